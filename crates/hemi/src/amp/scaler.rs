//! Dynamic loss scaling: PyTorch's `torch.amp.GradScaler`, plus the hysteresis, minimum and
//! maximum scale that DeepSpeed and apex add.
//!
//! Why: an F16 gradient below 2^-24 (6e-8) rounds to zero. Multiplying the loss by a large
//! scale S before `backward` multiplies every gradient by S and lifts the small ones into
//! F16's range; the scaler divides the gradients by S again (in F32) before the optimizer
//! sees them. Too large an S overflows some gradient to inf: that step is skipped and S
//! backs off; after `growth_interval` clean steps S grows again, so it hovers just below
//! the overflow threshold.
//!
//! The arithmetic is PyTorch's, bit for bit (`tests/models/torch_parity.rs`): the scale is an F32
//! (PyTorch keeps it in a one-element F32 tensor), so it can never exceed 2^127 (a growth whose
//! F32 result would be inf is refused); growth and backoff multiply it in f64 and round the
//! product to F32 once (`_amp_update_scale_cpu_kernel`); unscaling multiplies each F32
//! gradient by `inv = f32(1 / f64(scale))` and looks for inf/NaN in the scaled gradients it
//! reads (`_amp_foreach_non_finite_check_and_unscale_`).
//!
//! Two pieces: `LossScale`, the scale's state machine (shared with `Fp16Optimizer`), and
//! `GradScaler`, which adds PyTorch's per-optimizer protocol around it:
//!
//! ```text
//!           unscale_()              step()
//!   READY ─────────────▶ UNSCALED ─────────▶ STEPPED      update() returns every
//!     │                                 ▲                  optimizer to READY
//!     └──────────── step() ─────────────┘ (unscales first)
//! ```
//! `unscale_` twice, `unscale_` after `step`, `step` twice, or `update` with no optimizer
//! unscaled are errors, as in PyTorch.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::tensor::{Tensor, TensorId};

/// Configuration of a dynamic loss scale (PyTorch's `GradScaler` arguments and defaults,
/// plus DeepSpeed's `hysteresis` and `min_loss_scale` and apex's `max_loss_scale`). The
/// defaults are PyTorch's and reproduce its trajectory exactly; the extras are opt-in.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The scale before the first step (PyTorch: 2^16), rounded to F32 as PyTorch does.
    pub init_scale: f64,
    /// Multiplier applied after `growth_interval` consecutive clean steps (> 1).
    pub growth_factor: f64,
    /// Multiplier applied on an overflow (in (0, 1)).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows (>= 1).
    pub growth_interval: u64,
    /// False: the scaler does nothing (`scale` is the identity, `step` just steps).
    pub enabled: bool,
    /// DeepSpeed's `hysteresis` (its `delayed_shift`): overflows absorbed before the scale
    /// backs off. 1 (PyTorch) backs off on every overflow. With n > 1, the first n - 1
    /// overflows only count the budget down (the step is still skipped); once it is down to
    /// one, every overflow backs off. The budget is restored to n whenever the scale reaches
    /// a growth point (`growth_interval` clean steps in a row), as DeepSpeed's
    /// `DynamicLossScaler` does without `consecutive_hysteresis`.
    pub hysteresis: u32,
    /// A floor for the scale (DeepSpeed's `min_loss_scale`): a backoff never goes below it.
    /// At the floor, overflowing steps are still skipped and training goes on; the first
    /// time the floor stops a backoff, a warning is printed once.
    pub min_scale: Option<f64>,
    /// A ceiling for the scale: growth never exceeds it. `None` (PyTorch; also apex's
    /// `FP16_Optimizer`): only F32's range bounds it, at 2^127 for power-of-two factors.
    /// apex's `amp` (opt levels O1/O2) caps at `Some(2^24)` (its `max_loss_scale`).
    pub max_scale: Option<f64>,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
            hysteresis: 1,
            min_scale: None,
            max_scale: None,
        }
    }
}

