//! The weight gradient of a BF16 convolution as dot products read straight from the image.
//!
//! `conv::conv2d_backward_weight` computes `dw [c_out, K] = dy [c_out, L] · colᵀ [L, K]` per
//! image: im2col writes the column matrix, then the BF16-pair GEMM packs `colᵀ` into pixel
//! pairs, a transpose. With few output channels each copied element feeds few multiply-adds:
//! on ResNet-20's 16-channel stage (`hemi bench conv --layers resnet20-16 --threads 1`, one
//! Zen 5 core) that route took 3.3 ms per weight gradient at batch 128, this one 2.3 ms; on
//! the 32- and 64-channel stages both take 2.3 ms (about 270 GFLOP/s, what the GEMM reaches
//! on large square products), and on ResNet-50's 64 channels of 56×56 the GEMM is faster, so
//! `WgradPlan::new` takes convolutions of at most `MAX_C_OUT` output channels.
//!
//! For a stride-1 convolution whose output rows are as long as its input rows (the 'same'
//! 3×3 convolutions of ResNets, and every pointwise one), each weight is one dot product
//! over the image's output pixels `p`:
//!
//! `dw[o][c][ki][kj] = Σ_p dy[o][p] · x[c][p + s]`, `s = (ki·dh − ph)·W + kj·dw − pw`,
//!
//! with the pixels whose input lies in the padding left out. `vdpbf16ps` multiplies pairs
//! of consecutive BF16 values, and consecutive pixels are consecutive in both `dy` and `x`
//! (NCHW): one 64-byte load of each row gives 16 pixel pairs, at any shift. So nothing is
//! copied: the pixels outside the padding are chosen by a 32-lane mask per kernel offset and
//! chunk of 32 pixels (AVX-512's masked loads read no masked-off lane), the last chunk's
//! lanes past the image by another.
//!
//! Blocks of `RB` output channels × `CB` input channels at one kernel offset keep `RB·CB`
//! accumulators (16 lanes each) in registers and load `RB + CB` vectors per 32 pixels (4 × 6
//! ran out of registers and took twice as long). Each lane sums its chunks in order, image
//! by image over a group of images, pair by pair as `vdpbf16ps` does (Intel SDM: the odd
//! element's product first; products of BF16 values are exact in F32), the 16 lanes are
//! added as a fixed tree, and the groups' sums are added into `dw` in order. `Kernel::Avx512Bf16`
//! runs it with `vdpbf16ps`, `Kernel::PortableBf16Pairs` in plain F32 arithmetic: the same
//! bits (on values whose sums are not subnormal, which `vdpbf16ps` flushes to zero).

use half::bf16;
use half::slice::HalfFloatSliceExt;

use crate::backend::nn::Conv2dGeom;
use crate::cpu::gemm::select::{f32_kernel, kernel_for, Kernel};
use crate::DType;

/// Output channels per block.
const RB: usize = 4;
/// Input channels (at one kernel offset) per block.
const CB: usize = 4;
/// Pixels per chunk: 16 lanes of one BF16 pair each.
const CHUNK: usize = 32;
/// The most output channels `WgradPlan::new` takes. Past 16 the GEMM's 8 × 32 tiles fill
/// and its packing is shared by enough rows: at batch 128 on one Zen 5 core (`hemi bench conv
/// --threads 1`, BF16 weight gradient), 16 channels on 32×32 took 3.3 ms by GEMM and 2.3 ms
/// here, 32 on 16×16 2.3 ms both ways, 64 on 8×8 2.35 and 2.45 ms; 64 on 56×56 at batch 32
/// (`resnet-3x3`) 19.3 and 23.8 ms (ResNet-50 amp-bf16 17 → 15 images/s with no limit).
const MAX_C_OUT: usize = 16;
/// The bytes of a block's rows a group of images may span (`WgradPlan::group_len`).
const GROUP_BYTES: usize = 32 << 10;

/// How a plan's blocks multiply: all three give the same bits (`Dot` on values whose sums are
/// not subnormal, which `vdpbf16ps` flushes to zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Imp {
    /// Plain F32 arithmetic, in `vdpbf16ps`' order for BF16 (`portable-bf16-pairs`), in
    /// `x86::block_f32`'s for F32 (`portable-wide`).
    Portable,
    /// `vdpbf16ps` (`avx512bf16`).
    Dot,
    /// Each pair widened to two F32 vectors (its odd and its even elements) and two FMAs:
    /// where BF16 products run widened to F32 (`avx512f`, `gemm::select::Bf16Route::Widen`).
    Fma,
}

