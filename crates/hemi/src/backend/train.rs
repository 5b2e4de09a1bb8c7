//! Training primitives: the fused unscale-and-check-finite of the loss scaler (`AmpOps`)
//! and the optimizer updates (`OptimOps`).

use super::BackendStorage;
use crate::dtype::convert::Rounding;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::{Layout, Storage};

/// One SGD step's hyper-parameters as PyTorch's F32 kernel sees them (Python floats reach
/// ATen as double Scalars, which the F32 kernel casts to float).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    /// `-lr`, the factor applied to the update direction.
    pub neg_lr: f32,
    /// The L2 weight-decay coefficient added as `wd * p` to the gradient.
    pub weight_decay: f32,
    /// The momentum factor (PyTorch's `momentum`).
    pub momentum: f32,
    /// `1 - dampening`.
    pub keep: f32,
}

/// Which parts of the SGD rule run this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SgdFlags {
    /// Add `weight_decay * p` to the gradient first.
    pub weight_decay: bool,
    /// Keep a momentum buffer (`momentum != 0`).
    pub momentum: bool,
    /// The momentum buffer's first step: it becomes the (decayed) gradient itself.
    pub first: bool,
    /// Nesterov momentum: step along `g + momentum * buf` instead of `buf`.
    pub nesterov: bool,
}

/// Where weight decay enters an Adam step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdamDecay {
    /// No weight decay.
    None,
    /// Adam: `g = g + wd * p`.
    L2,
    /// AdamW: `p = p * (1 - lr * wd)` first.
    Decoupled,
}

