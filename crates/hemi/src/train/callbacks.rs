//! What the training loop does besides the step, as callbacks (Keras' `Callback`,
//! Lightning's hooks): each concern (log lines and events, gradient statistics, tensors for
//! histograms, the divergence checks, epoch checkpoints, the inf injection of the tests) is
//! a small type with the hooks it needs, so that [`train`](super::train) keeps only the
//! documents' loop (forward, backward, step) and its bookkeeping, and a new concern (the
//! precision doctor, ZeRO) adds a callback instead of lines in the loop.
//!
//! The loop calls the callbacks in a fixed order at each hook, and every hook may end the
//! run with an error (a diverged run). The order of events the caller sees is the order
//! the callbacks are listed in `train`.

use std::time::Instant;

use super::checkpoint::{self, save_checkpoint, Progress, RunInfo};
use super::{mean_or_nan, DivergenceConfig, Event, GradStat, SkipWindow, TrainConfig};
use crate::amp::{AmpOptimizer, Precision, ScalerState};
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::optim::OptimizerState;
use crate::tensor::Tensor;

/// The gradients of a step are ready (reduced across ranks, averaged over micro-batches);
/// the optimizer has not stepped yet.
pub struct BackwardEnd<'a> {
    /// The epoch, 1-based.
    pub epoch: usize,
    /// The batch within the epoch, 1-based.
    pub batch: usize,
    /// The step about to be taken (1-based, counting a resumed run's earlier steps).
    pub global_step: u64,
    /// The batch's loss (the ranks' mean in a data-parallel run; may be inf or NaN).
    pub loss: f64,
    /// The rank of this process (0 alone).
    pub rank: usize,
    /// The optimizer, whose parameters hold the gradients.
    pub opt: &'a AmpOptimizer,
}

/// A step was taken (or skipped for inf/NaN gradients).
pub struct StepEnd<'a> {
    /// The epoch, 1-based.
    pub epoch: usize,
    /// The batch within the epoch, 1-based.
    pub batch: usize,
    /// The step just taken (1-based, counting a resumed run's earlier steps).
    pub global_step: u64,
    /// The learning rate the step used.
    pub lr: f64,
    /// The batch's loss, as in [`BackwardEnd`].
    pub loss: f64,
    /// Samples in the batch.
    pub images: usize,
    /// The loss scale after the step (1.0 where the preset does not scale).
    pub scale: f64,
    /// Steps skipped so far in the run.
    pub skipped: u64,
    /// Whether this step was skipped.
    pub step_skipped: bool,
    /// The model after the step.
    pub model: &'a dyn Module,
    /// The optimizer after the step (gradients still in place).
    pub opt: &'a AmpOptimizer,
}

/// An epoch was trained and evaluated.
pub struct EpochEnd<'a> {
    /// The epoch, 1-based.
    pub epoch: usize,
    /// Mean of the epoch's finite batch losses (NaN when none was finite).
    pub train_loss: f64,
    /// Test accuracy after the epoch, in `[0, 1]`.
    pub test_accuracy: f64,
    /// Mean test loss per target.
    pub test_loss: f64,
    /// Wall time of the epoch, evaluation included.
    pub seconds: f64,
    /// Training throughput over the epoch (evaluation excluded), samples per second.
    pub images_per_s: f64,
    /// Optimizer steps of the run at the epoch's end.
    pub global_step: u64,
    /// The model after the epoch.
    pub model: &'a dyn Module,
    /// The optimizer after the epoch.
    pub opt: &'a AmpOptimizer,
    /// The optimizer and scaler state a checkpoint saves where `opt.state_dict()` is not it:
    /// under ZeRO, the shards' states gathered on rank 0 (`None` on the other ranks, and
    /// without ZeRO).
    pub saved_state: Option<&'a (OptimizerState, Option<ScalerState>)>,
}

/// Where callbacks report to: the caller's event handler.
pub type Emit<'a> = dyn FnMut(&Event) + 'a;

