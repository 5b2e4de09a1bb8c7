//! Adam and AdamW: PyTorch's `torch.optim.Adam` / `torch.optim.AdamW` update rules and
//! defaults, with optional AMSGrad. One implementation serves both; they differ only in
//! where weight decay enters (Adam: an L2 term added to the gradient; AdamW: decoupled,
//! `p *= 1 - lr * weight_decay` before the update) and in the default weight decay.

use super::optimizer::{
    check_decay_mask, check_grads, check_nonneg, check_params, state_zeros, Optimizer,
    OptimizerState, StateBuffer, StateReader,
};
use crate::backend::train::{AdamDecay, AdamScalars, AdamState};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of `Adam` (PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight_decay 0, amsgrad off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates (β1, β2) of the running means of the gradient and its square (default
    /// (0.9, 0.999)), each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator `sqrt(v̂) + eps` for stability (default 1e-8).
    pub eps: f64,
    /// L2 penalty: `weight_decay * p` is added to the gradient.
    pub weight_decay: f64,
    /// Use the maximum of past second moments (Reddi et al.'s AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

/// Hyper-parameters of `AdamW` (PyTorch's defaults: as Adam's but weight_decay 1e-2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates (β1, β2) of the running means of the gradient and its square (default
    /// (0.9, 0.999)), each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator `sqrt(v̂) + eps` for stability (default 1e-8).
    pub eps: f64,
    /// Decoupled decay: each step first scales `p` by `1 - lr * weight_decay`.
    pub weight_decay: f64,
    /// Use the maximum of past second moments (Reddi et al.'s AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            weight_decay: 1e-2,
            ..AdamWConfig::from(AdamConfig::default())
        }
    }
}

impl From<AdamConfig> for AdamWConfig {
    fn from(c: AdamConfig) -> Self {
        AdamWConfig {
            lr: c.lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
        }
    }
}

impl From<AdamWConfig> for AdamConfig {
    fn from(c: AdamWConfig) -> Self {
        AdamConfig {
            lr: c.lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            amsgrad: c.amsgrad,
        }
    }
}

impl AdamConfig {
    fn validate(&self, op: &'static str) -> Result<()> {
        check_nonneg(op, "learning rate", self.lr)?;
        check_nonneg(op, "epsilon", self.eps)?;
        check_nonneg(op, "weight_decay", self.weight_decay)?;
        for (k, b) in [("beta1", self.betas.0), ("beta2", self.betas.1)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::arg(
                    op,
                    format!("invalid {k}: {b} (need 0 <= beta < 1)"),
                ));
            }
        }
        Ok(())
    }
}

/// One parameter's state, created by its first step with a gradient (PyTorch's lazy init).
#[derive(Clone, Debug)]
struct ParamState {
    /// Steps this parameter has taken (PyTorch keeps a count per parameter: a parameter
    /// without a gradient on some step lags behind, and its bias correction with it).
    step: u64,
    /// F32 buffers shaped and placed like the parameter.
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// Running maximum of `exp_avg_sq` (amsgrad only).
    max_exp_avg_sq: Option<Tensor>,
}

/// What Adam and AdamW share: the parameters, hyper-parameters and per-parameter state.
struct AdamCore {
    kind: &'static str,
    decoupled: bool,
    params: Vec<Tensor>,
    config: AdamConfig,
    state: Vec<Option<ParamState>>,
    /// Whether weight decay applies to each parameter (`set_weight_decay_mask`).
    decay: Vec<bool>,
}

impl AdamCore {
    fn new(
        kind: &'static str,
        op: &'static str,
        decoupled: bool,
        params: Vec<Tensor>,
        config: AdamConfig,
    ) -> Result<Self> {
        config.validate(op)?;
        check_params(op, &params)?;
        let state = vec![None; params.len()];
        let decay = vec![true; params.len()];
        Ok(AdamCore {
            kind,
            decoupled,
            params,
            config,
            state,
            decay,
        })
    }

