//! Matrix products: 2-D and batched, transposed operands without copies.
