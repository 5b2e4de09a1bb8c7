//! The training primitives on the CPU: `AmpOps` (the loss scaler's unscale-and-check, the
//! gradient statistics, stochastic rounding) and `OptimOps` (the optimizer updates, in place
//! on the parameter and its state buffers), handing the values to the kernels of
//! `cpu::elementwise::{amp, optim}`.

use crate::backend::nn::View;
use crate::backend::train::{
    AdamDecay, AdamScalars, AdamState, AmpOps, Log2Histogram, OptimOps, SgdFlags, SgdScalars,
};
use crate::cpu::elementwise::amp::{
    log2_histogram, norm_partial, range_counts, scale_in_place, stochastic_bf16, stochastic_f16,
    unscale_bf16, unscale_f16, unscale_f32, unscale_f64,
};
use crate::cpu::elementwise::optim::{adam, sgd_par};
use crate::cpu::storage::CpuStorage;
use crate::dtype::convert::Rounding;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Layout;

impl AmpOps for CpuStorage {
    fn range_counts(&self, layout: &Layout, tiny: f64, max: f64) -> Result<(u64, u64)> {
        Ok(range_counts(&self.to_f32(layout), tiny, max))
    }

    fn log2_histogram(&self, layout: &Layout) -> Result<Log2Histogram> {
        if self.dtype() == DType::I64 {
            return Err(Error::dtype(
                "log2_histogram",
                DType::I64,
                "histograms of float tensors only",
            ));
        }
        Ok(log2_histogram(&self.to_f32(layout)))
    }

    fn norm_partial(&self, layout: &Layout, p: f64) -> Result<f64> {
        if self.dtype() == DType::I64 {
            return Err(Error::dtype(
                "norm",
                DType::I64,
                "norms of float tensors only",
            ));
        }
        Ok(norm_partial(&self.to_f64(layout), p))
    }

    fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Self> {
        let values = self.to_f32(layout);
        Ok(match (dtype, rounding) {
            (DType::I64, _) => {
                return Err(Error::dtype(
                    "round_into",
                    dtype,
                    "rounds into float dtypes only",
                ))
            }
            (DType::F32 | DType::F64, _) | (_, Rounding::NearestEven) => {
                CpuStorage::from_f32(values.into_owned(), dtype)
            }
            (DType::F16, Rounding::Stochastic) => CpuStorage::F16(stochastic_f16(&values, rng)),
            (DType::BF16, Rounding::Stochastic) => CpuStorage::BF16(stochastic_bf16(&values, rng)),
        })
    }

    fn unscale_check(&self, layout: &Layout, inv: f32, found_inf: &mut Self) -> Result<Self> {
        let flag = match found_inf {
            CpuStorage::F32(f) if f.len() == 1 => &mut f[0],
            f => {
                return Err(Error::arg(
                    "unscale_check",
                    format!(
                        "found_inf must be one F32 value, got {} {}",
                        f.len(),
                        f.dtype()
                    ),
                ))
            }
        };
        let (out, bad) = match (self, layout.contiguous_range()) {
            (CpuStorage::F64(_), _) => {
                let mut v = self.to_f64(layout).into_owned();
                let bad = unscale_f64(&mut v, f64::from(inv));
                (CpuStorage::F64(v), bad)
            }
            (CpuStorage::F32(v), Some(r)) => {
                let (out, bad) = unscale_f32(&v[r], inv);
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::F16(v), Some(r)) => {
                let (out, bad) = unscale_f16(&v[r], inv);
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::BF16(v), Some(r)) => {
                let (out, bad) = unscale_bf16(&v[r], inv);
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::I64(_), _) => {
                return Err(Error::dtype(
                    "unscale_check",
                    DType::I64,
                    "gradients are float tensors",
                ))
            }
            _ => {
                // A strided gradient (rare: autograd makes contiguous ones): gather, then scale.
                let mut out = self.to_f32(layout).into_owned();
                let bad = scale_in_place(&mut out, inv);
                (CpuStorage::F32(out), bad)
            }
        };
        if bad {
            *flag = 1.0;
        }
        Ok(out)
    }
}

