//! Layers. A `Module` computes `forward` and describes its tensors (parameters and buffers)
//! and children once (`Visit`), in PyTorch's `state_dict` order and naming, so checkpoints
//! load into the same PyTorch model.
//!
//! Parameters are autograd leaves owned by their layer; an optimizer holds clones of the
//! same handles and updates them in place. Casting a model (`to_dtype`) makes new leaves,
//! so cast before building the optimizer, as in PyTorch.

mod activation;
mod checkpoint;
mod conv;
pub mod init;
mod linear;
mod loss;
mod norm;
mod pool;
mod sequential;
mod state_dict;
mod visit;

pub use activation::{Dropout, Flatten, Gelu, Relu};
pub use checkpoint::{checkpoint, Replicate};
pub use conv::Conv2d;
pub use linear::{Embedding, Linear};
pub use loss::{CrossEntropyLoss, MseLoss, NllLoss};
pub use norm::{BatchNorm2d, LayerNorm};
pub use pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
pub use sequential::Sequential;
pub use state_dict::{state_dict_mismatch, StateDictMismatch};
pub(crate) use visit::generators;
pub use visit::{Visit, Visitor, VisitorMut};

use crate::data::Inputs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What a named tensor of a module is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Trained by the optimizer (requires grad).
    Parameter,
    /// State that is saved but not trained (running statistics, counters).
    Buffer,
}

/// A named tensor of a module, mutable (for casts and loading).
pub struct Slot<'a> {
    /// The tensor's `state_dict` name relative to the module (`"fc1.weight"`).
    pub name: String,
    /// The tensor itself, to be cast or loaded into.
    pub tensor: &'a mut Tensor,
    /// Whether it is a trained parameter or a saved buffer.
    pub kind: Kind,
    /// Belongs to a normalisation layer (kept in F32 by mixed-precision presets).
    pub is_norm: bool,
}

/// A layer whose forward `quant` can take over: `Linear` or `Conv2d`.
#[derive(Clone, Copy)]
pub enum LayerRef<'a> {
    /// A fully connected layer.
    Linear(&'a Linear),
    /// A 2-D convolution.
    Conv2d(&'a Conv2d),
}

impl<'a> LayerRef<'a> {
    /// The layer's weight.
    pub fn weight(self) -> &'a Tensor {
        match self {
            LayerRef::Linear(l) => &l.weight,
            LayerRef::Conv2d(c) => &c.weight,
        }
    }
    /// The layer's bias, if it has one.
    pub fn bias(self) -> Option<&'a Tensor> {
        match self {
            LayerRef::Linear(l) => l.bias.as_ref(),
            LayerRef::Conv2d(c) => c.bias.as_ref(),
        }
    }
    /// The hook that replaces its float forward, if one is set.
    pub fn hook(self) -> Option<&'a std::sync::Arc<dyn ForwardHook>> {
        match self {
            LayerRef::Linear(l) => l.hook.as_ref(),
            LayerRef::Conv2d(c) => c.hook.as_ref(),
        }
    }
}

/// A mutable `Linear` or `Conv2d` of a model, listed by [`Module::layers_mut`] so that
/// `quant` can set its [`ForwardHook`] (PyTorch swaps modules; hemi's layers keep their
/// type and carry the replacement).
pub enum LayerMut<'a> {
    /// A fully connected layer.
    Linear(&'a mut Linear),
    /// A 2-D convolution.
    Conv2d(&'a mut Conv2d),
}

impl LayerMut<'_> {
    /// The layer's hook slot.
    pub fn hook_mut(&mut self) -> &mut Option<std::sync::Arc<dyn ForwardHook>> {
        match self {
            LayerMut::Linear(l) => &mut l.hook,
            LayerMut::Conv2d(c) => &mut c.hook,
        }
    }
    /// The layer, read-only.
    pub fn as_ref(&self) -> LayerRef<'_> {
        match self {
            LayerMut::Linear(l) => LayerRef::Linear(l),
            LayerMut::Conv2d(c) => LayerRef::Conv2d(c),
        }
    }
}

