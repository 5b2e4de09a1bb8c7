//! Ops and autograd: every op against f64 references in F32/F16/BF16, finite-difference gradients, autocast.
//!
//! One test binary for these files (each a module, as each was its own binary before), so
//! the suite links a few binaries instead of one per file.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod attention;
mod autocast;
mod autograd;
mod bn_act;
mod bn_relu_conv;
mod conv;
mod elementwise;
mod grad_histogram;
mod index;
mod loss;
mod matmul;
mod naive;
mod nn;
mod norm;
mod op_table;
mod pool;
mod stats;
mod tensor;
mod transformer_ops;
