//! Network primitives: matmul and batched matmul with F32 accumulation, convolutions
//! forward and backward (and the fused conv blocks), pools, batch and layer norms.

#[allow(unused_imports)]
use super::BackendStorage;