/// A concern of the training loop. Every hook does nothing by default.
pub trait Callback {
    /// An epoch starts (also the first, resumed, epoch of a resumed run).
    fn on_epoch_start(&mut self, _epoch: usize) -> Result<()> {
        Ok(())
    }
    /// The gradients of a step are ready; an error ends the run before the step.
    fn after_backward(&mut self, _b: &BackwardEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        Ok(())
    }
    /// Whether this callback reads the gradients of step `global_step` between the
    /// backward and the step, unscaled: the loop then unscales them before the step (which
    /// otherwise unscales them itself, to the same values). After the step the gradients
    /// are unscaled either way.
    fn wants_unscaled(&self, _global_step: u64) -> bool {
        false
    }
    /// A step was taken; an error ends the run.
    fn on_step_end(&mut self, _s: &StepEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        Ok(())
    }
    /// An epoch was trained and evaluated; an error ends the run.
    fn on_epoch_end(&mut self, _e: &EpochEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        Ok(())
    }
}

/// `Event::Batch` after every step, `Event::Log` every `log_every` batches (the mean loss
/// and the throughput since the last line), `Event::Epoch` after every epoch.
pub struct Reporter {
    log_every: usize,
    loss: f64,
    batches: usize,
    images: usize,
    since: Instant,
}

impl Reporter {
    /// Log lines every `log_every` batches.
    pub fn new(log_every: usize) -> Self {
        Reporter {
            log_every,
            loss: 0.0,
            batches: 0,
            images: 0,
            since: Instant::now(),
        }
    }
}

impl Callback for Reporter {
    fn on_epoch_start(&mut self, _epoch: usize) -> Result<()> {
        (self.loss, self.batches, self.images, self.since) = (0.0, 0, 0, Instant::now());
        Ok(())
    }

    fn on_step_end(&mut self, s: &StepEnd<'_>, emit: &mut Emit<'_>) -> Result<()> {
        self.images += s.images;
        if s.loss.is_finite() {
            self.loss += s.loss;
            self.batches += 1;
        }
        emit(&Event::Batch {
            epoch: s.epoch,
            batch: s.batch,
            global_step: s.global_step,
            lr: s.lr,
            loss: s.loss,
            images: s.images,
            scale: s.scale,
            skipped: s.skipped,
        });
        if s.batch.is_multiple_of(self.log_every) {
            let secs = self.since.elapsed().as_secs_f64();
            emit(&Event::Log {
                epoch: s.epoch,
                step: s.batch,
                global_step: s.global_step,
                loss: mean_or_nan(self.loss, self.batches),
                lr: s.opt.optimizer().lr(),
                images_per_s: self.images as f64 / secs.max(1e-9),
                scale: s.scale,
                skipped: s.skipped,
            });
            (self.loss, self.batches, self.images, self.since) = (0.0, 0, 0, Instant::now());
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, e: &EpochEnd<'_>, emit: &mut Emit<'_>) -> Result<()> {
        emit(&Event::Epoch {
            epoch: e.epoch,
            train_loss: e.train_loss,
            test_accuracy: e.test_accuracy,
            test_loss: e.test_loss,
            seconds: e.seconds,
            images_per_s: e.images_per_s,
        });
        Ok(())
    }
}

/// `grad_stats`: per parameter, how many unscaled gradient values F16 could not hold, every
/// step; `Event::GradStats` with the epoch's counts at its end, the run's in [`Self::run`].
pub struct GradStats {
    names: Vec<String>,
    epoch: Vec<GradStat>,
    /// The counts of the whole run so far.
    pub run: Vec<GradStat>,
}

impl GradStats {
    /// Counts for the parameters `names` (in `named_parameters` order).
    pub fn new(names: &[String]) -> Self {
        let fresh = || names.iter().map(|n| GradStat::new(n)).collect();
        GradStats {
            names: names.to_vec(),
            epoch: fresh(),
            run: fresh(),
        }
    }
}

impl Callback for GradStats {
    fn on_epoch_start(&mut self, _epoch: usize) -> Result<()> {
        self.epoch = self.names.iter().map(|n| GradStat::new(n)).collect();
        Ok(())
    }

