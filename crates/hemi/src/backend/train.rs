//! Training primitives: losses, index/gather/scatter/concatenation, the fused
//! unscale-and-check-finite of the loss scaler, and the optimizer updates.

#[allow(unused_imports)]
use super::BackendStorage;
