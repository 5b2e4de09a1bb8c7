//! The x86-64 microkernels of hemi's blocked GEMM (`avx2-fma`, `avx512f`, `avx512bf16`,
//! `amx-bf16`), selected at run time; each packs and blocks as its portable twin does.

use super::blocked::{run_tile, Job, Micro};
use super::blocked::{AMX_KC, AMX_MC, AMX_MR, AMX_NC, AMX_NR};
use super::blocked::{WIDE_KC, WIDE_MC, WIDE_MR, WIDE_NC, WIDE_NR};
use super::pack::{pack_amx_a, pack_f32, pack_pairs, Workspace};
use crate::cpu::amx::TileConfig;
use crate::cpu::gemm::MatRef;
use crate::dtype::WithDType;
use half::bf16;
use std::arch::x86_64::*;
use std::ops::Range;

/// `run_tile` compiled for AVX2 + FMA + F16C (packing included).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_tile_avx2<A: WithDType, B: WithDType>(
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
    ws: &mut Workspace,
) {
    run_tile::<Avx2Fma, A, B>(job, rows, cols, ws)
}

/// `run_tile` compiled for AVX-512 BF16.
///
/// # Safety
/// The CPU has AVX-512 F, BW and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn run_tile_avx512bf16<A: WithDType, B: WithDType>(
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
    ws: &mut Workspace,
) {
    if super::select::pair_rows(job.a.rows()) == 8 {
        run_tile::<Avx512Bf16<8>, A, B>(job, rows, cols, ws)
    } else {
        run_tile::<Avx512Bf16<14>, A, B>(job, rows, cols, ws)
    }
}

/// `run_tile` compiled for AVX-512 F (packing with AVX2 and F16C).
///
/// # Safety
/// The CPU has AVX-512 F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn run_tile_avx512f<A: WithDType, B: WithDType>(
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
    ws: &mut Workspace,
) {
    run_tile::<Avx512F32, A, B>(job, rows, cols, ws)
}

/// `panel[p * stride + r0 + i] = rows[i][p]` for i < 8, p < n8 (a multiple of 8): 8×8
/// blocks transposed in registers (unpack, shuffle, 128-bit permute), one 8-float store
/// per k index instead of eight scattered ones.
///
/// # Safety
/// The CPU has AVX.
#[inline]
#[target_feature(enable = "avx")]
pub(super) unsafe fn transpose_rows_8(
    rows: &[&[f32]; 8],
    n8: usize,
    panel: &mut [f32],
    stride: usize,
    r0: usize,
) {
    assert!(n8.is_multiple_of(8) && rows.iter().all(|r| r.len() >= n8));
    assert!(n8 == 0 || (n8 - 1) * stride + r0 + 8 <= panel.len());
    // SAFETY: every row holds n8 floats (asserted); AVX as the caller promises.
    unsafe { transpose_ptrs_8(&rows.map(<[f32]>::as_ptr), n8, panel, stride, r0) }
}

