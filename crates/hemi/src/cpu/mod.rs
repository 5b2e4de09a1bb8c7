//! CPU kernels: plain loops and `gemm` calls over buffers with their shape arguments; no
//! autograd here.

pub mod amp;
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod attention;
pub mod chunked;
pub mod conv;
pub mod conv_block;
pub mod conv_direct;
pub mod conv_implicit;
pub mod conv_wgrad;
pub mod gemm;
pub mod gemm_half;
pub mod index;
pub mod loss;
pub mod map;
pub mod matmul;
pub mod nn;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod qgemm;
pub mod quant;
pub mod reduce;
pub mod runs;
pub mod storage;
