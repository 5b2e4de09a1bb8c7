//! hemi's own blocked GEMM over F32, F16 and BF16 operands (mixed or not), accumulating in
//! F32: `dst (F32, row-major) = [dst +] a·b` on strided views.
//!
//! Why not the `gemm` crate for half operands: it takes F32 operands, so an F16/BF16 product
//! first needed a full-size converted copy of each operand. Here conversion happens while
//! packing, on cache-sized blocks, and BF16×BF16 runs on `vdpbf16ps` where the CPU has it.
//! F32×F32 products come here too on CPUs with AVX-512 F (`f32_kernel`), where the `avx512f`
//! kernel is about twice as fast as the `gemm` crate, whose AVX-512 code needs nightly Rust.
//!
//! The scheme is Goto/BLIS blocking:
//! ```text
//! for jc in n, step NC                  B block KC×NC (L3)
//!   for pc in k, step KC                pack B[pc.., jc..] into NR-column panels
//!     for ic in m, step MC              pack A[ic.., pc..] into MR-row panels (L2)
//!       for jr, ir                      microkernel: the MR×NR tile of C += A panel · B panel
//! ```
//! A B micro-panel (KC×NR) stays in L1 while the A micro-panels of the block stream past it;
//! when the whole packed B block fits in L2 (small k), the tiles go a row at a time instead,
//! so that consecutive tiles do not store to rows of C a power-of-two stride apart.
//! Edges (m % MR, n % NR, odd k) are zero-padded in the panels; a partial tile of C is computed
//! whole into a stack buffer and only its valid part is stored.
//!
//! Three packed formats, four tile shapes, each with a plain-Rust kernel beside the SIMD one
//! (same panels, so the packing of every shape is tested on any CPU):
//! - F32 panels, 6×16 tiles: `avx2-fma` (12 ymm accumulators) and `portable`. Any operand
//!   dtype; F16 converts with `vcvtph2ps` (F16C) in the SIMD paths and through `half` in
//!   the portable ones, BF16 by a 16-bit shift.
//! - F32 panels, 8×32 tiles (`WIDE_*`): `avx512f` (16 zmm accumulators: per k step two B
//!   loads, eight broadcasts, sixteen FMAs) and `portable-wide`, which sums with
//!   `f32::mul_add` in the same order and so gives the same bits. Any operand dtype, packed
//!   as above. Measured on Zen 5 against 12×32, 14×32 and 8×48 tiles and KC 256–512: all run
//!   the microkernel at the FMA limit in L1, and 8×32 was fastest on whole products, the
//!   8 rows dividing convolutions' channel counts.
//! - BF16 pairs, 8×32 or 14×32 tiles (`pair_rows`): `avx512bf16` and `portable-bf16-pairs`.
//!   BF16×BF16 only. Each packed u32 holds the BF16 bits of k indices 2q (low half) and 2q+1
//!   (high half); A is broadcast one pair per row, B is 32 columns × 1 pair = two zmm, and
//!   `vdpbf16ps` adds both products to an F32 accumulator (16 or 28 zmm accumulators hide
//!   its latency).
//!
//! - AMX, 32×32 tiles: `amx-bf16` (Intel AMX `tdpbf16ps`) and `portable-amx`. BF16×BF16
//!   only. A panels are row-major BF16 rows (a row of 16 pair steps is a row of an AMX A
//!   tile), B panels the BF16-pair format with 32 columns (two AMX B tiles side by side, 128
//!   bytes a row); steps padded with zeros to a multiple of 16 (32 k indices per
//!   `tdpbf16ps`). Four 16×16 F32 accumulator tiles cover the 32×32 tile of C; KC 512.
//!   Chosen for every BF16×BF16 product where the CPU has AMX-BF16 and Linux grants the tile
//!   state (`arch_prctl`); measured 3.7–4.2× `avx512bf16` on n = 512–2048 (Xeon, 2 cores).
//!   The hardware's summation order inside one `tdpbf16ps` is not the SDM's sequential one
//!   (see `Kernel::PortableAmx`), so the twin agrees with it to the bit only on exact sums.
//!
//! Numerics: every sum is accumulated in F32 in k order within a KC block, blocks added in
//! order; the result of an element does not depend on the thread count or on where the
//! element falls in the tiling (edge tiles run the same kernel), only on the kernel and k.
//! The `avx512bf16` kernel inherits the instruction's DAZ/FTZ (Intel SDM, VDPBF16PS): BF16
//! subnormal inputs count as zero and F32 subnormal partial sums flush to zero.
//!
//! Threads: `gemm` may be called from any thread, also from inside rayon tasks. Each thread
//! keeps its pack buffers (up to 4.3 MiB: A block MC×KC, B block KC×NC) in a thread-local
//! workspace between calls.
//!
//! Where the code is: this file has the entry points (`gemm`, `gemm_with`, `gemm_packed`,
//! `gemm_unfold*`, `gemm_round`), the split among threads and the blocked driver (`Micro`,
//! `run_tile`); `select` chooses the kernel, `pack` packs the panels (`unfold` packs B from
//! a convolution's image), `portable` and `x86` are the microkernels.

