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

pub mod quant;

use crate::backend::map::UnaryOp;
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::Range;

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
    /// Plain Rust on the `amx-i8` layout (32×32 tiles, k padded to 64): any CPU.
    PortableAmx,
    /// AVX2 for CPUs without VNNI: u8 activations widened to u16 pairs when A is packed, s8
    /// weights to i16 by `vpmovsxbw` as they are loaded, then `vpmaddwd` (two i16 × i16
    /// products summed into an i32, exact here) and `vpaddd`. Not `vpmaddubsw`: it sums two
    /// u8 × s8 products into a *saturating* i16, and 255·127·2 = 64 770 (or 255·(-128)·2)
    /// does not fit, so activations near 255 with weights of one sign would silently clip.
    Avx2I16,
    /// AVX-VNNI: the VEX-encoded 256-bit `vpdpbusd` (`_mm256_dpbusd_avx_epi32`, no AVX-512
    /// needed), 12 ymm accumulators.
    AvxVnni,
    /// AVX-512 VNNI: `vpdpbusd` on zmm (`_mm512_dpbusd_epi32`), 16 zmm accumulators.
    Avx512Vnni,
    /// Intel AMX-INT8 (`tdpbusd`, Sapphire Rapids and later): 32×32 tiles as 2×2 AMX
    /// accumulator tiles, k in steps of 64. Needs AVX-512 VNNI too (products of at most
    /// `AMX_MIN_M` rows run on it) and Linux's permission for the tile data (`amx_usable`).
    AmxInt8,
}

impl QKernel {
    /// Every kernel, portable first, then the portable twins, then the SIMD kernels.
    pub const ALL: [QKernel; 9] = [
        QKernel::Portable,
        QKernel::PortableVnni512,
        QKernel::PortableVnni256,
        QKernel::PortableI16Pairs,
        QKernel::PortableAmx,
        QKernel::Avx2I16,
        QKernel::AvxVnni,
        QKernel::Avx512Vnni,
        QKernel::AmxInt8,
    ];

