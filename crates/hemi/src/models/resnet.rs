//! Residual networks: torchvision's ImageNet family (`resnet18`, `resnet34`, `resnet50`,
//! with torchvision's `state_dict` names and order) and the CIFAR ResNets of He et al. 2016
//! §4.2 (`resnet20`, `resnet32`, `resnet56`, with parameter-free option-A shortcuts).
//!
//! ImageNet layout (torchvision, ResNet v1.5): 7×7/2 conv (no bias), BN, ReLU, 3×3/2
//! max-pool with padding 1, four stages of 64/128/256/512 channels (×4 after a Bottleneck)
//! with stride 2 at the first block of stages 2–4 (on the 3×3 conv of a Bottleneck), global
//! average pool, fc. A block whose output shape differs from its input adds its input
//! through `downsample` = 1×1 strided conv (no bias) + BN.
//!
//! CIFAR layout (He et al. §4.2): 3×3 conv 16 channels (no bias), BN, ReLU, no max-pool,
//! three stages of `n` BasicBlocks with 16/32/64 channels (stride 2 at the first block of
//! stages 2–3), global average pool, fc; depth 6n+2. Option A shortcuts take
//! `x[:, :, ::2, ::2]` and append zero channels, so they have no parameters.
//!
//! Initialisation as torchvision: convs kaiming-normal with fan_out (std = √(2/(out·k·k))),
//! BN weight 1 and bias 0, fc PyTorch's Linear default; with `zero_init_residual` the last
//! BN of each block starts at weight 0, so every block starts as its shortcut.

use std::sync::Arc;

use crate::autograd::Segment;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{
    init, param, BatchNorm2d, Conv2d, Linear, MaxPool2d, Module, Replicate, Visit, Visitor,
    VisitorMut,
};
use crate::ops::conv::Conv2dOptions;
use crate::rng::Generator;
use crate::tensor::Tensor;

/// The architectures `resnet` and `ResNetConfig` know, by name.
pub const RESNET_ARCHS: [&str; 6] = [
    "resnet18", "resnet34", "resnet50", "resnet20", "resnet32", "resnet56",
];

/// The residual block of a network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Two 3×3 convs (`conv1`, `conv2`); expansion 1.
    Basic,
    /// 1×1 reduce, 3×3 (strided), 1×1 expand ×4 (`conv1`..`conv3`).
    Bottleneck,
}

impl BlockKind {
    /// Output channels of a block over its `planes`.
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// How a CIFAR ResNet's blocks that change shape add their input (He et al. §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CifarShortcut {
    /// Option A: stride-2 subsampling and zero-padded channels; no parameters (the paper's
    /// CIFAR networks).
    A,
    /// Option B: a 1×1 strided conv + BN projection (`downsample.0`, `downsample.1`), as the
    /// ImageNet networks.
    B,
}

/// What a block adds to its residual branch.
pub enum Shortcut {
    /// The input itself.
    Identity,
    /// Option A: `x[..., ::stride, ::stride]` between zero channels, `extra_channels / 2`
    /// before and the rest after (the placement of the widely used PyTorch CIFAR ResNet,
    /// `F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, p, p))`, so its weights carry over).
    Pad {
        /// The spatial subsampling step (2 where the stage halves the size).
        stride: usize,
        /// Zero channels appended in total: output channels minus input channels.
        extra_channels: usize,
    },
    /// torchvision's `downsample`: a 1×1 strided conv without bias, then BN.
    Projection {
        /// `downsample.0`: 1×1 convolution with the block's stride, no bias.
        conv: Conv2d,
        /// `downsample.1`: the BatchNorm after it.
        bn: BatchNorm2d,
    },
}

/// A residual block: `relu(bn_k(conv_k(…relu(bn1(conv1(x)))…)) + shortcut(x))`.
pub struct Block {
    /// Basic (two 3×3 convs) or Bottleneck (1×1, 3×3, 1×1).
    pub kind: BlockKind,
    /// (`conv{i+1}`, `bn{i+1}`) in order: two for Basic, three for Bottleneck.
    pub layers: Vec<(Conv2d, BatchNorm2d)>,
    /// How the block's input reaches its output.
    pub shortcut: Shortcut,
}

