//! Reductions: sums, means, extrema and their indices, variances, softmax rows; every
//! sum accumulated in at least F32.

#[allow(unused_imports)]
use super::BackendStorage;
