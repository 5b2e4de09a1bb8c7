//! A model of your own and a training loop of your own: `TinyNet` implements hemi's `Module`
//! over weight tensors it owns (plus a `BatchNorm2d` child, to show how children's tensors
//! are named; its `Visit` describes them once, and `state_dict`, `to_dtype`,
//! `set_training`... follow from it), and `main` trains it with AdamW (no weight decay on biases and norms), a
//! linear warm-up then cosine schedule stepped per batch, autocast F16 with a `GradScaler`,
//! and gradient clipping on the unscaled gradients — the pieces `hemi::train` puts
//! together, used directly.
//!
//! ```text
//! cargo run --release -p hemi --example custom_model
//! ```

use std::sync::Arc;
use std::time::Instant;

use hemi::amp::{autocast, GradScaler, GradScalerConfig};
use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
use hemi::nn::init::{bias_uniform, kaiming_uniform_default};
use hemi::nn::{BatchNorm2d, Module, Visit, Visitor, VisitorMut};
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::loss::cross_entropy;
use hemi::optim::{clip_grad_norm, no_decay_mask, Optimizer};
use hemi::optim::{AdamW, AdamWConfig, CosineAnnealingLR, LinearWarmup, Scheduler};
use hemi::{DType, Generator, Result, Tensor};

/// conv 3→16 3×3 + ReLU + max-pool 2 (one fused op), conv 16→32 3×3, BatchNorm, ReLU,
/// max-pool 2, linear 32·6·6 → 10, for 3×32×32 images. The weights are plain tensors
/// marked as parameters: nothing from `hemi::nn` but the BatchNorm.
struct TinyNet {
    conv1_w: Tensor, // [16, 3, 3, 3]
    conv1_b: Tensor, // [16]
    conv2_w: Tensor, // [32, 16, 3, 3]
    conv2_b: Tensor, // [32]
    bn: BatchNorm2d, // over conv2's 32 channels; mixed-precision presets keep it F32
    fc_w: Tensor,    // [10, 1152]
    fc_b: Tensor,    // [10]
}

impl TinyNet {
    fn new(rng: &mut Generator) -> Result<TinyNet> {
        // PyTorch's default initialisation, as nn::Conv2d and nn::Linear use it.
        let weight = |shape: &[usize], fan_in: usize, rng: &mut Generator| -> Result<Tensor> {
            Ok(kaiming_uniform_default(shape, fan_in, rng)?.requires_grad_())
        };
        let bias = |n: usize, fan_in: usize, rng: &mut Generator| -> Result<Tensor> {
            Ok(bias_uniform(n, fan_in, rng)?.requires_grad_())
        };
        Ok(TinyNet {
            conv1_w: weight(&[16, 3, 3, 3], 27, rng)?,
            conv1_b: bias(16, 27, rng)?,
            conv2_w: weight(&[32, 16, 3, 3], 144, rng)?,
            conv2_b: bias(32, 144, rng)?,
            bn: BatchNorm2d::new(32)?,
            fc_w: weight(&[10, 32 * 6 * 6], 1152, rng)?,
            fc_b: bias(10, 1152, rng)?,
        })
    }
}

impl Module for TinyNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let opts = Conv2dOptions::default();
        // [B, 3, 32, 32] -> [B, 16, 15, 15]
        let h = x.conv2d_relu_max_pool2(&self.conv1_w, Some(&self.conv1_b), opts)?;
        // -> [B, 32, 13, 13] -> [B, 32, 6, 6]
        let h = h.conv2d(&self.conv2_w, Some(&self.conv2_b), opts)?;
        let h = self.bn.forward(&h)?.relu()?;
        let h = h.max_pool2d((2, 2), (2, 2), (0, 0))?;
        // -> [B, 1152] -> [B, 10]
        h.flatten(1, -1)?.linear(&self.fc_w, Some(&self.fc_b))
    }
}

/// The state_dict: PyTorch-style names, the child's under `bn.`. `visit_mut` shows the same
/// tensors mutable (for casts and `load_state_dict`); the child's `visit` shows its training
/// flag too, so `set_training` reaches the BatchNorm.
impl Visit for TinyNet {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.param("conv1.weight", &self.conv1_w);
        v.param("conv1.bias", &self.conv1_b);
        v.param("conv2.weight", &self.conv2_w);
        v.param("conv2.bias", &self.conv2_b);
        v.child("bn", &self.bn);
        v.param("fc.weight", &self.fc_w);
        v.param("fc.bias", &self.fc_b);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.param("conv1.weight", &mut self.conv1_w);
        v.param("conv1.bias", &mut self.conv1_b);
        v.param("conv2.weight", &mut self.conv2_w);
        v.param("conv2.bias", &mut self.conv2_b);
        v.child("bn", &mut self.bn);
        v.param("fc.weight", &mut self.fc_w);
        v.param("fc.bias", &mut self.fc_b);
    }
}

