//! Learning-rate schedules as closed forms of the step count (PyTorch's
//! `_get_closed_form_lr`), and `Scheduler`, which applies one to an optimizer.
//!
//! A schedule is a pure function `lr_at(base_lr, t)`: no hidden recursion on the previous
//! lr, so a resumed run only needs the step count to continue exactly (`SchedulerState`).
//! Whether a step is an epoch or a batch is the caller's choice: `t` counts calls to
//! `Scheduler::step`.

use super::optimizer::Optimizer;
use crate::error::{Error, Result};

/// A learning-rate schedule: the lr after `t` scheduler steps for a run that starts at
/// `base_lr`.
pub trait LrScheduler: Send + Sync {
    /// The learning rate after `t` scheduler steps of a run whose initial lr is `base_lr`.
    fn lr_at(&self, base_lr: f64, t: u64) -> f64;

    /// Checks the schedule's parameters (called by `Scheduler::new`).
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

/// A boxed schedule is a schedule (the CLI picks one at run time).
impl LrScheduler for Box<dyn LrScheduler> {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        (**self).lr_at(base_lr, t)
    }
    fn validate(&self) -> Result<()> {
        (**self).validate()
    }
}

/// Decays the lr by `gamma` every `step_size` steps (PyTorch's `StepLR`):
/// `base_lr * gamma^floor(t / step_size)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLR {
    /// Steps between two decays, > 0.
    pub step_size: u64,
    /// The factor applied at each decay (0.1 typically).
    pub gamma: f64,
}

impl LrScheduler for StepLR {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        let k = t / self.step_size.max(1);
        base_lr * self.gamma.powf(k as f64)
    }

    fn validate(&self) -> Result<()> {
        if self.step_size == 0 || !self.gamma.is_finite() {
            return Err(Error::arg(
                "StepLR",
                format!("need step_size > 0 and a finite gamma, got {self:?}"),
            ));
        }
        Ok(())
    }
}

/// Decays the lr by `gamma` at each milestone (PyTorch's `MultiStepLR`):
/// `base_lr * gamma^(number of milestones <= t)`.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiStepLR {
    /// Steps at which the lr drops, increasing.
    pub milestones: Vec<u64>,
    /// The factor applied at each milestone (0.1 typically).
    pub gamma: f64,
}

impl LrScheduler for MultiStepLR {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        let k = self.milestones.iter().filter(|&&m| m <= t).count();
        base_lr * self.gamma.powi(k as i32)
    }

    fn validate(&self) -> Result<()> {
        let increasing = self.milestones.windows(2).all(|w| w[0] < w[1]);
        if !increasing || !self.gamma.is_finite() || self.milestones.len() > i32::MAX as usize {
            return Err(Error::arg(
                "MultiStepLR",
                format!("need increasing milestones and a finite gamma, got {self:?}"),
            ));
        }
        Ok(())
    }
}

/// Cosine annealing from `base_lr` down to `eta_min` over `t_max` steps (PyTorch's
/// `CosineAnnealingLR`, closed form, no restarts):
/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * t / t_max)) / 2`.
/// Past `t_max` the cosine climbs back up, as PyTorch's closed form does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineAnnealingLR {
    /// Steps of one half cosine period, > 0 (the step at which the lr reaches `eta_min`).
    pub t_max: u64,
    /// The lowest lr, reached at `t_max`.
    pub eta_min: f64,
}

impl LrScheduler for CosineAnnealingLR {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        let x = std::f64::consts::PI * t as f64 / self.t_max.max(1) as f64;
        self.eta_min + (base_lr - self.eta_min) * (1.0 + x.cos()) / 2.0
    }

    fn validate(&self) -> Result<()> {
        if self.t_max == 0 || !self.eta_min.is_finite() {
            return Err(Error::arg(
                "CosineAnnealingLR",
                format!("need t_max > 0 and a finite eta_min, got {self:?}"),
            ));
        }
        Ok(())
    }
}

/// Linear decay from `base_lr` to 0 over `total_steps` (PyTorch's `LinearLR(start_factor=1,
/// end_factor=0, total_iters=total_steps)`; after a warm-up, the decay of Hugging Face's
/// `get_linear_schedule_with_warmup`): `base_lr * max(0, 1 - t / total_steps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearDecay {
    /// Steps until the lr reaches 0, > 0.
    pub total_steps: u64,
}

impl LrScheduler for LinearDecay {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        let frac = t.min(self.total_steps) as f64 / self.total_steps.max(1) as f64;
        base_lr * (1.0 - frac)
    }

    fn validate(&self) -> Result<()> {
        if self.total_steps == 0 {
            return Err(Error::arg("LinearDecay", "need total_steps > 0"));
        }
        Ok(())
    }
}

