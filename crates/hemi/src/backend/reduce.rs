//! Reductions: sums, means, extrema and their indices, variances, softmax rows; every
//! sum accumulated in at least F32.
//!
//! Two views of the input recur. A reduction over several dims takes a layout that
//! addresses the elements with the reduced dims moved last (a permuted view, no copy), so
//! that output element `o` reduces the `inner` consecutive elements `o*inner..(o+1)*inner`
//! of its row-major order. An op along one dim (softmax, max_dim, the class dim of the
//! losses) takes `Rows`, the row-major tensor seen as `[outer, len, inner]`.

use super::declare::primitives;
use super::map::MapOps;
use super::nn::View;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::layout::resolve_dim;
use crate::tensor::Layout;

/// A row-major tensor seen as `[outer, len, inner]` around one dim: element `(o, k, i)` is
/// at `(o * len + k) * inner + i`, and row `r = o * inner + i` is the `len` elements along
/// the dim. Ops along one dim work row by row in this view without permuting the tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    /// Product of the dims before the one operated along.
    pub outer: usize,
    /// Size of the dim operated along: the length of each row.
    pub len: usize,
    /// Product of the dims after it: the distance between consecutive elements of a row.
    pub inner: usize,
}

impl Rows {
    /// The rows of a tensor of `shape` along `dim` (negative counts from the end), with the
    /// resolved dim. A zero-dim tensor is one row of one element, as PyTorch treats it for
    /// dim 0 or -1.
    pub fn along(op: &'static str, shape: &[usize], dim: isize) -> Result<(usize, Rows)> {
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
    pub fn count(&self) -> usize {
        self.outer * self.inner
    }

    /// Index of element 0 of row `r` in the row-major values; element `k` is `inner`
    /// further on per step.
    pub fn start(&self, r: usize) -> usize {
        let (o, i) = (r / self.inner, r % self.inner);
        o * self.len * self.inner + i
    }
}

/// What a reduction computes over each run of elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum (eight lanes, then a fixed pairwise combination).
    Sum,
    /// The sum times `1 / n` (NaN for an empty run).
    Mean,
    /// The largest value; NaN if any is NaN.
    Max,
    /// The smallest value; NaN if any is NaN.
    Min,
    /// `Σ(x - mean)² / max(0, n - correction)` by a shifted, corrected two-pass algorithm.
    Var {
        /// Subtracted from the count in the divisor: 0 for the population (biased)
        /// variance, 1 for Bessel's unbiased one (PyTorch's `correction=`).
        correction: usize,
    },
}

impl ReduceOp {
    /// The op's name (`"sum"`, `"mean"`, `"max"`, `"min"`, `"var"`), used in errors.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Var { .. } => "var",
        }
    }
}

primitives! {
    /// The reduction primitives a backend implements: sums, means, extrema and their indices,
    /// variances and softmax rows, each accumulated in at least F32. `Storage` has a
    /// dispatching method of the same name for each.
    pub trait ReduceOps: MapOps {
        /// `out[o] = op(x[o*inner .. (o+1)*inner])` for `o < outer`, where `x` is the row-major
        /// order of the elements `layout` addresses (the reduced dims last). Computed in the
        /// compute type of `out` (F32, F64 for F64), rounded once into `out`. The caller checked
        /// that the input is a float tensor, and for `Max`/`Min` that `inner > 0` (or
        /// `outer == 0`).
        fn reduce(
            &self,
            layout: &Layout,
            outer: usize,
            inner: usize,
            op: ReduceOp,
            out: DType,
        ) -> Result<Self>;

        /// The gradient of `reduce` with `Max`/`Min` (`amax`/`amin`), `self = x` in the layout
        /// `reduce` read: the output gradient `g[o]` split evenly among the elements of run `o`
        /// equal to its extreme `m[o]` (NaN matching NaN), 0 elsewhere. `m` and `g` hold `outer`
        /// elements each (`runs` is `(outer, inner)`). Contiguous in the order of `layout` (reduced dims last), in `out`.
        fn extreme_backward(
            &self,
            layout: &Layout,
            m: View<'_, Self>,
            g: View<'_, Self>,
            runs: (usize, usize),
            out: DType,
        ) -> Result<Self>;

        /// The gradient of `reduce` with `Var { correction }`, `self = x` in the layout `reduce`
        /// read: `g[o] · 2 (x - mean_o) / max(0, inner - correction)`. `g` holds `outer`
        /// elements. Contiguous in the order of `layout` (reduced dims last), in `out`.
        fn var_backward(
            &self,
            layout: &Layout,
            g: View<'_, Self>,
            runs: (usize, usize),
            correction: usize,
            out: DType,
        ) -> Result<Self> {
            super::compose::var_backward(self, layout, g, runs, correction, out)
        }

        /// The extreme (`op` is `Max` or `Min`, checked by the caller) of each row of `rows` and
        /// its index along the row, the first on ties and the first NaN if any: values in `out`
        /// (computed in its compute type), indices I64, both `rows.count()` long. The caller
        /// checked `rows.len > 0` (or no rows).
        fn extreme_dim(
            &self,
            layout: &Layout,
            rows: Rows,
            op: ReduceOp,
            out: DType,
        ) -> Result<(Self, Self)>;

        /// The gradient of `extreme_dim` with `self = g` (`rows.count()` elements): zeros of
        /// the input's shape (`rows`) with `g[r]` at element `index[r]` of row `r`. `index`
        /// (I64) is what `extreme_dim` returned. Contiguous, in `out`.
        fn extreme_dim_backward(
            &self,
            lg: &Layout,
            index: &Self,
            li: &Layout,
            rows: Rows,
            out: DType,
        ) -> Result<Self>;

        /// Softmax (`log`: log-softmax) of each row of `rows`, with the row max subtracted,
        /// computed in the compute type of `out` and contiguous in `out`.
        fn softmax(&self, layout: &Layout, rows: Rows, log: bool, out: DType) -> Result<Self> {
            super::compose::softmax(self, layout, rows, log, out)
        }

        /// The gradient of `softmax` with `self = g` and `y` its output:
        /// `y ⊙ (g - Σ g⊙y)`, or `g - exp(y) · Σ g` for log-softmax, row by row; contiguous in
        /// `out`.
        fn softmax_backward(
            &self,
            lg: &Layout,
            y: &Self,
            ly: &Layout,
            rows: Rows,
            log: bool,
            out: DType,
        ) -> Result<Self> {
            super::compose::softmax_backward(self, lg, y, ly, rows, log, out)
        }
    }
}
