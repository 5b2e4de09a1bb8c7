//! Bulk conversion between F32/F64 and the half-precision storage types F16 and BF16.
//!
//! This module owns every slice conversion hemi does between float dtypes, and with it the
//! conversion half of the precision contract: exact where the value fits, one rounding to
//! nearest-even otherwise, overflow to ±inf, NaN stays NaN (made quiet, sign kept),
//! subnormals handled exactly. Every function here is bit-identical to converting element by
//! element with `half`'s scalar `from_f32` / `to_f32`; the F64 -> F16/BF16 paths are the
//! exception on purpose, because `half` rounds those twice (see `f64_to_f32_round_odd`).
//!
//! How each direction is made fast:
//! - F32 <-> F16: `half`'s slice API, which uses F16C (`vcvtps2ph` / `vcvtph2ps`) when the CPU
//!   has it, detected at run time.
//! - F32 -> BF16: our own kernels. `half`'s BF16 slice conversion is a scalar loop with a
//!   branch per element. The portable kernel is a branch-free bit trick that LLVM
//!   auto-vectorises; it is compiled twice, for the baseline target and for AVX2, and on CPUs
//!   with AVX-512 BF16 a `vcvtne2ps2bf16` kernel takes over (with a fix-up for the one input
//!   class where the instruction differs from IEEE rounding: F32 subnormals).
//! - BF16 -> F32: a 16-bit shift (plus the quiet bit for NaN), auto-vectorised.
//! - Slices of at least `PAR_MIN_LEN` elements are split across rayon's pool: one core cannot
//!   saturate memory bandwidth on these streaming loops, two come closer.

use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

/// Below this many elements a conversion runs on the calling thread. Measured on a 2-core
/// Zen 3 (idle): at 128K elements splitting loses (fork/join costs more than it saves), from
/// 256K on it wins, at 512K by 1.2-1.6x, at 16M (memory bound) by 1.5x.
const PAR_MIN_LEN: usize = 1 << 19;
/// Elements per rayon task: big enough to amortise scheduling, small enough that all threads
/// get work and finish together.
const PAR_CHUNK: usize = 1 << 16;
/// Elements per stack buffer in the two-step F64 -> F16/BF16 conversions (2 KiB of F32):
/// small enough to stay in L1 between the two steps.
const F64_STEP: usize = 512;

/// F32 -> F16, round to nearest-even. `src.len() == dst.len()`.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    check_len(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: the CPU has AVX and F16C.
        return run(src, dst, |s, d| unsafe { x86::f32_to_f16_f16c(s, d) });
    }
    run(src, dst, |s, d| d.convert_from_f32_slice(s));
}

/// F16 -> F32, exact.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    check_len(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if x86::has_f16c() {
        // SAFETY: the CPU has AVX and F16C.
        return run(src, dst, |s, d| unsafe { x86::f16_to_f32_f16c(s, d) });
    }
    run(src, dst, |s, d| s.convert_to_f32_slice(d));
}

/// F32 -> BF16, round to nearest-even, NaN stays a quiet NaN.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    check_len(src.len(), dst.len());
    run(src, dst, f32_to_bf16_kernel());
}

/// BF16 -> F32, exact (a signalling NaN comes back quiet, as `bf16::to_f32` does).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    check_len(src.len(), dst.len());
    run(src, dst, bf16_to_f32_kernel());
}

/// F64 -> F16, one rounding (direct, not through F32).
pub fn f64_to_f16(src: &[f64], dst: &mut [f16]) {
    check_len(src.len(), dst.len());
    run(src, dst, |s, d| {
        let mut tmp = [0f32; F64_STEP];
        for (s, d) in s.chunks(F64_STEP).zip(d.chunks_mut(F64_STEP)) {
            let tmp = &mut tmp[..s.len()];
            f64_to_f32_round_odd_slice(s, tmp);
            d.convert_from_f32_slice(tmp);
        }
    });
}

/// F16 -> F64, exact.
pub fn f16_to_f64(src: &[f16], dst: &mut [f64]) {
    check_len(src.len(), dst.len());
    run(src, dst, |s, d| s.convert_to_f64_slice(d));
}

/// F64 -> BF16, one rounding (direct, not through F32).
pub fn f64_to_bf16(src: &[f64], dst: &mut [bf16]) {
    check_len(src.len(), dst.len());
    let kernel = f32_to_bf16_kernel();
    run(src, dst, |s, d| {
        let mut tmp = [0f32; F64_STEP];
        for (s, d) in s.chunks(F64_STEP).zip(d.chunks_mut(F64_STEP)) {
            let tmp = &mut tmp[..s.len()];
            f64_to_f32_round_odd_slice(s, tmp);
            kernel(tmp, d);
        }
    });
}

/// BF16 -> F64, exact.
pub fn bf16_to_f64(src: &[bf16], dst: &mut [f64]) {
    check_len(src.len(), dst.len());
    run(src, dst, |s, d| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = s.to_f64();
        }
    });
}

#[inline]
#[track_caller]
fn check_len(src: usize, dst: usize) {
    assert_eq!(
        src, dst,
        "conversion needs equal lengths: src has {src} elements, dst {dst}"
    );
}

/// Runs `kernel` over the whole slices, split across rayon's pool when they are long.
#[inline]
fn run<A, B, K>(src: &[A], dst: &mut [B], kernel: K)
where
    A: Sync,
    B: Send,
    K: Fn(&[A], &mut [B]) + Sync,
{
    if src.len() >= PAR_MIN_LEN && rayon::current_num_threads() > 1 {
        crate::threads::nudge();
        src.par_chunks(PAR_CHUNK)
            .zip(dst.par_chunks_mut(PAR_CHUNK))
            .for_each(|(s, d)| kernel(s, d));
    } else {
        kernel(src, dst);
    }
}