/// A replacement of a `Linear`'s or `Conv2d`'s float forward: the INT8 layers, calibration
/// observers and fake-quant training of `quant` implement it. The layer is passed in, so a
/// hook sees the current (trained) weights.
pub trait ForwardHook: Send + Sync + std::any::Any {
    /// The layer's output for `x`, with ReLU applied when `relu` (fused by the caller's
    /// `forward_relu`).
    fn forward(&self, layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor>;
    /// The layer's output for `x` followed by GELU (`tanh`: its tanh approximation), for
    /// `Linear::forward_gelu`. By default `forward`, then the op; INT8 layers apply it in
    /// their epilogue.
    fn forward_gelu(&self, layer: LayerRef<'_>, x: &Tensor, tanh: bool) -> Result<Tensor> {
        let y = self.forward(layer, x, false)?;
        if tanh {
            y.gelu_tanh()
        } else {
            y.gelu()
        }
    }
    /// For code that knows the concrete hook type (reading calibrated ranges back).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A layer or a network of layers: its `forward`, and through `Visit` its tensors and
/// children, from which every list below (`tensors`, `layers_mut`, `set_training`...) is
/// derived. `Any` lets code that knows the concrete types (the ONNX exporters of
/// `models::onnx`) recognise a `dyn Module`.
pub trait Module: Visit + Send + std::any::Any {
    /// Applies the module.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Applies the module to a batch's inputs. The default takes images and calls
    /// `forward`; models with several inputs (token ids, attention mask, token types)
    /// override it.
    fn forward_inputs(&self, inputs: &Inputs) -> Result<Tensor> {
        self.forward(inputs.images()?)
    }

    // The lists below are walks over the module's one description of itself (`Visit`,
    // see `nn/visit.rs`); a module implements `Visit` and does not override them.

    /// The module's tensors in `state_dict` order: (name, tensor, kind, is_norm).
    fn tensors(&self) -> Vec<(String, &Tensor, Kind, bool)> {
        visit::tensors(self)
    }

    /// The same tensors, mutable.
    fn tensors_mut(&mut self) -> Vec<Slot<'_>> {
        visit::tensors_mut(self)
    }

    /// The model's `Linear` and `Conv2d` layers under their `state_dict` prefixes
    /// (`"fc1"`, `"encoder.layer.0.attention.self.query"`; `""` for a lone layer), for
    /// quantisation. None under a module that hides them (`VisitorMut::hide_layers`):
    /// such a model cannot be quantised.
    fn layers_mut(&mut self) -> Vec<(String, LayerMut<'_>)> {
        visit::layers_mut(self)
    }

    /// Switches train/eval behaviour (dropout, batch-norm statistics): sets every training
    /// flag the module and its children show (`Visitor::training`).
    fn set_training(&mut self, training: bool) {
        visit::set_training(self, training);
    }

    /// The generators the model's dropout draws from, in a fixed order: a replay of a step
    /// (`train::doctor`) saves and restores them so that it draws the step's masks again and
    /// the run continues as if it had not happened.
    fn generators(&self) -> Vec<&std::sync::Mutex<crate::rng::Generator>> {
        visit::generators(self)
    }

    /// The model's `BatchNorm2d` layers, in `state_dict` order (for SyncBatchNorm,
    /// `dist::convert_sync_batch_norm`).
    fn batch_norms_mut(&mut self) -> Vec<&mut BatchNorm2d> {
        visit::batch_norms_mut(self)
    }

    /// Trainable parameters with their names, in `state_dict` order.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.tensors()
            .into_iter()
            .filter(|t| t.2 == Kind::Parameter)
            .map(|(n, t, _, _)| (n, t.clone()))
            .collect()
    }

