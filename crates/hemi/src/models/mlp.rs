//! A small multi-layer perceptron on flattened images.

use crate::error::Result;
use crate::nn::{Linear, Module, Visit, Visitor, VisitorMut};
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
}

impl Visit for Mlp {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("fc1", &self.fc1);
        v.child("fc2", &self.fc2);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("fc1", &mut self.fc1);
        v.child("fc2", &mut self.fc2);
    }
}