use crate::cpu::gemm::MatRef;
use crate::dtype::WithDType;
use crate::DType;
use half::{bf16, f16};
use std::ops::Range;

use super::pack::{pack_b_pairs, pack_b_unfold, with_workspace, Packed, PackedA, Workspace};
use super::portable::{PortableAmx, PortableF32, PortableF32Wide, PortablePairs};
use super::select::{kernel_for, pair_rows, Kernel};
use super::unfold::Unfold;
#[cfg(target_arch = "x86_64")]
use super::x86;

/// Products with fewer multiply-adds than this stay on the calling thread.
const PAR_MIN_MACS: usize = 64 * 64 * 64;
/// The largest KC of any kernel (size of the stack buffers used while packing).
pub(super) const MAX_KC: usize = 512;
/// Packed B blocks up to this many elements (256 KiB) are swept a row of tiles at a time.
const ACROSS_MAX_B: usize = 64 * 1024;
/// The largest MR·NR of any kernel (stack buffer of an edge tile).
const MAX_TILE: usize = AMX_MR * AMX_NR;

/// Tile (MR×NR) of the AMX-format kernels (`amx-bf16` and its twin `portable-amx`): 2×2 AMX
/// tiles of 16×16 F32.
pub(super) const AMX_MR: usize = 32;
pub(super) const AMX_NR: usize = 32;
pub(super) const AMX_KC: usize = 512;
pub(super) const AMX_MC: usize = 256;
pub(super) const AMX_NC: usize = 2048;
const _: () = assert!(AMX_KC <= MAX_KC && AMX_KC.is_multiple_of(32));

/// Tile (MR×NR) and blocking (KC, MC, NC) of the wide F32-panel kernels (`avx512f` and its
/// twin `portable-wide`); see `PortableF32Wide`.
pub(super) const WIDE_MR: usize = 8;
pub(super) const WIDE_NR: usize = 32;
pub(super) const WIDE_KC: usize = 256;
pub(super) const WIDE_MC: usize = 256;
pub(super) const WIDE_NC: usize = 2048;
const _: () = assert!(WIDE_MR * WIDE_NR <= MAX_TILE && WIDE_KC <= MAX_KC);
const _: () = assert!(WIDE_NR.is_multiple_of(16) && WIDE_MC.is_multiple_of(WIDE_MR));

/// `dst = (accumulate ? dst : 0) + a·b`, `dst` row-major contiguous `a.rows x b.cols`,
/// accumulated in F32 with the kernel `kernel_for` picks. `parallel` lets it split the
/// output over rayon's pool (products under 64³ multiply-adds stay on the calling thread);
/// pass false from inside a task that is already parallel. Panics on mismatched shapes or
/// out-of-bounds views (callers validate user input first).
pub fn gemm<A: WithDType, B: WithDType>(
    dst: &mut [f32],
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    let kernel = kernel_for(a.dtype(), b.dtype(), a.rows, a.cols, b.cols);
    gemm_with(kernel, dst, a, b, accumulate, parallel)
}

/// As `gemm`, with the kernel chosen by the caller (tests, benches). Panics if the CPU lacks
/// the kernel or its format does not take these dtypes.
pub fn gemm_with<A: WithDType, B: WithDType>(
    kernel: Kernel,
    dst: &mut [f32],
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    mat_product(kernel, dst, Lhs::Mat(a), b, accumulate, parallel)
}

/// `gemm_with` on A packed beforehand: its kernel, the same bits.
pub fn gemm_packed<B: WithDType>(
    dst: &mut [f32],
    a: &PackedA,
    b: MatRef<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    mat_product::<f32, B>(a.kernel, dst, Lhs::Packed(a), b, accumulate, parallel)
}

/// `gemm_with` where B is the column matrix `u` of a convolution, packed straight from its
/// image (`Unfold`): the same panels, so the same bits, as `gemm_with` on `im2col`'s
/// matrix. Kernels with F32 panels only (`Kernel::packs_f32`); panics as `gemm_with` does.
pub fn gemm_unfold<A: WithDType, B: WithDType>(
    kernel: Kernel,
    dst: &mut [f32],
    a: MatRef<'_, A>,
    u: Unfold<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    unfold_product(kernel, dst, Lhs::Mat(a), u, accumulate, parallel)
}

