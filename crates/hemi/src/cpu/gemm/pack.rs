//! Packing for hemi's blocked GEMM: A panels (packed per task, or once ahead: `PackedA`),
//! B panels from a matrix or from a convolution's image (`unfold`), in the F32, BF16-pair
//! and AMX formats; and each thread's pack buffers.

use half::{bf16, f16, slice::HalfFloatSliceExt};
use std::cell::RefCell;

use super::blocked::{k_block_len, packed_steps, Micro, AMX_MR, MAX_KC};
use super::portable::{PortableAmx, PortableF32, PortableF32Wide, PortablePairs};
use super::select::{pair_rows, Kernel};
use super::unfold::{self, Unfold};
#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::cpu::gemm::MatRef;
use crate::dtype::{same_slice, WithDType};
use crate::DType;

/// A left operand packed once for one kernel, for products that share it: a convolution's
/// weights, multiplied with the column matrix of every image of the batch. Packing A is part
/// of every product (`gemm_with` packs it per task); for ResNet-20's 64-channel layers,
/// 64×576 weights times an 8×8 image, it was a tenth of the convolution. The panels are the
/// kernel's own, so `gemm_packed` gives the bits of `gemm_with` on the matrix.
pub struct PackedA {
    pub(super) kernel: Kernel,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Start of each k block's panels (all rows), in 4-byte elements.
    blocks: Vec<usize>,
    data: Vec<Line>,
}

impl PackedA {
    /// `a` packed for `kernel`. Panics where the CPU lacks the kernel or its format does not
    /// take `a`'s dtype.
    pub fn new<A: WithDType>(kernel: Kernel, a: MatRef<'_, A>) -> Self {
        assert!(
            kernel.is_available(),
            "gemm_half: this CPU cannot run {}",
            kernel.name()
        );
        assert!(
            kernel.accepts(a.dtype(), a.dtype()),
            "gemm_half: {} does not take {:?}",
            kernel.name(),
            a.dtype()
        );
        a.check_bounds("lhs");
        // The packing is compiled here once per dtype, not again in each crate that calls
        // `new` (see `blocked::run_job`).
        fn f32_panels(kernel: Kernel, a: MatRef<'_, f32>) -> PackedA {
            PackedA::pack(kernel, a)
        }
        fn f16_panels(kernel: Kernel, a: MatRef<'_, f16>) -> PackedA {
            PackedA::pack(kernel, a)
        }
        fn bf16_panels(kernel: Kernel, a: MatRef<'_, bf16>) -> PackedA {
            PackedA::pack(kernel, a)
        }
        if let Some(a) = a.cast::<f32>() {
            f32_panels(kernel, a)
        } else if let Some(a) = a.cast::<f16>() {
            f16_panels(kernel, a)
        } else if let Some(a) = a.cast::<bf16>() {
            bf16_panels(kernel, a)
        } else {
            unreachable!("`accepts` takes F32, F16 or BF16 only")
        }
    }

    /// `new` after its checks.
    fn pack<A: WithDType>(kernel: Kernel, a: MatRef<'_, A>) -> Self {
        // Each x86 kernel packs as its portable twin does (same panels, same blocking).
        let (blocks, data) = match kernel {
            Kernel::PortableF32 | Kernel::Avx2Fma => pack_whole::<PortableF32, A>(&a),
            Kernel::PortableF32Wide | Kernel::Avx512F32 => pack_whole::<PortableF32Wide, A>(&a),
            Kernel::PortableBf16Pairs | Kernel::Avx512Bf16 if pair_rows(a.rows) == 8 => {
                pack_whole::<PortablePairs<8>, A>(&a)
            }
            Kernel::PortableBf16Pairs | Kernel::Avx512Bf16 => {
                pack_whole::<PortablePairs<14>, A>(&a)
            }
            Kernel::PortableAmx | Kernel::AmxBf16 => pack_whole::<PortableAmx, A>(&a),
        };
        PackedA {
            kernel,
            dtype: a.dtype(),
            rows: a.rows,
            cols: a.cols,
            blocks,
            data,
        }
    }

