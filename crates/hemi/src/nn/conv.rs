//! The Conv2d layer.

use super::{init, param, ForwardHook, LayerMut, LayerRef, Module, Visit, Visitor, VisitorMut};
use crate::error::{Error, Result};
use crate::ops::conv::Conv2dOptions;
use crate::rng::Generator;
use crate::tensor::Tensor;
use std::sync::Arc;

/// PyTorch's `nn.Conv2d`: weight `[out, in/groups, kh, kw]`, bias `[out]`.
pub struct Conv2d {
    /// `[out_channels, in_channels / groups, kh, kw]`, F32 at creation.
    pub weight: Tensor,
    /// `[out_channels]`, when the layer has a bias.
    pub bias: Option<Tensor>,
    /// Stride, padding, dilation and groups.
    pub opts: Conv2dOptions,
    /// A replacement of the float forward (INT8, calibration, fake-quant), set by `quant`.
    pub hook: Option<Arc<dyn ForwardHook>>,
}

impl Conv2d {
    /// A convolution from `in_channels` to `out_channels` with a `kernel` of (height,
    /// width), initialised as PyTorch's `nn.Conv2d` (Kaiming-uniform weight with a = √5,
    /// bias uniform in ±1/√fan_in) from `rng`. Groups that do not divide both channel
    /// counts are an [`Error::Arg`].
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: (usize, usize),
        opts: Conv2dOptions,
        bias: bool,
        rng: &mut Generator,
    ) -> Result<Self> {
        if opts.groups == 0
            || !in_channels.is_multiple_of(opts.groups)
            || !out_channels.is_multiple_of(opts.groups)
        {
            return Err(Error::arg(
                "Conv2d",
                format!(
                    "groups {} must divide in {in_channels} and out {out_channels} channels",
                    opts.groups
                ),
            ));
        }
        let fan_in = in_channels / opts.groups * kernel.0 * kernel.1;
        let shape = [out_channels, in_channels / opts.groups, kernel.0, kernel.1];
        let weight = param(init::kaiming_uniform_default(&shape, fan_in, rng)?)?;
        let bias = if bias {
            Some(param(init::bias_uniform(out_channels, fan_in, rng)?)?)
        } else {
            None
        };
        Ok(Conv2d {
            weight,
            bias,
            opts,
            hook: None,
        })
    }

    /// `pool(relu(self(x)))` with a 2×2 stride-2 max-pool, as one fused op
    /// (`Tensor::conv2d_relu_max_pool2`): what `MaxPool2d::new(2).forward(&conv.forward(x)?.relu()?)`
    /// computes, without storing the full-resolution activation.
    pub fn forward_relu_max_pool2(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hook {
            Some(h) => {
                h.forward(LayerRef::Conv2d(self), x, true)?
                    .max_pool2d((2, 2), (2, 2), (0, 0))
            }
            None => x.conv2d_relu_max_pool2(&self.weight, self.bias.as_ref(), self.opts),
        }
    }

    /// `relu(self(x))`: one call, so that a quantised layer fuses the ReLU into its
    /// requantisation (PyTorch's `ConvReLU2d` after `fuse_modules`).
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hook {
            Some(h) => h.forward(LayerRef::Conv2d(self), x, true),
            None => self.forward(x)?.relu(),
        }
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hook {
            Some(h) => h.forward(LayerRef::Conv2d(self), x, false),
            None => x.conv2d(&self.weight, self.bias.as_ref(), self.opts),
        }
    }
}

impl Visit for Conv2d {
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
        Some(LayerMut::Conv2d(self))
    }
}
