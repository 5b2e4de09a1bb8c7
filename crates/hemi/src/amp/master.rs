//! F32 master weights for a half-precision model: apex's `FP16_Optimizer` (opt level O2),
//! and the pure-BF16 mode with stochastic rounding.
//!
//! Why: an F16 weight of 1.0 cannot take an update below 2^-11 (half its ulp), so small
//! learning-rate steps vanish when the optimizer writes F16 weights directly. The wrapper
//! keeps an F32 copy (the "master") of every half parameter, runs the ordinary optimizer on
//! the masters, and after each step rounds the masters into the model's half weights.
//! Forward and backward run in half precision on the model; the loss is scaled so that
//! small gradients survive F16 backward, and the wrapper unscales them into F32 master
//! gradients.
//!
//! One step, per parameter with a gradient:
//! ```text
//! master.grad = f32(param.grad) * inv_scale    one fused pass, noting inf/NaN
//! any inf/NaN?  skip: params, masters and optimizer state unchanged; scale backs off
//! otherwise     clip_grad_norm(masters) (optional); inner.step() on the masters;
//!               param = round(master)          nearest-even or stochastic; scale update
//! ```

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::{
    check_grads, check_params, clip_grads_to, grad_norm, GradNormFn, Optimizer, OptimizerState,
    StateBuffer,
};
use crate::rng::Generator;
use crate::tensor::Tensor;

use super::rounding::Rounding;
use super::scaler::{
    any_found, flag_for, scale_loss, unscale, GradScalerConfig, LossScale, ScalerState,
};

/// How `Fp16Optimizer` scales the loss. In every mode a step whose gradients hold inf or
/// NaN is skipped (apex checks only under dynamic scaling; a NaN written into the weights
/// ends the run, so hemi always checks: the check is part of the unscaling pass anyway).
#[derive(Clone, Debug, PartialEq)]
pub enum LossScaling {
    /// A scale of 1 (BF16 models, whose range needs no scaling).
    None,
    /// A fixed scale (apex's `static_loss_scale`).
    Static(f64),
    /// A dynamic scale (apex's `dynamic_loss_scale=True`; PyTorch's rule and F32 arithmetic,
    /// see `LossScale`).
    Dynamic(GradScalerConfig),
}

/// Configuration of `Fp16Optimizer`.
#[derive(Clone, Debug, PartialEq)]
pub struct MasterConfig {
    /// How the loss is scaled before backward: none, a fixed factor or PyTorch's dynamic
    /// scale.
    pub loss_scaling: LossScaling,
    /// How masters are written back into the half parameters.
    pub rounding: Rounding,
    /// Clips the total 2-norm of the (unscaled) master gradients before each step.
    pub clip_grad_norm: Option<f64>,
    /// True (fp16-master): the F32 masters persist across steps and are the truth; the half
    /// parameters are their rounded image. False (pure-bf16): the F32 copies are refreshed
    /// from the half parameters before every step, so the state is the half weights (only the
    /// update is computed in F32; with stochastic rounding it survives on average).
    pub keep_masters: bool,
    /// Seed of the stochastic rounding stream.
    pub seed: u64,
}

impl Default for MasterConfig {
    /// fp16-master: dynamic scaling with PyTorch's defaults, nearest-even write-back, no
    /// clipping, persistent masters.
    ///
    /// No ceiling on the scale, as apex's `FP16_Optimizer` (its `DynamicLossScaler` has none);
    /// it is apex's `amp` (O1/O2 through `amp.initialize`) whose `LossScaler` caps the scale
    /// at 2^24: set `max_scale: Some(2^24)` for that trajectory.
    fn default() -> Self {
        MasterConfig {
            loss_scaling: LossScaling::Dynamic(GradScalerConfig::default()),
            rounding: Rounding::NearestEven,
            clip_grad_norm: None,
            keep_masters: true,
            seed: 0,
        }
    }
}

