//! CPU kernels against their plain twins and f64 references: GEMM, convolutions, INT8 GEMM, thread-count independence.
//!
//! One test binary for these files (each a module, as each was its own binary before), so
//! the suite links a few binaries instead of one per file. Tests that change process-wide
//! state (`gemm_kernels`' forced kernels) run each in a process of its own (`alone`).

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod alone;
mod compose;
mod compose_ops;
mod conv_amx;
mod conv_block;
mod conv_direct;
mod conv_implicit;
mod conv_wgrad;
mod gemm_f32_bench;
mod gemm_half;
mod gemm_kernels;
mod qgemm;
mod threads;
mod unit;
