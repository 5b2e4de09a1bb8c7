//! Activation checkpointing of modules (`autograd::checkpoint`): `checkpoint(&module, &x)`
//! is `module.forward(&x)` without keeping the module's activations for the backward.
//!
//! The backward runs the module's forward again, after the caller's borrow of the module
//! has ended, so the graph holds a *replica* of it (`Replicate`): a copy made when the
//! forward runs that shares the module's parameters (the same tensors, so the optimizer's
//! updates and `.grad` are theirs), its running statistics, its dropout generators and its
//! quantisation hooks, and keeps its training flags as they were at that forward (a model
//! switched to eval before the backward still recomputes in training mode). Making one
//! copies a few handles per layer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::{
    BatchNorm2d, Conv2d, Dropout, Flatten, Gelu, LayerNorm, Linear, MaxPool2d, Module, Relu,
};
use crate::autograd::Segment;
use crate::error::Result;
use crate::rng::Generator;
use crate::tensor::Tensor;

/// A module that activation checkpointing can run again in the backward.
pub trait Replicate: Module + Sync + Sized {
    /// A copy of the module computing what it computes now: the same parameter and buffer
    /// tensors (handles on them, not copies of their values), the same dropout generators
    /// and hooks, the training flags' current values.
    fn replica(&self) -> Self;
}

/// A module's replica as a checkpointed segment of one input.
struct Replica<M>(M);

impl<M: Module + Sync> Segment for Replica<M> {
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor> {
        self.0.forward(&inputs[0])
    }
    fn generators(&self) -> Vec<&Mutex<Generator>> {
        self.0.generators()
    }
}

/// `module.forward(x)` as a checkpointed segment (`autograd::checkpoint`): only `x` is kept
/// for the backward, which runs the forward again (on a replica) with the same dropout
/// masks and autocast settings, without updating batch-norm statistics a second time. The
/// gradients are those of `module.forward(x)`, bit for bit. Outside grad mode, just the
/// forward.
///
/// ```
/// use hemi::nn::{checkpoint, Linear, Module};
/// use hemi::{DType, Generator, Tensor};
/// let mut rng = Generator::new(0);
/// let fc = Linear::new(4, 3, true, &mut rng)?;
/// let x = Tensor::randn(&[2, 4], 0.0, 1.0, DType::F32, &mut rng)?;
/// checkpoint(&fc, &x)?.sum_all()?.backward()?;
/// let g = fc.weight.grad().unwrap();
/// fc.zero_grad();
/// fc.forward(&x)?.sum_all()?.backward()?;
/// assert_eq!(g.to_vec_f32(), fc.weight.grad().unwrap().to_vec_f32());
/// # Ok::<(), hemi::Error>(())
/// ```
pub fn checkpoint<M: Replicate + 'static>(module: &M, x: &Tensor) -> Result<Tensor> {
    if !crate::autograd::is_grad_enabled() {
        return module.forward(x);
    }
    crate::autograd::checkpoint(Arc::new(Replica(module.replica())), &[x])
}

/// A copy of a training flag's current value.
pub(crate) fn flag(f: &AtomicBool) -> AtomicBool {
    AtomicBool::new(f.load(Ordering::Relaxed))
}

impl Replicate for Linear {
    fn replica(&self) -> Self {
        Linear {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            hook: self.hook.clone(),
        }
    }
}

impl Replicate for Conv2d {
    fn replica(&self) -> Self {
        Conv2d {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            opts: self.opts,
            hook: self.hook.clone(),
        }
    }
}

impl Replicate for BatchNorm2d {
    fn replica(&self) -> Self {
        BatchNorm2d {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            running_mean: self.running_mean.clone(),
            running_var: self.running_var.clone(),
            num_batches_tracked: self.num_batches_tracked.clone(),
            eps: self.eps,
            momentum: self.momentum,
            sync: self.sync.clone(),
            training: flag(&self.training),
        }
    }
}

impl Replicate for LayerNorm {
    fn replica(&self) -> Self {
        LayerNorm {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            normalized_shape: self.normalized_shape.clone(),
            eps: self.eps,
        }
    }
}

impl Replicate for Dropout {
    fn replica(&self) -> Self {
        Dropout {
            p: self.p,
            rng: self.rng.clone(),
            training: flag(&self.training),
        }
    }
}

macro_rules! copy_replica {
    ($($t:ty),*) => {$(
        impl Replicate for $t {
            fn replica(&self) -> Self {
                *self
            }
        }
    )*};
}

copy_replica!(Relu, Gelu, Flatten, MaxPool2d);
