//! Batch norm's per-run loops on AVX-512, reading and writing the tensor's own F32, F16 or
//! BF16 elements: a half element is widened to F32 in a register as it is loaded and a
//! result rounded to the storage type as it is stored.
//!
//! `cpu::norm` runs a channel's run (one image's `s` values of one channel) through these
//! where the CPU has AVX-512 F/BW/VL and F16C, or through their AVX2 build (eight lanes, the
//! tails through a small stack buffer) where it has AVX2 and F16C (`level`). Elsewhere
//! (the portable level) it converts the run
//! into an F32 buffer, calls its F32 loop, and rounds the result out of another buffer: the
//! portable twin, which the tests in `cpu::norm` hold these kernels to, bit for bit. On 2
//! Emerald Rapids cores reading in place took batch norm from about 27 % to 19.5 % of the
//! samples of a ResNet-20 amp-bf16 step (the buffers cost a store and a reload of every
//! value, per pass, on top of the conversion).
//!
//! The sums keep the portable loops' order: eight lanes, lane `i` taking elements `i`,
//! `i + 8`, … (`reduce::sum_slice`), folded pairwise, then the tail in order. The
//! elementwise loops run sixteen lanes with the same operations per element in the same
//! order (no fused multiply-add), so every width gives the same bits.

use std::mem::MaybeUninit;

use crate::dtype::{same_slice, same_slice_mut, WithDType};

/// The constants of the forward's elementwise pass: `(x − mu)·scale + shift`, then the
/// residual, then the ReLU.
#[derive(Clone, Copy, Debug)]
#[doc(hidden)]
pub struct Apply {
    pub mu: f32,
    pub scale: f32,
    pub shift: f32,
    pub relu: bool,
}

/// The constants of the input gradient. Training: `rs · ((gz·wc − dm) − xhat·dn)` with
/// `xhat = (x − mu)·rs`; eval: `(gz·wc)·rs`.
#[derive(Clone, Copy, Debug)]
#[doc(hidden)]
pub struct Dx {
    pub training: bool,
    pub mu: f32,
    pub rs: f32,
    pub wc: f32,
    pub dm: f32,
    pub dn: f32,
}

/// Which build of the kernels runs: both give the same bits (the tests hold each to the
/// portable path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[doc(hidden)]
pub enum Level {
    /// Sixteen lanes under AVX-512 masks: AVX-512 F, BW, VL and F16C.
    Avx512,
    /// Eight lanes: AVX2 and F16C (Zen 3, Haswell and later; `--cpu-level avx2`).
    Avx2,
}

impl Level {
    /// Whether this CPU, as the CPU configuration caps it, runs this build.
    pub fn is_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Level::Avx512 => {
                    cpu_has!(Avx512f) && cpu_has!(Avx512bw) && cpu_has!(Avx512vl) && cpu_has!(F16c)
                }
                Level::Avx2 => cpu_has!(Avx2) && cpu_has!(F16c),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// The widest build this CPU runs (checked once), `None` off x86-64 and at the portable
/// level.
#[doc(hidden)]
pub fn level() -> Option<Level> {
    static LEVEL: std::sync::OnceLock<Option<Level>> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        [Level::Avx512, Level::Avx2]
            .into_iter()
            .find(|l| l.is_available())
    })
}

/// True where some build of these kernels runs (`level`).
#[doc(hidden)]
pub fn available() -> bool {
    level().is_some()
}

/// `s` as `&[U]`, where `U` is `T`.
fn cast<T: 'static, U: 'static>(s: &[T]) -> &[U] {
    same_slice(s).expect("the element type was matched")
}

/// `s` as `&mut [U]`, where `U` is `T`.
fn cast_mut<T: 'static, U: 'static>(s: &mut [T]) -> &mut [U] {
    same_slice_mut(s).expect("the element type was matched")
}