/// The optimizer of a half-precision model, through F32 master weights (apex's
/// `FP16_Optimizer`). It is itself an `Optimizer` over the model's parameters:
///
/// ```text
/// let mut opt = Fp16Optimizer::new(net.parameters(), MasterConfig::default(), |masters| {
///     Ok(Box::new(Sgd::new(masters, SgdConfig { lr: 1e-3, momentum: 0.9, ..Default::default() })?))
/// })?;
/// opt.zero_grad();
/// opt.scale_loss(&loss)?.backward()?;
/// opt.step()?;        // unscales, skips on overflow, steps the masters, writes back, rescales
/// ```
///
/// F32 parameters among them (BatchNorm's weight and bias) are their own masters: the inner
/// optimizer updates them directly (as apex does), `step` replaces their gradient by the
/// unscaled F32 one, and nothing is written back. F16 and BF16 parameters get an F32 copy.
///
/// Saved state (`state_dict`): kind `"fp16_master"`; scalars `num_params`, `rounding_step`
/// (write-backs so far: the stochastic rounding stream is derived from the seed and this
/// count, so a restored run continues bit for bit), `inner_optimizer.{kind}` = 1 (the inner
/// optimizer's kind, e.g. `inner_optimizer.sgd`), the inner optimizer's scalars prefixed
/// `inner.` and the loss scale's prefixed `scaler.`; buffers: the inner optimizer's prefixed
/// `inner.`, and with `keep_masters` the F32 master of every half parameter `i` as
/// `master.{i}` (F32 parameters are their own masters and travel with the model).
pub struct Fp16Optimizer {
    params: Vec<Tensor>,
    masters: Vec<Tensor>,
    inner: Box<dyn Optimizer>,
    inner_kind: String,
    scale: LossScale,
    rounding: Rounding,
    clip: Option<f64>,
    /// The total norm for clipping where the gradients are sharded (`None`: `grad_norm`).
    norm: Option<GradNormFn>,
    keep_masters: bool,
    seed: u64,
    rounding_step: u64,
    last_skipped: bool,
    sync: Option<super::scaler::FoundInfSync>,
}

const KIND: &str = "fp16_master";

