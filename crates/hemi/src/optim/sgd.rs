//! Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight
//! decay: PyTorch's `torch.optim.SGD` update rule, step for step.

use super::optimizer::{
    check_grads, check_nonneg, check_params, grad_f32, write_param, Optimizer, OptimizerState,
    StateBuffer, StateReader,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of `Sgd` (PyTorch's names and defaults; PyTorch has no default lr, hemi
/// takes the documents' 0.001).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    fn validate(&self, op: &'static str) -> Result<()> {
        check_nonneg(op, "learning rate", self.lr)?;
        check_nonneg(op, "momentum", self.momentum)?;
        check_nonneg(op, "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::arg(
                op,
                format!("invalid dampening: {}", self.dampening),
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::arg(
                op,
                format!(
                    "Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }
}

/// SGD over a list of parameters. For each parameter `p` with gradient `g` (all in F32):
///
/// ```text
/// g = g + weight_decay * p                         (if weight_decay != 0)
/// b = g                                            (first step with momentum != 0)
/// b = momentum * b + (1 - dampening) * g           (later steps)
/// g = g + momentum * b   (nesterov)   or   g = b   (otherwise)
/// p = p - lr * g
/// ```
///
/// The F32 arithmetic is PyTorch's CPU arithmetic, bit for bit (`tests/torch_parity.rs`):
/// each `x + a * y` above is one fused multiply-add, `momentum * b` is rounded on its own,
/// and the hyper-parameters are rounded to F32 once, as ATen does with Python floats.
pub struct Sgd {
    params: Vec<Tensor>,
    config: SgdConfig,
    /// One F32 momentum buffer per parameter, created by its first step with a gradient.
    momentum_buffers: Vec<Option<Vec<f32>>>,
}

impl Sgd {
    /// Errors on invalid hyper-parameters (negative lr, nesterov without momentum or with
    /// dampening) and on parameters that are not whole F32/F16/BF16 leaves.
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<Sgd> {
        config.validate("Sgd::new")?;
        check_params("Sgd::new", &params)?;
        let momentum_buffers = vec![None; params.len()];
        Ok(Sgd {
            params,
            config,
            momentum_buffers,
        })
    }

    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Parameter `i`'s momentum buffer (F32, row-major), once its first step created it.
    pub fn momentum_buffer(&self, i: usize) -> Option<&[f32]> {
        self.momentum_buffers.get(i)?.as_deref()
    }
}

/// One SGD step over one parameter's values, in place (`buf`: the parameter's momentum
/// buffer, created here on its first step).
fn sgd_update(p: &mut [f32], g: &[f32], buf: &mut Option<Vec<f32>>, c: &SgdConfig) {
    // Python floats reach ATen as double Scalars, which the F32 kernels cast to float.
    let s = SgdScalars {
        neg_lr: (-c.lr) as f32,
        weight_decay: c.weight_decay as f32,
        momentum: c.momentum as f32,
        keep: (1.0 - c.dampening) as f32,
    };
    let wd = c.weight_decay != 0.0;
    if c.momentum == 0.0 {
        return match wd {
            false => sgd_loop::<false, false, false, false>(p, g, &mut [], s),
            true => sgd_loop::<true, false, false, false>(p, g, &mut [], s),
        };
    }
    // The first step takes the buffer as the (weight-decayed) gradient itself.
    let first = buf.is_none();
    let b = buf.get_or_insert_with(|| vec![0.0; p.len()]);
    match (wd, first, c.nesterov) {
        (false, false, false) => sgd_loop::<false, true, false, false>(p, g, b, s),
        (false, false, true) => sgd_loop::<false, true, false, true>(p, g, b, s),
        (false, true, false) => sgd_loop::<false, true, true, false>(p, g, b, s),
        (false, true, true) => sgd_loop::<false, true, true, true>(p, g, b, s),
        (true, false, false) => sgd_loop::<true, true, false, false>(p, g, b, s),
        (true, false, true) => sgd_loop::<true, true, false, true>(p, g, b, s),
        (true, true, false) => sgd_loop::<true, true, true, false>(p, g, b, s),
        (true, true, true) => sgd_loop::<true, true, true, true>(p, g, b, s),
    }
}

/// The hyper-parameters as the F32 kernel sees them.
#[derive(Clone, Copy)]
struct SgdScalars {
    neg_lr: f32,
    weight_decay: f32,
    momentum: f32,
    /// `1 - dampening`.
    keep: f32,
}

/// `sgd_kernel` compiled with FMA where the CPU has it (`has_fma` says why), else as is.
fn sgd_loop<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    s: SgdScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if super::optimizer::has_fma() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma<
            const WD: bool,
            const MOMENTUM: bool,
            const FIRST: bool,
            const NESTEROV: bool,
        >(
            p: &mut [f32],
            g: &[f32],
            buf: &mut [f32],
            s: SgdScalars,
        ) {
            sgd_kernel::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s)
        }
        // SAFETY: selected only after `has_fma()` detected AVX2 and FMA.
        return unsafe { fma::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s) };
    }
    sgd_kernel::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s)
}