/// The plan of one convolution's weight gradient in pixel pairs: the kernel, the shift of
/// each kernel offset, and the masks of its chunks.
#[derive(Clone, Debug)]
pub struct WgradPlan {
    imp: Imp,
    g: Conv2dGeom,
    chunks: usize,
    /// `shifts[r]`: input pixel `p + shifts[r]` of kernel offset `r = ki·kw + kj`.
    shifts: Vec<isize>,
    /// `masks[r * chunks + q]`: bit `e` set where pixel `32q + e` of kernel offset `r` reads
    /// an input pixel (not padding, not past the output).
    masks: Vec<u32>,
    /// `tail[q]`: bit `e` set where pixel `32q + e` is an output pixel.
    tail: Vec<u32>,
}

impl WgradPlan {
    /// The plan on the kernel a BF16 product of this convolution runs on, where this file is
    /// the faster route: `None` where that kernel has no block here (`with_kernel`), the
    /// convolution is not one this file reads, or it has more than `MAX_C_OUT` output
    /// channels.
    pub fn new(g: &Conv2dGeom) -> Option<Self> {
        if g.c_out > MAX_C_OUT {
            return None;
        }
        let kernel = kernel_for(DType::BF16, DType::BF16, g.c_out, g.l(), g.k());
        Self::with_kernel(g, kernel)
    }

    /// `new` for F32 tensors (`add_images_f32`): the plan on the kernel an F32 product of this
    /// convolution runs on, where that is hemi's `avx512f` (or a forced portable twin).
    pub fn new_f32(g: &Conv2dGeom) -> Option<Self> {
        if g.c_out > MAX_C_OUT {
            return None;
        }
        Self::with_kernel(g, f32_kernel(g.c_out, g.l(), g.k())?)
    }

    /// The plan on `kernel`: `avx512bf16` (`vdpbf16ps`) and `avx512f` (FMAs) where the CPU has
    /// them, or their portable twins `portable-bf16-pairs` and `portable-wide`; `None` for
    /// other kernels and for convolutions that are grouped, strided, have output rows of
    /// another length than their input rows, or have no output.
    pub fn with_kernel(g: &Conv2dGeom, kernel: Kernel) -> Option<Self> {
        let imp = match kernel {
            Kernel::Avx512Bf16 if kernel.is_available() => Imp::Dot,
            Kernel::Avx512F32 if kernel.is_available() && has_avx512bw() => Imp::Fma,
            Kernel::PortableBf16Pairs | Kernel::PortableF32Wide => Imp::Portable,
            _ => return None,
        };
        if g.groups != 1 || g.stride != (1, 1) || g.w_out != g.w || g.l() == 0 || g.c_in == 0 {
            return None;
        }
        let ShiftMasks {
            chunks,
            shifts,
            masks,
            tail,
        } = ShiftMasks::new(g, CHUNK);
        Some(WgradPlan {
            imp,
            g: *g,
            chunks,
            shifts,
            masks,
            tail,
        })
    }

    /// Adds the weight gradient of `images` consecutive images into `dw [c_out, c_in, kh,
    /// kw]`: `x [images, c_in, h, w]` and `dy [images, c_out, h_out, w_out]` as stored.
    ///
    /// The images go in groups whose block rows fit in L1 (`group_len`): each lane sums a
    /// group's chunks in order, the lanes are added, and the groups' sums are added into
    /// `dw` in order. `parallel`: spread each group's blocks over rayon's threads (the sums
    /// are the same bits either way).
    pub fn add_images(
        &self,
        x: &[bf16],
        dy: &[bf16],
        images: usize,
        dw: &mut [f32],
        parallel: bool,
    ) {
        let block: Block<u16> = match self.imp {
            #[cfg(target_arch = "x86_64")]
            Imp::Dot => x86::block,
            #[cfg(target_arch = "x86_64")]
            Imp::Fma => x86::block_fma,
            _ => portable_block,
        };
        self.add_images_with(
            x.reinterpret_cast(),
            dy.reinterpret_cast(),
            images,
            dw,
            parallel,
            block,
        )
    }