impl GradScalerConfig {
    /// Checks the values; `scale` stands for the initial (or restored) scale, which must be
    /// finite and > 0 once rounded to F32.
    fn validate(&self, op: &'static str, scale: f64) -> Result<()> {
        let bad = |msg: String| Err(Error::arg(op, msg));
        let s32 = scale as f32;
        if !(s32.is_finite() && s32 > 0.0) {
            return bad(format!(
                "the scale must be finite and > 0 in F32, got {scale}"
            ));
        }
        let scale = f64::from(s32);
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(format!(
                "growth_factor must be finite and > 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return bad("growth_interval must be >= 1, got 0".into());
        }
        if self.hysteresis == 0 {
            return bad("hysteresis must be >= 1, got 0".into());
        }
        if let Some(m) = self.min_scale {
            if !(m.is_finite() && m > 0.0 && m <= scale) {
                return bad(format!(
                    "min_scale must be finite, > 0 and <= the scale {scale}, got {m}"
                ));
            }
        }
        if let Some(m) = self.max_scale {
            if m.is_nan() || m < scale {
                return bad(format!("max_scale must be >= the scale {scale}, got {m}"));
            }
        }
        Ok(())
    }
}

/// The dynamic loss-scale state machine (PyTorch's `_amp_update_scale_` rule plus
/// hysteresis, min and max), shared by `GradScaler` and `Fp16Optimizer`. Also usable as a
/// static scale (`fixed`).
///
/// One `update(found_inf)` per step:
/// ```text
/// found_inf:  growth_tracker = 0
///             if hysteresis_left > 1 { hysteresis_left -= 1 }           (absorbed)
///             else { scale = f32(max(scale * backoff_factor, min_scale)) }
/// clean:      growth_tracker += 1
///             if growth_tracker == growth_interval {
///                 growth_tracker = 0; hysteresis_left = hysteresis
///                 grown = f32(min(scale * growth_factor, max_scale))
///                 if grown is finite { scale = grown }
///             }
/// ```
/// The scale is an F32; the products are taken in f64 and rounded to F32 once, as PyTorch's
/// kernel does (`float * double` stored into a float). With hysteresis 1 and no min/max this
/// is exactly PyTorch's rule.
#[derive(Clone, Debug)]
pub struct LossScale {
    cfg: GradScalerConfig,
    /// False for a static scale: `update` counts steps but never changes the scale.
    dynamic: bool,
    /// F32, as PyTorch's scale tensor: never inf, at most 2^127 with a growth factor of 2.
    scale: f32,
    growth_tracker: u64,
    hysteresis_left: u32,
    skipped: u64,
    steps: u64,
    /// The min_scale warning has been printed.
    warned_min: bool,
}

impl LossScale {
    /// A dynamic scale. Errors unless `init_scale` is finite and > 0, `growth_factor` > 1,
    /// `backoff_factor` in (0, 1), `growth_interval` and `hysteresis` >= 1, and
    /// `min_scale <= init_scale <= max_scale`. A disabled config gives a scale of 1 that
    /// never changes.
    pub fn new(cfg: GradScalerConfig) -> Result<LossScale> {
        cfg.validate("LossScale::new", cfg.init_scale)?;
        Ok(LossScale {
            dynamic: true,
            scale: cfg.init_scale as f32,
            growth_tracker: 0,
            hysteresis_left: cfg.hysteresis,
            skipped: 0,
            steps: 0,
            warned_min: false,
            cfg,
        })
    }

    /// A static scale that never changes (apex's `static_loss_scale`), rounded to F32 like
    /// every scale (apex multiplies F32 tensors by it); overflowing steps are still counted
    /// as skipped.
    pub fn fixed(scale: f64) -> Result<LossScale> {
        let cfg = GradScalerConfig {
            init_scale: scale,
            min_scale: None,
            max_scale: None,
            ..GradScalerConfig::default()
        };
        cfg.validate("LossScale::fixed", scale)?;
        let mut s = LossScale::new(cfg)?;
        s.dynamic = false;
        Ok(s)
    }

    /// The current scale (1 when the config is disabled); an F32 value.
    pub fn scale(&self) -> f64 {
        if self.cfg.enabled {
            f64::from(self.scale)
        } else {
            1.0
        }
    }