    /// Trainable parameters, in `state_dict` order.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// Every saved tensor (parameters and buffers), detached, in `state_dict` order.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.tensors()
            .into_iter()
            .map(|(n, t, _, _)| (n, t.detach()))
            .collect()
    }

    /// Loads values by name into the existing tensors (in place, so optimizers holding
    /// the parameters keep working). Strict, as PyTorch's `strict=True`: the whole dict is
    /// checked first (every name present once, no other names, the same shapes), the error
    /// lists every mismatch, and nothing is loaded unless all of it can be. Values are cast
    /// to each tensor's dtype.
    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let m = state_dict_mismatch(&*self, state);
        if !m.is_empty() {
            return Err(Error::Msg(format!("load_state_dict (strict): {m}")));
        }
        // Cast first, so that a failing cast also leaves the model as it was.
        let mut values = Vec::with_capacity(state.len());
        let mut slots = self.tensors_mut();
        for slot in &slots {
            let (_, v) = state
                .iter()
                .find(|(n, _)| *n == slot.name)
                .expect("checked above");
            values.push(v.detach().to_dtype(slot.tensor.dtype())?);
        }
        for (slot, v) in slots.iter_mut().zip(&values) {
            slot.tensor.set_data(v)?;
        }
        Ok(())
    }

    /// Casts every float tensor to `dtype` (PyTorch's `model.half()` / `.bfloat16()`);
    /// with `keep_norms_f32`, normalisation layers' tensors stay F32 (apex O2). Integer
    /// buffers are untouched. Parameters become new leaves: build optimizers afterwards.
    fn to_dtype(&mut self, dtype: DType, keep_norms_f32: bool) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::dtype(
                "to_dtype",
                dtype,
                "models cast to float dtypes only",
            ));
        }
        for slot in self.tensors_mut() {
            if !slot.tensor.dtype().is_float() {
                continue;
            }
            let target = if keep_norms_f32 && slot.is_norm {
                DType::F32
            } else {
                dtype
            };
            let cast = slot.tensor.detach().to_dtype(target)?.contiguous()?;
            let fresh = Tensor::from_storage(cast.storage(), cast.layout().clone());
            if slot.kind == Kind::Parameter {
                fresh.set_requires_grad(true)?;
            }
            *slot.tensor = fresh;
        }
        Ok(())
    }

    /// Moves every tensor to `device` (PyTorch's `model.to(device)`). Parameters become new
    /// leaves on that device: build optimizers afterwards (their state is created where
    /// the parameters are).
    fn to_device(&mut self, device: crate::Device) -> Result<()> {
        for slot in self.tensors_mut() {
            if slot.tensor.device() == device {
                continue;
            }
            let moved = slot.tensor.detach().to_device(device)?;
            let fresh = Tensor::from_storage(moved.storage(), moved.layout().clone());
            if slot.kind == Kind::Parameter {
                fresh.set_requires_grad(true)?;
            }
            *slot.tensor = fresh;
        }
        Ok(())
    }

    /// Clears the gradients of all parameters.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// Turns activation checkpointing of the model's own segments on (`Some(granularity)`,
    /// one of `checkpoint_granularities`: which segments) or off (`None`): in training the
    /// segments keep only their inputs for the backward and run their forward again there
    /// (`autograd::checkpoint`), for the same gradients bit for bit. ResNets checkpoint
    /// `blocks` or `stages`, BERT its encoder `layers`, each but the last (the backward
    /// starts with it: its activations would be alive then anyway). Default: the model has
    /// no such segments, and `Some` is an error.
    fn set_activation_checkpointing(&mut self, granularity: Option<&str>) -> Result<()> {
        match granularity {
            None => Ok(()),
            Some(g) => Err(Error::arg(
                "activation checkpointing",
                format!("this model has no checkpointed segments (asked for {g:?})"),
            )),
        }
    }

    /// The granularities `set_activation_checkpointing` takes, the default first; empty
    /// when the model has no checkpointed segments.
    fn checkpoint_granularities(&self) -> &'static [&'static str] {
        &[]
    }

    /// Number of trainable scalars.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|p| p.numel()).sum()
    }
}

/// A parameter leaf.
pub(crate) fn param(t: Tensor) -> Result<Tensor> {
    t.set_requires_grad(true)?;
    Ok(t)
}