fn main() -> Result<()> {
    const EPOCHS: u64 = 3;
    let loader = |split, len, shuffle| -> Result<DataLoader> {
        DataLoader::new(
            Arc::new(Synthetic::try_generate(0, split, len)?),
            LoaderConfig {
                batch_size: 64,
                shuffle,
                transform: Transform::new().normalize(&[0.5], &[0.5]),
                ..Default::default()
            },
        )
    };
    let (train, test) = (
        loader(Split::Train, 2560, true)?,
        loader(Split::Test, 500, false)?,
    );

    let mut net = TinyNet::new(&mut Generator::new(0))?;
    println!("TinyNet: {} parameters", net.num_parameters());
    for (name, t) in net.state_dict() {
        println!("  {name:<24} {:?} {}", t.shape(), t.dtype());
    }

    let params = net.parameters();
    let decay = no_decay_mask(&params); // weight decay on weights of rank >= 2 only
    let mut opt = AdamW::new(
        params,
        AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.05,
            ..Default::default()
        },
    )?;
    opt.set_weight_decay_mask(&decay)?;
    // Per batch: 10 % linear warm-up from lr/10, then cosine down to 0 at the last step.
    let steps = EPOCHS * train.num_batches() as u64;
    let warmup = steps / 10;
    let cosine = CosineAnnealingLR {
        t_max: steps - warmup,
        eta_min: 0.0,
    };
    let mut sched = Scheduler::new(LinearWarmup::new(warmup, 0.1).then(cosine), &mut opt)?;
    let mut scaler = GradScaler::new(GradScalerConfig::default())?;

    let start = Instant::now();
    for epoch in 0..EPOCHS {
        net.set_training(true);
        let (mut loss_sum, mut norm_sum, mut clipped) = (0.0, 0.0, 0);
        for batch in train.epoch(epoch) {
            let batch = batch?;
            opt.zero_grad();
            let loss = {
                let _ac = autocast(DType::F16);
                cross_entropy(
                    &net.forward(batch.images()?)?,
                    &batch.labels,
                    Default::default(),
                )?
            };
            scaler.scale(&loss)?.backward()?;
            scaler.unscale_(&opt)?; // true gradients from here on
            let norm = clip_grad_norm(opt.params(), 5.0, 2.0)?; // total 2-norm, before clipping
            norm_sum += norm;
            clipped += usize::from(norm > 5.0);
            scaler.step(&mut opt)?;
            scaler.update()?;
            sched.step(&mut opt);
            loss_sum += loss.to_scalar()?;
        }
        let acc = accuracy(&mut net, &test)?;
        println!(
            "epoch {}: train loss {:.3}, test accuracy {:.1} %, lr now {:.2e}, mean gradient \
             norm {:.2} ({clipped} of {} steps clipped to 5), loss scale {}",
            epoch + 1,
            loss_sum / train.num_batches() as f64,
            100.0 * acc,
            opt.lr(),
            norm_sum / train.num_batches() as f64,
            train.num_batches(),
            scaler.get_scale()
        );
    }
    println!(
        "{} steps in {:.1} s, {} skipped",
        steps,
        start.elapsed().as_secs_f64(),
        scaler.skipped_steps()
    );
    Ok(())
}

/// Fraction of `test` classified correctly, in eval mode (BatchNorm's running statistics)
/// and without recording gradients, under the same autocast as training.
fn accuracy(net: &mut TinyNet, test: &DataLoader) -> Result<f64> {
    net.set_training(false);
    let _g = hemi::no_grad();
    let _ac = autocast(DType::F16);
    let (mut correct, mut total) = (0, 0);
    for batch in test.epoch(0) {
        let batch = batch?;
        let predicted = net.forward(batch.images()?)?.argmax(1, false)?.to_vec_i64();
        let labels = batch.labels.to_vec_i64();
        correct += predicted
            .iter()
            .zip(&labels)
            .filter(|(p, l)| p == l)
            .count();
        total += labels.len();
    }
    Ok(correct as f64 / total.max(1) as f64)
}
