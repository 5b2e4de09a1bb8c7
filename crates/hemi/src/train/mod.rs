//! The training loop of the documents' recipe: epochs over a `DataLoader`, a loss logged
//! every `log_every` batches, test accuracy after every epoch, and a checkpoint after every
//! epoch from which `resume` continues bit-identically (the loader's order is a function of
//! (seed, epoch), and the checkpoint holds the model, the optimizer state and the epoch).
//!
//! The loop reports through `Event`s; the CLI turns them into a progress bar, log lines and
//! a metrics file.

pub mod callbacks;
pub mod checkpoint;
pub mod doctor;
pub mod recipe;
pub mod task;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use crate::backend::train::Log2Histogram;
use callbacks::{
    with_promoted, Divergence, EpochCheckpoints, GradStats, InjectInf, Reporter, Tensors,
};
pub use callbacks::{BackwardEnd, Callback, EpochEnd, StepEnd};
pub use checkpoint::{
    latest_checkpoint, list_checkpoints, load_checkpoint, parse_state, save_checkpoint, Checkpoint,
    Progress, RunInfo,
};
pub use recipe::{Recipe, Schedule};
pub use task::{find_task, Classification, MaskedLm, Task, TaskOutput};

use crate::amp::{AmpOptimizer, GradScalerConfig, Precision, PrecisionPolicy};
use crate::data::DataLoader;
use crate::dist::{CommSnapshot, DistConfig, GradReducer, ProcessGroup, ZeroShard, ZeroStage};
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::optim::{
    no_decay_mask, Adam, AdamConfig, AdamW, AdamWConfig, Optimizer, OptimizerState, Sgd, SgdConfig,
};
use crate::tensor::Tensor;

/// Which optimizer to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Stochastic gradient descent with momentum ([`Sgd`]), the documents' optimizer
    /// (`torch.optim.SGD`).
    Sgd,
    /// Adam with L2 weight decay ([`Adam`], `torch.optim.Adam`).
    Adam,
    /// Adam with decoupled weight decay ([`AdamW`], `torch.optim.AdamW`).
    AdamW,
}

impl OptimizerKind {
    /// The name the CLI and checkpoints use: `"sgd"`, `"adam"` or `"adamw"`.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        }
    }
    /// Parses a name as written by [`OptimizerKind::name`]; anything else is an
    /// [`Error::Arg`] listing the accepted names.
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
    /// Number of passes over the training set (default 10).
    pub epochs: usize,
    /// The optimizer to build (default SGD).
    pub optimizer: OptimizerKind,
    /// The base learning rate (default 0.001), before warm-up and schedule.
    pub lr: f64,
    /// SGD momentum (default 0.9); ignored by Adam and AdamW.
    pub momentum: f64,
    /// `None`: the optimizer's default (0 for SGD and Adam, 0.01 for AdamW).
    pub weight_decay: Option<f64>,
    /// Nesterov momentum (SGD).
    pub nesterov: bool,
    /// No weight decay on biases and normalisation weights (parameters of rank < 2).
    pub no_decay_norm_bias: bool,
    /// The lr schedule after the warm-up, applied per optimizer step.
    pub schedule: Schedule,
    /// Linear warm-up over this many epochs (fractions allowed).
    pub warmup_epochs: f64,
    /// Label smoothing of the training loss (ε of `CrossEntropyOptions`).
    pub label_smoothing: f64,
    /// Log the mean loss every this many batches ([`Event::Log`]; default 200, the
    /// documents' interval).
    pub log_every: usize,
    /// The checkpoint root: a checkpoint directory (`epoch-0003/`...) is written into it after
    /// every epoch, and when the run is stopped through `stop`.
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from the newest complete checkpoint in `checkpoint_dir`. Without it, a
    /// `checkpoint_dir` that already holds checkpoints is an error (nothing is overwritten).
    pub resume: bool,
    /// Settings (`RunInfo::flat` names: `lr`, `epochs`, `data_dir`...) a resumed run may
    /// change; any other difference from the checkpoint's run is an error listing them.
    pub overrides: Vec<String>,
    /// Keep only the newest `keep` checkpoints (all when `None`).
    pub keep: Option<usize>,
    /// Also keep the checkpoint with the best test accuracy.
    pub keep_best: bool,
    /// Set from outside (a Ctrl-C handler) to stop at the next step boundary: the run writes a
    /// mid-epoch checkpoint (when it has a `checkpoint_dir`) and returns `Error::Interrupted`.
    pub stop: Option<Arc<AtomicBool>>,
    /// When a loss-scaled run counts as diverged.
    pub divergence: DivergenceConfig,
    /// Stop after this many epochs in total (as if interrupted), keeping the checkpoint.
    pub stop_after: Option<usize>,
    /// The precision preset (default amp-fp16, the documents' mode).
    pub precision: Precision,
    /// The loss scaler's settings (amp-fp16 and fp16-master).
    pub scaler: GradScalerConfig,
    /// Count, per parameter, the unscaled gradient values that F16 could not hold
    /// (|g| < 2^-24 underflows, |g| > 65504 overflows); reported in the summary.
    pub grad_stats: bool,
    /// Every this many optimizer steps (0: never), hand the parameters and their unscaled
    /// gradients to the caller (`Event::Tensors`) for histograms (TensorBoard).
    pub tensors_every: usize,
    /// Seed of the stochastic-rounding stream (pure-bf16).
    pub seed: u64,
    /// What the run optimises (default: classification).
    pub task: Arc<dyn Task>,
    /// Data-parallel training over the ranks of a process group (`None`: this process
    /// alone). Each rank passes its own shard of the training data (`DataLoader::sharded`
    /// with padding) and may pass a shard of the test data (without padding): the
    /// evaluation is summed over the ranks.
    pub dist: Option<DistConfig>,
    /// Split every batch into this many micro-batches (rows j, j + K, j + 2K, ...) and
    /// accumulate their gradients (summed, then divided by K) before one step: K micro-
    /// batches of B on one process take the step that K ranks with batches of B take (default
    /// 1).
    pub micro_batches: usize,
    /// A testing aid: on rank `.0`, after the gradients of global step `.1` (1-based) were
    /// reduced, one gradient value is set to +inf, so that the found-inf reduction must make
    /// every rank skip that step.
    pub inject_inf: Option<(usize, u64)>,
    /// Per-module and per-op precision pins over the preset (`--policy`), for training and
    /// evaluation; recorded in the checkpoint settings.
    pub policy: Option<PrecisionPolicy>,
    /// How many skipped (or, unscaled, non-finite) steps are replayed and named as an
    /// `Event::Overflow` (default 8); later ones are only counted, so that a run of skips
    /// cannot flood the log. 0 switches the replays off.
    pub overflow_reports: usize,
    /// Clip the total 2-norm of the (unscaled) gradients to this before every step
    /// (PyTorch's `clip_grad_norm_` after `GradScaler::unscale_`; the F32 masters' under
    /// fp16-master, as apex). `None`: no clipping.
    pub clip_grad_norm: Option<f64>,
    /// Self-healing (`--auto-promote`, amp presets): a module the overflow replays name
    /// this many times, or once the loss scale has fallen to 1, is pinned to F32 for the
    /// rest of the run (`Event::Promoted`; checkpoints record it, so `--resume` continues
    /// with it). `None`: off.
    pub auto_promote: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 10,
            optimizer: OptimizerKind::Sgd,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: None,
            nesterov: false,
            no_decay_norm_bias: false,
            schedule: Schedule::Constant,
            warmup_epochs: 0.0,
            label_smoothing: 0.0,
            log_every: 200,
            checkpoint_dir: None,
            resume: false,
            overrides: Vec::new(),
            keep: None,
            keep_best: false,
            stop: None,
            divergence: DivergenceConfig::default(),
            stop_after: None,
            precision: Precision::AmpFp16,
            scaler: GradScalerConfig::default(),
            grad_stats: false,
            tensors_every: 0,
            seed: 0,
            task: Arc::new(Classification),
            dist: None,
            micro_batches: 1,
            inject_inf: None,
            policy: None,
            overflow_reports: 8,
            clip_grad_norm: None,
            auto_promote: None,
        }
    }
}

