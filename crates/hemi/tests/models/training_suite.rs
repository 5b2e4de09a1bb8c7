// The training steps of `naive.rs` as functions of the backend `BACKEND`, which the file
// that includes this one (`include!`) defines: `naive.rs` (the naive backend) and
// `../gpu/models.rs` (the wgpu backend). The tolerance rule is written at the top of
// `naive.rs`.

use std::path::Path;

use hemi::amp::{AmpOptimizer, GradScalerConfig, Precision};
use hemi::models::{resnet20, BertForSequenceClassification, CifarNet, ResNet};
use hemi::nn::Module;
use hemi::ops::loss::{cross_entropy, mse_loss, CrossEntropyOptions, Reduction};
use hemi::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use hemi::{no_grad, DType, Device, Generator, Result, Tensor};

const STEPS: usize = 3;

/// The optimizers the steps run.
#[derive(Clone, Copy, Debug)]
enum Opt {
    /// SGD with momentum 0.9 and weight decay.
    Sgd { lr: f64 },
    /// Adam.
    Adam { lr: f64 },
}

impl Opt {
    fn build(self) -> impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
        move |params| {
            Ok(match self {
                Opt::Sgd { lr } => Box::new(Sgd::new(
                    params,
                    SgdConfig {
                        lr,
                        momentum: 0.9,
                        weight_decay: 5e-4,
                        ..Default::default()
                    },
                )?) as Box<dyn Optimizer>,
                Opt::Adam { lr } => Box::new(Adam::new(
                    params,
                    AdamConfig {
                        lr,
                        ..Default::default()
                    },
                )?),
            })
        }
    }

    /// The extra allowance of the weights after `k` steps: Adam's sign noise, SGD's steps
    /// along gradients computed in a lower precision.
    fn slack(self, k: usize, compute: DType, depth: Depth) -> f64 {
        match self {
            // Each step moves a weight by `lr · g`, the gradients computed in `compute`
            // (BF16 under amp-bf16): their difference, the rule's factor of a gradient of
            // order 1, times `lr`, per step.
            Opt::Sgd { lr } => k as f64 * lr * tolerance(compute, depth, 0),
            Opt::Adam { lr } => 2.0 * k as f64 * lr,
        }
    }
}

/// The numbers the rule needs: layers through which a value is rounded, and the longest sum.
#[derive(Clone, Copy, Debug)]
struct Depth {
    layers: usize,
    terms: usize,
}

/// The rule's factor of the scale for `dtype` after `k` steps.
fn tolerance(dtype: DType, depth: Depth, k: usize) -> f64 {
    let eps = |d: DType| d.finfo().unwrap().epsilon;
    let c = dtype.compute_type();
    4.0 * (k + 1) as f64 * (depth.layers as f64 * eps(dtype) + depth.terms as f64 * eps(c))
}

#[track_caller]
fn agree(what: &str, cpu: &[f64], other: &[f64], tol: f64, slack: f64) {
    assert_eq!(cpu.len(), other.len(), "{what}: lengths");
    let scale = cpu.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let bound = tol * scale + slack;
    let (mut worst, mut at) = (0.0f64, 0);
    for (i, (c, n)) in cpu.iter().zip(other).enumerate() {
        let err = (c - n).abs();
        if err.is_nan() || err > worst {
            (worst, at) = (if err.is_nan() { f64::INFINITY } else { err }, i);
        }
    }
    assert!(
        worst <= bound,
        "{what}: element {at} of {}: cpu {}, {BACKEND} {} (|err| {worst:.3e} > {bound:.3e})",
        cpu.len(),
        cpu[at],
        other[at]
    );
}

/// What a few training steps recorded on one device.
struct Trained {
    /// The first batch's logits (as F64).
    logits: Vec<f64>,
    losses: Vec<f64>,
    /// Steps taken (a loss scaler skips a step whose gradients overflowed).
    stepped: usize,
    /// The batches (0-based) whose step the loss scaler skipped.
    skipped: Vec<usize>,
    state: Named<Vec<f64>>,
}

/// A batch: model input and I64 class labels.
type Batch = (Tensor, Tensor);

/// Values by the name of their parameter or buffer.
type Named<T> = Vec<(String, T)>;

/// A parameter's gradient, if it got one.
type Grad = Option<Vec<f64>>;