/// `src` converted by `convert` into a new vector, in parallel parts as in `run`. The
/// vector is not zero-filled in one pass first: that memset ran on one thread while the
/// other waited (3 % of the main thread's time in a BERT amp-bf16 step). Each part sets a
/// few kilobytes of its own uninitialised capacity to zero while they are in L1 and
/// converts into them at once.
fn collect<A, B>(src: &[A], convert: impl Fn(&[A], &mut [B]) + Sync) -> Vec<B>
where
    A: Sync,
    B: Copy + Default + Send,
{
    const STEP: usize = 4096;
    let n = src.len();
    let part = |s: &[A], d: &mut [std::mem::MaybeUninit<B>]| {
        for (s, d) in s.chunks(STEP).zip(d.chunks_mut(STEP)) {
            for x in d.iter_mut() {
                x.write(B::default());
            }
            // SAFETY: every element of `d` was just written.
            let d = unsafe { &mut *(d as *mut [std::mem::MaybeUninit<B>] as *mut [B]) };
            convert(s, d);
        }
    };
    let mut out: Vec<B> = Vec::with_capacity(n);
    let spare = &mut out.spare_capacity_mut()[..n];
    if n >= PAR_MIN_LEN && rayon::current_num_threads() > 1 {
        crate::threads::nudge();
        spare
            .par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .for_each(|(d, s)| part(s, d));
    } else {
        part(src, spare);
    }
    // SAFETY: the parts cover the first n elements and each wrote all of its own (a panic
    // propagates before this line, leaving `out` empty).
    unsafe { out.set_len(n) };
    out
}

/// `f32_to_f16` into a new vector (no zero-fill first).
pub fn f32_to_f16_vec(src: &[f32]) -> Vec<f16> {
    collect(src, f32_to_f16)
}

/// `f16_to_f32` into a new vector (no zero-fill first).
pub fn f16_to_f32_vec(src: &[f16]) -> Vec<f32> {
    collect(src, f16_to_f32)
}

/// `f32_to_bf16` into a new vector (no zero-fill first).
pub fn f32_to_bf16_vec(src: &[f32]) -> Vec<bf16> {
    collect(src, f32_to_bf16)
}

/// `bf16_to_f32` into a new vector (no zero-fill first).
pub fn bf16_to_f32_vec(src: &[bf16]) -> Vec<f32> {
    collect(src, bf16_to_f32)
}

// ---------------------------------------------------------------------------------------------
// F32 -> BF16

/// One element, as bits. Non-NaN: adding 0x7FFF plus the lowest kept bit and truncating rounds
/// to nearest-even in the integer domain; the carry walks into the exponent where it must
/// (mantissa overflow, F32 max -> inf) and the same formula is right for subnormals, since a
/// BF16 subnormal is an F32 subnormal with the low 16 bits dropped. NaN: keep the top of the
/// payload and set the quiet bit, so a payload living only in the dropped bits cannot turn the
/// NaN into an infinity. Both results are computed and one selected, without a branch, so the
/// loop vectorises. Same bits as `bf16::from_f32`.
#[inline(always)]
fn f32_to_bf16_bits(x: u32) -> u16 {
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x0040;
    let is_nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

#[inline(always)]
fn f32_to_bf16_portable(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_bits(s.to_bits()));
    }
}

/// A whole-slice F32 -> BF16 conversion (the slices have equal lengths).
type F32ToBf16 = fn(&[f32], &mut [bf16]);

/// Picks the fastest F32 -> BF16 kernel this CPU runs.
fn f32_to_bf16_kernel() -> F32ToBf16 {
    #[cfg(target_arch = "x86_64")]
    {
        if cpu_has!(Avx512bf16) && cpu_has!(Avx512f) {
            return x86::f32_to_bf16_avx512bf16;
        }
        if cpu_has!(Avx2) {
            return x86::f32_to_bf16_avx2;
        }
    }
    f32_to_bf16_portable
}

// ---------------------------------------------------------------------------------------------
// BF16 -> F32

/// One element, as bits: BF16 is the top half of an F32. NaN gets the quiet bit, as
/// `bf16::to_f32` does (and as the F16 path's `vcvtph2ps` does), so every path agrees.
#[inline(always)]
fn bf16_to_f32_bits(h: u16) -> u32 {
    let is_nan = (h & 0x7FFF) > 0x7F80;
    ((h as u32) << 16) | ((is_nan as u32) << 22)
}

#[inline(always)]
fn bf16_to_f32_portable(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(bf16_to_f32_bits(s.to_bits()));
    }
}

/// Picks the fastest BF16 -> F32 kernel this CPU runs.
fn bf16_to_f32_kernel() -> fn(&[bf16], &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if cpu_has!(Avx512f) && cpu_has!(Avx512bw) {
            return x86::bf16_to_f32_avx512;
        }
        if cpu_has!(Avx2) {
            return x86::bf16_to_f32_avx2;
        }
    }
    bf16_to_f32_portable
}

// ---------------------------------------------------------------------------------------------
// F64 -> F32 (the first of the two steps of F64 -> F16/BF16)

/// F64 -> F32 rounded to odd: truncate toward zero, then set the last bit if anything was
/// dropped. Why: `half` converts F64 by rounding to F32 first (F16C path) or by ignoring the
/// low 32 mantissa bits (software path), and both give the wrong answer for an F64 just above
/// or below an F16/BF16 tie. Rounding to odd into a format with at least two more bits of
/// precision than the target, then to nearest-even, gives the correctly rounded result
/// (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
/// rounding to odd", 2008): the odd result never lands on a target tie unless the input was
/// exactly on it. F32 has 13 more bits than F16 and 16 more than BF16, over the whole range
/// either target can represent, subnormals included. Values beyond F32's range end up at
/// ±F32::MAX or ±smallest subnormal, which still round to ±inf or ±0 in both targets.
#[inline(always)]
fn f64_to_f32_round_odd(x: f64) -> f32 {
    let r = x as f32; // round to nearest-even
    let back = r as f64;
    // Round to nearest went away from zero: step the magnitude back by one ulp to truncate.
    // (Never happens when r is 0, so the subtraction cannot wrap.)
    let truncated = r.to_bits().wrapping_sub((back.abs() > x.abs()) as u32);
    let odd = truncated | ((back != x) as u32);
    // NaN: make the F32 NaN from the sign and top mantissa bits explicitly rather than trust
    // `as` with a NaN payload; the quiet bit is set, as `half` does for F64 NaNs.
    let bits = x.to_bits();
    let nan =
        ((bits >> 32) as u32 & 0x8000_0000) | 0x7FC0_0000 | ((bits >> 29) as u32 & 0x007F_FFFF);
    f32::from_bits(if x.is_nan() { nan } else { odd })
}

fn f64_to_f32_round_odd_slice(src: &[f64], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f64_to_f32_round_odd(*s);
    }
}

