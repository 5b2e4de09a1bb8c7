//! Forward convolutions with few output channels as FMAs read straight from the image.
//!
//! `conv::image_forward` computes `y [c_out, L] = w [c_out, K] · col [K, L]` on hemi's GEMM,
//! which packs `col` (from the image, or from im2col) into panels before multiplying. With
//! 16 output channels each packed element feeds only 16 multiply-adds, so on ResNet-20's
//! first stage (`hemi bench conv --layers resnet20-16 --threads 1`, one Emerald Rapids core)
//! the packing held the forward to about 73 GFLOP/s, under half of that core's F32 FMA peak.
//!
//! For a stride-1 convolution whose output rows are as long as its input rows (the 'same'
//! convolutions of ResNets), output pixel `p` of kernel offset `r = ki·kw + kj` reads input
//! pixel `p + s_r` of each channel, `s_r = (ki·dh − ph)·W + kj·dw − pw`, unless that input
//! lies in the padding. So a run of 16 output pixels reads a run of 16 input pixels, one
//! masked 64-byte load (32 bytes for F16 and BF16, widened), whatever the shift; a 16-lane mask per
//! kernel offset and chunk of 16 pixels zeroes the pixels whose input is padding. Blocks of
//! `RO` output channels × `PC` chunks keep `RO·PC` accumulators in registers; each k step
//! (channel, kernel offset) loads `PC` input vectors, broadcasts `RO` weights and does
//! `RO·PC` FMAs. Nothing is packed.
//!
//! Each output element sums its k steps in order from zero, one FMA (one rounding) each, then
//! the bias is added: what the GEMM does where `K` fits one k block. The portable twin does
//! the same with `f32::mul_add`, so the two give the same bits (`tests/kernels/conv_direct.rs`).

use half::{bf16, f16};

use crate::backend::nn::Conv2dGeom;
use crate::cpu::conv::wgrad::ShiftMasks;

/// Output channels per block.
const RO: usize = 8;
/// Chunks of 16 pixels per block.
const PC: usize = 3;
/// Pixels per chunk: one 16-lane F32 vector.
const CHUNK: usize = 16;
/// The most output channels `DirectPlan::new` takes: the route was measured faster only at
/// 16 (ResNet-20's first stage, bench/RESULTS.md); with more, each packed column value feeds
/// more multiply-adds, and the GEMM keeps those layers until a measurement says otherwise.
pub const MAX_C_OUT: usize = 16;

/// One convolution's forward from the image: its geometry, the weights as F32 in k-major
/// order (`wt[k · cop + o]`, `cop` = `c_out` rounded up to `RO`, zero past it), the shift of
/// each kernel offset and the masks of its chunks.
#[derive(Clone, Debug)]
pub struct DirectPlan {
    simd: bool,
    g: Conv2dGeom,
    cop: usize,
    wt: Vec<f32>,
    chunks: usize,
    shifts: Vec<isize>,
    /// `masks[r * chunks + q]`: bit `e` set where output pixel `16q + e` of kernel offset `r`
    /// reads an input pixel (not padding, not past the output).
    masks: Vec<u16>,
    /// `tail[q]`: bit `e` set where pixel `16q + e` is an output pixel.
    tail: Vec<u16>,
}

/// The element types the convolutions read from the image (`DirectPlan` here,
/// `implicit::ImplicitPlan`) take: F32, and F16 and BF16 (widened to F32 as loaded).
pub trait DirectElem: Copy + Sync + sealed::Sealed {}
impl DirectElem for f32 {}
impl DirectElem for f16 {}
impl DirectElem for bf16 {}
mod sealed {
    use half::{bf16, f16};

