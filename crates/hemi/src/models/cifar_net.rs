//! The CNN of the user's documents, for 32×32 RGB images in 10 classes.

use crate::error::{Error, Result};
use crate::nn::{Conv2d, Linear, Module, Visit, Visitor, VisitorMut};
use crate::ops::conv::Conv2dOptions;
use crate::rng::Generator;
use crate::tensor::Tensor;

/// conv 3→64 3×3, ReLU, max-pool 2, conv 64→128 3×3, ReLU, max-pool 2, fc →256, ReLU,
/// fc 256→10 — the network of the documents, with PyTorch's state_dict names (`conv1`,
/// `conv2`, `fc1`, `fc2`).
///
/// fc1's input size is derived from the input shape: with 3×3 kernels (no padding) a
/// 32×32 input becomes 30 → 15 → 13 → 6, so fc1 takes 128·6·6 = 4608 features. The
/// documents' `128 * 5 * 5` = 3200 is wrong for 3×3 kernels on 32×32 inputs (it is the
/// size for 5×5 kernels) and fails in PyTorch with "mat1 and mat2 shapes cannot be
/// multiplied".
pub struct CifarNet {
    /// `conv1`: 3×3 convolution, `channels` → 64, no padding.
    pub conv1: Conv2d,
    /// `conv2`: 3×3 convolution, 64 → 128, no padding.
    pub conv2: Conv2d,
    /// `fc1`: 128·h·w (4608 for 32×32 inputs) → 256.
    pub fc1: Linear,
    /// `fc2`: 256 → `classes` (the logits).
    pub fc2: Linear,
}

impl CifarNet {
    /// For inputs of `channels`×`height`×`width` (3×32×32 for CIFAR-10) and `classes`
    /// outputs, initialised as PyTorch would from `rng`.
    pub fn new(
        channels: usize,
        height: usize,
        width: usize,
        classes: usize,
        rng: &mut Generator,
    ) -> Result<Self> {
        // Spatial size after conv(k=3) then pool(2), twice.
        let after = |s: usize| -> Option<usize> {
            let s = s.checked_sub(2)? / 2;
            let s = s.checked_sub(2)? / 2;
            (s > 0).then_some(s)
        };
        let (Some(h), Some(w)) = (after(height), after(width)) else {
            return Err(Error::shape(
                "CifarNet",
                format!("input {height}x{width} is too small for two 3x3 convs and 2x2 pools"),
            ));
        };
        let opts = Conv2dOptions::default();
        Ok(CifarNet {
            conv1: Conv2d::new(channels, 64, (3, 3), opts, true, rng)?,
            conv2: Conv2d::new(64, 128, (3, 3), opts, true, rng)?,
            fc1: Linear::new(128 * h * w, 256, true, rng)?,
            fc2: Linear::new(256, classes, true, rng)?,
        })
    }

    /// The documents' configuration: 3×32×32 inputs, 10 classes.
    pub fn cifar10(rng: &mut Generator) -> Result<Self> {
        CifarNet::new(3, 32, 32, 10, rng)
    }
}

impl Module for CifarNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // pool(relu(conv(x))) twice, each block fused into one op (same values and
        // gradients as the three ops, see `Tensor::conv2d_relu_max_pool2`).
        let x = self.conv1.forward_relu_max_pool2(x)?;
        let x = self.conv2.forward_relu_max_pool2(&x)?;
        let x = x.flatten(1, -1)?;
        let x = self.fc1.forward_relu(&x)?;
        self.fc2.forward(&x)
    }
}

impl Visit for CifarNet {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("conv1", &self.conv1);
        v.child("conv2", &self.conv2);
        v.child("fc1", &self.fc1);
        v.child("fc2", &self.fc2);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("conv1", &mut self.conv1);
        v.child("conv2", &mut self.conv2);
        v.child("fc1", &mut self.fc1);
        v.child("fc2", &mut self.fc2);
    }
}
