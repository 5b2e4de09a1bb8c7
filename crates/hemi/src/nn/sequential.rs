//! Sequential: layers applied in order, named "0", "1", ... as PyTorch's `nn.Sequential`.

use super::{Module, Visit, Visitor, VisitorMut};
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
}

/// Children `"0"`, `"1"`... by position.
impl Visit for Sequential {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        for (i, l) in self.layers.iter().enumerate() {
            v.child(&i.to_string(), &**l);
        }
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        // Quantisation has never listed a Sequential's layers (`layers_mut` came after it and
        // did not cover it), and the traversal keeps it so. Its forward does run each
        // layer's hook: dropping this line would let `quant` take them.
        v.hide_layers();
        for (i, l) in self.layers.iter_mut().enumerate() {
            v.child(&i.to_string(), &mut **l);
        }
    }
}