/// When a run with loss scaling has diverged rather than hit passing overflows. Runs without
/// loss scaling stop at the first non-finite loss. A loss-scaled run stops when
/// - more than `max_skipped_fraction` of the last `min_steps`..`window` steps had a
///   non-finite loss (the forward pass itself blew up: no scale can fix that), or
/// - more than `max_skipped_fraction` of the last `window` steps were skipped (checked once
///   `window` steps were taken, so that a scale settling down from a high start, one skip
///   per halving, is not mistaken for divergence), or
/// - the scale fell below `min_scale` (it has collapsed).
#[derive(Clone, Debug, PartialEq)]
pub struct DivergenceConfig {
    /// 1.0 never stops on skipped steps.
    pub max_skipped_fraction: f64,
    /// The number of most recent steps the skipped-step fraction is taken over (default
    /// 100).
    pub window: usize,
    /// The fewest recent steps the non-finite-loss fraction is judged on (default 16).
    pub min_steps: usize,
    /// A loss scale below this has collapsed: the gradients overflow even unscaled.
    pub min_scale: f64,
}

impl Default for DivergenceConfig {
    fn default() -> Self {
        DivergenceConfig {
            max_skipped_fraction: 0.5,
            window: 100,
            min_steps: 16,
            // 2^-24: gradients that overflow F16 at this scale are above 2^40.
            min_scale: 5.960_464_477_539_063e-8,
        }
    }
}

impl DivergenceConfig {
    fn validate(&self) -> Result<()> {
        if !(self.max_skipped_fraction > 0.0 && self.max_skipped_fraction <= 1.0) {
            return Err(Error::arg(
                "train",
                format!(
                    "max_skipped_fraction must be in (0, 1], got {}",
                    self.max_skipped_fraction
                ),
            ));
        }
        if self.window == 0 || self.min_steps == 0 {
            return Err(Error::arg("train", "window and min_steps must be >= 1"));
        }
        Ok(())
    }
}

/// The settings of `cfg` that change a run's result, for the checkpoint's `RunInfo`.
fn config_settings(cfg: &TrainConfig) -> Vec<(&'static str, String)> {
    let s = &cfg.scaler;
    let mut v = vec![
        ("epochs", cfg.epochs.to_string()),
        ("optimizer", cfg.optimizer.name().to_string()),
        ("lr", cfg.lr.to_string()),
        ("momentum", cfg.momentum.to_string()),
        (
            "weight_decay",
            cfg.weight_decay.map_or("default".into(), |w| w.to_string()),
        ),
    ];
    // Recorded only when set, so that checkpoints of runs made before these settings
    // existed (all at their defaults) still resume.
    if cfg.nesterov {
        v.push(("nesterov", "true".into()));
    }
    if cfg.no_decay_norm_bias {
        v.push(("no_decay_norm_bias", "true".into()));
    }
    if cfg.schedule != Schedule::Constant {
        v.push(("schedule", cfg.schedule.describe()));
    }
    if cfg.warmup_epochs != 0.0 {
        v.push(("warmup_epochs", cfg.warmup_epochs.to_string()));
    }
    if cfg.label_smoothing != 0.0 {
        v.push(("label_smoothing", cfg.label_smoothing.to_string()));
    }
    if let Some(p) = cfg.policy.as_ref().filter(|p| !p.is_empty()) {
        v.push(("policy", p.to_json_compact()));
    }
    if cfg.task.name() != Classification.name() {
        v.push(("task", cfg.task.name().to_string()));
    }
    if cfg.micro_batches > 1 {
        v.push(("micro_batches", cfg.micro_batches.to_string()));
    }
    if let Some(d) = cfg.dist.as_ref().filter(|d| d.group.size() > 1) {
        v.push(("world_size", d.group.size().to_string()));
        v.push(("allreduce", d.reducer.wire.name().to_string()));
        if d.zero != ZeroStage::Off {
            v.push(("zero", d.zero.number().to_string()));
        }
    }
    if let Some(c) = cfg.clip_grad_norm {
        v.push(("clip_grad_norm", c.to_string()));
    }
    if cfg.precision.loss_scaling() {
        v.extend([
            ("scaler.init_scale", s.init_scale.to_string()),
            ("scaler.growth_factor", s.growth_factor.to_string()),
            ("scaler.backoff_factor", s.backoff_factor.to_string()),
            ("scaler.growth_interval", s.growth_interval.to_string()),
            ("scaler.hysteresis", s.hysteresis.to_string()),
            (
                "scaler.min_scale",
                s.min_scale.map_or("none".into(), |x| x.to_string()),
            ),
            (
                "scaler.max_scale",
                s.max_scale.map_or("none".into(), |x| x.to_string()),
            ),
        ]);
    }
    v
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
                nesterov: cfg.nesterov,
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
        /// The first epoch this run trains, 1-based (after a resumed checkpoint's epochs).
        first_epoch: usize,
        /// The run's total number of epochs.
        epochs: usize,
        /// Batches in one epoch of the training loader.
        batches_per_epoch: usize,
        /// Batches of `first_epoch` a resumed checkpoint already holds (0 when starting
        /// at an epoch boundary).
        batches_done: usize,
    },
    /// A batch finished.
    Batch {
        /// The epoch, 1-based.
        epoch: usize,
        /// The batch within the epoch, 1-based.
        batch: usize,
        /// Optimizer steps of the whole run so far, this one included (resumed runs count
        /// the steps before the checkpoint too): TensorBoard's x axis.
        global_step: u64,
        /// The learning rate this step used.
        lr: f64,
        /// This batch's loss, unscaled (may be inf or NaN under loss scaling; such a step
        /// is skipped).
        loss: f64,
        /// Samples in this batch.
        images: usize,
        /// The loss scale after this step (1.0 where the preset does not scale).
        scale: f64,
        /// Steps skipped so far (inf/NaN gradients).
        skipped: u64,
    },
    /// Every `log_every` batches: the mean loss since the last log line.
    Log {
        /// The epoch, 1-based.
        epoch: usize,
        /// The batch within the epoch that triggered the line, 1-based (a multiple of
        /// `log_every`).
        step: usize,
        /// As in `Batch`.
        global_step: u64,
        /// Mean of the finite losses since the previous log line (NaN when none was
        /// finite).
        loss: f64,
        /// The learning rate of the last step.
        lr: f64,
        /// Training throughput since the previous log line, in samples per second.
        images_per_s: f64,
        /// The loss scale after the last step (1.0 where the preset does not scale).
        scale: f64,
        /// Steps skipped so far (inf/NaN gradients).
        skipped: u64,
    },
    /// With `grad_stats`, at the end of every epoch: this epoch's gradient statistics per
    /// parameter (unscaled gradients, every step of the epoch) and the loss scale at its end.
    GradStats {
        /// The epoch, 1-based.
        epoch: usize,
        /// Optimizer steps of the run at the epoch's end.
        global_step: u64,
        /// The loss scale at the epoch's end (1.0 where the preset does not scale).
        scale: f64,
        /// One entry per parameter, in `named_parameters` order, counting this epoch only.
        stats: Vec<GradStat>,
    },
    /// Every `tensors_every` steps: each parameter with its unscaled gradient of this step
    /// (`None` for a parameter without one), in `named_parameters` order. The tensors share
    /// the model's storage: read them, do not keep them.
    Tensors {
        /// The step just taken (as in `Batch`).
        global_step: u64,
        /// (name, parameter, unscaled gradient) per parameter.
        tensors: Vec<(String, Tensor, Option<Tensor>)>,
    },
    /// A step was skipped for inf/NaN gradients (or, where the loss is not scaled, its loss
    /// was not finite), and a replay of it with per-op checks named where the overflow
    /// started (`train::doctor`). At most `TrainConfig::overflow_reports` per run.
    Overflow {
        /// The epoch, 1-based.
        epoch: usize,
        /// The batch within the epoch, 1-based.
        batch: usize,
        /// The step (as in `Batch`).
        global_step: u64,
        /// The loss scale the step used (1.0 where the preset does not scale).
        scale: f64,
        /// The first non-finite op result in forward order, if any.
        forward: Option<crate::ops::check::ForwardCulprit>,
        /// Else the first non-finite gradient in backward order, if any.
        backward: Option<crate::ops::check::BackwardCulprit>,
        /// The finding in one line.
        message: String,
        /// Replays left in this run after this one (0: later overflows are only counted).
        reports_left: usize,
    },
    /// `--auto-promote` pinned modules to F32 for the rest of the run.
    Promoted {
        /// The step after which the pins apply (as in `Batch`).
        global_step: u64,
        /// The modules pinned now.
        modules: Vec<String>,
        /// Why: how often the replays named them, and the loss scale.
        reason: String,
    },
    /// An epoch finished and the test set was evaluated.
    Epoch {
        /// The epoch, 1-based.
        epoch: usize,
        /// Mean of the epoch's finite batch losses (NaN when none was finite).
        train_loss: f64,
        /// Fraction of the test targets predicted correctly, in `[0, 1]`.
        test_accuracy: f64,
        /// Mean test loss per target (its exp is the perplexity of a language model).
        test_loss: f64,
        /// Wall time of the epoch, evaluation included.
        seconds: f64,
        /// Training throughput over the epoch (evaluation excluded), in samples per second.
        images_per_s: f64,
    },
}

