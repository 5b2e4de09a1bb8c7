//! Forward convolutions with output channels in multiples of 32 as an implicit GEMM: the
//! weights are the vector operand, the image's pixels are broadcast from a padded copy, and
//! no column matrix is built or packed.
//!
//! `conv::image_forward` otherwise computes `y [c_out, L] = w [c_out, K] · col [K, L]` on
//! hemi's GEMM, which packs `col` (read from the image, or from im2col) into panels before
//! multiplying. On ResNet-20's 32- and 64-channel layers each packed element then feeds only
//! 32 or 64 multiply-adds, and the packing (about two passes over a matrix `kh·kw` times the
//! image) held those convolutions to 86–98 GFLOP/s on one Emerald Rapids core, about half its
//! F32 FMA peak (`hemi bench conv --layers resnet20-32,resnet20-64 --threads 1`).
//!
//! Here the product is taken the other way round, `y^T [L, c_out] = col^T [L, K] · w^T [K,
//! c_out]`. The weights are packed once per call, in panels of `NW = 32` output channels
//! (`panel[k · NW + o]`). The image is copied once into planes padded with zeros, so that
//! output pixel `p` of k step `k = (c, ki, kj)` reads element `base(p) + off(k)` of the copy,
//! with `base(p) = oh·sh·Wp + ow·sw` and `off(k) = (c·Hp + ki·dh)·Wp + kj·dw`: any stride,
//! padding or dilation, and no masks. A tile of `MR = 8` consecutive output pixels × 32
//! channels keeps 16 accumulators in registers; each k step loads two weight vectors,
//! broadcasts 8 pixels and does 16 FMAs. The tile is then transposed in registers (8×16
//! blocks) and stored as 8-pixel runs of each channel's output plane.
//!
//! Each output element sums its k steps in order from zero, one FMA (one rounding) each, then
//! the bias is added: what the GEMM does where `K` fits one k block. The portable twin does
//! the same with `f32::mul_add`, so the two give the same bits (`tests/kernels/conv_implicit.rs`).
//! F16 and BF16 images are widened to F32 in the padded copy (exact), so their products are
//! the F32 products of the same values.

use std::cell::RefCell;

use crate::backend::nn::Conv2dGeom;
use crate::cpu::conv::direct::DirectElem;

/// Output pixels per tile.
const MR: usize = 8;
/// Output channels per panel: two 16-lane F32 vectors.
const NW: usize = 32;
/// Vectors per panel row.
const NV: usize = NW / 16;
/// The fewest k steps `ImplicitPlan::weight_grad` takes. The output gradient is transposed
/// once per image, a pass of `c_out · L` against `c_out · L · K` multiply-adds: with CifarNet's
/// first layer (3 → 64 channels, 3×3, K = 27) the weight gradient took 19.3 ms here against
/// the GEMM's 7.9 (`hemi bench conv --layers cifar-conv1 --threads 1`, one Emerald Rapids
/// core), while at K = 288 (ResNet-20's 32 channels) it is 1.5× faster than the GEMM.
pub const MIN_WGRAD_K: usize = 64;

/// One convolution as an implicit GEMM: its geometry, the padded planes' size, the weights
/// in panels of `NW` output channels (for the forward), the offset of each k step and the
/// base of each output pixel.
#[derive(Clone, Debug)]
pub struct ImplicitPlan {
    simd: bool,
    g: Conv2dGeom,
    /// Rows and columns of a padded plane: exactly those some output reads.
    hp: usize,
    wp: usize,
    /// `panels[(p · K + k) · NW + o]`: weight of output channel `p·NW + o` at k step `k`
    /// (empty in a plan for weight gradients).
    panels: Vec<f32>,
    /// `offs[k]`: where k step `k` reads, relative to an output pixel's base in the copy.
    offs: Vec<isize>,
    /// `bases[p]`: where output pixel `p` reads its first k step in the copy.
    bases: Vec<isize>,
}

