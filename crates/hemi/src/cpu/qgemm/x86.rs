//! The x86-64 INT8 microkernels (`avx512-vnni`, `avx-vnni`, `avx2-i16`, `amx-i8`), each run
//! through `run_task_with` inside a function compiled with its target features.

use super::pack::{AmxTiles, I16Pairs, Layout, Vnni256, Vnni512};
use super::{run_task_with, Job, Micro};
use crate::cpu::amx::TileConfig;
use std::arch::x86_64::*;
use std::ops::Range;

/// `run_task_with` for `avx512-vnni`, compiled with its features (the epilogue too).
///
/// # Safety
/// `QKernel::Avx512Vnni.is_available()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn run_task_avx512_vnni(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    run_task_with::<Avx512Vnni>(job, rows, cols)
}

/// `run_task_with` for `avx-vnni`.
///
/// # Safety
/// `QKernel::AvxVnni.is_available()`.
#[target_feature(enable = "avx2,avxvnni")]
pub(super) unsafe fn run_task_avx_vnni(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    run_task_with::<AvxVnni>(job, rows, cols)
}

/// `run_task_with` for `avx2-i16`.
///
/// # Safety
/// `QKernel::Avx2I16.is_available()`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn run_task_avx2_i16(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    run_task_with::<Avx2I16>(job, rows, cols)
}

/// `run_task_with` for `amx-i8`, with the tiles configured on this thread meanwhile.
///
/// # Safety
/// `QKernel::AmxInt8.is_available()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn run_task_amx_int8(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    // SAFETY: the caller checked that AMX-INT8 is usable.
    let _release = unsafe { TileConfig::all_16x64().load() };
    run_task_with::<AmxInt8>(job, rows, cols)
}

struct Avx512Vnni;
struct AvxVnni;
struct Avx2I16;
struct AmxInt8;

/// `$f::<R, ...>(args)` for R = `rows`, one instance per possible row count, so that the
/// last tile of a block (and products of fewer rows than a tile) computes only its rows.
macro_rules! by_rows {
    ($rows:expr, [$($r:literal)*], $f:ident::<_, $nv:tt, $s:tt>$args:tt) => {
        match $rows {
            $($r => $f::<$r, $nv, $s>$args,)*
            _ => unreachable!("a tile has 1..=MR rows"),
        }
    };
}

impl Micro for Avx512Vnni {
    type L = Vnni512;

    #[inline(always)]
    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        const S: usize = Vnni512::MR;
        // SAFETY: forwarded from the caller.
        unsafe { by_rows!(rows, [1 2 3 4 5 6 7 8], tile_zmm::<_, 2, S>(a, b, acc, accumulate)) }
    }
}

impl Micro for AvxVnni {
    type L = Vnni256;

    #[inline(always)]
    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        const S: usize = Vnni256::MR;
        // SAFETY: forwarded from the caller.
        unsafe { by_rows!(rows, [1 2 3 4 5 6], tile_ymm_vnni::<_, 2, S>(a, b, acc, accumulate)) }
    }
}

impl Micro for Avx2I16 {
    type L = I16Pairs;

    #[inline(always)]
    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        const S: usize = I16Pairs::MR;
        // SAFETY: forwarded from the caller.
        unsafe { by_rows!(rows, [1 2 3 4 5 6], tile_ymm_i16::<_, 2, S>(a, b, acc, accumulate)) }
    }
}