// ---------------------------------------------------------------------------------------------
// x86-64 kernels selected at run time

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{f16_to_f32_f16c, has_f16c};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{bf16_to_f32_portable, f32_to_bf16_portable};
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Whether the CPU has AVX and F16C (`vcvtph2ps` / `vcvtps2ph` on 8 lanes).
    pub(crate) fn has_f16c() -> bool {
        cpu_has!(Avx) && cpu_has!(F16c)
    }

    /// F16 -> F32 with `vcvtph2ps`, 16 per step, inlined (also into `gemm_half`'s packing).
    /// `half`'s slice conversion uses the same instruction but calls a function per 8
    /// elements (with its 16-byte copies in and out): a sixth of a ResNet-20 amp-fp16 step
    /// went to it and its F32 -> F16 twin. The same bits: the conversion is exact, and a
    /// signalling NaN comes back quiet either way.
    ///
    /// # Safety
    /// The CPU has AVX and F16C (`has_f16c`).
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    pub(crate) unsafe fn f16_to_f32_f16c(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n elements of both slices; unaligned 16- and 32-byte accesses.
            unsafe {
                let a = _mm_loadu_si128(src.as_ptr().add(i).cast());
                let b = _mm_loadu_si128(src.as_ptr().add(i + 8).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(a));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i + 8), _mm256_cvtph_ps(b));
            }
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: as above, 8 elements.
            unsafe {
                let a = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(a));
            }
            i += 8;
        }
        if i < n {
            // A tail of under 8 through a zero-padded buffer (short runs are common in
            // `gemm_half`'s packing: an A panel row of a column-major A is 6).
            let mut h = [0u16; 8];
            let mut f = [0f32; 8];
            for (d, s) in h.iter_mut().zip(&src[i..n]) {
                *d = s.to_bits();
            }
            // SAFETY: 8-element stack buffers.
            unsafe {
                _mm256_storeu_ps(
                    f.as_mut_ptr(),
                    _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())),
                )
            };
            dst[i..n].copy_from_slice(&f[..n - i]);
        }
    }

    /// F32 -> F16 with `vcvtps2ph` (round to nearest-even, whatever MXCSR says), 16 per
    /// step, inlined; the same bits as `half` (which uses the same instruction, or the same
    /// IEEE rounding in software).
    ///
    /// # Safety
    /// The CPU has AVX and F16C (`has_f16c`).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f32_to_f16_f16c(src: &[f32], dst: &mut [f16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n elements of both slices; unaligned 32- and 16-byte accesses.
            unsafe {
                let a = _mm256_loadu_ps(src.as_ptr().add(i));
                let b = _mm256_loadu_ps(src.as_ptr().add(i + 8));
                let ha = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a);
                let hb = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), ha);
                _mm_storeu_si128(dst.as_mut_ptr().add(i + 8).cast(), hb);
            }
            i += 16;
        }
        dst[i..n].convert_from_f32_slice(&src[i..n]);
    }

    /// The portable kernel compiled for AVX2: the default x86-64 target only has SSE2, where
    /// narrowing 32-bit lanes to 16 bits costs extra shuffles.
    pub(super) fn f32_to_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
        #[target_feature(enable = "avx2")]
        unsafe fn inner(src: &[f32], dst: &mut [bf16]) {
            f32_to_bf16_portable(src, dst)
        }
        // SAFETY: selected only after `cpu_has!(Avx2)`.
        unsafe { inner(src, dst) }
    }

    /// BF16 -> F32 sixteen lanes at a time: widen, shift into the high half, and set the
    /// quiet bit of NaN lanes (`bf16_to_f32_bits`, the portable kernel's rule). Batch norm
    /// reads every half activation through this four times a step; the AVX2 build of the
    /// portable loop took 14 % of a ResNet-50 amp-bf16 step on Zen 5.
    pub(super) fn bf16_to_f32_avx512(src: &[bf16], dst: &mut [f32]) {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn inner(src: &[bf16], dst: &mut [f32]) {
            let n = src.len().min(dst.len());
            let abs = _mm512_set1_epi32(0x7FFF_FFFF);
            let inf = _mm512_set1_epi32(0x7F80_0000);
            let quiet = _mm512_set1_epi32(1 << 22);
            let mut i = 0;
            while i + 16 <= n {
                // SAFETY: lanes i..i + 16 lie inside both slices.
                unsafe {
                    let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                    let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                    let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, abs), inf);
                    let w = _mm512_mask_or_epi32(w, nan, w, quiet);
                    _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), w);
                }
                i += 16;
            }
            bf16_to_f32_portable(&src[i..n], &mut dst[i..n]);
        }
        // SAFETY: selected only after `cpu_has!` found AVX-512 F and BW.
        unsafe { inner(src, dst) }
    }

    /// The portable kernel compiled for AVX2.
    pub(super) fn bf16_to_f32_avx2(src: &[bf16], dst: &mut [f32]) {
        #[target_feature(enable = "avx2")]
        unsafe fn inner(src: &[bf16], dst: &mut [f32]) {
            bf16_to_f32_portable(src, dst)
        }
        // SAFETY: selected only after `cpu_has!(Avx2)`.
        unsafe { inner(src, dst) }
    }

    /// F32 -> BF16 with `vcvtne2ps2bf16`, 32 elements per step.
    ///
    /// The instruction rounds to nearest-even, ignores MXCSR, turns NaN into the same quiet
    /// NaN as `bf16::from_f32` and overflows to inf the same way, but it treats F32 subnormal
    /// inputs as zero (Intel SDM, `convert_fp32_to_bfloat16`), where IEEE rounding keeps them
    /// (BF16 has the same subnormal range as F32). A step whose 32 inputs hold a subnormal
    /// therefore goes through the bit trick instead. Subnormals are rare in real data, so the
    /// check is one compare per vector and a branch that is almost never taken.
    pub(super) fn f32_to_bf16_avx512bf16(src: &[f32], dst: &mut [bf16]) {
        // SAFETY: selected only after `cpu_has!` found AVX-512 F and BF16.
        unsafe { f32_to_bf16_avx512bf16_inner(src, dst) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn f32_to_bf16_avx512bf16_inner(src: &[f32], dst: &mut [bf16]) {
        debug_assert_eq!(src.len(), dst.len());
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n, and both slices hold n elements; unaligned loads/stores.
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr().add(i));
                let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
                if (subnormal_lanes(lo) | subnormal_lanes(hi)) == 0 {
                    // The first operand fills the upper 16 lanes, the second the lower ones.
                    let r = _mm512_cvtne2ps_pbh(hi, lo);
                    _mm512_storeu_si512(
                        dst.as_mut_ptr().add(i) as *mut __m512i,
                        std::mem::transmute::<__m512bh, __m512i>(r),
                    );
                } else {
                    f32_to_bf16_portable(&src[i..i + 32], &mut dst[i..i + 32]);
                }
            }
            i += 32;
        }
        f32_to_bf16_portable(&src[i..n], &mut dst[i..n]);
    }

    /// Mask of the lanes of `v` that hold an F32 subnormal: `abs - 1 < 0x7FFFFF` (unsigned)
    /// holds exactly for abs in 1..=0x7FFFFF.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn subnormal_lanes(v: __m512) -> __mmask16 {
        let abs = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFF_FFFF));
        let abs_minus_one = _mm512_sub_epi32(abs, _mm512_set1_epi32(1));
        _mm512_cmplt_epu32_mask(abs_minus_one, _mm512_set1_epi32(0x007F_FFFF))
    }
}

