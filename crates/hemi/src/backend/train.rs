//! Training primitives: the fused unscale-and-check-finite of the loss scaler (`AmpOps`)
//! and the optimizer updates (`OptimOps`).

use super::declare::primitives;
use super::map::MapOps;
use super::nn::View;
use crate::dtype::convert::Rounding;
use crate::dtype::DType;
use crate::rng::Generator;
use crate::tensor::Layout;

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

/// Adam's state buffers (F32), updated in place by a step.
#[derive(Debug)]
pub struct AdamState<'a, S> {
    /// The running mean of the gradients (`m`).
    pub exp_avg: &'a mut S,
    /// The running mean of the squared gradients (`v`).
    pub exp_avg_sq: &'a mut S,
    /// AMSGrad's running maximum of `v`, when AMSGrad is on.
    pub max_exp_avg_sq: Option<&'a mut S>,
}

primitives! {
    /// The optimizer-update primitives a backend implements: SGD (momentum, Nesterov, weight
    /// decay) and Adam/AdamW (AMSGrad) steps, PyTorch's updates bit for bit in F32, with state
    /// buffers updated in place.
    pub trait OptimOps: MapOps {
        /// One SGD step of the parameter `self` (the whole buffer, contiguous through `lp`;
        /// F32/F16/BF16) with gradient `grad` (any float dtype, a view, same element
        /// count) and, with momentum, the F32 momentum buffer. Everything is updated in place; a
        /// half parameter is rounded once. The update is PyTorch's, bit for bit in F32.
        fn sgd_step(
            &mut self,
            lp: &Layout,
            grad: View<'_, Self>,
            buf: Option<&mut Self>,
            s: &SgdScalars,
            f: SgdFlags,
        ) -> Result<()> {
            super::compose::optim::sgd_step(self, lp, grad, buf, s, f)
        }

        /// One Adam(W) step: the parameter (as for `sgd_step`), `exp_avg`, `exp_avg_sq` and
        /// (AMSGrad) `max_exp_avg_sq` (F32) updated in place.
        fn adam_step(
            &mut self,
            lp: &Layout,
            grad: View<'_, Self>,
            state: AdamState<'_, Self>,
            k: &AdamScalars,
            decay: AdamDecay,
        ) -> Result<()> {
            super::compose::optim::adam_step(self, lp, grad, state, k, decay)
        }
    }
}

/// `floor(log2 |x|)` of F32 values, counted: F32's whole range, from the smallest
/// subnormal 2^-149 to the largest binade 2^127, one bin per binade, plus zeros and non-finite
/// values. A dtype's limits are powers of two (F16: smallest subnormal 2^-24, smallest normal
/// 2^-14, overflow from the binade 2^16; BF16: 2^-133, 2^-126, 2^128), so the share of values a
/// dtype loses, before or after multiplying by a power-of-two loss scale, is a sum of bins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log2Histogram {
    /// `counts[i]` holds the values with `floor(log2 |x|) == Log2Histogram::E_MIN + i`.
    pub counts: Vec<u64>,
    /// Values equal to ±0.
    pub zeros: u64,
    /// NaN and ±inf.
    pub nonfinite: u64,
}

impl Default for Log2Histogram {
    fn default() -> Self {
        Log2Histogram {
            counts: vec![0; Self::BINS],
            zeros: 0,
            nonfinite: 0,
        }
    }
}

impl Log2Histogram {
    /// The exponent of the first bin: F32's smallest subnormal is 2^-149.
    pub const E_MIN: i32 = -149;
    /// Bins: binades 2^-149 .. 2^127.
    pub const BINS: usize = 277;
    /// The binade of F16's smallest subnormal, 2^-24: nonzero values below it are lost.
    pub const F16_SUBNORMAL: i32 = -24;
    /// The first binade F16 cannot hold: from 2^16 (above 65504) values overflow.
    pub const F16_OVERFLOW: i32 = 16;

    /// `floor(log2 |x|)` of a finite nonzero F32, exactly (subnormals included).
    pub fn exponent(x: f32) -> i32 {
        let bits = x.to_bits() & 0x7fff_ffff;
        let biased = (bits >> 23) as i32;
        if biased == 0 {
            // Subnormal: x = m * 2^-149 with m < 2^23.
            Self::E_MIN + (31 - bits.leading_zeros() as i32)
        } else {
            biased - 127
        }
    }