    fn wants_unscaled(&self, _global_step: u64) -> bool {
        true
    }

    fn on_step_end(&mut self, s: &StepEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        for (st, t) in self.epoch.iter_mut().zip(s.opt.grad_tensors()) {
            if let Some(g) = t.grad() {
                st.count(&g)?;
            }
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, e: &EpochEnd<'_>, emit: &mut Emit<'_>) -> Result<()> {
        for (run, ep) in self.run.iter_mut().zip(&self.epoch) {
            run.merge(ep);
        }
        emit(&Event::GradStats {
            epoch: e.epoch,
            global_step: e.global_step,
            scale: e.opt.scale(),
            stats: std::mem::take(&mut self.epoch),
        });
        Ok(())
    }
}

/// `tensors_every`: every this many steps, `Event::Tensors` with each parameter and its
/// unscaled gradient (TensorBoard's histograms).
pub struct Tensors {
    every: u64,
}

impl Tensors {
    /// Every `every` steps (0: never).
    pub fn new(every: usize) -> Self {
        Tensors {
            every: every as u64,
        }
    }
}

impl Callback for Tensors {
    fn wants_unscaled(&self, global_step: u64) -> bool {
        self.every > 0 && global_step.is_multiple_of(self.every)
    }

    fn on_step_end(&mut self, s: &StepEnd<'_>, emit: &mut Emit<'_>) -> Result<()> {
        if !self.wants_unscaled(s.global_step) {
            return Ok(());
        }
        let tensors = s
            .model
            .named_parameters()
            .into_iter()
            .zip(s.opt.grad_tensors())
            .map(|((n, p), m)| (n, p, m.grad()))
            .collect();
        emit(&Event::Tensors {
            global_step: s.global_step,
            tensors,
        });
        Ok(())
    }
}

/// Ends a run that has diverged rather than hit passing overflows (see
/// [`DivergenceConfig`]): without loss scaling at the first non-finite loss; with it after
/// 50 non-finite losses in a row, or when the recent steps' skips or the scale say so.
pub struct Divergence {
    config: DivergenceConfig,
    precision: Precision,
    bad_losses: usize,
    window: SkipWindow,
}

impl Divergence {
    /// Consecutive non-finite losses a loss-scaled run tolerates (each halves the scale).
    const MAX_BAD_LOSSES: usize = 50;

    /// The checks for a run of `precision`.
    pub fn new(config: DivergenceConfig, precision: Precision) -> Self {
        Divergence {
            config,
            precision,
            bad_losses: 0,
            window: SkipWindow::default(),
        }
    }
}

impl Callback for Divergence {
    fn after_backward(&mut self, b: &BackwardEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        // Under loss scaling a non-finite loss gives non-finite gradients: the step is
        // skipped and the scale backs off. Only a run that keeps producing them, or one
        // without a scaler, has diverged.
        self.bad_losses = if b.loss.is_finite() {
            0
        } else {
            self.bad_losses + 1
        };
        let scaled = self.precision.loss_scaling();
        if self.bad_losses > if scaled { Self::MAX_BAD_LOSSES } else { 0 } {
            let advice = if scaled {
                "lower the learning rate"
            } else if self.precision == Precision::Fp32 {
                "lower the learning rate, or add gradient clipping"
            } else {
                "lower the learning rate, or use a loss-scaled or F32 precision"
            };
            return Err(Error::Diverged(format!(
                "epoch {}, batch {}: the loss is {} ({} in a row); training diverged \
                 ({advice}); the last checkpoint is intact",
                b.epoch, b.batch, b.loss, self.bad_losses
            )));
        }
        Ok(())
    }