impl Fp16Optimizer {
    /// `params`: the model's parameters (F16, BF16 or F32 leaves, each a whole contiguous
    /// tensor, each once). `build` makes the inner optimizer over the F32 master tensors it
    /// is given (in that order; anything else is an error).
    pub fn new(
        params: Vec<Tensor>,
        cfg: MasterConfig,
        build: impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>>,
    ) -> Result<Fp16Optimizer> {
        const OP: &str = "Fp16Optimizer::new";
        check_params(OP, &params)?;
        if let Some(c) = cfg.clip_grad_norm {
            if !(c.is_finite() && c >= 0.0) {
                return Err(Error::arg(
                    OP,
                    format!("clip_grad_norm must be finite and >= 0, got {c}"),
                ));
            }
        }
        let scale = match cfg.loss_scaling {
            LossScaling::None => LossScale::fixed(1.0)?,
            LossScaling::Static(s) => LossScale::fixed(s)?,
            LossScaling::Dynamic(c) => LossScale::new(c)?,
        };
        let masters = params
            .iter()
            .map(|p| match p.dtype() {
                DType::F32 => Ok(p.clone()),
                _ => {
                    let m = p.detach().to_dtype(DType::F32)?;
                    Ok(Tensor::from_storage(m.storage(), m.layout().clone()))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let inner = build(masters.clone())?;
        let same = inner.params().len() == masters.len()
            && (inner.params().iter().zip(&masters)).all(|(a, b)| a.id() == b.id());
        if !same {
            return Err(Error::arg(
                OP,
                "the inner optimizer must be built over exactly the master tensors it is given, in order",
            ));
        }
        let inner_kind = inner.state_dict().optimizer;
        Ok(Fp16Optimizer {
            params,
            masters,
            inner,
            inner_kind,
            scale,
            rounding: cfg.rounding,
            clip: cfg.clip_grad_norm,
            norm: None,
            keep_masters: cfg.keep_masters,
            seed: cfg.seed,
            rounding_step: 0,
            last_skipped: false,
            sync: None,
        })
    }

    /// `loss * loss_scale()`, cast up to F32 first (so the scaled loss cannot overflow F16),
    /// recorded by autograd: call `backward` on it.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        scale_loss(loss, self.scale.scale())
    }

    /// The current loss scale.
    pub fn loss_scale(&self) -> f64 {
        self.scale.scale()
    }

    /// Steps skipped so far because a gradient held inf or NaN.
    pub fn skipped_steps(&self) -> u64 {
        self.scale.skipped_steps()
    }

    /// Reduces every found-inf flag through `sync` before it decides a step (data-parallel
    /// training; `None`: this process alone).
    pub fn set_found_inf_sync(&mut self, sync: Option<super::scaler::FoundInfSync>) {
        self.sync = sync;
    }

    /// Clips the total 2-norm of the master gradients to `max_norm` before each step
    /// (`MasterConfig::clip_grad_norm`); `norm`, when given, computes that total instead of
    /// `grad_norm(masters, 2.0)` (ZeRO: the masters are a shard). Errors on a negative or
    /// non-finite `max_norm`.
    pub fn set_clip_grad_norm(
        &mut self,
        max_norm: Option<f64>,
        norm: Option<GradNormFn>,
    ) -> Result<()> {
        if let Some(c) = max_norm {
            if !(c.is_finite() && c >= 0.0) {
                return Err(Error::arg(
                    "Fp16Optimizer::set_clip_grad_norm",
                    format!("clip_grad_norm must be finite and >= 0, got {c}"),
                ));
            }
        }
        self.clip = max_norm;
        self.norm = norm;
        Ok(())
    }

    /// Whether the last `step` was skipped.
    pub fn last_step_skipped(&self) -> bool {
        self.last_skipped
    }

    /// The F32 master of each parameter, in order (an F32 parameter is its own master).
    pub fn masters(&self) -> &[Tensor] {
        &self.masters
    }

    /// The optimizer that updates the masters.
    pub fn inner(&self) -> &dyn Optimizer {
        &*self.inner
    }

    /// The loss scale's state machine.
    pub fn scaler(&self) -> &LossScale {
        &self.scale
    }

    /// The generator of parameter `i`'s stochastic rounding at write-back number `step`: a
    /// pure function of the seed and the counters, so a restored run draws the same bits.
    fn rounding_rng(&self, i: usize) -> Generator {
        let mix = |x: u64| {
            // SplitMix64's finaliser: neighbouring inputs give unrelated outputs.
            let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Generator::new(mix(self.seed ^ mix(self.rounding_step ^ mix(i as u64))))
    }
}

impl Optimizer for Fp16Optimizer {
    fn step(&mut self) -> Result<()> {
        const OP: &str = "Fp16Optimizer::step";
        check_grads(OP, &self.params)?;
        // 1. Unscale into F32 master gradients, noting inf/NaN (one pass per gradient).
        let inv = self.scale.inv_scale();
        let mut grads: Vec<Option<Tensor>> = Vec::with_capacity(self.params.len());
        let mut flags = std::collections::BTreeMap::new();
        for p in &self.params {
            let Some(g) = p.grad() else {
                grads.push(None);
                continue;
            };
            let flag = flag_for(&mut flags, g.device())?;
            grads.push(Some(unscale(&g, inv, flag)?));
        }
        let mut found_inf = any_found(&flags)?;
        if let Some(sync) = &self.sync {
            found_inf = sync(found_inf)?;
        }
        // 2. Overflow: skip the step; nothing but the scale changes.
        if found_inf {
            self.scale.update(true);
            self.last_skipped = true;
            return Ok(());
        }
        // 3. The step proper, on the masters.
        for ((p, m), g) in self.params.iter().zip(&self.masters).zip(grads) {
            if !self.keep_masters && p.dtype() != DType::F32 {
                m.set_data(&p.detach().to_dtype(DType::F32)?)?;
            }
            m.set_grad(g);
        }
        if let Some(max_norm) = self.clip {
            let total = match &self.norm {
                Some(f) => f(&self.masters)?,
                None => grad_norm(&self.masters, 2.0)?,
            };
            clip_grads_to(&self.masters, max_norm, total)?;
        }
        self.inner.step()?;
        // 4. Write the updated masters back into the half parameters.
        for (i, (p, m)) in self.params.iter().zip(&self.masters).enumerate() {
            if p.dtype() == DType::F32 || m.grad().is_none() {
                continue;
            }
            let mut rng = self.rounding_rng(i);
            p.set_data(&m.round_into(p.dtype(), self.rounding, &mut rng)?)?;
        }
        self.rounding_step += 1;
        self.scale.update(false);
        self.last_skipped = false;
        Ok(())
    }

    /// Clears the model's gradients and the masters' gradients.
    fn zero_grad(&self) {
        for t in self.params.iter().chain(&self.masters) {
            t.zero_grad();
        }
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn state_bytes(&self) -> usize {
        let masters: usize = if self.keep_masters {
            (self.params.iter().zip(&self.masters))
                .filter(|(p, _)| p.dtype() != DType::F32)
                .map(|(_, m)| m.numel() * 4)
                .sum()
        } else {
            0
        };
        self.inner.state_bytes() + masters
    }

    fn state_dict(&self) -> OptimizerState {
        let inner = self.inner.state_dict();
        let mut scalars = vec![
            ("num_params".to_string(), self.params.len() as f64),
            ("rounding_step".to_string(), self.rounding_step as f64),
            (format!("inner_optimizer.{}", inner.optimizer), 1.0),
        ];
        scalars.extend((inner.scalars.into_iter()).map(|(n, v)| (format!("inner.{n}"), v)));
        scalars.extend(
            (self.scale.state().scalars.into_iter()).map(|(n, v)| (format!("scaler.{n}"), v)),
        );
        let mut buffers: Vec<StateBuffer> = (inner.buffers.into_iter())
            .map(|b| StateBuffer {
                name: format!("inner.{}", b.name),
                ..b
            })
            .collect();
        if self.keep_masters {
            for (i, (p, m)) in self.params.iter().zip(&self.masters).enumerate() {
                if p.dtype() != DType::F32 {
                    buffers.push(StateBuffer {
                        name: format!("master.{i}"),
                        shape: m.shape().to_vec(),
                        data: m.to_vec_f32(),
                    });
                }
            }
        }
        OptimizerState {
            optimizer: KIND.to_string(),
            scalars,
            buffers,
        }
    }

    /// Restores the inner optimizer's state, the masters and the loss scale (the scale after
    /// loading is the saved one). The half parameters are not touched: they come with the
    /// model's weights. On error nothing changes.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        const OP: &str = "Fp16Optimizer::load_state_dict";
        if state.optimizer != KIND {
            return Err(Error::arg(
                OP,
                format!(
                    "state of a {:?} optimizer loaded into {KIND:?}",
                    state.optimizer
                ),
            ));
        }
        let mut num_params = None;
        let mut rounding_step = None;
        let mut kinds = Vec::new();
        let mut inner_scalars = Vec::new();
        let mut scaler_scalars = Vec::new();
        for (name, v) in &state.scalars {
            if let Some(n) = name.strip_prefix("inner.") {
                inner_scalars.push((n.to_string(), *v));
            } else if let Some(n) = name.strip_prefix("scaler.") {
                scaler_scalars.push((n.to_string(), *v));
            } else if let Some(k) = name.strip_prefix("inner_optimizer.") {
                kinds.push(k);
            } else if name == "num_params" {
                num_params = Some(*v);
            } else if name == "rounding_step" {
                rounding_step = Some(*v);
            } else {
                return Err(Error::arg(
                    OP,
                    format!("state has a scalar this optimizer does not use: {name:?}"),
                ));
            }
        }
        if num_params != Some(self.params.len() as f64) {
            return Err(Error::arg(
                OP,
                format!(
                    "state holds {num_params:?} parameters, the optimizer has {}",
                    self.params.len()
                ),
            ));
        }
        let rounding_step = match rounding_step {
            Some(v) if v >= 0.0 && v.fract() == 0.0 && v <= 2f64.powi(53) => v as u64,
            v => {
                return Err(Error::arg(
                    OP,
                    format!("state \"rounding_step\" is {v:?}, expected a non-negative integer"),
                ))
            }
        };
        if kinds != [self.inner_kind.as_str()] {
            return Err(Error::arg(
                OP,
                format!(
                    "state's inner optimizer is {kinds:?}, this one wraps {:?}",
                    self.inner_kind
                ),
            ));
        }
        let mut scale = self.scale.clone();
        scale.load_state(&ScalerState {
            scalars: scaler_scalars,
        })?;
        let mut inner_buffers = Vec::new();
        let mut masters: Vec<Option<Tensor>> = vec![None; self.params.len()];
        for b in &state.buffers {
            if let Some(n) = b.name.strip_prefix("inner.") {
                inner_buffers.push(StateBuffer {
                    name: n.to_string(),
                    ..b.clone()
                });
                continue;
            }
            let i = (b.name.strip_prefix("master."))
                .and_then(|i| i.parse::<usize>().ok())
                .filter(|&i| {
                    self.keep_masters
                        && i < self.params.len()
                        && self.params[i].dtype() != DType::F32
                        && masters[i].is_none()
                })
                .ok_or_else(|| {
                    Error::arg(
                        OP,
                        format!(
                            "state has a buffer this optimizer does not use: {:?}",
                            b.name
                        ),
                    )
                })?;
            let p = &self.params[i];
            if b.shape != p.shape() || b.data.len() != p.numel() {
                return Err(Error::shape(
                    OP,
                    format!(
                        "master {i} has shape {:?} ({} values), parameter {i} has shape {:?}",
                        b.shape,
                        b.data.len(),
                        p.shape()
                    ),
                ));
            }
            masters[i] = Some(Tensor::from_f32_vec(b.data.clone(), p.shape(), DType::F32)?);
        }
        if self.keep_masters {
            if let Some(i) = (0..self.params.len())
                .find(|&i| self.params[i].dtype() != DType::F32 && masters[i].is_none())
            {
                return Err(Error::arg(
                    OP,
                    format!("state has no master for parameter {i} (\"master.{i}\")"),
                ));
            }
        }
        // Everything is checked but the inner state, whose loader changes nothing on error.
        self.inner.load_state_dict(&OptimizerState {
            optimizer: self.inner_kind.clone(),
            scalars: inner_scalars,
            buffers: inner_buffers,
        })?;
        for (m, new) in self.masters.iter().zip(masters) {
            if let Some(new) = new {
                m.set_data(&new)?;
            }
        }
        self.scale = scale;
        self.rounding_step = rounding_step;
        Ok(())
    }
}