/// PyTorch's `_single_tensor_sgd`, element by element, rounding where its CPU kernels round:
/// every `x.add(y, alpha=a)` is one fused multiply-add `y * a + x` (ATen's vectorised `add`
/// is `fmadd(other, alpha, self)`, and its scalar tail is contracted the same way), and
/// `buf.mul_(momentum)` is a separate F32 product. The configuration is in the const
/// parameters so that each loop is branch-free and vectorises.
#[inline(always)]
fn sgd_kernel<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    s: SgdScalars,
) {
    let n = p.len();
    let g = &g[..n];
    let buf = if MOMENTUM { &mut buf[..n] } else { buf };
    for i in 0..n {
        // grad = grad.add(param, alpha=weight_decay)
        let mut d = if WD {
            p[i].mul_add(s.weight_decay, g[i])
        } else {
            g[i]
        };
        if MOMENTUM {
            // First step: buf = grad.clone(); then buf.mul_(momentum).add_(grad, alpha=1-dampening)
            let b = if FIRST {
                d
            } else {
                d.mul_add(s.keep, buf[i] * s.momentum)
            };
            buf[i] = b;
            // grad = grad.add(buf, alpha=momentum) (Nesterov), else grad = buf
            d = if NESTEROV {
                b.mul_add(s.momentum, d)
            } else {
                b
            };
        }
        // param.add_(grad, alpha=-lr)
        p[i] = d.mul_add(s.neg_lr, p[i]);
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        check_grads("Sgd::step", &self.params)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = grad_f32(p) else {
                continue;
            };
            let mut values = p.to_vec_f32();
            sgd_update(&mut values, &g, &mut self.momentum_buffers[i], &self.config);
            write_param(p, values)?;
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn state_dict(&self) -> OptimizerState {
        let c = &self.config;
        let scalars = vec![
            ("num_params".to_string(), self.params.len() as f64),
            ("lr".to_string(), c.lr),
            ("momentum".to_string(), c.momentum),
            ("dampening".to_string(), c.dampening),
            ("weight_decay".to_string(), c.weight_decay),
            ("nesterov".to_string(), f64::from(u8::from(c.nesterov))),
        ];
        let buffers = (self.params.iter().zip(&self.momentum_buffers).enumerate())
            .filter_map(|(i, (p, b))| {
                Some(StateBuffer {
                    name: format!("{i}.momentum_buffer"),
                    shape: p.shape().to_vec(),
                    data: b.clone()?,
                })
            })
            .collect();
        OptimizerState {
            optimizer: "sgd".to_string(),
            scalars,
            buffers,
        }
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        const OP: &str = "Sgd::load_state_dict";
        let mut r = StateReader::new(OP, state, "sgd", self.params.len())?;
        let config = SgdConfig {
            lr: r.scalar("lr")?,
            momentum: r.scalar("momentum")?,
            dampening: r.scalar("dampening")?,
            weight_decay: r.scalar("weight_decay")?,
            nesterov: r.flag("nesterov")?,
        };
        config.validate(OP)?;
        let buffers = (self.params.iter().enumerate())
            .map(|(i, p)| r.buffer(i, "momentum_buffer", p))
            .collect::<Result<Vec<_>>>()?;
        r.finish()?;
        self.config = config;
        self.momentum_buffers = buffers;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::optim::optimizer::test_data as data;

    fn agree<const WD: bool, const M: bool, const F: bool, const N: bool>() {
        let s = SgdScalars {
            neg_lr: -0.0123,
            weight_decay: 1e-3,
            momentum: 0.9,
            keep: 0.7,
        };
        // Lengths around 8- and 16-lane vectors and their tails.
        for n in [1, 7, 8, 9, 15, 17, 31, 33, 100] {
            let (mut p1, g, mut b1) = (data(n, 1), data(n, 2), data(n, 3));
            let (mut p2, mut b2) = (p1.clone(), b1.clone());
            let (b1, b2): (&mut [f32], &mut [f32]) = if M {
                (&mut b1, &mut b2)
            } else {
                (&mut [], &mut [])
            };
            sgd_loop::<WD, M, F, N>(&mut p1, &g, b1, s); // the FMA build where there is one
            sgd_kernel::<WD, M, F, N>(&mut p2, &g, b2, s); // the portable build
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p1), bits(&p2), "n {n}");
            assert_eq!(bits(b1), bits(b2), "n {n}");
        }
    }

    #[test]
    fn fma_and_portable_builds_give_the_same_bits() {
        agree::<false, false, false, false>();
        agree::<true, false, false, false>();
        agree::<false, true, true, false>();
        agree::<true, true, false, false>();
        agree::<true, true, false, true>();
        agree::<false, true, false, true>();
    }
}