/// A conv without bias, initialised kaiming-normal fan_out (torchvision's ResNet init).
fn conv(
    in_ch: usize,
    out_ch: usize,
    k: usize,
    stride: usize,
    padding: usize,
    rng: &mut Generator,
) -> Result<Conv2d> {
    let weight = param(init::kaiming_normal_fan_out(&[out_ch, in_ch, k, k], rng)?)?;
    Ok(Conv2d {
        weight,
        bias: None,
        opts: Conv2dOptions::default().stride(stride).padding(padding),
        hook: None,
    })
}

impl Block {
    /// A block from `in_ch` channels to `planes · expansion` channels, its first spatial
    /// conv strided by `stride`. A shape change uses a projection shortcut unless
    /// `option_a` is set.
    fn new(
        kind: BlockKind,
        in_ch: usize,
        planes: usize,
        stride: usize,
        option_a: bool,
        zero_init_residual: bool,
        rng: &mut Generator,
    ) -> Result<Self> {
        let out_ch = planes * kind.expansion();
        let mut layers = match kind {
            BlockKind::Basic => vec![
                (
                    conv(in_ch, planes, 3, stride, 1, rng)?,
                    BatchNorm2d::new(planes)?,
                ),
                (
                    conv(planes, planes, 3, 1, 1, rng)?,
                    BatchNorm2d::new(planes)?,
                ),
            ],
            BlockKind::Bottleneck => vec![
                (
                    conv(in_ch, planes, 1, 1, 0, rng)?,
                    BatchNorm2d::new(planes)?,
                ),
                (
                    conv(planes, planes, 3, stride, 1, rng)?,
                    BatchNorm2d::new(planes)?,
                ),
                (
                    conv(planes, out_ch, 1, 1, 0, rng)?,
                    BatchNorm2d::new(out_ch)?,
                ),
            ],
        };
        if zero_init_residual {
            if let Some((_, bn)) = layers.last_mut() {
                bn.weight = param(Tensor::zeros(bn.weight.shape(), DType::F32)?)?;
            }
        }
        let shortcut = if stride == 1 && in_ch == out_ch {
            Shortcut::Identity
        } else if option_a {
            if out_ch < in_ch {
                return Err(Error::arg(
                    "ResNet",
                    format!("option-A shortcut cannot reduce {in_ch} to {out_ch} channels"),
                ));
            }
            Shortcut::Pad {
                stride,
                extra_channels: out_ch - in_ch,
            }
        } else {
            Shortcut::Projection {
                conv: conv(in_ch, out_ch, 1, stride, 0, rng)?,
                bn: BatchNorm2d::new(out_ch)?,
            }
        };
        Ok(Block {
            kind,
            layers,
            shortcut,
        })
    }

    /// What the block adds to its residual branch for input `x` ([N, C, H, W]).
    pub fn shortcut_forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.shortcut {
            Shortcut::Identity => Ok(x.clone()),
            Shortcut::Projection { conv, bn } => bn.forward_conv(x, conv),
            Shortcut::Pad {
                stride,
                extra_channels,
            } => {
                if x.rank() != 4 {
                    return Err(Error::shape(
                        "ResNet shortcut",
                        format!("expects [N, C, H, W], got {:?}", x.shape()),
                    ));
                }
                // A 1×1 max-pool with stride s is exactly x[:, :, ::s, ::s] (ceil(H/s)
                // rows, as the strided 3×3 conv with padding 1 gives), with a scatter
                // for its gradient.
                let s = if *stride > 1 {
                    x.max_pool2d((1, 1), (*stride, *stride), (0, 0))?
                } else {
                    x.clone()
                };
                if *extra_channels == 0 {
                    return Ok(s);
                }
                let zeros = |channels: usize| -> Result<Tensor> {
                    let mut shape = s.shape().to_vec();
                    shape[1] = channels;
                    Tensor::zeros(&shape, s.dtype())?.to_device(s.device())
                };
                let before = *extra_channels / 2;
                let (lo, hi) = (zeros(before)?, zeros(*extra_channels - before)?);
                Tensor::cat(&[&lo, &s, &hi], 1)
            }
        }
    }
}