    /// `add_images` for F32 tensors: the same dot products over the same masked chunks, two
    /// 16-pixel halves per chunk with an FMA each (`x86::block_f32`, on a plan of an AVX-512
    /// kernel), or `f32::mul_add` in the same order (`portable_block_f32`): the same bits.
    pub fn add_images_f32(
        &self,
        x: &[f32],
        dy: &[f32],
        images: usize,
        dw: &mut [f32],
        parallel: bool,
    ) {
        let block: Block<f32> = match self.imp {
            #[cfg(target_arch = "x86_64")]
            Imp::Dot | Imp::Fma => x86::block_f32,
            _ => portable_block_f32,
        };
        self.add_images_with(x, dy, images, dw, parallel, block)
    }

    fn add_images_with<E: Copy + Sync>(
        &self,
        x: &[E],
        dy: &[E],
        images: usize,
        dw: &mut [f32],
        parallel: bool,
        block: Block<E>,
    ) {
        let g = &self.g;
        assert!(
            x.len() >= images * g.in_image()
                && dy.len() >= images * g.out_image()
                && dw.len() >= g.weight_len(),
            "conv_wgrad: buffers too small for {images} images of {g:?}"
        );
        let group = self.group_len(std::mem::size_of::<E>());
        for first in (0..images).step_by(group) {
            let count = group.min(images - first);
            let xs = &x[first * g.in_image()..(first + count) * g.in_image()];
            let dys = &dy[first * g.out_image()..(first + count) * g.out_image()];
            self.add_group(xs, dys, count, dw, parallel, block);
        }
    }

    /// Images per group: as many as keep a block's `RB + CB` rows of every image in
    /// `GROUP_BYTES` (so the kernel offsets after the first read them from L1), at least one.
    /// More images per group add the lanes less often; 16–128 KiB measured the same within
    /// the noise on ResNet-20's layers (Zen 5, 48 KiB L1).
    fn group_len(&self, elem_bytes: usize) -> usize {
        let row_bytes = self.g.l() * elem_bytes;
        (GROUP_BYTES / ((RB + CB) * row_bytes).max(1)).max(1)
    }

    fn add_group<E: Copy + Sync>(
        &self,
        x: &[E],
        dy: &[E],
        images: usize,
        dw: &mut [f32],
        parallel: bool,
        block: Block<E>,
    ) {
        let g = &self.g;
        let (l, hw, kk) = (g.l(), g.h * g.w, g.kh * g.kw);
        let (row_blocks, col_blocks) = (g.c_out.div_ceil(RB), g.c_in.div_ceil(CB));
        let tasks = row_blocks * col_blocks * kk;
        let strides = (g.out_image(), g.in_image());
        // Task t: kernel offset t % kk of row block and column block t / kk.
        let run = |t: usize| -> [[f32; CB]; RB] {
            let (r, rc) = (t % kk, t / kk);
            let (o0, c0) = ((rc / col_blocks) * RB, (rc % col_blocks) * CB);
            // Rows and columns past the last are read again from the last and not stored.
            let dy_rows: [*const E; RB] = std::array::from_fn(|i| {
                let o = (o0 + i).min(g.c_out - 1);
                dy[o * l..].as_ptr()
            });
            let x_rows: [*const E; CB] = std::array::from_fn(|j| {
                let c = (c0 + j).min(g.c_in - 1);
                x[c * hw..].as_ptr()
            });
            let rows = Rows {
                dy: dy_rows,
                x: x_rows,
                strides,
                images,
                shift: self.shifts[r],
                masks: &self.masks[r * self.chunks..(r + 1) * self.chunks],
                tail: &self.tail,
            };
            // SAFETY: `block` is the portable block, or a SIMD one chosen only where the CPU
            // has its features (`with_kernel`: `Kernel::is_available`, AVX-512 BW). Row
            // pointers start planes of image 0; image `i`'s are `i` strides on, inside `x` and
            // `dy` (checked by `add_images_with`); a set bit of `tail[q]` is a pixel
            // `32q + e < l`, and a set bit of `masks[q]` one whose input `32q + e + shift`
            // lies in `0..hw`; the blocks read no lane whose bit is clear.
            unsafe { block(&rows) }
        };
        let sums: Vec<[[f32; CB]; RB]> = if parallel && tasks > 1 {
            crate::threads::nudge();
            crate::cpu::chunked::map_collect(tasks, 1, || (), |_, t| run(t))
        } else {
            (0..tasks).map(run).collect()
        };
        for (t, s) in sums.iter().enumerate() {
            let (r, rc) = (t % kk, t / kk);
            let (o0, c0) = ((rc / col_blocks) * RB, (rc % col_blocks) * CB);
            for (i, row) in s.iter().enumerate().take(g.c_out - o0) {
                for (j, &v) in row.iter().enumerate().take(g.c_in - c0) {
                    dw[((o0 + i) * g.c_in + c0 + j) * kk + r] += v;
                }
            }
        }
    }
}