/// One Adam step's scalars as the F32 kernel sees them (computed in f64 by the optimizer,
/// as PyTorch computes them in Python floats).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamScalars {
    /// Adam: the L2 coefficient `wd`; AdamW: the factor `1 - lr * wd`.
    pub decay: f32,
    /// ATen's lerp: `start + w * (end - start)` when |w| < 0.5, else
    /// `end + (w - 1) * (end - start)`; `lerp_coeff` is `w` or `w - 1` accordingly.
    pub lerp_small: bool,
    /// The lerp weight for the first moment `m`: `1 - beta1` when `lerp_small`, else `(1 -
    /// beta1) - 1`.
    pub lerp_coeff: f32,
    /// `beta2`, the decay of the running mean of squared gradients.
    pub beta2: f32,
    /// `1 - beta2`, rounded to F32 on its own as ATen does.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`, the second moment's bias correction (computed with `pow(_,
    /// 0.5)` as CPython does).
    pub bias_correction2_sqrt: f32,
    /// Added to the denominator for stability (`eps`).
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`: the step along `m / denom`, with the first moment's bias
    /// correction folded in.
    pub neg_step_size: f32,
}

/// The optimizer-update primitives a backend implements: SGD (momentum, Nesterov, weight
/// decay) and Adam/AdamW (AMSGrad) steps, PyTorch's updates bit for bit in F32, with state
/// buffers updated in place.
pub trait OptimOps: BackendStorage {
    /// One SGD step of the parameter `self` (read through `lp`, F32/F16/BF16) with gradient
    /// `grad` (any float dtype, read through `lg`, same element count) and, with momentum,
    /// the F32 momentum buffer updated in place. Returns the new parameter values in the
    /// parameter's dtype, rounded once. The update is PyTorch's, bit for bit in F32.
    #[allow(clippy::too_many_arguments)]
    fn sgd_step(
        &self,
        lp: &Layout,
        grad: &Self,
        lg: &Layout,
        buf: Option<&mut Self>,
        s: &SgdScalars,
        f: SgdFlags,
    ) -> Result<Self>;

    /// One Adam(W) step: `exp_avg`, `exp_avg_sq` and (AMSGrad) `max_exp_avg_sq` are F32
    /// buffers updated in place; returns the new parameter values in its dtype.
    #[allow(clippy::too_many_arguments)]
    fn adam_step(
        &self,
        lp: &Layout,
        grad: &Self,
        lg: &Layout,
        exp_avg: &mut Self,
        exp_avg_sq: &mut Self,
        max_exp_avg_sq: Option<&mut Self>,
        k: &AdamScalars,
        decay: AdamDecay,
    ) -> Result<Self>;
}

/// The loss scaler's primitive a backend implements: the fused unscale-and-check-finite of
/// PyTorch's `_amp_foreach_non_finite_check_and_unscale_`.
pub trait AmpOps: BackendStorage {
    /// The loss scaler's fused unscale-and-check: `self * inv` (read through `layout`) in
    /// F32 — in F64 for an F64 gradient, as PyTorch multiplies a double gradient by its F32
    /// `inv_scale` widened — as a new buffer, and 1.0 stored into the one-element F32 buffer
    /// `found_inf` when any element of `self` is inf or NaN (it is never cleared here, so one
    /// flag serves a whole list of gradients and is read back once). As PyTorch's
    /// `_amp_foreach_non_finite_check_and_unscale_`, the check is on the scaled gradient
    /// read, not on the product.
    fn unscale_check(&self, layout: &Layout, inv: f32, found_inf: &mut Self) -> Result<Self>;

    /// One gradient's part of a `p`-norm, in f64 over its F32 (F64 for F64) values in
    /// element order: `max |x|` for p = ∞ (NaN if any element is NaN), else `Σ |x|^p`
    /// (`Σ x·x` for p = 2, `Σ |x|` for p = 1). The caller combines the parts and takes the
    /// root (gradient clipping).
    fn norm_partial(&self, layout: &Layout, p: f64) -> Result<f64>;

    /// How many elements (read as F32) are nonzero with `|x| < tiny`, and how many have
    /// `|x| > max` or are NaN: a gradient's F16 underflow and overflow counts.
    fn range_counts(&self, layout: &Layout, tiny: f64, max: f64) -> Result<(u64, u64)>;

    /// The elements `layout` addresses, read as F32, rounded into a new buffer of the float
    /// `dtype` as `rounding` says: nearest-even, or stochastically into F16/BF16 with bits
    /// drawn from `rng` in element order (one `next_u64` per F16 element, one per four BF16
    /// elements), so a seeded run is reproducible (`amp::rounding::round_f32_into`'s rules).
    fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Self>;
}

fn mixed(op: &'static str, a: &Storage, b: &Storage) -> Error {
    Error::device(op, format!("inputs on {} and {}", a.device(), b.device()))
}

impl Storage {
    /// `AmpOps::unscale_check` on this storage's backend (`found_inf` on the same device).
    pub fn unscale_check(
        &self,
        layout: &Layout,
        inv: f32,
        found_inf: &mut Storage,
    ) -> Result<Storage> {
        #[allow(unreachable_patterns)]
        match (self, found_inf) {
            (Storage::Cpu(g), Storage::Cpu(f)) => {
                Ok(Storage::Cpu(g.unscale_check(layout, inv, f)?))
            }
            (g, f) => Err(mixed("unscale_check", g, f)),
        }
    }

    /// `AmpOps::norm_partial` on this storage's backend (one f64 read back).
    pub fn norm_partial(&self, layout: &Layout, p: f64) -> Result<f64> {
        crate::tensor::storage::dispatch!(self, s => s.norm_partial(layout, p))
    }

    /// `AmpOps::range_counts` on this storage's backend (two counts read back).
    pub fn range_counts(&self, layout: &Layout, tiny: f64, max: f64) -> Result<(u64, u64)> {
        crate::tensor::storage::dispatch!(self, s => s.range_counts(layout, tiny, max))
    }

    /// `AmpOps::round_into` on this storage's backend.
    pub fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Storage> {
        Ok(
            crate::tensor::storage::dispatch!(self, s => crate::tensor::storage::wrap!(
                self,
                s.round_into(layout, dtype, rounding, rng)?
            )),
        )
    }

    /// `OptimOps::sgd_step` on this storage's backend; every buffer on the same device.
    pub fn sgd_step(
        &self,
        lp: &Layout,
        grad: &Storage,
        lg: &Layout,
        buf: Option<&mut Storage>,
        s: &SgdScalars,
        f: SgdFlags,
    ) -> Result<Storage> {
        const OP: &str = "sgd_step";
        #[allow(unreachable_patterns)]
        match (self, grad, buf) {
            (Storage::Cpu(p), Storage::Cpu(g), None) => {
                Ok(Storage::Cpu(p.sgd_step(lp, g, lg, None, s, f)?))
            }
            (Storage::Cpu(p), Storage::Cpu(g), Some(Storage::Cpu(b))) => {
                Ok(Storage::Cpu(p.sgd_step(lp, g, lg, Some(b), s, f)?))
            }
            (p, g, _) if p.device() != g.device() => Err(mixed(OP, p, g)),
            (p, _, Some(b)) => Err(mixed(OP, p, b)),
            (p, g, None) => Err(mixed(OP, p, g)),
        }
    }

    /// `OptimOps::adam_step` on this storage's backend; every buffer on the same device.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step(
        &self,
        lp: &Layout,
        grad: &Storage,
        lg: &Layout,
        exp_avg: &mut Storage,
        exp_avg_sq: &mut Storage,
        max_exp_avg_sq: Option<&mut Storage>,
        k: &AdamScalars,
        decay: AdamDecay,
    ) -> Result<Storage> {
        const OP: &str = "adam_step";
        #[allow(unreachable_patterns)]
        match (self, grad, exp_avg, exp_avg_sq, max_exp_avg_sq) {
            (Storage::Cpu(p), Storage::Cpu(g), Storage::Cpu(m), Storage::Cpu(v), None) => {
                Ok(Storage::Cpu(p.adam_step(lp, g, lg, m, v, None, k, decay)?))
            }
            (
                Storage::Cpu(p),
                Storage::Cpu(g),
                Storage::Cpu(m),
                Storage::Cpu(v),
                Some(Storage::Cpu(x)),
            ) => Ok(Storage::Cpu(p.adam_step(
                lp,
                g,
                lg,
                m,
                v,
                Some(x),
                k,
                decay,
            )?)),
            (p, g, ..) if p.device() != g.device() => Err(mixed(OP, p, g)),
            (p, _, m, ..) => Err(mixed(OP, p, m)),
        }
    }
}
