//! Pooling layers (no tensors of their own).

use super::Module;
use crate::error::Result;
use crate::tensor::Tensor;

/// PyTorch's `nn.MaxPool2d(kernel, stride=kernel, padding=0)`.
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d {
    /// Window (height, width).
    pub kernel: (usize, usize),
    /// Step between windows (vertical, horizontal).
    pub stride: (usize, usize),
    /// Implicit -inf padding on each side, at most half the kernel.
    pub padding: (usize, usize),
}

impl MaxPool2d {
    /// Square kernel `k` with stride `k`, as `nn.MaxPool2d(k)`.
    pub fn new(k: usize) -> Self {
        MaxPool2d {
            kernel: (k, k),
            stride: (k, k),
            padding: (0, 0),
        }
    }
}

/// PyTorch's `nn.AvgPool2d(kernel, stride=kernel, padding=0, count_include_pad=True)`.
#[derive(Clone, Copy, Debug)]
pub struct AvgPool2d {
    /// Window (height, width).
    pub kernel: (usize, usize),
    /// Step between windows (vertical, horizontal).
    pub stride: (usize, usize),
    /// Implicit zero padding on each side, at most half the kernel.
    pub padding: (usize, usize),
    /// Count padded zeros in each window's divisor (PyTorch's default `true`).
    pub count_include_pad: bool,
}

impl AvgPool2d {
    /// Square kernel `k` with stride `k`, as `nn.AvgPool2d(k)`.
    pub fn new(k: usize) -> Self {
        AvgPool2d {
            kernel: (k, k),
            stride: (k, k),
            padding: (0, 0),
            count_include_pad: true,
        }
    }
}

/// PyTorch's `nn.AdaptiveAvgPool2d(output_size)`.
#[derive(Clone, Copy, Debug)]
pub struct AdaptiveAvgPool2d {
    /// The output's (height, width); each window spans PyTorch's adaptive bounds.
    pub output_size: (usize, usize),
}

macro_rules! stateless {
    ($t:ty, |$s:ident, $x:ident| $body:expr) => {
        impl Module for $t {
            fn forward(&self, $x: &Tensor) -> Result<Tensor> {
                let $s = self;
                $body
            }
        }
        impl $crate::nn::Visit for $t {
            fn visit<'a>(&'a self, _: &mut dyn $crate::nn::Visitor<'a>) {}
            fn visit_mut<'a>(&'a mut self, _: &mut dyn $crate::nn::VisitorMut<'a>) {}
        }
    };
}
pub(crate) use stateless;

stateless!(MaxPool2d, |s, x| x
    .max_pool2d(s.kernel, s.stride, s.padding));
stateless!(AvgPool2d, |s, x| x.avg_pool2d(
    s.kernel,
    s.stride,
    s.padding,
    s.count_include_pad
));
stateless!(AdaptiveAvgPool2d, |s, x| x
    .adaptive_avg_pool2d(s.output_size));