/// How an F32 value becomes a lower-precision one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest, ties to even (IEEE 754's default; deterministic).
    #[default]
    NearestEven,
    /// Round to one of the two neighbouring representable values, up with probability
    /// `(x - down) / (up - down)`: unbiased, `E[round(x)] = x`.
    Stochastic,
}

/// Stochastic rounding of one F32 value into F16, driven by 64 random bits.
///
/// F16's spacing changes with the exponent and is uniform (2^-24) through the subnormal
/// range, so this works with the two neighbours themselves rather than a bit trick: `down`
/// is `|x|` truncated toward zero to F16, `up` the next F16 above it, and the value rounds up
/// when a uniform `u` in [0, 1) (53 bits from `bits`) is below `p = (|x| - down) / (up -
/// down)`. Both differences are exact in f64 and `up - down` is a power of two, so `p` is
/// exact and P(up) = p to within 2^-53. Values below the smallest subnormal (2^-24) round to
/// 0 or 2^-24. The sign is put back at the end, so negative values are symmetric.
pub fn stochastic_round_f16(x: f32, bits: u64) -> f16 {
    let a = x.abs();
    // NaN, inf and finite values beyond the largest F16 round as nearest-even does.
    if a.is_nan() || a > f16::MAX.to_f32() {
        return f16::from_f32(x);
    }
    let nearest = f16::from_f32(a);
    let down = if nearest.to_f32() > a {
        f16::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    let lo = f64::from(down.to_f32());
    let a64 = f64::from(a);
    let mag = if a64 == lo {
        down
    } else {
        // down < a <= MAX, so down < MAX and its successor is finite.
        let up = f16::from_bits(down.to_bits() + 1);
        let p = (a64 - lo) / (f64::from(up.to_f32()) - lo);
        let u = (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        if u < p {
            up
        } else {
            down
        }
    };
    if x.is_sign_negative() {
        -mag
    } else {
        mag
    }
}

/// Stochastic rounding of one F32 value into BF16, driven by 16 random bits.
///
/// BF16 is the top half of an F32, so the classic trick is exact: add 16 random bits to the
/// F32 bit pattern and drop the low 16 bits. The sum carries into the kept half with
/// probability (low 16 bits) / 2^16, which is exactly `(|x| - down) / (up - down)` because
/// the magnitude bits of a float are linear in its value between two neighbours (also across
/// the subnormal range and into the next binade, where a carry lands on the power of two).
/// Adding to the magnitude rounds away from zero for either sign, so negatives are symmetric.
/// A representable value has zero low bits and never carries. NaN, inf and values beyond the
/// largest finite BF16 round to nearest-even (for those, the carry would produce inf or
/// disturb the NaN payload).
pub fn stochastic_round_bf16(x: f32, bits: u16) -> bf16 {
    if x.is_nan() || x.abs() > bf16::MAX.to_f32() {
        return bf16::from_f32(x);
    }
    let b = x.to_bits().wrapping_add(u32::from(bits));
    bf16::from_bits((b >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: a tiny deterministic generator, enough to spread test inputs.
    struct Rng(u64);
    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn next_u32(&mut self) -> u32 {
            (self.next_u64() >> 32) as u32
        }
        /// F32 bit patterns: mostly uniform bits (NaNs, infinities and subnormals come up
        /// naturally, about 1 in 256 and 1 in 512), plus a share from the classes that
        /// uniform bits rarely hit: subnormals, ties, near overflow.
        fn f32_bits(&mut self) -> u32 {
            let r = self.next_u32();
            let sign = self.next_u32() & 0x8000_0000;
            match self.next_u32() % 8 {
                0 => sign | (r & 0x007F_FFFF),               // subnormal or zero
                1 => (r & 0xFFFF_0000) | 0x8000,             // BF16 tie
                2 => (r & 0xFFFF_E000) | 0x1000,             // F16 tie (normal F16 range)
                3 => sign | 0x7F7F_0000 | (r & 0xFFFF),      // near BF16 overflow
                4 => sign | 0x7F80_0000 | (r & 0x007F_FFFF), // inf or NaN
                _ => r,
            }
        }
    }

    fn random_f32(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| f32::from_bits(rng.f32_bits())).collect()
    }

    const LENGTHS: [usize; 14] = [0, 1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 1023, 4097];

    fn bf16_of(x: f32) -> u16 {
        let mut d = [bf16::ZERO];
        f32_to_bf16(&[x], &mut d);
        d[0].to_bits()
    }

    fn f16_of(x: f32) -> u16 {
        let mut d = [f16::ZERO];
        f32_to_f16(&[x], &mut d);
        d[0].to_bits()
    }

    /// The `*_vec` conversions (into fresh, never zero-filled vectors) give the bits of the
    /// slice conversions, at small lengths, kilo-element edges and past the parallel split.
    #[test]
    fn conversions_into_new_vectors_equal_the_slice_conversions() {
        let mut rng = Rng(77);
        let lengths = LENGTHS.iter().copied().chain([1025, PAR_MIN_LEN + 1037]);
        for n in lengths {
            let x = random_f32(&mut rng, n);
            let mut h = vec![f16::ZERO; n];
            f32_to_f16(&x, &mut h);
            let mut b = vec![bf16::ZERO; n];
            f32_to_bf16(&x, &mut b);
            let bits = |v: &[u16]| v.to_vec();
            let hb: Vec<u16> = h.iter().map(|v| v.to_bits()).collect();
            let bb: Vec<u16> = b.iter().map(|v| v.to_bits()).collect();
            let hv: Vec<u16> = f32_to_f16_vec(&x).iter().map(|v| v.to_bits()).collect();
            let bv: Vec<u16> = f32_to_bf16_vec(&x).iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits(&hv), hb, "f32 -> f16, n = {n}");
            assert_eq!(bits(&bv), bb, "f32 -> bf16, n = {n}");
            let (mut hw, mut bw) = (vec![0f32; n], vec![0f32; n]);
            f16_to_f32(&h, &mut hw);
            bf16_to_f32(&b, &mut bw);
            let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                f32_bits(&f16_to_f32_vec(&h)),
                f32_bits(&hw),
                "f16 -> f32, n = {n}"
            );
            assert_eq!(
                f32_bits(&bf16_to_f32_vec(&b)),
                f32_bits(&bw),
                "bf16 -> f32, n = {n}"
            );
        }
    }

    #[test]
    fn every_f16_round_trips_through_f32() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut wide = vec![0f32; all.len()];
        f16_to_f32(&all, &mut wide);
        let mut back = vec![f16::ZERO; all.len()];
        f32_to_f16(&wide, &mut back);
        for ((h, w), b) in all.iter().zip(&wide).zip(&back) {
            assert_eq!(
                w.to_bits(),
                h.to_f32().to_bits(),
                "f16 {:#06x} widens",
                h.to_bits()
            );
            if h.is_nan() {
                assert!(w.is_nan() && b.is_nan(), "f16 NaN {:#06x}", h.to_bits());
            } else {
                assert_eq!(
                    b.to_bits(),
                    h.to_bits(),
                    "f16 {:#06x} round trip",
                    h.to_bits()
                );
            }
        }
    }

    #[test]
    fn every_bf16_round_trips_through_f32() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![0f32; all.len()];
        bf16_to_f32(&all, &mut wide);
        let mut back = vec![bf16::ZERO; all.len()];
        f32_to_bf16(&wide, &mut back);
        for ((h, w), b) in all.iter().zip(&wide).zip(&back) {
            // Bit-identical to half's scalar conversion, NaNs included (quiet bit set).
            assert_eq!(
                w.to_bits(),
                h.to_f32().to_bits(),
                "bf16 {:#06x} widens",
                h.to_bits()
            );
            if h.is_nan() {
                assert!(w.is_nan() && b.is_nan(), "bf16 NaN {:#06x}", h.to_bits());
                assert_eq!(
                    b.to_bits(),
                    h.to_bits() | 0x0040,
                    "NaN keeps sign and payload"
                );
            } else {
                assert_eq!(
                    w.to_bits(),
                    (h.to_bits() as u32) << 16,
                    "widening is a shift"
                );
                assert_eq!(
                    b.to_bits(),
                    h.to_bits(),
                    "bf16 {:#06x} round trip",
                    h.to_bits()
                );
            }
        }
    }

    #[test]
    fn f16_rounds_ties_to_even() {
        let ulp = 2f32.powi(-10); // F16 ulp at 1.0
                                  // 1 + ulp/2 lies between 0x3C00 (even) and 0x3C01: goes down.
        assert_eq!(f16_of(1.0 + ulp / 2.0), 0x3C00);
        // 1 + 3ulp/2 lies between 0x3C01 and 0x3C02 (even): goes up.
        assert_eq!(f16_of(1.0 + 3.0 * ulp / 2.0), 0x3C02);
        // One F32 ulp off the tie decides it.
        let above = f32::from_bits((1.0f32 + ulp / 2.0).to_bits() + 1);
        let below = f32::from_bits((1.0f32 + 3.0 * ulp / 2.0).to_bits() - 1);
        assert_eq!(f16_of(above), 0x3C01);
        assert_eq!(f16_of(below), 0x3C01);
        assert_eq!(f16_of(-(1.0 + ulp / 2.0)), 0xBC00);
        assert_eq!(f16_of(-(1.0 + 3.0 * ulp / 2.0)), 0xBC02);
    }

    #[test]
    fn f16_overflow_boundary() {
        assert_eq!(f16_of(65504.0), 0x7BFF);
        assert_eq!(f16_of(65519.99), 0x7BFF);
        assert_eq!(f16_of(f32::from_bits(65520f32.to_bits() - 1)), 0x7BFF);
        assert_eq!(f16_of(65520.0), 0x7C00); // the tie goes to the even neighbour: inf
        assert_eq!(f16_of(-65504.0), 0xFBFF);
        assert_eq!(f16_of(-65520.0), 0xFC00);
        assert_eq!(f16_of(1e10), 0x7C00);
        assert_eq!(f16_of(f32::MAX), 0x7C00);
    }

    #[test]
    fn f16_subnormals() {
        let tiny = 2f32.powi(-24); // smallest F16 subnormal
        assert_eq!(f16_of(tiny), 0x0001);
        assert_eq!(f16_of(tiny / 2.0), 0x0000); // tie between 0 and 0x0001: to even, 0
        assert_eq!(f16_of(-tiny / 2.0), 0x8000);
        assert_eq!(f16_of(f32::from_bits((tiny / 2.0).to_bits() + 1)), 0x0001);
        assert_eq!(f16_of(tiny * 1.5), 0x0002); // tie between 1 and 2: to even, 2
        assert_eq!(f16_of(tiny * 2.5), 0x0002); // tie between 2 and 3: to even, 2
        assert_eq!(f16_of(tiny * 1023.0), 0x03FF); // largest subnormal
        assert_eq!(f16_of(2f32.powi(-14)), 0x0400); // smallest normal
        assert_eq!(f16_of(tiny * 1023.5), 0x0400); // tie rounds up into the normals
        assert_eq!(f16_of(tiny / 4.0), 0x0000);
        for k in 0..1024u16 {
            assert_eq!(f16_of(tiny * k as f32), k, "subnormal {k}");
        }
    }

    #[test]
    fn bf16_rounds_ties_to_even() {
        // 1.0 = 0x3F80_0000; a BF16 ulp at 1.0 is 0x1_0000 in F32 bits.
        assert_eq!(bf16_of(f32::from_bits(0x3F80_8000)), 0x3F80); // tie, down to even
        assert_eq!(bf16_of(f32::from_bits(0x3F81_8000)), 0x3F82); // tie, up to even
        assert_eq!(bf16_of(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(bf16_of(f32::from_bits(0x3F81_7FFF)), 0x3F81);
        assert_eq!(bf16_of(f32::from_bits(0xBF80_8000)), 0xBF80);
        assert_eq!(bf16_of(f32::from_bits(0xBF81_8000)), 0xBF82);
        // A carry out of the mantissa bumps the exponent: 0x3FFF_8000 -> 2.0.
        assert_eq!(bf16_of(f32::from_bits(0x3FFF_8000)), 0x4000);
    }

    #[test]
    fn bf16_overflow_boundary() {
        // BF16 max is 0x7F7F = (2 - 2^-7) * 2^127; the tie towards inf is 0x7F7F_8000, and
        // 0x7F7F is odd, so the tie goes to inf.
        assert_eq!(bf16_of(f32::from_bits(0x7F7F_0000)), 0x7F7F);
        assert_eq!(bf16_of(f32::from_bits(0x7F7F_7FFF)), 0x7F7F);
        assert_eq!(bf16_of(f32::from_bits(0x7F7F_8000)), 0x7F80);
        assert_eq!(bf16_of(f32::MAX), 0x7F80);
        assert_eq!(bf16_of(f32::from_bits(0xFF7F_7FFF)), 0xFF7F);
        assert_eq!(bf16_of(f32::MIN), 0xFF80);
    }

    #[test]
    fn bf16_subnormals() {
        // F32 subnormal bits 0x0001_0000 is the smallest BF16 subnormal, 2^-133.
        assert_eq!(bf16_of(f32::from_bits(0x0001_0000)), 0x0001);
        assert_eq!(bf16_of(f32::from_bits(0x0000_8000)), 0x0000); // half of it: tie, to 0
        assert_eq!(bf16_of(f32::from_bits(0x8000_8000)), 0x8000);
        assert_eq!(bf16_of(f32::from_bits(0x0000_8001)), 0x0001); // a bit more: up
        assert_eq!(bf16_of(f32::from_bits(0x0001_8000)), 0x0002); // tie, up to even
        assert_eq!(bf16_of(f32::from_bits(0x0002_8000)), 0x0002); // tie, down to even
        assert_eq!(bf16_of(f32::from_bits(0x0000_0001)), 0x0000); // F32's smallest
        assert_eq!(bf16_of(f32::from_bits(0x007F_0000)), 0x007F); // largest subnormal
        assert_eq!(bf16_of(f32::from_bits(0x007F_FFFF)), 0x0080); // rounds up to normal
        assert_eq!(bf16_of(f32::MIN_POSITIVE), 0x0080);
    }

    #[test]
    fn zeros_infinities_and_nans() {
        assert_eq!(bf16_of(0.0), 0x0000);
        assert_eq!(bf16_of(-0.0), 0x8000);
        assert_eq!(f16_of(0.0), 0x0000);
        assert_eq!(f16_of(-0.0), 0x8000);
        assert_eq!(bf16_of(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_of(f32::NEG_INFINITY), 0xFF80);
        assert_eq!(f16_of(f32::INFINITY), 0x7C00);
        assert_eq!(f16_of(f32::NEG_INFINITY), 0xFC00);
        // Signalling NaNs whose payload lives only in the dropped bits must not become inf.
        for bits in [
            0x7F80_0001u32,
            0xFF80_0001,
            0x7FA0_0000,
            0x7FC0_0000,
            0xFFFF_FFFF,
        ] {
            let sign = bits & 0x8000_0000 != 0;
            let b = bf16::from_bits(bf16_of(f32::from_bits(bits)));
            assert!(
                b.is_nan() && b.to_bits() & 0x0040 != 0,
                "{bits:#x} -> quiet bf16 NaN"
            );
            assert_eq!(b.is_sign_negative(), sign);
            assert_eq!(b.to_bits(), bf16::from_f32(f32::from_bits(bits)).to_bits());
            let h = f16::from_bits(f16_of(f32::from_bits(bits)));
            assert!(
                h.is_nan() && h.to_bits() & 0x0200 != 0,
                "{bits:#x} -> quiet f16 NaN"
            );
            assert_eq!(h.is_sign_negative(), sign);
        }
        // BF16 signalling NaN widens to a quiet F32 NaN with the same payload.
        let mut w = [0f32];
        bf16_to_f32(&[bf16::from_bits(0xFF81)], &mut w);
        assert_eq!(w[0].to_bits(), 0xFFC1_0000);
    }

    /// Each BF16 -> F32 kernel this CPU runs gives the portable kernel's bits on every
    /// pattern, at every length up to 40 and at unaligned starts (the 16-lane loop and its
    /// tail). Machines without AVX-512 run the kernels they have.
    #[test]
    fn bf16_to_f32_kernels_match_the_portable_kernel() {
        type Kernel = fn(&[bf16], &mut [f32]);
        #[allow(unused_mut)]
        let mut kernels: Vec<(&str, Kernel)> = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::features::Feature::Avx512f.detected()
                && crate::cpu::features::Feature::Avx512bw.detected()
            {
                kernels.push(("avx512", super::x86::bf16_to_f32_avx512));
            }
            if crate::cpu::features::Feature::Avx2.detected() {
                kernels.push(("avx2", super::x86::bf16_to_f32_avx2));
            }
        }
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut want = vec![0f32; all.len()];
        bf16_to_f32_portable(&all, &mut want);
        for (name, k) in kernels {
            let mut got = vec![0f32; all.len()];
            k(&all, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{name}: pattern {i:#06x}");
            }
            for start in 0..3 {
                for len in 0..=40 {
                    // NaNs, infinities and ordinary values side by side.
                    let src: Vec<bf16> = (0..len)
                        .map(|j| all[(start * 977 + j * 4099 + 0x7F7E) % all.len()])
                        .collect();
                    let mut got = vec![0f32; len];
                    k(&src, &mut got);
                    for (j, (g, h)) in got.iter().zip(&src).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            want[h.to_bits() as usize].to_bits(),
                            "{name}: start {start}, len {len}, at {j}"
                        );
                    }
                }
            }
        }
    }

    /// Checks the four F32 <-> F16/BF16 paths against `half`'s scalar conversion on `src`.
    fn check_against_scalar(src: &[f32], what: &str) {
        let n = src.len();
        let mut b = vec![bf16::ZERO; n];
        f32_to_bf16(src, &mut b);
        let mut h = vec![f16::ZERO; n];
        f32_to_f16(src, &mut h);
        for i in 0..n {
            let x = src[i];
            assert_eq!(
                b[i].to_bits(),
                bf16::from_f32(x).to_bits(),
                "{what}: f32_to_bf16 at {i} of {n}, input {:#010x}",
                x.to_bits()
            );
            assert_eq!(
                h[i].to_bits(),
                f16::from_f32(x).to_bits(),
                "{what}: f32_to_f16 at {i} of {n}, input {:#010x}",
                x.to_bits()
            );
        }
        let mut w = vec![0f32; n];
        bf16_to_f32(&b, &mut w);
        for i in 0..n {
            assert_eq!(
                w[i].to_bits(),
                b[i].to_f32().to_bits(),
                "{what}: bf16_to_f32 at {i}"
            );
        }
        // Widen arbitrary 16-bit patterns too (the narrowed ones above are biased).
        let halves: Vec<u16> = src.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let bh: Vec<bf16> = halves.iter().map(|&x| bf16::from_bits(x)).collect();
        let hh: Vec<f16> = halves.iter().map(|&x| f16::from_bits(x)).collect();
        bf16_to_f32(&bh, &mut w);
        for i in 0..n {
            assert_eq!(
                w[i].to_bits(),
                bh[i].to_f32().to_bits(),
                "{what}: bf16_to_f32 at {i}"
            );
        }
        f16_to_f32(&hh, &mut w);
        for i in 0..n {
            assert_eq!(
                w[i].to_bits(),
                hh[i].to_f32().to_bits(),
                "{what}: f16_to_f32 at {i}"
            );
        }
    }

    #[test]
    fn fast_paths_match_scalar_on_odd_lengths_and_offsets() {
        let mut rng = Rng(0x5EED);
        for &n in &LENGTHS {
            let src = random_f32(&mut rng, n + 3);
            for offset in [0, 1, 3] {
                check_against_scalar(
                    &src[offset..offset + n],
                    &format!("len {n} offset {offset}"),
                );
            }
        }
        // Destination misaligned relative to the source as well.
        let src = random_f32(&mut rng, 4101);
        let mut b = vec![bf16::ZERO; 4101];
        f32_to_bf16(&src[3..], &mut b[1..4099]);
        for i in 0..4098 {
            assert_eq!(b[i + 1].to_bits(), bf16::from_f32(src[i + 3]).to_bits());
        }
    }

    #[test]
    fn fast_paths_match_scalar_on_long_slices() {
        // Long enough to take the rayon path, with a ragged last chunk.
        let mut rng = Rng(42);
        let src = random_f32(&mut rng, PAR_MIN_LEN + PAR_CHUNK + 5);
        check_against_scalar(&src, "parallel");
    }

    #[test]
    fn bf16_structured_bits_match_scalar() {
        // Every high half combined with low halves that sit on and around the rounding point.
        let lows = [
            0x0000u32, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000,
        ];
        let src: Vec<f32> = (0..=0xFFFFu32)
            .flat_map(|hi| lows.iter().map(move |&lo| f32::from_bits((hi << 16) | lo)))
            .collect();
        let mut b = vec![bf16::ZERO; src.len()];
        f32_to_bf16(&src, &mut b);
        for (x, y) in src.iter().zip(&b) {
            assert_eq!(
                y.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "input {:#010x}",
                x.to_bits()
            );
        }
    }

    #[test]
    fn every_f32_kernel_agrees_with_scalar() {
        // Each kernel this CPU can run, called directly (the dispatch only ever shows one).
        let mut kernels: Vec<(&str, F32ToBf16)> = vec![("portable", f32_to_bf16_portable)];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::features::Feature::Avx2.detected() {
                kernels.push(("avx2", x86::f32_to_bf16_avx2));
            }
            if crate::cpu::features::Feature::Avx512bf16.detected()
                && crate::cpu::features::Feature::Avx512f.detected()
            {
                kernels.push(("avx512bf16", x86::f32_to_bf16_avx512bf16));
            } else {
                eprintln!("note: no AVX-512 BF16 on this CPU; its kernel is not exercised");
            }
        }
        let mut rng = Rng(7);
        let src = random_f32(&mut rng, 1 << 16);
        // Every pattern that differs between the instruction and IEEE: the subnormals, and
        // the mix of subnormal and normal inside one 32-element step.
        let subnormals: Vec<f32> = (0..1 << 16)
            .map(|i: u32| f32::from_bits(((i & 1) << 31) | (rng.next_u32() & 0x007F_FFFF)))
            .chain((0..64).map(|i| f32::from_bits(if i == 37 { 0x0000_8001 } else { 0x3F80_8000 })))
            .collect();
        for (name, kernel) in kernels {
            for input in [&src[..], &subnormals[..]] {
                for &n in &LENGTHS {
                    for offset in [0, 1, 3] {
                        let s = &input[offset..offset + n];
                        let mut d = vec![bf16::ZERO; n];
                        kernel(s, &mut d);
                        for (x, y) in s.iter().zip(&d) {
                            let want = bf16::from_f32(*x).to_bits();
                            assert_eq!(y.to_bits(), want, "{name}: input {:#010x}", x.to_bits());
                        }
                    }
                }
                let mut d = vec![bf16::ZERO; input.len()];
                kernel(input, &mut d);
                for (x, y) in input.iter().zip(&d) {
                    let want = bf16::from_f32(*x).to_bits();
                    assert_eq!(y.to_bits(), want, "{name}: input {:#010x}", x.to_bits());
                }
            }
        }
    }

    /// All 2^32 F32 bit patterns through `f32_to_bf16`, against `bf16::from_f32`. A few
    /// seconds in release, much longer unoptimised: `cargo test --release` (CI's command)
    /// runs it; unoptimised builds skip it.
    #[test]
    #[cfg_attr(debug_assertions, ignore = "2^32 inputs: run with --release")]
    fn every_f32_to_bf16_matches_scalar() {
        const BLOCK: u64 = 1 << 20;
        (0..(1u64 << 32) / BLOCK).into_par_iter().for_each(|blk| {
            let src: Vec<f32> = (blk * BLOCK..(blk + 1) * BLOCK)
                .map(|b| f32::from_bits(b as u32))
                .collect();
            let mut d = vec![bf16::ZERO; src.len()];
            f32_to_bf16(&src, &mut d);
            for (x, y) in src.iter().zip(&d) {
                let want = bf16::from_f32(*x).to_bits();
                assert_eq!(y.to_bits(), want, "input {:#010x}", x.to_bits());
            }
        });
    }

    // ---- F64 ----

    /// Correctly rounded F64 -> 16-bit float, by search over the target's finite values:
    /// `value(bits)` for bits in 0..=max_bits is increasing; `inf` is the infinity's bits.
    fn reference_round(x: f64, value: impl Fn(u16) -> f64, max_bits: u16, inf: u16) -> u16 {
        let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
        let a = x.abs();
        if a.is_infinite() {
            return sign | inf;
        }
        // Largest k with value(k) <= a.
        let (mut lo, mut hi) = (0u16, max_bits);
        if a >= value(max_bits) {
            lo = max_bits;
        } else {
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if value(mid) <= a {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
        }
        let v = value(lo);
        if v == a {
            return sign | lo;
        }
        // Next value up; above the max, inf sits one (virtual) ulp further on.
        let next = if lo == max_bits {
            2.0 * v - value(lo - 1)
        } else {
            value(lo + 1)
        };
        let mid = (v + next) / 2.0; // exact: one more bit than the target has
        let k = if a < mid || (a == mid && lo % 2 == 0) {
            lo
        } else {
            lo + 1
        };
        sign | k.min(inf)
    }

    fn ref_f16(x: f64) -> u16 {
        reference_round(x, |b| f16::from_bits(b).to_f64(), 0x7BFF, 0x7C00)
    }

    fn ref_bf16(x: f64) -> u16 {
        reference_round(x, |b| bf16::from_bits(b).to_f64(), 0x7F7F, 0x7F80)
    }

    /// F64 inputs on, just off and far from the F16 and BF16 ties, plus random patterns.
    fn f64_inputs(rng: &mut Rng, n: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let pick = rng.next_u32() % 4;
            let h = (rng.next_u32() & 0xFFFF) as u16;
            let base = match pick {
                0 => f16::from_bits(h & 0x7BFF).to_f64(),
                1 => bf16::from_bits(h & 0x7F7F).to_f64(),
                _ => f64::from_bits(rng.next_u64()),
            };
            if !base.is_finite() || pick >= 2 {
                out.push(base);
                continue;
            }
            // Move to the midpoint with the next value up, then a few F64 ulps either way.
            let next = if pick == 0 {
                f16::from_bits((h & 0x7BFF) + 1).to_f64()
            } else {
                bf16::from_bits((h & 0x7F7F) + 1).to_f64()
            };
            let mid = (base + next) / 2.0;
            let nudge = (rng.next_u32() % 7) as i64 - 3;
            let sign = if rng.next_u32() & 1 == 1 { -1.0 } else { 1.0 };
            out.push(sign * f64::from_bits((mid.to_bits() as i64 + nudge) as u64));
            // And a value just off the tie by less than F32 can see.
            out.push(sign * (mid + mid * 2f64.powi(-40)));
            out.push(sign * (mid - mid * 2f64.powi(-40)));
        }
        out.truncate(n);
        out
    }

    #[test]
    fn f64_to_half_types_round_once() {
        // half's scalar from_f64 rounds this twice (to F32, then to the tie, then to even).
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        let mut h = [f16::ZERO];
        f64_to_f16(&[x], &mut h);
        assert_eq!(h[0].to_bits(), 0x3C01);
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        let mut b = [bf16::ZERO];
        f64_to_bf16(&[x], &mut b);
        assert_eq!(b[0].to_bits(), 0x3F81);

        let mut rng = Rng(99);
        for &n in LENGTHS.iter().chain(&[100_000]) {
            let src = f64_inputs(&mut rng, n + 1);
            let s = &src[1..];
            let mut h = vec![f16::ZERO; n];
            let mut b = vec![bf16::ZERO; n];
            f64_to_f16(s, &mut h);
            f64_to_bf16(s, &mut b);
            for i in 0..n {
                let x = s[i];
                if x.is_nan() {
                    assert!(
                        h[i].is_nan() && h[i].to_bits() & 0x0200 != 0,
                        "{x:e} -> f16"
                    );
                    assert!(
                        b[i].is_nan() && b[i].to_bits() & 0x0040 != 0,
                        "{x:e} -> bf16"
                    );
                    assert_eq!(h[i].is_sign_negative(), x.is_sign_negative());
                    assert_eq!(b[i].to_bits(), bf16::from_f64(x).to_bits(), "NaN payload");
                    continue;
                }
                assert_eq!(
                    h[i].to_bits(),
                    ref_f16(x),
                    "f64_to_f16({x:e}) [{:#x}]",
                    x.to_bits()
                );
                assert_eq!(
                    b[i].to_bits(),
                    ref_bf16(x),
                    "f64_to_bf16({x:e}) [{:#x}]",
                    x.to_bits()
                );
            }
        }
        // Edges: overflow ties, subnormal ties, beyond F32's range.
        let cases: [(f64, u16, u16); 10] = [
            (65504.0, 0x7BFF, 0x4780),
            (65520.0, 0x7C00, 0x4780),
            (65519.999999, 0x7BFF, 0x4780),
            (2f64.powi(-25), 0x0000, 0x3300),
            (2f64.powi(-25) * (1.0 + 2f64.powi(-50)), 0x0001, 0x3300),
            (2f64.powi(-134), 0x0000, 0x0000), // BF16's half-of-smallest: tie to 0
            (2f64.powi(-134) * (1.0 + 2f64.powi(-50)), 0x0000, 0x0001),
            (1e300, 0x7C00, 0x7F80),
            (-1e-300, 0x8000, 0x8000),
            (f64::from_bits(0x47EF_EFFF_FFFF_FFFF), 0x7C00, 0x7F7F), // just under BF16's inf tie
        ];
        for (x, want_h, want_b) in cases {
            let mut h = [f16::ZERO];
            let mut b = [bf16::ZERO];
            f64_to_f16(&[x], &mut h);
            f64_to_bf16(&[x], &mut b);
            assert_eq!(h[0].to_bits(), want_h, "f64_to_f16({x:e})");
            assert_eq!(b[0].to_bits(), want_b, "f64_to_bf16({x:e})");
            assert_eq!(want_h, ref_f16(x));
            assert_eq!(want_b, ref_bf16(x));
        }
    }

    #[test]
    fn half_types_widen_to_f64_exactly() {
        let hs: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let bs: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut w = vec![0f64; 1 << 16];
        f16_to_f64(&hs, &mut w);
        for (h, x) in hs.iter().zip(&w) {
            if h.is_nan() {
                assert!(x.is_nan());
            } else {
                assert_eq!(x.to_bits(), (h.to_f32() as f64).to_bits());
            }
        }
        bf16_to_f64(&bs, &mut w);
        for (b, x) in bs.iter().zip(&w) {
            if b.is_nan() {
                assert!(x.is_nan());
            } else {
                assert_eq!(x.to_bits(), (b.to_f32() as f64).to_bits());
            }
        }
    }

    #[test]
    #[should_panic(expected = "equal lengths")]
    fn length_mismatch_panics() {
        let mut d = [bf16::ZERO; 2];
        f32_to_bf16(&[1.0, 2.0, 3.0], &mut d);
    }
}
