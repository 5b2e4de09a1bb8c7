//! The column matrix of a convolution as the B operand, packed straight from the image
//! ("implicit im2col").
//!
//! A convolution's forward multiplies its weights by the column matrix `col [K, L]` of each
//! image (`cpu::conv::im2col`), and the GEMM then copies that matrix once more into its
//! packed panels. For a stride-1 convolution whose output rows are as long as its input
//! rows (a 'same'-padded 3×3, the input gradient of one as `conv::transposed_input_conv`
//! runs it), row `(c, ki, kj)` of `col` is plane `c` shifted by `off_h` rows and `off_w`
//! columns, with zeros where the window leaves the plane: so each packed step (one k index,
//! NR consecutive output pixels) is one run of the plane with a few lanes zeroed, and the
//! column matrix need not exist. On a Zen 5 core the two copies were a fifth of a ResNet-20
//! F32 training step.
//!
//! The panels are exactly those `pack_f32` makes from the explicit column matrix (same
//! values, same zeros), so products give the same bits either way (`tests/kernels/gemm_half.rs`
//! holds every F32-panel kernel to that). Kernels on BF16 pairs cannot read im2col's k
//! order this way (a pair step would interleave two shifted runs; the versions of that tried
//! made ResNet-20's amp-bf16 step 2–30 % slower than im2col + pack), but with k taken in
//! channel pairs and the image's planes interleaved in pairs, a pair step is again one
//! shifted run, of u32: `cpu::conv`'s `PairConv` unfolds those planes as F32 bit patterns
//! (`gemm_unfold_pairs`).

use super::pack::{load_run, Packed, PACK_STEPS};
use crate::backend::nn::Conv2dGeom;
use crate::dtype::{same_slice, WithDType};

/// `B = col [K, L]` rows `row0..row0 + rows` (one group's) of one image `x [c_in, h, w]` of a
/// stride-1 convolution with `w_out == w`.
#[derive(Clone, Copy, Debug)]
pub struct Unfold<'a, T> {
    x: &'a [T],
    h: usize,
    w: usize,
    h_out: usize,
    kh: usize,
    kw: usize,
    padding: (usize, usize),
    dilation: (usize, usize),
    row0: usize,
    rows: usize,
}

/// Where row `p` of the column matrix reads: output pixel `j` (flattened) reads
/// `plane[j + shift]` for `j` in `lo..hi` (from the first pixel whose input exists to the
/// last), except in output columns `ow` outside `ow_lo..ow_hi`, which are zero, as is
/// everything outside `lo..hi`.
struct RowSrc<'a, T> {
    plane: &'a [T],
    shift: isize,
    lo: usize,
    hi: usize,
    ow_lo: usize,
    ow_hi: usize,
}

impl<'a, T: WithDType> Unfold<'a, T> {
    /// The column matrix of group `group` of image `x` under `g`, or `None` where it cannot be
    /// read this way (strides other than 1, output rows shorter or longer than input rows,
    /// pointwise convolutions, which use the image itself).
    pub fn conv(x: &'a [T], g: &Conv2dGeom, group: usize) -> Option<Self> {
        if !Self::reads(g) {
            return None;
        }
        let k = g.k();
        assert!(x.len() >= g.in_image(), "unfold: image too small for {g:?}");
        Some(Unfold {
            x,
            h: g.h,
            w: g.w,
            h_out: g.h_out,
            kh: g.kh,
            kw: g.kw,
            padding: g.padding,
            dilation: g.dilation,
            row0: group * k,
            rows: k,
        })
    }

    /// Whether `conv` can read the column matrix of `g` from the image: stride 1, output
    /// rows as long as input rows, not pointwise, some output.
    pub fn reads(g: &Conv2dGeom) -> bool {
        g.stride == (1, 1) && g.w_out == g.w && !g.is_pointwise() && g.l() > 0
    }

    /// Rows of B (the product's inner dimension).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of B (output pixels per image).
    pub fn cols(&self) -> usize {
        self.h_out * self.w
    }

    fn row(&self, p: usize) -> RowSrc<'a, T> {
        let r = self.row0 + p;
        let (c, ki, kj) = (
            r / (self.kh * self.kw),
            (r / self.kw) % self.kh,
            r % self.kw,
        );
        let off_h = (ki * self.dilation.0) as isize - self.padding.0 as isize;
        let off_w = (kj * self.dilation.1) as isize - self.padding.1 as isize;
        let (h, w) = (self.h as isize, self.w as isize);
        let oh_lo = (-off_h).clamp(0, self.h_out as isize);
        let oh_hi = (h - off_h).clamp(oh_lo, self.h_out as isize);
        let ow_lo = (-off_w).clamp(0, w);
        let ow_hi = (w - off_w).clamp(ow_lo, w);
        let plane = &self.x[c * self.h * self.w..(c + 1) * self.h * self.w];
        // From the first valid pixel of the first valid row to the last of the last, so that
        // every pixel in between reads inside the plane (the wrapped ones are zeroed after).
        let (lo, hi) = if oh_lo < oh_hi && ow_lo < ow_hi {
            (oh_lo * w + ow_lo, (oh_hi - 1) * w + ow_hi)
        } else {
            (0, 0)
        };
        RowSrc {
            plane,
            shift: off_h * w + off_w,
            lo: lo as usize,
            hi: hi as usize,
            ow_lo: ow_lo as usize,
            ow_hi: ow_hi as usize,
        }
    }
}

