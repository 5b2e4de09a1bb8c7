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
//! - `avx512-vnni` / `portable-vnni512`: 8×32 tiles of `vpdpbusd` on zmm (16 accumulators;
//!   per step of 4 k: two B loads, eight A broadcasts, sixteen `vpdpbusd`).
//! - `avx-vnni` / `portable-vnni256`: 6×16 tiles of the VEX `vpdpbusd` on ymm (AVX-VNNI,
//!   Alder Lake and later, also on CPUs without AVX-512).
//! - `avx2-i16` / `portable-i16-pairs`: 6×16 tiles for AVX2-only CPUs (Zen 3 and older),
//!   u8 and s8 widened to i16 and multiplied in pairs by `vpmaddwd` (see `QKernel::Avx2I16`
//!   for why not `vpmaddubsw`).
//!
//! Layouts: W is packed in panels of NR columns × k rounded up to KG (4 for the VNNI
//! kernels, 2 for the i16 pairs); within a panel, the KG consecutive k values of a column
//! are adjacent and the NR columns of one k group follow each other, which is what one
//! `vpdpbusd` / `vpmaddwd` lane takes. A is packed per block of rows into the same groups,
//! one u32 per row and group (4 u8, or 2 u8 widened to u16), MR rows of a tile side by side,
//! so a kernel broadcasts it with one load. Both are zero-padded past k, m and n: padding
//! adds nothing to a sum, and no kernel reads outside its packed buffers. A tile's sums land
//! in a stack buffer; the epilogue then writes the tile's valid part, with the same
//! `dequant_one` / `requant_one` as the portable kernel, so every kernel gives the same bits.
//!
//! Threads: products of at least 64³ multiply-adds are split over rayon's current pool
//! (hemi's thread setting) in rectangles of whole tiles; smaller ones (batch-1 inference)
//! stay on the calling thread.
//!
//! Integer sums are exact: `|a·w| ≤ 255 · 128`, so k up to 65 793 (2³¹ / 32 640) cannot
//! overflow; `PackedB::new` rejects larger k.

use crate::error::{Error, Result};
use rayon::prelude::*;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Range;

/// The largest reduction length whose sums provably fit in i32: `k · 255 · 128 < 2³¹`.
pub const MAX_K: usize = (i32::MAX as usize) / (255 * 128);

/// Products with fewer multiply-adds than this stay on the calling thread.
const PAR_MIN_MACS: usize = 64 * 64 * 64;
/// Bytes of packed A per block of rows (the block is reused for every column panel of a
/// task, so it should stay in L2 beside one B panel).
const A_BLOCK_BYTES: usize = 256 * 1024;
/// At most this many rows per block of packed A.
const MAX_MC: usize = 256;
/// The largest MR·NR of any kernel (stack buffer of one tile's sums).
const MAX_TILE: usize = 8 * 32;

/// Tile and packing of the `avx512-vnni` layout: MR rows × NR columns, KG k values a lane.
const VNNI512: (usize, usize, usize) = (8, 32, 4);
/// Tile and packing of the `avx-vnni` layout.
const VNNI256: (usize, usize, usize) = (6, 16, 4);
/// Tile and packing of the `avx2-i16` layout.
const I16_PAIRS: (usize, usize, usize) = (6, 16, 2);

/// An INT8 microkernel with its packed weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKernel {
    /// Plain Rust over the unpacked rows: any CPU.
    Portable,
    /// Plain Rust on the `avx512-vnni` layout (8×32 tiles, groups of 4 k), summing as
    /// `vpdpbusd` does: any CPU. Slow; it exists so that layout is tested everywhere.
    PortableVnni512,
    /// Plain Rust on the `avx-vnni` layout (6×16 tiles, groups of 4 k): any CPU.
    PortableVnni256,
    /// Plain Rust on the `avx2-i16` layout (6×16 tiles, pairs of k), summing as `vpmaddwd`
    /// does: any CPU.
    PortableI16Pairs,
    /// AVX2 for CPUs without VNNI: u8 activations widened to u16 pairs when A is packed, s8
    /// weights to i16 by `vpmovsxbw` as they are loaded, then `vpmaddwd` (two i16 × i16
    /// products summed into an i32, exact here) and `vpaddd`. Not `vpmaddubsw`: it sums two u8 × s8 products into
    /// a *saturating* i16, and 255·127·2 = 64 770 (or 255·(-128)·2) does not fit, so
    /// activations near 255 with weights of one sign would silently clip.
    Avx2I16,
    /// AVX-VNNI: the VEX-encoded 256-bit `vpdpbusd` (`_mm256_dpbusd_avx_epi32`, no AVX-512
    /// needed), 12 ymm accumulators.
    AvxVnni,
    /// AVX-512 VNNI: `vpdpbusd` on zmm (`_mm512_dpbusd_epi32`), 16 zmm accumulators.
    Avx512Vnni,
}

