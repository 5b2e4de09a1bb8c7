//! Pooling: max_pool2d (indices kept), avg_pool2d, adaptive_avg_pool2d.
