//! The optimizer updates from F32 maps: PyTorch's `_single_tensor_sgd` and `_single_tensor_adam`
//! written step by step with `unary` and `binary`, the new parameter rounded once into its
//! dtype. PyTorch's CPU kernels fuse each `add(alpha=)`, `lerp` and `addcmul` into one
//! multiply-add; the maps round the product and the sum separately, so the composition agrees
//! with the CPU's kernel (which is PyTorch's, bit for bit) to an F32 rounding per operation,
//! not bit for bit. A backend overrides these with its fused kernel.

use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::View;
use crate::backend::train::{AdamDecay, AdamScalars, AdamState, SgdFlags, SgdScalars};
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Layout;

const F32: DType = DType::F32;

/// F32 maps over `n` contiguous elements.
struct Maps {
    flat: Layout,
    one: Layout,
}

impl Maps {
    fn new(n: usize) -> Maps {
        Maps {
            flat: Layout::contiguous(&[n]),
            one: Layout::new(vec![n], vec![0], 0),
        }
    }
    fn mul<B: MapOps>(&self, x: &B, c: f32) -> Result<B> {
        x.unary(&self.flat, UnaryOp::MulScalar(f64::from(c)), F32)
    }
    fn bin<B: MapOps>(&self, a: &B, b: &B, op: BinaryOp) -> Result<B> {
        a.binary(&self.flat, b, &self.flat, op, F32)
    }
    /// `x op c` with `c` an F32 constant on `x`'s device.
    fn with_const<B: MapOps>(&self, x: &B, c: f32, op: BinaryOp) -> Result<B> {
        let c = x.upload(&CpuStorage::from_vec(vec![c]))?;
        x.binary(&self.flat, &c, &self.one, op, F32)
    }
}

/// An F32 state buffer of `n` values, or an error naming it.
fn state<B: BackendStorage>(op: &'static str, what: &str, b: &B, n: usize) -> Result<()> {
    if b.dtype() != F32 || b.len() != n {
        return Err(Error::arg(
            op,
            format!(
                "{what} must hold {n} F32 values, got {} {}",
                b.len(),
                b.dtype()
            ),
        ));
    }
    Ok(())
}

/// The parameter and gradient as F32 buffers of one length, or a shape error.
fn operands<B: MapOps>(op: &'static str, p: &B, lp: &Layout, g: &B, lg: &Layout) -> Result<(B, B)> {
    if !p.dtype().is_float() || p.dtype() == DType::F64 {
        return Err(Error::arg(
            op,
            format!("the parameter must be F32, F16 or BF16, got {}", p.dtype()),
        ));
    }
    if lg.numel() != lp.numel() {
        return Err(Error::shape(
            op,
            format!("{} gradients for {} parameters", lg.numel(), lp.numel()),
        ));
    }
    Ok((p.cast(lp, F32)?, g.cast(lg, F32)?))
}

/// One SGD step (`OptimOps::sgd_step`): `d = g + wd·p`; with momentum `buf = d` (first step)
/// or `momentum·buf + (1-dampening)·d`, then `d = d + momentum·buf` (Nesterov) or `buf`;
/// `p = p - lr·d`, rounded once into the parameter's dtype.
pub fn sgd_step<B: MapOps>(
    param: &mut B,
    lp: &Layout,
    (grad, lg): View<'_, B>,
    buf: Option<&mut B>,
    s: &SgdScalars,
    f: SgdFlags,
) -> Result<()> {
    const OP: &str = "sgd_step";
    let n = lp.numel();
    let (p, g) = operands(OP, param, lp, grad, lg)?;
    let m = Maps::new(n);
    let mut d = if f.weight_decay {
        m.bin(&m.mul(&p, s.weight_decay)?, &g, BinaryOp::Add)?
    } else {
        g
    };
    if f.momentum {
        let Some(buf) = buf else {
            return Err(Error::arg(OP, "momentum needs a momentum buffer"));
        };
        state(OP, "the momentum buffer", buf, n)?;
        let b = if f.first {
            d.clone()
        } else {
            let kept = m.mul(buf, s.momentum)?;
            m.bin(&m.mul(&d, s.keep)?, &kept, BinaryOp::Add)?
        };
        d = if f.nesterov {
            m.bin(&m.mul(&b, s.momentum)?, &d, BinaryOp::Add)?
        } else {
            b.clone()
        };
        *buf = b;
    }
    let step = m.mul(&d, s.neg_lr)?;
    *param = step.binary(&m.flat, &p, &m.flat, BinaryOp::Add, param.dtype())?;
    Ok(())
}

/// One Adam(W) step (`OptimOps::adam_step`), PyTorch's order: decoupled decay `p·(1-lr·wd)` or
/// L2 `g + wd·p`; `m = lerp(m, g, 1-β1)`; `v = β2·v + (1-β2)·g·g`; AMSGrad's running
/// maximum; `denom = sqrt(v) / sqrt(1-β2^t) + eps`; `p = p + (-step·m) / denom`, rounded once
/// into the parameter's dtype.
pub fn adam_step<B: MapOps>(
    param: &mut B,
    lp: &Layout,
    (grad, lg): View<'_, B>,
    AdamState {
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
    }: AdamState<'_, B>,
    k: &AdamScalars,
    decay: AdamDecay,
) -> Result<()> {
    const OP: &str = "adam_step";
    let n = lp.numel();
    state(OP, "exp_avg", exp_avg, n)?;
    state(OP, "exp_avg_sq", exp_avg_sq, n)?;
    if let Some(x) = &max_exp_avg_sq {
        state(OP, "max_exp_avg_sq", *x, n)?;
    }
    let (mut p, mut g) = operands(OP, param, lp, grad, lg)?;
    let m = Maps::new(n);
    match decay {
        AdamDecay::None => {}
        AdamDecay::Decoupled => p = m.mul(&p, k.decay)?,
        AdamDecay::L2 => g = m.bin(&m.mul(&p, k.decay)?, &g, BinaryOp::Add)?,
    }
    // exp_avg.lerp_(grad, 1 - beta1): base + w·(g - m), base m or g as ATen picks.
    let diff = m.bin(&g, exp_avg, BinaryOp::Sub)?;
    let step = m.mul(&diff, k.lerp_coeff)?;
    let base = if k.lerp_small { &*exp_avg } else { &g };
    let new_m = m.bin(&step, base, BinaryOp::Add)?;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    let gg = m.bin(&m.mul(&g, k.one_minus_beta2)?, &g, BinaryOp::Mul)?;
    let new_v = m.bin(&gg, &m.mul(exp_avg_sq, k.beta2)?, BinaryOp::Add)?;
    let v = match max_exp_avg_sq {
        Some(max) => {
            *max = m.bin(&new_v, max, BinaryOp::Maximum)?;
            max.clone()
        }
        None => new_v.clone(),
    };
    let root = v.unary(&m.flat, UnaryOp::Sqrt, F32)?;
    let denom = m.with_const(&root, k.bias_correction2_sqrt, BinaryOp::Div)?;
    let denom = denom.unary(&m.flat, UnaryOp::AddScalar(f64::from(k.eps)), F32)?;
    let upd = m.bin(&m.mul(&new_m, k.neg_step_size)?, &denom, BinaryOp::Div)?;
    *param = p.binary(&m.flat, &upd, &m.flat, BinaryOp::Add, param.dtype())?;
    *exp_avg = new_m;
    *exp_avg_sq = new_v;
    Ok(())
}