/// `transpose_rows_8` from eight pointers, each to `n8` readable 32-bit values at any
/// alignment (BF16 pairs read in place: a run of BF16 starting at an odd element is not
/// 4-byte aligned, so it cannot be a `&[f32]`).
///
/// # Safety
/// The CPU has AVX; `rows[i]` points to `n8` readable 4-byte values (any alignment).
#[inline]
#[target_feature(enable = "avx")]
pub(super) unsafe fn transpose_ptrs_8(
    rows: &[*const f32; 8],
    n8: usize,
    panel: &mut [f32],
    stride: usize,
    r0: usize,
) {
    assert!(n8.is_multiple_of(8));
    assert!(n8 == 0 || (n8 - 1) * stride + r0 + 8 <= panel.len());
    for p in (0..n8).step_by(8) {
        // SAFETY: p + 8 <= n8 values behind every pointer (the caller's promise), read
        // unaligned; the stores write panel[(p + j) * stride + r0 .. + 8] for j < 8,
        // inside the panel (asserted).
        unsafe {
            let a = |i: usize| _mm256_loadu_ps(rows[i].add(p));
            let t0 = _mm256_unpacklo_ps(a(0), a(1));
            let t1 = _mm256_unpackhi_ps(a(0), a(1));
            let t2 = _mm256_unpacklo_ps(a(2), a(3));
            let t3 = _mm256_unpackhi_ps(a(2), a(3));
            let t4 = _mm256_unpacklo_ps(a(4), a(5));
            let t5 = _mm256_unpackhi_ps(a(4), a(5));
            let t6 = _mm256_unpacklo_ps(a(6), a(7));
            let t7 = _mm256_unpackhi_ps(a(6), a(7));
            // s_j: k indices j and j + 4 of rows 0..4 (s0..s3) or 4..8 (s4..s7).
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let cols = [
                _mm256_permute2f128_ps::<0x20>(s0, s4),
                _mm256_permute2f128_ps::<0x20>(s1, s5),
                _mm256_permute2f128_ps::<0x20>(s2, s6),
                _mm256_permute2f128_ps::<0x20>(s3, s7),
                _mm256_permute2f128_ps::<0x31>(s0, s4),
                _mm256_permute2f128_ps::<0x31>(s1, s5),
                _mm256_permute2f128_ps::<0x31>(s2, s6),
                _mm256_permute2f128_ps::<0x31>(s3, s7),
            ];
            for (j, c) in cols.into_iter().enumerate() {
                _mm256_storeu_ps(panel.as_mut_ptr().add((p + j) * stride + r0), c);
            }
        }
    }
}

/// BF16 -> F32 (a 16-bit shift), 8 per step with `vpmovzxwd` + `vpslld`: LLVM unrolls a
/// 16-element run of the plain loop into scalar code instead.
///
/// # Safety
/// The CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bf16_to_f32_avx2(src: &[bf16], out: &mut [f32]) {
    let n = src.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n elements of both slices; unaligned 16- and 32-byte accesses.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            let f = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), f);
        }
        i += 8;
    }
    for (o, h) in out[i..n].iter_mut().zip(&src[i..n]) {
        *o = super::pack::bf16_bits_to_f32(h.to_bits());
    }
}

/// Blocking as `PortableF32`.
struct Avx2Fma;

const _: () = assert!(
    Avx2Fma::KC == super::portable::PortableF32::KC
        && Avx512Bf16::<8>::KC == super::portable::PortablePairs::<8>::KC
        && Avx512Bf16::<14>::KC == super::portable::PortablePairs::<8>::KC
        && Avx512F32::KC == super::portable::PortableF32Wide::KC
        && AmxBf16::KC == super::portable::PortableAmx::KC
);

impl Micro for Avx2Fma {
    type P = f32;
    const KSTEP: usize = 1;
    const SIMD: bool = true;
    const MR: usize = 6;
    const NR: usize = 16;
    const KC: usize = 512;
    const MC: usize = 144;
    const NC: usize = 2048;

    #[inline(always)]
    fn pack_a<T: WithDType>(
        a: &MatRef<'_, T>,
        i0: usize,
        h: usize,
        p0: usize,
        kc: usize,
        out: &mut [f32],
    ) {
        pack_f32::<6, T>(a, i0, h, p0, kc, out, true)
    }

    #[inline(always)]
    fn pack_b<T: WithDType>(
        bt: &MatRef<'_, T>,
        j0: usize,
        w: usize,
        p0: usize,
        kc: usize,
        out: &mut [f32],
    ) {
        pack_f32::<16, T>(bt, j0, w, p0, kc, out, true)
    }

    #[inline(always)]
    unsafe fn tile(
        steps: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        // SAFETY: forwarded from the caller (who also guarantees AVX2 + FMA).
        unsafe { tile_6x16(steps, a, b, c, ldc, load_c) }
    }
}

