//! Precision presets (DESIGN.md's table; Keras' policies by their PyTorch/apex anchors) and
//! `AmpOptimizer`, which runs one preset's training step: where the weights live, which
//! autocast scope the forward pass uses, how the loss is scaled and how the optimizer steps.
//!
//! | preset | weights | compute | loss scaling | anchor |
//! |---|---|---|---|---|
//! | `fp32` | F32 | F32 | none | apex O0 |
//! | `amp-fp16` (`mixed_float16`) | F32 | autocast F16 | dynamic | torch.autocast + GradScaler, apex O1 |
//! | `amp-bf16` (`mixed_bfloat16`) | F32 | autocast BF16 | none | torch.autocast(bfloat16) |
//! | `fp16-master` | F16 (norms F32) | F16 | dynamic | apex FP16_Optimizer, O2 |
//! | `pure-fp16` | F16 | F16 | none | apex O3 (speed baseline; may diverge) |
//! | `pure-bf16` | BF16 | BF16 | none | BF16 weights, F32 optimizer maths, stochastic rounding |

use std::fmt;

use crate::amp::master::{Fp16Optimizer, LossScaling, MasterConfig};
use crate::amp::rounding::Rounding;
use crate::amp::scaler::{GradScaler, GradScalerConfig, ScalerState};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::ops::autocast::{autocast_enabled, AutocastGuard};
use crate::optim::{clip_grads_to, grad_norm, GradNormFn, Optimizer, OptimizerState};
use crate::tensor::Tensor;

/// A precision preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// `fp32`: F32 weights and compute, no loss scaling (apex O0; Keras `float32`).
    Fp32,
    /// `amp-fp16`, Keras' `mixed_float16`: F32 weights, forward under autocast F16, dynamic
    /// loss scaling (`torch.autocast` + `GradScaler`, apex O1). The default and the
    /// documents' mode.
    AmpFp16,
    /// `amp-bf16`, Keras' `mixed_bfloat16`: F32 weights, forward under autocast BF16, no
    /// loss scaling (`torch.autocast(dtype=torch.bfloat16)`).
    AmpBf16,
    /// `fp16-master`: F16 weights (norm layers F32) trained through F32 master copies with
    /// dynamic loss scaling (apex `FP16_Optimizer`, O2).
    Fp16Master,
    /// `pure-fp16` (Keras `float16`): F16 weights and compute, no loss scaling (apex O3); a
    /// speed baseline that may diverge.
    PureFp16,
    /// `pure-bf16` (Keras `bfloat16`): BF16 weights and compute, F32 optimizer maths
    /// written back with stochastic rounding.
    PureBf16,
}

impl Precision {
    /// Every preset, in the order of DESIGN.md's table (for listings and tests).
    pub const ALL: [Precision; 6] = [
        Precision::Fp32,
        Precision::AmpFp16,
        Precision::AmpBf16,
        Precision::Fp16Master,
        Precision::PureFp16,
        Precision::PureBf16,
    ];

