//! Embedding lookup, index_select, concat and stack.
//!
//! The forwards copy elements in their storage dtype (exact for every dtype, I64 included);
//! the backwards of the lookups scatter-add the output gradient into zeros in the compute
//! type (F32 for half dtypes, so repeated indices accumulate in F32) and round once.

use std::borrow::Cow;
use std::sync::Arc;

use half::{bf16, f16};
#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use super::elementwise::promote_all;
use crate::dtype::{DType, WithDType};
use crate::error::{Error, Result};
use crate::tensor::layout::resolve_dim;
use crate::tensor::{CpuStorage, Layout, Storage, Tensor};

/// Runs `$body` with `$T` bound to the storage element type of `$dtype`.
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}

/// The elements `layout` addresses in `s`, row-major: borrowed when contiguous (an
/// embedding table is not copied per lookup).
fn elems<'a, T: WithDType>(s: &'a CpuStorage, layout: &Layout) -> Cow<'a, [T]> {
    s.elems(layout)
        .expect("storage dtype checked by the caller")
}

/// Validated indices from an I64 tensor: each in `0..size`, else `Error::Index`.
fn indices(op: &'static str, index: &Tensor, size: usize) -> Result<Vec<usize>> {
    if index.dtype() != DType::I64 {
        return Err(Error::dtype(
            op,
            index.dtype(),
            format!("indices must be I64, got shape {:?}", index.shape()),
        ));
    }
    index
        .to_vec_i64()
        .into_iter()
        .map(|i| {
            if i < 0 || i as u64 >= size as u64 {
                Err(Error::Index { op, index: i, size })
            } else {
                Ok(i as usize)
            }
        })
        .collect()
}

/// `out[o, j, :] = x[o, idx[j], :]` with `x` seen as `[outer, size, inner]` around dim
/// `dim`; the output has `out_shape` (`outer * idx.len() * inner` elements). The backward
/// adds each `g[o, j, :]` into row `idx[j]` of a zero gradient.
fn gather_along(
    op: &'static str,
    x: &Tensor,
    dim: usize,
    idx: Vec<usize>,
    out_shape: Vec<usize>,
) -> Tensor {
    let shape = x.shape().to_vec();
    let outer: usize = shape[..dim].iter().product();
    let size = shape[dim];
    let inner: usize = shape[dim + 1..].iter().product();
    let storage = x.storage();
    let out = with_elem!(x.dtype(), T => {
        let src = elems::<T>(storage.as_cpu(), x.layout());
        let mut out = Vec::with_capacity(outer * idx.len() * inner);
        for o in 0..outer {
            for &i in &idx {
                out.extend_from_slice(&src[(o * size + i) * inner..][..inner]);
            }
        }
        CpuStorage::from_vec(out)
    });
    let dtype = x.dtype();
    let idx = Arc::new(idx);
    Tensor::from_op(
        Arc::new(out.into()),
        Layout::contiguous(&out_shape),
        op,
        &[x],
        move |g| {
            crate::with_compute!(g.dtype(), C => {
                let gv = g.values::<C>();
                let mut acc = vec![C::zero(); outer * size * inner];
                let k = idx.len();
                for o in 0..outer {
                    for (j, &i) in idx.iter().enumerate() {
                        let dst = &mut acc[(o * size + i) * inner..][..inner];
                        let src = &gv[(o * k + j) * inner..][..inner];
                        dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
                    }
                }
                Ok(vec![Some(Tensor::from_values(acc, &shape, dtype))])
            })
        },
    )
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
        let idx = indices(OP, ids, v)?;
        let mut out_shape = ids.shape().to_vec();
        out_shape.push(d);
        Ok(gather_along(OP, weight, 0, idx, out_shape))
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
        let idx = indices(OP, index, self.shape()[d])?;
        let mut out_shape = self.shape().to_vec();
        out_shape[d] = idx.len();
        Ok(gather_along(OP, self, d, idx, out_shape))
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
        let out = with_elem!(dtype, T => {
            let srcs: Vec<Cow<[T]>> = parts.iter().map(|(s, l)| elems::<T>(s.as_cpu(), l)).collect();
            let mut out = Vec::with_capacity(outer * total * inner);
            for o in 0..outer {
                for (src, &len) in srcs.iter().zip(&lens) {
                    out.extend_from_slice(&src[o * len * inner..][..len * inner]);
                }
            }
            CpuStorage::from_vec(out)
        });
        Ok(Tensor::from_op(
            Arc::new(out.into()),
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