thread_local! {
    /// The padded copy of the image a thread is convolving, kept between images and calls,
    /// with the layout its zeros were written for.
    static PADDED: RefCell<(Vec<f32>, Option<PadLayout>)> = const { RefCell::new((Vec::new(), None)) };
    /// An output gradient by pixel (`[c_out/NW][L][NW]`, F32), for weight gradients.
    static BY_PIXEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl ImplicitPlan {
    /// The plan where this file is the route: an ungrouped, non-pointwise convolution whose
    /// output channels are a multiple of 32, on a CPU with AVX-512 F and VL; `None` otherwise.
    /// `w` is `[c_out, c_in, kh, kw]`.
    pub fn new<T: DirectElem>(g: &Conv2dGeom, w: &[T]) -> Option<Self> {
        if g.is_pointwise() || !simd_available() {
            return None;
        }
        Self::with_simd(g, w, true)
    }

    /// The plan on the AVX-512 tile (`simd`, where the CPU has it) or its portable twin;
    /// `None` for convolutions it does not take (grouped, output channels not a multiple of
    /// 32, no output or no input channel) and for `simd` on a CPU without AVX-512 F/VL.
    pub fn with_simd<T: DirectElem>(g: &Conv2dGeom, w: &[T], simd: bool) -> Option<Self> {
        let mut plan = Self::weight_grad_with_simd(g, simd)?;
        assert!(
            w.len() >= g.weight_len(),
            "conv_implicit: weights too short for {g:?}"
        );
        let k = g.k();
        plan.panels = vec![0f32; g.c_out * k];
        for o in 0..g.c_out {
            let (p, lane) = (o / NW, o % NW);
            for (kx, &v) in w[o * k..(o + 1) * k].iter().enumerate() {
                plan.panels[(p * k + kx) * NW + lane] = v.to_f32();
            }
        }
        Some(plan)
    }

    /// The plan of weight gradients (`add_weight_grad`) where this file is the route: the
    /// convolutions `new` takes with at least `MIN_WGRAD_K` k steps.
    pub fn weight_grad(g: &Conv2dGeom) -> Option<Self> {
        if g.is_pointwise() || g.k() < MIN_WGRAD_K || !simd_available() {
            return None;
        }
        Self::weight_grad_with_simd(g, true)
    }

    /// The plan of weight gradients on the AVX-512 tile (`simd`) or its portable twin, for
    /// the convolutions `with_simd` takes.
    pub fn weight_grad_with_simd(g: &Conv2dGeom, simd: bool) -> Option<Self> {
        if simd && !simd_available() {
            return None;
        }
        if g.groups != 1 || g.c_out == 0 || !g.c_out.is_multiple_of(NW) || g.l() == 0 {
            return None;
        }
        if g.c_in == 0 || g.kh == 0 || g.kw == 0 {
            return None;
        }
        let span = |out: usize, s: usize, k: usize, d: usize| (out - 1) * s + (k - 1) * d + 1;
        let hp = span(g.h_out, g.stride.0, g.kh, g.dilation.0);
        let wp = span(g.w_out, g.stride.1, g.kw, g.dilation.1);
        let mut offs = Vec::with_capacity(g.k());
        for c in 0..g.c_in {
            for ki in 0..g.kh {
                for kj in 0..g.kw {
                    let row = c * hp + ki * g.dilation.0;
                    offs.push((row * wp + kj * g.dilation.1) as isize);
                }
            }
        }
        let bases = (0..g.l())
            .map(|p| {
                let (oh, ow) = (p / g.w_out, p % g.w_out);
                (oh * g.stride.0 * wp + ow * g.stride.1) as isize
            })
            .collect();
        Some(ImplicitPlan {
            simd,
            g: *g,
            hp,
            wp,
            panels: Vec::new(),
            offs,
            bases,
        })
    }

    /// One image: `y [c_out, L] = bias + w · col(x)`, `x [c_in, h, w]` as stored, `bias`
    /// (`[c_out]`) or zeros. Panics on a plan for weight gradients.
    pub fn image<T: DirectElem>(&self, x: &[T], bias: Option<&[f32]>, y: &mut [f32]) {
        let g = &self.g;
        assert!(
            !self.panels.is_empty(),
            "conv_implicit: a weight-gradient plan has no weights"
        );
        assert!(
            x.len() >= g.in_image() && y.len() >= g.out_image(),
            "conv_implicit: buffers too small for one image of {g:?}"
        );
        assert!(
            bias.is_none_or(|b| b.len() >= g.c_out),
            "conv_implicit: bias too short"
        );
        let (l, k) = (g.l(), g.k());
        PADDED.with_borrow_mut(|(xp, layout)| {
            self.pad(x, xp, layout);
            for p in 0..g.c_out / NW {
                let panel = &self.panels[p * k * NW..(p + 1) * k * NW];
                let out = Out::Bias(bias.map(|b| &b[p * NW..(p + 1) * NW]));
                let y = &mut y[p * NW * l..(p + 1) * NW * l];
                for p0 in (0..l).step_by(MR) {
                    let rows = (l - p0).min(MR);
                    let tile = Tile::new(p0, rows, |i| self.bases[i], &self.offs, panel, l);
                    // SAFETY: `simd` only where the CPU has AVX-512 F/VL (`with_simd`); `xp`
                    // holds the padded image, where every base + offset lies (`pad`); the
                    // panel has K steps of NW; `y` holds this panel's NW output planes.
                    unsafe { tile.run(self.simd, xp, out, y) };
                }
            }
        });
    }

    /// The weight gradient of `n` images added to `dw [c_out, K]`: image by image in order,
    /// each `Σ_p dy[o][p] · col(x)[k][p]` summed over its pixels in order from zero, then
    /// added (`x [n, c_in, h, w]`, `dy [n, c_out, h_out, w_out]` as stored).
    ///
    /// The forward's tile with the roles turned: `MR` k steps × `NW` output channels, the
    /// output gradient by pixel (`[L][NW]` per panel, transposed once per image) as the vector
    /// operand, and the padded image broadcast at each pixel's base.
    pub fn add_weight_grad<T: DirectElem>(&self, x: &[T], dy: &[T], n: usize, dw: &mut [f32]) {
        let g = &self.g;
        let (l, k) = (g.l(), g.k());
        assert!(
            x.len() >= n * g.in_image() && dy.len() >= n * g.out_image(),
            "conv_implicit: buffers too small for {n} images of {g:?}"
        );
        assert!(dw.len() >= g.weight_len(), "conv_implicit: dw too short");
        PADDED.with_borrow_mut(|(xp, layout)| {
            BY_PIXEL.with_borrow_mut(|dyt| {
                dyt.resize(g.c_out * l, 0.0);
                // One row widened at a time (`widen` converts F16 with F16C; with one
                // `f16::to_f32` per element the F16 weight gradient of ResNet-20's 32-channel
                // layer took 7.4 ms against 5.1 on one core).
                let mut row32 = vec![0f32; l];
                for i in 0..n {
                    self.pad(&x[i * g.in_image()..(i + 1) * g.in_image()], xp, layout);
                    let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
                    for (o, row) in dyi.chunks_exact(l).enumerate() {
                        let (p, lane) = (o / NW, o % NW);
                        let panel = &mut dyt[p * l * NW..(p + 1) * l * NW];
                        T::widen(row, &mut row32);
                        for (d, &v) in panel[lane..].iter_mut().step_by(NW).zip(&row32) {
                            *d = v;
                        }
                    }
                    for p in 0..g.c_out / NW {
                        let panel = &dyt[p * l * NW..(p + 1) * l * NW];
                        let dw = &mut dw[p * NW * k..(p + 1) * NW * k];
                        for k0 in (0..k).step_by(MR) {
                            let rows = (k - k0).min(MR);
                            let tile = Tile::new(k0, rows, |j| self.offs[j], &self.bases, panel, k);
                            // SAFETY: as in `image`, with the roles of `offs` and `bases`
                            // turned; the panel has L steps of NW; `dw` holds this panel's NW
                            // rows of K.
                            unsafe { tile.run(self.simd, xp, Out::Add, dw) };
                        }
                    }
                }
            })
        });
    }

    /// `x` copied into `out` as `c_in` planes of `hp × wp` F32: input row `ih` at padded row
    /// `ih + ph`, column `iw` at `iw + pw`, zeros around; input rows and columns no output
    /// reads are left out. The zeros are written only where `out` does not already hold
    /// them for this layout (`layout`, updated): the next image of a batch copies its rows
    /// and nothing else (on ResNet-20's 8×8 planes the border is a third of the copy).
    fn pad<T: DirectElem>(&self, x: &[T], out: &mut Vec<f32>, layout: &mut Option<PadLayout>) {
        let g = &self.g;
        let (hp, wp) = (self.hp, self.wp);
        let (ph, pw) = g.padding;
        // Input rows and columns copied: ih in [0, rows), iw in [0, cols).
        let rows = g.h.min(hp.saturating_sub(ph));
        let cols = g.w.min(wp.saturating_sub(pw));
        let want = PadLayout {
            planes: g.c_in,
            hp,
            wp,
            ph,
            pw,
            rows,
            cols,
        };
        if *layout != Some(want) {
            out.clear();
            out.resize(g.c_in * hp * wp, 0.0);
            *layout = Some(want);
        }
        if cols == 0 {
            return;
        }
        for (plane, dst) in x.chunks_exact(g.h * g.w).zip(out.chunks_exact_mut(hp * wp)) {
            for ih in 0..rows {
                let at = (ih + ph) * wp + pw;
                T::widen(&plane[ih * g.w..ih * g.w + cols], &mut dst[at..at + cols]);
            }
        }
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpu_has!(Avx512f) && cpu_has!(Avx512vl)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where a padded copy's values lie: `planes` planes of `hp × wp`, input rows `0..rows` and
/// columns `0..cols` at `(ph, pw)`, zeros elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PadLayout {
    planes: usize,
    hp: usize,
    wp: usize,
    ph: usize,
    pw: usize,
    rows: usize,
    cols: usize,
}

/// One tile: `MR` rows, each reading the padded copy from its own start (`starts[r]`,
/// rows past `rows` repeating row 0's: read, never stored), stepping together through `idx`
/// with `NW` vector values per step from `vec`; the sums go to `rows` consecutive positions
/// `at..at + rows` of `NW` rows of `dst` a `stride` apart, with the bias added
/// (`Out::Bias`) or onto what is there (`Out::Add`).
///
/// The forward's tiles are `MR` output pixels (`starts` their bases, `idx` the k steps'
/// offsets, `vec` the weights); the weight gradient's are `MR` k steps (`starts` their
/// offsets, `idx` the pixels' bases, `vec` the output gradient by pixel).
struct Tile<'a> {
    starts: [isize; MR],
    idx: &'a [isize],
    vec: &'a [f32],
    rows: usize,
    at: usize,
    stride: usize,
}

/// What a tile's sums are stored as.
#[derive(Clone, Copy)]
enum Out<'a> {
    /// `bias[o] + sum` (zero where `None`).
    Bias(Option<&'a [f32]>),
    /// `dst + sum`.
    Add,
}

impl<'a> Tile<'a> {
    /// The tile of `rows` of `starts` from `at`, each row's start `start(i)` for its index
    /// `i` in `at..at + rows`.
    fn new(
        at: usize,
        rows: usize,
        start: impl Fn(usize) -> isize,
        idx: &'a [isize],
        vec: &'a [f32],
        stride: usize,
    ) -> Self {
        let starts = std::array::from_fn(|r| start(if r < rows { at + r } else { at }));
        Tile {
            starts,
            idx,
            vec,
            rows,
            at,
            stride,
        }
    }

    /// The tile on the AVX-512 code (`simd`) or the portable twin.
    ///
    /// # Safety
    /// `simd` only where the CPU has AVX-512 F/VL; every `start + idx` indexes `xp`; `vec`
    /// holds `idx.len() · NW` values; `dst` holds `NW` rows of `stride` with the tile's
    /// positions in them; a bias, where given, `NW` values.
    unsafe fn run(&self, simd: bool, xp: &[f32], out: Out<'_>, dst: &mut [f32]) {
        match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: forwarded.
            true => unsafe { x86::tile(self, xp, out, dst) },
            _ => portable_tile(self, xp, out, dst),
        }
    }
}