impl Replicate for Block {
    fn replica(&self) -> Self {
        Block {
            kind: self.kind,
            layers: self
                .layers
                .iter()
                .map(|(c, b)| (c.replica(), b.replica()))
                .collect(),
            shortcut: match &self.shortcut {
                Shortcut::Identity => Shortcut::Identity,
                &Shortcut::Pad {
                    stride,
                    extra_channels,
                } => Shortcut::Pad {
                    stride,
                    extra_channels,
                },
                Shortcut::Projection { conv, bn } => Shortcut::Projection {
                    conv: conv.replica(),
                    bn: bn.replica(),
                },
            },
        }
    }
}

/// Which parts of a ResNet activation checkpointing (`autograd::checkpoint`) runs again in
/// the backward instead of keeping their activations: `ResNet::checkpoint`. The last block
/// (or stage) runs as usual: the backward starts with it, so its activations would be alive
/// then either way (PyTorch's `checkpoint_sequential` leaves its last segment alone too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResNetCheckpoint {
    /// Every residual block: the backward keeps each block's input (one activation per
    /// block) and holds one block's activations at a time.
    Blocks,
    /// Every stage (`layer1`..`layer4`): the backward keeps each stage's input and holds one
    /// stage's activations at a time (fewer kept tensors, a larger transient).
    Stages,
}

impl ResNetCheckpoint {
    /// The names `ResNet`'s `set_activation_checkpointing` takes, the default first.
    pub const NAMES: [&'static str; 2] = ["blocks", "stages"];

    /// The granularity named `name` (`blocks`, `stages`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "blocks" => Ok(ResNetCheckpoint::Blocks),
            "stages" => Ok(ResNetCheckpoint::Stages),
            other => Err(Error::arg(
                "activation checkpointing",
                format!(
                    "a ResNet checkpoints {}, not {other:?}",
                    Self::NAMES.join(" or ")
                ),
            )),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            ResNetCheckpoint::Blocks => "blocks",
            ResNetCheckpoint::Stages => "stages",
        }
    }
}

/// A stage's blocks (replicas) as one checkpointed segment, each block in its module scope.
struct Stage {
    name: &'static str,
    blocks: Vec<Block>,
}

impl Segment for Stage {
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor> {
        let mut x = inputs[0].clone();
        for (i, block) in self.blocks.iter().enumerate() {
            let _scope = crate::ops::scope::enter_index(self.name, i);
            x = block.forward(&x)?;
        }
        Ok(x)
    }
}

/// A block's last convolution costing at most this many multiply-adds per output value, and
/// writing at least twice as many channels as it reads, has its output computed again in
/// the backward instead of kept from the forward: the 1×1 64 → 256 convolutions that end a
/// ResNet-50's first-stage bottlenecks. Their outputs are
/// the network's largest activations (98 MiB each in F32 at batch 32, 224×224), and running
/// the three again costs about 1 % of a training step; every other convolution costs at
/// least twice as much per value and keeps its output.
const RECOMPUTE_MAX_MACS: usize = 64;

/// Whether `conv`'s output is computed again in the backward (`RECOMPUTE_MAX_MACS`).
fn recomputed(conv: &Conv2d) -> bool {
    let w = conv.weight.shape();
    w.len() == 4 && w[1] * w[2] * w[3] <= RECOMPUTE_MAX_MACS && w[0] >= 2 * w[1]
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // Each BN + ReLU with the next conv one fused op (the ReLU's output is not kept
        // for the backward but computed again there), and the last BN + shortcut + ReLU
        // one fused op (one pass, only its input and output kept).
        let Some(((conv, _), rest)) = self.layers.split_first() else {
            return Ok(x.clone());
        };
        let mut y = conv.forward(x)?;
        let mut bn = &self.layers[0].1;
        for (i, (conv, next_bn)) in rest.iter().enumerate() {
            if i + 1 == rest.len() && recomputed(conv) {
                // The last conv + BN + shortcut + ReLU as one op that keeps the conv's
                // input (a quarter of its output's size) and computes the output again.
                let a = bn.forward_act(&y, None, true)?;
                return next_bn.forward_conv_add_relu(&a, conv, &self.shortcut_forward(x)?);
            }
            y = bn.forward_relu_conv(&y, conv)?;
            bn = next_bn;
        }
        bn.forward_act(&y, Some(&self.shortcut_forward(x)?), true)
    }
}

