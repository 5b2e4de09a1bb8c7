//! A small multi-layer perceptron on flattened images.

use crate::error::Result;
use crate::nn::{prefixed, prefixed_layers, prefixed_mut, Kind, LayerMut, Linear, Module, Slot};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// flatten → fc1 (in→hidden) → ReLU → fc2 (hidden→classes).
pub struct Mlp {
    /// `fc1`: the flattened input (`in_features`) → `hidden`.
    pub fc1: Linear,
    /// `fc2`: `hidden` → `classes` (the logits).
    pub fc2: Linear,
}

impl Mlp {
    /// An MLP for inputs of `in_features` values (an image's C·H·W), `hidden` ReLU units
    /// and `classes` outputs, initialised as PyTorch's `nn.Linear` would from `rng`.
    pub fn new(
        in_features: usize,
        hidden: usize,
        classes: usize,
        rng: &mut Generator,
    ) -> Result<Self> {
        Ok(Mlp {
            fc1: Linear::new(in_features, hidden, true, rng)?,
            fc2: Linear::new(hidden, classes, true, rng)?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if x.rank() > 2 {
            x.flatten(1, -1)?
        } else {
            x.clone()
        };
        self.fc2.forward(&self.fc1.forward_relu(&x)?)
    }
    fn tensors(&self) -> Vec<(String, &Tensor, Kind, bool)> {
        let mut v = prefixed("fc1", self.fc1.tensors());
        v.extend(prefixed("fc2", self.fc2.tensors()));
        v
    }
    fn layers_mut(&mut self) -> Vec<(String, LayerMut<'_>)> {
        let mut v = prefixed_layers("fc1", self.fc1.layers_mut());
        v.extend(prefixed_layers("fc2", self.fc2.layers_mut()));
        v
    }
    fn tensors_mut(&mut self) -> Vec<Slot<'_>> {
        let mut v = prefixed_mut("fc1", self.fc1.tensors_mut());
        v.extend(prefixed_mut("fc2", self.fc2.tensors_mut()));
        v
    }
}
