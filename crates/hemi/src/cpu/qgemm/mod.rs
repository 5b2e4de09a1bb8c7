//! INT8 GEMM: `C[m, n] = Σ_k A[m, k] · W[n, k]` with A unsigned 8-bit activations (row-major,
//! row stride `lda`), W signed 8-bit weights (`[n, k]`, PyTorch's `[out, in]`), sums in
//! exact 32-bit integers, then an epilogue applied per output tile (`Epilogue`).
//!
//! The quantised layers of `quant` call this: activations are affine u8 (scale, zero point
//! per row or per tensor), weights symmetric s8 per output channel (zero point 0), so the
//! zero-point correction is `-a_zero[i] · colsum[j]` where `colsum[j] = Σ_k W[j, k]` is
//! computed once, when the weights are packed (`PackedB`).
//!
//! Kernels (`QKernel`), chosen at run time (`QKernel::best`), each SIMD one with a plain-Rust
//! twin on the same packed layout, so that packing, tiling and the m, n, k tails are tested
//! on any CPU:
//! - `portable-i8`: plain Rust over the unpacked rows, any CPU; the reference the others
//!   are tested against.
//! - `amx-i8` / `portable-amx-i8`: Intel AMX `tdpbusd`, 32×32 tiles (2×2 accumulator
//!   tiles), k in steps of 64 and chunks of 512. Products of at most `AMX_MIN_M` rows run
//!   `avx512-vnni` on the same panels. Not in the brief this file was written to, which
//!   stopped at VNNI: on a 2-core Xeon with AMX, hemi's BF16 matmul runs on `amx-bf16`, and
//!   no `vpdpbusd` kernel comes near 1.3× of that (`avx512-vnni` is at its port limit).
//! - `avx512-vnni` / `portable-vnni512`: 8×32 tiles of `vpdpbusd` on zmm (16 accumulators;
//!   per step of 4 k: two B loads, eight A broadcasts, sixteen `vpdpbusd`).
//! - `avx-vnni` / `portable-vnni256`: 6×16 tiles of the VEX `vpdpbusd` on ymm (AVX-VNNI,
//!   Alder Lake and later, also on CPUs without AVX-512).
//! - `avx2-i16` / `portable-i16-pairs`: 6×16 tiles for AVX2-only CPUs (Zen 3 and older),
//!   u8 and s8 widened to i16 and multiplied in pairs by `vpmaddwd` (see `QKernel::Avx2I16`
//!   for why not `vpmaddubsw`).
//!
//! Layouts (`Layout`): W is packed in panels of NR columns × k rounded up (to KG = 4 for
//! the VNNI kernels, 2 for the i16 pairs, 64 for AMX); within a panel, the KG consecutive k
//! values of a column are adjacent and the NR columns of one k group follow each other,
//! which is what one `vpdpbusd` / `vpmaddwd` lane takes (and, 16 groups at a time, an AMX
//! B tile). A is packed per block of rows into the same groups, one u32 per row and group
//! (4 u8, or 2 u8 widened to u16): for the SIMD kernels the MR rows of a tile side by side,
//! so a kernel broadcasts one with one load; for AMX 32 rows of 64 bytes per k step (two A
//! tiles). Both are zero-padded past k, m and n: padding adds nothing to a sum, and no
//! kernel reads outside its packed buffers. A tile's sums land in a buffer; the epilogue
//! then writes the tile's valid part, with the same `dequant_one` / `requant_one` as the
//! portable kernel, so every kernel gives the same bits.
//!
//! Threads: products of at least 64³ multiply-adds are split over rayon's current pool
//! (hemi's thread setting) in rectangles of whole tiles, rows first (`split`); smaller ones
//! (batch-1 inference) stay on the calling thread.
//!
//! Integer sums are exact: `|a·w| ≤ 255 · 128`, so k up to 65 793 (2³¹ / 32 640) cannot
//! overflow; `PackedB::new` rejects larger k.
//!
//! Where the code is: this file has `qgemm`, the split among threads and the driver of the
//! packed kernels (`Micro`, `run_task_with`); `select` chooses the kernel, `pack` packs W
//! and A, `epilogue` turns the sums into outputs, `portable` and `x86` are the kernels.
//! `quant` has the rest of the INT8 arithmetic on host buffers: quantise, dequantise,
//! qparams, u8 im2col.

pub mod epilogue;
pub mod pack;
mod portable;
pub mod quant;
pub mod select;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::error::{Error, Result};
use std::cell::Cell;
use std::ops::Range;

use epilogue::{Epilogue, Sink};
use pack::{pack_a, AmxTiles, I16Pairs, Layout, PackedB, Vnni256, Vnni512};
use portable::{portable, Twin};
use select::QKernel;