/// torchvision's names: `conv1`, `bn1`, `conv2`, `bn2`... then `downsample.0` (conv) and
/// `downsample.1` (BN) for a projection shortcut.
impl Visit for Block {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        for (i, (conv, bn)) in self.layers.iter().enumerate() {
            v.child(&format!("conv{}", i + 1), conv);
            v.child(&format!("bn{}", i + 1), bn);
        }
        if let Shortcut::Projection { conv, bn } = &self.shortcut {
            v.child("downsample.0", conv);
            v.child("downsample.1", bn);
        }
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        // The fused BN + conv ops read the convolutions' weights directly, past their hooks.
        v.hide_layers();
        for (i, (conv, bn)) in self.layers.iter_mut().enumerate() {
            v.child(&format!("conv{}", i + 1), conv);
            v.child(&format!("bn{}", i + 1), bn);
        }
        if let Shortcut::Projection { conv, bn } = &mut self.shortcut {
            v.child("downsample.0", conv);
            v.child("downsample.1", bn);
        }
    }
}

/// A residual network; `layers[i]` is torchvision's `layer{i+1}`.
pub struct ResNet {
    /// The stem's convolution: 7×7/2 → 64 channels (ImageNet) or 3×3 → 16 (CIFAR), no bias.
    pub conv1: Conv2d,
    /// The stem's BatchNorm.
    pub bn1: BatchNorm2d,
    /// The ImageNet stem's 3×3/2 max-pool (padding 1); none in the CIFAR networks.
    pub maxpool: Option<MaxPool2d>,
    /// The stages: `layers[i][j]` is `layer{i+1}.{j}` in torchvision's names.
    pub layers: Vec<Vec<Block>>,
    /// The classifier: pooled features → `num_classes` logits.
    pub fc: Linear,
    /// Activation checkpointing of the blocks or the stages in training (`None`, the
    /// default: off). The same gradients either way; less memory, one more forward of
    /// the checkpointed parts per step.
    pub checkpoint: Option<ResNetCheckpoint>,
}

/// A configuration by architecture name (one of [`RESNET_ARCHS`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    /// The architecture, one of [`RESNET_ARCHS`] (`"resnet20"`, `"resnet50"`...).
    pub arch: String,
    /// Number of output classes (the width of `fc`).
    pub num_classes: usize,
    /// Start the last BN of each block at weight 0 (torchvision's `zero_init_residual`).
    pub zero_init_residual: bool,
}

impl ResNetConfig {
    /// The configuration of `arch` with `num_classes` outputs and torchvision's defaults
    /// (`zero_init_residual` off).
    pub fn new(arch: &str, num_classes: usize) -> Self {
        ResNetConfig {
            arch: arch.to_string(),
            num_classes,
            zero_init_residual: false,
        }
    }

    /// The network, initialised from `rng`; an error names the known architectures when
    /// `arch` is not one of them.
    pub fn build(&self, rng: &mut Generator) -> Result<ResNet> {
        let (nc, zi) = (self.num_classes, self.zero_init_residual);
        match self.arch.as_str() {
            "resnet18" => ResNet::imagenet(BlockKind::Basic, [2, 2, 2, 2], nc, zi, rng),
            "resnet34" => ResNet::imagenet(BlockKind::Basic, [3, 4, 6, 3], nc, zi, rng),
            "resnet50" => ResNet::imagenet(BlockKind::Bottleneck, [3, 4, 6, 3], nc, zi, rng),
            "resnet20" => ResNet::cifar(3, nc, CifarShortcut::A, zi, rng),
            "resnet32" => ResNet::cifar(5, nc, CifarShortcut::A, zi, rng),
            "resnet56" => ResNet::cifar(9, nc, CifarShortcut::A, zi, rng),
            other => Err(Error::arg(
                "resnet",
                format!(
                    "unknown architecture {other:?}; known: {}",
                    RESNET_ARCHS.join(", ")
                ),
            )),
        }
    }
}

