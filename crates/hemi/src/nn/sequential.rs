//! Sequential: layers applied in order, named "0", "1", ... as PyTorch's `nn.Sequential`.

use super::{prefixed, prefixed_mut, Kind, Module, Slot};
use crate::error::Result;
use crate::tensor::Tensor;

/// Layers applied in order, PyTorch's `nn.Sequential`; their tensors are named
/// `"0.weight"`, `"1.bias"`... by position.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// An empty sequence (the identity until layers are added).
    pub fn new() -> Self {
        Sequential::default()
    }
    /// Appends a layer (builder style).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Module + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }
    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    /// True when no layer has been added.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            let _scope = crate::ops::scope::enter_at(i);
            h = l.forward(&h)?;
        }
        Ok(h)
    }
    fn set_training(&mut self, training: bool) {
        self.layers
            .iter_mut()
            .for_each(|l| l.set_training(training));
    }
    fn generators(&self) -> Vec<&std::sync::Mutex<crate::rng::Generator>> {
        self.layers.iter().flat_map(|l| l.generators()).collect()
    }
    fn batch_norms_mut(&mut self) -> Vec<&mut crate::nn::BatchNorm2d> {
        self.layers
            .iter_mut()
            .flat_map(|l| l.batch_norms_mut())
            .collect()
    }
    fn tensors(&self) -> Vec<(String, &Tensor, Kind, bool)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| prefixed(&i.to_string(), l.tensors()))
            .collect()
    }
    fn tensors_mut(&mut self) -> Vec<Slot<'_>> {
        self.layers
            .iter_mut()
            .enumerate()
            .flat_map(|(i, l)| prefixed_mut(&i.to_string(), l.tensors_mut()))
            .collect()
    }
}