    /// Counts one value.
    pub fn add(&mut self, x: f32) {
        if x == 0.0 {
            self.zeros += 1;
        } else if !x.is_finite() {
            self.nonfinite += 1;
        } else {
            self.counts[(Self::exponent(x) - Self::E_MIN) as usize] += 1;
        }
    }

    /// Adds another histogram's counts to this one.
    pub fn merge(&mut self, other: &Log2Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.zeros += other.zeros;
        self.nonfinite += other.nonfinite;
    }

    /// All values counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.zeros + self.nonfinite
    }

    /// The share of the counted values F16 cannot hold once multiplied by the loss scale
    /// 2^`shift`: nonzero values below its smallest subnormal, values from 2^16 up, and
    /// non-finite ones (exact zeros are kept). 0 when nothing was counted.
    pub fn f16_lost_share(&self, shift: i32) -> f64 {
        let kept = self.zeros
            + self.count_between(Self::F16_SUBNORMAL - shift, Self::F16_OVERFLOW - 1 - shift);
        let total = self.total();
        (total - kept) as f64 / total.max(1) as f64
    }

    /// The `(exponent, count)` of every nonempty binade, in increasing exponent.
    pub fn nonzero_bins(&self) -> impl Iterator<Item = (i32, u64)> + '_ {
        (Self::E_MIN..)
            .zip(self.counts.iter().copied())
            .filter(|&(_, c)| c > 0)
    }

    /// Finite nonzero values with `floor(log2 |x|)` in `lo..=hi`.
    pub fn count_between(&self, lo: i32, hi: i32) -> u64 {
        let lo = (lo.max(Self::E_MIN) - Self::E_MIN) as usize;
        let hi = (hi - Self::E_MIN).min(Self::BINS as i32 - 1);
        if hi < 0 || lo as i32 > hi {
            return 0;
        }
        self.counts[lo..=hi as usize].iter().sum()
    }
}

primitives! {
    /// The loss scaler's primitive a backend implements: the fused unscale-and-check-finite of
    /// PyTorch's `_amp_foreach_non_finite_check_and_unscale_`.
    pub trait AmpOps: MapOps {
        /// The loss scaler's fused unscale-and-check: `self * inv` (read through `layout`) in
        /// F32 — in F64 for an F64 gradient, as PyTorch multiplies a double gradient by its F32
        /// `inv_scale` widened — as a new buffer, and 1.0 stored into the one-element F32 buffer
        /// `found_inf` when any element of `self` is inf or NaN (it is never cleared here, so one
        /// flag serves a whole list of gradients and is read back once). As PyTorch's
        /// `_amp_foreach_non_finite_check_and_unscale_`, the check is on the scaled gradient
        /// read, not on the product.
        fn unscale_check(&self, layout: &Layout, inv: f32, found_inf: &mut Self) -> Result<Self> {
            super::compose::unscale_check(self, layout, inv, found_inf)
        }

        /// One gradient's part of a `p`-norm, in f64 over its F32 (F64 for F64) values in
        /// element order: `max |x|` for p = ∞ (NaN if any element is NaN), else `Σ |x|^p`
        /// (`Σ x·x` for p = 2, `Σ |x|` for p = 1). The caller combines the parts and takes the
        /// root (gradient clipping).
        fn norm_partial(&self, layout: &Layout, p: f64) -> Result<f64> {
            super::compose::norm_partial(self, layout, p)
        }

        /// How many elements (read as F32) are nonzero with `|x| < tiny`, and how many have
        /// `|x| > max` or are NaN: a gradient's F16 underflow and overflow counts.
        fn range_counts(&self, layout: &Layout, tiny: f64, max: f64) -> Result<(u64, u64)> {
            super::compose::range_counts(self, layout, tiny, max)
        }

        /// The `floor(log2 |x|)` histogram of the elements `layout` addresses, read as F32
        /// (`--grad-stats`: where a gradient's values sit against F16's and BF16's ranges).
        fn log2_histogram(&self, layout: &Layout) -> Result<Log2Histogram> {
            super::compose::log2_histogram(self, layout)
        }

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
}