/// `gemm_unfold` on A packed beforehand: its kernel, the same bits.
pub fn gemm_unfold_packed<B: WithDType>(
    dst: &mut [f32],
    a: &PackedA,
    u: Unfold<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    unfold_product::<f32, B>(a.kernel, dst, Lhs::Packed(a), u, accumulate, parallel)
}

/// `gemm_with` on a BF16-pair kernel (`Kernel::unfolds_pairs`) where B is a convolution's
/// column matrix with its k indices in channel pairs, packed straight from the image's
/// channel pairs: `u` unfolds planes of u32 (as F32 bit patterns, moved, never computed
/// with) whose element `[cp, y, x]` holds the BF16 bits of channel `2cp` in its low half and
/// of channel `2cp + 1` in its high half, so each packed step (pair row `r` of the unfold,
/// NR output pixels) is one shifted run of those pairs, the pair format the kernel reads.
/// A's k index `2r + e` is channel `2cp + e` at the kernel offset of row `r`
/// (`cpu::conv` reorders the weights so). The same bits as `gemm_with` on the explicit
/// matrix in that k order (`tests/kernels/gemm_half.rs`).
pub fn gemm_unfold_pairs(
    kernel: Kernel,
    dst: &mut [f32],
    a: MatRef<'_, bf16>,
    u: Unfold<'_, f32>,
    accumulate: bool,
    parallel: bool,
) {
    pairs_product(kernel, dst, Lhs::Mat(a), u, accumulate, parallel)
}

/// `gemm_unfold_pairs` on A packed beforehand: its kernel, the same bits.
pub fn gemm_unfold_pairs_packed(
    dst: &mut [f32],
    a: &PackedA,
    u: Unfold<'_, f32>,
    accumulate: bool,
    parallel: bool,
) {
    pairs_product(a.kernel, dst, Lhs::Packed(a), u, accumulate, parallel)
}

/// `gemm_with`'s and `gemm_packed`'s checks of B, then the product.
fn mat_product<A: WithDType, B: WithDType>(
    kernel: Kernel,
    dst: &mut [f32],
    a: Lhs<'_, A>,
    b: MatRef<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows(), a.cols(), b.cols);
    assert_eq!(
        b.rows, k,
        "gemm_half: inner dims ({m}x{k} · {}x{n})",
        b.rows
    );
    b.check_bounds("rhs");
    run_product(kernel, dst, a, Rhs::Mat(b), n, accumulate, parallel)
}

/// `gemm_unfold`'s and `gemm_unfold_packed`'s checks, then the product.
fn unfold_product<A: WithDType, B: WithDType>(
    kernel: Kernel,
    dst: &mut [f32],
    a: Lhs<'_, A>,
    u: Unfold<'_, B>,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows(), a.cols(), u.cols());
    assert_eq!(
        u.rows(),
        k,
        "gemm_unfold: inner dims ({m}x{k} · {}x{n})",
        u.rows()
    );
    assert!(
        kernel.packs_f32(),
        "gemm_unfold: {} packs BF16 pairs",
        kernel.name()
    );
    run_product(kernel, dst, a, Rhs::Unfold(u), n, accumulate, parallel)
}

/// `gemm_unfold_pairs`'s and `gemm_unfold_pairs_packed`'s checks, then the product.
fn pairs_product(
    kernel: Kernel,
    dst: &mut [f32],
    a: Lhs<'_, bf16>,
    u: Unfold<'_, f32>,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows(), a.cols(), u.cols());
    assert_eq!(
        2 * u.rows(),
        k,
        "gemm_unfold_pairs: inner dims ({m}x{k} · 2·{}x{n})",
        u.rows()
    );
    assert!(
        kernel.unfolds_pairs(),
        "gemm_unfold_pairs: {} does not pack unpadded BF16 pairs",
        kernel.name()
    );
    run_product::<bf16, bf16>(kernel, dst, a, Rhs::Pairs(u), n, accumulate, parallel)
}

