//! Softmax, log-softmax and the losses: cross-entropy, NLL and MSE.
//!
//! Precision: these are autocast's FP32 ops. Whatever the input dtype, the values are read
//! into F32 (F64 for F64 inputs), every exp, log and sum runs there, and the output is F32
//! (F64 for F64 inputs): a half input never meets a half intermediate, and a loss is never
//! rounded to F16. The gradients handed back to half inputs are cast to their dtype by
//! autograd.
//!
//! Cross-entropy follows PyTorch's `F.cross_entropy` exactly for class-index targets:
//! logits `[N, C]` or `[N, C, d1, ...]` (or `[C]` with a scalar target), targets I64 of the
//! logits' shape without the class dim, `ignore_index` (default -100) excluded from the loss
//! and from the count of the mean, label smoothing as `(1-ε)·nll + ε·mean_c(-log p_c)`.
//! Its backward is fused: `(softmax - q) · scale` with `q` the smoothed one-hot target,
//! not a replay of log_softmax and a gather through the graph.

use std::sync::Arc;

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

use super::elementwise::{map, zip_map, PAR_THRESHOLD};
use super::reduce::sum_slice;
use super::stats::{row_max, Rows};
use crate::dtype::DType;
use crate::dtype::WithDType as _;
use crate::error::{Error, Result};
use crate::tensor::{FloatDType, Layout, Tensor};

/// How a loss combines its per-element values (PyTorch's `reduction=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The mean: over all elements, or over the non-ignored targets for class losses.
    #[default]
    Mean,
    /// The sum.
    Sum,
    /// No reduction: one loss per element (per target for class losses; ignored targets
    /// get 0).
    None,
}

/// Options of `cross_entropy`, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    pub reduction: Reduction,
    /// Targets equal to this value add nothing to the loss nor to the mean's count
    /// (`None`: every target must be a class index). Default `Some(-100)`.
    pub ignore_index: Option<i64>,
    /// ε in `[0, 1]`: the target distribution is `(1-ε)·onehot + ε/C`. Default 0.
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions {
            reduction: Reduction::Mean,
            ignore_index: Some(-100),
            label_smoothing: 0.0,
        }
    }
}

/// The dtype of an FP32 op's output: F64 for F64 inputs, F32 for the others.
fn fp32_op_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

// ----- softmax and log-softmax, row by row, with their backward -------------------------

/// `y = exp(x - max) / Σ exp(x - max)`: subtracting the max keeps every exponent <= 0.
fn softmax_row<C: FloatDType>(x: &[C], y: &mut [C]) {
    let m = row_max(x);
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m).exp();
    }
    let inv = C::one() / sum_slice(y);
    y.iter_mut().for_each(|y| *y *= inv);
}

/// `dx = y ⊙ (g - Σ g⊙y)`.
fn softmax_backward_row<C: FloatDType>(g: &[C], y: &[C], dx: &mut [C]) {
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = g * y;
    }
    let dot = sum_slice(dx);
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = y * (g - dot);
    }
}

/// `y = (x - max) - ln Σ exp(x - max)`: finite for logits far apart (1e4 and -1e4).
fn log_softmax_row<C: FloatDType>(x: &[C], y: &mut [C]) {
    let m = row_max(x);
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m).exp();
    }
    let lse = sum_slice(y).ln();
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m) - lse;
    }
}

/// `dx = g - exp(y) · Σ g`.
fn log_softmax_backward_row<C: FloatDType>(g: &[C], y: &[C], dx: &mut [C]) {
    let sg = sum_slice(g);
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = g - y.exp() * sg;
    }
}

fn softmax_along(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    require_float(op, x)?;
    let (_, rows) = Rows::along(op, x.shape(), dim)?;
    let dtype = fp32_op_dtype(x.dtype());
    crate::with_compute!(dtype, C => {
        let xv = x.values::<C>();
        let y = rows.map([&xv[..]], |[x], y| {
            if log { log_softmax_row(x, y) } else { softmax_row(x, y) }
        });
        let storage = Arc::new(crate::tensor::Storage::from(crate::tensor::CpuStorage::store::<C>(y, dtype)));
        let layout = Layout::contiguous(x.shape());
        // Both backwards need only the output: keep it as a detached handle on its storage.
        let y = Tensor::from_storage(storage.clone(), layout.clone());
        Ok(Tensor::from_op(storage, layout, op, &[x], move |g| {
            let (gv, yv) = (g.values::<C>(), y.values::<C>());
            let dx = rows.map([&gv[..], &yv[..]], |[g, y], dx| {
                if log { log_softmax_backward_row(g, y, dx) } else { softmax_backward_row(g, y, dx) }
            });
            Ok(vec![Some(Tensor::from_values(dx, y.shape(), dtype))])
        }))
    })
}

impl Tensor {
    /// Softmax along `dim` (any dim, negative from the end), computed in F32 with the row
    /// max subtracted. Output F32 for F16/BF16/F32 inputs, F64 for F64.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_along(self, dim, false)
    }

    /// Log-softmax along `dim`, `x - max - ln Σ exp(x - max)` in F32: finite for logits
    /// 1e4 apart. Output F32 for F16/BF16/F32 inputs, F64 for F64.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_along(self, dim, true)
    }
}