/// Runs `$body` with `$l` the concrete type of `$t` (F32, F16 or BF16) on x86-64;
/// elsewhere `available()` is false and nothing calls in.
macro_rules! on_x86 {
    ($t:ty, $l:ident => $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            with_f32_or_half!(<$t as WithDType>::DTYPE, $l => $body, _ => unreachable!(
                "batch norm's kernels take F32, F16 or BF16, not {:?}",
                <$t as WithDType>::DTYPE
            ))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            unreachable!("in_place::available() is false off x86-64")
        }
    }};
}

/// `x86::$wide::<L>(args)` at `Level::Avx512`, `x86::$narrow::<L>(args)` at `Level::Avx2`.
macro_rules! at_level {
    ($level:expr, $wide:ident, $narrow:ident, ($($arg:expr),*)) => {
        match $level {
            Level::Avx512 => x86::$wide::<L>($($arg),*),
            Level::Avx2 => x86::$narrow::<L>($($arg),*),
        }
    };
}

/// `Σ x` (as F32) in `sum_slice`'s order.
///
/// # Safety
/// `level.is_available()`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[doc(hidden)]
pub unsafe fn sum<T: WithDType>(level: Level, x: &[T]) -> f32 {
    // SAFETY: forwarded.
    on_x86!(T, L => unsafe { at_level!(level, sum, sum_avx2, (cast(x))) })
}

/// `Σ (x − mu)²` (as F32) in `sum_slice`'s order.
///
/// # Safety
/// `level.is_available()`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[doc(hidden)]
pub unsafe fn sq_dev<T: WithDType>(level: Level, x: &[T], mu: f32) -> f32 {
    // SAFETY: forwarded.
    on_x86!(T, L => unsafe { at_level!(level, sq_dev, sq_dev_avx2, (cast(x), mu)) })
}

/// `o = relu?((x − mu)·scale + shift + r)`, rounded once into `T` (every element of `o`
/// written).
///
/// # Safety
/// `level.is_available()`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[doc(hidden)]
pub unsafe fn apply<T: WithDType>(
    level: Level,
    o: &mut [MaybeUninit<T>],
    x: &[T],
    r: Option<&[T]>,
    k: Apply,
) {
    assert!(x.len() >= o.len() && r.is_none_or(|r| r.len() >= o.len()));
    // SAFETY: forwarded; lengths checked above.
    on_x86!(T, L => unsafe {
        at_level!(level, apply, apply_avx2, (cast_mut(o), cast(x), r.map(cast), k))
    })
}

/// `(Σ gz·xhat, Σ gz)` with `gz = g·[y > 0]` (`g` without `y`) and `xhat = (x − mu)·rs`,
/// each in `sum_slice`'s order.
///
/// # Safety
/// `level.is_available()`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[doc(hidden)]
pub unsafe fn relu_sums<T: WithDType>(
    level: Level,
    g: &[T],
    y: Option<&[T]>,
    x: &[T],
    mu: f32,
    rs: f32,
) -> (f32, f32) {
    assert!(x.len() >= g.len() && y.is_none_or(|y| y.len() >= g.len()));
    // SAFETY: forwarded; lengths checked above.
    on_x86!(T, L => unsafe {
        at_level!(level, relu_sums, relu_sums_avx2, (cast(g), y.map(cast), cast(x), mu, rs))
    })
}

/// One run of the backward's elementwise pass: `gz = g·[y > 0]` into `dres`, and the input
/// gradient (`Dx`) into `dx`, each rounded once into `T` (every element written).
///
/// # Safety
/// `level.is_available()`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[doc(hidden)]
pub unsafe fn dx<T: WithDType>(
    level: Level,
    g: &[T],
    y: Option<&[T]>,
    x: &[T],
    k: Dx,
    dx: Option<&mut [MaybeUninit<T>]>,
    dres: Option<&mut [MaybeUninit<T>]>,
) {
    let n = g.len();
    assert!(x.len() >= n && y.is_none_or(|y| y.len() >= n));
    assert!(dx.as_ref().is_none_or(|o| o.len() == n));
    assert!(dres.as_ref().is_none_or(|o| o.len() == n));
    // SAFETY: forwarded; lengths checked above.
    on_x86!(T, L => unsafe {
        at_level!(
            level,
            dx,
            dx_avx2,
            (cast(g), y.map(cast), cast(x), k, dx.map(cast_mut), dres.map(cast_mut))
        )
    })
}