impl QKernel {
    /// Every kernel, portable first, then the portable twins, then the SIMD kernels.
    pub const ALL: [QKernel; 7] = [
        QKernel::Portable,
        QKernel::PortableVnni512,
        QKernel::PortableVnni256,
        QKernel::PortableI16Pairs,
        QKernel::Avx2I16,
        QKernel::AvxVnni,
        QKernel::Avx512Vnni,
    ];

    /// The kernel's name as `hemi bench matmul` prints it.
    pub fn name(self) -> &'static str {
        match self {
            QKernel::Portable => "portable-i8",
            QKernel::PortableVnni512 => "portable-vnni512",
            QKernel::PortableVnni256 => "portable-vnni256",
            QKernel::PortableI16Pairs => "portable-i16-pairs",
            QKernel::Avx2I16 => "avx2-i16",
            QKernel::AvxVnni => "avx-vnni",
            QKernel::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            QKernel::Portable
            | QKernel::PortableVnni512
            | QKernel::PortableVnni256
            | QKernel::PortableI16Pairs => true,
            #[cfg(target_arch = "x86_64")]
            QKernel::Avx2I16 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            QKernel::AvxVnni => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni")
            }
            #[cfg(target_arch = "x86_64")]
            QKernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            QKernel::Avx2I16 | QKernel::AvxVnni | QKernel::Avx512Vnni => false,
        }
    }

    /// Plain Rust (the reference or a twin of a SIMD kernel's layout): runs anywhere, slowly.
    pub fn is_portable(self) -> bool {
        matches!(
            self,
            QKernel::Portable
                | QKernel::PortableVnni512
                | QKernel::PortableVnni256
                | QKernel::PortableI16Pairs
        )
    }

    /// The fastest kernel this CPU runs: `avx512-vnni`, else `avx-vnni`, else `avx2-i16`,
    /// else `portable-i8`.
    pub fn best() -> QKernel {
        [QKernel::Avx512Vnni, QKernel::AvxVnni, QKernel::Avx2I16]
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(QKernel::Portable)
    }

    /// (MR, NR, KG) of the packed layout: tile rows, tile columns (= columns of a B panel)
    /// and k values per group. None for `portable-i8`, which reads W unpacked.
    fn layout(self) -> Option<(usize, usize, usize)> {
        match self {
            QKernel::Portable => None,
            QKernel::PortableVnni512 | QKernel::Avx512Vnni => Some(VNNI512),
            QKernel::PortableVnni256 | QKernel::AvxVnni => Some(VNNI256),
            QKernel::PortableI16Pairs | QKernel::Avx2I16 => Some(I16_PAIRS),
        }
    }
}

/// Weights `[n, k]` (s8) packed for one kernel, with their row sums `Σ_k W[j, k]`.
#[derive(Clone, Debug)]
pub struct PackedB {
    n: usize,
    k: usize,
    kernel: QKernel,
    data: Vec<i8>,
    col_sums: Vec<i32>,
}

impl PackedB {
    /// Packs row-major `w` (`[n, k]`) for the fastest kernel of this CPU.
    pub fn new(w: &[i8], n: usize, k: usize) -> Result<PackedB> {
        PackedB::with_kernel(w, n, k, QKernel::best())
    }