    /// The kernel the panels are for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// (rows, cols) of the packed matrix.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// `count` panels of `len` elements from panel `first` of k block `block`.
    pub(super) fn panels<P: Packed>(
        &self,
        block: usize,
        first: usize,
        count: usize,
        len: usize,
    ) -> &[P] {
        let all = self.data.len() * 16;
        // SAFETY: `data` holds `all` initialised 4-byte elements; `Packed` types are 4 bytes
        // with every bit pattern valid; the slice borrows `data`.
        let elems = unsafe { std::slice::from_raw_parts(self.data.as_ptr().cast::<P>(), all) };
        &elems[self.blocks[block] + first * len..][..count * len]
    }
}

/// The k blocks of `a` for `M`, each with all its rows packed (`M::pack_a`), as `run_tile`
/// cuts them.
fn pack_whole<M: Micro, A: WithDType>(a: &MatRef<'_, A>) -> (Vec<usize>, Vec<Line>) {
    let (m, k) = (a.rows, a.cols);
    let kc_max = k_block_len::<M>(k);
    let m_panels = m.div_ceil(M::MR);
    let mut blocks = Vec::new();
    let mut total = 0;
    for pc in (0..k).step_by(kc_max.max(1)) {
        blocks.push(total);
        total += m_panels * packed_steps::<M>((k - pc).min(kc_max)) * M::MR;
    }
    let mut data = Vec::new();
    let out = as_packed::<M::P>(&mut data, total);
    for (b, pc) in (0..k).step_by(kc_max.max(1)).enumerate() {
        let len = m_panels * packed_steps::<M>((k - pc).min(kc_max)) * M::MR;
        M::pack_a(
            a,
            0,
            m,
            pc,
            (k - pc).min(kc_max),
            &mut out[blocks[b]..][..len],
        );
    }
    (blocks, data)
}

/// `M::pack_b` of the column matrix `u`: its F32 panels, `M::NR` wide, filled by `unfold`.
#[inline(always)]
pub(super) fn pack_b_unfold<M: Micro, B: WithDType>(
    u: &Unfold<'_, B>,
    j0: usize,
    w: usize,
    p0: usize,
    kc: usize,
    out: &mut [M::P],
) {
    match (M::KSTEP, M::NR) {
        (1, 16) => unfold::unfold_f32::<16, B>(u, j0, w, p0, kc, unfold::as_f32s(out), M::SIMD),
        (1, 32) => unfold::unfold_f32::<32, B>(u, j0, w, p0, kc, unfold::as_f32s(out), M::SIMD),
        (s, nr) => unreachable!("gemm_unfold checks for F32 panels ({s}-step, {nr} wide here)"),
    }
}