/// R×(16·NV) tile (R ≤ S, the rows of packed A per group): per group of 4 k, NV B loads
/// (16 columns × 4 s8 each), R broadcasts of a row's 4 u8, R·NV `vpdpbusd` into R·NV zmm
/// accumulators.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn tile_zmm<const R: usize, const NV: usize, const S: usize>(
    a: &[u32],
    b: &[i8],
    acc: &mut [i32],
    accumulate: bool,
) {
    let groups = a.len() / S;
    assert!(R <= S && b.len() >= groups * 64 * NV && R * 16 * NV <= acc.len());
    let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
    let mut c = [[_mm512_setzero_si512(); NV]; R];
    if accumulate {
        for (r, row) in c.iter_mut().enumerate() {
            for (v, s) in row.iter_mut().enumerate() {
                // SAFETY: R·16·NV ≤ acc.len(), asserted above.
                *s = unsafe { _mm512_loadu_si512(acc.as_ptr().add(16 * (r * NV + v)).cast()) };
            }
        }
    }
    for _ in 0..groups {
        // SAFETY: `groups` groups of S u32 (a) and 64·NV bytes (b), asserted above.
        unsafe {
            let mut bv = [_mm512_setzero_si512(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(pb.add(64 * v).cast());
            }
            for (r, row) in c.iter_mut().enumerate() {
                let x = _mm512_set1_epi32(*pa.add(r) as i32);
                for (s, &y) in row.iter_mut().zip(&bv) {
                    *s = _mm512_dpbusd_epi32(*s, x, y);
                }
            }
            pa = pa.add(S);
            pb = pb.add(64 * NV);
        }
    }
    for (r, row) in c.iter().enumerate() {
        for (v, &s) in row.iter().enumerate() {
            // SAFETY: R·16·NV ≤ acc.len(), asserted above.
            unsafe { _mm512_storeu_si512(acc.as_mut_ptr().add(16 * (r * NV + v)).cast(), s) };
        }
    }
}

/// R×(8·NV) tile of the VEX `vpdpbusd` (AVX-VNNI) on ymm, as `tile_zmm`.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
unsafe fn tile_ymm_vnni<const R: usize, const NV: usize, const S: usize>(
    a: &[u32],
    b: &[i8],
    acc: &mut [i32],
    accumulate: bool,
) {
    let groups = a.len() / S;
    assert!(R <= S && b.len() >= groups * 32 * NV && R * 8 * NV <= acc.len());
    let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
    let mut c = [[_mm256_setzero_si256(); NV]; R];
    if accumulate {
        for (r, row) in c.iter_mut().enumerate() {
            for (v, s) in row.iter_mut().enumerate() {
                // SAFETY: R·8·NV ≤ acc.len(), asserted above.
                *s = unsafe { _mm256_loadu_si256(acc.as_ptr().add(8 * (r * NV + v)).cast()) };
            }
        }
    }
    for _ in 0..groups {
        // SAFETY: `groups` groups of S u32 (a) and 32·NV bytes (b), asserted above.
        unsafe {
            let mut bv = [_mm256_setzero_si256(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm256_loadu_si256(pb.add(32 * v).cast());
            }
            for (r, row) in c.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(*pa.add(r) as i32);
                for (s, &y) in row.iter_mut().zip(&bv) {
                    *s = _mm256_dpbusd_avx_epi32(*s, x, y);
                }
            }
            pa = pa.add(S);
            pb = pb.add(32 * NV);
        }
    }
    for (r, row) in c.iter().enumerate() {
        for (v, &s) in row.iter().enumerate() {
            // SAFETY: R·8·NV ≤ acc.len(), asserted above.
            unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(8 * (r * NV + v)).cast(), s) };
        }
    }
}

/// R×(8·NV) tile on pairs of k: per pair, NV loads of 8 columns × 2 s8 sign-extended to
/// i16 (`vpmovsxbw`), R broadcasts of a row's two u8 as u16, and per accumulator a
/// `vpmaddwd` (both i16 products summed into an i32, exact) and a `vpaddd`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tile_ymm_i16<const R: usize, const NV: usize, const S: usize>(
    a: &[u32],
    b: &[i8],
    acc: &mut [i32],
    accumulate: bool,
) {
    let groups = a.len() / S;
    assert!(R <= S && b.len() >= groups * 16 * NV && R * 8 * NV <= acc.len());
    let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
    let mut c = [[_mm256_setzero_si256(); NV]; R];
    if accumulate {
        for (r, row) in c.iter_mut().enumerate() {
            for (v, s) in row.iter_mut().enumerate() {
                // SAFETY: R·8·NV ≤ acc.len(), asserted above.
                *s = unsafe { _mm256_loadu_si256(acc.as_ptr().add(8 * (r * NV + v)).cast()) };
            }
        }
    }
    for _ in 0..groups {
        // SAFETY: `groups` groups of S u32 (a) and 16·NV bytes (b), asserted above.
        unsafe {
            let mut bv = [_mm256_setzero_si256(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm256_cvtepi8_epi16(_mm_loadu_si128(pb.add(16 * v).cast()));
            }
            for (r, row) in c.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(*pa.add(r) as i32);
                for (s, &y) in row.iter_mut().zip(&bv) {
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(x, y));
                }
            }
            pa = pa.add(S);
            pb = pb.add(16 * NV);
        }
    }
    for (r, row) in c.iter().enumerate() {
        for (v, &s) in row.iter().enumerate() {
            // SAFETY: R·8·NV ≤ acc.len(), asserted above.
            unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(8 * (r * NV + v)).cast(), s) };
        }
    }
}