/// The checks and the run the entry points share: `dst [m, n] = [dst +] a · b`.
fn run_product<A: WithDType, B: WithDType>(
    kernel: Kernel,
    dst: &mut [f32],
    a: Lhs<'_, A>,
    b: Rhs<'_, B>,
    n: usize,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, a_dtype) = match &a {
        Lhs::Mat(a) => {
            a.check_bounds("lhs");
            (a.rows, a.cols, a.dtype())
        }
        Lhs::Packed(p) => {
            assert_eq!(
                p.kernel, kernel,
                "gemm_half: A was packed for another kernel"
            );
            (p.rows, p.cols, p.dtype)
        }
    };
    assert!(dst.len() >= m * n, "gemm_half: dst too small for {m}x{n}");
    assert!(
        kernel.is_available(),
        "gemm_half: this CPU cannot run {}",
        kernel.name()
    );
    assert!(
        kernel.accepts(a_dtype, B::DTYPE),
        "gemm_half: {} does not take {:?} x {:?}",
        kernel.name(),
        a_dtype,
        B::DTYPE
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let job = Job {
        a,
        b,
        c: DstPtr(dst.as_mut_ptr()),
        ldc: n,
        k,
        accumulate,
        round: None,
    };
    run_job(kernel, &job, m, n, k, parallel)
}

/// Whether `gemm_round` on `kernel` takes a product with inner dim `k`: it rounds each
/// tile as it finishes, so the whole sum must come from one k block.
pub fn rounds_in_tiles(kernel: Kernel, k: usize) -> bool {
    k > 0 && k <= kernel.k_block()
}

/// `dst [m, n] = round(bias + a · b)` into F16 or BF16 (`O`), `bias` (`[n]`, F32) on every
/// row, or zeros. Each MR × NR tile is summed in F32 into a buffer in L1, from the bias, and
/// rounded once to nearest-even straight into `dst`. This gives the bits of `gemm_with` into
/// an F32 matrix filled with the bias rows, followed by `CpuStorage::from_f32`. There is no
/// `m × n` F32 matrix, no fill of it and no conversion pass over it; under autocast every
/// linear layer's output was all three. Returns true once every one of the first `m × n`
/// elements of `dst` is written; false, having written nothing, where the sum needs more
/// than one k block (`rounds_in_tiles`). Panics as `gemm_with` does.
pub fn gemm_round<A: WithDType, B: WithDType, O: WithDType>(
    kernel: Kernel,
    dst: &mut [std::mem::MaybeUninit<O>],
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    bias: Option<&[f32]>,
    parallel: bool,
) -> bool {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(
        b.rows, k,
        "gemm_round: inner dims ({m}x{k} · {}x{n})",
        b.rows
    );
    assert!(dst.len() >= m * n, "gemm_round: dst too small for {m}x{n}");
    assert!(
        bias.is_none_or(|b| b.len() >= n),
        "gemm_round: bias shorter than {n}"
    );
    let bf16_out = match O::DTYPE {
        DType::BF16 => true,
        DType::F16 => false,
        other => panic!("gemm_round: rounds into F16 or BF16, not {other:?}"),
    };
    if !rounds_in_tiles(kernel, k) {
        return false;
    }
    b.check_bounds("rhs");
    a.check_bounds("lhs");
    assert!(
        kernel.is_available(),
        "gemm_round: this CPU cannot run {}",
        kernel.name()
    );
    assert!(
        kernel.accepts(a.dtype(), B::DTYPE),
        "gemm_round: {} does not take {:?} x {:?}",
        kernel.name(),
        a.dtype(),
        B::DTYPE
    );
    if m == 0 || n == 0 {
        return true;
    }
    let job = Job {
        a: Lhs::Mat(a),
        b: Rhs::Mat(b),
        c: DstPtr(std::ptr::null_mut()),
        ldc: n,
        k,
        accumulate: false,
        round: Some(Rounded {
            ptr: dst.as_mut_ptr().cast(),
            bf16: bf16_out,
            bias,
        }),
    };
    run_job(kernel, &job, m, n, k, parallel);
    true
}

/// `src` rounded into the `src.len()` BF16 (`bf16_out`) or F16 values at `dst`.
///
/// # Safety
/// `dst` points to `src.len()` writable 2-byte values that nothing else accesses meanwhile.
#[inline(always)]
unsafe fn round_run(src: &[f32], dst: *mut u16, bf16_out: bool) {
    // SAFETY (both arms): the caller's contract; every bit pattern is a valid BF16/F16.
    if bf16_out {
        let d = unsafe { std::slice::from_raw_parts_mut(dst.cast::<bf16>(), src.len()) };
        crate::dtype::convert::f32_to_bf16(src, d);
    } else {
        let d = unsafe { std::slice::from_raw_parts_mut(dst.cast::<half::f16>(), src.len()) };
        crate::dtype::convert::f32_to_f16(src, d);
    }
}