/// The ResNet named `name` (one of [`RESNET_ARCHS`]) with `num_classes` outputs.
pub fn resnet(name: &str, num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    ResNetConfig::new(name, num_classes).build(rng)
}

/// torchvision's `resnet18`: BasicBlocks [2, 2, 2, 2] (11,689,512 parameters at 1000 classes).
pub fn resnet18(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet18", num_classes, rng)
}

/// torchvision's `resnet34`: BasicBlocks [3, 4, 6, 3] (21,797,672 parameters at 1000 classes).
pub fn resnet34(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet34", num_classes, rng)
}

/// torchvision's `resnet50`: Bottlenecks [3, 4, 6, 3] (25,557,032 parameters at 1000 classes).
pub fn resnet50(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet50", num_classes, rng)
}

/// He et al.'s CIFAR ResNet-20 (n = 3), option-A shortcuts (269,722 parameters at 10 classes).
pub fn resnet20(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet20", num_classes, rng)
}

/// He et al.'s CIFAR ResNet-32 (n = 5), option-A shortcuts.
pub fn resnet32(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet32", num_classes, rng)
}

/// He et al.'s CIFAR ResNet-56 (n = 9), option-A shortcuts.
pub fn resnet56(num_classes: usize, rng: &mut Generator) -> Result<ResNet> {
    resnet("resnet56", num_classes, rng)
}

fn check_classes(num_classes: usize) -> Result<()> {
    if num_classes == 0 {
        return Err(Error::arg("ResNet", "num_classes must be > 0"));
    }
    Ok(())
}

impl ResNet {
    /// torchvision's ImageNet ResNet with `blocks[i]` blocks in stage `i`.
    pub fn imagenet(
        kind: BlockKind,
        blocks: [usize; 4],
        num_classes: usize,
        zero_init_residual: bool,
        rng: &mut Generator,
    ) -> Result<Self> {
        check_classes(num_classes)?;
        let conv1 = conv(3, 64, 7, 2, 3, rng)?;
        let bn1 = BatchNorm2d::new(64)?;
        let mut in_ch = 64;
        let mut layers = Vec::new();
        for (stage, (&n, planes)) in blocks.iter().zip([64, 128, 256, 512]).enumerate() {
            let stride = if stage == 0 { 1 } else { 2 };
            let mut layer = Vec::new();
            for b in 0..n {
                let s = if b == 0 { stride } else { 1 };
                layer.push(Block::new(
                    kind,
                    in_ch,
                    planes,
                    s,
                    false,
                    zero_init_residual,
                    rng,
                )?);
                in_ch = planes * kind.expansion();
            }
            layers.push(layer);
        }
        Ok(ResNet {
            conv1,
            bn1,
            maxpool: Some(MaxPool2d {
                kernel: (3, 3),
                stride: (2, 2),
                padding: (1, 1),
            }),
            layers,
            fc: Linear::new(in_ch, num_classes, true, rng)?,
            checkpoint: None,
        })
    }

