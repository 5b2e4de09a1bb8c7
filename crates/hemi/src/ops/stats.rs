//! Reductions beyond sum and mean: max and min (values over dims, or values with their
//! indices along one dim), argmax/argmin, and var. Also `Rows`, the one-dim view that
//! softmax and the losses share with max_dim.
//!
//! Dtypes: max, min and var keep the input dtype (var is computed in F32 for half inputs
//! and rounded once); indices are I64. Integer inputs are rejected.
//!
//! NaN propagates: a row holding a NaN has max (and min) NaN, and max_dim/argmax point at
//! its first NaN, as PyTorch does.

use std::sync::Arc;

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

use super::elementwise::PAR_THRESHOLD;
use super::reduce::{reduce_dims, reduce_rows, reduced_shape, reduction_layout, sum_slice};
use crate::dtype::DType;
use crate::dtype::WithDType as _;
use crate::error::{Error, Result};
use crate::tensor::layout::resolve_dim;
use crate::tensor::{FloatDType, Tensor};

/// A row-major tensor seen as `[outer, len, inner]` around one dim: element `(o, k, i)` is
/// at `(o * len + k) * inner + i`, and row `r = o * inner + i` is the `len` elements along
/// the dim. Ops along one dim (softmax, the class dim of the losses, max_dim) work row by
/// row in this view without permuting the tensor; a row is a contiguous slice when
/// `inner == 1` (the common last-dim case) and is gathered into a buffer otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rows {
    pub outer: usize,
    pub len: usize,
    pub inner: usize,
}

impl Rows {
    /// The rows of a tensor of `shape` along `dim` (negative counts from the end). A
    /// zero-dim tensor is one row of one element, as PyTorch treats it for dim 0 or -1.
    pub(crate) fn along(op: &'static str, shape: &[usize], dim: isize) -> Result<(usize, Rows)> {
        if shape.is_empty() {
            resolve_dim(op, dim, 1)?;
            return Ok((
                0,
                Rows {
                    outer: 1,
                    len: 1,
                    inner: 1,
                },
            ));
        }
        let d = resolve_dim(op, dim, shape.len())?;
        let rows = Rows {
            outer: shape[..d].iter().product(),
            len: shape[d],
            inner: shape[d + 1..].iter().product(),
        };
        Ok((d, rows))
    }

    /// Number of rows.
    pub(crate) fn count(&self) -> usize {
        self.outer * self.inner
    }

    /// Index of element 0 of row `r` in the row-major values; element `k` is `inner`
    /// further on per step.
    pub(crate) fn start(&self, r: usize) -> usize {
        let (o, i) = (r / self.inner, r % self.inner);
        o * self.len * self.inner + i
    }

    /// `f(row)` for every row, in row order.
    pub(crate) fn reduce<C: FloatDType, R: Copy + Default + Send>(
        &self,
        x: &[C],
        f: impl Fn(&[C]) -> R + Sync,
    ) -> Vec<R> {
        let mut out = vec![R::default(); self.count()];
        if out.is_empty() {
            return out;
        }
        if self.len == 0 {
            out.iter_mut().for_each(|o| *o = f(&[]));
            return out;
        }
        let block = self.len * self.inner;
        let body = |ob: &mut [R], xb: &[C]| {
            if self.inner == 1 {
                ob[0] = f(xb);
                return;
            }
            let mut buf = vec![C::zero(); self.len];
            for (i, o) in ob.iter_mut().enumerate() {
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = xb[k * self.inner + i];
                }
                *o = f(&buf);
            }
        };
        if x.len() < PAR_THRESHOLD {
            out.chunks_mut(self.inner)
                .zip(x.chunks(block))
                .for_each(|(o, xb)| body(o, xb));
        } else {
            out.par_chunks_mut(self.inner)
                .zip(x.par_chunks(block))
                .for_each(|(o, xb)| body(o, xb));
        }
        out
    }

    /// `f(input rows, output row)` for every row: `K` inputs laid out like the tensor give
    /// one output laid out the same way.
    pub(crate) fn map<C: FloatDType, const K: usize>(
        &self,
        ins: [&[C]; K],
        f: impl Fn([&[C]; K], &mut [C]) + Sync,
    ) -> Vec<C> {
        let n = self.count() * self.len;
        debug_assert!(ins.iter().all(|x| x.len() == n));
        let mut out = vec![C::zero(); n];
        if n == 0 {
            return out;
        }
        let block = self.len * self.inner;
        let body = |b: usize, ob: &mut [C]| {
            let base = b * block;
            if self.inner == 1 {
                f(ins.map(|x| &x[base..base + block]), ob);
                return;
            }
            let mut bufs: [Vec<C>; K] = std::array::from_fn(|_| vec![C::zero(); self.len]);
            let mut row = vec![C::zero(); self.len];
            for i in 0..self.inner {
                for (buf, x) in bufs.iter_mut().zip(&ins) {
                    for (k, v) in buf.iter_mut().enumerate() {
                        *v = x[base + k * self.inner + i];
                    }
                }
                f(std::array::from_fn(|j| &bufs[j][..]), &mut row);
                for (k, &v) in row.iter().enumerate() {
                    ob[k * self.inner + i] = v;
                }
            }
        };
        if n < PAR_THRESHOLD {
            out.chunks_mut(block)
                .enumerate()
                .for_each(|(b, ob)| body(b, ob));
        } else {
            out.par_chunks_mut(block)
                .enumerate()
                .for_each(|(b, ob)| body(b, ob));
        }
        out
    }
}