/// `src` rounded into `dst` by the kernels' store (the tests hold it to `convert`'s).
///
/// # Safety
/// `level.is_available()`.
#[doc(hidden)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub unsafe fn round_into<T: WithDType>(level: Level, src: &[f32], dst: &mut [MaybeUninit<T>]) {
    assert_eq!(src.len(), dst.len());
    // SAFETY: forwarded; equal lengths.
    on_x86!(T, L => unsafe { at_level!(level, round_into, round_into_avx2, (src, cast_mut(dst))) })
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Apply, Dx};
    use half::{bf16, f16};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// How the kernels load and store an element type (also `conv::amx`'s output store).
    pub(crate) trait Lanes: Copy + Default {
        /// Eight elements from `p` as F32 (exact).
        unsafe fn ld8(p: *const Self) -> __m256;
        /// Eight lanes of `v`, rounded to nearest-even as `st` rounds them, stored at `p`
        /// (AVX2 and F16C).
        unsafe fn st8(p: *mut Self, v: __m256);
        /// The elements of `p` under mask `m` as F32 (exact; other lanes zero).
        unsafe fn ld(p: *const Self, m: __mmask16) -> __m512;
        /// The lanes of `v` under mask `m`, rounded to nearest-even, stored at `p`.
        unsafe fn st(p: *mut Self, v: __m512, m: __mmask16);
        /// One element as F32 (the tails of the sums).
        fn f32(self) -> f32;
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn ld8(p: *const f32) -> __m256 {
            // SAFETY: the caller's.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn st8(p: *mut f32, v: __m256) {
            // SAFETY: the caller's.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn ld(p: *const f32, m: __mmask16) -> __m512 {
            // SAFETY: the caller's.
            unsafe { _mm512_maskz_loadu_ps(m, p) }
        }
        #[inline(always)]
        unsafe fn st(p: *mut f32, v: __m512, m: __mmask16) {
            // SAFETY: the caller's.
            unsafe { _mm512_mask_storeu_ps(p, m, v) }
        }
        #[inline(always)]
        fn f32(self) -> f32 {
            self
        }
    }

    /// Each lane of `v` rounded to BF16 as `Lanes::st` stores it, its bits in the lane's low
    /// half (the high half zero).
    ///
    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn bf16_bits(v: __m512) -> __m512i {
        let x = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(nan, rounded, quiet)
    }

    /// `bf16_bits` on eight lanes (AVX2). Always inlined, like every helper of the AVX2
    /// build: a helper or closure compiled on its own lacks the entry's target features,
    /// and its intrinsics become calls (measured: 2.3× slower batch norm).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn bf16_bits8(v: __m256) -> __m256i {
        let x = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
        let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
        let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }

    impl Lanes for bf16 {
        #[inline(always)]
        unsafe fn ld8(p: *const bf16) -> __m256 {
            // SAFETY: the caller's.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        /// `bf16_bits8`, the eight 32-bit lanes (each at most `0xFFFF`) packed to 16 bits.
        #[inline(always)]
        unsafe fn st8(p: *mut bf16, v: __m256) {
            // SAFETY: the caller's (AVX2 for every `st8`).
            unsafe {
                let b = bf16_bits8(v);
                let h =
                    _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
                _mm_storeu_si128(p.cast(), h)
            }
        }
        #[inline(always)]
        unsafe fn ld(p: *const bf16, m: __mmask16) -> __m512 {
            // SAFETY: the caller's.
            let h = unsafe { _mm256_maskz_loadu_epi16(m, p.cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        /// `convert::f32_to_bf16`'s rounding (`f32_to_bf16_bits`), sixteen lanes at once:
        /// add `0x7FFF` plus the kept part's lowest bit and drop the low half; a NaN keeps
        /// its top half with the quiet bit set.
        #[inline(always)]
        unsafe fn st(p: *mut bf16, v: __m512, m: __mmask16) {
            // SAFETY: the caller's (AVX-512 F for every `Lanes` method).
            unsafe {
                let h = _mm512_cvtepi32_epi16(bf16_bits(v));
                _mm256_mask_storeu_epi16(p.cast(), m, h)
            }
        }
        #[inline(always)]
        fn f32(self) -> f32 {
            self.to_f32()
        }
    }

    impl Lanes for f16 {
        #[inline(always)]
        unsafe fn ld8(p: *const f16) -> __m256 {
            // SAFETY: the caller's.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
        }
        /// `vcvtps2ph` to nearest-even, as `st`.
        #[inline(always)]
        unsafe fn st8(p: *mut f16, v: __m256) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            // SAFETY: the caller's.
            unsafe { _mm_storeu_si128(p.cast(), h) }
        }
        #[inline(always)]
        unsafe fn ld(p: *const f16, m: __mmask16) -> __m512 {
            // SAFETY: the caller's.
            _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(m, p.cast()) })
        }
        /// `vcvtps2ph` to nearest-even, as `convert::f32_to_f16`'s F16C kernel.
        #[inline(always)]
        unsafe fn st(p: *mut f16, v: __m512, m: __mmask16) {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            // SAFETY: the caller's.
            unsafe { _mm256_mask_storeu_epi16(p.cast(), m, h) }
        }
        #[inline(always)]
        fn f32(self) -> f32 {
            self.to_f32()
        }
    }

    /// The mask of the first `n` (at most 16) lanes.
    #[inline(always)]
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xFFFF
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// `sum_slice`'s fold of its eight lanes.
    #[inline(always)]
    fn fold(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: eight F32.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }

    /// `Σ f(x)` over the full eight-element chunks of `$x` (eight lanes), folded, then the
    /// tail in order through `t`. A macro, so that `f` is inlined into the entry that has
    /// the target features (a closure is compiled without them; see `bf16_bits8`).
    macro_rules! sum_by {
        ($L:ty, $x:expr, |$v:ident| $f:expr, |$s:ident| $t:expr) => {{
            let x: &[$L] = $x;
            let full = x.len() / 8 * 8;
            let mut acc = _mm256_setzero_ps();
            let mut j = 0;
            while j < full {
                // SAFETY: j + 8 <= x.len().
                let $v = unsafe { <$L as Lanes>::ld8(x.as_ptr().add(j)) };
                acc = _mm256_add_ps(acc, $f);
                j += 8;
            }
            let mut total = fold(acc);
            for &e in &x[full..] {
                let $s = e.f32();
                total += $t;
            }
            total
        }};
    }

    /// An entry point: `$imp` compiled with the target features `$feat` (the CPU has them,
    /// as the caller in `in_place` checks with `Level::is_available`, and the slices are as
    /// it checks).
    macro_rules! entry {
        ($feat:literal, fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $imp:ident) => {
            /// # Safety
            /// The CPU has the target features named; the slices are as the caller in
            /// `in_place` checks.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name<L: Lanes>($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: forwarded.
                unsafe { $imp::<L>($($arg),*) }
            }
        };
    }

    entry!("avx512f,avx512bw,avx512vl,f16c", fn sum(x: &[L]) -> f32 = sum_imp);
    entry!("avx512f,avx512bw,avx512vl,f16c", fn sq_dev(x: &[L], mu: f32) -> f32 = sq_dev_imp);
    entry!("avx512f,avx512bw,avx512vl,f16c",
        fn apply(o: &mut [MaybeUninit<L>], x: &[L], r: Option<&[L]>, k: Apply) = apply_imp);
    entry!("avx512f,avx512bw,avx512vl,f16c",
        fn relu_sums(g: &[L], y: Option<&[L]>, x: &[L], mu: f32, rs: f32) -> (f32, f32)
        = relu_sums_imp);
    entry!("avx512f,avx512bw,avx512vl,f16c",
        fn dx(g: &[L], y: Option<&[L]>, x: &[L], k: Dx, dx: Option<&mut [MaybeUninit<L>]>,
        dres: Option<&mut [MaybeUninit<L>]>) = dx_imp);
    entry!("avx512f,avx512bw,avx512vl,f16c",
        fn round_into(src: &[f32], dst: &mut [MaybeUninit<L>]) = round_into_imp);

    // The sums are eight-lane loops already: the same bodies, compiled for AVX2.
    entry!("avx2,f16c", fn sum_avx2(x: &[L]) -> f32 = sum_imp);
    entry!("avx2,f16c", fn sq_dev_avx2(x: &[L], mu: f32) -> f32 = sq_dev_imp);
    entry!("avx2,f16c",
        fn apply_avx2(o: &mut [MaybeUninit<L>], x: &[L], r: Option<&[L]>, k: Apply) = apply8_imp);
    entry!("avx2,f16c",
        fn relu_sums_avx2(g: &[L], y: Option<&[L]>, x: &[L], mu: f32, rs: f32) -> (f32, f32)
        = relu_sums_imp);
    entry!("avx2,f16c",
        fn dx_avx2(g: &[L], y: Option<&[L]>, x: &[L], k: Dx, dx: Option<&mut [MaybeUninit<L>]>,
        dres: Option<&mut [MaybeUninit<L>]>) = dx8_imp);
    entry!("avx2,f16c",
        fn round_into_avx2(src: &[f32], dst: &mut [MaybeUninit<L>]) = round_into8_imp);

    /// The first `n` (< 8) elements at `p` as F32, the other lanes zero: through a stack
    /// buffer, since AVX2 has no masked 16-bit loads.
    ///
    /// # Safety
    /// `n` elements are readable at `p`; AVX2 and F16C.
    #[inline(always)]
    unsafe fn ld8_part<L: Lanes>(p: *const L, n: usize) -> __m256 {
        let mut buf = [L::default(); 8];
        // SAFETY: the caller's; n < 8.
        unsafe {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
            L::ld8(buf.as_ptr())
        }
    }

    /// The first `n` (< 8) lanes of `v`, rounded as `st8` rounds them, stored at `p`.
    ///
    /// # Safety
    /// `n` elements are writable at `p`; AVX2 and F16C.
    #[inline(always)]
    unsafe fn st8_part<L: Lanes>(p: *mut L, v: __m256, n: usize) {
        let mut buf = [L::default(); 8];
        // SAFETY: the caller's; n < 8.
        unsafe {
            L::st8(buf.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), p, n);
        }
    }

    /// `relu` on eight lanes: `+0.0` where not `z > 0` and not NaN.
    #[inline(always)]
    unsafe fn relu8(z: __m256) -> __m256 {
        _mm256_and_ps(_mm256_cmp_ps::<_CMP_NLE_UQ>(z, _mm256_setzero_ps()), z)
    }

    /// `through_relu` on eight lanes.
    #[inline(always)]
    unsafe fn through_relu8(g: __m256, y: Option<__m256>) -> __m256 {
        match y {
            Some(y) => {
                let zero = _mm256_setzero_ps();
                let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(y, zero);
                _mm256_mul_ps(g, _mm256_blendv_ps(zero, _mm256_set1_ps(1.0), pos))
            }
            None => g,
        }
    }

    /// `$body` for each step of eight elements of `0..$len` (`$j` its start, `$n` = 8),
    /// then for the tail (`$n` < 8) if any. A macro, not a function taking a closure: the
    /// closure would be compiled without the entry's target features (see `bf16_bits8`).
    macro_rules! steps8 {
        ($len:expr, |$j:ident, $n:ident| $body:block) => {{
            let len = $len;
            let mut $j = 0;
            while $j + 8 <= len {
                let $n = 8;
                $body
                $j += 8;
            }
            if $j < len {
                let $n = len - $j;
                $body
            }
        }};
    }

    /// `n` (≤ 8) elements at `p` as F32.
    #[inline(always)]
    unsafe fn load8<L: Lanes>(p: *const L, n: usize) -> __m256 {
        // SAFETY: the caller's.
        unsafe {
            if n == 8 {
                L::ld8(p)
            } else {
                ld8_part(p, n)
            }
        }
    }

    /// The first `n` (≤ 8) lanes of `v` rounded and stored at `p`.
    #[inline(always)]
    unsafe fn store8<L: Lanes>(p: *mut L, v: __m256, n: usize) {
        // SAFETY: the caller's.
        unsafe {
            if n == 8 {
                L::st8(p, v)
            } else {
                st8_part(p, v, n)
            }
        }
    }

    #[inline(always)]
    unsafe fn round_into8_imp<L: Lanes>(src: &[f32], dst: &mut [MaybeUninit<L>]) {
        steps8!(dst.len(), |j, n| {
            // SAFETY: j + n <= the length of both slices (equal lengths).
            unsafe {
                let v = load8(src.as_ptr().add(j), n);
                store8::<L>(dst.as_mut_ptr().add(j).cast(), v, n);
            }
        });
    }

    #[inline(always)]
    unsafe fn apply8_imp<L: Lanes>(o: &mut [MaybeUninit<L>], x: &[L], r: Option<&[L]>, k: Apply) {
        let (mu, scale, shift) = (
            _mm256_set1_ps(k.mu),
            _mm256_set1_ps(k.scale),
            _mm256_set1_ps(k.shift),
        );
        steps8!(o.len(), |j, n| {
            // SAFETY: j + n <= the length of every slice (the callers' lengths).
            unsafe {
                let v = load8(x.as_ptr().add(j), n);
                let mut z = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, mu), scale), shift);
                if let Some(r) = r {
                    z = _mm256_add_ps(z, load8(r.as_ptr().add(j), n));
                }
                if k.relu {
                    z = relu8(z);
                }
                store8::<L>(o.as_mut_ptr().add(j).cast(), z, n);
            }
        });
    }

    #[inline(always)]
    unsafe fn dx8_imp<L: Lanes>(
        g: &[L],
        y: Option<&[L]>,
        x: &[L],
        k: Dx,
        mut dx: Option<&mut [MaybeUninit<L>]>,
        mut dres: Option<&mut [MaybeUninit<L>]>,
    ) {
        let (mu, rs, wc, dm, dn) = (
            _mm256_set1_ps(k.mu),
            _mm256_set1_ps(k.rs),
            _mm256_set1_ps(k.wc),
            _mm256_set1_ps(k.dm),
            _mm256_set1_ps(k.dn),
        );
        steps8!(g.len(), |j, n| {
            // SAFETY: j + n <= the length of every slice (the caller's checks).
            unsafe {
                // Not `y.map(..)`: a closure loses the target features (`bf16_bits8`).
                #[allow(clippy::manual_map)]
                let yv = match y {
                    Some(y) => Some(load8(y.as_ptr().add(j), n)),
                    None => None,
                };
                let z = through_relu8(load8(g.as_ptr().add(j), n), yv);
                if let Some(r) = &mut dres {
                    store8::<L>(r.as_mut_ptr().add(j).cast(), z, n);
                }
                if let Some(o) = &mut dx {
                    let gw = _mm256_mul_ps(z, wc);
                    let v = if k.training {
                        let xv = load8(x.as_ptr().add(j), n);
                        let xhat = _mm256_mul_ps(_mm256_sub_ps(xv, mu), rs);
                        let t = _mm256_sub_ps(_mm256_sub_ps(gw, dm), _mm256_mul_ps(xhat, dn));
                        _mm256_mul_ps(rs, t)
                    } else {
                        _mm256_mul_ps(gw, rs)
                    };
                    store8::<L>(o.as_mut_ptr().add(j).cast(), v, n);
                }
            }
        });
    }

    #[inline(always)]
    unsafe fn round_into_imp<L: Lanes>(src: &[f32], dst: &mut [MaybeUninit<L>]) {
        let mut j = 0;
        while j < dst.len() {
            let m = lanes(dst.len() - j);
            // SAFETY: the lanes under `m` lie inside both slices (equal lengths).
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, src.as_ptr().add(j));
                L::st(dst.as_mut_ptr().add(j).cast(), v, m);
            }
            j += 16;
        }
    }

    #[inline(always)]
    unsafe fn sum_imp<L: Lanes>(x: &[L]) -> f32 {
        sum_by!(L, x, |v| v, |v| v)
    }

    #[inline(always)]
    unsafe fn sq_dev_imp<L: Lanes>(x: &[L], mu: f32) -> f32 {
        let m = _mm256_set1_ps(mu);
        sum_by!(
            L,
            x,
            |v| {
                let d = _mm256_sub_ps(v, m);
                _mm256_mul_ps(d, d)
            },
            |v| (v - mu) * (v - mu)
        )
    }

    /// `relu_f32` on sixteen lanes: a lane stays where `z > 0` or `z` is NaN (not
    /// `z <= 0`, unordered), else `+0.0`.
    #[inline(always)]
    unsafe fn relu(z: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(z, _mm512_setzero_ps());
        _mm512_maskz_mov_ps(keep, z)
    }

    #[inline(always)]
    unsafe fn apply_imp<L: Lanes>(o: &mut [MaybeUninit<L>], x: &[L], r: Option<&[L]>, k: Apply) {
        let (mu, scale, shift) = (
            _mm512_set1_ps(k.mu),
            _mm512_set1_ps(k.scale),
            _mm512_set1_ps(k.shift),
        );
        let n = o.len();
        let mut j = 0;
        while j < n {
            let m = lanes(n - j);
            // SAFETY: the lanes under `m` lie inside every slice (the callers' lengths).
            unsafe {
                let v = L::ld(x.as_ptr().add(j), m);
                let mut z = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, mu), scale), shift);
                if let Some(r) = r {
                    z = _mm512_add_ps(z, L::ld(r.as_ptr().add(j), m));
                }
                if k.relu {
                    z = relu(z);
                }
                L::st(o.as_mut_ptr().add(j).cast(), z, m);
            }
            j += 16;
        }
    }

    /// `g · [y > 0]` (the ordered compare: NaN in `y` masks), or `g` without `y`.
    #[inline(always)]
    unsafe fn through_relu(g: __m512, y: Option<__m512>) -> __m512 {
        match y {
            Some(y) => {
                let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, _mm512_setzero_ps());
                let one = _mm512_mask_blend_ps(pos, _mm512_setzero_ps(), _mm512_set1_ps(1.0));
                _mm512_mul_ps(g, one)
            }
            None => g,
        }
    }

    /// `relu_sums_impl`'s lanes and order on `L` elements, the tail as `relu_sums_finish`
    /// does it (also `norm`'s AVX2 build for F32, which needs only AVX here).
    ///
    /// # Safety
    /// AVX (and what `L`'s loads need); `y` and `x` at least as long as `g`.
    #[inline(always)]
    pub(crate) unsafe fn relu_sums_imp<L: Lanes>(
        g: &[L],
        y: Option<&[L]>,
        x: &[L],
        mu: f32,
        rs: f32,
    ) -> (f32, f32) {
        let n = g.len();
        let full = n / 8 * 8;
        let (vmu, vrs) = (_mm256_set1_ps(mu), _mm256_set1_ps(rs));
        let (one, zero) = (_mm256_set1_ps(1.0), _mm256_setzero_ps());
        let (mut aw, mut ab) = (zero, zero);
        let mut j = 0;
        while j < full {
            // SAFETY: j + 8 <= n <= the length of every slice read (the caller's check).
            unsafe {
                let gv = L::ld8(g.as_ptr().add(j));
                let z = match y {
                    Some(y) => {
                        let pos = _mm256_cmp_ps::<_CMP_GT_OQ>(L::ld8(y.as_ptr().add(j)), zero);
                        _mm256_mul_ps(gv, _mm256_blendv_ps(zero, one, pos))
                    }
                    None => gv,
                };
                ab = _mm256_add_ps(ab, z);
                let xhat = _mm256_mul_ps(_mm256_sub_ps(L::ld8(x.as_ptr().add(j)), vmu), vrs);
                aw = _mm256_add_ps(aw, _mm256_mul_ps(z, xhat));
            }
            j += 8;
        }
        let (mut sw, mut sb) = (fold(aw), fold(ab));
        for j in full..n {
            let gj = g[j].f32();
            let z = match y {
                Some(y) => gj * if y[j].f32() > 0.0 { 1.0 } else { 0.0 },
                None => gj,
            };
            sb += z;
            sw += z * ((x[j].f32() - mu) * rs);
        }
        (sw, sb)
    }

    #[inline(always)]
    unsafe fn dx_imp<L: Lanes>(
        g: &[L],
        y: Option<&[L]>,
        x: &[L],
        k: Dx,
        mut dx: Option<&mut [MaybeUninit<L>]>,
        mut dres: Option<&mut [MaybeUninit<L>]>,
    ) {
        let n = g.len();
        let (mu, rs, wc, dm, dn) = (
            _mm512_set1_ps(k.mu),
            _mm512_set1_ps(k.rs),
            _mm512_set1_ps(k.wc),
            _mm512_set1_ps(k.dm),
            _mm512_set1_ps(k.dn),
        );
        let mut j = 0;
        while j < n {
            let m = lanes(n - j);
            // SAFETY: the lanes under `m` lie inside every slice (the caller's checks).
            unsafe {
                // Not `y.map(..)`: a closure loses the target features (`bf16_bits8`).
                #[allow(clippy::manual_map)]
                let yv = match y {
                    Some(y) => Some(L::ld(y.as_ptr().add(j), m)),
                    None => None,
                };
                let z = through_relu(L::ld(g.as_ptr().add(j), m), yv);
                if let Some(r) = dres.as_deref_mut() {
                    L::st(r.as_mut_ptr().add(j).cast(), z, m);
                }
                if let Some(o) = dx.as_deref_mut() {
                    let gw = _mm512_mul_ps(z, wc);
                    let v = if k.training {
                        let xv = L::ld(x.as_ptr().add(j), m);
                        let xhat = _mm512_mul_ps(_mm512_sub_ps(xv, mu), rs);
                        let t = _mm512_sub_ps(_mm512_sub_ps(gw, dm), _mm512_mul_ps(xhat, dn));
                        _mm512_mul_ps(rs, t)
                    } else {
                        _mm512_mul_ps(gw, rs)
                    };
                    L::st(o.as_mut_ptr().add(j).cast(), v, m);
                }
            }
            j += 16;
        }
    }
}

/// `v` as a slice the kernels write into (they only store values of `T`).
#[doc(hidden)]
pub fn uninit<T>(v: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: same layout; the kernels write only initialised `T` values through it.
    unsafe { &mut *(v as *mut [T] as *mut [MaybeUninit<T>]) }
}