/// `M::pack_b` of a column matrix in channel pairs: pair steps `p0 / 2..` are rows of `u`
/// (k blocks start and end on even k: KC and the alignment are even, and so is k).
#[inline(always)]
pub(super) fn pack_b_pairs<M: Micro>(
    u: &Unfold<'_, f32>,
    j0: usize,
    w: usize,
    p0: usize,
    kc: usize,
    out: &mut [M::P],
) {
    match (M::KSTEP, M::NR, M::STEP_ALIGN) {
        (2, 32, 1) => {
            debug_assert!(p0.is_multiple_of(2) && kc.is_multiple_of(2));
            let out = unfold::as_f32s(out);
            unfold::unfold_f32::<32, f32>(u, j0, w, p0 / 2, kc / 2, out, false)
        }
        (s, nr, a) => unreachable!(
            "gemm_unfold_pairs checks for unpadded pairs ({s}-step, {nr} wide, {a}-aligned here)"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Packing. A panels are packed from A with W = MR, B panels from Bᵀ with W = NR, so one
// function per format serves both: row r of a panel is row i0 + r of `x`.

/// k indices packed together when a block's panel rows are contiguous in memory: the packing
/// walks PACK_STEPS k indices of every panel in turn, so that it reads each k index's row of
/// the block from start to end (PACK_STEPS sequential streams) rather than a W-wide piece of
/// it per panel (a new cache line per piece, half of it used, for BF16 with W = 16).
pub(super) const PACK_STEPS: usize = 16;

/// F32 panels: panel t holds rows `i0 + t*W ..` of `x`; `panel[p * W + r] = x(i0 + t*W + r,
/// p0 + p)` as F32 for p < kc, rows past `h` zero. `simd`: the caller runs with AVX2 and
/// F16C enabled (the `avx2-fma` and `avx512f` kernels).
#[inline(always)]
pub(super) fn pack_f32<const W: usize, T: WithDType>(
    x: &MatRef<'_, T>,
    i0: usize,
    h: usize,
    p0: usize,
    kc: usize,
    out: &mut [f32],
    simd: bool,
) {
    let (n_panels, plen) = (h.div_ceil(W), kc * W);
    let out = &mut out[..n_panels * plen];
    if x.rs == 1 && h > 1 {
        // The rows of one k index are contiguous (row-major B, column-major A): convert them
        // straight into place, a run of constant length W where the panel is full.
        for ps in (0..kc).step_by(PACK_STEPS) {
            for (t, panel) in out.chunks_exact_mut(plen).enumerate() {
                let w = (h - t * W).min(W);
                let steps = panel
                    .chunks_exact_mut(W)
                    .enumerate()
                    .skip(ps)
                    .take(PACK_STEPS);
                for (p, step) in steps {
                    let at = x.offset(i0 + t * W, p0 + p);
                    if let (true, Some(src)) = (w == W, same_slice::<T, f32>(x.data)) {
                        // A copy of constant length, inlined (through `load_run` it was a
                        // call to memmove per W floats: a tenth of an F32 ResNet-20 step).
                        let src: &[f32; W] = src[at as usize..][..W].try_into().expect("W");
                        let dst: &mut [f32; W] = (&mut step[..W]).try_into().expect("W");
                        *dst = *src;
                    } else if w == W {
                        load_run(x.data, at, 1, &mut step[..W], simd);
                    } else {
                        load_run(x.data, at, 1, &mut step[..w], simd);
                        step[w..].fill(0.0);
                    }
                }
            }
        }
    } else {
        // One row at a time along k (contiguous for row-major A), scattered with stride W;
        // with AVX, eight rows at a time through 8×8 register transposes (a B panel of a
        // transposed B, e.g. a convolution's weight gradient `dy · colᵀ`, packed 4× faster).
        // Row buffers for sources that are not F32 rows contiguous along k, zeroed as far as
        // this call reads them (kc values a row): zeroing all 18 KiB for every panel was a
        // seventh of a BERT attention forward, whose panels are 32 k indices deep, and once
        // a call still 16 KiB per 32-deep panel block.
        let mut buf = Scratch::<MAX_KC>::new();
        #[cfg(target_arch = "x86_64")]
        let mut rows_store = Scratch::<{ 8 * MAX_KC }>::new();
        for (t, panel) in out.chunks_exact_mut(plen).enumerate() {
            let w = (h - t * W).min(W);
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut first = 0;
            #[cfg(target_arch = "x86_64")]
            if simd && W.is_multiple_of(8) {
                let n8 = kc / 8 * 8;
                while first + 8 <= w {
                    let at = |i: usize| x.offset(i0 + t * W + first + i, p0);
                    let src: [&[f32]; 8] = match (x.cs, same_slice::<T, f32>(x.data)) {
                        // F32 rows contiguous along k: transposed straight from the source.
                        (1, Some(s)) => std::array::from_fn(|i| &s[at(i) as usize..][..kc]),
                        _ => {
                            let rows = rows_store.take(8 * kc);
                            for i in 0..8 {
                                load_run(x.data, at(i), x.cs, &mut rows[i * kc..][..kc], simd);
                            }
                            std::array::from_fn(|i| &rows[i * kc..][..kc])
                        }
                    };
                    // SAFETY: `simd` is set only by the avx2-fma and avx512f kernels (AVX); the
                    // function checks that the panel holds the n8 steps it writes.
                    unsafe { x86::transpose_rows_8(&src, n8, panel, W, first) };
                    for p in n8..kc {
                        for (i, row) in src.iter().enumerate() {
                            panel[p * W + first + i] = row[p];
                        }
                    }
                    first += 8;
                }
            }
            for r in first..w {
                let at = x.offset(i0 + t * W + r, p0);
                let run: &[f32] = match same_slice::<T, f32>(x.data) {
                    Some(s) if x.cs == 1 => &s[at as usize..][..kc],
                    _ => {
                        let buf = buf.take(kc);
                        load_run(x.data, at, x.cs, buf, simd);
                        buf
                    }
                };
                for (step, &v) in panel.chunks_exact_mut(W).zip(run) {
                    step[r] = v;
                }
            }
            if w < W {
                for step in panel.chunks_exact_mut(W) {
                    step[w..].fill(0.0);
                }
            }
        }
    }
}

/// Up to `N` F32 on the stack, left uninitialised until a call takes a prefix of them, which
/// is zeroed then (once: a longer prefix later zeroes only the rest).
struct Scratch<const N: usize> {
    store: [std::mem::MaybeUninit<f32>; N],
    zeroed: usize,
}

impl<const N: usize> Scratch<N> {
    #[inline(always)]
    fn new() -> Self {
        Scratch {
            store: [std::mem::MaybeUninit::uninit(); N],
            zeroed: 0,
        }
    }

    /// The first `len` values (at most `N`), zero where no earlier call wrote them.
    #[inline(always)]
    fn take(&mut self, len: usize) -> &mut [f32] {
        assert!(len <= N, "scratch of {N} values: {len} asked");
        if self.zeroed < len {
            for v in &mut self.store[self.zeroed..len] {
                v.write(0.0);
            }
            self.zeroed = len;
        }
        // SAFETY: the first `zeroed >= len` values are initialised; `MaybeUninit<f32>` has
        // f32's layout; the slice borrows `self` mutably.
        unsafe { std::slice::from_raw_parts_mut(self.store.as_mut_ptr().cast(), len) }
    }
}

/// Converts `out.len()` elements of `src`, starting at `start`, `stride` apart, to F32.
/// The view's `check_bounds` keeps them in bounds; indexing checks again.
#[inline(always)]
pub(super) fn load_run<T: WithDType>(
    src: &[T],
    start: isize,
    stride: isize,
    out: &mut [f32],
    simd: bool,
) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd; // always false there
    let n = out.len();
    let s = start as usize;
    let at = |t: usize| (start + t as isize * stride) as usize;
    // One branch survives per element type (`same_slice` compares type ids, constants).
    if let Some(x) = same_slice::<T, f32>(src) {
        if stride == 1 {
            out.copy_from_slice(&x[s..s + n]);
        } else {
            out.iter_mut().enumerate().for_each(|(t, o)| *o = x[at(t)]);
        }
    } else if let Some(x) = same_slice::<T, f16>(src) {
        if stride == 1 {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is set only by kernels that need F16C (avx2-fma, avx512f).
                unsafe { crate::dtype::convert::f16_to_f32_f16c(&x[s..s + n], out) };
                return;
            }
            x[s..s + n].convert_to_f32_slice(out)
        } else {
            out.iter_mut()
                .enumerate()
                .for_each(|(t, o)| *o = x[at(t)].to_f32());
        }
    } else if let Some(x) = same_slice::<T, bf16>(src) {
        if stride == 1 {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is set only by kernels that need AVX2 (avx2-fma, avx512f).
                unsafe { x86::bf16_to_f32_avx2(&x[s..s + n], out) };
                return;
            }
            for (o, h) in out.iter_mut().zip(&x[s..s + n]) {
                *o = bf16_bits_to_f32(h.to_bits());
            }
        } else {
            out.iter_mut()
                .enumerate()
                .for_each(|(t, o)| *o = bf16_bits_to_f32(x[at(t)].to_bits()));
        }
    } else {
        unreachable!("gemm_with checks that operands are F32, F16 or BF16")
    }
}