/// What a run achieved.
#[derive(Clone, Debug)]
pub struct Summary {
    /// The precision preset the run used.
    pub precision: Precision,
    /// Optimizer steps taken in this run (including skipped ones) and how many were skipped.
    pub steps: u64,
    /// Of those steps, how many were skipped because a gradient was inf or NaN.
    pub skipped_steps: u64,
    /// The loss scale at the end (1.0 where the preset does not scale).
    pub final_scale: f64,
    /// Per-parameter F16 range counts (with `grad_stats`).
    pub grad_stats: Vec<GradStat>,
    /// Epochs trained in this call (not counting those a resumed checkpoint held).
    pub epochs_run: usize,
    /// The last epoch trained, 1-based (the checkpoint's when none ran).
    pub last_epoch: usize,
    /// Test accuracy after the last epoch, in `[0, 1]` (NaN when no epoch ran).
    pub test_accuracy: f64,
    /// Training samples processed in this call.
    pub train_images: usize,
    /// Seconds spent training in this call (evaluation excluded).
    pub train_seconds: f64,
    /// Data-parallel runs: what this rank sent and how long it waited on collectives in
    /// this call.
    pub comm: Option<CommSnapshot>,
    /// Bytes of optimizer state this rank holds at the end: the optimizer's F32 buffers
    /// (momentum, Adam moments, fp16-master's F32 masters; a shard's under ZeRO).
    pub optimizer_bytes: u64,
    /// Under ZeRO, the bytes of the shard tensors the optimizer updates (copies of the
    /// rank's slices of the weights, in the weights' dtype; 0 without ZeRO).
    pub shard_bytes: u64,
}

/// How many of one parameter's unscaled gradient values F16 could not represent, summed
/// over the steps of a run (Micikevicius et al. 2018: without loss scaling, small gradients
/// flush to zero).
#[derive(Clone, Debug, PartialEq)]
pub struct GradStat {
    /// The parameter's `state_dict` name (`conv1.weight`).
    pub name: String,
    /// Gradient values seen (numel × steps).
    pub values: u64,
    /// Nonzero values with |g| < 2^-24, F16's smallest subnormal: they round to 0 or 2^-24.
    pub underflow: u64,
    /// Values with |g| > 65504, F16's largest finite value (inf and NaN included).
    pub overflow: u64,
    /// Where the values sit: the `floor(log2 |g|)` histogram.
    pub log2: Log2Histogram,
}

impl GradStat {
    /// Adds another count of the same parameter (an epoch's to the run's).
    pub fn merge(&mut self, other: &GradStat) {
        self.values += other.values;
        self.underflow += other.underflow;
        self.overflow += other.overflow;
        self.log2.merge(&other.log2);
    }

    /// No values counted yet for the parameter `name`.
    pub fn new(name: &str) -> Self {
        GradStat {
            name: name.to_string(),
            values: 0,
            underflow: 0,
            overflow: 0,
            log2: Log2Histogram::default(),
        }
    }

    fn count(&mut self, grad: &Tensor) -> Result<()> {
        const TINY: f64 = 5.960_464_477_539_063e-8; // 2^-24
        let (under, over) = grad.storage().range_counts(grad.layout(), TINY, 65504.0)?;
        self.values += grad.numel() as u64;
        self.underflow += under;
        self.overflow += over;
        self.log2
            .merge(&grad.storage().log2_histogram(grad.layout())?);
        Ok(())
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

    /// Training throughput of the whole run, in samples per second (0 when nothing ran).
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
    let e = evaluate_task(model, loader, precision, &Classification)?;
    Ok((e.accuracy, e.loss))
}

/// A model's scores on a test set under a task.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Fraction of targets predicted correctly (samples; masked tokens for masked-LM).
    pub accuracy: f64,
    /// Mean loss per target.
    pub loss: f64,
    /// Targets scored.
    pub targets: usize,
}

