//! The training loop of the documents' recipe: epochs over a `DataLoader`, a loss logged
//! every `log_every` batches, test accuracy after every epoch, and a checkpoint after every
//! epoch from which `resume` continues bit-identically (the loader's order is a function of
//! (seed, epoch), and the checkpoint holds the model, the optimizer state and the epoch).
//!
//! The loop reports through `Event`s; the CLI turns them into a progress bar, log lines and
//! a metrics file.

mod checkpoint;

use std::path::PathBuf;
use std::time::Instant;

pub use checkpoint::{load_checkpoint, save_checkpoint, Checkpoint, RunInfo};

use crate::amp::{AmpOptimizer, GradScalerConfig, Precision};
use crate::data::DataLoader;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::ops::loss::{cross_entropy, CrossEntropyOptions};
use crate::optim::{Adam, AdamConfig, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use crate::tensor::Tensor;

/// Which optimizer to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    Adam,
    AdamW,
}

impl OptimizerKind {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        }
    }
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "sgd" => Ok(OptimizerKind::Sgd),
            "adam" => Ok(OptimizerKind::Adam),
            "adamw" => Ok(OptimizerKind::AdamW),
            _ => Err(Error::arg(
                "optimizer",
                format!("unknown optimizer {s:?} (sgd, adam, adamw)"),
            )),
        }
    }
}

/// The training recipe. Defaults are the documents': SGD, lr 0.001, momentum 0.9,
/// 10 epochs, the loss logged every 200 batches.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub epochs: usize,
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    /// `None`: the optimizer's default (0 for SGD and Adam, 0.01 for AdamW).
    pub weight_decay: Option<f64>,
    pub log_every: usize,
    /// Where a checkpoint is written after every epoch.
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from the checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// Stop after this many epochs in total (as if interrupted), keeping the checkpoint.
    pub stop_after: Option<usize>,
    /// The precision preset (default amp-fp16, the documents' mode).
    pub precision: Precision,
    /// The loss scaler's settings (amp-fp16 and fp16-master).
    pub scaler: GradScalerConfig,
    /// Count, per parameter, the unscaled gradient values that F16 could not hold
    /// (|g| < 2^-24 underflows, |g| > 65504 overflows); reported in the summary.
    pub grad_stats: bool,
    /// Seed of the stochastic-rounding stream (pure-bf16).
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 10,
            optimizer: OptimizerKind::Sgd,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: None,
            log_every: 200,
            checkpoint_dir: None,
            resume: false,
            stop_after: None,
            precision: Precision::AmpFp16,
            scaler: GradScalerConfig::default(),
            grad_stats: false,
            seed: 0,
        }
    }
}

/// Builds the configured optimizer over `params`.
pub fn build_optimizer(cfg: &TrainConfig, params: Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
    Ok(match cfg.optimizer {
        OptimizerKind::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                lr: cfg.lr,
                momentum: cfg.momentum,
                weight_decay: cfg.weight_decay.unwrap_or(0.0),
                ..Default::default()
            },
        )?),
        OptimizerKind::Adam => Box::new(Adam::new(
            params,
            AdamConfig {
                lr: cfg.lr,
                weight_decay: cfg.weight_decay.unwrap_or(0.0),
                ..Default::default()
            },
        )?),
        OptimizerKind::AdamW => {
            let d = AdamWConfig::default();
            Box::new(AdamW::new(
                params,
                AdamWConfig {
                    lr: cfg.lr,
                    weight_decay: cfg.weight_decay.unwrap_or(d.weight_decay),
                    ..d
                },
            )?)
        }
    })
}

/// What the loop reports.
#[derive(Clone, Debug)]
pub enum Event {
    /// The run starts (or resumes) at `first_epoch` (1-based) of `epochs`.
    Start {
        first_epoch: usize,
        epochs: usize,
        batches_per_epoch: usize,
    },
    /// A batch finished.
    Batch {
        epoch: usize,
        batch: usize,
        loss: f64,
        images: usize,
        /// The loss scale after this step (1.0 where the preset does not scale).
        scale: f64,
        /// Steps skipped so far (inf/NaN gradients).
        skipped: u64,
    },
    /// Every `log_every` batches: the mean loss since the last log line.
    Log {
        epoch: usize,
        step: usize,
        loss: f64,
        lr: f64,
        images_per_s: f64,
        scale: f64,
        skipped: u64,
    },
    /// An epoch finished and the test set was evaluated.
    Epoch {
        epoch: usize,
        train_loss: f64,
        test_accuracy: f64,
        seconds: f64,
        images_per_s: f64,
    },
}

/// What a run achieved.
#[derive(Clone, Debug)]
pub struct Summary {
    pub precision: Precision,
    /// Optimizer steps taken in this run (including skipped ones) and how many were skipped.
    pub steps: u64,
    pub skipped_steps: u64,
    /// The loss scale at the end (1.0 where the preset does not scale).
    pub final_scale: f64,
    /// Per-parameter F16 range counts (with `grad_stats`).
    pub grad_stats: Vec<GradStat>,
    pub epochs_run: usize,
    pub last_epoch: usize,
    pub test_accuracy: f64,
    pub train_images: usize,
    pub train_seconds: f64,
}

