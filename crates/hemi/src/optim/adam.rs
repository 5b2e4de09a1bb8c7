//! Adam and AdamW: PyTorch's `torch.optim.Adam` / `torch.optim.AdamW` update rules and
//! defaults, with optional AMSGrad. One implementation serves both; they differ only in
//! where weight decay enters (Adam: an L2 term added to the gradient; AdamW: decoupled,
//! `p *= 1 - lr * weight_decay` before the update) and in the default weight decay.

use super::optimizer::{
    check_grads, check_nonneg, check_params, grad_f32, write_param, Optimizer, OptimizerState,
    StateBuffer, StateReader,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of `Adam` (PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight_decay 0, amsgrad off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    /// L2 penalty: `weight_decay * p` is added to the gradient.
    pub weight_decay: f64,
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
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    /// Decoupled decay: each step first scales `p` by `1 - lr * weight_decay`.
    pub weight_decay: f64,
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
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Running maximum of `exp_avg_sq` (amsgrad only).
    max_exp_avg_sq: Option<Vec<f32>>,
}

/// What Adam and AdamW share: the parameters, hyper-parameters and per-parameter state.
struct AdamCore {
    kind: &'static str,
    decoupled: bool,
    params: Vec<Tensor>,
    config: AdamConfig,
    state: Vec<Option<ParamState>>,
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
        Ok(AdamCore {
            kind,
            decoupled,
            params,
            config,
            state,
        })
    }

    fn step(&mut self, op: &'static str) -> Result<()> {
        check_grads(op, &self.params)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = grad_f32(p) else {
                continue;
            };
            let n = p.numel();
            let s = self.state[i].get_or_insert_with(|| ParamState {
                step: 0,
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
                max_exp_avg_sq: None,
            });
            if self.config.amsgrad && s.max_exp_avg_sq.is_none() {
                s.max_exp_avg_sq = Some(vec![0.0; n]);
            }
            let mut values = p.to_vec_f32();
            adam_update(&mut values, &g, s, &self.config, self.decoupled);
            write_param(p, values)?;
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
            let mut push = |key: &str, data: &Vec<f32>| {
                buffers.push(StateBuffer {
                    name: format!("{i}.{key}"),
                    shape: p.shape().to_vec(),
                    data: data.clone(),
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

/// One Adam(W) step over one parameter's values, in place. The scalars are computed in f64
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
fn adam_update(p: &mut [f32], g: &[f32], s: &mut ParamState, c: &AdamConfig, decoupled: bool) {
    s.step += 1;
    let (beta1, beta2) = c.betas;
    let t = s.step as f64;
    let bias_correction1 = 1.0 - beta1.powf(t);
    let bias_correction2 = 1.0 - beta2.powf(t);
    let step_size = c.lr / bias_correction1;
    // Python's `bias_correction2 ** 0.5` calls libm's pow, which need not agree with sqrt in
    // the last bit; the opaque exponent keeps LLVM from rewriting pow(x, 0.5) as sqrt(x).
    let bias_correction2_sqrt = bias_correction2.powf(std::hint::black_box(0.5));
    let weight = (1.0 - beta1) as f32; // lerp's weight, cast to F32 by ATen
    let k = AdamScalars {
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
    };
    let (m, v) = (&mut s.exp_avg, &mut s.exp_avg_sq);
    let max = s.max_exp_avg_sq.as_deref_mut();
    match (c.weight_decay != 0.0, decoupled, max) {
        (false, _, None) => adam_loop::<NO_DECAY, false>(p, g, m, v, &mut [], k),
        (false, _, Some(mx)) => adam_loop::<NO_DECAY, true>(p, g, m, v, mx, k),
        (true, false, None) => adam_loop::<L2, false>(p, g, m, v, &mut [], k),
        (true, false, Some(mx)) => adam_loop::<L2, true>(p, g, m, v, mx, k),
        (true, true, None) => adam_loop::<DECOUPLED, false>(p, g, m, v, &mut [], k),
        (true, true, Some(mx)) => adam_loop::<DECOUPLED, true>(p, g, m, v, mx, k),
    }
}

/// Where weight decay enters (`adam_kernel`'s `DECAY`).
const NO_DECAY: u8 = 0;
/// Adam: `g = g + wd * p`.
const L2: u8 = 1;
/// AdamW: `p = p * (1 - lr * wd)`.
const DECOUPLED: u8 = 2;

/// One step's scalars as the F32 kernel sees them.
#[derive(Clone, Copy)]
struct AdamScalars {
    /// Adam: the L2 coefficient `wd`; AdamW: the factor `1 - lr * wd`.
    decay: f32,
    lerp_small: bool,
    lerp_coeff: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

/// `adam_kernel` compiled with FMA where the CPU has it (`optimizer::has_fma` says why).
fn adam_loop<const DECAY: u8, const AMSGRAD: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: &mut [f32],
    k: AdamScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if super::optimizer::has_fma() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma<const DECAY: u8, const AMSGRAD: bool>(
            p: &mut [f32],
            g: &[f32],
            m: &mut [f32],
            v: &mut [f32],
            max: &mut [f32],
            k: AdamScalars,
        ) {
            adam_kernel::<DECAY, AMSGRAD>(p, g, m, v, max, k)
        }
        // SAFETY: selected only after `has_fma()` detected AVX2 and FMA.
        return unsafe { fma::<DECAY, AMSGRAD>(p, g, m, v, max, k) };
    }
    adam_kernel::<DECAY, AMSGRAD>(p, g, m, v, max, k)
}

/// PyTorch's `_single_tensor_adam` (non-capturable branch), element by element, rounding
/// where its CPU kernels round: `add` with alpha, `lerp` and `addcmul` are fused
/// multiply-adds (ATen's vectorised kernels use `fmadd`, its scalar tails are contracted the
/// same way), `addcdiv` is `p + (value * m) / denom` with three roundings, and the square
/// root is the IEEE one.
#[inline(always)]
fn adam_kernel<const DECAY: u8, const AMSGRAD: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: &mut [f32],
    k: AdamScalars,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let max = if AMSGRAD { &mut max[..n] } else { max };
    for i in 0..n {
        let (mut pi, mut gi) = (p[i], g[i]);
        if DECAY == DECOUPLED {
            pi *= k.decay; // param.mul_(1 - lr * weight_decay)
        } else if DECAY == L2 {
            gi = pi.mul_add(k.decay, gi); // grad.add(param, alpha=weight_decay)
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let base = if k.lerp_small { m[i] } else { gi };
        m[i] = k.lerp_coeff.mul_add(gi - m[i], base);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let mut vi = (k.one_minus_beta2 * gi).mul_add(gi, v[i] * k.beta2);
        v[i] = vi;
        if AMSGRAD {
            // torch.maximum: NaN if either is NaN
            vi = if vi.is_nan() || max[i].is_nan() {
                f32::NAN
            } else {
                vi.max(max[i])
            };
            max[i] = vi;
        }
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = vi.sqrt() / k.bias_correction2_sqrt + k.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p[i] = pi + (k.neg_step_size * m[i]) / denom;
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
            fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
                self.0
                    .load_state_dict(concat!($name, "::load_state_dict"), state)
            }
        }
    };
}

impl_optimizer!(Adam, "Adam");
impl_optimizer!(AdamW, "AdamW");

#[cfg(test)]
mod tests {
    use super::*;

    use crate::optim::optimizer::test_data as data;

    fn agree<const DECAY: u8, const AMSGRAD: bool>(lerp_small: bool) {
        let k = AdamScalars {
            decay: 0.999,
            lerp_small,
            lerp_coeff: if lerp_small { 0.1 } else { 0.7 - 1.0 },
            beta2: 0.999,
            one_minus_beta2: 1e-3,
            bias_correction2_sqrt: 0.0316,
            eps: 1e-8,
            neg_step_size: -0.0101,
        };
        for n in [1, 7, 8, 9, 15, 17, 31, 33, 100] {
            let (mut p1, g, mut m1) = (data(n, 1), data(n, 2), data(n, 3));
            // Second moments are non-negative.
            let mut v1: Vec<f32> = data(n, 4).iter().map(|x| x * x).collect();
            let mut x1: Vec<f32> = data(n, 5).iter().map(|x| x * x).collect();
            let (mut p2, mut m2, mut v2, mut x2) = (p1.clone(), m1.clone(), v1.clone(), x1.clone());
            adam_loop::<DECAY, AMSGRAD>(&mut p1, &g, &mut m1, &mut v1, &mut x1, k);
            adam_kernel::<DECAY, AMSGRAD>(&mut p2, &g, &mut m2, &mut v2, &mut x2, k);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p1), bits(&p2), "n {n}");
            assert_eq!(bits(&m1), bits(&m2), "n {n}");
            assert_eq!(bits(&v1), bits(&v2), "n {n}");
            assert_eq!(bits(&x1), bits(&x2), "n {n}");
        }
    }

    #[test]
    fn fma_and_portable_builds_give_the_same_bits() {
        for small in [true, false] {
            agree::<NO_DECAY, false>(small);
            agree::<L2, false>(small);
            agree::<DECOUPLED, true>(small);
        }
    }
}