/// The portable tile: the SIMD tile's sums in their order, with `f32::mul_add`.
fn portable_tile(t: &Tile<'_>, xp: &[f32], out: Out<'_>, dst: &mut [f32]) {
    let mut acc = [[0f32; NW]; MR];
    for (step, &i) in t.idx.iter().enumerate() {
        let vrow = &t.vec[step * NW..(step + 1) * NW];
        for (acc_r, &start) in acc.iter_mut().zip(&t.starts) {
            let xv = xp[(start + i) as usize];
            for (a, &v) in acc_r.iter_mut().zip(vrow) {
                *a = xv.mul_add(v, *a);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate().take(t.rows) {
        for (o, &v) in acc_r.iter().enumerate() {
            let d = &mut dst[o * t.stride + t.at + r];
            *d = match out {
                Out::Bias(bias) => bias.map_or(0.0, |b| b[o]) + v,
                Out::Add => *d + v,
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Out, Tile, MR, NV, NW};
    use std::arch::x86_64::*;

    /// Steps ahead that the vector operand is prefetched.
    const PF: usize = 4;

    /// One tile: `MR × NV` accumulators over the steps, then transposed into `dst`. (Taking
    /// the forward's k steps in blocks of 128 for groups of 4 tiles, so that each block of
    /// weights is read from L1 by three of them, measured no faster on an Emerald Rapids
    /// core: the weights are prefetched instead.)
    ///
    /// # Safety
    /// As `Tile::run`, on a CPU with AVX-512 F and VL.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn tile(t: &Tile<'_>, xp: &[f32], out: Out<'_>, dst: &mut [f32]) {
        let ptrs: [*const f32; MR] =
            std::array::from_fn(|r| xp.as_ptr().wrapping_offset(t.starts[r]));
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let mut w = t.vec.as_ptr();
        for &i in t.idx {
            // SAFETY: the caller guarantees NW values per step and in-bounds reads.
            unsafe {
                for v in 0..NV {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(PF * NW + 16 * v).cast());
                }
                let wv: [__m512; NV] = std::array::from_fn(|v| _mm512_loadu_ps(w.add(16 * v)));
                for (acc_r, &ptr) in acc.iter_mut().zip(&ptrs) {
                    let xv = _mm512_set1_ps(*ptr.offset(i));
                    for (a, &wv) in acc_r.iter_mut().zip(&wv) {
                        *a = _mm512_fmadd_ps(xv, wv, *a);
                    }
                }
                w = w.add(NW);
            }
        }
        // SAFETY: forwarded.
        unsafe { store(t, &acc, out, dst) };
    }

    /// A tile's sums, transposed into runs of `rows` positions of each of the `NW` rows.
    ///
    /// # Safety
    /// As `tile`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[r][v] indexed by both
    unsafe fn store(t: &Tile<'_>, acc: &[[__m512; NV]; MR], out: Out<'_>, dst: &mut [f32]) {
        let mask: __mmask8 = if t.rows == MR {
            0xff
        } else {
            (1u8 << t.rows) - 1
        };
        for v in 0..NV {
            let b = match out {
                // SAFETY: the bias holds NW values (caller).
                Out::Bias(Some(b)) => unsafe { _mm512_loadu_ps(b.as_ptr().add(16 * v)) },
                _ => _mm512_setzero_ps(),
            };
            let rows: [__m512; MR] = std::array::from_fn(|r| match out {
                Out::Bias(_) => _mm512_add_ps(b, acc[r][v]),
                Out::Add => acc[r][v],
            });
            let cols = transpose_8x16(rows);
            for (i, z) in cols.iter().enumerate() {
                // Channel pair of output vector i: its low half is row `lo` of `dst`, its high
                // half row `lo + 4` (`transpose_8x16`).
                let lo = 16 * v + (i / 4) * 8 + i % 4;
                debug_assert!(lo + 4 < NW);
                let halves = [
                    _mm512_castps512_ps256(*z),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*z))),
                ];
                for (h, half) in halves.into_iter().enumerate() {
                    let o = lo + 4 * h;
                    // SAFETY: the masked lanes are positions at..at + rows of row `o` < NW,
                    // inside `dst` (caller).
                    unsafe {
                        let p = dst.as_mut_ptr().add(o * t.stride + t.at);
                        let half = match out {
                            Out::Add => _mm256_add_ps(_mm256_maskz_loadu_ps(mask, p), half),
                            Out::Bias(_) => half,
                        };
                        _mm256_mask_storeu_ps(p, mask, half)
                    };
                }
            }
        }
    }

    /// Eight rows of 16 (`rows[r]` lane `c`) as eight vectors of channel pairs: vector `i`
    /// holds rows 0–7 of channel `(i/4)·8 + i%4` in its low half and of channel
    /// `(i/4)·8 + i%4 + 4` in its high half.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose_8x16(rows: [__m512; MR]) -> [__m512; 8] {
        let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
        // In each 128-bit lane j: t0 = r0[0] r1[0] r0[1] r1[1], t1 = r0[2] r1[2] r0[3] r1[3] …
        let (t0, t1) = (_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm512_unpacklo_ps(r2, r3), _mm512_unpackhi_ps(r2, r3));
        let (t4, t5) = (_mm512_unpacklo_ps(r4, r5), _mm512_unpackhi_ps(r4, r5));
        let (t6, t7) = (_mm512_unpacklo_ps(r6, r7), _mm512_unpackhi_ps(r6, r7));
        // u[i] lane j: rows 0–3 of channel 4j + i; u[4 + i] lane j: rows 4–7 of it.
        let u = [
            _mm512_shuffle_ps::<0x44>(t0, t2),
            _mm512_shuffle_ps::<0xEE>(t0, t2),
            _mm512_shuffle_ps::<0x44>(t1, t3),
            _mm512_shuffle_ps::<0xEE>(t1, t3),
            _mm512_shuffle_ps::<0x44>(t4, t6),
            _mm512_shuffle_ps::<0xEE>(t4, t6),
            _mm512_shuffle_ps::<0x44>(t5, t7),
            _mm512_shuffle_ps::<0xEE>(t5, t7),
        ];
        // Lanes 0 and 1 (channels i and 4 + i), then lanes 2 and 3 (8 + i and 12 + i),
        // rows 0–3 from u[i] and 4–7 from u[4 + i].
        let lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        let hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        std::array::from_fn(|i| {
            let idx = if i < 4 { lo } else { hi };
            _mm512_permutex2var_ps(u[i % 4], idx, u[4 + i % 4])
        })
    }
}
