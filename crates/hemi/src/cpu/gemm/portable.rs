//! The portable microkernels of hemi's blocked GEMM: plain Rust on every packed format, the
//! twins the x86 kernels are held to (same panels, same blocking).

use super::blocked::{Micro, AMX_KC, AMX_MC, AMX_MR, AMX_NC, AMX_NR};
use super::blocked::{WIDE_KC, WIDE_MC, WIDE_MR, WIDE_NC, WIDE_NR};
use super::pack::{bf16_bits_to_f32, pack_amx_a, pack_f32, pack_pairs};
use crate::cpu::gemm::MatRef;
use crate::dtype::WithDType;

/// Blocking of the F32-panel kernels, for Zen 3 (32 KiB L1d, 512 KiB L2 per core): the B
/// micro-panel is 512 × 16 F32 = 32 KiB (measured faster than 256, as the gemm crate's KC >=
/// 512), an A block 144 × 512 F32 = 288 KiB.
pub(super) struct PortableF32;

impl Micro for PortableF32 {
    type P = f32;
    const KSTEP: usize = 1;
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
        pack_f32::<6, T>(a, i0, h, p0, kc, out, false)
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
        pack_f32::<16, T>(bt, j0, w, p0, kc, out, false)
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
        // SAFETY: forwarded from the caller.
        unsafe { tile_f32::<6, 16, false>(steps, a, b, c, ldc, load_c) }
    }
}

/// Blocking of the wide F32-panel kernels (`portable-wide`, `avx512f`), for Zen 4 / Zen 5
/// (32 / 48 KiB L1d, 1 MiB L2 per core): the B micro-panel is 256 × 32 F32 = 32 KiB, an A
/// block 256 × 256 F32 = 256 KiB. The 8-row tile divides the channel counts of convolutions
/// (16, 32, 64, and 9× those for the input gradient), so their products waste no rows.
pub(super) struct PortableF32Wide;

impl Micro for PortableF32Wide {
    type P = f32;
    const KSTEP: usize = 1;
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
        pack_f32::<WIDE_MR, T>(a, i0, h, p0, kc, out, false)
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
        pack_f32::<WIDE_NR, T>(bt, j0, w, p0, kc, out, false)
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
        // SAFETY: forwarded from the caller.
        unsafe { tile_f32::<WIDE_MR, WIDE_NR, true>(steps, a, b, c, ldc, load_c) }
    }
}

/// The F32-panel tile in plain Rust: `acc[r][j] += a[r] · b[j]` step by step from zero, the
/// product rounded before the add, or not (`FUSED`: `f32::mul_add`, one rounding, as an FMA
/// instruction), then `c = (load_c ? c : 0) + acc`.
///
/// # Safety
/// As `Micro::tile`.
#[inline(always)]
unsafe fn tile_f32<const MR: usize, const NR: usize, const FUSED: bool>(
    steps: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    // SAFETY: the caller guarantees `steps` steps of MR and NR elements.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(a, steps * MR),
            std::slice::from_raw_parts(b, steps * NR),
        )
    };
    let mut acc = [[0f32; NR]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        for (acc_row, &x) in acc.iter_mut().zip(ap) {
            for (s, &y) in acc_row.iter_mut().zip(bp) {
                *s = if FUSED { x.mul_add(y, *s) } else { *s + x * y };
            }
        }
    }
    // SAFETY: the caller guarantees C is MR rows of NR at stride ldc.
    unsafe { store_tile(&acc, c, ldc, load_c) }
}

/// Blocking of the BF16-pair kernels, for Sapphire Rapids / Zen 4 (48 / 32 KiB L1d, 2 / 1 MiB
/// L2 per core): the B micro-panel is 192 pair steps × 32 × 4 B = 24 KiB, an A block 336 × 192
/// × 4 B = 252 KiB.
pub(super) struct PortablePairs<const MR: usize>;

impl<const MR: usize> Micro for PortablePairs<MR> {
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
        pack_pairs::<MR, 1, false, T>(a, i0, h, p0, kc, out)
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
        pack_pairs::<32, 1, false, T>(bt, j0, w, p0, kc, out)
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
        // SAFETY: the caller guarantees `steps` steps of MR and NR elements.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a, steps * MR),
                std::slice::from_raw_parts(b, steps * 32),
            )
        };
        let mut acc = [[0f32; 32]; MR];
        for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(32)) {
            for (acc_row, &x) in acc.iter_mut().zip(ap) {
                let (x0, x1) = (
                    bf16_bits_to_f32(x as u16),
                    bf16_bits_to_f32((x >> 16) as u16),
                );
                for (s, &y) in acc_row.iter_mut().zip(bp) {
                    let (y0, y1) = (
                        bf16_bits_to_f32(y as u16),
                        bf16_bits_to_f32((y >> 16) as u16),
                    );
                    // As `vdpbf16ps` (Intel SDM): products of BF16 values are exact in F32;
                    // the odd k index's is added first, then the even one's.
                    *s += x1 * y1;
                    *s += x0 * y0;
                }
            }
        }
        // SAFETY: the caller guarantees C is MR rows of NR at stride ldc.
        unsafe { store_tile(&acc, c, ldc, load_c) }
    }
}

/// Blocking of the AMX kernels, for Sapphire Rapids (48 KiB L1d, 2 MiB L2 per core): the B
/// micro-panel is 256 pair steps × 32 × 4 B = 32 KiB, an A block 256 × 512 BF16 = 256 KiB.
pub(super) struct PortableAmx;

impl Micro for PortableAmx {
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
        pack_pairs::<AMX_NR, 16, false, T>(bt, j0, w, p0, kc, out)
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
        // SAFETY: the caller guarantees `steps` steps of MR and NR elements; the A panel is
        // read as the 16-bit elements it was written as.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a.cast::<u16>(), 2 * steps * AMX_MR),
                std::slice::from_raw_parts(b, steps * AMX_NR),
            )
        };
        let mut acc = [[0f32; AMX_NR]; AMX_MR];
        for (acc_row, a_row) in acc.iter_mut().zip(a.chunks_exact(2 * steps)) {
            for (pair, bp) in a_row.chunks_exact(2).zip(b.chunks_exact(AMX_NR)) {
                let (x0, x1) = (bf16_bits_to_f32(pair[0]), bf16_bits_to_f32(pair[1]));
                for (s, &y) in acc_row.iter_mut().zip(bp) {
                    let (y0, y1) = (
                        bf16_bits_to_f32(y as u16),
                        bf16_bits_to_f32((y >> 16) as u16),
                    );
                    // As the Intel SDM's pseudocode of `tdpbf16ps`: products of BF16 values
                    // are exact in F32; the even k index's is added first, then the odd one's.
                    *s += x0 * y0;
                    *s += x1 * y1;
                }
            }
        }
        // SAFETY: the caller guarantees C is MR rows of NR at stride ldc.
        unsafe { store_tile(&acc, c, ldc, load_c) }
    }
}

/// Stores an accumulator tile: `c = (load_c ? c : 0) + acc`.
///
/// # Safety
/// `c` is R rows of N writable F32 at stride `ldc`.
#[inline(always)]
unsafe fn store_tile<const R: usize, const N: usize>(
    acc: &[[f32; N]; R],
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    for (r, acc_row) in acc.iter().enumerate() {
        // SAFETY: row r of C, N elements, per the caller's guarantee.
        let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), N) };
        for (d, &s) in row.iter_mut().zip(acc_row) {
            *d = if load_c { *d + s } else { s };
        }
    }
}