/// A block's dot products (`portable_block`, `x86::block`...).
type Block<E> = unsafe fn(&Rows<'_, E>) -> [[f32; CB]; RB];

/// What a stride-1 convolution whose output rows are as long as its input rows reads, for
/// code that walks its output pixels in chunks of `chunk` (≤ 32) straight from the image
/// (`WgradPlan`, `direct::DirectPlan`): output pixel `p` of kernel offset
/// `r = ki·kw + kj` reads input pixel `p + shifts[r]` of each plane.
pub(crate) struct ShiftMasks {
    /// Chunks of output pixels: `ceil(L / chunk)`.
    pub chunks: usize,
    pub shifts: Vec<isize>,
    /// `masks[r * chunks + q]`: bit `e` set where pixel `chunk·q + e` of kernel offset `r`
    /// reads an input pixel (not padding, not past the output).
    pub masks: Vec<u32>,
    /// `tail[q]`: bit `e` set where pixel `chunk·q + e` is an output pixel.
    pub tail: Vec<u32>,
}

impl ShiftMasks {
    pub fn new(g: &Conv2dGeom, chunk: usize) -> Self {
        assert!((1..=32).contains(&chunk), "a chunk's mask is a u32");
        let (l, w, h) = (g.l(), g.w as isize, g.h as isize);
        let chunks = l.div_ceil(chunk);
        let mut shifts = Vec::with_capacity(g.kh * g.kw);
        let mut masks = vec![0u32; g.kh * g.kw * chunks];
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let r = ki * g.kw + kj;
                let off_h = (ki * g.dilation.0) as isize - g.padding.0 as isize;
                let off_w = (kj * g.dilation.1) as isize - g.padding.1 as isize;
                shifts.push(off_h * w + off_w);
                for p in 0..l {
                    let (ih, iw) = ((p / g.w) as isize + off_h, (p % g.w) as isize + off_w);
                    if (0..h).contains(&ih) && (0..w).contains(&iw) {
                        masks[r * chunks + p / chunk] |= 1 << (p % chunk);
                    }
                }
            }
        }
        let tail = (0..chunks)
            .map(|q| u32::MAX >> (32 - (l - q * chunk).min(chunk)))
            .collect();
        ShiftMasks {
            chunks,
            shifts,
            masks,
            tail,
        }
    }
}

/// Whether the CPU has AVX-512 BW (the masked 16-bit loads of `x86::block_fma`).
fn has_avx512bw() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpu_has!(Avx512bw)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What one block reads: `RB` rows of `dy` and `CB` planes of `x` (image 0's; image `i`'s
/// are `i · strides` elements on), over `images` images, at one kernel offset.
struct Rows<'a, E> {
    dy: [*const E; RB],
    x: [*const E; CB],
    /// Elements from one image to the next in `dy` and in `x`.
    strides: (usize, usize),
    images: usize,
    shift: isize,
    masks: &'a [u32],
    tail: &'a [u32],
}

/// The sum of 16 lanes as a fixed tree: lanes `i` and `i + 8`, then `i + 4`, `+ 2`, `+ 1`.
#[inline(always)]
fn lane_sum(mut v: [f32; 16]) -> f32 {
    let mut half = 8;
    while half > 0 {
        for i in 0..half {
            v[i] += v[i + half];
        }
        half /= 2;
    }
    v[0]
}