    /// `1 / scale` as the unscaling multiplies by it: the reciprocal taken in f64 and rounded
    /// to F32 once (PyTorch's `scale.double().reciprocal().float()`).
    pub fn inv_scale(&self) -> f32 {
        (1.0 / self.scale()) as f32
    }

    /// True for a dynamic scale, false for `fixed`.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// The configuration the scale was built with.
    pub fn config(&self) -> &GradScalerConfig {
        &self.cfg
    }

    /// One step's decision: `found_inf` says whether the step's gradients held inf or NaN
    /// (that step was skipped).
    pub fn update(&mut self, found_inf: bool) {
        self.steps += 1;
        if found_inf {
            self.skipped += 1;
        }
        if !self.dynamic || !self.cfg.enabled {
            return;
        }
        if found_inf {
            self.growth_tracker = 0;
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
            } else {
                self.back_off();
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.cfg.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_left = self.cfg.hysteresis;
                let mut grown = f64::from(self.scale) * self.cfg.growth_factor;
                if let Some(m) = self.cfg.max_scale {
                    grown = grown.min(m);
                }
                // Grows only if the F32 result is finite: never past F32's range to inf.
                let grown = grown as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
            }
        }
    }

    fn back_off(&mut self) {
        let mut next = f64::from(self.scale) * self.cfg.backoff_factor;
        if let Some(m) = self.cfg.min_scale {
            if next < m {
                next = m;
                if !self.warned_min {
                    self.warned_min = true;
                    eprintln!(
                        "hemi: loss scale reached its minimum {m}; overflowing steps are still \
                         skipped but the scale no longer backs off (the model may be diverging)"
                    );
                }
            }
        }
        self.scale = next as f32;
    }

    /// Sets the scale, rounded to F32 (PyTorch's `update(new_scale)`, a `fill_` of its F32
    /// tensor); the growth tracker and hysteresis are kept. Errors unless `s` is finite and
    /// > 0 in F32 and within [min_scale, max_scale].
    pub fn set_scale(&mut self, s: f64) -> Result<()> {
        const OP: &str = "LossScale::set_scale";
        let s32 = s as f32;
        if !(s32.is_finite() && s32 > 0.0) {
            return Err(Error::arg(
                OP,
                format!("the scale must be finite and > 0, got {s}"),
            ));
        }
        if self.cfg.min_scale.is_some_and(|m| s < m) || self.cfg.max_scale.is_some_and(|m| s > m) {
            return Err(Error::arg(
                OP,
                format!(
                    "scale {s} is outside [min_scale, max_scale] = [{:?}, {:?}]",
                    self.cfg.min_scale, self.cfg.max_scale
                ),
            ));
        }
        self.scale = s32;
        Ok(())
    }

    /// Steps whose gradients held inf or NaN so far.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// `update` calls so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The state and configuration as plain data (`ScalerState` lists the names).
    pub fn state(&self) -> ScalerState {
        let c = &self.cfg;
        let flag = |b: bool| f64::from(u8::from(b));
        let mut scalars = vec![
            ("scale", f64::from(self.scale)),
            ("growth_tracker", self.growth_tracker as f64),
            ("hysteresis_left", f64::from(self.hysteresis_left)),
            ("skipped_steps", self.skipped as f64),
            ("steps", self.steps as f64),
            ("growth_factor", c.growth_factor),
            ("backoff_factor", c.backoff_factor),
            ("growth_interval", c.growth_interval as f64),
            ("hysteresis", f64::from(c.hysteresis)),
        ];
        if let Some(m) = c.min_scale {
            scalars.push(("min_scale", m));
        }
        if let Some(m) = c.max_scale {
            scalars.push(("max_scale", m));
        }
        scalars.push(("enabled", flag(c.enabled)));
        scalars.push(("dynamic", flag(self.dynamic)));
        ScalerState {
            scalars: scalars
                .into_iter()
                .map(|(n, v)| (n.to_string(), v))
                .collect(),
        }
    }

