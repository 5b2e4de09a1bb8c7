//! hemi: a deep-learning training framework built around half precision.
//!
//! FP16 and BF16 tensors halve the memory of F32; hemi adds what makes training in them
//! converge (autocast, loss scaling, F32 master weights, stochastic rounding) and fast
//! (kernels that use the CPU's half-precision instructions), with PyTorch's programming
//! model and names. Every sum (matmul, convolution, reductions, norms, softmax, losses) is
//! accumulated in at least F32 and rounded once when stored.
//!
//! # Layers
//!
//! Bottom to top, each using only the ones below it:
//!
//! - [`dtype`] (F16, BF16, F32, F64, I64; the element trait, finfo, promotion, conversions)
//!   and [`device`]; [`threads`] (keeps rayon's workers awake between the kernels of a
//!   step);
//! - the backends: [`cpu`] (and `cuda` behind the `cuda` feature), whose buffers implement
//!   the primitives declared in [`backend`];
//! - [`tensor`] (the [`Tensor`] handle: a storage on one device, a layout, a dtype) and
//!   [`ops`] (validation, promotion, [autocast](ops::autocast), the recorded backward, then
//!   one backend primitive); [`autograd`] runs the backward;
//! - [`nn`] (layers with PyTorch's names and initialisation, the [`nn::Module`] trait),
//!   [`amp`] (autocast, [`amp::GradScaler`], master weights, the [`amp::Precision`]
//!   presets), [`optim`] (SGD, Adam, AdamW, schedules), [`data`] (data sets and the
//!   [`data::DataLoader`]), [`io`] (safetensors files);
//! - [`models`] (CifarNet, MLP, ResNets, BERT and their registry) and [`train`] (the loop
//!   over a task, evaluation, checkpoints).
//!
//! # The documents' training loop
//!
//! The user's documents train a CNN on CIFAR-10 with SGD (lr 0.001, momentum 0.9), the
//! forward pass under `autocast()` and the loss scaled by a `GradScaler`. In hemi the loop
//! reads as PyTorch's; here on 64 images of the built-in synthetic set instead of
//! CIFAR-10's 50,000 (`hemi::train::train` runs the full recipe, `hemi train` from the
//! command line):
//!
//! ```
//! use std::sync::Arc;
//!
//! use hemi::amp::{autocast, GradScaler, GradScalerConfig};
//! use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
//! use hemi::models::CifarNet;
//! use hemi::nn::Module;
//! use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
//! use hemi::optim::{Optimizer, Sgd, SgdConfig};
//! use hemi::{DType, Generator};
//!
//! # fn main() -> hemi::Result<()> {
//! let data = Synthetic::generate(0, Split::Train, 64); // 32×32 RGB images, 10 classes
//! let loader = DataLoader::new(
//!     Arc::new(data),
//!     LoaderConfig {
//!         batch_size: 32,
//!         transform: Transform::new().normalize(&[0.5], &[0.5]), // the documents' Normalize
//!         workers: 0,
//!         ..Default::default()
//!     },
//! )?;
//! let net = CifarNet::cifar10(&mut Generator::new(0))?; // conv-pool-conv-pool-fc-fc, F32
//! let sgd = SgdConfig { lr: 0.001, momentum: 0.9, ..Default::default() };
//! let mut opt = Sgd::new(net.parameters(), sgd)?;
//! let mut scaler = GradScaler::new(GradScalerConfig::default())?; // 2^16, PyTorch's rule
//!
//! let mut epoch_losses = Vec::new();
//! for epoch in 0..4 {
//!     let mut sum = 0.0;
//!     for batch in loader.epoch(epoch) {
//!         let batch = batch?;
//!         opt.zero_grad();
//!         let loss = {
//!             let _ac = autocast(DType::F16); // conv and linear in F16, the loss in F32
//!             let logits = net.forward(batch.images()?)?;
//!             cross_entropy(&logits, &batch.labels, CrossEntropyOptions::default())?
//!         };
//!         scaler.scale(&loss)?.backward()?; // F32 gradients of the F32 weights
//!         scaler.step(&mut opt)?; // unscales; skips the step if a gradient is inf/NaN
//!         scaler.update()?; // backs off on overflow, grows after 2000 clean steps
//!         sum += loss.to_scalar()?;
//!     }
//!     epoch_losses.push(sum / loader.num_batches() as f64);
//! }
//! assert!(epoch_losses[3] < epoch_losses[0], "{epoch_losses:?}");
//! assert_eq!((scaler.get_scale(), scaler.skipped_steps()), (65536.0, 0));
//! # Ok(())
//! # }
//! ```
//!
//! The weights stay F32 (autocast casts them per op, once per scope), so they are the
//! master weights. The other presets of [`amp::Precision`] run the same loop through
//! [`amp::AmpOptimizer`]: `fp16-master` keeps the model itself in F16 and trains it through
//! F32 master copies with the loss scaled inside the optimizer (apex's `FP16_Optimizer`),
//! and Keras' policy names parse to their presets (`mixed_float16` is `amp-fp16`):
//!
//! ```
//! # use std::sync::Arc;
//! # use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
//! use hemi::amp::{AmpOptimizer, GradScalerConfig, Precision};
//! use hemi::models::CifarNet;
//! use hemi::nn::Module;
//! use hemi::ops::loss::cross_entropy;
//! use hemi::optim::{Optimizer, Sgd, SgdConfig};
//! use hemi::{DType, Generator};
//!
//! # fn main() -> hemi::Result<()> {
//! # let data = Synthetic::generate(0, Split::Train, 32);
//! # let cfg = LoaderConfig { batch_size: 16, workers: 0, ..Default::default() };
//! # let loader = DataLoader::new(Arc::new(data), cfg)?;
//! // Keras: mixed_precision.set_global_policy("mixed_float16")
//! let policy = Precision::parse("mixed_float16")?;
//! assert_eq!(policy, Precision::AmpFp16);
//! assert_eq!((policy.weight_dtype(), policy.compute_dtype()), (DType::F32, DType::F16));
//!
//! for precision in [policy, Precision::Fp16Master] {
//!     let mut net = CifarNet::cifar10(&mut Generator::new(0))?;
//!     precision.prepare_model(&mut net)?; // fp16-master: the weights become F16
//!     let sgd = SgdConfig { lr: 0.001, momentum: 0.9, ..Default::default() };
//!     let mut opt = AmpOptimizer::new(precision, net.parameters(), GradScalerConfig::default(), 0,
//!         // the SGD steps whatever it is given: the F32 masters under fp16-master
//!         |params| Ok(Box::new(Sgd::new(params, sgd)?) as Box<dyn Optimizer>))?;
//!     for batch in loader.epoch(0) {
//!         let batch = batch?;
//!         opt.zero_grad();
//!         let loss = {
//!             let _ac = precision.autocast(); // autocast F16 for amp-fp16, none otherwise
//!             let logits = net.forward(&precision.input(batch.images()?)?)?;
//!             cross_entropy(&logits, &batch.labels, Default::default())?
//!         };
//!         opt.backward(&loss)?; // loss × scale
//!         assert!(opt.step()?); // false when skipped for an inf/NaN gradient
//!     }
//!     assert_eq!(opt.scale(), 65536.0);
//!     assert_eq!(net.parameters()[0].dtype(), precision.weight_dtype());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Runnable programs (the documents' loop by hand, a custom model and loop, inference from a
//! checkpoint) are in `crates/hemi/examples/`; DESIGN.md has the precision contract and
//! the autocast table.

#![warn(missing_docs)]

/// Whether kernels may use the instruction set `$f` (a [`cpu::features::Feature`] variant):
/// the CPU has it and the CPU configuration allows it. Every kernel choice asks through it,
/// never through `is_x86_feature_detected!` directly.
macro_rules! cpu_has {
    ($f:ident) => {
        $crate::cpu::features::has($crate::cpu::features::Feature::$f)
    };
}

pub mod amp;
pub mod autograd;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device;
#[cfg(any(feature = "cuda", feature = "gpu"))]
pub mod device_alloc;
pub mod dist;
pub mod dtype;
pub mod error;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod io;
pub mod models;
pub mod naive;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod quant;
pub mod rng;
pub mod tensor;
pub mod threads;
pub mod train;

pub use autograd::{no_grad, NoGradGuard};
pub use dtype::{DType, FInfo};
pub use error::{Error, Result};
pub use rng::Generator;
pub use tensor::{Device, Layout, Tensor};
