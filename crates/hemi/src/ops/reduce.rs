//! Reductions over dims: sum and mean here (max and var beside them), accumulated in the
//! compute type (F32 for half inputs) by `ReduceOps::reduce` (on the CPU with eight
//! independent lanes, which vectorises and keeps the rounding error of long sums near that
//! of pairwise summation). The helpers here resolve the dims and lay the input out with the
//! reduced dims last, the view the reduction primitives read.

use std::sync::Arc;

use crate::backend::reduce::ReduceOp;
use crate::error::{Error, Result};
use crate::tensor::layout::resolve_dim;
use crate::tensor::{Layout, Tensor};

/// Resolves and deduplicates a list of dims; an empty list means all dims.
pub(crate) fn reduce_dims(op: &'static str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let d = resolve_dim(op, d, rank)?;
        if out.contains(&d) {
            return Err(Error::arg(op, format!("dim {d} given twice in {dims:?}")));
        }
        out.push(d);
    }
    out.sort_unstable();
    Ok(out)
}

/// The output shape of a reduction over `dims` (kept as size 1 when `keepdim`).
pub(crate) fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &s)| {
            if dims.contains(&i) {
                keepdim.then_some(1)
            } else {
                Some(s)
            }
        })
        .collect()
}

/// Moves the reduced dims last and lays the tensor out contiguously, so that each output
/// element reduces one contiguous run of `inner` values. Returns (tensor, outer, inner).
pub(crate) fn reduction_layout(x: &Tensor, dims: &[usize]) -> Result<(Tensor, usize, usize)> {
    let keep: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = keep.iter().chain(dims).copied().collect();
    let inner: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let outer: usize = keep.iter().map(|&d| x.shape()[d]).product();
    let p = x.detach().permute(&perm)?;
    Ok((p, outer, inner))
}

impl Tensor {
    /// Sum over `dims` (all dims when empty); size-1 dims stay when `keepdim`.
    /// The output dtype is the input's; the sum is accumulated in F32 (F64 for F64).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.sum_or_mean(dims, keepdim, false)
    }

    /// Mean over `dims` (all dims when empty).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.sum_or_mean(dims, keepdim, true)
    }

    /// Sum of all elements, as a zero-dim tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// Mean of all elements, as a zero-dim tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    fn sum_or_mean(&self, dims: &[isize], keepdim: bool, mean: bool) -> Result<Tensor> {
        let op = if mean { "mean" } else { "sum" };
        if !self.dtype().is_float() {
            return Err(Error::dtype(op, self.dtype(), "expected a float tensor"));
        }
        if let Some(dt) = super::autocast::target(op, &[Some(self)]) {
            return super::autocast::cast(self, dt)?.sum_or_mean(dims, keepdim, mean);
        }
        let dims = reduce_dims(op, dims, self.rank())?;
        let out_shape = reduced_shape(self.shape(), &dims, keepdim);
        let keep_shape = reduced_shape(self.shape(), &dims, true);
        let (p, outer, inner) = reduction_layout(self, &dims)?;
        let in_shape = self.shape().to_vec();
        let rop = if mean { ReduceOp::Mean } else { ReduceOp::Sum };
        let out = p
            .storage()
            .reduce(p.layout(), outer, inner, rop, self.dtype())?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&out_shape),
            op,
            &[self],
            move |g| {
                // Each input element receives its output's gradient (times 1/n for mean).
                let g = g.reshape(&keep_shape)?.broadcast_to(&in_shape)?;
                let g = if mean {
                    g.mul_scalar(1.0 / inner as f64)?
                } else {
                    g.contiguous()?
                };
                Ok(vec![Some(g)])
            },
        ))
    }

    /// Sums this tensor down to `shape`, the inverse of broadcasting `shape` up to
    /// `self.shape()` (used by the backward of broadcasting ops).
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let rank = self.rank();
        if shape.len() > rank {
            return Err(Error::shape(
                "sum_to_shape",
                format!("cannot sum {:?} to {shape:?}", self.shape()),
            ));
        }
        let lead = rank - shape.len();
        let mut dims: Vec<isize> = (0..lead as isize).collect();
        for (i, &s) in shape.iter().enumerate() {
            let d = self.shape()[lead + i];
            if s == 1 && d != 1 {
                dims.push((lead + i) as isize);
            } else if s != d {
                return Err(Error::shape(
                    "sum_to_shape",
                    format!("cannot sum {:?} to {shape:?}", self.shape()),
                ));
            }
        }
        self.sum(&dims, true)?.reshape(shape)
    }
}