    /// Restores a state saved by `state`: the scale, counters and configuration all come
    /// from it (as PyTorch's `load_state_dict`). Its `enabled` and `dynamic` flags must match
    /// this scale's. On error nothing changes.
    pub fn load_state(&mut self, s: &ScalerState) -> Result<()> {
        const OP: &str = "LossScale::load_state";
        let mut r = ScalarReader::new(OP, &s.scalars);
        let enabled = r.flag("enabled")?;
        let dynamic = r.flag("dynamic")?;
        if enabled != self.cfg.enabled || dynamic != self.dynamic {
            let kind = |e: bool, d: bool| {
                format!(
                    "{} {}",
                    if e { "enabled" } else { "disabled" },
                    if d { "dynamic" } else { "static" }
                )
            };
            return Err(Error::arg(
                OP,
                format!(
                    "state of a {} loss scale loaded into a {} one",
                    kind(enabled, dynamic),
                    kind(self.cfg.enabled, self.dynamic)
                ),
            ));
        }
        let scale = r.scalar("scale")?;
        let cfg = GradScalerConfig {
            init_scale: self.cfg.init_scale,
            growth_factor: r.scalar("growth_factor")?,
            backoff_factor: r.scalar("backoff_factor")?,
            growth_interval: r.count("growth_interval")?,
            enabled,
            hysteresis: u32::try_from(r.count("hysteresis")?)
                .map_err(|_| Error::arg(OP, "hysteresis does not fit in u32"))?,
            min_scale: r.optional("min_scale"),
            max_scale: r.optional("max_scale"),
        };
        cfg.validate(OP, scale)?;
        let growth_tracker = r.count("growth_tracker")?;
        let hysteresis_left = r.count("hysteresis_left")?;
        let skipped = r.count("skipped_steps")?;
        let steps = r.count("steps")?;
        r.finish()?;
        if growth_tracker >= cfg.growth_interval {
            return Err(Error::arg(
                OP,
                format!(
                    "growth_tracker {growth_tracker} must be below growth_interval {}",
                    cfg.growth_interval
                ),
            ));
        }
        if hysteresis_left == 0 || hysteresis_left > u64::from(cfg.hysteresis) {
            return Err(Error::arg(
                OP,
                format!(
                    "hysteresis_left {hysteresis_left} must be in 1..={}",
                    cfg.hysteresis
                ),
            ));
        }
        if skipped > steps {
            return Err(Error::arg(
                OP,
                format!("skipped_steps {skipped} exceeds steps {steps}"),
            ));
        }
        self.cfg = cfg;
        self.scale = scale as f32;
        self.growth_tracker = growth_tracker;
        self.hysteresis_left = hysteresis_left as u32;
        self.skipped = skipped;
        self.steps = steps;
        Ok(())
    }
}

/// A loss scale's state as plain data for checkpoints: name/value pairs, integers exact in
/// f64, flags 0/1. Names: `scale`, `growth_tracker`, `hysteresis_left`, `skipped_steps`,
/// `steps`, and the configuration `growth_factor`, `backoff_factor`, `growth_interval`,
/// `hysteresis`, `min_scale` / `max_scale` (absent when `None`), `enabled`, `dynamic`.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalerState {
    /// The state's values by name (see the type's documentation for the names).
    pub scalars: Vec<(String, f64)>,
}

impl ScalerState {
    /// The value named `name`, if present.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.scalars
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, v)| v)
    }
}

/// Hands out named scalars and notices the ones nobody asked for (an unknown name means the
/// state came from something else).
pub(crate) struct ScalarReader<'a> {
    op: &'static str,
    scalars: &'a [(String, f64)],
    used: Vec<bool>,
}

impl<'a> ScalarReader<'a> {
    pub(crate) fn new(op: &'static str, scalars: &'a [(String, f64)]) -> Self {
        ScalarReader {
            op,
            scalars,
            used: vec![false; scalars.len()],
        }
    }

    pub(crate) fn optional(&mut self, name: &str) -> Option<f64> {
        let i = self.scalars.iter().position(|(n, _)| n == name)?;
        self.used[i] = true;
        Some(self.scalars[i].1)
    }

    pub(crate) fn scalar(&mut self, name: &str) -> Result<f64> {
        self.optional(name)
            .ok_or_else(|| Error::arg(self.op, format!("state has no scalar {name:?}")))
    }

