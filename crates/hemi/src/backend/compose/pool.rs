//! Average pools as products: a window sum over a plane is separable, `Σ_{h∈H(oh)} Σ_{w∈W(ow)}
//! x[h, w] = (R · X · Cᵀ)[oh, ow]` with `R[oh, h] = 1` for the rows of window `oh` and `C`
//! likewise for the columns, so the pools are two `matmul`s (the planes a broadcast batch) and
//! one division by the per-window divisor; their backward is the transposed products. The
//! 0/1 matrices multiply exactly, so each output is a sum of its window's values (rows
//! first, then columns, where the CPU's loop sums row-major) divided once, as the CPU's.

use super::row_major;
use crate::backend::map::{BinaryOp, MapOps};
use crate::backend::nn::{AdaptivePool2dGeom, NnOps, Pool2dGeom};
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Layout;

/// The windows of one axis: `(start, end)` clipped to the input, and the divisor factor.
struct Axis {
    windows: Vec<(usize, usize)>,
    size: usize,
}

impl Axis {
    /// The 0/1 matrix `[windows, size]`, row `o` one over window `o`.
    fn matrix(&self) -> Vec<f64> {
        let mut m = vec![0.0; self.windows.len() * self.size];
        for (o, &(s, e)) in self.windows.iter().enumerate() {
            m[o * self.size + s..o * self.size + e].fill(1.0);
        }
        m
    }
}

/// The rows (or columns) of a windowed pool: window `o` is `[o·s - p, o·s - p + k)` clipped
/// to `[0, size)`; `padded[o]` is its length clipped to the padded extent instead (PyTorch's
/// divisor with `count_include_pad`).
fn pool_axis(out: usize, s: usize, p: usize, k: usize, size: usize) -> (Axis, Vec<usize>) {
    let mut padded = Vec::with_capacity(out);
    let windows = (0..out)
        .map(|o| {
            let start = o * s;
            padded.push((start + k).min(size + 2 * p) - start);
            (
                start.saturating_sub(p).min(size),
                (start + k).saturating_sub(p).min(size),
            )
        })
        .collect();
    (Axis { windows, size }, padded)
}

/// PyTorch's adaptive windows `[floor(o·size/out), ceil((o+1)·size/out))`.
fn adaptive_axis(out: usize, size: usize) -> Axis {
    Axis {
        windows: (0..out)
            .map(|o| (o * size / out, ((o + 1) * size).div_ceil(out)))
            .collect(),
        size,
    }
}

/// A separable pool: the two axes and the `[h_out, w_out]` divisors.
struct Separable {
    planes: usize,
    rows: Axis,
    cols: Axis,
    divisor: Vec<f64>,
}

impl Separable {
    fn avg(g: &Pool2dGeom, count_include_pad: bool) -> Separable {
        let (rows, ph) = pool_axis(g.h_out, g.stride.0, g.padding.0, g.kernel.0, g.h);
        let (cols, pw) = pool_axis(g.w_out, g.stride.1, g.padding.1, g.kernel.1, g.w);
        let mut divisor = Vec::with_capacity(g.out_plane());
        for (oh, &(hs, he)) in rows.windows.iter().enumerate() {
            for (ow, &(ws, we)) in cols.windows.iter().enumerate() {
                let d = if count_include_pad {
                    ph[oh] * pw[ow]
                } else {
                    (he - hs) * (we - ws)
                };
                divisor.push(d as f64);
            }
        }
        Separable {
            planes: g.planes,
            rows,
            cols,
            divisor,
        }
    }

    fn adaptive(g: &AdaptivePool2dGeom) -> Separable {
        let rows = adaptive_axis(g.h_out, g.h);
        let cols = adaptive_axis(g.w_out, g.w);
        let divisor = rows
            .windows
            .iter()
            .flat_map(|&(hs, he)| {
                cols.windows
                    .iter()
                    .map(move |&(ws, we)| ((he - hs) * (we - ws)) as f64)
            })
            .collect();
        Separable {
            planes: g.planes,
            rows,
            cols,
            divisor,
        }
    }

    fn h_out(&self) -> usize {
        self.rows.windows.len()
    }
    fn w_out(&self) -> usize {
        self.cols.windows.len()
    }