/// Which extreme a reduction looks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Extreme {
    Max,
    Min,
}

impl Extreme {
    fn name(self) -> &'static str {
        match self {
            Extreme::Max => "max",
            Extreme::Min => "min",
        }
    }

    /// The extreme of a non-empty row and the first index where it occurs; a NaN wins over
    /// every number (the first NaN).
    fn find<C: FloatDType>(self, r: &[C]) -> (C, usize) {
        let (mut best, mut at) = (r[0], 0);
        for (k, &v) in r.iter().enumerate().skip(1) {
            if best.is_nan() {
                break;
            }
            let better = match self {
                Extreme::Max => v > best,
                Extreme::Min => v < best,
            };
            if better || v.is_nan() {
                (best, at) = (v, k);
            }
        }
        (best, at)
    }
}

/// The largest value of a row (NaN if any is NaN; -inf for an empty row), for softmax.
pub(crate) fn row_max<C: FloatDType>(r: &[C]) -> C {
    if r.is_empty() {
        return C::neg_infinity();
    }
    Extreme::Max.find(r).0
}

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

/// Builds a tensor of the original dim order from values laid out with `dims` moved last
/// (the layout `reduction_layout` gives), outside the graph.
fn unpermute<C: FloatDType>(
    values: Vec<C>,
    shape: &[usize],
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    let perm: Vec<usize> = (0..shape.len())
        .filter(|d| !dims.contains(d))
        .chain(dims.iter().copied())
        .collect();
    let perm_shape: Vec<usize> = perm.iter().map(|&d| shape[d]).collect();
    let mut inverse = vec![0; perm.len()];
    for (i, &d) in perm.iter().enumerate() {
        inverse[d] = i;
    }
    Tensor::from_values(values, &perm_shape, dtype)
        .permute(&inverse)?
        .contiguous()
}

/// Mean and sum of squared deviations of a row, in the compute type. The data are first
/// shifted by the row's first element, so the mean is found from small differences rather
/// than from a large running sum (1000 + noise in F32 keeps its noise); the second pass then
/// sums squared deviations from that mean, minus the corrected two-pass term
/// `(Σd)²/n` that cancels what is left of the mean's rounding error.
fn centered<C: FloatDType>(r: &[C]) -> (C, C) {
    if r.is_empty() {
        return (C::nan(), C::zero());
    }
    let n = C::from_f64(r.len() as f64);
    let shift = r[0];
    let mut lanes = [C::zero(); 8];
    for (k, &x) in r.iter().enumerate() {
        lanes[k % 8] += x - shift;
    }
    let mean = shift + sum_slice(&lanes) / n;
    let (mut s, mut ss) = ([C::zero(); 8], [C::zero(); 8]);
    for (k, &x) in r.iter().enumerate() {
        let d = x - mean;
        s[k % 8] += d;
        ss[k % 8] += d * d;
    }
    let s = sum_slice(&s);
    (mean, sum_slice(&ss) - s * s / n)
}