    /// A required non-negative integer (exact in f64).
    pub(crate) fn count(&mut self, name: &str) -> Result<u64> {
        let v = self.scalar(name)?;
        if v >= 0.0 && v.fract() == 0.0 && v <= 2f64.powi(53) {
            Ok(v as u64)
        } else {
            Err(Error::arg(
                self.op,
                format!("state {name:?} is {v}, expected a non-negative integer"),
            ))
        }
    }

    pub(crate) fn flag(&mut self, name: &str) -> Result<bool> {
        match self.scalar(name)? {
            0.0 => Ok(false),
            1.0 => Ok(true),
            v => Err(Error::arg(
                self.op,
                format!("state flag {name:?} is {v}, expected 0 or 1"),
            )),
        }
    }

    pub(crate) fn finish(self) -> Result<()> {
        let unused: Vec<&str> = (self.scalars.iter().zip(&self.used))
            .filter(|(_, &u)| !u)
            .map(|((n, _), _)| n.as_str())
            .collect();
        if unused.is_empty() {
            Ok(())
        } else {
            Err(Error::arg(
                self.op,
                format!("state has entries this loss scale does not use: {unused:?}"),
            ))
        }
    }
}

// ----- the fused unscale kernel -----------------------------------------------------------

/// A one-element F32 flag on `device`, 0 until an unscale finds inf or NaN.
pub(crate) fn found_inf_flag(device: crate::Device) -> Result<Tensor> {
    Tensor::zeros(&[1], DType::F32)?.to_device(device)
}

/// The gradient `g` times `inv` (F32; F64 for an F64 gradient) as a new contiguous tensor on
/// g's device, setting `found_inf` (from `found_inf_flag`, same device) when `g` holds inf
/// or NaN: one pass of the backend's fused `unscale_check`.
pub(crate) fn unscale(g: &Tensor, inv: f32, found_inf: &Tensor) -> Result<Tensor> {
    let gs = g.storage();
    let out = found_inf.with_storage_mut(|f| gs.unscale_check(g.layout(), inv, f))?;
    Ok(Tensor::from_storage(
        std::sync::Arc::new(out),
        crate::tensor::Layout::contiguous(g.shape()),
    ))
}

/// The found-inf flag for `device` in `flags`, created on first use.
pub(crate) fn flag_for(
    flags: &mut std::collections::BTreeMap<crate::Device, Tensor>,
    device: crate::Device,
) -> Result<&Tensor> {
    if let std::collections::btree_map::Entry::Vacant(e) = flags.entry(device) {
        e.insert(found_inf_flag(device)?);
    }
    Ok(&flags[&device])
}

/// Whether any of the flags was set (one read back per device).
pub(crate) fn any_found(flags: &std::collections::BTreeMap<crate::Device, Tensor>) -> Result<bool> {
    for f in flags.values() {
        if f.to_scalar()? != 0.0 {
            return Ok(true);
        }
    }
    Ok(false)
}

// ----- GradScaler -------------------------------------------------------------------------

/// Where an optimizer is in the current iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// One optimizer's record since the last `update`.
#[derive(Clone, Copy, Debug)]
struct OptRecord {
    stage: Stage,
    /// Set by `unscale_`: whether its gradients held inf or NaN.
    found_inf: Option<bool>,
}

/// PyTorch's `torch.amp.GradScaler` over hemi's optimizers:
///
/// ```text
/// scaler.scale(&loss)?.backward()?;
/// scaler.unscale_(&opt)?;                // optional: to clip or inspect true gradients
/// clip_grad_norm(opt.params(), 1.0, 2.0)?;
/// scaler.step(&mut opt)?;                // skipped when a gradient is inf/NaN
/// scaler.update()?;                      // backs off or grows the scale
/// ```
///
/// The scaler never sees the model: it reaches the gradients through the optimizer's
/// parameters, and tells optimizers apart by their parameters' ids. Several optimizers may
/// share one scaler: each skips its own step when its own gradients overflow, and `update`
/// backs off if any of them overflowed.
///
/// Gradients must be F32 (or F64): unscaling an F16 gradient in F16 is what loss scaling
/// exists to avoid, so F16/BF16 gradients are an error (keep F32 parameters under autocast,
/// or wrap an F16 model's optimizer in `Fp16Optimizer`).
pub struct GradScaler {
    loss: LossScale,
    records: HashMap<Vec<TensorId>, OptRecord>,
    sync: Option<FoundInfSync>,
}

