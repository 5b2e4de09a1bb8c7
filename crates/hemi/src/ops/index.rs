//! Embedding lookup, index_select, concat and stack.
//!
//! The forwards copy elements in their storage dtype (exact for every dtype, I64 included);
//! the backwards of the lookups scatter-add the output gradient into zeros in the compute
//! type (F32 for half dtypes, so repeated indices accumulate in F32) and round once.

use std::sync::Arc;

use super::elementwise::promote_all;
use crate::backend::index::AlongDim;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::layout::resolve_dim;
use crate::tensor::{Layout, Storage, Tensor};

/// Checks an index tensor: I64, each entry in `0..size`, else `Error::Index`.
fn check_indices(op: &'static str, index: &Tensor, size: usize) -> Result<()> {
    if index.dtype() != DType::I64 {
        return Err(Error::dtype(
            op,
            index.dtype(),
            format!("indices must be I64, got shape {:?}", index.shape()),
        ));
    }
    match index
        .try_to_vec_i64()?
        .into_iter()
        .find(|&i| i < 0 || i as u64 >= size as u64)
    {
        Some(i) => Err(Error::Index { op, index: i, size }),
        None => Ok(()),
    }
}

/// `out[o, j, :] = x[o, idx[j], :]` with `x` seen as `[outer, size, inner]` around dim
/// `dim`; the output has `out_shape` (`outer * idx.len() * inner` elements). The backward
/// adds each `g[o, j, :]` into row `idx[j]` of a zero gradient.
fn gather_along(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    ids: &Tensor,
    out_shape: Vec<usize>,
) -> Result<Tensor> {
    let shape = x.shape().to_vec();
    let d = AlongDim {
        outer: shape[..dim].iter().product(),
        size: shape[dim],
        inner: shape[dim + 1..].iter().product(),
    };
    let out = x
        .storage()
        .index_select(x.layout(), &ids.storage(), ids.layout(), d)?;
    let dtype = x.dtype();
    let ids = ids.detach();
    Ok(Tensor::from_op(
        Arc::new(out),
        Layout::contiguous(&out_shape),
        op,
        &[x],
        move |g| {
            let gx =
                g.storage()
                    .index_add_zeros(g.layout(), &ids.storage(), ids.layout(), d, dtype)?;
            Ok(vec![Some(Tensor::from_storage(
                Arc::new(gx),
                Layout::contiguous(&shape),
            ))])
        },
    ))
}

/// Embedding lookup: row `ids[...]` of `weight` `[V, D]` for every id, giving
/// `[*ids.shape, D]` in `weight`'s dtype. `ids` is I64 of any shape; an id outside `0..V`
/// is `Error::Index`. The backward scatter-adds into `weight`'s gradient (repeated ids
/// accumulate).
pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    Tensor::embedding(weight, ids)
}

impl Tensor {
    /// See [`embedding`].
    pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        const OP: &str = "embedding";
        if weight.rank() != 2 {
            return Err(Error::shape(
                OP,
                format!(
                    "weight must be [num_embeddings, dim], got {:?} (ids {:?})",
                    weight.shape(),
                    ids.shape()
                ),
            ));
        }
        let (v, d) = (weight.shape()[0], weight.shape()[1]);
        check_indices(OP, ids, v)?;
        let mut out_shape = ids.shape().to_vec();
        out_shape.push(d);
        gather_along(OP, weight, 0, ids, out_shape)
    }

    /// Entries `index[j]` of `self` along `dim` (`torch.index_select`): the output has
    /// `self`'s shape with dim `dim` of size `index.len()`. `index` is a 1-D I64 tensor;
    /// repeated indices are allowed and their gradients add up (index-add backward).
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_select";
        let d = resolve_dim(OP, dim, self.rank())?;
        if index.rank() != 1 {
            return Err(Error::shape(
                OP,
                format!(
                    "index must be 1-D, got {:?} (input {:?})",
                    index.shape(),
                    self.shape()
                ),
            ));
        }
        check_indices(OP, index, self.shape()[d])?;
        let mut out_shape = self.shape().to_vec();
        out_shape[d] = index.numel();
        gather_along(OP, self, d, index, out_shape)
    }

    /// Concatenation along `dim` (`torch.cat`): all tensors have the same rank (at least 1)
    /// and the same sizes except along `dim`. Mixed dtypes promote as elementwise ops do
    /// (the wider float; F16 with BF16 gives F32; a float with I64 gives the float); each
    /// input's gradient is the matching narrow of the output's gradient.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        const OP: &str = "cat";
        let Some(first) = tensors.first() else {
            return Err(Error::arg(OP, "needs at least one tensor"));
        };
        let shapes = || {
            tensors
                .iter()
                .map(|t| format!("{:?}", t.shape()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if first.rank() == 0 {
            return Err(Error::shape(
                OP,
                format!("zero-dim tensors cannot be concatenated: {}", shapes()),
            ));
        }
        let d = resolve_dim(OP, dim, first.rank())?;
        let base = first.shape();
        for t in tensors {
            let fits = t.rank() == base.len()
                && t.shape()
                    .iter()
                    .zip(base)
                    .enumerate()
                    .all(|(i, (a, b))| i == d || a == b);
            if !fits {
                return Err(Error::shape(
                    OP,
                    format!("sizes must match except in dim {d}: {}", shapes()),
                ));
            }
        }
        let dtype = promote_all(tensors);
        let lens: Vec<usize> = tensors.iter().map(|t| t.shape()[d]).collect();
        let total: usize = lens.iter().sum();
        let outer: usize = base[..d].iter().product();
        let inner: usize = base[d + 1..].iter().product();
        let mut out_shape = base.to_vec();
        out_shape[d] = total;
        // Each input in the output dtype (a cast only where the dtypes differ).
        let parts: Vec<(Arc<Storage>, Layout)> = tensors
            .iter()
            .map(|t| {
                Ok(if t.dtype() == dtype {
                    (t.storage(), t.layout().clone())
                } else {
                    (
                        Arc::new(t.storage().cast(t.layout(), dtype)?),
                        Layout::contiguous(t.shape()),
                    )
                })
            })
            .collect::<Result<_>>()?;
        let refs: Vec<(&Storage, &Layout)> = parts.iter().map(|(s, l)| (&**s, l)).collect();
        let out = Storage::cat(&refs, outer, &lens, inner)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&out_shape),
            OP,
            tensors,
            move |g| {
                let mut start = 0;
                let mut grads = Vec::with_capacity(lens.len());
                for &len in &lens {
                    grads.push(Some(g.narrow(d as isize, start, len)?));
                    start += len;
                }
                Ok(grads)
            },
        ))
    }

    /// Stacks tensors of one shape along a new dim `dim` (`0..=rank`, negative counts from
    /// the end), as `torch.stack`: each is unsqueezed at `dim`, then all are concatenated.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        const OP: &str = "stack";
        let Some(first) = tensors.first() else {
            return Err(Error::arg(OP, "needs at least one tensor"));
        };
        if tensors.iter().any(|t| t.shape() != first.shape()) {
            let shapes: Vec<String> = tensors.iter().map(|t| format!("{:?}", t.shape())).collect();
            return Err(Error::shape(
                OP,
                format!("all tensors must have one shape, got {}", shapes.join(", ")),
            ));
        }
        let d = resolve_dim(OP, dim, first.rank() + 1)?;
        let expanded = tensors
            .iter()
            .map(|t| t.unsqueeze(d as isize))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = expanded.iter().collect();
        Tensor::cat(&refs, d as isize)
    }
}
