//! The wgpu backend (feature `gpu`): tensors on any GPU with a Vulkan driver (`gpu:n`),
//! and on Mesa's lavapipe, a software Vulkan device, where CI runs its tests.
//!
//! - [`context`]: one context per ordinal (instance, adapter, device, queue), created on
//!   first use and shared; the caching allocator (`crate::device_alloc`, whose raw
//!   allocations here are wgpu buffers, one per segment); the pipeline cache (one compiled
//!   pipeline per generated shader text); launches and transfers. No adapter, a lost device,
//!   out of memory and a shader that fails to compile are `Error::Device`s naming the device
//!   and the fix.
//! - [`shaders`]: the WGSL kernels, generated per variant (dtypes, op): elementwise maps over
//!   strided, broadcast layouts (copies, casts, the op table's unary and binary maps and
//!   their backwards, `where`), row reductions, tiled batched matmul, and kernels over
//!   contiguous F32 operands (extrema, gathers and their scatter-add, concatenation, direct
//!   convolutions, max pooling, the dropout hash, stochastic rounding). F32 arithmetic; F16
//!   read natively (`enable f16;`) where the adapter has `SHADER_F16`, else packed two per
//!   `u32` word ([`with_packed_halves`] forces that fallback); BF16 packed two per word;
//!   both rounded to nearest-even on the bits when stored, bit for bit the CPU's.
//! - [`storage`]: [`GpuStorage`], `Storage::Gpu`'s buffer, and the 24 basic primitives; the
//!   default compositions (`backend::compose`: softmax, layer norm, losses, optimizers...)
//!   run on them.

pub mod context;
pub mod shaders;
pub mod storage;

pub use context::{context, device_count, with_packed_halves, AdapterInfo, GpuContext};
pub use storage::GpuStorage;