/// Runs `job` on the copy of the driver compiled in this crate for its operand types, one
/// of the nine F32/F16/BF16 pairs every kernel's checks (`Kernel::accepts`) leave.
///
/// The entry points are generic over the operand types, and a release build compiles a
/// generic function again in every crate that instantiates it (no shared generics at
/// opt-level 3). Were the driver (`split_and_run`, every kernel's `run_tile` and packing)
/// generic all the way down, each test binary calling `gemm_with` would compile the whole
/// of it again (it was a third of the `kernels` test binary), and the library itself
/// compiled it for the ten pairs with F64 or I64 that its generic callers name but the
/// checks reject. The nine copies below are plain functions: compiled here once.
fn run_job<A: WithDType, B: WithDType>(
    kernel: Kernel,
    job: &Job<'_, A, B>,
    m: usize,
    n: usize,
    k: usize,
    parallel: bool,
) {
    macro_rules! monomorphic {
        ($($name:ident: $a:ty, $b:ty;)*) => {
            $(
                if let Some(job) = job.cast::<$a, $b>() {
                    fn $name(
                        kernel: Kernel,
                        job: &Job<'_, $a, $b>,
                        m: usize,
                        n: usize,
                        k: usize,
                        parallel: bool,
                    ) {
                        split_and_run(kernel, job, m, n, k, parallel)
                    }
                    return $name(kernel, job, m, n, k, parallel);
                }
            )*
        };
    }
    monomorphic! {
        f32_f32: f32, f32;
        f32_f16: f32, f16;
        f32_bf16: f32, bf16;
        f16_f32: f16, f32;
        f16_f16: f16, f16;
        f16_bf16: f16, bf16;
        bf16_f32: bf16, f32;
        bf16_f16: bf16, f16;
        bf16_bf16: bf16, bf16;
    }
    unreachable!(
        "gemm_half: the callers check for F32, F16 or BF16 operands, not {:?} x {:?}",
        A::DTYPE,
        B::DTYPE
    )
}

/// Splits the product among threads (or not) and runs its tasks.
fn split_and_run<A: WithDType, B: WithDType>(
    kernel: Kernel,
    job: &Job<'_, A, B>,
    m: usize,
    n: usize,
    k: usize,
    parallel: bool,
) {
    let threads = if parallel && m * n * k >= PAR_MIN_MACS {
        rayon::current_num_threads()
    } else {
        1
    };
    let (mr, nr) = kernel.tile_shape(m);
    let (tm, tn) = split(m, n, k, mr, nr, threads);
    if tm >= m && tn >= n {
        run_task(kernel, job, 0..m, 0..n);
        return;
    }
    let tasks: Vec<(Range<usize>, Range<usize>)> = (0..m)
        .step_by(tm)
        .flat_map(|i| {
            (0..n)
                .step_by(tn)
                .map(move |j| (i..m.min(i + tm), j..n.min(j + tn)))
        })
        .collect();
    crate::threads::nudge();
    crate::cpu::chunked::for_each_block(
        tasks.len(),
        1,
        || (),
        |_, t| {
            let (rows, cols) = tasks[t].clone();
            run_task(kernel, job, rows, cols)
        },
    );
}

/// Tile sizes (rows, cols) of the output, whole MR×NR micro-tiles each, for `threads` tasks.
/// Each task packs its own panels, so A is packed once per tile column and B once per tile
/// row; among the grids that give every thread a tile, pick the one with the least work on
/// the busiest thread, counting a packed element as `PACK_COST` multiply-adds (packing
/// converts and scatters element by element, the microkernel does 8–32 multiply-adds per
/// instruction).
fn split(m: usize, n: usize, k: usize, mr: usize, nr: usize, threads: usize) -> (usize, usize) {
    const PACK_COST: usize = 16;
    let (mp, np) = (m.div_ceil(mr), n.div_ceil(nr));
    if threads <= 1 || mp * np == 1 {
        return (m, n);
    }
    let mut best = (usize::MAX, m, n);
    for gm in 1..=threads.min(mp) {
        let gn = threads.div_ceil(gm).min(np);
        let (tm, tn) = (mp.div_ceil(gm) * mr, np.div_ceil(gn) * nr);
        let tiles = m.div_ceil(tm) * n.div_ceil(tn);
        let per_thread = tiles.div_ceil(threads);
        let cost = per_thread * (tm * tn * k + PACK_COST * k * (tm + tn));
        if cost < best.0 {
            best = (cost, tm, tn);
        }
    }
    (best.1, best.2)
}