/// 6×16 F32 tile: per k step, two B loads, six A broadcasts, twelve FMAs into twelve
/// ymm accumulators (FMA latency 4 × 2 ports = 8 needed in flight).
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_6x16(
    steps: usize,
    mut a: *const f32,
    mut b: *const f32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    // Start fetching the C tile (a row of 16 F32 may span two lines): its rows are a row
    // stride apart, usually out of L1, and loading them only at the end stalls.
    for r in 0..6 {
        // SAFETY: prefetches are hints, and these addresses lie in the C tile.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc).cast());
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 15).cast());
        }
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    for _ in 0..steps {
        // SAFETY: the caller guarantees `steps` steps of 6 (a) and 16 (b) floats.
        unsafe {
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(r));
                acc_row[0] = _mm256_fmadd_ps(x, b0, acc_row[0]);
                acc_row[1] = _mm256_fmadd_ps(x, b1, acc_row[1]);
            }
            a = a.add(6);
            b = b.add(16);
        }
    }
    for (r, acc_row) in acc.iter().enumerate() {
        // SAFETY: the caller guarantees 6 rows of 16 floats at stride ldc.
        unsafe {
            let row = c.add(r * ldc);
            let (mut lo, mut hi) = (acc_row[0], acc_row[1]);
            if load_c {
                lo = _mm256_add_ps(_mm256_loadu_ps(row), lo);
                hi = _mm256_add_ps(_mm256_loadu_ps(row.add(8)), hi);
            }
            _mm256_storeu_ps(row, lo);
            _mm256_storeu_ps(row.add(8), hi);
        }
    }
}

/// Blocking as `PortablePairs`.
struct Avx512Bf16<const MR: usize>;

impl<const MR: usize> Micro for Avx512Bf16<MR> {
    type P = u32;
    const KSTEP: usize = 2;
    const MR: usize = MR;
    const NR: usize = 32;
    const KC: usize = 384;
    const MC: usize = 336;
    const NC: usize = 2048;

    #[inline(always)]
    fn pack_a<T: WithDType>(
        a: &MatRef<'_, T>,
        i0: usize,
        h: usize,
        p0: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        pack_pairs::<MR, 1, true, T>(a, i0, h, p0, kc, out)
    }

    #[inline(always)]
    fn pack_b<T: WithDType>(
        bt: &MatRef<'_, T>,
        j0: usize,
        w: usize,
        p0: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        pack_pairs::<32, 1, true, T>(bt, j0, w, p0, kc, out)
    }

    #[inline(always)]
    unsafe fn tile(
        steps: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        // SAFETY: forwarded from the caller (who also guarantees AVX-512 BF16).
        unsafe { tile_pairs::<MR>(steps, a, b, c, ldc, load_c) }
    }
}

/// MR×32 BF16-pair tile (MR = 8 or 14): per pair of k indices, two B loads (32 columns ×
/// 2 BF16), MR A broadcasts, 2·MR `vdpbf16ps` into 2·MR zmm accumulators (with MR = 14,
/// 3 registers left for B and the broadcast). 16 or 28 independent chains cover the
/// instruction's latency (5–6 cycles) at one (Zen 4) or two (Zen 5) per cycle.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_pairs<const MR: usize>(
    steps: usize,
    mut a: *const u32,
    mut b: *const u32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    for r in 0..MR {
        // SAFETY: prefetches are hints, and these addresses lie in the C tile (a row of
        // 32 F32 spans two or three lines).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc).cast());
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16).cast());
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 31).cast());
        }
    }
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for _ in 0..steps {
        // SAFETY: the caller guarantees `steps` steps of MR (a) and 32 (b) u32; the
        // transmutes reinterpret 512 bits of integers as 32 BF16 (same size, any bits).
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(16).cast()));
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r) as i32));
                acc_row[0] = _mm512_dpbf16_ps(acc_row[0], x, b0);
                acc_row[1] = _mm512_dpbf16_ps(acc_row[1], x, b1);
            }
            a = a.add(MR);
            b = b.add(32);
        }
    }
    for (r, acc_row) in acc.iter().enumerate() {
        // SAFETY: the caller guarantees MR rows of 32 floats at stride ldc.
        unsafe {
            let row = c.add(r * ldc);
            let (mut lo, mut hi) = (acc_row[0], acc_row[1]);
            if load_c {
                lo = _mm512_add_ps(_mm512_loadu_ps(row), lo);
                hi = _mm512_add_ps(_mm512_loadu_ps(row.add(16)), hi);
            }
            _mm512_storeu_ps(row, lo);
            _mm512_storeu_ps(row.add(16), hi);
        }
    }
}