/// BF16 is the top half of an F32. (A signalling NaN stays signalling; in a product it makes
/// a NaN all the same.)
#[inline(always)]
pub(super) fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// BF16 pairs: panel t holds rows `i0 + t*W ..` of `x`; with i = i0 + t*W + r,
/// `panel[q * W + r] = bits x(i, p0 + 2q) | bits x(i, p0 + 2q + 1) << 16` for q < ceil(kc / 2),
/// the high half zero past kc, rows past `h` zero, and the steps padded with zeros to a
/// multiple of ALIGN. This is the layout `vdpbf16ps` reads: lane j of a register holds the
/// even k index in its low 16 bits; and, with W = 32, two AMX B tiles side by side (16 rows
/// of 16 columns × a pair, 128 bytes apart).
#[inline(always)]
pub(super) fn pack_pairs<const W: usize, const ALIGN: usize, const SIMD: bool, T: WithDType>(
    x: &MatRef<'_, T>,
    i0: usize,
    h: usize,
    p0: usize,
    kc: usize,
    out: &mut [u32],
) {
    let Some(s) = same_slice::<T, bf16>(x.data) else {
        unreachable!("gemm_with checks that pair kernels get BF16 operands")
    };
    let real = kc.div_ceil(2);
    let steps = real.next_multiple_of(ALIGN);
    let (n_panels, plen) = (h.div_ceil(W), steps * W);
    let out = &mut out[..n_panels * plen];
    let bits = |o: isize| s[o as usize].to_bits() as u32;
    if x.rs == 1 && h > 1 {
        // The rows of one k index are contiguous: zip the runs of k indices 2q and 2q + 1,
        // PACK_STEPS k indices of every panel in turn (see PACK_STEPS).
        for qs in (0..real).step_by(PACK_STEPS / 2) {
            for (t, panel) in out.chunks_exact_mut(plen).enumerate() {
                let w = (h - t * W).min(W);
                let pair_steps = panel.chunks_exact_mut(W).enumerate().skip(qs);
                for (q, step) in pair_steps.take((PACK_STEPS / 2).min(real - qs)) {
                    let p = p0 + 2 * q;
                    let lo = &s[x.offset(i0 + t * W, p) as usize..][..w];
                    if 2 * q + 1 < kc {
                        let hi = &s[x.offset(i0 + t * W, p + 1) as usize..][..w];
                        for ((o, l), h) in step.iter_mut().zip(lo).zip(hi) {
                            *o = l.to_bits() as u32 | (h.to_bits() as u32) << 16;
                        }
                    } else {
                        for (o, l) in step.iter_mut().zip(lo) {
                            *o = l.to_bits() as u32;
                        }
                    }
                    if w < W {
                        // Guarded: an empty fill is still a call to memset, once per step
                        // (1 % of a BERT amp-bf16 step).
                        step[w..].fill(0);
                    }
                }
            }
        }
    } else {
        // One row at a time along k, pairs of neighbours, scattered with stride W; with AVX
        // and rows contiguous along k, eight rows at a time: a row's pairs are its BF16 run
        // read as u32 (x86 is little-endian: k index 2q in the low half), so the panel is an
        // 8×8 transpose of 32-bit values, as in `pack_f32` (a convolution's weight gradient
        // `dy · colᵀ` packs both operands this way).
        for (t, panel) in out.chunks_exact_mut(plen).enumerate() {
            let w = (h - t * W).min(W);
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut first = 0;
            #[cfg(target_arch = "x86_64")]
            if SIMD && x.cs == 1 && W.is_multiple_of(8) {
                // Read in place: the whole pairs of each row (kc / 2 of them), no copy. (A
                // copy into eight zeroed row buffers was 5 % of a ResNet-20 amp-bf16 step:
                // the weight gradient packs a few dozen k indices a call, the zeroing was
                // 16 KiB.)
                let n8 = kc / 2 / 8 * 8;
                // SAFETY: u32 and f32 have the same size, and every bit pattern is valid for
                // both.
                let panel32: &mut [f32] = unsafe {
                    std::slice::from_raw_parts_mut(panel.as_mut_ptr().cast(), panel.len())
                };
                while first + 8 <= w {
                    let at = |i: usize| x.offset(i0 + t * W + first + i, p0) as usize;
                    // Bounds: each row's run of kc BF16 lies inside `s` (indexing checks).
                    let rows: [*const f32; 8] =
                        std::array::from_fn(|i| s[at(i)..at(i) + kc].as_ptr().cast::<f32>());
                    // SAFETY: SIMD is set only by the AVX-512 kernels (AVX); each pointer
                    // starts a run of kc BF16, so n8 <= kc / 2 u32 pairs are readable; the
                    // function checks that the panel holds the n8 steps it writes.
                    unsafe { x86::transpose_ptrs_8(&rows, n8, panel32, W, first) };
                    for q in n8..real {
                        for i in 0..8 {
                            let run = &s[at(i)..at(i) + kc];
                            let hi = run.get(2 * q + 1).map_or(0, |h| h.to_bits() as u32);
                            let pair = run[2 * q].to_bits() as u32 | hi << 16;
                            panel32[q * W + first + i] = f32::from_bits(pair);
                        }
                    }
                    first += 8;
                }
            }
            for r in first..w {
                let at = x.offset(i0 + t * W + r, p0);
                if x.cs == 1 {
                    let run = &s[at as usize..][..kc];
                    for (step, pair) in panel.chunks_exact_mut(W).zip(run.chunks(2)) {
                        let hi = pair.get(1).map_or(0, |h| h.to_bits() as u32);
                        step[r] = pair[0].to_bits() as u32 | hi << 16;
                    }
                } else {
                    for (q, step) in panel.chunks_exact_mut(W).enumerate().take(real) {
                        let lo = bits(at + 2 * q as isize * x.cs);
                        let hi = if 2 * q + 1 < kc {
                            bits(at + (2 * q + 1) as isize * x.cs)
                        } else {
                            0
                        };
                        step[r] = lo | hi << 16;
                    }
                }
            }
            if w < W {
                for step in panel.chunks_exact_mut(W).take(real) {
                    step[w..].fill(0);
                }
            }
        }
    }
    if steps > real {
        for panel in out.chunks_exact_mut(plen) {
            panel[real * W..].fill(0);
        }
    }
}