// ----- cross-entropy and NLL -------------------------------------------------------------

/// What a class loss reads: log-probabilities (NLL) or logits (cross-entropy, which takes
/// the log-softmax first and can smooth the target).
struct ClassLoss {
    op: &'static str,
    from_logits: bool,
    reduction: Reduction,
    ignore_index: Option<i64>,
    smoothing: f64,
}

/// Checks the input/target pair and returns the rows along the class dim.
fn class_rows(op: &'static str, input: &Tensor, target: &Tensor) -> Result<Rows> {
    require_float(op, input)?;
    if target.dtype() != DType::I64 {
        return Err(Error::dtype(
            op,
            target.dtype(),
            format!(
                "target must hold I64 class indices (input {:?}, target {:?})",
                input.shape(),
                target.shape()
            ),
        ));
    }
    let (rows, want): (Rows, Vec<usize>) = match input.rank() {
        0 => {
            return Err(Error::shape(
                op,
                "input must be [C], [N, C] or [N, C, d1, ...], got a scalar []",
            ))
        }
        1 => (Rows::along(op, input.shape(), 0)?.1, vec![]),
        _ => {
            let mut want = input.shape().to_vec();
            want.remove(1);
            (Rows::along(op, input.shape(), 1)?.1, want)
        }
    };
    if target.shape() != want {
        return Err(Error::shape(
            op,
            format!(
                "input {:?} (class dim {}) needs target {want:?}, got target {:?}",
                input.shape(),
                if input.rank() == 1 { 0 } else { 1 },
                target.shape()
            ),
        ));
    }
    if rows.len == 0 {
        return Err(Error::shape(
            op,
            format!("input {:?} has no classes", input.shape()),
        ));
    }
    Ok(rows)
}

impl ClassLoss {
    fn run(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        let op = self.op;
        let rows = class_rows(op, input, target)?;
        if !(0.0..=1.0).contains(&self.smoothing) {
            return Err(Error::arg(
                op,
                format!("label_smoothing must be in [0, 1], got {}", self.smoothing),
            ));
        }
        let classes = rows.len;
        // None for an ignored position, the class otherwise.
        let targets: Vec<Option<usize>> = target
            .to_vec_i64()
            .into_iter()
            .map(|t| {
                if Some(t) == self.ignore_index {
                    Ok(None)
                } else if (0..classes as i64).contains(&t) {
                    Ok(Some(t as usize))
                } else {
                    Err(Error::Index {
                        op,
                        index: t,
                        size: classes,
                    })
                }
            })
            .collect::<Result<_>>()?;
        let targets = Arc::new(targets);
        let counted = targets.iter().filter(|t| t.is_some()).count();
        let (reduction, from_logits, smoothing) =
            (self.reduction, self.from_logits, self.smoothing);
        let in_shape = input.shape().to_vec();
        let dtype = fp32_op_dtype(input.dtype());
        crate::with_compute!(dtype, C => {
            let xv = input.values::<C>();
            let lp = if from_logits {
                rows.map([&xv[..]], |[x], y| log_softmax_row(x, y))
            } else {
                xv
            };
            // Per position: (1-ε)·(-lp[t]) + (ε/C)·Σ_c(-lp[c]); 0 where ignored. With ε = 0
            // the smoothing sum is skipped (it may be -inf where the nll is finite).
            let keep = C::from_f64(1.0 - smoothing);
            let per_class = C::from_f64(smoothing / classes as f64);
            let loss_at = |r: usize, buf: &mut Vec<C>| -> C {
                let Some(t) = targets[r] else { return C::zero() };
                let (start, step) = (rows.start(r), rows.inner);
                let nll = -lp[start + t * step];
                if smoothing == 0.0 {
                    return nll;
                }
                buf.clear();
                buf.extend((0..classes).map(|k| lp[start + k * step]));
                keep * nll - per_class * sum_slice(buf)
            };
            let n = rows.count();
            let losses: Vec<C> = if n * classes < PAR_THRESHOLD {
                let mut buf = Vec::new();
                (0..n).map(|r| loss_at(r, &mut buf)).collect()
            } else {
                (0..n).into_par_iter().map_init(Vec::new, |buf, r| loss_at(r, buf)).collect()
            };
            let (out, out_shape) = match reduction {
                Reduction::None => (losses, target.shape().to_vec()),
                Reduction::Sum => (vec![sum_slice(&losses)], vec![]),
                // All targets ignored: 0/0 = NaN, as PyTorch.
                Reduction::Mean => (vec![sum_slice(&losses) / C::from_f64(counted as f64)], vec![]),
            };
            let lp = Arc::new(if from_logits { lp } else { Vec::new() });
            Ok(Tensor::from_compute(out, &out_shape, dtype, op, &[input, target], move |g| {
                // d loss_r / d x[r, k] = scale_r · (p_k - q_k) for cross-entropy, -q_k for
                // NLL (w.r.t. the log-probabilities), with q = (1-ε)·onehot(t) + ε/C.
                let gv = g.values::<C>();
                let scale = |r: usize| match reduction {
                    Reduction::None => gv[r],
                    Reduction::Sum => gv[0],
                    Reduction::Mean => gv[0] / C::from_f64(counted as f64),
                };
                let block = rows.len * rows.inner;
                let fill = |o: usize, gb: &mut [C]| {
                    for i in 0..rows.inner {
                        let r = o * rows.inner + i;
                        let Some(t) = targets[r] else { continue };
                        let s = scale(r);
                        for k in 0..classes {
                            let at = k * rows.inner + i;
                            let p = if from_logits { lp[o * block + at].exp() } else { C::zero() };
                            gb[at] = s * (p - per_class);
                        }
                        gb[t * rows.inner + i] -= s * keep;
                    }
                };
                let mut gi = vec![C::zero(); rows.outer * block];
                if gi.len() < PAR_THRESHOLD {
                    gi.chunks_mut(block).enumerate().for_each(|(o, gb)| fill(o, gb));
                } else {
                    gi.par_chunks_mut(block).enumerate().for_each(|(o, gb)| fill(o, gb));
                }
                Ok(vec![Some(Tensor::from_values(gi, &in_shape, dtype)), None])
            }))
        })
    }
}

