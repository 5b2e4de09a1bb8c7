//! The packed layouts of the INT8 GEMM (`Layout`): the weights in panels (`PackedB`, with
//! their column sums), and each task's block of activations (`pack_a`).

use super::select::QKernel;
use super::{Job, MAX_K, MAX_NR};
use crate::error::{Error, Result};

/// A packed layout, shared by a SIMD kernel and its portable twin.
pub(super) trait Layout {
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
pub(super) struct Vnni512;
/// `avx-vnni`: 6×16 tiles (12 ymm accumulators), groups of 4 k, A group-major.
pub(super) struct Vnni256;
/// `avx2-i16`: 6×16 tiles (12 ymm accumulators), pairs of k, A group-major.
pub(super) struct I16Pairs;
/// `amx-i8`: 32×32 tiles, groups of 4 k, k padded to steps of 64 (one AMX A tile row), A
/// step-major: per step, 32 rows of 64 bytes (two A tiles of 16 rows, rows 64 bytes apart).
/// The B panels are `Vnni512`'s (a k step of 16 groups is an AMX B tile of 16 rows for 16
/// columns, rows 128 bytes apart), zero-padded further, so `avx512-vnni` can run on them.
pub(super) struct AmxTiles;

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
pub(super) struct Shape {
    pub(super) mr: usize,
    pub(super) nr: usize,
    kg: usize,
    kalign: usize,
}

impl Shape {
    pub(super) fn of<L: Layout>() -> Shape {
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
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) kernel: QKernel,
    /// k of the packed panels (k rounded up to the layout's `KALIGN`).
    pub(super) kp: usize,
    pub(super) data: Vec<i8>,
    pub(super) col_sums: Vec<i32>,
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

/// Rows `i0..i0 + h` of A into `buf`, tile after tile of MR rows, each at `L::a_at`: four u8
/// in a u32, the first in the low byte (KG = 4), or two u8 zero-extended to u16 (KG = 2).
/// Rows past `h` and k values past k are zeros.
#[inline(always)]
pub(super) fn pack_a<L: Layout>(
    job: &Job<'_>,
    i0: usize,
    h: usize,
    groups: usize,
    buf: &mut [u32],
) {
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
