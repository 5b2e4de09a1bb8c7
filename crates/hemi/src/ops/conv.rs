//! 2-D convolution (im2col + GEMM), forward and backward.