/// Cross-entropy between `logits` (`[N, C]`, `[N, C, d1, ...]`, or `[C]`) and class-index
/// `target` (I64, `[N]`, `[N, d1, ...]`, or `[]`), with PyTorch's semantics: mean over the
/// non-ignored targets (NaN when all are ignored), label smoothing
/// `(1-ε)·nll + ε·mean_c(-log p_c)` on non-ignored targets. Computed in F32 whatever the
/// logits' dtype; the output is F32 (F64 for F64 logits), a scalar unless
/// `Reduction::None` (then the target's shape, 0 at ignored targets).
///
/// Errors: a target that is neither a class in `0..C` nor the ignore index is
/// `Error::Index`; a non-I64 target, or one whose shape does not match, names both shapes.
pub fn cross_entropy(
    logits: &Tensor,
    target: &Tensor,
    opts: CrossEntropyOptions,
) -> Result<Tensor> {
    ClassLoss {
        op: "cross_entropy",
        from_logits: true,
        reduction: opts.reduction,
        ignore_index: opts.ignore_index,
        smoothing: opts.label_smoothing,
    }
    .run(logits, target)
}

/// Negative log-likelihood of class-index `target` under `log_probs` (shapes as for
/// `cross_entropy`): `-log_probs[n, target[n]]`, ignored targets excluded, reduced as
/// `reduction` says. Output F32 (F64 for F64 input).
pub fn nll_loss(
    log_probs: &Tensor,
    target: &Tensor,
    reduction: Reduction,
    ignore_index: Option<i64>,
) -> Result<Tensor> {
    ClassLoss {
        op: "nll_loss",
        from_logits: false,
        reduction,
        ignore_index,
        smoothing: 0.0,
    }
    .run(log_probs, target)
}

// ----- MSE ---------------------------------------------------------------------------------

/// Mean squared error `(input - target)²`, reduced as `reduction` says. The shapes must
/// match (PyTorch broadcasts with a warning that it is likely a bug; hemi refuses). Mixed
/// float dtypes promote; computed in F32, output F32 (F64 if either input is F64). Both
/// inputs get gradients.
pub fn mse_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let op = "mse_loss";
    require_float(op, input)?;
    require_float(op, target)?;
    if input.shape() != target.shape() {
        return Err(Error::shape(
            op,
            format!(
                "input {:?} vs target {:?} (mse_loss does not broadcast)",
                input.shape(),
                target.shape()
            ),
        ));
    }
    let shape = input.shape().to_vec();
    let n = input.numel();
    let dtype = fp32_op_dtype(input.dtype().promote(target.dtype()));
    crate::with_compute!(dtype, C => {
        let diff = zip_map(&input.values::<C>(), &target.values::<C>(), |a, b| a - b);
        let sq = map(&diff, |d| d * d);
        let (out, out_shape) = match reduction {
            Reduction::None => (sq, shape.clone()),
            Reduction::Sum => (vec![sum_slice(&sq)], vec![]),
            Reduction::Mean => (vec![sum_slice(&sq) / C::from_f64(n as f64)], vec![]),
        };
        let diff = Arc::new(diff);
        Ok(Tensor::from_compute(out, &out_shape, dtype, op, &[input, target], move |g| {
            // d/d input = 2 (input - target) · scale; d/d target is its negative.
            let gv = g.values::<C>();
            let two = C::from_f64(2.0);
            let da: Vec<C> = match reduction {
                Reduction::None => zip_map(&diff, &gv, |d, g| two * d * g),
                Reduction::Sum => map(&diff, |d| two * d * gv[0]),
                Reduction::Mean => {
                    let s = two * gv[0] / C::from_f64(n as f64);
                    map(&diff, |d| d * s)
                }
            };
            let db = map(&da, |d| -d);
            Ok(vec![
                Some(Tensor::from_values(da, &shape, dtype)),
                Some(Tensor::from_values(db, &shape, dtype)),
            ])
        }))
    })
}