impl Evaluation {
    /// exp(mean loss): the perplexity of a language model.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Scores `model` on every batch of `loader` under `task`, in eval mode and without
/// gradients, with the forward pass of `precision`.
pub fn evaluate_task(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
    task: &dyn Task,
) -> Result<Evaluation> {
    evaluate_task_with_policy(model, loader, precision, None, task)
}

/// `evaluate_task` with a precision policy's pins over the preset.
pub fn evaluate_task_with_policy(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
    task: &dyn Task,
) -> Result<Evaluation> {
    let (correct, total, loss_sum) = evaluate_sums(model, loader, precision, policy, task)?;
    if total == 0 {
        return Err(Error::arg("evaluate", "the test set is empty"));
    }
    Ok(Evaluation {
        accuracy: correct as f64 / total as f64,
        loss: loss_sum / total as f64,
        targets: total,
    })
}

/// `evaluate_task` with the test set sharded over the ranks of `group`: each rank scores its
/// share, and the counts are summed (in rank order) so every rank gets the same result.
pub fn evaluate_task_dist(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
    task: &dyn Task,
    group: &ProcessGroup,
) -> Result<Evaluation> {
    evaluate_task_dist_with_policy(model, loader, precision, None, task, group)
}

/// `evaluate_task_dist` with a precision policy's pins over the preset.
pub fn evaluate_task_dist_with_policy(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
    task: &dyn Task,
    group: &ProcessGroup,
) -> Result<Evaluation> {
    let (correct, total, loss_sum) = evaluate_sums(model, loader, precision, policy, task)?;
    let s = group.sum_f64(&[correct as f64, total as f64, loss_sum])?;
    if s[1] == 0.0 {
        return Err(Error::arg("evaluate", "the test set is empty"));
    }
    Ok(Evaluation {
        accuracy: s[0] / s[1],
        loss: s[2] / s[1],
        targets: s[1] as usize,
    })
}

/// The forward pass's scope: the preset's autocast, with the policy's pins when one is set.
pub(crate) fn forward_scope(
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
    model: &dyn Module,
) -> std::result::Result<crate::amp::PolicyScope, crate::amp::AutocastGuard> {
    match policy {
        Some(p) => Ok(p.scope(precision, model)),
        None => Err(precision.autocast()),
    }
}

/// `--auto-promote`: the modules to pin to F32 after the overflow `ev` (and why), when the
/// replays have now named them `after` times or the loss scale has fallen to 1.
fn promotion(
    ev: &Event,
    after: usize,
    promotable: &[String],
    promoted: &[String],
    named: &mut std::collections::HashMap<String, usize>,
    precision: Precision,
    scale: f64,
) -> Option<(Vec<String>, String)> {
    let Event::Overflow {
        forward, backward, ..
    } = ev
    else {
        return None;
    };
    let site = match (forward, backward) {
        (Some(f), _) => f.module.clone(),
        (None, Some(b)) => match &b.param {
            Some(p) => crate::ops::check::module_of(p).to_string(),
            None => b.module.clone(),
        },
        (None, None) => return None,
    };
    let mods: Vec<String> = site
        .split('+')
        .filter(|m| promotable.iter().any(|q| q == m))
        .filter(|m| !promoted.iter().any(|q| q == m))
        .map(str::to_string)
        .collect();
    let n = named.entry(site.clone()).or_insert(0);
    *n += 1;
    let floor = precision.loss_scaling() && scale <= 1.0;
    if mods.is_empty() || (*n < after && !floor) {
        return None;
    }
    let reason = format!(
        "the overflow replays named {} {} time{}; loss scale now {scale}",
        if site.is_empty() {
            "the model's top level"
        } else {
            &site
        },
        n,
        if *n == 1 { "" } else { "s" }
    );
    Some((mods, reason))
}

/// What `replay_overflow` needs of the run.
struct ReplayCtx<'a> {
    task: &'a dyn Task,
    precision: Precision,
    policy: Option<&'a PrecisionPolicy>,
    label_smoothing: f64,
    scale: f64,
    generators: Option<&'a [crate::rng::Generator]>,
    micro_batches: usize,
}

/// Replays a failed step (each micro-batch until one shows the overflow) and names where
/// it started.
fn replay_overflow(
    model: &mut dyn Module,
    batch: &crate::data::Batch,
    c: &ReplayCtx<'_>,
    (epoch, b, step): (usize, usize, u64),
) -> Result<Option<Event>> {
    use crate::train::doctor::{describe, replay_step, Replay};
    let k = c.micro_batches.max(1);
    let mut last = None;
    for j in 0..k {
        let micro = if k == 1 {
            batch.clone()
        } else {
            let rows: Vec<usize> = (j..batch.len()).step_by(k).collect();
            batch.select_rows(&rows)?
        };
        let r = replay_step(
            model,
            &Replay {
                task: c.task,
                batch: &micro,
                precision: c.precision,
                policy: c.policy,
                label_smoothing: c.label_smoothing,
                scale: c.scale,
                // Dropout draws the masks of the micro-batches in order: only the first
                // replays from the step's starting state.
                generators: if j == 0 { c.generators } else { None },
            },
        )?;
        let found = r.report.forward.is_some() || r.report.backward.is_some();
        last = Some(r.report);
        if found {
            break;
        }
    }
    let Some(report) = last else {
        return Ok(None);
    };
    let scale = c.precision.loss_scaling().then_some(c.scale);
    Ok(Some(Event::Overflow {
        epoch,
        batch: b,
        global_step: step,
        scale: scale.unwrap_or(1.0),
        message: describe(&report, scale),
        forward: report.forward,
        backward: report.backward,
        reports_left: 0,
    }))
}

/// The device of `model`'s first parameter (the CPU for a model without one): where the
/// training and evaluation loops put each batch, so a model moved to a GPU
/// (`Module::to_device`) trains and evaluates there.
fn model_device(model: &dyn Module) -> crate::Device {
    model
        .parameters()
        .first()
        .map_or(crate::Device::Cpu, |p| p.device())
}

/// (targets predicted correctly, targets, summed loss) of `model` on `loader`.
fn evaluate_sums(
    model: &mut dyn Module,
    loader: &DataLoader,
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
    task: &dyn Task,
) -> Result<(usize, usize, f64)> {
    model.set_training(false);
    let _g = crate::autograd::no_grad();
    let device = model_device(&*model);
    let run = || -> Result<(usize, usize, f64)> {
        let (mut correct, mut total, mut loss_sum) = (0usize, 0usize, 0.0);
        // Uploaded to the model's device one batch ahead (nothing to do on the CPU).
        for batch in loader.epoch(0).to_device(device) {
            let batch = batch?;
            let out = {
                let _scope = forward_scope(precision, policy, &*model);
                task.forward(&*model, &batch, precision, 0.0, true)?
            };
            correct += out.correct;
            total += out.count;
            loss_sum += out.loss.to_scalar()? * out.count as f64;
        }
        Ok((correct, total, loss_sum))
    };
    let r = run();
    model.set_training(true);
    r
}

/// Overwrites the optimizer's saved hyperparameters with the new run's, for the settings
/// named in `overrides` (`lr`, `momentum`, `weight_decay`).
fn apply_overrides(st: &mut OptimizerState, cfg: &TrainConfig) {
    let mut set = |name: &str, v: f64| {
        if let Some(x) = st.scalars.iter_mut().find(|(n, _)| n == name) {
            x.1 = v;
        }
    };
    for o in &cfg.overrides {
        match o.as_str() {
            "lr" => set("lr", cfg.lr),
            "momentum" if cfg.optimizer == OptimizerKind::Sgd => set("momentum", cfg.momentum),
            "weight_decay" => {
                if let Some(w) = cfg.weight_decay {
                    set("weight_decay", w);
                }
            }
            _ => {}
        }
    }
}