    /// The kernel's name as `hemi bench matmul` prints it.
    pub fn name(self) -> &'static str {
        match self {
            QKernel::Portable => "portable-i8",
            QKernel::PortableVnni512 => "portable-vnni512",
            QKernel::PortableVnni256 => "portable-vnni256",
            QKernel::PortableI16Pairs => "portable-i16-pairs",
            QKernel::PortableAmx => "portable-amx-i8",
            QKernel::Avx2I16 => "avx2-i16",
            QKernel::AvxVnni => "avx-vnni",
            QKernel::Avx512Vnni => "avx512-vnni",
            QKernel::AmxInt8 => "amx-i8",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            QKernel::Portable
            | QKernel::PortableVnni512
            | QKernel::PortableVnni256
            | QKernel::PortableI16Pairs
            | QKernel::PortableAmx => true,
            #[cfg(target_arch = "x86_64")]
            QKernel::Avx2I16 => cpu_has!(Avx2),
            #[cfg(target_arch = "x86_64")]
            QKernel::AvxVnni => cpu_has!(Avx2) && cpu_has!(AvxVnni),
            #[cfg(target_arch = "x86_64")]
            QKernel::Avx512Vnni => cpu_has!(Avx512f) && cpu_has!(Avx512bw) && cpu_has!(Avx512vnni),
            #[cfg(target_arch = "x86_64")]
            QKernel::AmxInt8 => QKernel::Avx512Vnni.is_available() && x86::amx_usable(),
            #[cfg(not(target_arch = "x86_64"))]
            QKernel::Avx2I16 | QKernel::AvxVnni | QKernel::Avx512Vnni | QKernel::AmxInt8 => false,
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
                | QKernel::PortableAmx
        )
    }

    /// The fastest kernel this CPU runs: `amx-i8`, else `avx512-vnni`, else `avx-vnni`, else
    /// `avx2-i16`, else `portable-i8`.
    pub fn best() -> QKernel {
        [
            QKernel::AmxInt8,
            QKernel::Avx512Vnni,
            QKernel::AvxVnni,
            QKernel::Avx2I16,
        ]
        .into_iter()
        .find(|k| k.is_available())
        .unwrap_or(QKernel::Portable)
    }

    /// The packed layout as `Shape`; None for `portable-i8`, which reads W unpacked.
    fn shape(self) -> Option<Shape> {
        match self {
            QKernel::Portable => None,
            QKernel::PortableVnni512 | QKernel::Avx512Vnni => Some(Shape::of::<Vnni512>()),
            QKernel::PortableVnni256 | QKernel::AvxVnni => Some(Shape::of::<Vnni256>()),
            QKernel::PortableI16Pairs | QKernel::Avx2I16 => Some(Shape::of::<I16Pairs>()),
            QKernel::PortableAmx | QKernel::AmxInt8 => Some(Shape::of::<AmxTiles>()),
        }
    }

    /// The kernel that runs an m-row product on weights packed for `self`.
    fn for_rows(self, m: usize) -> QKernel {
        match self {
            QKernel::AmxInt8 if m <= AMX_MIN_M => QKernel::Avx512Vnni,
            QKernel::PortableAmx if m <= AMX_MIN_M => QKernel::PortableVnni512,
            k => k,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed layouts

/// A packed layout, shared by a SIMD kernel and its portable twin.
trait Layout {
    /// Rows of a tile.
    const MR: usize;
    /// Columns of a tile and of a B panel.
    const NR: usize;
    /// k values one lane of the dot-product instruction sums (one u32 of packed A).
    const KG: usize;
    /// The packed k is rounded up to this multiple of KG.
    const KALIGN: usize;
    /// k values per chunk of the reduction (a multiple of KALIGN), after which the tiles'
    /// sums go to memory while the next chunk of B is brought to L1.
    const KC: usize = 8192;
    /// Bytes of packed A per block of rows: the block is reused for every B panel of a task,
    /// so it should stay in L2 (beside a panel, or a chunk of one).
    const A_BLOCK: usize = 256 * 1024;
    /// At most this many rows per block of packed A.
    const MAX_MC: usize = 256;
    /// Index of group g of row r in a tile of packed A (MR rows of `groups` groups).
    fn a_at(r: usize, g: usize, groups: usize) -> usize;
    /// Groups of a row that `a_at` puts side by side (from a multiple of RUN on), so that
    /// packing copies them as a run of bytes.
    const RUN: usize = 1;
}

/// `avx512-vnni`: 8×32 tiles (16 zmm accumulators), groups of 4 k, A group-major (the 8
/// rows of a group side by side, one broadcast each).
struct Vnni512;
/// `avx-vnni`: 6×16 tiles (12 ymm accumulators), groups of 4 k, A group-major.
struct Vnni256;
/// `avx2-i16`: 6×16 tiles (12 ymm accumulators), pairs of k, A group-major.
struct I16Pairs;
/// `amx-i8`: 32×32 tiles, groups of 4 k, k padded to steps of 64 (one AMX A tile row), A
/// step-major: per step, 32 rows of 64 bytes (two A tiles of 16 rows, rows 64 bytes apart).
/// The B panels are `Vnni512`'s (a k step of 16 groups is an AMX B tile of 16 rows for 16
/// columns, rows 128 bytes apart), zero-padded further, so `avx512-vnni` can run on them.
struct AmxTiles;

impl Layout for Vnni512 {
    const MR: usize = 8;
    const NR: usize = 32;
    const KG: usize = 4;
    const KALIGN: usize = 4;
    #[inline(always)]
    fn a_at(r: usize, g: usize, _: usize) -> usize {
        g * Self::MR + r
    }
}

impl Layout for Vnni256 {
    const MR: usize = 6;
    const NR: usize = 16;
    const KG: usize = 4;
    const KALIGN: usize = 4;
    #[inline(always)]
    fn a_at(r: usize, g: usize, _: usize) -> usize {
        g * Self::MR + r
    }
}

impl Layout for I16Pairs {
    const MR: usize = 6;
    const NR: usize = 16;
    const KG: usize = 2;
    const KALIGN: usize = 2;
    #[inline(always)]
    fn a_at(r: usize, g: usize, _: usize) -> usize {
        g * Self::MR + r
    }
}

impl Layout for AmxTiles {
    const MR: usize = 32;
    const NR: usize = 32;
    const KG: usize = 4;
    const KALIGN: usize = 64;
    // A 16 KiB chunk of a B panel stays in L1 while the A tiles of the block stream past it;
    // without chunks, k = 1024 ran at 0.6 of k = 512's rate.
    const KC: usize = 512;
    const RUN: usize = 16;
    // AMX CPUs have 2 MiB of L2 a core: blocks of 512 KiB (256 rows at k = 2048) ran
    // k = 2048 about 10% faster than 256 KiB; 1 MiB and 512 rows were slower again.
    const A_BLOCK: usize = 512 * 1024;
    #[inline(always)]
    fn a_at(r: usize, g: usize, _: usize) -> usize {
        (g / 16) * (Self::MR * 16) + r * 16 + g % 16
    }
}

const _: () = assert!(AmxTiles::NR == Vnni512::NR && AmxTiles::KG == Vnni512::KG);
const _: () = assert!((AmxTiles::KALIGN / AmxTiles::KG).is_multiple_of(AmxTiles::RUN));
const _: () = assert!(AmxTiles::NR <= MAX_NR && AmxTiles::KC.is_multiple_of(AmxTiles::KALIGN));

/// A layout's constants as values.
#[derive(Clone, Copy)]
struct Shape {
    mr: usize,
    nr: usize,
    kg: usize,
    kalign: usize,
}

impl Shape {
    fn of<L: Layout>() -> Shape {
        Shape {
            mr: L::MR,
            nr: L::NR,
            kg: L::KG,
            kalign: L::KALIGN,
        }
    }
}

/// Weights `[n, k]` (s8) packed for one kernel, with their row sums `Σ_k W[j, k]`.
#[derive(Clone, Debug)]
pub struct PackedB {
    n: usize,
    k: usize,
    kernel: QKernel,
    /// k of the packed panels (k rounded up to the layout's `KALIGN`).
    kp: usize,
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
        let (kp, data) = match kernel.shape() {
            None => (k, w.to_vec()),
            Some(s) => {
                let kp = k.next_multiple_of(s.kalign);
                (kp, pack_panels(w, n, k, kp, s.nr, s.kg))
            }
        };
        Ok(PackedB {
            n,
            k,
            kernel,
            kp,
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

/// `w` (`[n, k]`) as panels of `nr` columns × `kp ≥ k` (a multiple of `kg`): element
/// `(j, x)` at `panel · nr·kp + (x / kg) · nr·kg + (j % nr) · kg + x % kg`, zeros elsewhere.
fn pack_panels(w: &[i8], n: usize, k: usize, kp: usize, nr: usize, kg: usize) -> Vec<i8> {
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

/// The activation of an F32 epilogue, applied to `y` after the bias: ReLU as `dequant_one`
/// does it, GELU (erf or tanh form) as `Tensor::gelu` / `gelu_tanh` compute it in F32
/// (`UnaryOp::f`), so a fused layer gives the bits of the layer followed by the op.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Act {
    /// `y` as it is.
    #[default]
    None,
    /// `max(y, 0)`.
    Relu,
    /// `0.5 · y · (1 + erf(y / √2))`.
    Gelu,
    /// The tanh approximation of GELU.
    GeluTanh,
}

impl Act {
    /// GELU of either form applied to `y` (identity for `None` and `Relu`, which
    /// `dequant_one` applies).
    #[inline(always)]
    fn after(self, y: f32) -> f32 {
        match self {
            Act::Gelu => UnaryOp::Gelu.f(y),
            Act::GeluTanh => UnaryOp::GeluTanh.f(y),
            Act::None | Act::Relu => y,
        }
    }
}

/// What happens to the exact integer sums `acc[i, j] = Σ_k A[i, k] · W[j, k]`.
///
/// With `c = acc[i, j] - a_zero[i] · colsum[j]` (i32, exact), every kernel computes, in this
/// order and without fused multiply-adds (so all kernels give the same bits):
/// `y = (c as f32) * (a_scale[i] * w_scale[j])`, then `y = y + bias[j]`, then
/// `y = max(y, 0)` with `relu` (F32: `act`; GELU there follows the same `y`).
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
        /// The activation after the bias.
        act: Act,
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
        tasks
            .into_par_iter()
            .for_each(|(rows, cols)| run_task(kernel, &job, rows, cols));
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
            act,
            out,
        } => {
            out[i * n + j] = act.after(dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *act == Act::Relu,
            ))
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
    /// GELU after the dequantisation (F32 outputs).
    act: Act,
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
            act: Act::None,
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
                act,
                out,
            } => {
                sink = Sink {
                    out: Out::F32(out.as_mut_ptr()),
                    a_scale,
                    a_zero,
                    w_scale,
                    bias,
                    relu: act == Act::Relu,
                    act,
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
        let mut row_f32 = [0f32; MAX_NR];
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
            if matches!(self.act, Act::Gelu | Act::GeluTanh) {
                out_f32.iter_mut().for_each(|y| *y = self.act.after(*y));
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

/// Rows `i0..i0 + h` of A into `buf`, tile after tile of MR rows, each at `L::a_at`: four u8
/// in a u32, the first in the low byte (KG = 4), or two u8 zero-extended to u16 (KG = 2).
/// Rows past `h` and k values past k are zeros.
#[inline(always)]
fn pack_a<L: Layout>(job: &Job<'_>, i0: usize, h: usize, groups: usize, buf: &mut [u32]) {
    let k = job.b.k;
    if groups == 0 {
        return;
    }
    let encode_full = |v: &[u8]| -> u32 {
        if L::KG == 4 {
            u32::from_le_bytes([v[0], v[1], v[2], v[3]])
        } else {
            v[0] as u32 | (v[1] as u32) << 16
        }
    };
    let encode = |v: &[u8]| -> u32 {
        let mut x = [0u8; 4];
        x[..v.len()].copy_from_slice(v);
        if L::KG == 4 {
            u32::from_le_bytes(x)
        } else {
            x[0] as u32 | (x[1] as u32) << 16
        }
    };
    for (t, tile) in buf.chunks_exact_mut(L::MR * groups).enumerate() {
        for r in 0..L::MR {
            let i = t * L::MR + r;
            let row: &[u8] = if i < h {
                &job.a[(i0 + i) * job.lda..][..k]
            } else {
                &[]
            };
            for g0 in (0..groups).step_by(L::RUN) {
                let dst = &mut tile[L::a_at(r, g0, groups)..][..L::RUN];
                let src = row.get(g0 * L::KG..).unwrap_or(&[]);
                if src.len() >= L::RUN * L::KG {
                    for (d, v) in dst.iter_mut().zip(src.chunks_exact(L::KG)) {
                        *d = encode_full(v);
                    }
                } else {
                    let mut vs = src.chunks(L::KG);
                    for d in dst.iter_mut() {
                        *d = vs.next().map_or(0, encode);
                    }
                }
            }
        }
    }
}

/// Plain Rust on a SIMD kernel's layout: each lane sums its KG products in an i32 and adds
/// them to the accumulator (wrapping, as `vpdpbusd`, `vpaddd` and `tdpbusd` do; the sums are
/// exact anyway).
struct Twin<L>(PhantomData<L>);

impl<L: Layout> Micro for Twin<L> {
    type L = L;

    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        let (mr, nr, kg) = (L::MR, L::NR, L::KG);
        let groups = a.len() / mr;
        let bits = 32 / kg;
        let acc = &mut acc[..rows * nr];
        if !accumulate {
            acc.fill(0);
        }
        for (g, bg) in b.chunks_exact(nr * kg).take(groups).enumerate() {
            for (r, acc) in acc.chunks_exact_mut(nr).enumerate() {
                let x = a[L::a_at(r, g, groups)];
                let mut lanes = [0i32; 4];
                for (q, v) in lanes[..kg].iter_mut().enumerate() {
                    *v = ((x >> (bits * q)) & ((1 << bits) - 1)) as i32;
                }
                let x = &lanes[..kg];
                for (s, w) in acc.iter_mut().zip(bg.chunks_exact(kg)) {
                    let lane = x.iter().zip(w).map(|(&x, &w)| x * w as i32).sum::<i32>();
                    *s = s.wrapping_add(lane);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{run_task_with, AmxTiles, I16Pairs, Job, Layout, Micro, Vnni256, Vnni512};
    use crate::cpu::amx::TileConfig;
    use std::arch::x86_64::*;
    use std::ops::Range;

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
            unsafe {
                by_rows!(rows, [1 2 3 4 5 6], tile_ymm_vnni::<_, 2, S>(a, b, acc, accumulate))
            }
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
}
