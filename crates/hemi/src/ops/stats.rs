//! Reductions beyond sum/mean: max (with indices) and var.
