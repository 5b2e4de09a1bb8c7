//! 2-D convolution kernels over plain buffers: im2col / col2im and the im2col + GEMM
//! forward and backward (input, weight) of a grouped, strided, padded, dilated convolution,
//! parallel over the batch. No autograd and no validation here: `ops/conv.rs` checks the
//! shapes and hands over contiguous buffers (F32/F64, or F16/BF16 multiplied as stored).
//!
//! Layout: input `[n, c_in, h, w]`, weight `[c_out, c_in/groups, kh, kw]`, output
//! `[n, c_out, h_out, w_out]`, all row-major contiguous. Per image, the column matrix is
//! `[c_in*kh*kw, h_out*w_out]`; group `g` owns rows `g*K..(g+1)*K` (K = c_in/groups*kh*kw),
//! so each group's product is one GEMM on contiguous row blocks:
//! `y_g [c_out/groups, L] = w_g [c_out/groups, K] x col_g [K, L]`.

use rayon::prelude::*;

use half::{bf16, f16};
use num_traits::Zero;

use crate::cpu::chunked::{per_block_with, Src};
use crate::cpu::gemm::{matmul_into_par, MatRef};
use crate::cpu::gemm_half::{self, Operand};
use crate::cpu::runs::{add_in_order, Runs};
use crate::dtype::DType;
use crate::tensor::{CpuStorage, FloatDType};

/// Output size of one spatial dim (PyTorch's formula), or `None` when the dilated kernel
/// does not fit in the padded input.
pub fn conv_out_size(
    size: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let span = dilation * (kernel - 1) + 1;
    let padded = size + 2 * padding;
    (padded >= span).then(|| (padded - span) / stride + 1)
}

/// Shape of a 2-D convolution (validated by the caller: sizes fit, groups divide channels,
/// strides and dilations positive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dGeom {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    pub h_out: usize,
    pub w_out: usize,
}

impl Conv2dGeom {
    /// Output pixels per channel (the GEMM's N).
    pub fn l(&self) -> usize {
        self.h_out * self.w_out
    }
    /// Reduction length of one output element (the GEMM's K): c_in/groups * kh * kw.
    pub fn k(&self) -> usize {
        self.c_in / self.groups * self.kh * self.kw
    }
    /// Output channels per group (the GEMM's M).
    pub fn c_out_g(&self) -> usize {
        self.c_out / self.groups
    }
    pub fn in_image(&self) -> usize {
        self.c_in * self.h * self.w
    }
    pub fn out_image(&self) -> usize {
        self.c_out * self.l()
    }
    pub fn col_len(&self) -> usize {
        self.c_in * self.kh * self.kw * self.l()
    }
    pub fn weight_len(&self) -> usize {
        self.c_out * self.k()
    }
    pub fn out_shape(&self) -> [usize; 4] {
        [self.n, self.c_out, self.h_out, self.w_out]
    }
    /// A 1x1 kernel with unit stride and no padding: the column matrix is the image itself,
    /// so im2col and col2im are skipped.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == (1, 1) && self.padding == (0, 0)
    }
}

/// The outputs `o` in `[0, out)` whose input coordinate `o*stride + off` lies in `[0, size)`,
/// as a half-open range (so the copy loops need no bounds tests).
fn valid_range(out: usize, size: usize, stride: usize, off: isize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
    let room = size as isize - off;
    let hi = if room <= 0 { 0 } else { (room + s - 1) / s };
    let hi = (hi as usize).min(out);
    ((lo as usize).min(hi), hi)
}

/// Calls `f(row, c, off_h, off_w)` for each row (c, ki, kj) of the column matrix: output
/// pixel (oh, ow) of that row reads input pixel (oh*sh + off_h, ow*sw + off_w) of plane c.
#[inline]
fn for_each_col_row(g: &Conv2dGeom, mut f: impl FnMut(usize, usize, isize, isize)) {
    let (ph, pw) = (g.padding.0 as isize, g.padding.1 as isize);
    for c in 0..g.c_in {
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = (c * g.kh + ki) * g.kw + kj;
                let off_h = (ki * g.dilation.0) as isize - ph;
                let off_w = (kj * g.dilation.1) as isize - pw;
                f(row, c, off_h, off_w);
            }
        }
    }
}