/// Checks everything that can be checked before the first step, so that a bad setup fails
/// in a second instead of after an epoch. Checks the setup before the first step; on rank 0 with a checkpoint directory, returns
/// the directory's lock, which the caller holds for the rest of the run.
fn preflight(
    train: &DataLoader,
    test: &DataLoader,
    cfg: &TrainConfig,
    root: bool,
) -> Result<Option<checkpoint::DirLock>> {
    if cfg.micro_batches == 0 || cfg.micro_batches > train.config().batch_size {
        return Err(Error::arg(
            "train",
            format!(
                "micro_batches must be in 1..=batch size ({}), got {}",
                train.config().batch_size,
                cfg.micro_batches
            ),
        ));
    }
    if cfg.log_every == 0 {
        return Err(Error::arg("train", "log_every must be > 0"));
    }
    if cfg.epochs == 0 {
        return Err(Error::arg("train", "epochs must be >= 1"));
    }
    if cfg.stop_after == Some(0) {
        return Err(Error::arg(
            "train",
            "stop_after must be >= 1 (the number of epochs to run before stopping)",
        ));
    }
    if cfg.keep == Some(0) {
        return Err(Error::arg(
            "train",
            "keep must be >= 1 (the newest checkpoint)",
        ));
    }
    cfg.divergence.validate()?;
    if let Some(c) = cfg.clip_grad_norm {
        if !(c.is_finite() && c >= 0.0) {
            return Err(Error::arg(
                "train",
                format!("the gradient clipping norm must be finite and >= 0, got {c}"),
            ));
        }
    }
    if let Some(d) = cfg.dist.as_ref().filter(|d| d.zero != ZeroStage::Off) {
        if d.group.size() > 1 && (cfg.grad_stats || cfg.tensors_every > 0) {
            return Err(Error::arg(
                "train",
                "gradient statistics and tensor histograms read every parameter's gradient; \
                 under ZeRO a rank holds a shard of them (drop --zero, or those options)",
            ));
        }
    }
    if cfg.nesterov && cfg.optimizer != OptimizerKind::Sgd {
        return Err(Error::arg(
            "train",
            format!(
                "Nesterov momentum applies to SGD, not {}",
                cfg.optimizer.name()
            ),
        ));
    }
    if !(0.0..=1.0).contains(&cfg.label_smoothing) {
        return Err(Error::arg(
            "train",
            format!(
                "label smoothing must be in [0, 1], got {}",
                cfg.label_smoothing
            ),
        ));
    }
    if train.num_batches() == 0 {
        return Err(Error::arg(
            "train",
            format!(
                "the training set gives no batches ({} samples, batch size {})",
                train.len(),
                train.config().batch_size
            ),
        ));
    }
    if test.is_empty() {
        return Err(Error::arg("train", "the test set is empty"));
    }
    if let Some(d) = &cfg.dist {
        let (n, s) = (d.group.size(), train.shard());
        if s.world != n || s.rank != d.group.rank() {
            return Err(Error::arg(
                "train",
                format!(
                    "rank {} of {n} needs the training loader sharded for it \
                     (DataLoader::sharded), not rank {} of {}",
                    d.group.rank(),
                    s.rank,
                    s.world
                ),
            ));
        }
    }
    if train.sample_shape() != test.sample_shape() {
        return Err(Error::arg(
            "train",
            format!(
                "training samples are {:?} but test samples {:?}",
                train.sample_shape(),
                test.sample_shape()
            ),
        ));
    }
    let (a, b) = (train.num_classes(), test.num_classes());
    let (na, nb) = (train.class_names(), test.class_names());
    if a != b || na != nb {
        return Err(Error::arg(
            "train",
            format!(
                "the training and test sets have different classes, so labels would not mean \
                 the same: {}",
                class_difference(na, nb, a, b)
            ),
        ));
    }
    let mut lock = None;
    if let Some(dir) = &cfg.checkpoint_dir {
        // Only rank 0 writes (and tidies) the checkpoint directory, holding its lock for the
        // whole run: a second run is refused before it touches anything, and what lies
        // there from a run that is gone can be tidied safely.
        if root {
            // Taking the lock creates the directory and writes its lock file: an
            // unwritable or non-directory path is found here, before training.
            lock = Some(checkpoint::lock_dir(dir)?);
            for p in checkpoint::remove_stray(dir)? {
                eprintln!("removed {} (left by an interrupted save)", p.display());
            }
        }
        // Rank 0's check speaks for all (the other ranks may not see the directory yet).
        if !cfg.resume && root {
            if let Some(last) = latest_checkpoint(dir)? {
                return Err(Error::Msg(format!(
                    "{}: already holds checkpoints (newest {}); pass --resume to continue that \
                     run, or choose another directory (nothing was overwritten)",
                    dir.display(),
                    last.display()
                )));
            }
        }
    } else if cfg.resume {
        return Err(Error::arg("train", "--resume needs a checkpoint directory"));
    }
    Ok(lock)
}

/// Says how two class lists differ: the names only one side has, or the counts.
pub fn class_difference(train: &[String], test: &[String], a: usize, b: usize) -> String {
    let only = |x: &[String], y: &[String]| -> Vec<String> {
        x.iter().filter(|n| !y.contains(n)).cloned().collect()
    };
    let (ta, tb) = (only(train, test), only(test, train));
    let mut parts = Vec::new();
    if !ta.is_empty() {
        parts.push(format!("only in the training set: {}", ta.join(", ")));
    }
    if !tb.is_empty() {
        parts.push(format!("only in the test set: {}", tb.join(", ")));
    }
    if parts.is_empty() && train != test {
        parts.push("the same names in another order".to_string());
    }
    if parts.is_empty() {
        parts.push(format!("{a} classes vs {b}"));
    }
    parts.join("; ")
}

/// The recent steps' (skipped, non-finite loss) flags, to tell a loss-scaled run that has
/// diverged.
#[derive(Default)]
struct SkipWindow {
    flags: std::collections::VecDeque<(bool, bool)>,
    skipped: usize,
    bad_loss: usize,
}

impl SkipWindow {
    fn push(&mut self, skipped: bool, bad_loss: bool, window: usize) {
        self.flags.push_back((skipped, bad_loss));
        self.skipped += usize::from(skipped);
        self.bad_loss += usize::from(bad_loss);
        while self.flags.len() > window {
            let (s, b) = self.flags.pop_front().expect("longer than window");
            self.skipped -= usize::from(s);
            self.bad_loss -= usize::from(b);
        }
    }

    /// Why the run counts as diverged, if it does.
    fn diverged(&self, d: &DivergenceConfig, scale: f64) -> Option<String> {
        let n = self.flags.len();
        let frac = |k: usize| k as f64 / n.max(1) as f64;
        if n >= d.min_steps && frac(self.bad_loss) > d.max_skipped_fraction {
            Some(format!(
                "{} of the last {n} losses were inf/NaN",
                self.bad_loss
            ))
        } else if n >= d.window && frac(self.skipped) > d.max_skipped_fraction {
            Some(format!(
                "{} of the last {n} steps were skipped for inf/NaN gradients",
                self.skipped
            ))
        } else if scale < d.min_scale {
            Some(format!(
                "the loss scale collapsed to {scale} (below {:e})",
                d.min_scale
            ))
        } else {
            None
        }
    }
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
    train_with_callbacks(model, train, test, cfg, info, &mut [], on_event)
}