/// One product, shared by the tasks that compute its tiles.
pub(super) struct Job<'a, A, B> {
    pub(super) a: Lhs<'a, A>,
    b: Rhs<'a, B>,
    c: DstPtr,
    ldc: usize,
    k: usize,
    accumulate: bool,
    /// `gemm_round`: each tile rounded into this F16/BF16 output instead of written to `c`.
    round: Option<Rounded<'a>>,
}

impl<'a, A: WithDType, B: WithDType> Job<'a, A, B> {
    /// This job as a `Job<A2, B2>`, when `A2` is `A` and `B2` is `B`.
    fn cast<A2: WithDType, B2: WithDType>(&self) -> Option<&Job<'a, A2, B2>> {
        use std::any::TypeId;
        (TypeId::of::<A>() == TypeId::of::<A2>() && TypeId::of::<B>() == TypeId::of::<B2>())
            // SAFETY: the same types, so the same struct; the borrow carries over.
            .then(|| unsafe { &*(self as *const Self).cast::<Job<'a, A2, B2>>() })
    }
}

/// The F16/BF16 output of `gemm_round`, written by several tasks at once, and the bias its
/// F32 sums start from.
#[derive(Clone, Copy)]
struct Rounded<'a> {
    ptr: *mut u16,
    bf16: bool,
    bias: Option<&'a [f32]>,
}
// SAFETY: as for `DstPtr`: `gemm_round` holds the `&mut [O]` for the whole product, and its
// tasks write disjoint rectangles of it.
unsafe impl Send for Rounded<'_> {}
// SAFETY: as above.
unsafe impl Sync for Rounded<'_> {}

/// The left operand: a matrix packed by each task, or one packed before the product
/// (`PackedA`).
#[derive(Clone, Copy)]
pub(super) enum Lhs<'a, A> {
    Mat(MatRef<'a, A>),
    Packed(&'a PackedA),
}

impl<A: WithDType> Lhs<'_, A> {
    pub(super) fn rows(&self) -> usize {
        match self {
            Lhs::Mat(a) => a.rows,
            Lhs::Packed(p) => p.rows,
        }
    }

    fn cols(&self) -> usize {
        match self {
            Lhs::Mat(a) => a.cols,
            Lhs::Packed(p) => p.cols,
        }
    }
}

/// The length of `run_tile`'s k blocks for inner dimension `k`: equal blocks, so that none is
/// a sliver (k = 600 gives blocks of 304 and 296).
pub(super) fn k_block_len<M: Micro>(k: usize) -> usize {
    let kc_align = (M::KSTEP * M::STEP_ALIGN).max(8);
    k.div_ceil(k.div_ceil(M::KC))
        .next_multiple_of(kc_align)
        .min(M::KC)
}