/// The F32 buffer of an optimizer state, or an error naming `what`.
fn state_f32<'a>(op: &'static str, what: &str, s: &'a mut CpuStorage) -> Result<&'a mut [f32]> {
    let dtype = s.dtype();
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => Err(Error::dtype(
            op,
            dtype,
            format!("{what} must be F32 optimizer state"),
        )),
    }
}

/// The parameter's F32 values to update: its buffer itself when it is F32 (updated in place,
/// no copy and no fresh allocation: a BERT word embedding is 47 MB, and a new buffer per step
/// cost page faults and the kernel's zeroing), else a widened copy. The parameter must be its
/// whole storage, contiguous.
fn param_f32<'a>(op: &'static str, p: &'a mut CpuStorage, lp: &Layout) -> Result<ParamF32<'a>> {
    if lp.contiguous_range() != Some(0..p.len()) {
        return Err(Error::arg(
            op,
            format!(
                "the parameter must be a whole contiguous buffer, not a view of {} of its {} elements",
                lp.numel(),
                p.len()
            ),
        ));
    }
    if let CpuStorage::F32(v) = p {
        return Ok(ParamF32::InPlace(v));
    }
    let wide = p.to_f32(lp).into_owned();
    Ok(ParamF32::Widened(p, wide))
}

enum ParamF32<'a> {
    InPlace(&'a mut [f32]),
    /// The parameter, and its values widened to F32 (rounded back by `finish`).
    Widened(&'a mut CpuStorage, Vec<f32>),
}

impl ParamF32<'_> {
    fn values(&mut self) -> &mut [f32] {
        match self {
            ParamF32::InPlace(v) => v,
            ParamF32::Widened(_, w) => w,
        }
    }

    /// Rounds the updated values once into the parameter's dtype.
    fn finish(self) {
        if let ParamF32::Widened(p, w) = self {
            let dtype = p.dtype();
            *p = CpuStorage::from_f32(w, dtype);
        }
    }
}

impl OptimOps for CpuStorage {
    fn sgd_step(
        &mut self,
        lp: &Layout,
        (grad, lg): View<'_, Self>,
        buf: Option<&mut Self>,
        s: &SgdScalars,
        f: SgdFlags,
    ) -> Result<()> {
        const OP: &str = "sgd_step";
        let b: &mut [f32] = match buf {
            Some(b) => state_f32(OP, "the momentum buffer", b)?,
            None if f.momentum => return Err(Error::arg(OP, "momentum needs a momentum buffer")),
            None => &mut [],
        };
        let mut param = param_f32(OP, self, lp)?;
        let p = param.values();
        let g = grad.to_f32(lg);
        if g.len() != p.len() || (f.momentum && b.len() != p.len()) {
            return Err(Error::shape(
                OP,
                format!(
                    "{} gradients and a momentum buffer of {} values for {} parameters",
                    g.len(),
                    b.len(),
                    p.len()
                ),
            ));
        }
        sgd_par(p, &g, b, *s, f);
        param.finish();
        Ok(())
    }

    fn adam_step(
        &mut self,
        lp: &Layout,
        (grad, lg): View<'_, Self>,
        AdamState {
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        }: AdamState<'_, Self>,
        k: &AdamScalars,
        decay: AdamDecay,
    ) -> Result<()> {
        const OP: &str = "adam_step";
        let m = state_f32(OP, "exp_avg", exp_avg)?;
        let v = state_f32(OP, "exp_avg_sq", exp_avg_sq)?;
        let max = match max_exp_avg_sq {
            Some(x) => Some(state_f32(OP, "max_exp_avg_sq", x)?),
            None => None,
        };
        let mut param = param_f32(OP, self, lp)?;
        let p = param.values();
        let g = grad.to_f32(lg);
        let n = p.len();
        if g.len() != n
            || m.len() != n
            || v.len() != n
            || max.as_ref().is_some_and(|x| x.len() != n)
        {
            return Err(Error::shape(
                OP,
                format!("the gradient or the state buffers do not hold {n} values"),
            ));
        }
        adam(p, &g, m, v, max, *k, decay);
        param.finish();
        Ok(())
    }
}