impl Micro for AmxInt8 {
    type L = AmxTiles;

    /// Per k step of 64: A rows 0–15 and 16–31 into tiles 4 and 5 (rows 64 bytes apart),
    /// B columns 0–15 and 16–31 into tiles 6 and 7 (rows 128 bytes apart), four
    /// `tdpbusd` into the accumulator tiles 0–3 (zeroed, or loaded from `acc` with
    /// `accumulate`), stored to `acc` (32 rows of 32 i32).
    /// All 32 rows are computed (padding rows of A are zeros).
    #[inline(always)]
    unsafe fn tile(a: &[u32], _rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        const STEP_A: usize = AmxTiles::MR * 16; // u32 of packed A per k step
        const STEP_B: usize = AmxTiles::NR * 64; // bytes of a B panel per k step
        let steps = a.len() / STEP_A;
        assert!(a.len() == steps * STEP_A && b.len() >= steps * STEP_B);
        assert!(acc.len() >= AmxTiles::MR * AmxTiles::NR);
        let d = acc.as_mut_ptr();
        // SAFETY: `steps` steps of packed A (2 KiB each) and of the B panel (2 KiB each),
        // and 32 rows of 32 i32 (128 bytes a row) in `acc`, asserted above. The caller
        // configured tiles 0–7 as 16 rows of 64 bytes. Only tile registers, the pointer
        // copies, the counter and the flags are changed.
        unsafe {
            std::arch::asm!(
                "test {acc_in}, {acc_in}",
                "jz 4f",
                "tileloadd tmm0, [{d} + {s128}]",
                "tileloadd tmm1, [{d} + {s128} + 64]",
                "tileloadd tmm2, [{d} + {s128} + 2048]",
                "tileloadd tmm3, [{d} + {s128} + 2112]",
                "jmp 5f",
                "4:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "5:",
                "test {n}, {n}",
                "jz 3f",
                "2:",
                "tileloadd tmm4, [{a} + {s64}]",
                "tileloadd tmm6, [{b} + {s128}]",
                "tdpbusd tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b} + {s128} + 64]",
                "tdpbusd tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a} + {s64} + 1024]",
                "tdpbusd tmm2, tmm5, tmm6",
                "tdpbusd tmm3, tmm5, tmm7",
                "add {a}, 2048",
                "add {b}, 2048",
                "dec {n}",
                "jnz 2b",
                "3:",
                "tilestored [{d} + {s128}], tmm0",
                "tilestored [{d} + {s128} + 64], tmm1",
                "tilestored [{d} + {s128} + 2048], tmm2",
                "tilestored [{d} + {s128} + 2112], tmm3",
                a = inout(reg) a.as_ptr() => _,
                b = inout(reg) b.as_ptr() => _,
                n = inout(reg) steps => _,
                acc_in = in(reg) accumulate as usize,
                s64 = in(reg) 64usize,
                s128 = in(reg) 128usize,
                d = in(reg) d,
                options(nostack),
            );
        }
    }
}

/// Whether this process may run AMX-INT8 code (`cpu::amx::usable`).
pub(super) fn amx_usable() -> bool {
    crate::cpu::amx::usable(crate::cpu::amx::AmxType::Int8)
}