/// Unfolds one image `x [c_in, h, w]` into `col [c_in*kh*kw, h_out*w_out]` (zeros where the
/// window reads padding).
pub fn im2col<C: Copy + Default>(x: &[C], col: &mut [C], g: &Conv2dGeom) {
    im2col_ld(x, col, g.l(), g)
}

/// `im2col` into the first `h_out*w_out` columns of a matrix with row stride `ld` (several
/// images side by side: image `i`'s columns start at `col[i * L..]`).
pub fn im2col_ld<C: Copy + Default>(x: &[C], col: &mut [C], ld: usize, g: &Conv2dGeom) {
    let (l, wo, (sh, sw)) = (g.l(), g.w_out, g.stride);
    for_each_col_row(g, |row, c, off_h, off_w| {
        let dst = &mut col[row * ld..row * ld + l];
        let plane = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        let (oh_lo, oh_hi) = valid_range(g.h_out, g.h, sh, off_h);
        let (ow_lo, ow_hi) = valid_range(wo, g.w, sw, off_w);
        dst[..oh_lo * wo].fill(C::default());
        dst[oh_hi * wo..].fill(C::default());
        for oh in oh_lo..oh_hi {
            let out = &mut dst[oh * wo..(oh + 1) * wo];
            out[..ow_lo].fill(C::default());
            out[ow_hi..].fill(C::default());
            if ow_lo == ow_hi {
                continue;
            }
            let ih = ((oh * sh) as isize + off_h) as usize;
            let iw0 = ((ow_lo * sw) as isize + off_w) as usize;
            let src = &plane[ih * g.w..(ih + 1) * g.w];
            let out = &mut out[ow_lo..ow_hi];
            if sw == 1 {
                out.copy_from_slice(&src[iw0..iw0 + out.len()]);
            } else {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = src[iw0 + j * sw];
                }
            }
        }
    });
}

/// The adjoint of `im2col`: adds each column entry into the input pixel it was read from.
/// `dx [c_in, h, w]` is accumulated into (callers pass zeros).
pub fn col2im<C: FloatDType>(col: &[C], dx: &mut [C], g: &Conv2dGeom) {
    col2im_ld(col, dx, g.l(), g)
}

/// `col2im` from the first `h_out*w_out` columns of a matrix with row stride `ld`.
pub fn col2im_ld<C: FloatDType>(col: &[C], dx: &mut [C], ld: usize, g: &Conv2dGeom) {
    let (l, wo, (sh, sw)) = (g.l(), g.w_out, g.stride);
    for_each_col_row(g, |row, c, off_h, off_w| {
        let src = &col[row * ld..row * ld + l];
        let plane = &mut dx[c * g.h * g.w..(c + 1) * g.h * g.w];
        let (oh_lo, oh_hi) = valid_range(g.h_out, g.h, sh, off_h);
        let (ow_lo, ow_hi) = valid_range(wo, g.w, sw, off_w);
        if ow_lo == ow_hi {
            return;
        }
        for oh in oh_lo..oh_hi {
            let ih = ((oh * sh) as isize + off_h) as usize;
            let iw0 = ((ow_lo * sw) as isize + off_w) as usize;
            let inp = &src[oh * wo + ow_lo..oh * wo + ow_hi];
            let dst = &mut plane[ih * g.w..(ih + 1) * g.w];
            if sw == 1 {
                for (d, &s) in dst[iw0..iw0 + inp.len()].iter_mut().zip(inp) {
                    *d += s;
                }
            } else {
                for (j, &s) in inp.iter().enumerate() {
                    dst[iw0 + j * sw] += s;
                }
            }
        }
    });
}

