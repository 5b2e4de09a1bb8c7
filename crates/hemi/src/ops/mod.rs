//! Op entry points: validation, dtype promotion, dispatch to kernels, and the backward of
//! each op recorded for autograd. One family of ops per file.

pub mod attention;
pub mod autocast;
pub mod check;
pub mod conv;
pub mod dropout;
pub mod elementwise;
pub mod index;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod reduce;
pub mod scope;
pub mod stats;

pub use elementwise::promote_all;