/// `portable-bf16-pairs`' block: `sums[i][j] = Σ_p dy[i][p] · x[j][p + shift]` over the
/// images and the pixels of set mask bits, in `x86::block`'s order.
///
/// # Safety
/// As `x86::block`, without the CPU features.
unsafe fn portable_block(rows: &Rows<'_, u16>) -> [[f32; CB]; RB] {
    let mut acc = [[[0f32; 16]; CB]; RB];
    let lanes = |row: *const u16, off: isize, mask: u32| -> [f32; CHUNK] {
        std::array::from_fn(|e| {
            if mask >> e & 1 == 1 {
                // SAFETY: the caller guarantees that set bits address elements of the row.
                let bits = unsafe { *row.wrapping_offset(off + e as isize) };
                f32::from_bits((bits as u32) << 16)
            } else {
                0.0
            }
        })
    };
    for img in 0..rows.images {
        let (dy_at, x_at) = (img * rows.strides.0, img * rows.strides.1);
        for (q, (&mx, &mt)) in rows.masks.iter().zip(rows.tail).enumerate() {
            if mx == 0 {
                continue;
            }
            let off = (q * CHUNK) as isize;
            let d: [[f32; CHUNK]; RB] =
                std::array::from_fn(|i| lanes(rows.dy[i].wrapping_add(dy_at), off, mt));
            for (j, &xr) in rows.x.iter().enumerate() {
                let xv = lanes(xr.wrapping_add(x_at), off + rows.shift, mx);
                for (acc_row, dv) in acc.iter_mut().zip(&d) {
                    for (e, a) in acc_row[j].iter_mut().enumerate() {
                        // As `vdpbf16ps`: the odd element's exact product first, then the
                        // even's.
                        *a += dv[2 * e + 1] * xv[2 * e + 1];
                        *a += dv[2 * e] * xv[2 * e];
                    }
                }
            }
        }
    }
    acc.map(|row| row.map(lane_sum))
}