    /// Packs `w` for `kernel` (which this CPU must be able to run).
    pub fn with_kernel(w: &[i8], n: usize, k: usize, kernel: QKernel) -> Result<PackedB> {
        if n.checked_mul(k) != Some(w.len()) {
            return Err(Error::shape(
                "qgemm pack",
                format!("{} weights for [{n}, {k}]", w.len()),
            ));
        }
        if k > MAX_K {
            return Err(Error::shape(
                "qgemm pack",
                format!("k = {k} exceeds {MAX_K}, where i32 sums could overflow"),
            ));
        }
        if !kernel.is_available() {
            return Err(Error::Msg(format!(
                "qgemm: this CPU cannot run {}",
                kernel.name()
            )));
        }
        let col_sums = w
            .chunks_exact(k.max(1))
            .take(n)
            .map(|r| r.iter().map(|&v| v as i32).sum())
            .collect::<Vec<i32>>();
        let col_sums = if k == 0 { vec![0; n] } else { col_sums };
        let data = match kernel.layout() {
            None => w.to_vec(),
            Some((_, nr, kg)) => pack_panels(w, n, k, nr, kg),
        };
        Ok(PackedB {
            n,
            k,
            kernel,
            data,
            col_sums,
        })
    }

    /// Output columns (the weights' rows).
    pub fn n(&self) -> usize {
        self.n
    }
    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// The kernel the weights are packed for.
    pub fn kernel(&self) -> QKernel {
        self.kernel
    }
    /// `Σ_k W[j, k]` per output column j.
    pub fn col_sums(&self) -> &[i32] {
        &self.col_sums
    }
    /// Bytes held by the packed weights and their sums.
    pub fn nbytes(&self) -> usize {
        self.data.len() + 4 * self.col_sums.len()
    }
}

/// `w` (`[n, k]`) as panels of `nr` columns × `kp = k` rounded up to `kg`: element
/// `(j, x)` at `panel · nr·kp + (x / kg) · nr·kg + (j % nr) · kg + x % kg`, zeros elsewhere.
fn pack_panels(w: &[i8], n: usize, k: usize, nr: usize, kg: usize) -> Vec<i8> {
    let kp = k.next_multiple_of(kg);
    let mut out = vec![0i8; n.div_ceil(nr) * nr * kp];
    if k == 0 {
        return out;
    }
    for (j, row) in w.chunks_exact(k).enumerate() {
        let panel = &mut out[(j / nr) * nr * kp..][..nr * kp];
        let col = (j % nr) * kg;
        for (g, vals) in row.chunks(kg).enumerate() {
            panel[g * nr * kg + col..][..vals.len()].copy_from_slice(vals);
        }
    }
    out
}

/// What happens to the exact integer sums `acc[i, j] = Σ_k A[i, k] · W[j, k]`.
///
/// With `c = acc[i, j] - a_zero[i] · colsum[j]` (i32, exact), every kernel computes, in this
/// order and without fused multiply-adds (so all kernels give the same bits):
/// `y = (c as f32) * (a_scale[i] * w_scale[j])`, then `y = y + bias[j]`, then
/// `y = max(y, 0)` with `relu`.
pub enum Epilogue<'a> {
    /// The raw sums, row-major `[m, n]`, no zero-point correction.
    I32 {
        /// `m · n` outputs.
        out: &'a mut [i32],
    },
    /// Dequantised F32 outputs, row-major `[m, n]`.
    F32 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// Apply ReLU.
        relu: bool,
        /// `m · n` outputs.
        out: &'a mut [f32],
    },
    /// Requantised u8 outputs, row-major `[m, n]`: `y` as for `F32`, then
    /// `q = clamp(round_ties_even(y * (1 / out_scale)) + out_zero, 0, 255)` (with `relu`,
    /// `y` was clamped at 0 first, so `q ≥ out_zero`).
    U8 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// Apply ReLU.
        relu: bool,
        /// Scale of the output.
        out_scale: f32,
        /// Zero point of the output, in 0..=255.
        out_zero: i32,
        /// `m · n` outputs.
        out: &'a mut [u8],
    },
}