/// AMX A panels: panel t holds rows `i0 + t*AMX_MR ..` of `x`, row-major: as 16-bit
/// elements, `panel16[r * 2*steps + p] = bits x(i0 + t*AMX_MR + r, p0 + p)` for p < kc, with
/// `steps = ceil(kc / 2)` padded to a multiple of 16, zeros past kc and in rows past `h`.
/// A row of 16 pair steps is one row of an AMX A tile (16 × 32 BF16), rows `2*steps * 2`
/// bytes apart. (Defined in 16-bit elements, so the portable twin reads it the same way
/// whatever the byte order; on x86 the even k index is the low half of each u32.)
#[inline(always)]
pub(super) fn pack_amx_a<T: WithDType>(
    x: &MatRef<'_, T>,
    i0: usize,
    h: usize,
    p0: usize,
    kc: usize,
    out: &mut [u32],
) {
    let Some(s) = same_slice::<T, bf16>(x.data) else {
        unreachable!("gemm_with checks that AMX kernels get BF16 operands")
    };
    let row_len = 2 * kc.div_ceil(2).next_multiple_of(16);
    let (n_panels, plen) = (h.div_ceil(AMX_MR), AMX_MR * row_len);
    let out = as_halves(&mut out[..n_panels * plen / 2]);
    for (t, panel) in out.chunks_exact_mut(plen).enumerate() {
        let w = (h - t * AMX_MR).min(AMX_MR);
        let r0 = i0 + t * AMX_MR;
        if x.cs == 1 {
            // Row-major A: each row is a copy of the block's run of k indices.
            for (r, row) in panel.chunks_exact_mut(row_len).take(w).enumerate() {
                let run = &s[x.offset(r0 + r, p0) as usize..][..kc];
                for (o, v) in row.iter_mut().zip(run) {
                    *o = v.to_bits();
                }
                row[kc..].fill(0);
            }
        } else if x.rs == 1 {
            // Column-major A (a transposed operand): the rows of one k index are contiguous,
            // so read them in order and scatter a column of the panel.
            for p in 0..kc {
                let run = &s[x.offset(r0, p0 + p) as usize..][..w];
                for (r, v) in run.iter().enumerate() {
                    panel[r * row_len + p] = v.to_bits();
                }
            }
            for row in panel.chunks_exact_mut(row_len).take(w) {
                row[kc..].fill(0);
            }
        } else {
            for (r, row) in panel.chunks_exact_mut(row_len).take(w).enumerate() {
                for (p, o) in row[..kc].iter_mut().enumerate() {
                    *o = s[x.offset(r0 + r, p0 + p) as usize].to_bits();
                }
                row[kc..].fill(0);
            }
        }
        panel[w * row_len..].fill(0);
    }
}

