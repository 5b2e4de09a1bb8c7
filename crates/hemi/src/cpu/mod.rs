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

pub(crate) mod aligned;
pub mod amp;
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod attention;
pub mod chunked;
pub mod conv;
pub mod conv_amx;
pub mod conv_block;
pub mod conv_direct;
pub mod conv_implicit;
pub mod conv_wgrad;
pub mod features;
pub mod gemm;
pub mod gemm_half;
pub mod index;
pub mod loss;
pub mod map;
pub mod matmul;
pub mod nn;
pub mod norm;
#[doc(hidden)]
pub mod norm_wide;
pub mod optim;
pub mod pool;
pub mod qgemm;
pub mod quant;
pub mod reduce;
pub mod runs;
pub mod storage;