impl Epilogue<'_> {
    fn check(&self, m: usize, n: usize) -> Result<()> {
        let bad = |what: &str| Err(Error::shape("qgemm epilogue", what.to_string()));
        match self {
            Epilogue::I32 { out } => {
                if out.len() != m * n {
                    return bad("out length != m·n");
                }
            }
            Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("F32 epilogue lengths");
                }
            }
            Epilogue::U8 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("U8 epilogue lengths");
                }
            }
        }
        Ok(())
    }
}

/// The F32 value of the epilogue for one element (the definition every kernel follows).
#[inline(always)]
pub fn dequant_one(
    acc: i32,
    a_zero: i32,
    col_sum: i32,
    a_scale: f32,
    w_scale: f32,
    bias: f32,
    relu: bool,
) -> f32 {
    let c = acc.wrapping_sub(a_zero.wrapping_mul(col_sum));
    let y = (c as f32) * (a_scale * w_scale) + bias;
    if relu {
        y.max(0.0)
    } else {
        y
    }
}

/// The u8 value of the requantising epilogue for one F32 value `y`.
#[inline(always)]
pub fn requant_one(y: f32, inv_out_scale: f32, out_zero: i32) -> u8 {
    let q = (y * inv_out_scale).round_ties_even() + out_zero as f32;
    q.clamp(0.0, 255.0) as u8
}

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
    let (mr, nr, _) = b.kernel.layout().expect("packed kernels have a layout");
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
    let tasks = split(m, n, mr, nr, threads);
    if tasks.len() == 1 {
        run_task(b.kernel, &job, 0..m, 0..n);
    } else {
        tasks
            .into_par_iter()
            .for_each(|(rows, cols)| run_task(b.kernel, &job, rows, cols));
    }
    Ok(())
}

fn portable(a: &[u8], m: usize, lda: usize, b: &PackedB, mut epi: Epilogue<'_>) {
    let (n, k) = (b.n, b.k);
    for i in 0..m {
        let row = &a[i * lda..i * lda + k];
        for j in 0..n {
            let w = &b.data[j * k..(j + 1) * k];
            let acc: i32 = row.iter().zip(w).map(|(&x, &y)| x as i32 * y as i32).sum();
            store(&mut epi, i, j, n, acc, b.col_sums[j]);
        }
    }
}

#[inline(always)]
fn store(epi: &mut Epilogue<'_>, i: usize, j: usize, n: usize, acc: i32, col_sum: i32) {
    match epi {
        Epilogue::I32 { out } => out[i * n + j] = acc,
        Epilogue::F32 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            relu,
            out,
        } => {
            out[i * n + j] = dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *relu,
            )
        }
        Epilogue::U8 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            relu,
            out_scale,
            out_zero,
            out,
        } => {
            let y = dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *relu,
            );
            out[i * n + j] = requant_one(y, 1.0 / *out_scale, *out_zero);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed kernels: tasks, blocks of A, tiles, and the epilogue of a tile

/// Rectangles of the output (whole MR×NR tiles, but for the edges) for `threads` threads.
/// Columns are split first: a task packs its rows of A once and streams only its own B
/// panels. About four tasks per thread, so that rayon evens out a busy, shared machine.
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
    let gn = panels.min(want);
    let gm = tiles_m.min(want.div_ceil(gn));
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

/// The epilogue with its output as a raw pointer, so that tasks on several threads can write
/// their own tiles of it.
struct Sink<'a> {
    out: Out,
    n: usize,
    col_sums: &'a [i32],
    a_scale: &'a [f32],
    a_zero: &'a [i32],
    w_scale: &'a [f32],
    bias: Option<&'a [f32]>,
    relu: bool,
    inv_out_scale: f32,
    out_zero: i32,
    _out: PhantomData<&'a mut [u8]>,
}

#[derive(Clone, Copy)]
enum Out {
    I32(*mut i32),
    F32(*mut f32),
    U8(*mut u8),
}

// SAFETY: `qgemm` holds the epilogue's `&mut` output for the whole product, and its tasks
// write disjoint rectangles of it (`split`), each from one thread only.
unsafe impl Send for Sink<'_> {}
// SAFETY: as above.
unsafe impl Sync for Sink<'_> {}

