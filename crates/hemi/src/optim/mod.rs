//! Optimizers (SGD, Adam, AdamW), learning-rate schedules and gradient clipping.
//!
//! Every optimizer keeps its state in F32 whatever the parameter dtype, reads F16/BF16
//! parameters and gradients as F32, computes the update in one fused F32 loop per parameter
//! and rounds once into the parameter's dtype (`optimizer.rs` says why). The update rules
//! and defaults are PyTorch's, step for step, and so is the F32 rounding of its CPU kernels
//! (fused multiply-adds where ATen fuses), so that a run reproduces PyTorch's bit for bit
//! (`tests/models/torch_parity.rs`).

mod adam;
mod clip;
mod optimizer;
mod schedule;
mod sgd;

pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_grad_value, clip_grads_to, grad_norm, GradNormFn};
pub(crate) use optimizer::{check_grads, check_params};
pub use optimizer::{no_decay_mask, Optimizer, OptimizerState, StateBuffer};
pub use schedule::{
    CosineAnnealingLR, LinearDecay, LinearWarmup, LrScheduler, MultiStepLR, Scheduler,
    SchedulerState, StepLR,
};
pub use sgd::{Sgd, SgdConfig};