/// Blocking as `PortableF32Wide`.
struct Avx512F32;

impl Micro for Avx512F32 {
    type P = f32;
    const KSTEP: usize = 1;
    const SIMD: bool = true;
    const MR: usize = WIDE_MR;
    const NR: usize = WIDE_NR;
    const KC: usize = WIDE_KC;
    const MC: usize = WIDE_MC;
    const NC: usize = WIDE_NC;

    #[inline(always)]
    fn pack_a<T: WithDType>(
        a: &MatRef<'_, T>,
        i0: usize,
        h: usize,
        p0: usize,
        kc: usize,
        out: &mut [f32],
    ) {
        pack_f32::<WIDE_MR, T>(a, i0, h, p0, kc, out, true)
    }

    #[inline(always)]
    fn pack_b<T: WithDType>(
        bt: &MatRef<'_, T>,
        j0: usize,
        w: usize,
        p0: usize,
        kc: usize,
        out: &mut [f32],
    ) {
        pack_f32::<WIDE_NR, T>(bt, j0, w, p0, kc, out, true)
    }

    #[inline(always)]
    unsafe fn tile(
        steps: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        // SAFETY: forwarded from the caller (who also guarantees AVX-512 F).
        unsafe { tile_zmm::<WIDE_MR, { WIDE_NR / 16 }>(steps, a, b, c, ldc, load_c) }
    }
}

/// MR×(16·NV) F32 tile: per k step, NV B loads, MR A broadcasts, MR·NV FMAs into MR·NV
/// zmm accumulators. Each accumulator sums its k steps in order from zero with one
/// rounding per step, then C is added: what `tile_f32::<_, _, true>` does, bit for bit.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile_zmm<const MR: usize, const NV: usize>(
    steps: usize,
    mut a: *const f32,
    mut b: *const f32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    for r in 0..MR {
        for v in 0..NV {
            // SAFETY: prefetches are hints, and these addresses lie in the C tile (a row
            // of 16·NV F32 spans NV or NV + 1 lines).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16 * v).cast()) };
        }
        // SAFETY: as above.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(c.add(r * ldc + 16 * NV - 1).cast()) };
    }
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    for _ in 0..steps {
        // SAFETY: the caller guarantees `steps` steps of MR (a) and 16·NV (b) floats.
        unsafe {
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(b.add(16 * v));
            }
            for (r, acc_row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*a.add(r));
                for (s, &y) in acc_row.iter_mut().zip(&bv) {
                    *s = _mm512_fmadd_ps(x, y, *s);
                }
            }
            a = a.add(MR);
            b = b.add(16 * NV);
        }
    }
    for (r, acc_row) in acc.iter().enumerate() {
        for (v, &s) in acc_row.iter().enumerate() {
            // SAFETY: the caller guarantees MR rows of 16·NV floats at stride ldc.
            unsafe {
                let p = c.add(r * ldc + 16 * v);
                let s = if load_c {
                    _mm512_add_ps(_mm512_loadu_ps(p), s)
                } else {
                    s
                };
                _mm512_storeu_ps(p, s);
            }
        }
    }
}

/// Whether this process may run AMX BF16 code (`cpu::amx::usable`).
pub(super) fn amx_usable() -> bool {
    crate::cpu::amx::usable(crate::cpu::amx::AmxType::Bf16)
}

/// `run_tile` on the AMX kernel, with the tiles configured for it on this thread.
///
/// # Safety
/// `amx_usable()` is true.
pub(super) unsafe fn run_tile_amx<A: WithDType, B: WithDType>(
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
    ws: &mut Workspace,
) {
    // SAFETY: the caller checked that AMX-BF16 is usable.
    let _release = unsafe { TileConfig::all_16x64().load() };
    run_tile::<AmxBf16, A, B>(job, rows, cols, ws)
}