impl<'a> Sink<'a> {
    /// `epi` after `Epilogue::check(m, n)` passed.
    fn new(epi: Epilogue<'a>, col_sums: &'a [i32], n: usize) -> Sink<'a> {
        let mut sink = Sink {
            out: Out::I32(std::ptr::null_mut()),
            n,
            col_sums,
            a_scale: &[],
            a_zero: &[],
            w_scale: &[],
            bias: None,
            relu: false,
            inv_out_scale: 1.0,
            out_zero: 0,
            _out: PhantomData,
        };
        match epi {
            Epilogue::I32 { out } => sink.out = Out::I32(out.as_mut_ptr()),
            Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                relu,
                out,
            } => {
                sink = Sink {
                    out: Out::F32(out.as_mut_ptr()),
                    a_scale,
                    a_zero,
                    w_scale,
                    bias,
                    relu,
                    ..sink
                }
            }
            Epilogue::U8 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                relu,
                out_scale,
                out_zero,
                out,
            } => {
                sink = Sink {
                    out: Out::U8(out.as_mut_ptr()),
                    a_scale,
                    a_zero,
                    w_scale,
                    bias,
                    relu,
                    inv_out_scale: 1.0 / out_scale,
                    out_zero,
                    ..sink
                }
            }
        }
        sink
    }

    /// Writes rows `i0..i0 + h`, columns `j0..j0 + w` of the output from a tile's sums
    /// (row r at `acc[r · ld..]`), through `dequant_one` / `requant_one` element by element
    /// exactly as `store` does (inlined into each kernel, so it vectorises with its features).
    ///
    /// # Safety
    /// No other thread writes this rectangle, which lies inside the `[m, n]` output.
    #[inline(always)]
    unsafe fn write(&self, i0: usize, j0: usize, h: usize, w: usize, acc: &[i32], ld: usize) {
        let cols = j0..j0 + w;
        let cs = &self.col_sums[cols.clone()];
        let mut row_f32 = [0f32; MAX_TILE];
        for r in 0..h {
            let i = i0 + r;
            let acc = &acc[r * ld..][..w];
            let at = i * self.n + j0;
            // SAFETY: the caller's rectangle; `Epilogue::check` saw m·n outputs.
            let out_f32 = match self.out {
                Out::I32(p) => {
                    unsafe { std::slice::from_raw_parts_mut(p.add(at), w) }.copy_from_slice(acc);
                    continue;
                }
                // SAFETY: as above.
                Out::F32(p) => unsafe { std::slice::from_raw_parts_mut(p.add(at), w) },
                Out::U8(_) => &mut row_f32[..w],
            };
            let (az, sc) = (self.a_zero[i], self.a_scale[i]);
            let ws = &self.w_scale[cols.clone()];
            let bias = self.bias.map(|b| &b[cols.clone()]);
            if self.relu {
                dequant_row::<true>(acc, cs, az, sc, ws, bias, out_f32);
            } else {
                dequant_row::<false>(acc, cs, az, sc, ws, bias, out_f32);
            }
            if let Out::U8(p) = self.out {
                // SAFETY: as above.
                let out = unsafe { std::slice::from_raw_parts_mut(p.add(at), w) };
                for (q, &y) in out.iter_mut().zip(&row_f32[..w]) {
                    *q = requant_one(y, self.inv_out_scale, self.out_zero);
                }
            }
        }
    }
}

/// `dequant_one` over one row of a tile.
#[inline(always)]
fn dequant_row<const RELU: bool>(
    acc: &[i32],
    col_sums: &[i32],
    a_zero: i32,
    a_scale: f32,
    w_scale: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let it = out.iter_mut().zip(acc).zip(col_sums).zip(w_scale);
    match bias {
        Some(bias) => {
            for ((((y, &x), &cs), &ws), &b) in it.zip(bias) {
                *y = dequant_one(x, a_zero, cs, a_scale, ws, b, RELU);
            }
        }
        None => {
            for (((y, &x), &cs), &ws) in it {
                *y = dequant_one(x, a_zero, cs, a_scale, ws, 0.0, RELU);
            }
        }
    }
}

/// A microkernel on a packed layout: one MR×NR tile of sums over all of k.
trait Micro {
    const MR: usize;
    const NR: usize;
    const KG: usize;