/// The right operand: a matrix, or a convolution's column matrix read from its image.
#[derive(Clone, Copy)]
enum Rhs<'a, B> {
    Mat(MatRef<'a, B>),
    Unfold(Unfold<'a, B>),
    /// A column matrix in channel pairs (`gemm_unfold_pairs`).
    Pairs(Unfold<'a, f32>),
}

/// The output buffer, written by several tasks at once.
#[derive(Clone, Copy)]
struct DstPtr(*mut f32);
// SAFETY: `gemm_with` holds the `&mut [f32]` for the whole product, and its tasks write
// disjoint rectangles of it (the tiles `split` makes), each from one thread only.
unsafe impl Send for DstPtr {}
// SAFETY: as above.
unsafe impl Sync for DstPtr {}

fn run_task<A: WithDType, B: WithDType>(
    kernel: Kernel,
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    with_workspace(|ws| match kernel {
        Kernel::PortableF32 => run_tile::<PortableF32, A, B>(job, rows, cols, ws),
        Kernel::PortableBf16Pairs if pair_rows(job.a.rows()) == 8 => {
            run_tile::<PortablePairs<8>, A, B>(job, rows, cols, ws)
        }
        Kernel::PortableBf16Pairs => run_tile::<PortablePairs<14>, A, B>(job, rows, cols, ws),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked `Kernel::Avx2Fma.is_available()` (AVX2, FMA, F16C).
        Kernel::Avx2Fma => unsafe { x86::run_tile_avx2::<A, B>(job, rows, cols, ws) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked `Kernel::Avx512Bf16.is_available()`.
        Kernel::Avx512Bf16 => unsafe { x86::run_tile_avx512bf16::<A, B>(job, rows, cols, ws) },
        Kernel::PortableF32Wide => run_tile::<PortableF32Wide, A, B>(job, rows, cols, ws),
        Kernel::PortableAmx => run_tile::<PortableAmx, A, B>(job, rows, cols, ws),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked `Kernel::AmxBf16.is_available()` (AMX usable).
        Kernel::AmxBf16 => unsafe { x86::run_tile_amx::<A, B>(job, rows, cols, ws) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked `Kernel::Avx512F32.is_available()`.
        Kernel::Avx512F32 => unsafe { x86::run_tile_avx512f::<A, B>(job, rows, cols, ws) },
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Avx2Fma | Kernel::Avx512Bf16 | Kernel::Avx512F32 | Kernel::AmxBf16 => {
            unreachable!("checked by is_available")
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The blocked driver

/// A microkernel, its packed format and the blocking that suits it.
pub(super) trait Micro {
    /// Packed element: an F32 value, or two BF16 bit patterns in a u32.
    type P: Packed;
    /// k indices per packed step: 1 (F32 panels) or 2 (BF16 pairs).
    const KSTEP: usize;
    /// An F32-panel kernel that runs with AVX2 and F16C (its packing may use them:
    /// `pack_f32`'s `simd`).
    const SIMD: bool = false;
    /// The steps of a panel are padded (with zeros) to a multiple of this: 16 for AMX, whose
    /// tiles take 16 pair steps at once.
    const STEP_ALIGN: usize = 1;
    const MR: usize;
    const NR: usize;
    /// k indices per block (a multiple of 8). Each block is one more load and store of C per
    /// tile, which costs when k is small (on Zen 3, 8192×288×64 ran 1.7× faster with one k
    /// block than with two), so KC is as large as keeps the KC×NR B micro-panel in L1.
    const KC: usize;
    /// Rows per A block (a multiple of MR): an MC×KC A block stays in L2.
    const MC: usize;
    /// Columns per B block (a multiple of NR): a KC×NC B block stays in L3.
    const NC: usize;
    /// Packs rows `i0..i0 + h`, k indices `p0..p0 + kc` of `a` into `ceil(h / MR)` panels of
    /// `steps(kc) * MR` elements each (see the format).
    fn pack_a<T: WithDType>(
        a: &MatRef<'_, T>,
        i0: usize,
        h: usize,
        p0: usize,
        kc: usize,
        out: &mut [Self::P],
    );
    /// Packs columns `j0..j0 + w` of B, given as `bt` = Bᵀ, into NR-wide panels likewise.
    fn pack_b<T: WithDType>(
        bt: &MatRef<'_, T>,
        j0: usize,
        w: usize,
        p0: usize,
        kc: usize,
        out: &mut [Self::P],
    );
    /// `c[r*ldc + j] = (load_c ? c[r*ldc + j] : 0) + Σ_steps a·b` for r < MR, j < NR, the
    /// sum accumulated in F32 from zero and added to C at the end.
    ///
    /// # Safety
    /// `a` holds `steps * MR` and `b` `steps * NR` readable elements; `c` is MR rows of NR
    /// writable F32 at stride `ldc`; the CPU has the kernel's features.
    unsafe fn tile(
        steps: usize,
        a: *const Self::P,
        b: *const Self::P,
        c: *mut f32,
        ldc: usize,
        load_c: bool,
    );
}

/// Computes the rectangle `rows x cols` of the product. Inlined into each kernel's entry
/// point, so the packing compiles with that kernel's target features.
#[inline(always)]
pub(super) fn run_tile<M: Micro, A: WithDType, B: WithDType>(
    job: &Job<'_, A, B>,
    rows: Range<usize>,
    cols: Range<usize>,
    ws: &mut Workspace,
) {
    let (mr, nr) = (M::MR, M::NR);
    let k = job.k;
    let kc_max = k_block_len::<M>(k);
    let steps_max = packed_steps::<M>(kc_max);
    let mc_max = rows.len().min(M::MC).next_multiple_of(mr);
    let nc_max = cols.len().min(M::NC).next_multiple_of(nr);
    let (apack, bpack) = ws.buffers::<M::P>(mc_max * steps_max, nc_max * steps_max);
    let bt = match job.b {
        Rhs::Mat(b) => Some(b.t()),
        Rhs::Unfold(_) | Rhs::Pairs(_) => None,
    };
    let mut edge = [0f32; MAX_TILE];

    for jc in cols.clone().step_by(M::NC) {
        let nc = (cols.end - jc).min(M::NC);
        let n_panels = nc.div_ceil(nr);
        for pc in (0..k).step_by(kc_max) {
            let kc = (k - pc).min(kc_max);
            let steps = packed_steps::<M>(kc);
            let (a_len, b_len) = (steps * mr, steps * nr);
            let bp = &mut bpack[..n_panels * b_len];
            match (&bt, &job.b) {
                (Some(bt), _) => M::pack_b(bt, jc, nc, pc, kc, bp),
                (None, Rhs::Unfold(u)) => pack_b_unfold::<M, B>(u, jc, nc, pc, kc, bp),
                (None, Rhs::Pairs(u)) => pack_b_pairs::<M>(u, jc, nc, pc, kc, bp),
                (None, Rhs::Mat(_)) => unreachable!("bt is set for matrices"),
            }
            // Tile order: down a column of tiles (the B micro-panel stays in L1 while the A
            // panels stream past), or, when the packed B block is small enough to stay in
            // L2, across a row of tiles: consecutive tiles then store to different lines
            // of C instead of rows a stride apart, which a power-of-two row stride maps
            // onto the same few L1 sets (one Zen 5 core, 144×16·16×1024: avx512f 2.7×,
            // avx2-fma 2.2× faster this way; unchanged where k is large).
            let across = n_panels * b_len <= ACROSS_MAX_B;
            // The first k block overwrites C unless the caller accumulates.
            let load_c = job.accumulate || pc > 0;
            for ic in rows.clone().step_by(M::MC) {
                let mc = (rows.end - ic).min(M::MC);
                let m_panels = mc.div_ceil(mr);
                let apanels: &[M::P] = match &job.a {
                    Lhs::Mat(a) => {
                        M::pack_a(a, ic, mc, pc, kc, &mut apack[..m_panels * a_len]);
                        &apack[..m_panels * a_len]
                    }
                    Lhs::Packed(p) => {
                        debug_assert!(ic.is_multiple_of(mr));
                        p.panels(pc / kc_max, ic / mr, m_panels, a_len)
                    }
                };
                for t in 0..n_panels * m_panels {
                    let (jp, ip) = if across {
                        (t % n_panels, t / n_panels)
                    } else {
                        (t / m_panels, t % m_panels)
                    };
                    let j = jc + jp * nr;
                    let w = (nc - jp * nr).min(nr);
                    let bp = bpack[jp * b_len..].as_ptr();
                    let i = ic + ip * mr;
                    let h = (mc - ip * mr).min(mr);
                    let ap = apanels[ip * a_len..].as_ptr();
                    if let Some(out) = &job.round {
                        // One k block (checked by `gemm_round`): the tile's sums are final.
                        if let Some(bias) = out.bias {
                            for row in edge.chunks_exact_mut(nr).take(h) {
                                row[..w].copy_from_slice(&bias[j..j + w]);
                            }
                        }
                        // SAFETY: as below, with `edge` (MR x NR, stride NR) as C.
                        unsafe {
                            M::tile(steps, ap, bp, edge.as_mut_ptr(), nr, out.bias.is_some())
                        };
                        for (r, tile_row) in edge.chunks_exact(nr).take(h).enumerate() {
                            // SAFETY: row i+r, columns j..j+w of the m x n output lie inside
                            // this task's rectangle, which no other task touches.
                            unsafe {
                                let d = out.ptr.add((i + r) * job.ldc + j);
                                round_run(&tile_row[..w], d, out.bf16)
                            };
                        }
                        continue;
                    }
                    if h == mr && w == nr {
                        // SAFETY: the panels hold `steps` steps of MR and NR elements;
                        // rows i..i+MR and columns j..j+NR lie inside this task's
                        // rectangle of dst (m x n, row stride ldc = n).
                        unsafe {
                            let c = job.c.0.add(i * job.ldc + j);
                            M::tile(steps, ap, bp, c, job.ldc, load_c)
                        };
                    } else {
                        // SAFETY: as above, with `edge` (MR x NR, stride NR) as C.
                        unsafe { M::tile(steps, ap, bp, edge.as_mut_ptr(), nr, false) };
                        for (r, tile_row) in edge.chunks_exact(nr).take(h).enumerate() {
                            // SAFETY: row i+r, columns j..j+w are inside this task's
                            // rectangle of dst, which no other task touches.
                            let dst = unsafe {
                                let row = job.c.0.add((i + r) * job.ldc + j);
                                std::slice::from_raw_parts_mut(row, w)
                            };
                            for (d, &t) in dst.iter_mut().zip(tile_row) {
                                *d = if load_c { *d + t } else { t };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Packed steps of a panel holding `kc` k indices.
#[inline(always)]
pub(super) fn packed_steps<M: Micro>(kc: usize) -> usize {
    kc.div_ceil(M::KSTEP).next_multiple_of(M::STEP_ALIGN)
}
