//! A small multi-layer perceptron on flattened images.

use crate::error::Result;
use crate::nn::{prefixed, prefixed_mut, Kind, Linear, Module, Slot};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// flatten → fc1 (in→hidden) → ReLU → fc2 (hidden→classes).
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
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
        self.fc2.forward(&self.fc1.forward(&x)?.relu()?)
    }
    fn tensors(&self) -> Vec<(String, &Tensor, Kind, bool)> {
        let mut v = prefixed("fc1", self.fc1.tensors());
        v.extend(prefixed("fc2", self.fc2.tensors()));
        v
    }
    fn tensors_mut(&mut self) -> Vec<Slot<'_>> {
        let mut v = prefixed_mut("fc1", self.fc1.tensors_mut());
        v.extend(prefixed_mut("fc2", self.fc2.tensors_mut()));
        v
    }
}