/// [`train`] with `extra` callbacks, called at each hook after hemi's own (inf injection,
/// gradient statistics, tensors, divergence checks, epoch checkpoints, events; see
/// [`callbacks`]).
pub fn train_with_callbacks(
    model: &mut dyn Module,
    train: &DataLoader,
    test: &DataLoader,
    cfg: &TrainConfig,
    info: &RunInfo,
    extra: &mut [&mut dyn Callback],
    on_event: &mut dyn FnMut(&Event),
) -> Result<Summary> {
    let group = cfg.dist.as_ref().map(|d| d.group.clone());
    let rank = group.as_ref().map_or(0, |g| g.rank());
    let root = rank == 0;
    // A model moved to another device trains there: each batch is uploaded to it.
    // Checkpoints hold host copies, and a resumed run loads them onto the model's device
    // (`Tensor::set_data`), so a run moves between the CPU and a GPU at a checkpoint. The
    // collectives read host buffers.
    let device = model_device(&*model);
    if device != crate::Device::Cpu && cfg.dist.is_some() {
        return Err(Error::device(
            "train",
            format!(
                "data-parallel training on {device} is not supported yet: use the CPU \
                 (--device cpu)"
            ),
        ));
    }
    let _dir_lock = preflight(train, test, cfg, root)?;
    let precision = cfg.precision;
    // The checkpoint records the precision and the settings the run actually uses.
    let mut info = RunInfo {
        precision: precision.name().to_string(),
        ..info.clone()
    };
    for (k, v) in config_settings(cfg) {
        info.settings.insert(k.to_string(), v);
    }
    let info = &info;
    let policy = cfg.policy.as_ref().filter(|p| !p.is_empty());
    match policy {
        Some(p) => {
            p.validate(&*model)?;
            p.prepare_model(precision, model)?;
        }
        None => precision.prepare_model(model)?,
    }
    let params = model.parameters();
    let decay = no_decay_mask(&params);
    // ZeRO: the optimizer (and the masters) over this rank's shard of the parameters.
    let zero = match &cfg.dist {
        Some(d) if d.zero != ZeroStage::Off && d.group.size() > 1 => Some(Arc::new(
            ZeroShard::new(d.zero, d.group.clone(), params.clone(), d.reducer)?,
        )),
        _ => None,
    };
    let mut opt = match &zero {
        Some(z) => {
            let decay = z.piece_flags(&decay);
            let shards = z.shards().to_vec();
            AmpOptimizer::for_shard(precision, shards, cfg.scaler.clone(), cfg.seed, |t| {
                let mut opt = build_optimizer(cfg, t)?;
                if cfg.no_decay_norm_bias {
                    opt.set_weight_decay_mask(&decay)?;
                }
                Ok(opt)
            })?
        }
        None => AmpOptimizer::new(precision, params, cfg.scaler.clone(), cfg.seed, |params| {
            let mut opt = build_optimizer(cfg, params)?;
            if cfg.no_decay_norm_bias {
                opt.set_weight_decay_mask(&decay)?;
            }
            Ok(opt)
        })?,
    };
    if let Some(c) = cfg.clip_grad_norm {
        let norm = zero
            .clone()
            .map(|z| Arc::new(move |t: &[Tensor]| z.grad_norm(t)) as crate::optim::GradNormFn);
        opt.set_clip_grad_norm(Some(c), norm)?;
    }
    let schedule = recipe::lr_schedule(
        &cfg.schedule,
        cfg.warmup_epochs,
        cfg.epochs,
        train.num_batches(),
    )?;
    if cfg.auto_promote.is_some() && precision.autocast_dtype().is_none() {
        return Err(Error::arg(
            "auto_promote",
            format!(
                "--auto-promote needs an autocast preset (amp-fp16, amp-bf16), whose weights \
                 stay F32; {} keeps half weights that a module cannot switch mid-run",
                precision.name()
            ),
        ));
    }
    let mut resumed_promoted: Vec<String> = Vec::new();
    let mut start_at = Progress::default();
    if cfg.resume {
        let dir = cfg.checkpoint_dir.as_ref().expect("checked in preflight");
        let mut ck = load_checkpoint(dir)?;
        check_zero_ranks(&ck, info, zero.is_some())?;
        ck.info.check_resume(info, &cfg.overrides, &ck.dir)?;
        if ck.progress.epochs_done >= cfg.epochs {
            return Err(Error::Msg(format!(
                "{}: the checkpoint already holds {} of {} epochs; nothing to resume (train \
                 longer with --epochs N --override epochs)",
                ck.dir.display(),
                ck.progress.epochs_done,
                cfg.epochs
            )));
        }
        if ck.progress.batches_done >= train.num_batches() {
            return Err(Error::Msg(format!(
                "{}: the checkpoint stopped after batch {} of an epoch, but an epoch now has {} \
                 batches",
                ck.dir.display(),
                ck.progress.batches_done,
                train.num_batches()
            )));
        }
        if let Some(p) = ck.info.settings.get("promoted") {
            resumed_promoted = serde_json::from_str(p)
                .map_err(|e| Error::Msg(format!("{}: setting promoted: {e}", ck.dir.display())))?;
        }
        model.load_state_dict(&ck.model)?;
        apply_overrides(&mut ck.optimizer, cfg);
        match &zero {
            Some(z) => {
                z.refresh_from_params()?;
                opt.load_state_dict(&z.shard_state(&ck.optimizer)?, ck.scaler.as_ref())?;
            }
            None => opt.load_state_dict(&ck.optimizer, ck.scaler.as_ref())?,
        }
        start_at = ck.progress;
    }
    // Data parallelism: the same run on every rank, then gradients averaged after each
    // backward and the found-inf flag reduced, so the replicas stay equal.
    let comm_start = group.as_ref().map(|g| g.stats());
    let reducer = match (&cfg.dist, &group) {
        (Some(d), Some(g)) if g.size() > 1 => {
            check_replicas(g, info, model, &start_at)?;
            let sync_group = g.clone();
            opt.set_found_inf_sync(Some(Arc::new(move |f| sync_group.any(f))));
            Some(match &zero {
                Some(z) => {
                    GradReducer::with_zero(g.clone(), model.parameters(), d.reducer, z.clone())?
                }
                None => GradReducer::new(g.clone(), model.parameters(), d.reducer)?,
            })
        }
        _ => None,
    };
    let group = group.filter(|g| g.size() > 1);
    let first_epoch = start_at.epochs_done + 1;
    let last = cfg.stop_after.map_or(cfg.epochs, |s| s.min(cfg.epochs));
    on_event(&Event::Start {
        first_epoch,
        epochs: cfg.epochs,
        batches_per_epoch: train.num_batches(),
        batches_done: start_at.batches_done,
    });
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let (skipped_before, mut steps) = (opt.skipped_steps(), 0u64);
    let mut summary = Summary {
        precision,
        steps: 0,
        skipped_steps: 0,
        final_scale: opt.scale(),
        grad_stats: Vec::new(),
        epochs_run: 0,
        last_epoch: start_at.epochs_done,
        test_accuracy: f64::NAN,
        train_images: 0,
        train_seconds: 0.0,
        comm: None,
        optimizer_bytes: 0,
        shard_bytes: 0,
    };
    // Everything but the step, in the order its events reach `on_event`.
    let mut inject = cfg.inject_inf.map(InjectInf::new);
    let mut divergence = Divergence::new(cfg.divergence.clone(), precision);
    let mut grad_stats = cfg.grad_stats.then(|| GradStats::new(&names));
    let mut tensors = Tensors::new(cfg.tensors_every);
    // `--auto-promote`: the policy in force (the run's, plus the promoted modules).
    let mut live: Option<PrecisionPolicy> = policy.cloned();
    if !resumed_promoted.is_empty() {
        let p = live.get_or_insert_with(PrecisionPolicy::default);
        for m in &resumed_promoted {
            p.modules.push((m.clone(), crate::DType::F32));
        }
    }
    let promoted: callbacks::Promoted = std::rc::Rc::new(std::cell::RefCell::new(resumed_promoted));
    let mut named_count: std::collections::HashMap<String, usize> = Default::default();
    let promotable = crate::amp::policy::module_paths(&*model);
    let mut saves = root.then(|| EpochCheckpoints::new(cfg, info).with_promoted(promoted.clone()));
    let mut reporter = Reporter::new(cfg.log_every);
    let mut callbacks: Vec<&mut dyn Callback> = Vec::new();
    if let Some(c) = inject.as_mut() {
        callbacks.push(c);
    }
    if let Some(c) = grad_stats.as_mut() {
        callbacks.push(c);
    }
    callbacks.push(&mut tensors);
    callbacks.push(&mut divergence);
    if let Some(c) = saves.as_mut() {
        callbacks.push(c);
    }
    callbacks.push(&mut reporter);
    for c in extra.iter_mut() {
        callbacks.push(&mut **c);
    }
    let task = cfg.task.as_ref();
    let mut overflow_left = cfg.overflow_reports;
    let stopping = || cfg.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
    model.set_training(true);
    for epoch in first_epoch..=last {
        let start = Instant::now();
        let first_batch = if epoch == first_epoch {
            start_at.batches_done
        } else {
            0
        };
        let (mut epoch_loss, mut epoch_batches, mut epoch_images) = if first_batch > 0 {
            (
                start_at.partial_loss_sum,
                start_at.partial_batches,
                start_at.partial_images,
            )
        } else {
            (0.0, 0, 0)
        };
        let mut trained_images = 0usize;
        for c in callbacks.iter_mut() {
            c.on_epoch_start(epoch)?;
        }
        // Each batch is uploaded to the model's device while the step before it runs (a
        // no-op on the CPU).
        let batches = train
            .epoch_from(epoch as u64 - 1, first_batch)
            .to_device(device);
        for (b, batch) in (first_batch..).zip(batches) {
            let progress = Progress {
                epochs_done: epoch - 1,
                batches_done: b,
                partial_loss_sum: epoch_loss,
                partial_batches: epoch_batches,
                partial_images: epoch_images,
            };
            // Data-parallel runs agree on stopping after the backward (below), so that every
            // rank stops at the same batch.
            if group.is_none() && stopping() {
                return Err(interrupt(
                    steps,
                    cfg,
                    model,
                    &opt,
                    zero.as_deref(),
                    &with_promoted(info, &promoted.borrow()),
                    progress,
                ));
            }
            let batch = batch?;
            // The schedule is a closed form of the global step: a resumed run sets the same
            // lr an uninterrupted one would.
            let t = ((epoch - 1) * train.num_batches() + b) as u64;
            opt.optimizer_mut().set_lr(schedule.lr_at(cfg.lr, t));
            opt.zero_grad();
            if let Some(z) = &zero {
                z.zero_param_grads();
            }
            let skipped_before_step = opt.skipped_steps();
            // What a replay of this step needs (`train::doctor`): the scale and the dropout
            // generators before it (a few words each).
            let scale_before = opt.scale();
            let gens_before =
                (overflow_left > 0).then(|| crate::train::doctor::generator_states(&*model));
            // The documents' step: forward under autocast, (scaled) backward, step.
            let k = cfg.micro_batches;
            let mut lv = 0.0;
            for j in 0..k {
                let micro = if k == 1 {
                    batch.clone()
                } else {
                    let rows: Vec<usize> = (j..batch.len()).step_by(k).collect();
                    batch.select_rows(&rows)?
                };
                if let Some(r) = &reducer {
                    r.set_sync(j + 1 == k);
                }
                let loss = {
                    let _scope = forward_scope(precision, live.as_ref(), &*model);
                    task.forward(&*model, &micro, precision, cfg.label_smoothing, false)?
                        .loss
                };
                lv += loss.to_scalar()?;
                opt.backward(&loss)?;
            }
            lv /= k as f64;
            if let Some(r) = &reducer {
                r.finish()?;
            }
            if k > 1 {
                for p in opt.optimizer().params() {
                    if let Some(g) = p.grad() {
                        p.set_grad(Some(g.div_scalar(k as f64)?));
                    }
                }
            }
            if let Some(g) = &group {
                // One small collective per step: the stop flag, and the ranks' mean loss.
                let s = g.sum_f64(&[f64::from(u8::from(stopping())), lv])?;
                lv = s[1] / g.size() as f64;
                if s[0] > 0.0 {
                    return Err(interrupt(
                        steps,
                        cfg,
                        model,
                        &opt,
                        zero.as_deref(),
                        &with_promoted(info, &promoted.borrow()),
                        progress,
                    ));
                }
            }
            // Unscaled presets: a non-finite loss is named before the step changes the
            // weights; loss-scaled ones: a skipped step after it (the weights did not change).
            let replay_now = |model: &mut dyn Module| -> Result<Option<Event>> {
                let ctx = ReplayCtx {
                    task,
                    precision,
                    policy: live.as_ref(),
                    label_smoothing: cfg.label_smoothing,
                    scale: scale_before,
                    generators: gens_before.as_deref(),
                    micro_batches: k,
                };
                replay_overflow(model, &batch, &ctx, (epoch, b + 1, t + 1))
            };
            let mut overflow = None;
            let replays = overflow_left > 0 || cfg.auto_promote.is_some();
            let mut emitted = false;
            if replays && !precision.loss_scaling() && !lv.is_finite() {
                overflow = replay_now(model)?;
                // Named now: the divergence check below may end the run.
                if let Some(ev) = overflow.as_mut().filter(|_| overflow_left > 0) {
                    overflow_left -= 1;
                    if let Event::Overflow { reports_left, .. } = ev {
                        *reports_left = overflow_left;
                    }
                    on_event(ev);
                    emitted = true;
                }
            }
            let ready = BackwardEnd {
                epoch,
                batch: b + 1,
                global_step: t + 1,
                loss: lv,
                rank,
                opt: &opt,
            };
            for c in callbacks.iter_mut() {
                c.after_backward(&ready, on_event)?;
            }
            let lr = opt.optimizer().lr();
            if callbacks.iter().any(|c| c.wants_unscaled(t + 1)) {
                opt.unscale()?;
            }
            let stepped = opt.step()?;
            if let Some(z) = zero.as_ref().filter(|_| stepped) {
                // Every rank stepped its shard (or, on inf, every rank skipped): the whole
                // parameters from every rank's updated shard.
                z.gather_params()?;
            }
            if replays && precision.loss_scaling() && opt.skipped_steps() > skipped_before_step {
                overflow = replay_now(model)?;
            }
            if let Some(mut ev) = overflow {
                if let Some(after) = cfg.auto_promote {
                    let found = promotion(
                        &ev,
                        after,
                        &promotable,
                        &promoted.borrow(),
                        &mut named_count,
                        precision,
                        opt.scale(),
                    );
                    if let Some((mods, reason)) = found {
                        let p = live.get_or_insert_with(PrecisionPolicy::default);
                        for m in &mods {
                            p.modules.push((m.clone(), crate::DType::F32));
                        }
                        promoted.borrow_mut().extend(mods.iter().cloned());
                        on_event(&Event::Promoted {
                            global_step: t + 1,
                            modules: mods,
                            reason,
                        });
                    }
                }
                if overflow_left > 0 && !emitted {
                    overflow_left -= 1;
                    if let Event::Overflow { reports_left, .. } = &mut ev {
                        *reports_left = overflow_left;
                    }
                    on_event(&ev);
                }
            }
            steps += 1;
            let n = batch.len();
            epoch_images += n;
            trained_images += n;
            if lv.is_finite() {
                epoch_loss += lv;
                epoch_batches += 1;
            }
            let (scale, skipped) = (opt.scale(), opt.skipped_steps());
            let done = StepEnd {
                epoch,
                batch: b + 1,
                global_step: t + 1,
                lr,
                loss: lv,
                images: n,
                scale,
                skipped,
                step_skipped: skipped > skipped_before_step,
                model: &*model,
                opt: &opt,
            };
            for c in callbacks.iter_mut() {
                c.on_step_end(&done, on_event)?;
            }
        }
        let train_secs = start.elapsed().as_secs_f64();
        let eval = match &group {
            Some(g) => {
                check_params_equal(g, model, epoch)?;
                // BatchNorm running statistics are rank 0's everywhere (DDP's
                // broadcast_buffers), so every rank evaluates the model rank 0 saves.
                crate::dist::broadcast_buffers(g, model)?;
                evaluate_task_dist_with_policy(model, test, precision, live.as_ref(), task, g)?
            }
            None => evaluate_task_with_policy(model, test, precision, live.as_ref(), task)?,
        };
        // ZeRO: the optimizer state a checkpoint saves, gathered onto rank 0 (every rank
        // takes part).
        let gathered = match (&zero, &cfg.checkpoint_dir) {
            (Some(z), Some(_)) => {
                let (st, scaler) = opt.state_dict();
                z.gather_state(&st)?.map(|st| (st, scaler))
            }
            _ => None,
        };
        summary.epochs_run += 1;
        summary.last_epoch = epoch;
        summary.test_accuracy = eval.accuracy;
        summary.train_images += trained_images;
        summary.train_seconds += train_secs;
        let end = EpochEnd {
            epoch,
            train_loss: mean_or_nan(epoch_loss, epoch_batches),
            test_accuracy: eval.accuracy,
            test_loss: eval.loss,
            seconds: start.elapsed().as_secs_f64(),
            images_per_s: trained_images as f64 / train_secs.max(1e-9),
            global_step: (epoch * train.num_batches()) as u64,
            model: &*model,
            opt: &opt,
            saved_state: gathered.as_ref(),
        };
        for c in callbacks.iter_mut() {
            c.on_epoch_end(&end, on_event)?;
        }
    }
    summary.steps = steps;
    summary.skipped_steps = opt.skipped_steps() - skipped_before;
    summary.final_scale = opt.scale();
    drop(callbacks);
    if let Some(g) = grad_stats {
        summary.grad_stats = g.run;
    }
    if let (Some(g), Some(start)) = (&cfg.dist, comm_start) {
        summary.comm = Some(g.group.stats().since(&start));
    }
    let state = opt.optimizer().state_bytes();
    let shards: usize = zero.as_ref().map_or(0, |z| {
        (z.shards().iter())
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum()
    });
    summary.optimizer_bytes = state as u64;
    summary.shard_bytes = shards as u64;
    Ok(summary)
}