/// Panels and blocking as `PortableAmx`.
struct AmxBf16;

impl Micro for AmxBf16 {
    type P = u32;
    const KSTEP: usize = 2;
    const STEP_ALIGN: usize = 16;
    const MR: usize = AMX_MR;
    const NR: usize = AMX_NR;
    const KC: usize = AMX_KC;
    const MC: usize = AMX_MC;
    const NC: usize = AMX_NC;

    #[inline(always)]
    fn pack_a<T: WithDType>(
        a: &MatRef<'_, T>,
        i0: usize,
        h: usize,
        p0: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        pack_amx_a(a, i0, h, p0, kc, out)
    }

    #[inline(always)]
    fn pack_b<T: WithDType>(
        bt: &MatRef<'_, T>,
        j0: usize,
        w: usize,
        p0: usize,
        kc: usize,
        out: &mut [u32],
    ) {
        pack_pairs::<AMX_NR, 16, true, T>(bt, j0, w, p0, kc, out)
    }

    /// Per 16 pair steps: A rows 0–15 and 16–31 into tiles 4 and 5 (rows `steps` u32
    /// apart), B columns 0–15 and 16–31 into tiles 6 and 7 (rows 128 bytes apart), four
    /// `tdpbf16ps` into the accumulator tiles 0–3; then the tiles are stored to C, or to
    /// a buffer added to C.
    #[inline(always)]
    unsafe fn tile(
        steps: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    ) {
        debug_assert!(steps > 0 && steps.is_multiple_of(16));
        #[repr(C, align(64))]
        struct Buf([f32; AMX_MR * AMX_NR]);
        // Not zeroed (a 4 KiB memset per tile call was 1.3% of a BERT step): the four
        // tile stores below write all of it before it is read.
        let mut buf = std::mem::MaybeUninit::<Buf>::uninit();
        let (dst, ld) = if load_c {
            (buf.as_mut_ptr().cast::<f32>(), AMX_NR)
        } else {
            (c, ldc)
        };
        // SAFETY: the caller guarantees `steps` pair steps of 32 A rows (row-major, row
        // stride `steps` u32) and 32 B columns (128 bytes a step), and 32 rows of 32
        // writable F32 at stride `ld` in `dst` (C, or the buffer); `run_tile_amx`
        // configured tiles 0-7 as 16 rows of 64 bytes. Only tile registers, the
        // pointer copies and the flags are changed.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm5, [{a2} + {sa}]",
                "tileloadd tmm6, [{b} + {sb}]",
                "tileloadd tmm7, [{b} + {sb} + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, 64",
                "add {a2}, 64",
                "add {b}, 2048",
                "dec {n}",
                "jnz 2b",
                "tilestored [{d} + {sd}], tmm0",
                "tilestored [{d} + {sd} + 64], tmm1",
                "tilestored [{d2} + {sd}], tmm2",
                "tilestored [{d2} + {sd} + 64], tmm3",
                a = inout(reg) a => _,
                a2 = inout(reg) a.add(16 * steps) => _,
                b = inout(reg) b => _,
                n = inout(reg) steps / 16 => _,
                sa = in(reg) steps * 4,
                sb = in(reg) AMX_NR * 4,
                d = in(reg) dst,
                d2 = in(reg) dst.add(16 * ld),
                sd = in(reg) ld * 4,
                options(nostack),
            );
        }
        if load_c {
            // SAFETY: the tile stores wrote the whole buffer (32 rows of 128 bytes).
            let buf = unsafe { buf.assume_init_ref() };
            for (r, row) in buf.0.chunks_exact(AMX_NR).enumerate() {
                // SAFETY: row r of the C tile, 32 F32, per the caller's guarantee.
                let c_row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), AMX_NR) };
                for (d, &s) in c_row.iter_mut().zip(row) {
                    *d += s;
                }
            }
        }
    }
}