/// The column matrix of one image: the image itself for pointwise convolutions, else
/// `im2col` into `scratch`.
fn columns<'a, T: Copy + Default>(x: &'a [T], scratch: &'a mut Vec<T>, g: &Conv2dGeom) -> &'a [T] {
    if g.is_pointwise() {
        return x;
    }
    scratch.resize(g.col_len(), T::default());
    im2col(x, scratch, g);
    scratch
}

/// Forward of one image: `y [c_out, L] = w x col (+ bias)`, group by group.
fn image_forward<T: ConvElem>(
    x: &[T],
    w: &[T],
    bias: Option<&[T::Acc]>,
    y: &mut [T::Acc],
    scratch: &mut Vec<T>,
    g: &Conv2dGeom,
    par: bool,
) {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let col = columns(x, scratch, g);
    for grp in 0..g.groups {
        let a = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k);
        let b = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l);
        let dst = &mut y[grp * m * l..(grp + 1) * m * l];
        if let Some(bias) = bias {
            for (row, &b) in dst.chunks_exact_mut(l).zip(&bias[grp * m..(grp + 1) * m]) {
                row.fill(b);
            }
        }
        T::product(dst, a, b, bias.is_some(), par);
    }
}

/// Convolution forward: `x [n, c_in, h, w]`, `w [c_out, c_in/groups, kh, kw]`, optional
/// `bias [c_out]` -> `y [n, c_out, h_out, w_out]`. Parallel over images (each GEMM on its
/// thread); a single image gets a parallel GEMM instead.
pub fn conv2d_forward<C: FloatDType + ConvElem<Acc = C>>(
    x: &[C],
    w: &[C],
    bias: Option<&[C]>,
    g: &Conv2dGeom,
) -> Vec<C> {
    let mut y = vec![C::zero(); g.n * g.out_image()];
    if y.is_empty() {
        return y;
    }
    if g.n == 1 {
        image_forward(x, w, bias, &mut y, &mut Vec::new(), g, true);
        return y;
    }
    y.par_chunks_mut(g.out_image())
        .zip(x.par_chunks(g.in_image()))
        .for_each_init(Vec::new, |scratch, (yi, xi)| {
            image_forward(xi, w, bias, yi, scratch, g, false)
        });
    y
}

/// Input gradient of one image: `dcol = w^T x dy` per group, then col2im into `dx`.
fn image_backward_input<T: ConvElem>(
    dy: &[T],
    w: &[T],
    dx: &mut [T::Acc],
    scratch: &mut Vec<T::Acc>,
    g: &Conv2dGeom,
    par: bool,
) {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let pointwise = g.is_pointwise();
    if !pointwise {
        scratch.resize(g.col_len(), T::Acc::zero());
    }
    // Pointwise: the column matrix is the image, so the product lands in dx directly.
    let dcol: &mut [T::Acc] = if pointwise { dx } else { scratch };
    for grp in 0..g.groups {
        let wt = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k).t();
        let b = MatRef::row_major(&dy[grp * m * l..(grp + 1) * m * l], m, l);
        T::product(&mut dcol[grp * k * l..(grp + 1) * k * l], wt, b, false, par);
    }
    if !pointwise {
        col2im(scratch, dx, g);
    }
}

/// Gradient of the convolution with respect to its input: `dy [n, c_out, h_out, w_out]`,
/// `w` -> `dx [n, c_in, h, w]`. Parallel over images.
pub fn conv2d_backward_input<C: FloatDType + ConvElem<Acc = C>>(
    dy: &[C],
    w: &[C],
    g: &Conv2dGeom,
) -> Vec<C> {
    let mut dx = vec![C::zero(); g.n * g.in_image()];
    if dx.is_empty() {
        return dx;
    }
    if g.out_image() == 0 {
        return dx;
    }
    if g.n == 1 {
        image_backward_input(dy, w, &mut dx, &mut Vec::new(), g, true);
        return dx;
    }
    dx.par_chunks_mut(g.in_image())
        .zip(dy.par_chunks(g.out_image()))
        .for_each_init(Vec::new, |scratch, (dxi, dyi)| {
            image_backward_input(dyi, w, dxi, scratch, g, false)
        });
    dx
}