    /// How the SIMD block loads an element type.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        F32,
        F16,
        Bf16,
    }
    pub trait Sealed: Sized {
        const KIND: Kind;
        /// The element as F32 (exact).
        fn to_f32(self) -> f32;
        /// `src` as F32 into `dst` (same length; exact).
        fn widen(src: &[Self], dst: &mut [f32]);
    }
    impl Sealed for f32 {
        const KIND: Kind = Kind::F32;
        fn to_f32(self) -> f32 {
            self
        }
        fn widen(src: &[f32], dst: &mut [f32]) {
            dst.copy_from_slice(src);
        }
    }
    impl Sealed for f16 {
        const KIND: Kind = Kind::F16;
        fn to_f32(self) -> f32 {
            f16::to_f32(self)
        }
        // The F16C loop itself, not `convert::f16_to_f32`: rows are short (8–32 pixels on
        // ResNet-20), and that call's dispatch per row was 4 % of an amp-fp16 step.
        fn widen(src: &[f16], dst: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if crate::dtype::convert::has_f16c() {
                // SAFETY: the CPU has AVX and F16C (`has_f16c`).
                return unsafe { crate::dtype::convert::f16_to_f32_f16c(src, dst) };
            }
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
    impl Sealed for bf16 {
        const KIND: Kind = Kind::Bf16;
        fn to_f32(self) -> f32 {
            bf16::to_f32(self)
        }
        // Inline: the rows widened are short (8 pixels on ResNet-20's last stage), where a
        // call to `convert::bf16_to_f32` per row would cost about as much as the widening.
        fn widen(src: &[bf16], dst: &mut [f32]) {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
}
use sealed::Kind;

impl DirectPlan {
    /// The plan where this file is the faster route: a stride-1, ungrouped convolution with
    /// output rows as long as its input rows and at most `MAX_C_OUT` output channels, on a CPU
    /// with AVX-512 F, BW and VL; `None` otherwise. `w` is `[c_out, c_in, kh, kw]`.
    pub fn new<T: DirectElem>(g: &Conv2dGeom, w: &[T]) -> Option<Self> {
        if g.c_out > MAX_C_OUT || !simd_available() {
            return None;
        }
        Self::with_simd(g, w, true)
    }

    /// The plan on the AVX-512 block (`simd`, where the CPU has it) or its portable twin;
    /// `None` for convolutions it does not read (strided, grouped, output rows of another
    /// length than input rows, no output) and for `simd` on a CPU without AVX-512 F/BW/VL.
    pub fn with_simd<T: DirectElem>(g: &Conv2dGeom, w: &[T], simd: bool) -> Option<Self> {
        if simd && !simd_available() {
            return None;
        }
        if g.groups != 1 || g.stride != (1, 1) || g.w_out != g.w || g.l() == 0 || g.c_in == 0 {
            return None;
        }
        assert!(
            w.len() >= g.weight_len(),
            "conv_direct: weights too short for {g:?}"
        );
        let k = g.k();
        let cop = g.c_out.next_multiple_of(RO);
        let mut wt = vec![0f32; k * cop];
        for o in 0..g.c_out {
            for (kx, &v) in w[o * k..(o + 1) * k].iter().enumerate() {
                wt[kx * cop + o] = v.to_f32();
            }
        }
        let ShiftMasks {
            chunks,
            shifts,
            masks,
            tail,
        } = ShiftMasks::new(g, CHUNK);
        // 16-pixel chunks: every mask fits the 16 lanes of one F32 vector.
        let lanes16 = |v: Vec<u32>| v.into_iter().map(|m| m as u16).collect();
        let (masks, tail) = (lanes16(masks), lanes16(tail));
        Some(DirectPlan {
            simd,
            g: *g,
            cop,
            wt,
            chunks,
            shifts,
            masks,
            tail,
        })
    }

    /// One image: `y [c_out, L] = bias + w · col(x)`, `x [c_in, h, w]` as stored, `bias`
    /// (`[c_out]`) or zeros.
    pub fn image<T: DirectElem>(&self, x: &[T], bias: Option<&[f32]>, y: &mut [f32]) {
        let g = &self.g;
        assert!(
            x.len() >= g.in_image() && y.len() >= g.out_image(),
            "conv_direct: buffers too small for one image of {g:?}"
        );
        assert!(
            bias.is_none_or(|b| b.len() >= g.c_out),
            "conv_direct: bias too short"
        );
        for o0 in (0..g.c_out).step_by(RO) {
            for q0 in (0..self.chunks).step_by(PC) {
                let block = Block { plan: self, o0, q0 };
                // SAFETY: `simd` only where the CPU has AVX-512 F/BW/VL (`with_simd`); `x`
                // holds one image and `y` one output (asserted); a set mask bit addresses an
                // input pixel inside its plane (`with_simd`) and a set tail bit an output pixel.
                unsafe {
                    match (self.simd, T::KIND) {
                        #[cfg(target_arch = "x86_64")]
                        (true, Kind::F32) => x86::block_f32(&block, x.as_ptr().cast(), bias, y),
                        #[cfg(target_arch = "x86_64")]
                        (true, Kind::F16) => x86::block_f16(&block, x.as_ptr().cast(), bias, y),
                        #[cfg(target_arch = "x86_64")]
                        (true, Kind::Bf16) => x86::block_bf16(&block, x.as_ptr().cast(), bias, y),
                        _ => portable_block(&block, x, bias, y),
                    }
                }
            }
        }
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpu_has!(Avx512f) && cpu_has!(Avx512bw) && cpu_has!(Avx512vl)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One block of `RO` output channels from `o0` and `PC` chunks from `q0`.
struct Block<'a> {
    plan: &'a DirectPlan,
    o0: usize,
    q0: usize,
}

/// The portable block: the SIMD blocks' sums in their order, with `f32::mul_add`.
#[allow(clippy::needless_range_loop)] // acc[o][q][e] indexed by all three, as the SIMD block
fn portable_block<T: DirectElem>(b: &Block<'_>, x: &[T], bias: Option<&[f32]>, y: &mut [f32]) {
    let p = b.plan;
    let g = &p.g;
    let (hw, kk, l) = (g.h * g.w, g.kh * g.kw, g.l());
    let mut acc = [[[0f32; CHUNK]; PC]; RO];
    for c in 0..g.c_in {
        for r in 0..kk {
            let wrow = &p.wt[(c * kk + r) * p.cop + b.o0..][..RO];
            for q in 0..PC {
                let chunk = b.q0 + q;
                let mask = if chunk < p.chunks {
                    p.masks[r * p.chunks + chunk]
                } else {
                    0
                };
                for e in 0..CHUNK {
                    let xv = if mask >> e & 1 == 1 {
                        let at = (c * hw) as isize + (chunk * CHUNK + e) as isize + p.shifts[r];
                        x[at as usize].to_f32()
                    } else {
                        0.0
                    };
                    for (o, &wv) in wrow.iter().enumerate() {
                        acc[o][q][e] = wv.mul_add(xv, acc[o][q][e]);
                    }
                }
            }
        }
    }
    for (o, rows) in acc.iter().enumerate().take(g.c_out.saturating_sub(b.o0)) {
        let oc = b.o0 + o;
        for (q, lanes) in rows.iter().enumerate() {
            let chunk = b.q0 + q;
            if chunk >= p.chunks {
                break;
            }
            for (e, &v) in lanes.iter().enumerate() {
                let px = chunk * CHUNK + e;
                if px < l {
                    y[oc * l + px] = bias.map_or(0.0, |bs| bs[oc]) + v;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Block, CHUNK, PC, RO};
    use std::arch::x86_64::*;

    /// The block on F32 planes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VL; `x` points to one image of the plan's geometry and
    /// `y` holds one output; `bias`, where given, `c_out` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn block_f32(
        b: &Block<'_>,
        x: *const f32,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) {
        // SAFETY: forwarded; the loader reads 16 F32 under the mask.
        unsafe {
            block(b, bias, y, |c_off: isize, m: u16| {
                _mm512_maskz_loadu_ps(m, x.wrapping_offset(c_off))
            })
        }
    }

    /// The block on BF16 planes: 16 BF16 under the mask, each widened to F32 (a 16-bit
    /// shift: exact).
    ///
    /// # Safety
    /// As `block_f32`, with BF16 planes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn block_bf16(
        b: &Block<'_>,
        x: *const u16,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) {
        // SAFETY: forwarded; the loader reads 16 BF16 under the mask.
        unsafe {
            block(b, bias, y, |c_off: isize, m: u16| {
                let h = _mm256_maskz_loadu_epi16(m, x.wrapping_offset(c_off).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            })
        }
    }

    /// The block on F16 planes: 16 F16 under the mask, each widened to F32 (`vcvtph2ps`:
    /// exact).
    ///
    /// # Safety
    /// As `block_f32`, with F16 planes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn block_f16(
        b: &Block<'_>,
        x: *const u16,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) {
        // SAFETY: forwarded; the loader reads 16 F16 under the mask.
        unsafe {
            block(b, bias, y, |c_off: isize, m: u16| {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x.wrapping_offset(c_off).cast()))
            })
        }
    }

    /// `RO × PC` accumulators over the k steps; `load(off, mask)` is the 16 pixels from
    /// element `off` of the image, masked.
    ///
    /// # Safety
    /// As `block_f32`; `load` reads no lane whose mask bit is clear.
    #[inline(always)]
    unsafe fn block(
        b: &Block<'_>,
        bias: Option<&[f32]>,
        y: &mut [f32],
        load: impl Fn(isize, u16) -> __m512,
    ) {
        let p = b.plan;
        let g = &p.g;
        let (hw, kk, l) = (g.h * g.w, g.kh * g.kw, g.l());
        let mut acc = [[_mm512_setzero_ps(); PC]; RO];
        let masks: [&[u16]; PC] = std::array::from_fn(|q| {
            let chunk = b.q0 + q;
            if chunk < p.chunks {
                &p.masks[chunk..]
            } else {
                &[]
            }
        });
        for c in 0..g.c_in {
            for r in 0..kk {
                let base = (c * hw) as isize + p.shifts[r];
                // SAFETY: the weight row has `cop` ≥ o0 + RO entries at this k.
                let wrow = unsafe { p.wt.as_ptr().add((c * kk + r) * p.cop + b.o0) };
                let mut xv = [_mm512_setzero_ps(); PC];
                for q in 0..PC {
                    let m = masks[q].get(r * p.chunks).copied().unwrap_or(0);
                    xv[q] = load(base + ((b.q0 + q) * CHUNK) as isize, m);
                }
                for (o, acc_o) in acc.iter_mut().enumerate() {
                    // SAFETY: o < RO entries of the row (above).
                    let wv = _mm512_set1_ps(unsafe { *wrow.add(o) });
                    for q in 0..PC {
                        acc_o[q] = _mm512_fmadd_ps(wv, xv[q], acc_o[q]);
                    }
                }
            }
        }
        for (o, acc_o) in acc.iter().enumerate().take(g.c_out.saturating_sub(b.o0)) {
            let oc = b.o0 + o;
            let bv = _mm512_set1_ps(bias.map_or(0.0, |bs| bs[oc]));
            for (q, &v) in acc_o.iter().enumerate() {
                let chunk = b.q0 + q;
                if chunk >= p.chunks {
                    break;
                }
                let at = oc * l + chunk * CHUNK;
                // SAFETY: the tail mask's lanes are output pixels of row `oc`, inside `y`.
                unsafe {
                    _mm512_mask_storeu_ps(
                        y.as_mut_ptr().add(at),
                        p.tail[chunk],
                        _mm512_add_ps(bv, v),
                    )
                };
            }
        }
    }
}