/// A pack buffer of u32 seen as twice as many u16 (in memory order).
#[inline(always)]
pub(crate) fn as_halves(x: &mut [u32]) -> &mut [u16] {
    // SAFETY: u16 has a smaller alignment than u32, every bit pattern is valid for both, and
    // the new slice covers exactly the same bytes, borrowed mutably from `x`.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u16>(), x.len() * 2) }
}

// ---------------------------------------------------------------------------------------------
// Pack buffers

/// A packed element type: 4 bytes, every bit pattern valid.
///
/// # Safety
/// Only for types of size 4, alignment <= 64, with no invalid bit patterns.
pub(super) unsafe trait Packed: Copy + 'static {}
// SAFETY: 4-byte plain numbers.
unsafe impl Packed for f32 {}
// SAFETY: as above.
unsafe impl Packed for u32 {}

/// A cache line of the pack buffers: panels start on line boundaries, so a B step of 16
/// F32 (or 32 u32 pairs) is one (or two) whole lines.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u32; 16]);

/// The A and B pack buffers of one thread, kept between products so that a training step's
/// hundreds of products do not each allocate and page-fault fresh buffers.
#[derive(Default)]
pub(super) struct Workspace {
    a: Vec<Line>,
    b: Vec<Line>,
}

impl Workspace {
    pub(super) fn buffers<P: Packed>(
        &mut self,
        a_len: usize,
        b_len: usize,
    ) -> (&mut [P], &mut [P]) {
        (as_packed(&mut self.a, a_len), as_packed(&mut self.b, b_len))
    }
}

fn as_packed<P: Packed>(buf: &mut Vec<Line>, len: usize) -> &mut [P] {
    let lines = len.div_ceil(16);
    if buf.len() < lines {
        buf.resize(lines, Line([0; 16]));
    }
    // SAFETY: the buffer holds at least `len` 4-byte elements, 64-byte aligned and
    // initialised; `Packed` types are 4 bytes with every bit pattern valid; the returned
    // slice borrows the buffer mutably.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<P>(), len) }
}

thread_local! {
    static WORKSPACE: RefCell<Workspace> = RefCell::new(Workspace::default());
}

/// Runs `f` with this thread's workspace (a fresh one in the unlikely case it is in use,
/// e.g. a product started from inside another's task).
pub(super) fn with_workspace<R>(f: impl FnOnce(&mut Workspace) -> R) -> R {
    WORKSPACE.with(|ws| match ws.try_borrow_mut() {
        Ok(mut ws) => f(&mut ws),
        Err(_) => f(&mut Workspace::default()),
    })
}