    /// `R`, `C` and the divisors on `like`'s device, in the compute type `c`.
    fn upload<B: BackendStorage>(&self, like: &B, c: DType) -> Result<(B, B, B)> {
        let up = |v: Vec<f64>| like.upload(&CpuStorage::from_f64(v, c));
        Ok((
            up(self.rows.matrix())?,
            up(self.cols.matrix())?,
            up(self.divisor.clone())?,
        ))
    }

    /// The divisors `[h_out, w_out]` broadcast over the planes.
    fn per_plane(&self) -> Layout {
        Layout::new(
            vec![self.planes, self.h_out(), self.w_out()],
            vec![0, self.w_out(), 1],
            0,
        )
    }

    /// `(R · X · Cᵀ) / divisor` over the planes of `x` (read through `l`), rounded into `out`.
    fn forward<B: NnOps + MapOps>(&self, x: &B, l: &Layout, out: DType) -> Result<B> {
        let c = out.compute_type();
        let (r, cm, div) = self.upload(x, c)?;
        let (h, w) = (self.rows.size, self.cols.size);
        let (ho, wo, n) = (self.h_out(), self.w_out(), self.planes);
        let mut copy = None;
        let (x, off) = row_major(x, l, &mut copy)?;
        let lx = Layout::new(vec![n, h, w], vec![h * w, w, 1], off);
        // R [ho, h] broadcast over the planes, times each plane: [n, ho, w].
        let lr = Layout::new(vec![n, ho, h], vec![0, h, 1], 0);
        let rows = r.matmul(&lr, x, &lx, None, c)?;
        // Times Cᵀ ([w, wo], C read transposed): [n, ho, wo].
        let lrows = Layout::contiguous(&[n, ho, w]);
        let lct = Layout::new(vec![n, w, wo], vec![0, 1, w], 0);
        let sums = rows.matmul(&lrows, &cm, &lct, None, c)?;
        sums.binary(
            &Layout::contiguous(&[n, ho, wo]),
            &div,
            &self.per_plane(),
            BinaryOp::Div,
            out,
        )
    }

    /// `Rᵀ · (dy / divisor) · C`: each output gradient spread evenly over its window, in `out`.
    fn backward<B: NnOps + MapOps>(&self, dy: &B, ldy: &Layout, out: DType) -> Result<B> {
        let c = out.compute_type();
        let (r, cm, div) = self.upload(dy, c)?;
        let (h, w) = (self.rows.size, self.cols.size);
        let (ho, wo, n) = (self.h_out(), self.w_out(), self.planes);
        let mut copy = None;
        let (dy, off) = row_major(dy, ldy, &mut copy)?;
        let ldy = Layout::new(vec![n, ho, wo], vec![ho * wo, wo, 1], off);
        let spread = dy.binary(&ldy, &div, &self.per_plane(), BinaryOp::Div, c)?;
        // Rᵀ ([h, ho], R read transposed) times each plane: [n, h, wo].
        let lrt = Layout::new(vec![n, h, ho], vec![0, 1, h], 0);
        let rows = r.matmul(&lrt, &spread, &Layout::contiguous(&[n, ho, wo]), None, c)?;
        // Times C ([wo, w]): [n, h, w].
        let lc = Layout::new(vec![n, wo, w], vec![0, w, 1], 0);
        rows.matmul(&Layout::contiguous(&[n, h, wo]), &cm, &lc, None, out)
    }
}

/// `avg_pool2d` as two products and a division (module doc), in `x`'s dtype.
pub fn avg_pool2d<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: &Pool2dGeom,
    count_include_pad: bool,
) -> Result<B> {
    Separable::avg(g, count_include_pad).forward(x, l, x.dtype())
}

/// The gradient of `avg_pool2d`: the transposed products, in `out`.
pub fn avg_pool2d_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    g: &Pool2dGeom,
    count_include_pad: bool,
    out: DType,
) -> Result<B> {
    Separable::avg(g, count_include_pad).backward(dy, ldy, out)
}

/// `adaptive_avg_pool2d` as two products and a division, in `x`'s dtype.
pub fn adaptive_avg_pool2d<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: &AdaptivePool2dGeom,
) -> Result<B> {
    Separable::adaptive(g).forward(x, l, x.dtype())
}

/// The gradient of `adaptive_avg_pool2d`: the transposed products, in `out`.
pub fn adaptive_avg_pool2d_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    g: &AdaptivePool2dGeom,
    out: DType,
) -> Result<B> {
    Separable::adaptive(g).backward(dy, ldy, out)
}