/// Training steps of `model` moved to `device`, under `precision` with `opt`, one per
/// batch: forward under autocast, cross-entropy, the scaled backward, the step. The loss
/// scaler starts at 1024.
fn train(
    model: Box<dyn Module>,
    device: Device,
    precision: Precision,
    opt: Opt,
    batches: &[Batch],
) -> Result<Trained> {
    let scaler = GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    };
    train_scaled(model, device, precision, opt, batches, scaler)
}

/// `train` with the loss scaler's settings `scaler`.
fn train_scaled(
    mut model: Box<dyn Module>,
    device: Device,
    precision: Precision,
    opt: Opt,
    batches: &[Batch],
    scaler: GradScalerConfig,
) -> Result<Trained> {
    model.to_device(device)?;
    precision.prepare_model(model.as_mut())?;
    let mut optimizer = AmpOptimizer::new(precision, model.parameters(), scaler, 7, opt.build())?;
    let (mut logits, mut losses, mut stepped, mut skipped) = (Vec::new(), Vec::new(), 0, Vec::new());
    for (i, (x, y)) in batches.iter().enumerate() {
        let (x, y) = (x.to_device(device)?, y.to_device(device)?);
        optimizer.zero_grad();
        let (out, loss) = {
            let _ac = precision.autocast();
            let out = model.forward(&precision.input(&x)?)?;
            let loss = cross_entropy(&out, &y, CrossEntropyOptions::default())?;
            (out, loss)
        };
        assert_eq!(loss.device(), device);
        if i == 0 {
            logits = out.to_vec_f64();
        }
        losses.push(loss.to_scalar()?);
        optimizer.backward(&loss)?;
        optimizer.unscale()?;
        if optimizer.step()? {
            stepped += 1;
        } else {
            skipped.push(i);
        }
    }
    let state = model
        .state_dict()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.device(), device, "{name} left {device}");
            (name, t.to_vec_f64())
        })
        .collect();
    Ok(Trained {
        logits,
        losses,
        stepped,
        skipped,
        state,
    })
}

/// Trains a model made by `build` (called once per device with the same seed) on both
/// devices and compares what they recorded.
fn same_training(
    what: &str,
    build: impl Fn() -> Result<Box<dyn Module>>,
    precision: Precision,
    opt: Opt,
    batches: &[Batch],
    depth: Depth,
) {
    same_training_of(what, build, precision, opt, batches, depth, true)
}

/// `same_training` without the weights after the steps: the first logits, every loss,
/// the steps taken and skipped. (Only the GPU's suite needs it.)
#[allow(dead_code)]
fn same_losses(
    what: &str,
    build: impl Fn() -> Result<Box<dyn Module>>,
    precision: Precision,
    opt: Opt,
    batches: &[Batch],
    depth: Depth,
) {
    same_training_of(what, build, precision, opt, batches, depth, false)
}

fn same_training_of(
    what: &str,
    build: impl Fn() -> Result<Box<dyn Module>>,
    precision: Precision,
    opt: Opt,
    batches: &[Batch],
    depth: Depth,
    weights: bool,
) {
    let run = |device| {
        train(build().unwrap(), device, precision, opt, batches)
            .unwrap_or_else(|e| panic!("{what} on {device}: {e}"))
    };
    let (cpu, other) = (run(Device::Cpu), run(BACKEND));
    let dtype = precision.compute_dtype();
    agree(
        &format!("{what}: first logits"),
        &cpu.logits,
        &other.logits,
        tolerance(dtype, depth, 0),
        0.0,
    );
    assert_eq!(cpu.stepped, other.stepped, "{what}: steps taken");
    assert_eq!(cpu.skipped, other.skipped, "{what}: the steps the scaler skipped");
    for (k, (c, n)) in cpu.losses.iter().zip(&other.losses).enumerate() {
        agree(
            &format!("{what}: loss {k}"),
            &[*c],
            &[*n],
            tolerance(dtype, depth, k),
            0.0,
        );
    }
    for ((name, c), (name_n, n)) in cpu.state.iter().zip(&other.state).filter(|_| weights) {
        assert_eq!(name, name_n);
        agree(
            &format!("{what}: {name} after {STEPS} steps"),
            c,
            n,
            tolerance(precision.weight_dtype(), depth, STEPS),
            opt.slack(STEPS, dtype, depth),
        );
    }
}

/// `STEPS` batches of `n` random images `[3, size, size]` and labels in `0..classes`.
fn image_batches(n: usize, size: usize, classes: u64, seed: u64) -> Vec<Batch> {
    let mut rng = Generator::new(seed);
    (0..STEPS)
        .map(|_| {
            let x = Tensor::randn(&[n, 3, size, size], 0.0, 1.0, DType::F32, &mut rng).unwrap();
            let y: Vec<i64> = (0..n).map(|_| rng.below(classes) as i64).collect();
            (x, Tensor::from_vec(y, &[n]).unwrap())
        })
        .collect()
}