/// Gradient of the convolution with respect to its weight:
/// `dw_g [c_out/groups, K] = sum_n dy_g[n] [c_out/groups, L] x col_g[n]^T [L, K]`.
///
/// The batch is cut into runs of images fixed by the batch size (`Runs`, not by the thread
/// count); each run sums its images in order into its own buffer, and the buffers are added
/// in run order, so the result is the same on any number of threads.
/// Half inputs give an F32 gradient (`T::Acc`).
pub fn conv2d_backward_weight<T: ConvElem>(x: &[T], dy: &[T], g: &Conv2dGeom) -> Vec<T::Acc> {
    let len = g.weight_len();
    if g.n == 0 || len == 0 || g.l() == 0 {
        return vec![T::Acc::zero(); len];
    }
    let runs = Runs::new(g.n, 1, 1);
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let partials = runs.map_init(Vec::new, |scratch, r| {
        let mut dw = vec![T::Acc::zero(); len];
        for i in runs.range(r, g.n) {
            let xi = &x[i * g.in_image()..(i + 1) * g.in_image()];
            let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
            let col = columns(xi, scratch, g);
            for grp in 0..g.groups {
                let a = MatRef::row_major(&dyi[grp * m * l..(grp + 1) * m * l], m, l);
                let bt = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l).t();
                // A single run (one image) lets the GEMM use the threads itself (its
                // results do not depend on how many).
                let dst = &mut dw[grp * m * k..(grp + 1) * m * k];
                T::product(dst, a, bt, true, runs.count == 1);
            }
        }
        dw
    });
    add_in_order(partials, len)
}

/// Plain direct convolution (f64), the reference the fast path is tested against.
pub fn conv2d_reference(x: &[f64], w: &[f64], bias: Option<&[f64]>, g: &Conv2dGeom) -> Vec<f64> {
    let mut y = vec![0.0; g.n * g.out_image()];
    let (cig, m) = (g.c_in / g.groups, g.c_out_g());
    for n in 0..g.n {
        for co in 0..g.c_out {
            let grp = co / m;
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let mut s = bias.map_or(0.0, |b| b[co]);
                    for ci in 0..cig {
                        let c = grp * cig + ci;
                        for ki in 0..g.kh {
                            for kj in 0..g.kw {
                                let ih = (oh * g.stride.0 + ki * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let iw = (ow * g.stride.1 + kj * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                if ih < 0 || iw < 0 || ih >= g.h as isize || iw >= g.w as isize {
                                    continue;
                                }
                                let xv =
                                    x[((n * g.c_in + c) * g.h + ih as usize) * g.w + iw as usize];
                                let wv = w[((co * cig + ci) * g.kh + ki) * g.kw + kj];
                                s += xv * wv;
                            }
                        }
                    }
                    y[((n * g.c_out + co) * g.h_out + oh) * g.w_out + ow] = s;
                }
            }
        }
    }
    y
}

// ----- element types -------------------------------------------------------------------------
//
// The kernels above run on any `ConvElem`: F32 and F64 through the `gemm` crate, and F16/BF16
// as stored, without an F32 copy of the batch: the column matrix is unfolded in the tensor's
// own dtype (a gather, exact) and multiplied by `gemm_half`, which converts inside its
// packing (or, for BF16 on CPUs with AVX-512 BF16, multiplies BF16 pairs with `vdpbf16ps`),
// with F32 results. Products of two F16 or two BF16 values are exact in F32, so the half
// paths compute what the F32 kernels compute on the converted values, up to summation order
// (and, on the `avx512bf16` kernel, with subnormal inputs and partial sums flushed to zero, as
// `vdpbf16ps` does). On CPUs without AVX2 `gemm_half` runs its portable kernel, slower than
// the `gemm` crate's SIMD code there.