    fn step(&mut self, op: &'static str) -> Result<()> {
        check_grads(op, &self.params)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = p.grad() else {
                continue;
            };
            if self.state[i].is_none() {
                self.state[i] = Some(ParamState {
                    step: 0,
                    exp_avg: state_zeros(p)?,
                    exp_avg_sq: state_zeros(p)?,
                    max_exp_avg_sq: None,
                });
            }
            let s = self.state[i].as_mut().expect("created above");
            if self.config.amsgrad && s.max_exp_avg_sq.is_none() {
                s.max_exp_avg_sq = Some(state_zeros(p)?);
            }
            s.step += 1;
            let k = adam_scalars(s.step, &self.config, self.decoupled);
            let decays = self.config.weight_decay != 0.0 && self.decay[i];
            let decay = match (decays, self.decoupled) {
                (false, _) => AdamDecay::None,
                (true, false) => AdamDecay::L2,
                (true, true) => AdamDecay::Decoupled,
            };
            // In place: the parameter's buffer is copied first only when another handle
            // shares it (`with_storage_mut`).
            let gs = g.storage();
            let (pl, gl) = (p.layout(), g.layout());
            s.exp_avg.with_storage_mut(|m| {
                s.exp_avg_sq.with_storage_mut(|v| {
                    p.with_storage_mut(|ps| match &s.max_exp_avg_sq {
                        Some(x) => x.with_storage_mut(|x| {
                            let state = AdamState {
                                exp_avg: m,
                                exp_avg_sq: v,
                                max_exp_avg_sq: Some(x),
                            };
                            ps.adam_step(pl, (&gs, gl), state, &k, decay)
                        }),
                        None => {
                            let state = AdamState {
                                exp_avg: m,
                                exp_avg_sq: v,
                                max_exp_avg_sq: None,
                            };
                            ps.adam_step(pl, (&gs, gl), state, &k, decay)
                        }
                    })
                })
            })?;
        }
        Ok(())
    }

    fn state_dict(&self) -> OptimizerState {
        let c = &self.config;
        let mut scalars = vec![
            ("num_params".to_string(), self.params.len() as f64),
            ("lr".to_string(), c.lr),
            ("beta1".to_string(), c.betas.0),
            ("beta2".to_string(), c.betas.1),
            ("eps".to_string(), c.eps),
            ("weight_decay".to_string(), c.weight_decay),
            ("amsgrad".to_string(), f64::from(u8::from(c.amsgrad))),
        ];
        let mut buffers = Vec::new();
        for (i, (p, s)) in self.params.iter().zip(&self.state).enumerate() {
            let Some(s) = s else { continue };
            scalars.push((format!("{i}.step"), s.step as f64));
            let mut push = |key: &str, data: &Tensor| {
                buffers.push(StateBuffer {
                    name: format!("{i}.{key}"),
                    shape: p.shape().to_vec(),
                    data: data.to_vec_f32(),
                })
            };
            push("exp_avg", &s.exp_avg);
            push("exp_avg_sq", &s.exp_avg_sq);
            if let Some(m) = &s.max_exp_avg_sq {
                push("max_exp_avg_sq", m);
            }
        }
        OptimizerState {
            optimizer: self.kind.to_string(),
            scalars,
            buffers,
        }
    }

    fn load_state_dict(&mut self, op: &'static str, state: &OptimizerState) -> Result<()> {
        let mut r = StateReader::new(op, state, self.kind, self.params.len())?;
        let config = AdamConfig {
            lr: r.scalar("lr")?,
            betas: (r.scalar("beta1")?, r.scalar("beta2")?),
            eps: r.scalar("eps")?,
            weight_decay: r.scalar("weight_decay")?,
            amsgrad: r.flag("amsgrad")?,
        };
        config.validate(op)?;
        let mut loaded = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let step = r.step_count(i)?;
            let exp_avg = r.buffer(i, "exp_avg", p)?;
            let exp_avg_sq = r.buffer(i, "exp_avg_sq", p)?;
            let max_exp_avg_sq = r.buffer(i, "max_exp_avg_sq", p)?;
            loaded.push(match (step, exp_avg, exp_avg_sq) {
                (None, None, None) if max_exp_avg_sq.is_none() => None,
                (Some(step), Some(exp_avg), Some(exp_avg_sq))
                    if max_exp_avg_sq.is_some() == config.amsgrad =>
                {
                    Some(ParamState {
                        step,
                        exp_avg,
                        exp_avg_sq,
                        max_exp_avg_sq,
                    })
                }
                _ => {
                    return Err(Error::arg(
                        op,
                        format!(
                        "incomplete state for parameter {i}: need \"{i}.step\", \"{i}.exp_avg\", \
                             \"{i}.exp_avg_sq\"{} together",
                        if config.amsgrad {
                            format!(", \"{i}.max_exp_avg_sq\"")
                        } else {
                            String::new()
                        }
                    ),
                    ))
                }
            });
        }
        r.finish()?;
        self.config = config;
        self.state = loaded;
        Ok(())
    }
}

