//! hemi: a deep-learning training framework built around half precision.
//!
//! Layers, bottom to top (each uses only the ones below it): `dtype` (types, the one
//! element trait `WithDType`, finfo, conversions), `device`; the backends `cpu` (and `cuda`
//! behind the `cuda` feature), whose buffers implement the primitives named in `backend`;
//! `tensor` (the handle: a `Storage` enum over backends, a layout, a dtype, a device) and
//! `ops` (validation, promotion, autocast and backward, then one backend primitive);
//! `autograd` (the backward graph); above them `nn` (layers), `amp`, `optim` (optimizers),
//! `data` (datasets and the loader), `io` (safetensors checkpoints), `models` (CifarNet,
//! MLP) and `train`. See DESIGN.md for the precision contract.

pub mod amp;
pub mod autograd;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device;
pub mod dtype;
pub mod error;
pub mod io;
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod rng;
pub mod tensor;
pub mod train;

pub use autograd::{no_grad, NoGradGuard};
pub use dtype::{DType, FInfo};
pub use error::{Error, Result};
pub use rng::Generator;
pub use tensor::{Device, Layout, Tensor};