/// An element type the convolution kernels unfold and multiply as stored; products and
/// their sums are in `Acc` (the type itself for F32/F64, F32 for F16/BF16).
pub trait ConvElem: Copy + Default + Send + Sync + 'static {
    type Acc: FloatDType;
    /// `dst = [dst +] a · b` in `Acc`; `par` lets the product use the thread pool.
    fn product(
        dst: &mut [Self::Acc],
        a: MatRef<'_, Self>,
        b: MatRef<'_, Self>,
        acc: bool,
        par: bool,
    );
}

impl ConvElem for f32 {
    type Acc = f32;
    fn product(dst: &mut [f32], a: MatRef<'_, f32>, b: MatRef<'_, f32>, acc: bool, par: bool) {
        matmul_into_par(dst, a, b, acc, par)
    }
}

impl ConvElem for f64 {
    type Acc = f64;
    fn product(dst: &mut [f64], a: MatRef<'_, f64>, b: MatRef<'_, f64>, acc: bool, par: bool) {
        matmul_into_par(dst, a, b, acc, par)
    }
}

/// `a · b` of half views through `gemm_half`.
fn half_product<'a, E>(dst: &mut [f32], a: MatRef<'a, E>, b: MatRef<'a, E>, acc: bool, par: bool)
where
    &'a [E]: Into<Operand<'a>>,
{
    gemm_half::gemm(dst, a.into(), b.into(), acc, par)
}

impl ConvElem for f16 {
    type Acc = f32;
    fn product(dst: &mut [f32], a: MatRef<'_, f16>, b: MatRef<'_, f16>, acc: bool, par: bool) {
        half_product(dst, a, b, acc, par)
    }
}

impl ConvElem for bf16 {
    type Acc = f32;
    fn product(dst: &mut [f32], a: MatRef<'_, bf16>, b: MatRef<'_, bf16>, acc: bool, par: bool) {
        half_product(dst, a, b, acc, par)
    }
}

/// `Some(body)` with `$a`, `$b` bound to the slices of two `Src` of one dtype (F32, F16 or
/// BF16), `None` for a mix.
macro_rules! same_elem {
    (($a:expr, $b:expr), |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (Src::F32($x), Src::F32($y)) => Some($body),
            (Src::F16($x), Src::F16($y)) => Some($body),
            (Src::BF16($x), Src::BF16($y)) => Some($body),
            _ => None,
        }
    };
}
pub(crate) use same_elem;

// ----- F32/F16/BF16 tensors, results rounded image by image -----------------------------------
//
// For tensors that may be F16/BF16 (autocast's case): each image's F32 result is rounded
// straight into the output buffer, so the batch never exists in F32 (at batch 512 the F32
// copy of CifarNet's first activation gradient alone was 128 MiB).

/// `conv2d_forward` over contiguous `x` and `w` of one dtype (F32/F16/BF16; `None` for a
/// mix), the output in that dtype.
pub fn conv2d_forward_blocks(
    x: Src<'_>,
    w: Src<'_>,
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
) -> Option<CpuStorage> {
    fn run<T: ConvElem<Acc = f32>>(
        x: &[T],
        w: &[T],
        bias: Option<&[f32]>,
        g: &Conv2dGeom,
        dtype: DType,
    ) -> Option<CpuStorage> {
        per_block_with(g.n, g.out_image(), dtype, Vec::new, |col, i, y| {
            let xi = &x[i * g.in_image()..(i + 1) * g.in_image()];
            image_forward(xi, w, bias, y, col, g, g.n == 1);
        })
    }
    let dtype = x.dtype();
    same_elem!((x, w), |x, w| run(x, w, bias, g, dtype)).flatten()
}

