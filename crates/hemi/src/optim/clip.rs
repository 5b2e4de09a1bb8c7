//! Gradient clipping: by the total norm over all gradients (PyTorch's `clip_grad_norm_`) and
//! by value (`clip_grad_value_`). Both replace each parameter's `.grad` with the clipped
//! gradient in the gradient's own dtype; parameters without a gradient are skipped.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Scales all gradients together so that their total `norm_type`-norm is at most
/// `max_norm`, and returns the total norm before clipping.
///
/// As PyTorch: the total is the norm of all gradient elements taken as one vector (the norm
/// of the per-parameter norms), `norm_type` is any p > 0 or `f64::INFINITY` (max |g|), and
/// the scale is `max_norm / (total + 1e-6)` clamped to 1. The total is accumulated in f64
/// over the F32 (or F64) gradient values; the scale is applied in F32 and rounded once
/// into the gradient's dtype.
///
/// Unlike PyTorch (which multiplies by a scale of 0 or NaN), an infinite or NaN total
/// leaves the gradients untouched: it is returned as is and the caller decides (a loss
/// scaler skips the step).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    const OP: &str = "clip_grad_norm";
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::arg(
            OP,
            format!("max_norm must be >= 0, got {max_norm}"),
        ));
    }
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::arg(
            OP,
            format!("norm_type must be > 0 or infinity, got {norm_type}"),
        ));
    }
    let with_grads: Vec<(&Tensor, Tensor)> =
        params.iter().filter_map(|p| Some((p, p.grad()?))).collect();
    let total = total_norm(with_grads.iter().map(|(_, g)| g), norm_type);
    if !total.is_finite() {
        return Ok(total);
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for (p, g) in &with_grads {
            p.set_grad(Some(map_grad(g, |x| x * coef as f32, |x| x * coef)?));
        }
    }
    Ok(total)
}

/// The `norm_type`-norm of all elements of `grads` together, in f64. NaN anywhere gives NaN
/// (also for the max norm, where `f64::max` alone would skip it).
fn total_norm<'a>(grads: impl Iterator<Item = &'a Tensor>, norm_type: f64) -> f64 {
    let mut acc = 0.0f64;
    for g in grads {
        let v = g.to_vec_f64();
        if norm_type == f64::INFINITY {
            for x in v {
                let a = x.abs();
                if a.is_nan() {
                    return f64::NAN;
                }
                acc = acc.max(a);
            }
        } else if norm_type == 2.0 {
            acc += v.iter().map(|x| x * x).sum::<f64>();
        } else if norm_type == 1.0 {
            acc += v.iter().map(|x| x.abs()).sum::<f64>();
        } else {
            acc += v.iter().map(|x| x.abs().powf(norm_type)).sum::<f64>();
        }
    }
    if norm_type == f64::INFINITY || norm_type == 1.0 {
        acc
    } else if norm_type == 2.0 {
        acc.sqrt()
    } else {
        acc.powf(1.0 / norm_type)
    }
}

/// Clamps every gradient element to `[-clip_value, clip_value]` (PyTorch's
/// `clip_grad_value_`; NaN stays NaN).
pub fn clip_grad_value(params: &[Tensor], clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::arg(
            "clip_grad_value",
            format!("clip_value must be >= 0, got {clip_value}"),
        ));
    }
    let c32 = clip_value as f32;
    for p in params {
        if let Some(g) = p.grad() {
            let new = map_grad(
                &g,
                |x| x.clamp(-c32, c32),
                |x| x.clamp(-clip_value, clip_value),
            )?;
            p.set_grad(Some(new));
        }
    }
    Ok(())
}

/// `g` with `f` applied elementwise in the compute type of its dtype (f64 for F64, f32
/// otherwise), as a new contiguous tensor of the same shape and dtype.
fn map_grad(
    g: &Tensor,
    f32_op: impl Fn(f32) -> f32,
    f64_op: impl Fn(f64) -> f64,
) -> Result<Tensor> {
    match g.dtype() {
        DType::F64 => {
            let v = g.to_vec_f64().into_iter().map(f64_op).collect();
            Tensor::from_f64_vec(v, g.shape(), DType::F64)
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            let v = g.to_vec_f32().into_iter().map(f32_op).collect();
            Tensor::from_f32_vec(v, g.shape(), g.dtype())
        }
        dt => Err(Error::dtype(
            "clip_grad",
            dt,
            "gradients must be float tensors",
        )),
    }
}