/// How many of one parameter's unscaled gradient values F16 could not represent, summed
/// over the steps of a run (Micikevicius et al. 2018: without loss scaling, small gradients
/// flush to zero).
#[derive(Clone, Debug, PartialEq)]
pub struct GradStat {
    pub name: String,
    /// Gradient values seen (numel × steps).
    pub values: u64,
    /// Nonzero values with |g| < 2^-24, F16's smallest subnormal: they round to 0 or 2^-24.
    pub underflow: u64,
    /// Values with |g| > 65504, F16's largest finite value (inf and NaN included).
    pub overflow: u64,
}

impl GradStat {
    fn count(&mut self, grad: &Tensor) {
        const TINY: f32 = 5.960_464_5e-8; // 2^-24
        let v = grad.to_vec_f32();
        self.values += v.len() as u64;
        for g in v {
            let a = g.abs();
            if a > 65504.0 || a.is_nan() {
                self.overflow += 1;
            } else if a < TINY && a != 0.0 {
                self.underflow += 1;
            }
        }
    }
}

impl Summary {
    /// Fraction of steps skipped (0 when none ran).
    pub fn skipped_fraction(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.skipped_steps as f64 / self.steps as f64
        }
    }

    pub fn images_per_s(&self) -> f64 {
        if self.train_seconds > 0.0 {
            self.train_images as f64 / self.train_seconds
        } else {
            0.0
        }
    }
}

/// Accuracy (fraction correct) and mean loss of `model` on every sample of `loader`.
///
/// Runs in fp32 unless given a precision (`evaluate_with`).
pub fn evaluate(model: &mut dyn Module, loader: &DataLoader) -> Result<(f64, f64)> {
    evaluate_with(model, loader, Precision::Fp32)
}

/// `evaluate` with the forward pass of `precision` (its autocast scope and input dtype);
/// the model must already have the preset's weight dtype.
pub fn evaluate_with(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
) -> Result<(f64, f64)> {
    model.set_training(false);
    let _g = crate::autograd::no_grad();
    let (mut correct, mut total, mut loss_sum) = (0usize, 0usize, 0.0);
    for batch in loader.epoch(0) {
        let batch = batch?;
        let logits = {
            let _ac = precision.autocast();
            model.forward(&precision.input(&batch.images)?)?
        };
        let loss = cross_entropy(&logits, &batch.labels, CrossEntropyOptions::default())?;
        let pred = logits.argmax(1, false)?.to_vec_i64();
        let labels = batch.labels.to_vec_i64();
        correct += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
        total += labels.len();
        loss_sum += loss.to_scalar()? * labels.len() as f64;
    }
    model.set_training(true);
    if total == 0 {
        return Err(Error::arg("evaluate", "the test set is empty"));
    }
    Ok((correct as f64 / total as f64, loss_sum / total as f64))
}

