//! The CPU backend: kernels over plain buffers with their shape arguments (no autograd
//! here), in folders by kernel family, and the primitives that dispatch to them.
//!
//! - `ops/`: every `impl *Ops for CpuStorage` (one file per area of `backend/`) and
//!   `BackendStorage`: layouts read, the kernel picked by dtype, results rounded;
//! - `gemm/`: matrix products (`product`, hemi's blocked GEMM and its kernel choice,
//!   packing and microkernels, batched `matmul`); `qgemm/`: the INT8 GEMM and quantisation;
//! - `conv/`: convolutions (the plan of each, im2col, the direct, implicit, weight-gradient
//!   and AMX routes, the fused conv + ReLU + pool block);
//! - `norm/`: batch and layer norm (`in_place`: batch norm's AVX-512 runs on half storage);
//! - `elementwise/`: maps, the loss scaler's checks, optimizer updates; `reduce/`: sums,
//!   extrema, variance, softmax, and the losses;
//! - one file each for `attention` (fused scaled-dot-product attention), `pool` and
//!   `index` (gathers, concatenation);
//! - shared by the families: `storage` (the buffer type), `chunked` and `runs` (how work is
//!   split, thread-count independent), `features` (which instructions kernels may use) and
//!   `amx` (what every AMX kernel needs first).

/// Runs `$body` with the type alias `$T` bound to the element type of `$dtype`, one of F32,
/// F16 and BF16 (the dtypes the half-precision and fused kernels take); `$else` otherwise.
macro_rules! with_f32_or_half {
    ($dtype:expr, $T:ident => $body:expr, _ => $else:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            _ => $else,
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod attention;
pub mod chunked;
pub mod conv;
pub mod elementwise;
pub mod features;
pub mod gemm;
pub mod index;
pub mod norm;
pub mod ops;
pub mod pool;
pub mod qgemm;
pub mod reduce;
pub mod runs;
pub mod storage;
