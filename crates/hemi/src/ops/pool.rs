//! 2-D pooling, the op entry points: `max_pool2d` (argmax kept for the backward),
//! `avg_pool2d` and `adaptive_avg_pool2d`, each with its backward beside it, on the backend's
//! pool primitives (`backend::nn`).
//!
//! Semantics are PyTorch's (without ceil_mode or dilation): inputs `[N, C, H, W]` or
//! `[C, H, W]`, padding at most half the kernel, max-pool padding is -inf, and the output
//! keeps the input dtype (values compared and averaged in F32 for half inputs; a max is
//! exact in any dtype).

use std::sync::Arc;

use crate::backend::nn::{AdaptivePool2dGeom, Pool2dGeom};
use crate::error::{Error, Result};
use crate::tensor::{Layout, Tensor};

/// Checks a pooled input (float, rank 3 or 4, non-empty spatial dims) and returns
/// (planes, h, w).
fn planes(op: &'static str, x: &Tensor) -> Result<(usize, usize, usize)> {
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "expected a float tensor"));
    }
    let s = x.shape();
    if s.len() != 3 && s.len() != 4 {
        return Err(Error::shape(
            op,
            format!("input must be [N, C, H, W] or [C, H, W]; got {s:?}"),
        ));
    }
    let (h, w) = (s[s.len() - 2], s[s.len() - 1]);
    if h == 0 || w == 0 {
        return Err(Error::shape(
            op,
            format!("spatial dims must be non-zero; got {s:?}"),
        ));
    }
    Ok((s[..s.len() - 2].iter().product(), h, w))
}

/// The output shape: the input's leading dims and the pooled spatial dims.
pub(super) fn pooled_shape(x: &Tensor, h_out: usize, w_out: usize) -> Vec<usize> {
    let s = x.shape();
    let mut out = s[..s.len() - 2].to_vec();
    out.extend([h_out, w_out]);
    out
}

/// Checks kernel, stride and padding (PyTorch's rules) and works out the pool's geometry.
pub(super) fn window_geometry(
    op: &'static str,
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<Pool2dGeom> {
    let (planes, h, w) = planes(op, x)?;
    let args = || {
        format!(
            "input {:?}, kernel {kernel:?}, stride {stride:?}, padding {padding:?}",
            x.shape()
        )
    };
    if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
        return Err(Error::arg(
            op,
            format!("kernel and stride must be positive; got {}", args()),
        ));
    }
    if padding.0 > kernel.0 / 2 || padding.1 > kernel.1 / 2 {
        return Err(Error::arg(
            op,
            format!("padding must be at most half the kernel; got {}", args()),
        ));
    }
    if h + 2 * padding.0 < kernel.0 || w + 2 * padding.1 < kernel.1 {
        return Err(Error::shape(
            op,
            format!("kernel is larger than the padded input; got {}", args()),
        ));
    }
    Ok(Pool2dGeom {
        planes,
        h,
        w,
        kernel,
        stride,
        padding,
        h_out: (h + 2 * padding.0 - kernel.0) / stride.0 + 1,
        w_out: (w + 2 * padding.1 - kernel.1) / stride.1 + 1,
    })
}

impl Tensor {
    /// Max pooling over `kernel` windows (PyTorch's `max_pool2d`, padding -inf).
    pub fn max_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        Ok(self.max_pool(kernel, stride, padding, false)?.0)
    }

    /// Max pooling that also returns, as an I64 tensor of the output's shape, the flat
    /// index `h*W + w` of each maximum within its plane (PyTorch's `return_indices`). Ties
    /// go to the first maximum in row-major order; NaN propagates.
    pub fn max_pool2d_with_indices(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let (out, idx) = self.max_pool(kernel, stride, padding, true)?;
        Ok((out, idx.expect("indices requested")))
    }

    /// Max pooling; the I64 index tensor only when asked for (the backward keeps its own
    /// compact copy).
    fn max_pool(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        with_indices: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "max_pool2d";
        let g = window_geometry(OP, self, kernel, stride, padding)?;
        if g.in_plane() > u32::MAX as usize {
            return Err(Error::shape(
                OP,
                format!("{:?}: planes of more than 2^32 values", self.shape()),
            ));
        }
        let shape = pooled_shape(self, g.h_out, g.w_out);
        let dtype = self.dtype();
        let r = self.storage().max_pool2d(self.layout(), &g, with_indices)?;
        let indices = r
            .indices
            .map(|i| Tensor::from_storage(Arc::new(i), Layout::contiguous(&shape)));
        let argmax = r.argmax;
        let in_layout = Layout::contiguous(self.shape());
        let out = Tensor::from_op(
            Arc::new(r.out),
            Layout::contiguous(&shape),
            OP,
            &[self],
            move |dy| {
                let dx = dy
                    .storage()
                    .max_pool2d_backward(dy.layout(), &argmax, &g, dtype)?;
                Ok(vec![Some(Tensor::from_storage(
                    Arc::new(dx),
                    in_layout.clone(),
                ))])
            },
        );
        Ok((out, indices))
    }

    /// Average pooling over `kernel` windows (PyTorch's `avg_pool2d`; padding counts as
    /// zeros, and in the divisor when `count_include_pad`, PyTorch's default `true`).
    pub fn avg_pool2d(
        &self,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        count_include_pad: bool,
    ) -> Result<Tensor> {
        const OP: &str = "avg_pool2d";
        let g = window_geometry(OP, self, kernel, stride, padding)?;
        let shape = pooled_shape(self, g.h_out, g.w_out);
        let dtype = self.dtype();
        let in_layout = Layout::contiguous(self.shape());
        let out = self
            .storage()
            .avg_pool2d(self.layout(), &g, count_include_pad)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&shape),
            OP,
            &[self],
            move |dy| {
                let dx =
                    dy.storage()
                        .avg_pool2d_backward(dy.layout(), &g, count_include_pad, dtype)?;
                Ok(vec![Some(Tensor::from_storage(
                    Arc::new(dx),
                    in_layout.clone(),
                ))])
            },
        ))
    }

    /// Adaptive average pooling to `output_size` (PyTorch's `adaptive_avg_pool2d`): output
    /// row `i` averages input rows `floor(i*H/out) .. ceil((i+1)*H/out)`, likewise columns.
    pub fn adaptive_avg_pool2d(&self, output_size: (usize, usize)) -> Result<Tensor> {
        const OP: &str = "adaptive_avg_pool2d";
        let (planes, h, w) = planes(OP, self)?;
        if output_size.0 == 0 || output_size.1 == 0 {
            return Err(Error::arg(
                OP,
                format!(
                    "output size must be positive; got input {:?}, output size {output_size:?}",
                    self.shape()
                ),
            ));
        }
        let shape = pooled_shape(self, output_size.0, output_size.1);
        let dtype = self.dtype();
        let in_layout = Layout::contiguous(self.shape());
        let g = AdaptivePool2dGeom {
            planes,
            h,
            w,
            h_out: output_size.0,
            w_out: output_size.1,
        };
        let out = self.storage().adaptive_avg_pool2d(self.layout(), &g)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&shape),
            OP,
            &[self],
            move |dy| {
                let dx = dy
                    .storage()
                    .adaptive_avg_pool2d_backward(dy.layout(), &g, dtype)?;
                Ok(vec![Some(Tensor::from_storage(
                    Arc::new(dx),
                    in_layout.clone(),
                ))])
            },
        ))
    }
}