    fn on_step_end(&mut self, s: &StepEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        if !self.precision.loss_scaling() {
            return Ok(());
        }
        let d = &self.config;
        self.window
            .push(s.step_skipped, !s.loss.is_finite(), d.window);
        if let Some(why) = self.window.diverged(d, s.scale) {
            return Err(Error::Diverged(format!(
                "epoch {}, batch {}: {why}, loss scale {}; training diverged (lower the \
                 learning rate; the limit is --max-skipped-fraction {}); the last checkpoint \
                 is intact",
                s.epoch, s.batch, s.scale, d.max_skipped_fraction,
            )));
        }
        Ok(())
    }
}

/// A checkpoint after every epoch (rank 0), then the pruning `keep` / `keep_best` ask for.
pub struct EpochCheckpoints<'a> {
    cfg: &'a TrainConfig,
    info: &'a RunInfo,
    promoted: Option<Promoted>,
}

/// The modules `--auto-promote` moved to F32 so far (shared by the loop and the
/// checkpoints, which record them as the setting `promoted`).
pub type Promoted = std::rc::Rc<std::cell::RefCell<Vec<String>>>;

/// `info` with the promoted modules recorded (setting `promoted`, a JSON list).
pub fn with_promoted(info: &RunInfo, promoted: &[String]) -> RunInfo {
    let mut i = info.clone();
    if !promoted.is_empty() {
        i.settings.insert(
            "promoted".into(),
            serde_json::Value::from(promoted.to_vec()).to_string(),
        );
    }
    i
}

impl<'a> EpochCheckpoints<'a> {
    /// Checkpoints into `cfg.checkpoint_dir` (none without one), describing the run as
    /// `info`.
    pub fn new(cfg: &'a TrainConfig, info: &'a RunInfo) -> Self {
        EpochCheckpoints {
            cfg,
            info,
            promoted: None,
        }
    }

    /// Records the modules `--auto-promote` moved to F32 in every checkpoint.
    pub fn with_promoted(mut self, promoted: Promoted) -> Self {
        self.promoted = Some(promoted);
        self
    }
}

impl Callback for EpochCheckpoints<'_> {
    fn on_epoch_end(&mut self, e: &EpochEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        if let Some(dir) = &self.cfg.checkpoint_dir {
            let own;
            let (opt_state, scaler_state) = match e.saved_state {
                Some((o, s)) => (o, s.as_ref()),
                None => {
                    own = e.opt.state_dict();
                    (&own.0, own.1.as_ref())
                }
            };
            save_checkpoint(
                dir,
                e.model,
                opt_state,
                scaler_state,
                Progress::epoch(e.epoch),
                Some(e.test_accuracy),
                &match &self.promoted {
                    Some(p) => with_promoted(self.info, &p.borrow()),
                    None => self.info.clone(),
                },
            )?;
            checkpoint::prune_checkpoints(dir, self.cfg.keep, self.cfg.keep_best)?;
        }
        Ok(())
    }
}

/// A testing aid (`TrainConfig::inject_inf`): on rank `.0`, after the gradients of step `.1`
/// were reduced, the first gradient value of the first parameter that has one becomes
/// +inf, so that the found-inf reduction must make every rank skip that step.
pub struct InjectInf {
    at: (usize, u64),
}

impl InjectInf {
    /// At (rank, global step).
    pub fn new(at: (usize, u64)) -> Self {
        InjectInf { at }
    }
}

impl Callback for InjectInf {
    fn after_backward(&mut self, b: &BackwardEnd<'_>, _emit: &mut Emit<'_>) -> Result<()> {
        if (b.rank, b.global_step) == self.at {
            inject_inf(b.opt.optimizer().params())?;
        }
        Ok(())
    }
}

/// Sets the first gradient value of the first parameter that has one to +inf.
fn inject_inf(params: &[Tensor]) -> Result<()> {
    for p in params {
        if let Some(g) = p.grad() {
            let mut v = g.try_to_vec_f32()?;
            if let Some(x) = v.first_mut() {
                *x = f32::INFINITY;
                let inf = Tensor::from_f32_vec(v, g.shape(), g.dtype())?.to_device(g.device())?;
                p.set_grad(Some(inf));
                return Ok(());
            }
        }
    }
    Ok(())
}