/// One Adam(W) step's scalars for the backend's update. They are computed in f64
/// as PyTorch computes them in Python floats (`**` is libm's `pow`, as in CPython), the
/// element-wise part in F32 as ATen's CPU kernels do:
///
/// ```text
/// t  = t + 1
/// p  = p * (1 - lr * wd)                       (AdamW)
/// g  = g + wd * p                              (Adam, if wd != 0)
/// m  = m + (1 - beta1) * (g - m)               (torch.lerp)
/// v  = beta2 * v + (1 - beta2) * g * g
/// v̂  = max(v̂, v)                               (amsgrad; v̂ replaces v below)
/// p  = p + (-lr / (1 - beta1^t)) * m / (sqrt(v) / (1 - beta2^t)^0.5 + eps)
/// ```
fn adam_scalars(step: u64, c: &AdamConfig, decoupled: bool) -> AdamScalars {
    let (beta1, beta2) = c.betas;
    let t = step as f64;
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = c.lr / bias_correction1;
    // Python's `bias_correction2 ** 0.5` calls libm's pow, which need not agree with sqrt in
    // the last bit; the opaque exponent keeps LLVM from rewriting pow(x, 0.5) as sqrt(x).
    let bias_correction2_sqrt = bias_correction2.powf(std::hint::black_box(0.5));
    let weight = (1.0 - beta1) as f32; // lerp's weight, cast to F32 by ATen
    AdamScalars {
        decay: if decoupled {
            (1.0 - c.lr * c.weight_decay) as f32
        } else {
            c.weight_decay as f32
        },
        // ATen's lerp: `start + w * (end - start)` for |w| < 0.5, else
        // `end + (w - 1) * (end - start)`, either one fused multiply-add.
        lerp_small: weight.abs() < 0.5,
        lerp_coeff: if weight.abs() < 0.5 {
            weight
        } else {
            weight - 1.0
        },
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        bias_correction2_sqrt: bias_correction2_sqrt as f32,
        eps: c.eps as f32,
        neg_step_size: (-step_size) as f32,
    }
}

/// Adam (Kingma & Ba), PyTorch's `torch.optim.Adam`: L2 weight decay added to the gradient.
pub struct Adam(AdamCore);

impl Adam {
    /// Errors on invalid hyper-parameters (negative lr/eps/weight_decay, a beta outside
    /// [0, 1)) and on parameters that are not whole F32/F16/BF16 leaves.
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<Adam> {
        AdamCore::new("adam", "Adam::new", false, params, config).map(Adam)
    }

    /// The hyper-parameters in use (the lr as last set, e.g. by a schedule).
    pub fn config(&self) -> AdamConfig {
        self.0.config
    }
}

/// AdamW (Loshchilov & Hutter), PyTorch's `torch.optim.AdamW`: weight decay decoupled from
/// the gradient, applied as `p *= 1 - lr * weight_decay` before the Adam update.
pub struct AdamW(AdamCore);

impl AdamW {
    /// Errors as `Adam::new`.
    pub fn new(params: Vec<Tensor>, config: AdamWConfig) -> Result<AdamW> {
        AdamCore::new("adamw", "AdamW::new", true, params, config.into()).map(AdamW)
    }

    /// The hyper-parameters in use (the lr as last set, e.g. by a schedule).
    pub fn config(&self) -> AdamWConfig {
        self.0.config.into()
    }
}

/// Both optimizers forward to the shared core; only the op names in errors differ.
macro_rules! impl_optimizer {
    ($ty:ident, $name:literal) => {
        impl Optimizer for $ty {
            fn step(&mut self) -> Result<()> {
                self.0.step(concat!($name, "::step"))
            }
            fn lr(&self) -> f64 {
                self.0.config.lr
            }
            fn set_lr(&mut self, lr: f64) {
                self.0.config.lr = lr;
            }
            fn params(&self) -> &[Tensor] {
                &self.0.params
            }
            fn state_dict(&self) -> OptimizerState {
                self.0.state_dict()
            }
            fn state_bytes(&self) -> usize {
                (self.0.state.iter().flatten())
                    .map(|s| {
                        let max = s.max_exp_avg_sq.as_ref().map_or(0, Tensor::numel);
                        (s.exp_avg.numel() + s.exp_avg_sq.numel() + max) * 4
                    })
                    .sum()
            }
            fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
                self.0
                    .load_state_dict(concat!($name, "::load_state_dict"), state)
            }
            fn set_weight_decay_mask(&mut self, decay: &[bool]) -> Result<()> {
                let op = concat!($name, "::set_weight_decay_mask");
                check_decay_mask(op, decay, self.0.params.len())?;
                self.0.decay = decay.to_vec();
                Ok(())
            }
        }
    };
}

impl_optimizer!(Adam, "Adam");
impl_optimizer!(AdamW, "AdamW");