/// Linear warm-up from `start_factor * base_lr` to `base_lr` over `warmup_steps` steps,
/// then `after` (if any) run from its own step 0, or the constant `base_lr`.
///
/// Without `after` this is PyTorch's `LinearLR(start_factor, end_factor=1, total_iters=
/// warmup_steps)`: `base_lr * (start_factor + (1 - start_factor) * min(t, warmup) / warmup)`.
/// With it, it is `SequentialLR([LinearLR(..), after], milestones=[warmup_steps])`: at step
/// `t >= warmup_steps` the lr is `after.lr_at(base_lr, t - warmup_steps)` (warm-up then
/// cosine: `after = CosineAnnealingLR { t_max: total - warmup, .. }`).
pub struct LinearWarmup {
    /// Steps of the warm-up (0: none).
    pub warmup_steps: u64,
    /// The fraction of `base_lr` at step 0, in (0, 1].
    pub start_factor: f64,
    /// The schedule after the warm-up, counted from its own step 0; `None`: a constant
    /// `base_lr`.
    pub after: Option<Box<dyn LrScheduler>>,
}

impl LinearWarmup {
    /// Warm-up followed by a constant lr.
    pub fn new(warmup_steps: u64, start_factor: f64) -> LinearWarmup {
        LinearWarmup {
            warmup_steps,
            start_factor,
            after: None,
        }
    }

    /// Warm-up followed by `after`.
    pub fn then(self, after: impl LrScheduler + 'static) -> LinearWarmup {
        LinearWarmup {
            after: Some(Box::new(after)),
            ..self
        }
    }
}

impl LrScheduler for LinearWarmup {
    fn lr_at(&self, base_lr: f64, t: u64) -> f64 {
        if t < self.warmup_steps {
            let frac = t as f64 / self.warmup_steps as f64;
            return base_lr * (self.start_factor + (1.0 - self.start_factor) * frac);
        }
        match &self.after {
            Some(s) => s.lr_at(base_lr, t - self.warmup_steps),
            None => base_lr,
        }
    }

    fn validate(&self) -> Result<()> {
        // PyTorch's LinearLR bound: a zero start would make the first step's lr 0.
        if !(self.start_factor > 0.0 && self.start_factor <= 1.0) {
            return Err(Error::arg(
                "LinearWarmup",
                format!("start_factor must be in (0, 1], got {}", self.start_factor),
            ));
        }
        self.after.as_ref().map_or(Ok(()), |s| s.validate())
    }
}

/// The saved form of a `Scheduler`: everything it needs to continue a run exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerState {
    /// The optimizer's lr when the scheduler was created: the lr the schedule scales.
    pub base_lr: f64,
    /// Scheduler steps taken so far.
    pub step: u64,
}

/// Applies a schedule to an optimizer: `new` records the optimizer's lr as `base_lr` and
/// sets `lr_at(base_lr, 0)`; each `step` advances the count and sets the next lr (call it
/// after `optimizer.step()`, as in PyTorch).
pub struct Scheduler {
    schedule: Box<dyn LrScheduler>,
    base_lr: f64,
    step: u64,
}

impl Scheduler {
    /// Starts `schedule` on `opt`: records its current lr as `base_lr`, sets the lr of step
    /// 0 and checks the schedule's parameters ([`Error::Arg`] when invalid).
    pub fn new(schedule: impl LrScheduler + 'static, opt: &mut dyn Optimizer) -> Result<Self> {
        schedule.validate()?;
        let s = Scheduler {
            schedule: Box::new(schedule),
            base_lr: opt.lr(),
            step: 0,
        };
        opt.set_lr(s.lr());
        Ok(s)
    }

    /// Advances one step and sets the optimizer's lr for it.
    pub fn step(&mut self, opt: &mut dyn Optimizer) {
        self.step += 1;
        opt.set_lr(self.lr());
    }

    /// The lr for the current step.
    pub fn lr(&self) -> f64 {
        self.schedule.lr_at(self.base_lr, self.step)
    }

    /// The lr the schedule starts from (the optimizer's lr when `new` ran).
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Scheduler steps taken so far.
    pub fn last_step(&self) -> u64 {
        self.step
    }

    /// The position to save with a checkpoint (restore it with `load_state`).
    pub fn state(&self) -> SchedulerState {
        SchedulerState {
            base_lr: self.base_lr,
            step: self.step,
        }
    }

    /// Restores a saved position and sets the optimizer's lr for it (the same value a
    /// restored optimizer state carries).
    pub fn load_state(&mut self, state: &SchedulerState, opt: &mut dyn Optimizer) -> Result<()> {
        if !state.base_lr.is_finite() || state.base_lr < 0.0 {
            return Err(Error::arg(
                "Scheduler::load_state",
                format!("invalid base_lr {}", state.base_lr),
            ));
        }
        self.base_lr = state.base_lr;
        self.step = state.step;
        opt.set_lr(self.lr());
        Ok(())
    }
}
