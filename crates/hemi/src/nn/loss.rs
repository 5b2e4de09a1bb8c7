//! Loss modules: thin, configured wrappers over the loss ops (computed in F32).

use crate::error::Result;
use crate::ops::loss::{cross_entropy, mse_loss, nll_loss, CrossEntropyOptions, Reduction};
use crate::tensor::Tensor;

/// PyTorch's `nn.CrossEntropyLoss(reduction='mean', ignore_index=-100, label_smoothing=0)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropyLoss {
    pub opts: CrossEntropyOptions,
}

impl CrossEntropyLoss {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn forward(&self, logits: &Tensor, target: &Tensor) -> Result<Tensor> {
        cross_entropy(logits, target, self.opts)
    }
}

/// PyTorch's `nn.NLLLoss(reduction='mean', ignore_index=-100)`.
#[derive(Clone, Copy, Debug)]
pub struct NllLoss {
    pub reduction: Reduction,
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
    pub fn forward(&self, log_probs: &Tensor, target: &Tensor) -> Result<Tensor> {
        nll_loss(log_probs, target, self.reduction, self.ignore_index)
    }
}

/// PyTorch's `nn.MSELoss(reduction='mean')`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MseLoss {
    pub reduction: Reduction,
}

impl MseLoss {
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        mse_loss(input, target, self.reduction)
    }
}