/// `conv2d_backward_input` from contiguous `dy` and `w` of one dtype; `dx` in that dtype.
pub fn conv2d_backward_input_blocks(dy: Src<'_>, w: Src<'_>, g: &Conv2dGeom) -> Option<CpuStorage> {
    fn run<T: ConvElem<Acc = f32>>(
        dy: &[T],
        w: &[T],
        g: &Conv2dGeom,
        dtype: DType,
    ) -> Option<CpuStorage> {
        per_block_with(g.n, g.in_image(), dtype, Vec::new, |dcol, i, dx| {
            if g.out_image() > 0 {
                let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
                image_backward_input(dyi, w, dx, dcol, g, g.n == 1);
            }
        })
    }
    let dtype = dy.dtype();
    same_elem!((dy, w), |dy, w| run(dy, w, g, dtype)).flatten()
}

/// `conv2d_backward_weight` (F32) from contiguous `x` and `dy` of one dtype.
pub fn conv2d_backward_weight_blocks(x: Src<'_>, dy: Src<'_>, g: &Conv2dGeom) -> Option<Vec<f32>> {
    same_elem!((x, dy), |x, dy| conv2d_backward_weight(x, dy, g))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dGeom {
        let (h, w, kh, kw) = (7, 6, 3, 2);
        Conv2dGeom {
            n: 3,
            c_in: 4,
            h,
            w,
            c_out: 6,
            kh,
            kw,
            stride: (stride, stride + 1),
            padding: (padding, padding),
            dilation: (dilation, dilation),
            groups,
            h_out: conv_out_size(h, kh, stride, padding, dilation).unwrap(),
            w_out: conv_out_size(w, kw, stride + 1, padding, dilation).unwrap(),
        }
    }

    fn wave(n: usize, f: f64) -> Vec<f64> {
        (0..n).map(|i| (i as f64 * f).sin()).collect()
    }

    #[test]
    fn valid_range_matches_brute_force() {
        for out in 0..6 {
            for size in 1..6 {
                for stride in 1..4 {
                    for off in -5..5 {
                        let want: Vec<usize> = (0..out)
                            .filter(|&o| {
                                (0..size as isize).contains(&(o as isize * stride as isize + off))
                            })
                            .collect();
                        let (lo, hi) = valid_range(out, size, stride, off);
                        assert_eq!(
                            (lo..hi).collect::<Vec<_>>(),
                            want,
                            "{out} {size} {stride} {off}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn forward_matches_reference() {
        for (s, p, d, grp) in [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 2), (2, 1, 2, 1)] {
            let g = geom(s, p, d, grp);
            let x = wave(g.n * g.in_image(), 0.37);
            let w = wave(g.weight_len(), 0.11);
            let b = wave(g.c_out, 0.7);
            let want = conv2d_reference(&x, &w, Some(&b), &g);
            let got = conv2d_forward(&x, &w, Some(&b), &g);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-12, "{g:?}: {a} vs {b}");
            }
        }
    }

    /// col2im is im2col's adjoint: <im2col(x), c> == <x, col2im(c)>.
    #[test]
    fn col2im_is_adjoint_of_im2col() {
        let g = geom(2, 1, 2, 1);
        let x = wave(g.in_image(), 0.3);
        let c = wave(g.col_len(), 0.17);
        let mut col = vec![0.0; g.col_len()];
        im2col(&x, &mut col, &g);
        let mut dx = vec![0.0; g.in_image()];
        col2im(&c, &mut dx, &g);
        let lhs: f64 = col.iter().zip(&c).map(|(a, b)| a * b).sum();
        let rhs: f64 = x.iter().zip(&dx).map(|(a, b)| a * b).sum();
        assert!((lhs - rhs).abs() < 1e-10, "{lhs} vs {rhs}");
    }
}