    /// He et al.'s CIFAR ResNet of depth 6n+2: three stages of `n` BasicBlocks.
    pub fn cifar(
        n: usize,
        num_classes: usize,
        shortcut: CifarShortcut,
        zero_init_residual: bool,
        rng: &mut Generator,
    ) -> Result<Self> {
        check_classes(num_classes)?;
        if n == 0 {
            return Err(Error::arg(
                "ResNet",
                "a CIFAR ResNet needs n >= 1 blocks per stage",
            ));
        }
        let conv1 = conv(3, 16, 3, 1, 1, rng)?;
        let bn1 = BatchNorm2d::new(16)?;
        let mut in_ch = 16;
        let mut layers = Vec::new();
        for (stage, planes) in [16, 32, 64].into_iter().enumerate() {
            let stride = if stage == 0 { 1 } else { 2 };
            let mut layer = Vec::new();
            for b in 0..n {
                let s = if b == 0 { stride } else { 1 };
                layer.push(Block::new(
                    BlockKind::Basic,
                    in_ch,
                    planes,
                    s,
                    shortcut == CifarShortcut::A,
                    zero_init_residual,
                    rng,
                )?);
                in_ch = planes;
            }
            layers.push(layer);
        }
        Ok(ResNet {
            conv1,
            bn1,
            maxpool: None,
            layers,
            fc: Linear::new(in_ch, num_classes, true, rng)?,
            checkpoint: None,
        })
    }

    /// The features before `fc`: [N, C] after the global average pool.
    pub fn features(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 4 {
            return Err(Error::shape(
                "ResNet",
                format!("expects images [N, C, H, W], got {:?}", x.shape()),
            ));
        }
        let mut x = match &self.maxpool {
            Some(pool) => self.bn1.forward_conv_relu_max_pool(x, &self.conv1, pool)?,
            None => self.bn1.forward_act(&self.conv1.forward(x)?, None, true)?,
        };
        const LAYERS: [&str; 4] = ["layer1", "layer2", "layer3", "layer4"];
        let checkpoint = self
            .checkpoint
            .filter(|_| crate::autograd::is_grad_enabled());
        // The last segment runs as usual (as `checkpoint_sequential`'s does): the backward
        // starts with it, so recomputing it would hold the same activations at the same
        // moment, one forward of it later.
        let last_stage = self.layers.len().saturating_sub(1);
        for (l, layer) in self.layers.iter().enumerate() {
            if checkpoint == Some(ResNetCheckpoint::Stages) && l < last_stage {
                let stage = Stage {
                    name: LAYERS[l.min(3)],
                    blocks: layer.iter().map(Block::replica).collect(),
                };
                x = crate::autograd::checkpoint(Arc::new(stage), &[&x])?;
                continue;
            }
            for (i, block) in layer.iter().enumerate() {
                let _scope = crate::ops::scope::enter_index(LAYERS[l.min(3)], i);
                let last = l == last_stage && i + 1 == layer.len();
                x = match checkpoint {
                    Some(ResNetCheckpoint::Blocks) if !last => crate::nn::checkpoint(block, &x)?,
                    _ => block.forward(&x)?,
                };
            }
        }
        x.adaptive_avg_pool2d((1, 1))?.flatten(1, -1)
    }
}

impl Module for ResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc.forward(&self.features(x)?)
    }

    fn set_activation_checkpointing(&mut self, granularity: Option<&str>) -> Result<()> {
        self.checkpoint = granularity.map(ResNetCheckpoint::parse).transpose()?;
        Ok(())
    }

    fn checkpoint_granularities(&self) -> &'static [&'static str] {
        &ResNetCheckpoint::NAMES
    }
}

/// torchvision's names: `conv1`, `bn1`, `layer{i}.{j}` (the blocks), `fc`.
impl Visit for ResNet {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("conv1", &self.conv1);
        v.child("bn1", &self.bn1);
        for (i, layer) in self.layers.iter().enumerate() {
            for (j, block) in layer.iter().enumerate() {
                v.child(&format!("layer{}.{j}", i + 1), block);
            }
        }
        v.child("fc", &self.fc);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        // Not quantisable: the stem's and the blocks' fused ops read the convolutions'
        // weights directly, past their hooks (and hooking only `fc` would leave it float).
        v.hide_layers();
        v.child("conv1", &mut self.conv1);
        v.child("bn1", &mut self.bn1);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (j, block) in layer.iter_mut().enumerate() {
                v.child(&format!("layer{}.{j}", i + 1), block);
            }
        }
        v.child("fc", &mut self.fc);
    }
}