/// The largest reduction length whose sums provably fit in i32: `k · 255 · 128 < 2³¹`.
pub const MAX_K: usize = (i32::MAX as usize) / (255 * 128);

/// Products with fewer multiply-adds than this stay on the calling thread.
const PAR_MIN_MACS: usize = 64 * 64 * 64;
/// The largest NR of any kernel.
const MAX_NR: usize = 32;
/// Products of at most this many rows on AMX-packed weights run `avx512-vnni` on the same
/// panels instead (`portable-vnni512` for `portable-amx-i8`): an AMX tile has 32 rows however
/// few are used, a `vpdpbusd` tile as many as there are.
const AMX_MIN_M: usize = 4;

/// `C = A · Wᵀ` through `epi`: `a` holds m rows of k u8 at stride `lda ≥ k`.
pub fn qgemm(a: &[u8], m: usize, lda: usize, b: &PackedB, epi: Epilogue<'_>) -> Result<()> {
    let (n, k) = (b.n, b.k);
    let need = m.checked_sub(1).map_or(Some(0), |r| {
        r.checked_mul(lda).and_then(|x| x.checked_add(k))
    });
    if lda < k || need.is_none_or(|need| a.len() < need) {
        return Err(Error::shape(
            "qgemm",
            format!("A of {} bytes for {m} rows of {k} at stride {lda}", a.len()),
        ));
    }
    if m.checked_mul(n).is_none() {
        return Err(Error::shape(
            "qgemm",
            format!("output [{m}, {n}] too large"),
        ));
    }
    epi.check(m, n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if b.kernel == QKernel::Portable {
        portable(a, m, lda, b, epi);
        return Ok(());
    }
    let kernel = b.kernel.for_rows(m);
    let shape = kernel.shape().expect("packed kernels have a layout");
    let job = Job {
        a,
        lda,
        m,
        b,
        sink: Sink::new(epi, &b.col_sums, n),
    };
    let threads = if m.saturating_mul(n).saturating_mul(k) >= PAR_MIN_MACS {
        rayon::current_num_threads()
    } else {
        1
    };
    let tasks = split(m, n, shape.mr, shape.nr, threads);
    if tasks.len() == 1 {
        run_task(kernel, &job, 0..m, 0..n);
    } else {
        crate::threads::nudge();
        crate::cpu::chunked::for_each_block(
            tasks.len(),
            1,
            || (),
            |_, t| {
                let (rows, cols) = tasks[t].clone();
                run_task(kernel, &job, rows, cols)
            },
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Packed kernels: tasks, blocks of A, tiles

/// Rectangles of the output (whole MR×NR tiles, but for the edges) for `threads` threads,
/// about four per thread, so that rayon evens out a busy, shared machine. Rows are split
/// first: each task packs its own rows of A, and a split of the columns would pack the same
/// rows again in every task (with AMX, packing 512 rows for each of 8 column tasks took
/// longer than their products); columns only where there are too few rows.
fn split(
    m: usize,
    n: usize,
    mr: usize,
    nr: usize,
    threads: usize,
) -> Vec<(Range<usize>, Range<usize>)> {
    if threads <= 1 {
        return vec![(0..m, 0..n)];
    }
    let want = 4 * threads;
    let (tiles_m, panels) = (m.div_ceil(mr), n.div_ceil(nr));
    let gm = tiles_m.min(want);
    let gn = panels.min(want.div_ceil(gm));
    let (tm, tn) = (tiles_m.div_ceil(gm) * mr, panels.div_ceil(gn) * nr);
    (0..m)
        .step_by(tm)
        .flat_map(|i| {
            (0..n)
                .step_by(tn)
                .map(move |j| (i..m.min(i + tm), j..n.min(j + tn)))
        })
        .collect()
}

/// One product, shared by the tasks that compute its rectangles.
struct Job<'a> {
    a: &'a [u8],
    lda: usize,
    m: usize,
    b: &'a PackedB,
    sink: Sink<'a>,
}

/// A microkernel on a packed layout: one tile of sums over all of k.
trait Micro {
    type L: Layout;

    /// For rows r < `rows` (≤ MR) and columns c < NR of the tile:
    /// `acc[r · NR + c] (+)= Σ_g Σ_q A(r, g)[q] · b[(g · NR + c) · KG + q]` over the groups g
    /// of packed A (`a[L::a_at(r, g, groups)]`, `a.len() = MR · groups`), added to what
    /// `acc` holds with `accumulate`; A(r, g)[q] is byte q of the u32 (KG = 4) or its 16-bit
    /// half q (KG = 2). Other entries of `acc` (MR · NR) may change.
    ///
    /// # Safety
    /// The CPU has the kernel's features; `b` holds at least as many groups as `a`.
    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool);
}

/// The kernel's tasks: a match to each microkernel's instance of `run_task_with`, inside a
/// function with its target features for the SIMD ones.
fn run_task(kernel: QKernel, job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    match kernel {
        QKernel::Portable => unreachable!("portable-i8 has no packed layout"),
        QKernel::PortableVnni512 => run_task_with::<Twin<Vnni512>>(job, rows, cols),
        QKernel::PortableVnni256 => run_task_with::<Twin<Vnni256>>(job, rows, cols),
        QKernel::PortableI16Pairs => run_task_with::<Twin<I16Pairs>>(job, rows, cols),
        QKernel::PortableAmx => run_task_with::<Twin<AmxTiles>>(job, rows, cols),
        // SAFETY: the weights were packed for this kernel, so `is_available` was true (and
        // `amx-i8` implies `avx512-vnni`).
        #[cfg(target_arch = "x86_64")]
        QKernel::Avx512Vnni => unsafe { x86::run_task_avx512_vnni(job, rows, cols) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        QKernel::AvxVnni => unsafe { x86::run_task_avx_vnni(job, rows, cols) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        QKernel::Avx2I16 => unsafe { x86::run_task_avx2_i16(job, rows, cols) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        QKernel::AmxInt8 => unsafe { x86::run_task_amx_int8(job, rows, cols) },
        #[cfg(not(target_arch = "x86_64"))]
        QKernel::Avx512Vnni | QKernel::AvxVnni | QKernel::Avx2I16 | QKernel::AmxInt8 => {
            unreachable!("x86 kernels are never available here")
        }
    }
}

/// A task's buffers: packed A of a block of rows, and the sums of its tiles.
#[derive(Default)]
struct Workspace {
    a: Vec<u32>,
    acc: Vec<i32>,
}

thread_local! {
    /// The buffers of the last task on this thread, kept between calls.
    static WORKSPACE: Cell<Workspace> = const {
        Cell::new(Workspace {
            a: Vec::new(),
            acc: Vec::new(),
        })
    };
}

/// Rows `rows` × columns `cols` of the output (`cols.start` a multiple of NR): per block of
/// rows, pack A once; then per B panel, per chunk of `L::KC` k values, run the block's tiles
/// down the panel, so that the panel's chunk is reused from L1 while the block's packed A
/// stays in L2 (the tiles' sums wait in `acc` between chunks); after the last chunk, the
/// epilogue writes the tiles.
#[inline(always)]
fn run_task_with<M: Micro>(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    let (mr, nr, kg) = (M::L::MR, M::L::NR, M::L::KG);
    // The buffers are taken, not borrowed, so that this stays inlined in the caller (and
    // compiled with its target features); a nested call finds them empty and allocates.
    let Workspace {
        a: mut buf,
        mut acc,
    } = WORKSPACE.take();
    let kp = job.b.kp;
    debug_assert!(kp.is_multiple_of(kg) && job.b.data.len() == job.b.n.div_ceil(nr) * nr * kp);
    debug_assert!(rows.end <= job.m && cols.start.is_multiple_of(nr));
    let groups = kp / kg;
    let mc = (M::L::A_BLOCK / (4 * groups).max(1)).clamp(mr, M::L::MAX_MC) / mr * mr;
    let chunk = M::L::KC / kg;
    for ic in rows.clone().step_by(mc) {
        let ih = mc.min(rows.end - ic);
        let tiles = ih.div_ceil(mr);
        buf.resize(tiles * mr * groups, 0);
        acc.resize(tiles * mr * nr, 0);
        pack_a::<M::L>(job, ic, ih, groups, &mut buf);
        for j0 in cols.clone().step_by(nr) {
            let w = nr.min(cols.end - j0);
            let panel = &job.b.data[(j0 / nr) * nr * kp..][..nr * kp];
            let mut g0 = 0;
            loop {
                let gs = chunk.min(groups - g0);
                let last = g0 + gs == groups;
                let b = &panel[g0 * nr * kg..][..gs * nr * kg];
                for t in 0..tiles {
                    let h = mr.min(ih - t * mr);
                    let a = &buf[(t * groups + g0) * mr..][..gs * mr];
                    let acc = &mut acc[t * mr * nr..][..mr * nr];
                    // SAFETY: `run_task` checked the CPU; `b` has `gs` groups, as `a`.
                    unsafe { M::tile(a, h, b, acc, g0 > 0) };
                    if last {
                        // SAFETY: this task owns rows `rows` × columns `cols` of the output.
                        unsafe { job.sink.write(ic + t * mr, j0, h, w, acc, nr) };
                    }
                }
                if last {
                    break;
                }
                g0 += gs;
            }
        }
    }
    WORKSPACE.set(Workspace { a: buf, acc });
}
