//! The library's unit tests: they live here, not in `src/`, so the test command builds
//! the library once (a `#[cfg(test)]` module makes cargo compile the whole library a
//! second time as a test binary).

mod cuda_alloc;
mod cuda_context;
mod cuda_device;
mod cuda_gemm;
mod cuda_kernels;
mod cuda_launch;
