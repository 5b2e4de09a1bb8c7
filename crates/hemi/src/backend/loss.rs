//! Loss primitives: the class losses (cross-entropy from logits, NLL from log-probabilities)
//! and MSE, forward and fused backward. Every exp, log and sum runs in the compute type
//! (F32, F64 for F64) and the outputs are of that type.

use super::declare::{primitives, Lift};
use super::index::IndexOps;
use super::map::MapOps;
use super::nn::View;
use super::reduce::{ReduceOps, Rows};
use crate::dtype::DType;
use crate::tensor::Layout;

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

/// A class loss: what it reads and how it treats its targets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClassLoss {
    /// The op's name, for errors.
    pub op: &'static str,
    /// Logits (cross-entropy: log-softmax first) or log-probabilities (NLL).
    pub from_logits: bool,
    /// How the per-target losses are combined (PyTorch's `reduction=`).
    pub reduction: Reduction,
    /// Targets equal to this add nothing to the loss nor to the mean's count.
    pub ignore_index: Option<i64>,
    /// ε in `[0, 1]`: the target distribution is `(1-ε)·onehot + ε/C`.
    pub label_smoothing: f64,
}

/// What the forward of a class loss returns.
#[derive(Clone, Debug)]
pub struct ClassLossForward<S> {
    /// The loss: one per target for `Reduction::None` (0 at ignored targets), else one
    /// element.
    pub loss: S,
    /// The log-softmax of the logits (contiguous, the input's shape) when `from_logits`,
    /// kept for the backward.
    pub log_probs: Option<S>,
    /// The number of non-ignored targets (the mean's divisor).
    pub counted: usize,
}

/// What the backward of a class loss reads from its forward.
#[derive(Debug)]
pub struct ClassSaved<'a, S> {
    /// The log-softmax the forward returned (cross-entropy), `None` for NLL.
    pub log_probs: Option<&'a S>,
    /// The number of non-ignored targets (the mean's divisor).
    pub counted: usize,
}

primitives! {
    /// The loss primitives a backend implements: the class losses (cross-entropy, NLL, with
    /// label smoothing and an ignore index) and their backward, computed in F32 (F64 for F64)
    /// whatever the input dtype. `Storage` has a dispatching method of the same name for each.
    pub trait LossOps: MapOps + ReduceOps + IndexOps {
        /// The forward of `loss` with `self` the logits or log-probabilities seen as `rows` (the
        /// class dim is the row) and `target` (I64, one class index per row, read through `lt`):
        /// per row `(1-ε)·(-lp[t]) + (ε/C)·Σ_c(-lp[c])` (the smoothing sum skipped for ε = 0),
        /// 0 for ignored targets, then reduced. In the compute type of `out` (F32 or F64),
        /// outputs in `out`. The caller checked shapes, dtypes, `rows.len > 0` and ε; a target
        /// that is neither a class in `0..rows.len` nor the ignore index is `Error::Index`.
        fn class_loss(
            &self,
            layout: &Layout,
            target: &Self,
            lt: &Layout,
            rows: Rows,
            loss: ClassLoss,
            out: DType,
        ) -> Result<ClassLossForward<Self>> {
            super::compose::loss::class_loss(self, layout, target, lt, rows, loss, out)
        }

        /// The gradient of `class_loss` w.r.t. its input with `self = g` (the loss's
        /// gradient): per row `scale · (p - q)` for cross-entropy (`p = exp(log_probs)`, which
        /// the forward returned in `saved`) and `-scale · q` for NLL (`saved.log_probs` is `None`), with
        /// `q = (1-ε)·onehot(t) + ε/C` and `scale` the row's gradient (`/ counted` for the
        /// mean); 0 for ignored rows. Contiguous in the input's shape, in `out`.
        fn class_loss_backward(
            &self,
            lg: &Layout,
            saved: ClassSaved<'_, Self>,
            target: View<'_, Self>,
            rows: Rows,
            loss: ClassLoss,
            out: DType,
        ) -> Result<Self> {
            super::compose::loss::class_loss_backward(self, lg, saved, target, rows, loss, out)
        }

        /// Mean squared error of `self` (input) and `target` (layouts of the same shape):
        /// returns the loss (`(a - b)²` per element for `Reduction::None`, else its sum or mean
        /// in one element) and the difference `a - b` for the backward, both contiguous in `out`
        /// (F32 or F64, the compute type).
        fn mse(
            &self,
            la: &Layout,
            target: &Self,
            lb: &Layout,
            reduction: Reduction,
            out: DType,
        ) -> Result<(Self, Self)> {
            super::compose::mse(self, la, target, lb, reduction, out)
        }

        /// The gradients of `mse` with `self` the difference it returned (contiguous) and `g`
        /// the loss's gradient: `(2·diff·scale, -2·diff·scale)`, contiguous in `out`.
        fn mse_backward(
            &self,
            g: &Self,
            lg: &Layout,
            reduction: Reduction,
            out: DType,
        ) -> Result<(Self, Self)> {
            super::compose::mse_backward(self, g, lg, reduction, out)
        }
    }
}

impl<B: Lift<S>, S> Lift<ClassLossForward<S>> for ClassLossForward<B> {
    fn lift(self) -> ClassLossForward<S> {
        ClassLossForward {
            loss: self.loss.lift(),
            log_probs: self.log_probs.lift(),
            counted: self.counted,
        }
    }
}
