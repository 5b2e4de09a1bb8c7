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

use crate::cpu::chunked::{chunk, for_each_chunk};

/// Below this many elements a conversion runs on the calling thread. Measured on a 2-core
/// Zen 3 (idle): at 128K elements splitting loses (fork/join costs more than it saves), from
/// 256K on it wins, at 512K by 1.2-1.6x, at 16M (memory bound) by 1.5x.
#[doc(hidden)]
pub const PAR_MIN_LEN: usize = 1 << 19;
/// Elements per rayon task: big enough to amortise scheduling, small enough that all threads
/// get work and finish together.
#[doc(hidden)]
pub const PAR_CHUNK: usize = 1 << 16;
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
        for_each_chunk(dst, PAR_CHUNK, &|i, d| kernel(chunk(src, i, PAR_CHUNK), d));
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
        for_each_chunk(spare, PAR_CHUNK, &|i, d| part(chunk(src, i, PAR_CHUNK), d));
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

/// F32 -> BF16 in plain Rust, by `f32_to_bf16_bits` (nearest-even, NaN quiet).
#[inline(always)]
#[doc(hidden)]
pub fn f32_to_bf16_portable(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_bits(s.to_bits()));
    }
}

/// A whole-slice F32 -> BF16 conversion (the slices have equal lengths).
#[doc(hidden)]
pub type F32ToBf16 = fn(&[f32], &mut [bf16]);

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

/// BF16 -> F32 in plain Rust, by `bf16_to_f32_bits` (exact, NaN quiet).
#[inline(always)]
#[doc(hidden)]
pub fn bf16_to_f32_portable(src: &[bf16], dst: &mut [f32]) {
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

/// The x86-64 kernels the conversions pick at run time (public, hidden, for the unit tests
/// in `tests/kernels/unit/`).
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod x86 {
    use super::{bf16_to_f32_portable, f32_to_bf16_portable};
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Whether the CPU has AVX and F16C (`vcvtph2ps` / `vcvtps2ph` on 8 lanes).
    pub(crate) fn has_f16c() -> bool {
        cpu_has!(Avx) && cpu_has!(F16c)
    }

    /// F16 -> F32 with `vcvtph2ps`, 16 per step, inlined (also into `cpu::gemm::pack`).
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
            // `cpu::gemm::pack`: an A panel row of a column-major A is 6).
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
    pub fn f32_to_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
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
    pub fn bf16_to_f32_avx512(src: &[bf16], dst: &mut [f32]) {
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
    pub fn bf16_to_f32_avx2(src: &[bf16], dst: &mut [f32]) {
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
    pub fn f32_to_bf16_avx512bf16(src: &[f32], dst: &mut [bf16]) {
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
