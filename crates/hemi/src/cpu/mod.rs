//! CPU kernels: plain loops and `gemm` calls over buffers with their shape arguments; no
//! autograd here.

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