    /// The preset's name (`amp-fp16`...).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::AmpFp16 => "amp-fp16",
            Precision::AmpBf16 => "amp-bf16",
            Precision::Fp16Master => "fp16-master",
            Precision::PureFp16 => "pure-fp16",
            Precision::PureBf16 => "pure-bf16",
        }
    }

    /// Parses a preset name or a Keras policy name (`mixed_float16`, `mixed_bfloat16`,
    /// `float32`); `_` and `-` are interchangeable.
    pub fn parse(s: &str) -> Result<Precision> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        let p = match norm.as_str() {
            "fp32" | "float32" => Precision::Fp32,
            "amp-fp16" | "mixed-float16" => Precision::AmpFp16,
            "amp-bf16" | "mixed-bfloat16" => Precision::AmpBf16,
            "fp16-master" => Precision::Fp16Master,
            "pure-fp16" | "float16" => Precision::PureFp16,
            "pure-bf16" | "bfloat16" => Precision::PureBf16,
            _ => {
                return Err(Error::arg(
                    "precision",
                    format!(
                        "unknown precision {s:?}; one of fp32, amp-fp16 (mixed_float16), \
                         amp-bf16 (mixed_bfloat16), fp16-master, pure-fp16, pure-bf16"
                    ),
                ))
            }
        };
        Ok(p)
    }

    /// The dtype of the model's weights (Keras' `variable_dtype` for the model itself).
    pub fn weight_dtype(self) -> DType {
        match self {
            Precision::Fp32 | Precision::AmpFp16 | Precision::AmpBf16 => DType::F32,
            Precision::Fp16Master | Precision::PureFp16 => DType::F16,
            Precision::PureBf16 => DType::BF16,
        }
    }

    /// The dtype GEMM-shaped ops compute in (Keras' `compute_dtype`).
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::AmpFp16 | Precision::Fp16Master | Precision::PureFp16 => DType::F16,
            Precision::AmpBf16 | Precision::PureBf16 => DType::BF16,
        }
    }

    /// The autocast scope of the forward pass (amp presets only).
    pub fn autocast_dtype(self) -> Option<DType> {
        match self {
            Precision::AmpFp16 => Some(DType::F16),
            Precision::AmpBf16 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Whether norm layers keep F32 parameters and statistics when the model is cast.
    pub fn keep_norms_f32(self) -> bool {
        matches!(self, Precision::Fp16Master)
    }

    /// Whether the preset scales the loss dynamically.
    pub fn loss_scaling(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::Fp16Master)
    }

    /// Casts `model`'s weights to the preset's weight dtype (norms stay F32 where the
    /// preset says so). F32 presets leave the model alone.
    pub fn prepare_model(self, model: &mut dyn Module) -> Result<()> {
        if self.weight_dtype() == DType::F32 {
            return Ok(());
        }
        model.to_dtype(self.weight_dtype(), self.keep_norms_f32())
    }

    /// The forward pass's scope: autocast for amp presets, a disabled scope otherwise.
    pub fn autocast(self) -> AutocastGuard {
        match self.autocast_dtype() {
            Some(d) => autocast_enabled(d, true),
            None => autocast_enabled(DType::F32, false),
        }
    }

    /// A batch of inputs in the dtype the model's first layer expects (the weights' dtype:
    /// an F32 input would otherwise promote a half model's first layer back to F32).
    pub fn input(self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight_dtype();
        if x.dtype().is_float() && x.dtype() != w {
            x.to_dtype(w)
        } else {
            Ok(x.clone())
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Precision> {
        Precision::parse(s)
    }
}

enum Engine {
    /// F32 weights (fp32, amp-*) or half weights stepped directly (pure-fp16), with a
    /// GradScaler for amp-fp16.
    Plain {
        opt: Box<dyn Optimizer>,
        scaler: Option<GradScaler>,
    },
    /// F32 masters behind half weights (fp16-master, pure-bf16).
    Master(Fp16Optimizer),
}

/// One preset's optimizer: the user's optimizer plus the loss scaler or master weights the
/// preset needs. A training step is
/// ```ignore
/// opt.zero_grad();
/// let loss = { let _ac = precision.autocast(); loss_fn(model.forward(&precision.input(&x)?)?)? };
/// opt.backward(&loss)?;
/// let stepped = opt.step()?;
/// ```
pub struct AmpOptimizer {
    precision: Precision,
    engine: Engine,
    /// Clip the total 2-norm of the unscaled gradients to this before each step.
    clip: Option<f64>,
    /// Computes that total where the gradients are sharded (ZeRO; `None`: `grad_norm`).
    norm: Option<GradNormFn>,
    /// `unscale` ran since the last step (amp-fp16).
    unscaled: bool,
}

impl AmpOptimizer {
    /// Builds the preset's optimizer over `params` (a model already cast with
    /// `Precision::prepare_model`); `build` makes the user's optimizer over the tensors it is
    /// given (the F32 masters under fp16-master and pure-bf16).
    ///
    /// `scaler` configures the dynamic loss scale of amp-fp16 and fp16-master (the other
    /// presets ignore it). `GradScalerConfig::default()` is PyTorch's GradScaler, with no
    /// ceiling, for both; the apex anchors differ here: apex's `amp` (O1, O2) caps its scale at
    /// 2^24 while its `FP16_Optimizer` does not. Pass `max_scale: Some(2^24)` to follow apex
    /// amp.
    pub fn new(
        precision: Precision,
        params: Vec<Tensor>,
        scaler: GradScalerConfig,
        seed: u64,
        build: impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>>,
    ) -> Result<AmpOptimizer> {
        Self::build(precision, params, scaler, seed, build, true)
    }

    /// `new` over one rank's shard of a model's parameters (ZeRO, `dist::ZeroShard::shards`):
    /// flat slices of the parameters in their dtypes, of which none need have the preset's
    /// weight dtype (a shard may hold only F32 norms). pure-bf16 is refused: its stochastic
    /// rounding draws a stream per parameter, which slicing would change.
    pub fn for_shard(
        precision: Precision,
        shards: Vec<Tensor>,
        scaler: GradScalerConfig,
        seed: u64,
        build: impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>>,
    ) -> Result<AmpOptimizer> {
        if precision == Precision::PureBf16 {
            return Err(Error::arg(
                "AmpOptimizer",
                "pure-bf16 cannot be sharded (ZeRO): its stochastic rounding draws one random \
                 stream per parameter, and a shard holds pieces of parameters",
            ));
        }
        Self::build(precision, shards, scaler, seed, build, false)
    }

    fn build(
        precision: Precision,
        params: Vec<Tensor>,
        scaler: GradScalerConfig,
        seed: u64,
        build: impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>>,
        whole_model: bool,
    ) -> Result<AmpOptimizer> {
        let want = precision.weight_dtype();
        if whole_model
            && want != DType::F32
            && !params.is_empty()
            && !params.iter().any(|p| p.dtype() == want)
        {
            return Err(Error::dtype(
                "AmpOptimizer",
                params[0].dtype(),
                format!(
                    "no parameter is {want} under {precision}; call Precision::prepare_model \
                     on the model before building the optimizer"
                ),
            ));
        }
        for (i, p) in params.iter().enumerate() {
            // F32 parameters: norms under fp16-master, and modules a precision policy pins
            // to F32 under any preset (`PrecisionPolicy::prepare_model`).
            let ok = p.dtype() == want || p.dtype() == DType::F32;
            if !ok {
                return Err(Error::dtype(
                    "AmpOptimizer",
                    p.dtype(),
                    format!(
                        "parameter {i} under {precision} should be {want}; call \
                         Precision::prepare_model on the model first"
                    ),
                ));
            }
        }
        let engine = match precision {
            Precision::Fp32 | Precision::AmpBf16 | Precision::PureFp16 => Engine::Plain {
                opt: build(params)?,
                scaler: None,
            },
            Precision::AmpFp16 => Engine::Plain {
                opt: build(params)?,
                scaler: Some(GradScaler::new(scaler)?),
            },
            Precision::Fp16Master => Engine::Master(Fp16Optimizer::new(
                params,
                MasterConfig {
                    loss_scaling: LossScaling::Dynamic(scaler),
                    rounding: Rounding::NearestEven,
                    clip_grad_norm: None,
                    keep_masters: true,
                    seed,
                },
                build,
            )?),
            Precision::PureBf16 => Engine::Master(Fp16Optimizer::new(
                params,
                MasterConfig {
                    loss_scaling: LossScaling::None,
                    rounding: Rounding::Stochastic,
                    clip_grad_norm: None,
                    keep_masters: false,
                    seed,
                },
                build,
            )?),
        };
        Ok(AmpOptimizer {
            precision,
            engine,
            clip: None,
            norm: None,
            unscaled: false,
        })
    }

    /// Clips the total 2-norm of the unscaled gradients to `max_norm` before every step
    /// (PyTorch's `clip_grad_norm_` between `unscale_` and `step`; under fp16-master the
    /// masters' gradients, as apex). `norm`, when given, computes the total instead of
    /// `grad_norm(tensors, 2.0)` (ZeRO: the optimizer holds a shard). A step whose gradients
    /// hold inf or NaN is not clipped (the loss scaler skips it). Errors on a negative or
    /// non-finite `max_norm`.
    pub fn set_clip_grad_norm(
        &mut self,
        max_norm: Option<f64>,
        norm: Option<GradNormFn>,
    ) -> Result<()> {
        if let Some(c) = max_norm {
            if !(c.is_finite() && c >= 0.0) {
                return Err(Error::arg(
                    "AmpOptimizer::set_clip_grad_norm",
                    format!("the clipping norm must be finite and >= 0, got {c}"),
                ));
            }
        }
        match &mut self.engine {
            Engine::Master(m) => m.set_clip_grad_norm(max_norm, norm)?,
            Engine::Plain { .. } => {
                self.clip = max_norm;
                self.norm = norm;
            }
        }
        Ok(())
    }

    /// Reduces the loss scaler's found-inf flag through `sync` (data-parallel training: every
    /// rank skips a step when any rank's gradients overflowed). Presets without a scaler
    /// ignore it.
    pub fn set_found_inf_sync(&mut self, sync: Option<super::FoundInfSync>) {
        match &mut self.engine {
            Engine::Plain {
                scaler: Some(s), ..
            } => s.set_found_inf_sync(sync),
            Engine::Plain { .. } => {}
            Engine::Master(m) => m.set_found_inf_sync(sync),
        }
    }

    /// The preset this optimizer runs.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The optimizer whose state a checkpoint saves (the master-weight wrapper for
    /// fp16-master and pure-bf16).
    pub fn optimizer(&self) -> &dyn Optimizer {
        match &self.engine {
            Engine::Plain { opt, .. } => opt.as_ref(),
            Engine::Master(m) => m,
        }
    }

    /// Mutable access to the optimizer (schedulers set its learning rate).
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        match &mut self.engine {
            Engine::Plain { opt, .. } => opt.as_mut(),
            Engine::Master(m) => m,
        }
    }

    /// Clears the gradients before the next backward (`optimizer.zero_grad()`), of the
    /// model's parameters and, under the master presets, of the masters.
    pub fn zero_grad(&self) {
        self.optimizer().zero_grad();
    }

    /// Backward of `loss` times the current loss scale.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        match &self.engine {
            Engine::Plain {
                scaler: Some(s), ..
            } => s.scale(loss)?.backward(),
            Engine::Plain { .. } => loss.backward(),
            Engine::Master(m) => m.scale_loss(loss)?.backward(),
        }
    }

    /// Unscales the gradients in place where the preset scales the loss (amp-fp16), so that
    /// they can be read or clipped before `step`. Other presets: nothing to do (fp16-master
    /// unscales into its masters inside `step`).
    pub fn unscale(&mut self) -> Result<()> {
        if let Engine::Plain {
            opt,
            scaler: Some(s),
            ..
        } = &mut self.engine
        {
            s.unscale_(opt.as_ref())?;
            self.unscaled = true;
        }
        Ok(())
    }

    /// One optimizer step; `false` when the step was skipped because a gradient held inf or
    /// NaN (the loss scale then backs off).
    pub fn step(&mut self) -> Result<bool> {
        let unscaled = std::mem::take(&mut self.unscaled);
        match &mut self.engine {
            Engine::Plain { opt, scaler } => {
                if let Some(max_norm) = self.clip {
                    if let Some(s) = scaler.as_mut().filter(|_| !unscaled) {
                        s.unscale_(opt.as_ref())?;
                    }
                    let total = match &self.norm {
                        Some(f) => f(opt.params())?,
                        None => grad_norm(opt.params(), 2.0)?,
                    };
                    clip_grads_to(opt.params(), max_norm, total)?;
                }
                Self::step_plain(opt.as_mut(), scaler)
            }
            Engine::Master(m) => {
                m.step()?;
                Ok(!m.last_step_skipped())
            }
        }
    }

    fn step_plain(opt: &mut dyn Optimizer, scaler: &mut Option<GradScaler>) -> Result<bool> {
        match scaler {
            Some(s) => {
                let stepped = s.step(opt)?;
                s.update()?;
                Ok(stepped)
            }
            None => {
                opt.step()?;
                Ok(true)
            }
        }
    }

    /// The loss scale the next backward uses (1.0 where the preset does not scale).
    pub fn scale(&self) -> f64 {
        match &self.engine {
            Engine::Plain {
                scaler: Some(s), ..
            } => s.get_scale(),
            Engine::Plain { .. } => 1.0,
            Engine::Master(m) => m.loss_scale(),
        }
    }

    /// Steps skipped so far.
    pub fn skipped_steps(&self) -> u64 {
        match &self.engine {
            Engine::Plain {
                scaler: Some(s), ..
            } => s.skipped_steps(),
            Engine::Plain { .. } => 0,
            Engine::Master(m) => m.skipped_steps(),
        }
    }

    /// The tensors holding unscaled F32 gradients after `unscale` (amp) or `step` (master
    /// presets): the parameters, or the F32 masters.
    pub fn grad_tensors(&self) -> Vec<Tensor> {
        match &self.engine {
            Engine::Plain { opt, .. } => opt.params().to_vec(),
            Engine::Master(m) => m.masters().to_vec(),
        }
    }

    /// The optimizer's state and, for amp-fp16, the scaler's (the master presets keep
    /// their scale inside the optimizer state).
    pub fn state_dict(&self) -> (OptimizerState, Option<ScalerState>) {
        match &self.engine {
            Engine::Plain { opt, scaler, .. } => {
                (opt.state_dict(), scaler.as_ref().map(|s| s.state_dict()))
            }
            Engine::Master(m) => (m.state_dict(), None),
        }
    }

    /// Restores `state_dict`'s output. A missing scaler state for amp-fp16 is an error
    /// (resuming would silently restart from the initial scale).
    pub fn load_state_dict(
        &mut self,
        opt_state: &OptimizerState,
        scaler_state: Option<&ScalerState>,
    ) -> Result<()> {
        match &mut self.engine {
            Engine::Plain { opt, scaler, .. } => {
                if let Some(s) = scaler {
                    let st = scaler_state.ok_or_else(|| {
                        Error::arg(
                            "AmpOptimizer",
                            "the checkpoint has no loss-scaler state (saved under another precision?)",
                        )
                    })?;
                    // Each load changes nothing on error; undo the scaler's if the
                    // optimizer's fails.
                    let before = s.state_dict();
                    s.load_state_dict(st)?;
                    if let Err(e) = opt.load_state_dict(opt_state) {
                        s.load_state_dict(&before)?;
                        return Err(e);
                    }
                } else {
                    opt.load_state_dict(opt_state)?;
                }
                Ok(())
            }
            Engine::Master(m) => m.load_state_dict(opt_state),
        }
    }
}