/// A ZeRO run resumes with the rank count its checkpoint was written with (a shard's state
/// is a slice of the unsharded one, cut for N ranks): otherwise an error naming both counts.
fn check_zero_ranks(ck: &Checkpoint, now: &RunInfo, zero_now: bool) -> Result<()> {
    let get = |i: &RunInfo, k: &str| i.settings.get(k).cloned();
    let zero_then = get(&ck.info, "zero").is_some();
    if !(zero_now || zero_then) {
        return Ok(());
    }
    let ranks = |i: &RunInfo| get(i, "world_size").unwrap_or_else(|| "1".into());
    let (then, n) = (ranks(&ck.info), ranks(now));
    if then != n {
        return Err(Error::arg(
            "resume",
            format!(
                "{}: the checkpoint was written by a run on {then} rank(s) and this run has \
                 {n}; a ZeRO run resumes with the rank count it was started with (mpirun -np \
                 {then})",
                ck.dir.display()
            ),
        ));
    }
    Ok(())
}

/// A SHA-256 over every parameter's name, shape, dtype and bits.
fn params_digest(model: &dyn Module) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (name, p) in model.named_parameters() {
        h.update(name.as_bytes());
        h.update(format!("{:?}{}", p.shape(), p.dtype()).as_bytes());
        for x in p.to_vec_f64() {
            h.update(x.to_le_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// At the start of a data-parallel run: every rank must run the same settings (the run's
/// flat settings but the data directory, which may be mounted elsewhere on another machine)
/// from the same parameters and the same point of the run; the error names the ranks and
/// what differs.
fn check_replicas(
    g: &ProcessGroup,
    info: &RunInfo,
    model: &dyn Module,
    at: &Progress,
) -> Result<()> {
    let mut flat = info.flat();
    flat.remove("data_dir");
    flat.insert(
        "progress".into(),
        format!("epoch {} batch {}", at.epochs_done, at.batches_done),
    );
    let mine = serde_json::json!({ "settings": flat, "params": params_digest(model) });
    let all = g.all_gather(mine.to_string().into_bytes())?;
    let parse = |b: &[u8]| -> Result<serde_json::Value> {
        serde_json::from_slice(b)
            .map_err(|e| Error::Msg(format!("a rank sent an unreadable configuration: {e}")))
    };
    let first = parse(&all[0])?;
    let mut problems = Vec::new();
    for (r, b) in all.iter().enumerate().skip(1) {
        let other = parse(b)?;
        let (a, o) = (&first["settings"], &other["settings"]);
        let mut keys: Vec<&String> = a
            .as_object()
            .into_iter()
            .chain(o.as_object())
            .flat_map(|m| m.keys())
            .collect();
        keys.sort();
        keys.dedup();
        for k in keys {
            if a.get(k) != o.get(k) {
                let show = |v: Option<&serde_json::Value>| {
                    v.and_then(|v| v.as_str())
                        .unwrap_or("(not set)")
                        .to_string()
                };
                problems.push(format!(
                    "rank {r} has {k} = {} where rank 0 has {}",
                    show(o.get(k)),
                    show(a.get(k))
                ));
            }
        }
        if first["params"] != other["params"] && a == o {
            problems.push(format!(
                "rank {r} starts from other parameters than rank 0 (SHA-256 {} vs {})",
                other["params"], first["params"]
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Msg(format!(
            "rank {}: the ranks do not run the same training: {}",
            g.rank(),
            problems.join("; ")
        )))
    }
}

/// At every epoch's end of a data-parallel run: the replicas must still be equal (they take
/// the same steps from the same averaged gradients).
fn check_params_equal(g: &ProcessGroup, model: &dyn Module, epoch: usize) -> Result<()> {
    let all = g.all_gather(params_digest(model).into_bytes())?;
    match all.iter().position(|d| d != &all[0]) {
        None => Ok(()),
        Some(r) => Err(Error::Msg(format!(
            "rank {}: after epoch {epoch} rank {r}'s parameters differ from rank 0's: the \
             replicas diverged",
            g.rank()
        ))),
    }
}

/// The mean of `n` losses summing to `sum`; NaN when every loss was inf/NaN, so that a run
/// whose losses are all non-finite never reports 0.
fn mean_or_nan(sum: f64, n: usize) -> f64 {
    if n == 0 {
        f64::NAN
    } else {
        sum / n as f64
    }
}

/// Writes the mid-epoch checkpoint of a stopped run and builds the error that reports it.
fn interrupt(
    steps: u64,
    cfg: &TrainConfig,
    model: &dyn Module,
    opt: &AmpOptimizer,
    zero: Option<&ZeroShard>,
    info: &RunInfo,
    at: Progress,
) -> Error {
    let root = cfg.dist.as_ref().is_none_or(|d| d.group.rank() == 0);
    let Some(dir) = &cfg.checkpoint_dir else {
        return Error::Interrupted(format!(
            "stopped at epoch {}, batch {} (no --checkpoint-dir: nothing saved)",
            at.epochs_done + 1,
            at.batches_done
        ));
    };
    if steps == 0 {
        return Error::Interrupted(format!(
            "stopped before the first step (epoch {}, batch {}); nothing new to save",
            at.epochs_done + 1,
            at.batches_done
        ));
    }
    if at.batches_done == 0 && at.epochs_done > 0 {
        // At an epoch boundary the epoch's checkpoint was just written.
        return Error::Interrupted(format!(
            "stopped after epoch {}; resume with --resume (checkpoint in {})",
            at.epochs_done,
            dir.display()
        ));
    }
    let (mut opt_state, scaler_state) = opt.state_dict();
    if let Some(z) = zero {
        // Every rank sends its shard's state; rank 0 writes the whole.
        match z.gather_state(&opt_state) {
            Ok(Some(full)) => opt_state = full,
            Ok(None) => {}
            Err(e) => {
                return Error::Interrupted(format!(
                    "stopped at epoch {}, batch {}; the shards' optimizer state could not be \
                     gathered ({e}); the last complete checkpoint in {} is intact",
                    at.epochs_done + 1,
                    at.batches_done,
                    dir.display()
                ))
            }
        }
    }
    if !root {
        return Error::Interrupted(format!(
            "stopped at epoch {}, batch {}; rank 0 writes the checkpoint",
            at.epochs_done + 1,
            at.batches_done
        ));
    }
    match save_checkpoint(
        dir,
        model,
        &opt_state,
        scaler_state.as_ref(),
        at,
        None,
        info,
    ) {
        Ok(p) => Error::Interrupted(format!(
            "stopped at epoch {}, batch {}; checkpoint {} written, continue with --resume",
            at.epochs_done + 1,
            at.batches_done,
            p.display()
        )),
        Err(e) => Error::Interrupted(format!(
            "stopped at epoch {}, batch {}; the mid-epoch checkpoint could not be written \
             ({e}); the last complete checkpoint in {} is intact",
            at.epochs_done + 1,
            at.batches_done,
            dir.display()
        )),
    }
}
