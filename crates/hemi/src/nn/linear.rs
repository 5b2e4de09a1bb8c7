//! Linear (fully connected) and Embedding layers.

use super::{init, param, ForwardHook, LayerMut, LayerRef, Module, Visit, Visitor, VisitorMut};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;
use std::sync::Arc;

/// `y = x Wᵀ + b` with `weight` `[out, in]` and `bias` `[out]`, PyTorch's `nn.Linear`.
pub struct Linear {
    /// `[out_features, in_features]`, F32 at creation.
    pub weight: Tensor,
    /// `[out_features]`, when the layer has a bias.
    pub bias: Option<Tensor>,
    /// A replacement of the float forward (INT8, calibration, fake-quant), set by `quant`.
    pub hook: Option<Arc<dyn ForwardHook>>,
}

impl Linear {
    /// A layer from `in_features` to `out_features`, initialised as PyTorch's `nn.Linear`
    /// (Kaiming-uniform weight with a = √5, bias uniform in ±1/√in_features) from `rng`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        rng: &mut Generator,
    ) -> Result<Self> {
        let weight = param(init::kaiming_uniform_default(
            &[out_features, in_features],
            in_features,
            rng,
        )?)?;
        let bias = if bias {
            Some(param(init::bias_uniform(out_features, in_features, rng)?)?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            hook: None,
        })
    }
}

impl Linear {
    /// `relu(self(x))`: one call, so that a quantised layer fuses the ReLU into its
    /// requantisation (PyTorch's `LinearReLU` after `fuse_modules`).
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hook {
            Some(h) => h.forward(LayerRef::Linear(self), x, true),
            None => self.forward(x)?.relu(),
        }
    }
}

impl Linear {
    /// `gelu(self(x))` (`tanh`: the tanh approximation), one call, so that an INT8 layer
    /// applies GELU in its epilogue instead of a pass over the whole output.
    pub fn forward_gelu(&self, x: &Tensor, tanh: bool) -> Result<Tensor> {
        match &self.hook {
            Some(h) => h.forward_gelu(LayerRef::Linear(self), x, tanh),
            None if tanh => self.forward(x)?.gelu_tanh(),
            None => self.forward(x)?.gelu(),
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hook {
            Some(h) => h.forward(LayerRef::Linear(self), x, false),
            None => x.linear(&self.weight, self.bias.as_ref()),
        }
    }
}

impl Visit for Linear {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.param("weight", &self.weight);
        if let Some(b) = &self.bias {
            v.param("bias", b);
        }
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.param("weight", &mut self.weight);
        if let Some(b) = &mut self.bias {
            v.param("bias", b);
        }
    }
    fn as_layer_mut(&mut self) -> Option<LayerMut<'_>> {
        Some(LayerMut::Linear(self))
    }
}

/// A lookup table of `num_embeddings` vectors of size `dim`, initialised N(0, 1) as
/// PyTorch's `nn.Embedding`.
pub struct Embedding {
    /// `[num_embeddings, dim]`: row `i` is the vector of id `i`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num_embeddings` vectors of `dim` values drawn N(0, 1) from `rng`; zero
    /// sizes are an [`Error::Arg`].
    pub fn new(num_embeddings: usize, dim: usize, rng: &mut Generator) -> Result<Self> {
        if num_embeddings == 0 || dim == 0 {
            return Err(Error::arg("Embedding", "sizes must be > 0"));
        }
        Ok(Embedding {
            weight: param(Tensor::randn(
                &[num_embeddings, dim],
                0.0,
                1.0,
                DType::F32,
                rng,
            )?)?,
        })
    }
}

impl Module for Embedding {
    /// `x` holds I64 ids of any shape.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::embedding(&self.weight, x)
    }
}

impl Visit for Embedding {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.param("weight", &self.weight);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.param("weight", &mut self.weight);
    }
}
