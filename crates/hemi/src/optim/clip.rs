//! Gradient clipping: by the total norm over all gradients (PyTorch's `clip_grad_norm_`) and
//! by value (`clip_grad_value_`). Both replace each parameter's `.grad` with the clipped
//! gradient in the gradient's own dtype; parameters without a gradient are skipped.

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
    let total = grad_norm(params, norm_type)?;
    clip_grads_to(params, max_norm, total)?;
    Ok(total)
}

/// The total `norm_type`-norm of the gradients of `params` (those that have one), as
/// `clip_grad_norm` computes it, without clipping.
pub fn grad_norm(params: &[Tensor], norm_type: f64) -> Result<f64> {
    total_norm(
        params
            .iter()
            .filter_map(|p| p.grad())
            .collect::<Vec<_>>()
            .iter(),
        norm_type,
    )
}

/// The second half of `clip_grad_norm`: scales the gradients of `params` by
/// `max_norm / (total + 1e-6)` when that is below 1, `total` being their total norm
/// (computed elsewhere: by `grad_norm`, or over the shards of every rank under ZeRO). A
/// non-finite `total` leaves them untouched.
pub fn clip_grads_to(params: &[Tensor], max_norm: f64, total: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::arg(
            "clip_grad_norm",
            format!("max_norm must be >= 0, got {max_norm}"),
        ));
    }
    if !total.is_finite() {
        return Ok(());
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for p in params {
            if let Some(g) = p.grad() {
                p.set_grad(Some(g.mul_scalar(coef)?));
            }
        }
    }
    Ok(())
}

/// The total gradient norm of a list of tensors (their `.grad`s), for clipping: a
/// replacement for `grad_norm(tensors, 2.0)` where the gradients are sharded (ZeRO). It must
/// give the same bits on the same gradients.
pub type GradNormFn = std::sync::Arc<dyn Fn(&[Tensor]) -> Result<f64> + Send + Sync>;

/// The `norm_type`-norm of all elements of `grads` together, in f64. NaN anywhere gives NaN
/// (also for the max norm, where `f64::max` alone would skip it). Each gradient's partial
/// (its max |g|, or its sum of |g|^p in element order) comes from the backend; the partials
/// are combined here in parameter order.
fn total_norm<'a>(grads: impl Iterator<Item = &'a Tensor>, norm_type: f64) -> Result<f64> {
    let mut acc = 0.0f64;
    for g in grads {
        let part = g.storage().norm_partial(g.layout(), norm_type)?;
        if norm_type == f64::INFINITY {
            if part.is_nan() {
                return Ok(f64::NAN);
            }
            acc = acc.max(part);
        } else {
            acc += part;
        }
    }
    Ok(if norm_type == f64::INFINITY || norm_type == 1.0 {
        acc
    } else if norm_type == 2.0 {
        acc.sqrt()
    } else {
        acc.powf(1.0 / norm_type)
    })
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
    for p in params {
        if let Some(g) = p.grad() {
            if !g.dtype().is_float() {
                return Err(Error::dtype(
                    "clip_grad_value",
                    g.dtype(),
                    "gradients must be float tensors",
                ));
            }
            p.set_grad(Some(g.clamp(-clip_value, clip_value)?));
        }
    }
    Ok(())
}