/// The F32 block, portable: `sums[i][j] = Σ_p dy[i][p] · x[j][p + shift]`, lane `e` of a
/// chunk of 32 pixels adding pixel `e`, then pixel `16 + e`, each by one fused multiply-add
/// (`f32::mul_add`), as `x86::block_f32` does.
///
/// # Safety
/// As `x86::block_f32`, without the CPU features.
unsafe fn portable_block_f32(rows: &Rows<'_, f32>) -> [[f32; CB]; RB] {
    let mut acc = [[[0f32; 16]; CB]; RB];
    let lanes = |row: *const f32, off: isize, mask: u32| -> [f32; CHUNK] {
        std::array::from_fn(|e| {
            if mask >> e & 1 == 1 {
                // SAFETY: the caller guarantees that set bits address elements of the row.
                unsafe { *row.wrapping_offset(off + e as isize) }
            } else {
                0.0
            }
        })
    };
    for img in 0..rows.images {
        let (dy_at, x_at) = (img * rows.strides.0, img * rows.strides.1);
        for (q, (&mx, &mt)) in rows.masks.iter().zip(rows.tail).enumerate() {
            if mx == 0 {
                continue;
            }
            let off = (q * CHUNK) as isize;
            let d: [[f32; CHUNK]; RB] =
                std::array::from_fn(|i| lanes(rows.dy[i].wrapping_add(dy_at), off, mt));
            for (j, &xr) in rows.x.iter().enumerate() {
                let xv = lanes(xr.wrapping_add(x_at), off + rows.shift, mx);
                for (acc_row, dv) in acc.iter_mut().zip(&d) {
                    for (e, a) in acc_row[j].iter_mut().enumerate() {
                        *a = dv[e].mul_add(xv[e], *a);
                        *a = dv[16 + e].mul_add(xv[16 + e], *a);
                    }
                }
            }
        }
    }
    acc.map(|row| row.map(lane_sum))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Rows, CB, CHUNK, RB};
    use std::arch::x86_64::*;

    /// `RB × CB` dot products over masked chunks of 32 pixels with `vdpbf16ps`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and BF16. For every image `i < rows.images` and chunk `q`,
    /// each set bit `e` of `tail[q]` addresses element `i · strides.0 + 32q + e` inside each
    /// `dy` row's allocation, and each set bit of `masks[q]` element
    /// `i · strides.1 + 32q + e + shift` inside each `x` row's; masked-off lanes are not read
    /// (AVX-512 masked loads suppress their faults), so their addresses need not be valid.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn block(rows: &Rows<'_, u16>) -> [[f32; CB]; RB] {
        let mut acc = [[_mm512_setzero_ps(); CB]; RB];
        let chunks = rows.masks.len();
        assert_eq!(rows.tail.len(), chunks, "a tail mask per chunk");
        // Every row as an offset from the block's first (loop-invariant registers), so each
        // load is one instruction on a base that moves with the chunk.
        let (dy0, x0) = (rows.dy[0], rows.x[0]);
        let dy_off: [isize; RB] = std::array::from_fn(|i| (rows.dy[i] as isize - dy0 as isize) / 2);
        let x_off: [isize; CB] = std::array::from_fn(|j| (rows.x[j] as isize - x0 as isize) / 2);
        for img in 0..rows.images {
            let dy_img = dy0.wrapping_add(img * rows.strides.0);
            let x_img = x0
                .wrapping_add(img * rows.strides.1)
                .wrapping_offset(rows.shift);
            for q in 0..chunks {
                // SAFETY: q < chunks, the length of both (asserted above).
                let (mx, mt) =
                    unsafe { (*rows.masks.get_unchecked(q), *rows.tail.get_unchecked(q)) };
                if mx == 0 {
                    continue;
                }
                let (dp, xp) = (
                    dy_img.wrapping_add(q * CHUNK),
                    x_img.wrapping_add(q * CHUNK),
                );
                // SAFETY: the caller's contract on set bits; the transmutes reinterpret 512
                // bits of integers as 32 BF16 (same size, any bits).
                unsafe {
                    let mut d = [_mm512_setzero_si512(); RB];
                    for i in 0..RB {
                        let p = dp.wrapping_offset(dy_off[i]).cast::<i16>();
                        d[i] = _mm512_maskz_loadu_epi16(mt, p);
                    }
                    let d: [__m512bh; RB] = std::mem::transmute(d);
                    for j in 0..CB {
                        let p = xp.wrapping_offset(x_off[j]).cast::<i16>();
                        let xv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mx, p));
                        for i in 0..RB {
                            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], d[i], xv);
                        }
                    }
                }
            }
        }
        let mut sums = [[0f32; CB]; RB];
        for i in 0..RB {
            for j in 0..CB {
                sums[i][j] = lane_sum_zmm(acc[i][j]);
            }
        }
        sums
    }

    /// `block` with F32 FMAs: each 32-bit lane of a 64-byte load holds a pair, its high half
    /// (the odd element) is an F32 once the low half is cleared and its low half (the even
    /// element) once shifted up, and the two products go in `vdpbf16ps`' order, odd first.
    /// Products of BF16 values are exact in F32, so each FMA rounds once, as the twin's add
    /// does: the same bits as `portable_block`, subnormals included.
    ///
    /// # Safety
    /// As `block`, with AVX-512 F and BW instead of BF16.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn block_fma(rows: &Rows<'_, u16>) -> [[f32; CB]; RB] {
        let mut acc = [[_mm512_setzero_ps(); CB]; RB];
        let chunks = rows.masks.len();
        assert_eq!(rows.tail.len(), chunks, "a tail mask per chunk");
        let (dy0, x0) = (rows.dy[0], rows.x[0]);
        let dy_off: [isize; RB] = std::array::from_fn(|i| (rows.dy[i] as isize - dy0 as isize) / 2);
        let x_off: [isize; CB] = std::array::from_fn(|j| (rows.x[j] as isize - x0 as isize) / 2);
        let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for img in 0..rows.images {
            let dy_img = dy0.wrapping_add(img * rows.strides.0);
            let x_img = x0
                .wrapping_add(img * rows.strides.1)
                .wrapping_offset(rows.shift);
            for q in 0..chunks {
                // SAFETY: q < chunks, the length of both (asserted above).
                let (mx, mt) =
                    unsafe { (*rows.masks.get_unchecked(q), *rows.tail.get_unchecked(q)) };
                if mx == 0 {
                    continue;
                }
                let (dp, xp) = (
                    dy_img.wrapping_add(q * CHUNK),
                    x_img.wrapping_add(q * CHUNK),
                );
                // SAFETY: the caller's contract on set bits.
                unsafe {
                    let mut d_odd = [_mm512_setzero_ps(); RB];
                    let mut d_even = [_mm512_setzero_ps(); RB];
                    for i in 0..RB {
                        let p = dp.wrapping_offset(dy_off[i]).cast::<i16>();
                        let v = _mm512_maskz_loadu_epi16(mt, p);
                        d_odd[i] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                        d_even[i] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                    }
                    for j in 0..CB {
                        let p = xp.wrapping_offset(x_off[j]).cast::<i16>();
                        let v = _mm512_maskz_loadu_epi16(mx, p);
                        let x_odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                        let x_even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                        for i in 0..RB {
                            acc[i][j] = _mm512_fmadd_ps(d_odd[i], x_odd, acc[i][j]);
                            acc[i][j] = _mm512_fmadd_ps(d_even[i], x_even, acc[i][j]);
                        }
                    }
                }
            }
        }
        let mut sums = [[0f32; CB]; RB];
        for i in 0..RB {
            for j in 0..CB {
                sums[i][j] = lane_sum_zmm(acc[i][j]);
            }
        }
        sums
    }

    /// `block` on F32 planes: each 32-pixel chunk as two 16-lane halves, pixel `e` then
    /// pixel `16 + e` into lane `e`, one FMA each.
    ///
    /// # Safety
    /// As `block`, with AVX-512 F instead of BW and BF16, on F32 rows.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_f32(rows: &Rows<'_, f32>) -> [[f32; CB]; RB] {
        let mut acc = [[_mm512_setzero_ps(); CB]; RB];
        let chunks = rows.masks.len();
        assert_eq!(rows.tail.len(), chunks, "a tail mask per chunk");
        let (dy0, x0) = (rows.dy[0], rows.x[0]);
        let dy_off: [isize; RB] = std::array::from_fn(|i| (rows.dy[i] as isize - dy0 as isize) / 4);
        let x_off: [isize; CB] = std::array::from_fn(|j| (rows.x[j] as isize - x0 as isize) / 4);
        for img in 0..rows.images {
            let dy_img = dy0.wrapping_add(img * rows.strides.0);
            let x_img = x0
                .wrapping_add(img * rows.strides.1)
                .wrapping_offset(rows.shift);
            for q in 0..chunks {
                // SAFETY: q < chunks, the length of both (asserted above).
                let (mx, mt) =
                    unsafe { (*rows.masks.get_unchecked(q), *rows.tail.get_unchecked(q)) };
                if mx == 0 {
                    continue;
                }
                let (dp, xp) = (
                    dy_img.wrapping_add(q * CHUNK),
                    x_img.wrapping_add(q * CHUNK),
                );
                let (mt_lo, mt_hi) = (mt as u16, (mt >> 16) as u16);
                let (mx_lo, mx_hi) = (mx as u16, (mx >> 16) as u16);
                // SAFETY: the caller's contract on set bits.
                unsafe {
                    let mut d_lo = [_mm512_setzero_ps(); RB];
                    let mut d_hi = [_mm512_setzero_ps(); RB];
                    for i in 0..RB {
                        let p = dp.wrapping_offset(dy_off[i]);
                        d_lo[i] = _mm512_maskz_loadu_ps(mt_lo, p);
                        d_hi[i] = _mm512_maskz_loadu_ps(mt_hi, p.wrapping_add(16));
                    }
                    for j in 0..CB {
                        let p = xp.wrapping_offset(x_off[j]);
                        let x_lo = _mm512_maskz_loadu_ps(mx_lo, p);
                        let x_hi = _mm512_maskz_loadu_ps(mx_hi, p.wrapping_add(16));
                        for i in 0..RB {
                            acc[i][j] = _mm512_fmadd_ps(d_lo[i], x_lo, acc[i][j]);
                            acc[i][j] = _mm512_fmadd_ps(d_hi[i], x_hi, acc[i][j]);
                        }
                    }
                }
            }
        }
        let mut sums = [[0f32; CB]; RB];
        for i in 0..RB {
            for j in 0..CB {
                sums[i][j] = lane_sum_zmm(acc[i][j]);
            }
        }
        sums
    }

    /// `super::lane_sum` of a register: lanes `i` and `i + 8` first, then `+ 4`, `+ 2`, `+ 1`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lane_sum_zmm(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }
}