impl<T> RowSrc<'_, T> {
    /// The lanes `a..b` of a step that starts at output pixel `jt` and holds `wt` pixels
    /// that read the plane (the rest of the step is zero), and the plane index of lane a.
    #[inline(always)]
    fn span(&self, jt: usize, wt: usize) -> Option<(usize, usize, usize)> {
        let (lo, hi) = (self.lo.max(jt), self.hi.min(jt + wt));
        (lo < hi).then(|| (lo - jt, hi - jt, (lo as isize + self.shift) as usize))
    }

    /// Calls `f(lane)` for the lanes `a..b` of a step whose first lane is output column
    /// `first_col` where the column lies outside `ow_lo..ow_hi` (the pixels the shifted run
    /// wraps into from the neighbouring row, which must be zero).
    #[inline(always)]
    fn wrapped(&self, first_col: usize, a: usize, b: usize, w: usize, mut f: impl FnMut(usize)) {
        for ow in (0..self.ow_lo).chain(self.ow_hi..w) {
            // Lanes whose column is ow: the first at (ow - first_col) mod w, then every w.
            let mut lane = if ow >= first_col {
                ow - first_col
            } else {
                ow + w - first_col
            };
            while lane < a {
                lane += w;
            }
            while lane < b {
                f(lane);
                lane += w;
            }
        }
    }

    /// The `W` lanes of the step starting at output pixel `jt` (`wt` of them in the matrix)
    /// as F32: the plane's values where the window reads it, zero elsewhere (`simd` as
    /// `pack_f32`'s).
    #[inline(always)]
    fn step<const W: usize>(&self, jt: usize, wt: usize, w: usize, out: &mut [f32; W], simd: bool)
    where
        T: WithDType,
    {
        let Some((a, b, at)) = self.span(jt, wt) else {
            *out = [0.0; W];
            return;
        };
        match same_slice::<T, f32>(self.plane) {
            // A whole step of F32: a copy of constant length, inlined (no call to memmove).
            Some(src) if a == 0 && b == W => *out = src[at..at + W].try_into().expect("W"),
            _ => {
                out[..a].fill(0.0);
                out[b..].fill(0.0);
                load_run(self.plane, at as isize, 1, &mut out[a..b], simd);
            }
        }
        if self.ow_lo > 0 || self.ow_hi < w {
            self.wrapped(jt % w, a, b, w, |lane| out[lane] = 0.0);
        }
    }
}

/// F32 panels of width `W` of columns `j0..j0 + nw`, k indices `p0..p0 + kc` of `u`: what
/// `pack_f32::<W>` makes of the explicit column matrix (`simd` as there). PACK_STEPS k
/// indices of every panel in turn, as `pack_f32` writes them: one k index at a time across
/// the panels, which lie `kc·W` floats apart, thrashed a few L1 sets.
#[inline(always)]
pub(super) fn unfold_f32<const W: usize, T: WithDType>(
    u: &Unfold<'_, T>,
    j0: usize,
    nw: usize,
    p0: usize,
    kc: usize,
    out: &mut [f32],
    simd: bool,
) {
    let (n_panels, plen) = (nw.div_ceil(W), kc * W);
    let out = &mut out[..n_panels * plen];
    for ps in (0..kc).step_by(PACK_STEPS) {
        let block: [Option<RowSrc<'_, T>>; PACK_STEPS] =
            std::array::from_fn(|i| (ps + i < kc).then(|| u.row(p0 + ps + i)));
        for t in 0..n_panels {
            let (jt, wt) = (j0 + t * W, (nw - t * W).min(W));
            for (i, r) in block.iter().map_while(Option::as_ref).enumerate() {
                let at = t * plen + (ps + i) * W;
                let step: &mut [f32; W] = (&mut out[at..][..W]).try_into().expect("W");
                r.step(jt, wt, u.w, step, simd);
            }
        }
    }
}

/// A pack buffer as F32 values.
pub(super) fn as_f32s<P: Packed>(s: &mut [P]) -> &mut [f32] {
    // SAFETY: `Packed` types are 4-byte plain numbers with no invalid bit patterns, as F32.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) }
}
