//! Reductions beyond sum and mean: max and min (values over dims, or values with their
//! indices along one dim), argmax/argmin, and var: validation, output shapes and backward
//! recording around the `ReduceOps` primitives (`backend::reduce`, whose `Rows` is the
//! one-dim view that softmax and the losses share with max_dim).
//!
//! Dtypes: max, min and var keep the input dtype (var is computed in F32 for half inputs
//! and rounded once); indices are I64. Integer inputs are rejected.
//!
//! NaN propagates: a row holding a NaN has max (and min) NaN, and max_dim/argmax point at
//! its first NaN, as PyTorch does.

use std::sync::Arc;

use super::reduce::{reduce_dims, reduced_shape, reduction_layout};
use crate::backend::reduce::ReduceOp;
use crate::error::{Error, Result};
use crate::tensor::{Layout, Storage, Tensor};

/// Kept here for the op files that import it from this path.
pub(crate) use crate::backend::reduce::Rows;

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

/// A tensor of the original dim order from a contiguous buffer laid out with `dims` moved
/// last (the layout `reduction_layout` gives), outside the graph.
fn unpermute(values: Storage, shape: &[usize], dims: &[usize]) -> Result<Tensor> {
    let perm: Vec<usize> = (0..shape.len())
        .filter(|d| !dims.contains(d))
        .chain(dims.iter().copied())
        .collect();
    let perm_shape: Vec<usize> = perm.iter().map(|&d| shape[d]).collect();
    let mut inverse = vec![0; perm.len()];
    for (i, &d) in perm.iter().enumerate() {
        inverse[d] = i;
    }
    Tensor::from_storage(Arc::new(values), Layout::contiguous(&perm_shape))
        .permute(&inverse)?
        .contiguous()
}

impl Tensor {
    /// Largest value over `dims` (all dims when empty), PyTorch's `amax`. NaN propagates.
    ///
    /// Gradient: like `amax`, the output's gradient is split evenly among the elements that
    /// equal the maximum (ties share it; a NaN maximum sends it to the NaN elements).
    /// For one max per row with a winner-takes-all gradient use `max_dim`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme(dims, keepdim, ReduceOp::Max)
    }

    /// Smallest value over `dims` (all dims when empty), PyTorch's `amin`; the gradient as
    /// for `max`.
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme(dims, keepdim, ReduceOp::Min)
    }

    /// Largest value along `dim` and its index (I64; the first on ties, the first NaN if
    /// any), as `torch.max(x, dim)`. The gradient goes to the indexed element.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim("max_dim", dim, keepdim, ReduceOp::Max)
    }

    /// Smallest value along `dim` and its index, as `torch.min(x, dim)`.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim("min_dim", dim, keepdim, ReduceOp::Min)
    }

    /// Index (I64) of the largest value along `dim`, the first on ties.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self
            .detach()
            .extreme_dim("argmax", dim, keepdim, ReduceOp::Max)?
            .1)
    }

    /// Index (I64) of the smallest value along `dim`, the first on ties.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self
            .detach()
            .extreme_dim("argmin", dim, keepdim, ReduceOp::Min)?
            .1)
    }

    /// Variance over `dims` (all dims when empty) with `correction` subtracted from the
    /// count, as `torch.var(x, dims, correction=...)`: `Σ(x - mean)² / max(0, n - correction)`
    /// (so `n <= correction` gives inf, or NaN for a zero sum, as PyTorch). Computed in the
    /// compute type by a shifted, corrected two-pass algorithm: stable for data with a
    /// large mean. The output dtype is the input's.
    pub fn var(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let op = "var";
        require_float(op, self)?;
        if let Some(dt) = super::autocast::target(op, &[Some(self)]) {
            return super::autocast::cast(self, dt)?.var(dims, correction, keepdim);
        }
        let dims = reduce_dims(op, dims, self.rank())?;
        let out_shape = reduced_shape(self.shape(), &dims, keepdim);
        let (p, outer, inner) = reduction_layout(self, &dims)?;
        let x = self.detach();
        let out = p.storage().reduce(
            p.layout(),
            outer,
            inner,
            ReduceOp::Var { correction },
            self.dtype(),
        )?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&out_shape),
            op,
            &[self],
            move |g| {
                // Computed with the reduced dims last, then put back.
                let (p, _, _) = reduction_layout(&x, &dims)?;
                let gi = p.storage().var_backward(
                    p.layout(),
                    (&g.storage(), g.layout()),
                    (outer, inner),
                    correction,
                    g.dtype(),
                )?;
                Ok(vec![Some(unpermute(gi, x.shape(), &dims)?)])
            },
        ))
    }

    fn extreme(&self, dims: &[isize], keepdim: bool, rop: ReduceOp) -> Result<Tensor> {
        let op = rop.name();
        require_float(op, self)?;
        let dims = reduce_dims(op, dims, self.rank())?;
        let out_shape = reduced_shape(self.shape(), &dims, keepdim);
        let (p, outer, inner) = reduction_layout(self, &dims)?;
        if inner == 0 && outer > 0 {
            return Err(Error::shape(
                op,
                format!(
                    "cannot reduce {:?} over dims {dims:?} of size zero",
                    self.shape()
                ),
            ));
        }
        let x = self.detach();
        let storage = Arc::new(
            p.storage()
                .reduce(p.layout(), outer, inner, rop, self.dtype())?,
        );
        let layout = Layout::contiguous(&out_shape);
        // The backward keeps the output values through a detached handle on its storage
        // (not the output tensor itself, which would own its own node).
        let m = Tensor::from_storage(storage.clone(), layout.clone());
        Ok(Tensor::from_op(storage, layout, op, &[self], move |g| {
            // Computed with the reduced dims last, then put back.
            let (p, _, _) = reduction_layout(&x, &dims)?;
            let gi = p.storage().extreme_backward(
                p.layout(),
                (&m.storage(), m.layout()),
                (&g.storage(), g.layout()),
                (outer, inner),
                g.dtype(),
            )?;
            Ok(vec![Some(unpermute(gi, x.shape(), &dims)?)])
        }))
    }

    fn extreme_dim(
        &self,
        op: &'static str,
        dim: isize,
        keepdim: bool,
        rop: ReduceOp,
    ) -> Result<(Tensor, Tensor)> {
        require_float(op, self)?;
        let (d, rows) = Rows::along(op, self.shape(), dim)?;
        if rows.len == 0 && rows.count() > 0 {
            return Err(Error::shape(
                op,
                format!("cannot reduce dim {d} of size zero in {:?}", self.shape()),
            ));
        }
        let mut out_shape = self.shape().to_vec();
        if !out_shape.is_empty() {
            if keepdim {
                out_shape[d] = 1;
            } else {
                out_shape.remove(d);
            }
        }
        let (values, index) = self
            .storage()
            .extreme_dim(self.layout(), rows, rop, self.dtype())?;
        let layout = Layout::contiguous(&out_shape);
        let index = Tensor::from_storage(Arc::new(index), layout.clone());
        let at = index.detach();
        let in_shape = self.shape().to_vec();
        let values = Tensor::from_op(Arc::new(values), layout, op, &[self], move |g| {
            // The whole gradient goes to the element each output came from.
            let gi = g.storage().extreme_dim_backward(
                g.layout(),
                &at.storage(),
                at.layout(),
                rows,
                g.dtype(),
            )?;
            Ok(vec![Some(Tensor::from_storage(
                Arc::new(gi),
                Layout::contiguous(&in_shape),
            ))])
        });
        Ok((values, index))
    }
}