impl Tensor {
    /// Largest value over `dims` (all dims when empty), PyTorch's `amax`. NaN propagates.
    ///
    /// Gradient: like `amax`, the output's gradient is split evenly among the elements that
    /// equal the maximum (ties share it; a NaN maximum sends it to the NaN elements).
    /// For one max per row with a winner-takes-all gradient use `max_dim`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme(dims, keepdim, Extreme::Max)
    }

    /// Smallest value over `dims` (all dims when empty), PyTorch's `amin`; the gradient as
    /// for `max`.
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.extreme(dims, keepdim, Extreme::Min)
    }

    /// Largest value along `dim` and its index (I64; the first on ties, the first NaN if
    /// any), as `torch.max(x, dim)`. The gradient goes to the indexed element.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim("max_dim", dim, keepdim, Extreme::Max)
    }

    /// Smallest value along `dim` and its index, as `torch.min(x, dim)`.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim("min_dim", dim, keepdim, Extreme::Min)
    }

    /// Index (I64) of the largest value along `dim`, the first on ties.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self
            .detach()
            .extreme_dim("argmax", dim, keepdim, Extreme::Max)?
            .1)
    }

    /// Index (I64) of the smallest value along `dim`, the first on ties.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self
            .detach()
            .extreme_dim("argmin", dim, keepdim, Extreme::Min)?
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
        let divisor = inner.saturating_sub(correction) as f64;
        let in_shape = self.shape().to_vec();
        let dtype = self.dtype();
        let x = self.detach();
        crate::with_compute!(dtype, C => {
            let out = p.with_values::<C, _>(|v| {
                reduce_rows(v, outer, inner, |r| centered(r).1 / C::from_f64(divisor))
            });
            Ok(Tensor::from_compute(out, &out_shape, dtype, op, &[self], move |g| {
                // d var / d x_i = 2 (x_i - mean) / divisor (the mean's own dependence on
                // x_i sums to zero), computed with the reduced dims last, then put back.
                let gv = g.values::<C>();
                let (p, _, _) = reduction_layout(&x, &dims)?;
                let xv = p.values::<C>();
                let two = C::from_f64(2.0) / C::from_f64(divisor);
                let mut gi = vec![C::zero(); xv.len()];
                if inner > 0 {
                    gi.chunks_mut(inner).zip(xv.chunks(inner)).zip(&gv).for_each(|((o, r), &g)| {
                        let mean = centered(r).0;
                        for (o, &x) in o.iter_mut().zip(r) {
                            *o = g * two * (x - mean);
                        }
                    });
                }
                Ok(vec![Some(unpermute(gi, &in_shape, &dims, g.dtype())?)])
            }))
        })
    }

    fn extreme(&self, dims: &[isize], keepdim: bool, ext: Extreme) -> Result<Tensor> {
        let op = ext.name();
        require_float(op, self)?;
        let dims = reduce_dims(op, dims, self.rank())?;
        let out_shape = reduced_shape(self.shape(), &dims, keepdim);
        let keep_shape = reduced_shape(self.shape(), &dims, true);
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
        let in_shape = self.shape().to_vec();
        let dtype = self.dtype();
        let x = self.detach();
        crate::with_compute!(dtype, C => {
            let out = p.with_values::<C, _>(|v| reduce_rows(v, outer, inner, |r| ext.find(r).0));
            let storage = Arc::new(crate::tensor::Storage::from(crate::tensor::CpuStorage::store::<C>(out, dtype)));
            let layout = crate::tensor::Layout::contiguous(&out_shape);
            // The backward keeps the output values through a detached handle on its storage
            // (not the output tensor itself, which would own its own node).
            let m = Tensor::from_storage(storage.clone(), layout.clone());
            let sum_dims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
            Ok(Tensor::from_op(storage, layout, op, &[self], move |g| {
                crate::with_compute!(g.dtype(), D => {
                    let expand = |t: &Tensor| -> Result<Vec<D>> {
                        Ok(t.reshape(&keep_shape)?.broadcast_to(&in_shape)?.values::<D>())
                    };
                    let (xv, mv, gv) = (x.values::<D>(), expand(&m)?, expand(g)?);
                    // Both are exact values of the input dtype, so `==` finds the winners.
                    let hit: Vec<D> = xv.iter().zip(&mv).map(|(&x, &m)| {
                        if x == m || (x.is_nan() && m.is_nan()) { D::one() } else { D::zero() }
                    }).collect();
                    let ties = Tensor::from_values(hit.clone(), &in_shape, D::DTYPE).sum(&sum_dims, true)?;
                    let tv = expand(&ties)?;
                    let gi: Vec<D> = (0..xv.len()).map(|i| {
                        if hit[i] == D::one() { gv[i] / tv[i] } else { D::zero() }
                    }).collect();
                    Ok(vec![Some(Tensor::from_values(gi, &in_shape, g.dtype()))])
                })
            }))
        })
    }

    fn extreme_dim(
        &self,
        op: &'static str,
        dim: isize,
        keepdim: bool,
        ext: Extreme,
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
        let in_shape = self.shape().to_vec();
        let dtype = self.dtype();
        crate::with_compute!(dtype, C => {
            let found: Vec<(C, usize)> = self.with_values::<C, _>(|v| rows.reduce(v, |r| ext.find(r)));
            let index: Vec<i64> = found.iter().map(|&(_, k)| k as i64).collect();
            let values: Vec<C> = found.iter().map(|&(v, _)| v).collect();
            let at: Arc<Vec<usize>> = Arc::new(found.iter().map(|&(_, k)| k).collect());
            let values = Tensor::from_compute(values, &out_shape, dtype, op, &[self], move |g| {
                // The whole gradient goes to the element each output came from.
                crate::with_compute!(g.dtype(), D => {
                    let gv = g.values::<D>();
                    let mut gi = vec![D::zero(); in_shape.iter().product()];
                    for (r, (&k, &g)) in at.iter().zip(&gv).enumerate() {
                        gi[rows.start(r) + k * rows.inner] = g;
                    }
                    Ok(vec![Some(Tensor::from_values(gi, &in_shape, g.dtype()))])
                })
            });
            Ok((values, Tensor::from_vec(index, &out_shape)?))
        })
    }
}
