//! Batch norm and layer norm, statistics in F32.