/// Trains `model` on `train` for `cfg.epochs` epochs, evaluating on `test` after each.
/// `info` describes the run for checkpoints (model, data set, seed).
pub fn train(
    model: &mut dyn Module,
    train: &DataLoader,
    test: &DataLoader,
    cfg: &TrainConfig,
    info: &RunInfo,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary> {
    if cfg.log_every == 0 {
        return Err(Error::arg("train", "log_every must be > 0"));
    }
    let precision = cfg.precision;
    // The checkpoint records the precision the run actually uses.
    let info = &RunInfo {
        precision: precision.name().to_string(),
        ..info.clone()
    };
    precision.prepare_model(model)?;
    let mut opt = AmpOptimizer::new(
        precision,
        model.parameters(),
        cfg.scaler.clone(),
        cfg.seed,
        |params| build_optimizer(cfg, params),
    )?;
    let mut first_epoch = 1;
    if cfg.resume {
        let dir = cfg
            .checkpoint_dir
            .as_ref()
            .ok_or_else(|| Error::arg("train", "--resume needs a checkpoint directory"))?;
        let ck = load_checkpoint(dir)?;
        if ck.info.model != info.model {
            return Err(Error::Msg(format!(
                "{}: checkpoint is for model {:?}, not {:?}",
                dir.display(),
                ck.info.model,
                info.model
            )));
        }
        if ck.info.precision != info.precision {
            return Err(Error::Msg(format!(
                "{}: checkpoint was trained with precision {}, not {}; resume with the same \
                 --precision",
                dir.display(),
                ck.info.precision,
                info.precision
            )));
        }
        model.load_state_dict(&ck.model)?;
        opt.load_state_dict(&ck.optimizer, ck.scaler.as_ref())?;
        first_epoch = ck.epochs_done + 1;
    }
    let last = cfg.stop_after.map_or(cfg.epochs, |s| s.min(cfg.epochs));
    on_event(&Event::Start {
        first_epoch,
        epochs: cfg.epochs,
        batches_per_epoch: train.num_batches(),
    });
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut grad_stats: Vec<GradStat> = names
        .iter()
        .map(|n| GradStat {
            name: n.clone(),
            values: 0,
            underflow: 0,
            overflow: 0,
        })
        .collect();
    let (skipped_before, mut steps) = (opt.skipped_steps(), 0u64);
    let mut summary = Summary {
        precision,
        steps: 0,
        skipped_steps: 0,
        final_scale: opt.scale(),
        grad_stats: Vec::new(),
        epochs_run: 0,
        last_epoch: first_epoch.saturating_sub(1),
        test_accuracy: f64::NAN,
        train_images: 0,
        train_seconds: 0.0,
    };
    let ce = CrossEntropyOptions::default();
    /// Consecutive non-finite losses a loss-scaled run tolerates (each halves the scale).
    const MAX_BAD_LOSSES: usize = 50;
    let mut bad_losses = 0usize;
    model.set_training(true);
    for epoch in first_epoch..=last {
        let start = Instant::now();
        let (mut epoch_loss, mut epoch_batches, mut epoch_images) = (0.0, 0usize, 0usize);
        let (mut log_loss, mut log_batches, mut log_images, mut log_start) =
            (0.0, 0usize, 0usize, Instant::now());
        for (b, batch) in train.epoch(epoch as u64 - 1).enumerate() {
            let batch = batch?;
            opt.zero_grad();
            let loss = {
                let _ac = precision.autocast();
                let logits = model.forward(&precision.input(&batch.images)?)?;
                cross_entropy(&logits, &batch.labels, ce)?
            };
            let lv = loss.to_scalar()?;
            // Under loss scaling a non-finite loss gives non-finite gradients: the step is
            // skipped and the scale backs off. Only a run that keeps producing them, or one
            // without a scaler, has diverged.
            bad_losses = if lv.is_finite() { 0 } else { bad_losses + 1 };
            if bad_losses
                > if precision.loss_scaling() {
                    MAX_BAD_LOSSES
                } else {
                    0
                }
            {
                return Err(Error::Msg(format!(
                    "epoch {epoch}, batch {}: the loss is {lv} ({bad_losses} in a row); training \
                     diverged (lower the learning rate, or use a loss-scaled or F32 precision); \
                     the last checkpoint is intact",
                    b + 1
                )));
            }
            opt.backward(&loss)?;
            if cfg.grad_stats {
                opt.unscale()?;
            }
            opt.step()?;
            steps += 1;
            if cfg.grad_stats {
                for (st, t) in grad_stats.iter_mut().zip(opt.grad_tensors()) {
                    if let Some(g) = t.grad() {
                        st.count(&g);
                    }
                }
            }
            let (scale, skipped) = (opt.scale(), opt.skipped_steps());
            let n = batch.len();
            epoch_images += n;
            log_images += n;
            if lv.is_finite() {
                epoch_loss += lv;
                epoch_batches += 1;
                log_loss += lv;
                log_batches += 1;
            }
            on_event(&Event::Batch {
                epoch,
                batch: b + 1,
                loss: lv,
                images: n,
                scale,
                skipped,
            });
            if (b + 1) % cfg.log_every == 0 {
                let secs = log_start.elapsed().as_secs_f64();
                on_event(&Event::Log {
                    epoch,
                    step: b + 1,
                    loss: log_loss / log_batches.max(1) as f64,
                    lr: opt.optimizer().lr(),
                    images_per_s: log_images as f64 / secs.max(1e-9),
                    scale,
                    skipped,
                });
                (log_loss, log_batches, log_images, log_start) = (0.0, 0, 0, Instant::now());
            }
        }
        let train_secs = start.elapsed().as_secs_f64();
        let (acc, _) = evaluate_with(model, test, precision)?;
        let seconds = start.elapsed().as_secs_f64();
        summary.epochs_run += 1;
        summary.last_epoch = epoch;
        summary.test_accuracy = acc;
        summary.train_images += epoch_images;
        summary.train_seconds += train_secs;
        if let Some(dir) = &cfg.checkpoint_dir {
            let (opt_state, scaler_state) = opt.state_dict();
            save_checkpoint(dir, model, &opt_state, scaler_state.as_ref(), epoch, info)?;
        }
        on_event(&Event::Epoch {
            epoch,
            train_loss: epoch_loss / epoch_batches.max(1) as f64,
            test_accuracy: acc,
            seconds,
            images_per_s: epoch_images as f64 / train_secs.max(1e-9),
        });
    }
    summary.steps = steps;
    summary.skipped_steps = opt.skipped_steps() - skipped_before;
    summary.final_scale = opt.scale();
    if cfg.grad_stats {
        summary.grad_stats = grad_stats;
    }
    Ok(summary)
}