    /// `acc[r · NR + c] = Σ_g Σ_q A(g, r)[q] · b[(g · NR + c) · KG + q]` for every row r < MR
    /// and column c < NR, over the `a.len() / MR` groups g of packed A (`a[g · MR + r]`).
    ///
    /// # Safety
    /// The CPU has the kernel's features; `b` holds at least as many groups as `a`.
    unsafe fn tile(a: &[u32], b: &[i8], acc: &mut [i32; MAX_TILE]);
}

/// The kernel's tasks: a match to each microkernel's instance of `run_task_with`, inside a
/// function with its target features for the SIMD ones.
fn run_task(kernel: QKernel, job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    type Vnni512 = PortableTile<{ VNNI512.0 }, { VNNI512.1 }, { VNNI512.2 }>;
    type Vnni256 = PortableTile<{ VNNI256.0 }, { VNNI256.1 }, { VNNI256.2 }>;
    type I16Pairs = PortableTile<{ I16_PAIRS.0 }, { I16_PAIRS.1 }, { I16_PAIRS.2 }>;
    match kernel {
        QKernel::Portable => unreachable!("portable-i8 has no packed layout"),
        QKernel::PortableVnni512 => run_task_with::<Vnni512>(job, rows, cols),
        QKernel::PortableVnni256 => run_task_with::<Vnni256>(job, rows, cols),
        QKernel::PortableI16Pairs => run_task_with::<I16Pairs>(job, rows, cols),
        // SAFETY: the weights were packed for this kernel, so `is_available` was true.
        #[cfg(target_arch = "x86_64")]
        QKernel::Avx512Vnni => unsafe { x86::run_task_avx512_vnni(job, rows, cols) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        QKernel::AvxVnni => unsafe { x86::run_task_avx_vnni(job, rows, cols) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        QKernel::Avx2I16 => unsafe { x86::run_task_avx2_i16(job, rows, cols) },
        #[cfg(not(target_arch = "x86_64"))]
        QKernel::Avx512Vnni | QKernel::AvxVnni | QKernel::Avx2I16 => {
            unreachable!("x86 kernels are never available here")
        }
    }
}

thread_local! {
    /// Packed A of the block of rows this thread works on, kept between calls.
    static A_PACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Rows `rows` × columns `cols` of the output (`cols.start` a multiple of NR): per block of
/// rows, pack A once, then for each B panel run the block's tiles down it, so that the panel
/// is reused from cache while the block's packed A stays in L2.
#[inline(always)]
fn run_task_with<M: Micro>(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>) {
    A_PACK.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => blocks::<M>(job, rows, cols, &mut buf),
        Err(_) => blocks::<M>(job, rows, cols, &mut Vec::new()),
    })
}

#[inline(always)]
fn blocks<M: Micro>(job: &Job<'_>, rows: Range<usize>, cols: Range<usize>, buf: &mut Vec<u32>) {
    let k = job.b.k;
    let kp = k.next_multiple_of(M::KG);
    let groups = kp / M::KG;
    let mc = (A_BLOCK_BYTES / (4 * groups).max(1)).clamp(M::MR, MAX_MC) / M::MR * M::MR;
    debug_assert!(rows.end <= job.m && cols.start.is_multiple_of(M::NR));
    for ic in rows.clone().step_by(mc) {
        let ih = mc.min(rows.end - ic);
        let tiles = ih.div_ceil(M::MR);
        buf.resize(tiles * M::MR * groups, 0);
        pack_a::<M>(job, ic, ih, groups, buf);
        for j0 in cols.clone().step_by(M::NR) {
            let w = M::NR.min(cols.end - j0);
            let panel = &job.b.data[(j0 / M::NR) * M::NR * kp..][..M::NR * kp];
            for t in 0..tiles {
                let h = M::MR.min(ih - t * M::MR);
                let mut acc = [0i32; MAX_TILE];
                let a = &buf[t * M::MR * groups..][..M::MR * groups];
                // SAFETY: `run_task` checked the CPU; the panel has `groups` groups, as `a`.
                unsafe { M::tile(a, panel, &mut acc) };
                // SAFETY: this task owns rows `rows` × columns `cols` of the output.
                unsafe { job.sink.write(ic + t * M::MR, j0, h, w, &acc, M::NR) };
            }
        }
    }
}

/// Rows `i0..i0 + h` of A into `buf`, tile after tile: `buf[(t · groups + g) · MR + r]`
/// holds group g of row `t · MR + r` (KG = 4: four u8, the first in the low byte; KG = 2:
/// two u8 zero-extended to u16). Rows past `h` and k values past k are zeros.
#[inline(always)]
fn pack_a<M: Micro>(job: &Job<'_>, i0: usize, h: usize, groups: usize, buf: &mut [u32]) {
    let k = job.b.k;
    let encode = |v: &[u8]| -> u32 {
        let mut x = [0u8; 4];
        x[..v.len()].copy_from_slice(v);
        if M::KG == 4 {
            u32::from_le_bytes(x)
        } else {
            x[0] as u32 | (x[1] as u32) << 16
        }
    };
    if groups == 0 {
        return;
    }
    for (t, tile) in buf.chunks_exact_mut(M::MR * groups).enumerate() {
        for r in 0..M::MR {
            let i = t * M::MR + r;
            if i >= h {
                for g in 0..groups {
                    tile[g * M::MR + r] = 0;
                }
                continue;
            }
            let row = &job.a[(i0 + i) * job.lda..][..k];
            for (g, v) in row.chunks(M::KG).enumerate() {
                tile[g * M::MR + r] = encode(v);
            }
        }
    }
}

/// Plain Rust on a packed layout: each lane sums its KG products in an i32 and adds them to
/// the accumulator (wrapping, as `vpdpbusd` and `vpaddd` do; the sums are exact anyway).
struct PortableTile<const MR: usize, const NR: usize, const KG: usize>;

impl<const MR: usize, const NR: usize, const KG: usize> Micro for PortableTile<MR, NR, KG> {
    const MR: usize = MR;
    const NR: usize = NR;
    const KG: usize = KG;

    unsafe fn tile(a: &[u32], b: &[i8], acc: &mut [i32; MAX_TILE]) {
        let (acc, bits) = (&mut acc[..MR * NR], 32 / KG);
        for (ag, bg) in a.chunks_exact(MR).zip(b.chunks_exact(NR * KG)) {
            for (&x, acc) in ag.iter().zip(acc.chunks_exact_mut(NR)) {
                let x: [i32; KG] =
                    std::array::from_fn(|q| ((x >> (bits * q)) & ((1 << bits) - 1)) as i32);
                for (s, w) in acc.iter_mut().zip(bg.chunks_exact(KG)) {
                    let lane = x.iter().zip(w).map(|(&x, &w)| x * w as i32).sum::<i32>();
                    *s = s.wrapping_add(lane);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{run_task_with, Job, Micro, I16_PAIRS, MAX_TILE, VNNI256, VNNI512};
    use std::arch::x86_64::*;
    use std::ops::Range;

    struct Avx512Vnni;
    struct AvxVnni;
    struct Avx2I16;

    /// `run_task_with` for `avx512-vnni`, compiled with its features (the epilogue too).
    ///
    /// # Safety
    /// `QKernel::Avx512Vnni.is_available()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn run_task_avx512_vnni(
        job: &Job<'_>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) {
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

    impl Micro for Avx512Vnni {
        const MR: usize = VNNI512.0;
        const NR: usize = VNNI512.1;
        const KG: usize = VNNI512.2;

        #[inline(always)]
        unsafe fn tile(a: &[u32], b: &[i8], acc: &mut [i32; MAX_TILE]) {
            // SAFETY: forwarded from the caller.
            unsafe { tile_zmm::<{ VNNI512.0 }, { VNNI512.1 / 16 }>(a, b, acc) }
        }
    }

    impl Micro for AvxVnni {
        const MR: usize = VNNI256.0;
        const NR: usize = VNNI256.1;
        const KG: usize = VNNI256.2;

        #[inline(always)]
        unsafe fn tile(a: &[u32], b: &[i8], acc: &mut [i32; MAX_TILE]) {
            // SAFETY: forwarded from the caller.
            unsafe { tile_ymm_vnni::<{ VNNI256.0 }, { VNNI256.1 / 8 }>(a, b, acc) }
        }
    }

    impl Micro for Avx2I16 {
        const MR: usize = I16_PAIRS.0;
        const NR: usize = I16_PAIRS.1;
        const KG: usize = I16_PAIRS.2;

        #[inline(always)]
        unsafe fn tile(a: &[u32], b: &[i8], acc: &mut [i32; MAX_TILE]) {
            // SAFETY: forwarded from the caller.
            unsafe { tile_ymm_i16::<{ I16_PAIRS.0 }, { I16_PAIRS.1 / 8 }>(a, b, acc) }
        }
    }

    /// MR×(16·NV) tile: per group of 4 k, NV B loads (16 columns × 4 s8 each), MR broadcasts
    /// of a row's 4 u8, MR·NV `vpdpbusd` into MR·NV zmm accumulators.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn tile_zmm<const MR: usize, const NV: usize>(
        a: &[u32],
        b: &[i8],
        acc: &mut [i32; MAX_TILE],
    ) {
        let groups = a.len() / MR;
        assert!(b.len() >= groups * 64 * NV && MR * 16 * NV <= MAX_TILE);
        let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
        let mut c = [[_mm512_setzero_si512(); NV]; MR];
        for _ in 0..groups {
            // SAFETY: `groups` groups of MR u32 (a) and 64·NV bytes (b), asserted above.
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
                pa = pa.add(MR);
                pb = pb.add(64 * NV);
            }
        }
        for (r, row) in c.iter().enumerate() {
            for (v, &s) in row.iter().enumerate() {
                // SAFETY: MR·16·NV ≤ MAX_TILE, asserted above.
                unsafe { _mm512_storeu_si512(acc.as_mut_ptr().add(16 * (r * NV + v)).cast(), s) };
            }
        }
    }

    /// MR×(8·NV) tile of the VEX `vpdpbusd` (AVX-VNNI) on ymm, as `tile_zmm`.
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn tile_ymm_vnni<const MR: usize, const NV: usize>(
        a: &[u32],
        b: &[i8],
        acc: &mut [i32; MAX_TILE],
    ) {
        let groups = a.len() / MR;
        assert!(b.len() >= groups * 32 * NV && MR * 8 * NV <= MAX_TILE);
        let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
        let mut c = [[_mm256_setzero_si256(); NV]; MR];
        for _ in 0..groups {
            // SAFETY: `groups` groups of MR u32 (a) and 32·NV bytes (b), asserted above.
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
                pa = pa.add(MR);
                pb = pb.add(32 * NV);
            }
        }
        for (r, row) in c.iter().enumerate() {
            for (v, &s) in row.iter().enumerate() {
                // SAFETY: MR·8·NV ≤ MAX_TILE, asserted above.
                unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(8 * (r * NV + v)).cast(), s) };
            }
        }
    }

    /// MR×(8·NV) tile on pairs of k: per pair, NV loads of 8 columns × 2 s8 sign-extended to
    /// i16 (`vpmovsxbw`), MR broadcasts of a row's two u8 as u16, and per accumulator a
    /// `vpmaddwd` (both i16 products summed into an i32, exact) and a `vpaddd`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn tile_ymm_i16<const MR: usize, const NV: usize>(
        a: &[u32],
        b: &[i8],
        acc: &mut [i32; MAX_TILE],
    ) {
        let groups = a.len() / MR;
        assert!(b.len() >= groups * 16 * NV && MR * 8 * NV <= MAX_TILE);
        let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
        let mut c = [[_mm256_setzero_si256(); NV]; MR];
        for _ in 0..groups {
            // SAFETY: `groups` groups of MR u32 (a) and 16·NV bytes (b), asserted above.
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
                pa = pa.add(MR);
                pb = pb.add(16 * NV);
            }
        }
        for (r, row) in c.iter().enumerate() {
            for (v, &s) in row.iter().enumerate() {
                // SAFETY: MR·8·NV ≤ MAX_TILE, asserted above.
                unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(8 * (r * NV + v)).cast(), s) };
            }
        }
    }
}
