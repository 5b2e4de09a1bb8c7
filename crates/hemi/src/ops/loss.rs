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

use crate::backend::loss::{ClassLoss, ClassSaved};
use crate::backend::reduce::Rows;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Layout, Tensor};

pub use crate::backend::loss::Reduction;

/// Options of `cross_entropy`, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// How the per-target losses are combined (default: the mean over non-ignored targets).
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
    dtype.compute_type()
}

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

// ----- softmax and log-softmax, row by row, with their backward -------------------------

fn softmax_along(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    require_float(op, x)?;
    let (_, rows) = Rows::along(op, x.shape(), dim)?;
    let dtype = fp32_op_dtype(x.dtype());
    let storage = Arc::new(x.storage().softmax(x.layout(), rows, log, dtype)?);
    let layout = Layout::contiguous(x.shape());
    // Both backwards need only the output: keep it as a detached handle on its storage.
    let y = Tensor::from_storage(storage.clone(), layout.clone());
    Ok(Tensor::from_op(storage, layout, op, &[x], move |g| {
        let dx =
            g.storage()
                .softmax_backward(g.layout(), &y.storage(), y.layout(), rows, log, dtype)?;
        Ok(vec![Some(Tensor::from_storage(
            Arc::new(dx),
            Layout::contiguous(y.shape()),
        ))])
    }))
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

/// A class loss: validation, the forward primitive, and its fused backward.
fn class_loss(loss: ClassLoss, input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let op = loss.op;
    let rows = class_rows(op, input, target)?;
    if !(0.0..=1.0).contains(&loss.label_smoothing) {
        return Err(Error::arg(
            op,
            format!(
                "label_smoothing must be in [0, 1], got {}",
                loss.label_smoothing
            ),
        ));
    }
    let dtype = fp32_op_dtype(input.dtype());
    let f = input.storage().class_loss(
        input.layout(),
        &target.storage(),
        target.layout(),
        rows,
        loss,
        dtype,
    )?;
    let out_shape = match loss.reduction {
        Reduction::None => target.shape().to_vec(),
        Reduction::Sum | Reduction::Mean => vec![],
    };
    let (log_probs, counted) = (f.log_probs.map(Arc::new), f.counted);
    let saved = target.detach();
    let in_shape = input.shape().to_vec();
    Ok(Tensor::from_op(
        Arc::new(f.loss),
        Layout::contiguous(&out_shape),
        op,
        &[input, target],
        move |g| {
            let gi = g.storage().class_loss_backward(
                g.layout(),
                ClassSaved {
                    log_probs: log_probs.as_deref(),
                    counted,
                },
                (&saved.storage(), saved.layout()),
                rows,
                loss,
                dtype,
            )?;
            Ok(vec![
                Some(Tensor::from_storage(
                    Arc::new(gi),
                    Layout::contiguous(&in_shape),
                )),
                None,
            ])
        },
    ))
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
    let loss = ClassLoss {
        op: "cross_entropy",
        from_logits: true,
        reduction: opts.reduction,
        ignore_index: opts.ignore_index,
        label_smoothing: opts.label_smoothing,
    };
    class_loss(loss, logits, target)
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
    let loss = ClassLoss {
        op: "nll_loss",
        from_logits: false,
        reduction,
        ignore_index,
        label_smoothing: 0.0,
    };
    class_loss(loss, log_probs, target)
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
    let dtype = fp32_op_dtype(input.dtype().promote(target.dtype()));
    let (loss, diff) = input.storage().mse(
        input.layout(),
        &target.storage(),
        target.layout(),
        reduction,
        dtype,
    )?;
    let out_shape = match reduction {
        Reduction::None => shape.clone(),
        Reduction::Sum | Reduction::Mean => vec![],
    };
    Ok(Tensor::from_op(
        Arc::new(loss),
        Layout::contiguous(&out_shape),
        op,
        &[input, target],
        move |g| {
            let (da, db) = diff.mse_backward(&g.storage(), g.layout(), reduction, dtype)?;
            let layout = Layout::contiguous(&shape);
            Ok(vec![
                Some(Tensor::from_storage(Arc::new(da), layout.clone())),
                Some(Tensor::from_storage(Arc::new(db), layout)),
            ])
        },
    ))
}
