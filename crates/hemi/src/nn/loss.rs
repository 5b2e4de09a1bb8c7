//! Loss modules: thin, configured wrappers over the loss ops (computed in F32).

use crate::error::Result;
use crate::ops::loss::{cross_entropy, mse_loss, nll_loss, CrossEntropyOptions, Reduction};
use crate::tensor::Tensor;

/// PyTorch's `nn.CrossEntropyLoss(reduction='mean', ignore_index=-100, label_smoothing=0)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropyLoss {
    /// Reduction, ignore index and label smoothing.
    pub opts: CrossEntropyOptions,
}

impl CrossEntropyLoss {
    /// The loss with PyTorch's defaults (mean over non-ignored targets, ignore index -100,
    /// no smoothing).
    pub fn new() -> Self {
        Self::default()
    }
    /// The loss of `logits` `[N, C]` (or `[N, C, d1, ...]`) against class indices `target`
    /// `[N]` (or `[N, d1, ...]`, I64), as [`cross_entropy`]: computed and returned in F32
    /// (F64 for F64 logits) whatever the logits' dtype; a target outside `0..C` that is not
    /// the ignore index is an `Error::Index`.
    pub fn forward(&self, logits: &Tensor, target: &Tensor) -> Result<Tensor> {
        cross_entropy(logits, target, self.opts)
    }
}

/// PyTorch's `nn.NLLLoss(reduction='mean', ignore_index=-100)`.
#[derive(Clone, Copy, Debug)]
pub struct NllLoss {
    /// How the per-target losses are combined.
    pub reduction: Reduction,
    /// Targets equal to this contribute nothing (PyTorch's `ignore_index`; `None`: every
    /// target counts).
    pub ignore_index: Option<i64>,
}

impl Default for NllLoss {
    fn default() -> Self {
        NllLoss {
            reduction: Reduction::Mean,
            ignore_index: Some(-100),
        }
    }
}

impl NllLoss {
    /// The loss of log-probabilities `log_probs` `[N, C]` against class indices `target`
    /// `[N]` (I64), as [`nll_loss`]; in F32 (F64 for F64 input).
    pub fn forward(&self, log_probs: &Tensor, target: &Tensor) -> Result<Tensor> {
        nll_loss(log_probs, target, self.reduction, self.ignore_index)
    }
}

/// PyTorch's `nn.MSELoss(reduction='mean')`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MseLoss {
    /// How the per-element squared errors are combined.
    pub reduction: Reduction,
}

impl MseLoss {
    /// The squared error between `input` and `target` (same shape; hemi does not broadcast
    /// here), as [`mse_loss`]; computed in F32, F64 if either input is F64.
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        mse_loss(input, target, self.reduction)
    }
}