/// Combines this process's found-inf flag with the other ranks' (data-parallel training:
/// true when any rank found inf or NaN), so that every rank skips or steps together and the
/// scale stays the same everywhere.
pub type FoundInfSync = std::sync::Arc<dyn Fn(bool) -> Result<bool> + Send + Sync>;

impl GradScaler {
    /// Errors on invalid configuration values (see `LossScale::new`).
    pub fn new(cfg: GradScalerConfig) -> Result<GradScaler> {
        Ok(GradScaler {
            loss: LossScale::new(cfg)?,
            records: HashMap::new(),
            sync: None,
        })
    }

    /// Reduces every found-inf flag through `sync` before it decides a step (data-parallel
    /// training; `None`: this process alone).
    pub fn set_found_inf_sync(&mut self, sync: Option<FoundInfSync>) {
        self.sync = sync;
    }

    fn key(opt: &dyn Optimizer) -> Vec<TensorId> {
        opt.params().iter().map(Tensor::id).collect()
    }

    /// `loss * scale`, recorded by autograd. An F16/BF16 loss is cast to F32 first, so that
    /// the scaled loss itself cannot overflow (its gradient is cast back down on the way
    /// into the half-precision graph). Disabled: the loss itself.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.is_enabled() {
            return Ok(loss.clone());
        }
        scale_loss(loss, self.loss.scale())
    }

    /// Divides `opt`'s gradients by the scale, in place (in F32), and records whether any of
    /// them holds inf or NaN. Call it before clipping or inspecting gradients; `step` calls
    /// it otherwise. Errors when called twice for `opt` before `update`, after `step`, or on
    /// F16/BF16 gradients (nothing is changed then).
    pub fn unscale_(&mut self, opt: &dyn Optimizer) -> Result<()> {
        const OP: &str = "GradScaler::unscale_";
        if !self.is_enabled() {
            return Ok(());
        }
        let key = Self::key(opt);
        match self.records.get(&key).map(|r| r.stage) {
            Some(Stage::Unscaled) => {
                return Err(Error::Msg(format!(
                    "{OP}: unscale_() has already been called on this optimizer since the last update()"
                )))
            }
            Some(Stage::Stepped) => {
                return Err(Error::Msg(format!(
                    "{OP}: unscale_() is being called after step(); call update() first"
                )))
            }
            _ => {}
        }
        let params = opt.params();
        for (i, p) in params.iter().enumerate() {
            if let Some(g) = p.grad() {
                match g.dtype() {
                    DType::F32 | DType::F64 => {}
                    dt @ (DType::F16 | DType::BF16) => {
                        return Err(Error::dtype(
                            OP,
                            dt,
                            format!(
                                "parameter {i} has a {dt} gradient; loss scaling needs F32 gradients \
                                 (unscaling in half precision would underflow or overflow them again). \
                                 Keep F32 master weights: train F32 parameters under amp-fp16 autocast, \
                                 or wrap the optimizer of an F16 model in Fp16Optimizer"
                            ),
                        ));
                    }
                    dt => {
                        return Err(Error::dtype(
                            OP,
                            dt,
                            format!("gradient of parameter {i} is not a float tensor"),
                        ))
                    }
                }
            }
        }
        let inv = self.loss.inv_scale();
        let mut flags = std::collections::BTreeMap::new();
        for p in params {
            let Some(g) = p.grad() else { continue };
            let flag = flag_for(&mut flags, g.device())?;
            p.set_grad(Some(unscale(&g, inv, flag)?));
        }
        let mut found_inf = any_found(&flags)?;
        if let Some(sync) = &self.sync {
            found_inf = sync(found_inf)?;
        }
        self.records.insert(
            key,
            OptRecord {
                stage: Stage::Unscaled,
                found_inf: Some(found_inf),
            },
        );
        Ok(())
    }

    /// Unscales `opt`'s gradients (unless `unscale_` already did) and runs `opt.step()`
    /// unless a gradient held inf or NaN. Returns whether it stepped. Errors when `opt`
    /// already stepped since the last `update`. Disabled: just `opt.step()`.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<bool> {
        if !self.is_enabled() {
            opt.step()?;
            return Ok(true);
        }
        let key = Self::key(opt);
        let stage = self.records.get(&key).map_or(Stage::Ready, |r| r.stage);
        match stage {
            Stage::Stepped => {
                return Err(Error::Msg(
                    "GradScaler::step: step() has already been called since the last update()"
                        .into(),
                ))
            }
            Stage::Ready => self.unscale_(&*opt)?,
            Stage::Unscaled => {}
        }
        let record = self
            .records
            .get_mut(&key)
            .expect("unscale_ recorded this optimizer");
        let found_inf = record.found_inf.expect("unscale_ recorded found_inf");
        if !found_inf {
            opt.step()?;
        }
        record.stage = Stage::Stepped;
        Ok(!found_inf)
    }

    /// Ends the iteration: backs the scale off if any optimizer unscaled since the last
    /// `update` found inf or NaN, grows it after `growth_interval` clean iterations, and
    /// returns every optimizer to READY. Errors when no optimizer was unscaled or stepped
    /// (PyTorch's "No inf checks were recorded prior to update."). Disabled: nothing.
    pub fn update(&mut self) -> Result<()> {
        if !self.is_enabled() {
            return Ok(());
        }
        let infs: Vec<bool> = self.records.values().filter_map(|r| r.found_inf).collect();
        if infs.is_empty() {
            return Err(Error::Msg(
                "GradScaler::update: no inf checks were recorded prior to update(); call \
                 step(&mut optimizer) (or unscale_) for at least one optimizer first"
                    .into(),
            ));
        }
        self.loss.update(infs.contains(&true));
        self.records.clear();
        Ok(())
    }

    /// Sets the scale directly, rounded to F32 (PyTorch's `update(new_scale)`), and returns
    /// every optimizer to READY; no inf checks are needed and the growth tracker is kept.
    /// Errors unless the new scale is finite and > 0 in F32 and within [min_scale,
    /// max_scale]. Disabled: nothing.
    pub fn update_to(&mut self, new_scale: f64) -> Result<()> {
        if !self.is_enabled() {
            return Ok(());
        }
        self.loss.set_scale(new_scale)?;
        self.records.clear();
        Ok(())
    }

    /// The current scale, an F32 value; 1 when disabled (as PyTorch).
    pub fn get_scale(&self) -> f64 {
        self.loss.scale()
    }

    /// False for a scaler built with `enabled: false` (PyTorch's
    /// `GradScaler(enabled=False)`): then `scale` returns the loss unchanged and `step`
    /// simply steps.
    pub fn is_enabled(&self) -> bool {
        self.loss.config().enabled
    }

    /// Iterations (updates) whose gradients held inf or NaN so far.
    pub fn skipped_steps(&self) -> u64 {
        self.loss.skipped_steps()
    }

    /// The loss scale's state machine (read-only).
    pub fn loss_scale(&self) -> &LossScale {
        &self.loss
    }

    /// The scale, counters and configuration (`ScalerState`); a disabled scaler's state has
    /// `enabled` 0.
    pub fn state_dict(&self) -> ScalerState {
        self.loss.state()
    }

    /// Restores a state saved by `state_dict`; errors (changing nothing) on a state of a
    /// disabled scaler loaded into an enabled one or the reverse, or on invalid values.
    pub fn load_state_dict(&mut self, s: &ScalerState) -> Result<()> {
        self.loss.load_state(s)
    }
}

/// `loss * scale` in at least F32 (F16/BF16 losses are cast up first), recorded by autograd.
pub(crate) fn scale_loss(loss: &Tensor, scale: f64) -> Result<Tensor> {
    let l = match loss.dtype() {
        DType::F16 | DType::BF16 => loss.to_dtype(DType::F32)?,
        _ => loss.clone(),
    };
    l.mul_scalar(scale)
}