fn cifar_net() -> Result<Box<dyn Module>> {
    Ok(Box::new(CifarNet::cifar10(&mut Generator::new(31))?))
}

fn resnet() -> Result<Box<dyn Module>> {
    Ok(Box::new(resnet20(10, &mut Generator::new(32))?))
}

/// CifarNet: two conv + ReLU + pool blocks and two linear layers; fc1 sums 128·6·6 terms.
const CIFAR_NET: Depth = Depth {
    layers: 4,
    terms: 4608,
};

/// ResNet-20: 19 convolutions and their norms in a chain, the longest sum a batch norm's
/// statistics or a weight gradient over the batch and the pixels.
const RESNET20: Depth = Depth {
    layers: 40,
    terms: 2 * 32 * 32,
};

/// The tiny BERT fixture (2 layers, hidden 32, 4 heads, 101 tokens, 3 labels).
fn bert() -> Result<Box<dyn Module>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert/tiny/cls");
    let model =
        BertForSequenceClassification::from_pretrained(&dir, None, &mut Generator::new(33))?;
    Ok(Box::new(model))
}

/// `STEPS` batches of `n` sequences of `len` token ids (CLS first) and labels in `0..3`.
fn token_batches(n: usize, len: usize, seed: u64) -> Vec<Batch> {
    let mut rng = Generator::new(seed);
    (0..STEPS)
        .map(|_| {
            let ids: Vec<i64> = (0..n * len)
                .map(|i| {
                    if i % len == 0 {
                        2
                    } else {
                        3 + rng.below(98) as i64
                    }
                })
                .collect();
            let y: Vec<i64> = (0..n).map(|_| rng.below(3) as i64).collect();
            (
                Tensor::from_vec(ids, &[n, len]).unwrap(),
                Tensor::from_vec(y, &[n]).unwrap(),
            )
        })
        .collect()
}

/// BERT: 2 layers of attention and feed-forward, each with its norms (about 6 roundings a
/// layer), the longest sum the feed-forward's inner width or the batch's tokens.
const BERT: Depth = Depth {
    layers: 16,
    terms: 64,
};

// ----- what runs before the merge: the bodies of the CNNs, forward and backward ----------

/// The parameters' gradients (and the outputs) of `body` on `device` for one batch, with a
/// random output gradient (the same on every device).
fn body_grads<M: Module>(
    mut model: M,
    device: Device,
    precision: Precision,
    x: &Tensor,
    body: impl Fn(&M, &Tensor) -> Result<Tensor>,
) -> Result<(Vec<f64>, Named<Grad>)> {
    model.to_device(device)?;
    precision.prepare_model(&mut model)?;
    let x = precision.input(&x.to_device(device)?)?;
    let out = {
        let _ac = precision.autocast();
        body(&model, &x)?
    };
    assert_eq!(out.device(), device);
    let mut rng = Generator::new(9);
    let g = Tensor::randn(out.shape(), 0.0, 1.0, out.dtype(), &mut rng)?.to_device(device)?;
    hemi::autograd::backward_with(&out, g)?;
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let g = p.grad().map(|g| {
                assert_eq!(g.device(), device, "{name}'s gradient");
                g.to_vec_f64()
            });
            (name, g)
        })
        .collect();
    Ok((out.to_vec_f64(), grads))
}

fn same_body<M: Module>(
    what: &str,
    build: impl Fn() -> Result<M>,
    precision: Precision,
    x: &Tensor,
    depth: Depth,
    body: impl Fn(&M, &Tensor) -> Result<Tensor> + Copy,
) {
    let run = |device| {
        body_grads(build().unwrap(), device, precision, x, body)
            .unwrap_or_else(|e| panic!("{what} on {device}: {e}"))
    };
    let ((yc, gc), (yn, gn)) = (run(Device::Cpu), run(BACKEND));
    let tol = tolerance(precision.compute_dtype(), depth, 0);
    agree(&format!("{what}: output"), &yc, &yn, tol, 0.0);
    for ((name, c), (_, n)) in gc.iter().zip(&gn) {
        match (c, n) {
            (Some(c), Some(n)) => agree(&format!("{what}: d {name}"), c, n, tol, 0.0),
            (None, None) => {}
            _ => panic!("{what}: {name} has a gradient on one device only"),
        }
    }
}
