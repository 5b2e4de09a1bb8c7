//! The CUDA backend, host side (feature `cuda`).
//!
//! Every CUDA library is loaded at run time, so this builds without a toolkit; on a machine
//! without a GPU every entry point returns an [`Error::Device`](crate::Error::Device) that says
//! what is missing. The pieces, bottom up:
//!
//! - [`device`]: probe the driver and libraries (clear errors instead of cudarc's panics),
//!   count devices, check ordinals.
//! - [`alloc`]: the caching allocator's bookkeeping (generic over the raw allocator, tested on
//!   the CPU with a fake one).
//! - [`launch`]: grid/block arithmetic.
//! - [`kernels`]: CUDA C sources per storage dtype for NVRTC, kernel names, cache keys, and
//!   the elementwise index parameters.
//! - [`gemm`]: row-major batched matmul -> cuBLAS column-major arguments.
//! - [`context`]: [`CudaDevice`] (context, stream, cuBLAS, allocator, module cache) and
//!   [`CudaStorage`]. Not yet wired into `Tensor`.

pub use crate::device_alloc as alloc;
pub mod context;
pub mod device;
pub mod gemm;
pub mod kernels;
pub mod launch;

pub use context::{CudaDevice, CudaStorage};
pub use device::{cuda_available, device_count};
