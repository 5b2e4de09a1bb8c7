//! The library's unit tests: they live here, not in `src/`, so the test command builds
//! the library once (a `#[cfg(test)]` module makes cargo compile the whole library a
//! second time as a test binary).

mod cpu_attention;
mod cpu_conv;
mod cpu_conv_amx;
mod cpu_conv_block;
mod cpu_features;
mod cpu_gemm;
mod cpu_loss;
mod cpu_map;
mod cpu_matmul;
mod cpu_norm;
mod cpu_norm_wide;
mod cpu_optim;
mod cpu_reduce;
mod cpu_runs;
mod dtype;
mod dtype_convert;
mod dtype_fastmath;
mod rng;
mod tensor_layout;
