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

use crate::cpu::gemm::MatRef;
use crate::dtype::{same_slice, WithDType};
use crate::DType;
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::unfold::{self, Unfold};

/// Products with fewer multiply-adds than this stay on the calling thread.
const PAR_MIN_MACS: usize = 64 * 64 * 64;
/// The largest KC of any kernel (size of the stack buffers used while packing).
const MAX_KC: usize = 512;
/// Packed B blocks up to this many elements (256 KiB) are swept a row of tiles at a time.
const ACROSS_MAX_B: usize = 64 * 1024;
/// The largest MR·NR of any kernel (stack buffer of an edge tile).
const MAX_TILE: usize = AMX_MR * AMX_NR;

/// Tile (MR×NR) of the AMX-format kernels (`amx-bf16` and its twin `portable-amx`): 2×2 AMX
/// tiles of 16×16 F32.
const AMX_MR: usize = 32;
const AMX_NR: usize = 32;
const AMX_KC: usize = 512;
const AMX_MC: usize = 256;
const AMX_NC: usize = 2048;
const _: () = assert!(AMX_KC <= MAX_KC && AMX_KC.is_multiple_of(32));

/// Tile (MR×NR) and blocking (KC, MC, NC) of the wide F32-panel kernels (`avx512f` and its
/// twin `portable-wide`); see `PortableF32Wide`.
const WIDE_MR: usize = 8;
const WIDE_NR: usize = 32;
const WIDE_KC: usize = 256;
const WIDE_MC: usize = 256;
const WIDE_NC: usize = 2048;
const _: () = assert!(WIDE_MR * WIDE_NR <= MAX_TILE && WIDE_KC <= MAX_KC);
const _: () = assert!(WIDE_NR.is_multiple_of(16) && WIDE_MC.is_multiple_of(WIDE_MR));

// ---------------------------------------------------------------------------------------------
// Kernels and dispatch

/// A microkernel with its packed format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust on F32 panels (6×16 tiles): any CPU, any operand dtypes.
    PortableF32,
    /// Plain Rust on BF16-pair panels (14×32 tiles), emulating `vdpbf16ps` (both products of
    /// a pair added to the F32 accumulator in turn): BF16×BF16 only. Slow; it exists so the
    /// pair format is tested on CPUs without AVX-512 BF16.
    PortableBf16Pairs,
    /// AVX2 + FMA on F32 panels (6×16 tiles, 12 ymm accumulators): any operand dtypes
    /// (needs F16C too, for packing F16; every AVX2 CPU has it).
    Avx2Fma,
    /// AVX-512 BF16 `vdpbf16ps` on BF16-pair panels (14×32 tiles, 28 zmm accumulators). Needs
    /// AVX-512 F, BW and BF16 (Rust's `avx512bf16` implies BW, which the packing code uses).
    Avx512Bf16,
    /// Plain Rust on F32 panels of the `avx512f` kernel's tile (WIDE_MR×WIDE_NR), with that
    /// kernel's blocking and its fused multiply-adds (`f32::mul_add`), so it gives the same
    /// bits: any CPU, any operand dtypes. Slow (a library call per multiply-add where the
    /// build lacks FMA); it exists so the wide packing is tested on CPUs without AVX-512.
    PortableF32Wide,
    /// AVX-512 F on F32 panels (WIDE_MR×WIDE_NR tiles, one zmm accumulator per 16 columns of
    /// a row): any operand dtypes. Needs AVX-512 F, plus AVX2, FMA and F16C for the packing
    /// (every AVX-512 CPU has them).
    Avx512F32,
    /// Plain Rust on the AMX panels (32×32 tiles: A rows of BF16 pairs, B panels as the
    /// BF16-pair format), summing as the Intel SDM's pseudocode of `tdpbf16ps` does (per
    /// pair, the even k index's product, then the odd one's): BF16×BF16 only. It exists so
    /// the AMX packing is tested on CPUs without AMX. The hardware sums in an order (or with
    /// internal precision) the SDM does not give: measured on a Sapphire-Rapids-class Xeon,
    /// 60 % of the elements of random 16×32·32×16 products equal this sequential sum (and 62
    /// % the correctly rounded one), the rest differ in the last bits. So the two agree to
    /// the bit only where every partial sum is exact (`tests/gemm_kernels.rs`), and each is
    /// checked against F64 with the F32 summation bound.
    PortableAmx,
    /// Intel AMX `tdpbf16ps` on the AMX panels: four 16×16 F32 accumulator tiles, two A and
    /// two B tiles of 16 rows × 32 BF16 per 32 k indices. BF16×BF16 only. Needs AMX-TILE,
    /// AMX-BF16 and the operating system's permission to use the tile data (`amx_usable`).
    AmxBf16,
}

impl Kernel {
    /// Every microkernel, portable ones first (for tests and `hemi bench matmul` to iterate
    /// over).
    pub const ALL: [Kernel; 8] = [
        Kernel::PortableF32,
        Kernel::PortableBf16Pairs,
        Kernel::PortableF32Wide,
        Kernel::PortableAmx,
        Kernel::Avx2Fma,
        Kernel::Avx512Bf16,
        Kernel::Avx512F32,
        Kernel::AmxBf16,
    ];

    /// The kernel packs F32 panels (not BF16 pairs): the panels `gemm_unfold` can fill.
    pub fn packs_f32(self) -> bool {
        matches!(
            self,
            Kernel::PortableF32 | Kernel::Avx2Fma | Kernel::PortableF32Wide | Kernel::Avx512F32
        )
    }

    /// The kernel packs BF16 pairs one step of NR u32 at a time, unpadded: the panels
    /// `gemm_unfold_pairs` can fill (`avx512bf16` and its portable twin; not the AMX ones,
    /// whose steps are padded to 16).
    pub fn unfolds_pairs(self) -> bool {
        matches!(self, Kernel::PortableBf16Pairs | Kernel::Avx512Bf16)
    }

    /// The kernel's name as `hemi bench matmul` prints it (`"avx512bf16"`,
    /// `"portable"`...).
    pub fn name(self) -> &'static str {
        match self {
            Kernel::PortableF32 => "portable",
            Kernel::PortableBf16Pairs => "portable-bf16-pairs",
            Kernel::Avx2Fma => "avx2-fma",
            Kernel::Avx512Bf16 => "avx512bf16",
            Kernel::PortableF32Wide => "portable-wide",
            Kernel::Avx512F32 => "avx512f",
            Kernel::PortableAmx => "portable-amx",
            Kernel::AmxBf16 => "amx-bf16",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            Kernel::PortableF32
            | Kernel::PortableBf16Pairs
            | Kernel::PortableF32Wide
            | Kernel::PortableAmx => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => cpu_has!(Avx2) && cpu_has!(Fma) && cpu_has!(F16c),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => cpu_has!(Avx512f) && cpu_has!(Avx512bw) && cpu_has!(Avx512bf16),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512F32 => {
                cpu_has!(Avx512f) && cpu_has!(Avx2) && cpu_has!(Fma) && cpu_has!(F16c)
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::AmxBf16 => x86::amx_usable(),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2Fma | Kernel::Avx512Bf16 | Kernel::Avx512F32 | Kernel::AmxBf16 => false,
        }
    }

    /// Whether the kernel's packed format holds operands of these dtypes.
    pub fn accepts(self, a: DType, b: DType) -> bool {
        let half_or_f32 = |d| matches!(d, DType::F32 | DType::F16 | DType::BF16);
        match self {
            Kernel::PortableF32 | Kernel::Avx2Fma | Kernel::PortableF32Wide | Kernel::Avx512F32 => {
                half_or_f32(a) && half_or_f32(b)
            }
            Kernel::PortableBf16Pairs
            | Kernel::Avx512Bf16
            | Kernel::PortableAmx
            | Kernel::AmxBf16 => a == DType::BF16 && b == DType::BF16,
        }
    }

    /// The most k indices one block of this kernel sums (its `Micro::KC`; each x86 kernel
    /// blocks as its portable twin does).
    fn k_block(self) -> usize {
        match self {
            Kernel::PortableF32 | Kernel::Avx2Fma => PortableF32::KC,
            Kernel::PortableBf16Pairs | Kernel::Avx512Bf16 => PortablePairs::<8>::KC,
            Kernel::PortableF32Wide | Kernel::Avx512F32 => PortableF32Wide::KC,
            Kernel::PortableAmx | Kernel::AmxBf16 => PortableAmx::KC,
        }
    }

    /// (MR, NR): the tile of C one microkernel call computes in a product with `m` rows.
    fn tile_shape(self, m: usize) -> (usize, usize) {
        match self {
            Kernel::PortableF32 | Kernel::Avx2Fma => (6, 16),
            Kernel::PortableBf16Pairs | Kernel::Avx512Bf16 => (pair_rows(m), 32),
            Kernel::PortableF32Wide | Kernel::Avx512F32 => (WIDE_MR, WIDE_NR),
            Kernel::PortableAmx | Kernel::AmxBf16 => (AMX_MR, AMX_NR),
        }
    }
}

/// Rows of the BF16-pair tile for a product with `m` rows: 8 where that pads `m` less than
/// 14 does (so the channel counts of convolutions, 16–512: with 14 rows, 16 of them ran as
/// 28, 32 as 42, and each product's last row of tiles went through the edge buffer), else 14
/// (more accumulators per B load). The tile height changes no bit of the result: every
/// element sums its k steps in order either way.
fn pair_rows(m: usize) -> usize {
    if m.next_multiple_of(8) < m.next_multiple_of(14) {
        8
    } else {
        14
    }
}

/// The kernel `force_kernel` set, as its index in `Kernel::ALL` (`NONE_FORCED`: none).
static FORCED: AtomicUsize = AtomicUsize::new(NONE_FORCED);
const NONE_FORCED: usize = usize::MAX;

/// Makes `gemm` run `kernel` for every product in the process whose dtypes it takes (others
/// keep the automatic choice), or restores the automatic choice (`None`). An F32-panel
/// kernel also takes every F32 × F32 product of `cpu::gemm::product` (see `f32_kernel`). For
/// tests and benchmarks that hold the callers of `gemm` (convolution, matmul) to one kernel:
/// e.g. the BF16-pair packing of the `avx512bf16` kernel through `portable-bf16-pairs`, or
/// the 8×32 F32 packing of `avx512f` through `portable-wide`, on CPUs without AVX-512.
/// Panics if this CPU cannot run `kernel`.
///
/// The setting is global, not scoped: every thread's products switch at once, so results
/// computed while another thread changes it may mix kernels (each kernel sums in its own
/// order). Callers that set it serialise among themselves (`tests/gemm_kernels.rs` holds a
/// lock) and set it back to `None`.
pub fn force_kernel(kernel: Option<Kernel>) {
    let index = kernel.map_or(NONE_FORCED, |k| {
        assert!(
            k.is_available(),
            "gemm_half: this CPU cannot run {}",
            k.name()
        );
        Kernel::ALL.iter().position(|&x| x == k).expect("listed")
    });
    FORCED.store(index, Ordering::Relaxed);
}

/// How BF16 × BF16 products run on a CPU with AVX-512 BF16 and no usable AMX.
///
/// `vdpbf16ps` does twice the work of an F32 FMA per instruction, but not every CPU issues it
/// as often. One core of each, independent chains (`bench/RESULTS.md`, "BF16 products on
/// Intel"): Zen 5 runs 8.6 G `vdpbf16ps`/s, as many as F32 FMAs, so pairs are twice as fast;
/// an Intel Xeon (Emerald Rapids, AMX not exposed) runs 1.28 G/s against 5.29 G F32 FMAs/s,
/// so widening BF16 to F32 while packing and multiplying with F32 FMAs is 1.75× faster
/// (matmul 80 → 140 GFLOP/s, ResNet-20 amp-bf16 1.18×, BERT amp-bf16 1.47×). The widened
/// products are exact in F32 and summed in F32, as `vdpbf16ps` sums them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Route {
    /// `vdpbf16ps` on BF16 pairs (`avx512bf16`): AMD's Zen 4 and Zen 5.
    Pairs,
    /// BF16 widened to F32 in packing, F32 FMA kernels (`avx512f`, `avx2-fma`): Intel's
    /// AVX-512 BF16 cores (whose AMX, where usable, goes first anyway).
    Widen,
}

impl Bf16Route {
    /// The route `setting` names: `pairs` or `f32`; an error names a setting that is
    /// neither.
    pub fn parse(setting: &str) -> Result<Self, String> {
        match setting.trim() {
            "pairs" => Ok(Bf16Route::Pairs),
            "f32" | "widen" => Ok(Bf16Route::Widen),
            other => Err(format!(
                "BF16 route {other:?} is neither \"pairs\" (vdpbf16ps) nor \"f32\" (widen to F32)"
            )),
        }
    }

    /// `"pairs"` or `"f32"`.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Route::Pairs => "pairs",
            Bf16Route::Widen => "f32",
        }
    }

    /// The route for a CPU of this vendor (`intel`), unless `chosen`.
    pub fn choose(chosen: Option<Bf16Route>, intel: bool) -> Self {
        chosen.unwrap_or(if intel {
            Bf16Route::Widen
        } else {
            Bf16Route::Pairs
        })
    }

    /// This process's route: the CPU configuration's (`cpu::features`, which
    /// `HEMI_BF16_GEMM` overrides), else the vendor's.
    pub fn current() -> Self {
        static INTEL: OnceLock<bool> = OnceLock::new();
        Self::choose(
            crate::cpu::features::current().bf16_route,
            *INTEL.get_or_init(cpu_is_intel),
        )
    }
}

/// Whether CPUID's vendor string is `GenuineIntel`.
fn cpu_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0);
        // "Genu" "ineI" "ntel" in EBX, EDX, ECX.
        r.ebx == 0x756e_6547 && r.edx == 0x4965_6e69 && r.ecx == 0x6c65_746e
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The kernel `gemm` runs for operands of these dtypes on this CPU: the one `force_kernel`
/// set where it takes them, else for BF16×BF16 `amx-bf16` where the process may use AMX,
/// then `avx512bf16` where the CPU has it and `Bf16Route::current` is `Pairs`; else
/// `avx2-fma` where it has AVX2 and FMA (which `kernel_for` widens to `avx512f`), else
/// `portable`.
pub fn select_kernel(a: DType, b: DType) -> Kernel {
    if let Some(&k) = Kernel::ALL.get(FORCED.load(Ordering::Relaxed)) {
        if k.accepts(a, b) {
            return k;
        }
    }
    if a == DType::BF16 && b == DType::BF16 && Kernel::AmxBf16.is_available() {
        Kernel::AmxBf16
    } else if a == DType::BF16
        && b == DType::BF16
        && Kernel::Avx512Bf16.is_available()
        && Bf16Route::current() == Bf16Route::Pairs
    {
        Kernel::Avx512Bf16
    } else if Kernel::Avx2Fma.is_available() {
        Kernel::Avx2Fma
    } else {
        Kernel::PortableF32
    }
}

/// The kernel an F32 × F32 product `m×k · k×n` runs on in hemi's GEMM, or `None` where the
/// `gemm` crate runs it (`cpu::gemm::product` asks): the one `force_kernel` set where it takes
/// F32, else `avx512f` where the CPU has it and the shape suits its 8×32 tiles (below).
///
/// The `gemm` crate reaches AVX-512 only when built with nightly Rust, so on stable it
/// multiplies F32 at AVX2 width even on AVX-512 CPUs, and `avx512f` runs 1.3–2.7× faster
/// on square and convolution products (one Zen 5 core). It loses where its tiles are mostly
/// padding or the product is too small to amortise the packing: matrix-vector products
/// (2–30× slower), n = 10 (a classifier) or 16 (0.5–0.6×), 16×256×48 (0.8×), 32³ (0.7×).
/// So it takes products of at least 64³ multiply-adds whose tiles are at least 70% useful.
pub fn f32_kernel(m: usize, k: usize, n: usize) -> Option<Kernel> {
    if let Some(&kernel) = Kernel::ALL.get(FORCED.load(Ordering::Relaxed)) {
        if kernel.accepts(DType::F32, DType::F32) {
            return Some(kernel);
        }
    }
    (wide_suits(m, k, n) && Kernel::Avx512F32.is_available()).then_some(Kernel::Avx512F32)
}

/// Whether an `m×k · k×n` product suits `avx512f`'s 8×32 tiles: at least 64³ multiply-adds
/// and tiles at least 70% useful (the measurements in `f32_kernel`'s doc).
fn wide_suits(m: usize, k: usize, n: usize) -> bool {
    let padded = m.next_multiple_of(WIDE_MR) * n.next_multiple_of(WIDE_NR);
    (m * n).saturating_mul(k) >= 64 * 64 * 64 && 10 * m * n >= 7 * padded
}

/// The kernel `gemm` runs for this product: `select_kernel`'s, except that products with an
/// F16 or F32 operand that would run on `avx2-fma` run on `avx512f` where the CPU has it and
/// the shape suits its tiles (same panels, twice the width), unless `force_kernel` chose.
pub fn kernel_for(a: DType, b: DType, m: usize, k: usize, n: usize) -> Kernel {
    let forced = Kernel::ALL
        .get(FORCED.load(Ordering::Relaxed))
        .is_some_and(|k| k.accepts(a, b));
    match select_kernel(a, b) {
        Kernel::Avx2Fma if !forced && wide_suits(m, k, n) && Kernel::Avx512F32.is_available() => {
            Kernel::Avx512F32
        }
        kernel => kernel,
    }
}

/// Name of the microkernel `gemm` would run for these operand dtypes (for benches and logs).
pub fn kernel_name(a: DType, b: DType) -> &'static str {
    select_kernel(a, b).name()
}

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

/// Splits the product among threads (or not) and runs its tasks.
fn run_job<A: WithDType, B: WithDType>(
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
    tasks
        .into_par_iter()
        .for_each(|(rows, cols)| run_task(kernel, job, rows, cols));
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
struct Job<'a, A, B> {
    a: Lhs<'a, A>,
    b: Rhs<'a, B>,
    c: DstPtr,
    ldc: usize,
    k: usize,
    accumulate: bool,
    /// `gemm_round`: each tile rounded into this F16/BF16 output instead of written to `c`.
    round: Option<Rounded<'a>>,
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
enum Lhs<'a, A> {
    Mat(MatRef<'a, A>),
    Packed(&'a PackedA),
}

impl<A: WithDType> Lhs<'_, A> {
    fn rows(&self) -> usize {
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

/// A left operand packed once for one kernel, for products that share it: a convolution's
/// weights, multiplied with the column matrix of every image of the batch. Packing A is part
/// of every product (`gemm_with` packs it per task); for ResNet-20's 64-channel layers,
/// 64×576 weights times an 8×8 image, it was a tenth of the convolution. The panels are the
/// kernel's own, so `gemm_packed` gives the bits of `gemm_with` on the matrix.
pub struct PackedA {
    kernel: Kernel,
    dtype: DType,
    rows: usize,
    cols: usize,
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
    fn panels<P: Packed>(&self, block: usize, first: usize, count: usize, len: usize) -> &[P] {
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

/// The length of `run_tile`'s k blocks for inner dimension `k`: equal blocks, so that none is
/// a sliver (k = 600 gives blocks of 304 and 296).
fn k_block_len<M: Micro>(k: usize) -> usize {
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
trait Micro {
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
fn run_tile<M: Micro, A: WithDType, B: WithDType>(
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

/// `M::pack_b` of the column matrix `u`: its F32 panels, `M::NR` wide, filled by `unfold`.
#[inline(always)]
fn pack_b_unfold<M: Micro, B: WithDType>(
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
fn pack_b_pairs<M: Micro>(
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

/// Packed steps of a panel holding `kc` k indices.
#[inline(always)]
fn packed_steps<M: Micro>(kc: usize) -> usize {
    kc.div_ceil(M::KSTEP).next_multiple_of(M::STEP_ALIGN)
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
fn pack_f32<const W: usize, T: WithDType>(
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
fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// BF16 pairs: panel t holds rows `i0 + t*W ..` of `x`; with i = i0 + t*W + r,
/// `panel[q * W + r] = bits x(i, p0 + 2q) | bits x(i, p0 + 2q + 1) << 16` for q < ceil(kc / 2),
/// the high half zero past kc, rows past `h` zero, and the steps padded with zeros to a
/// multiple of ALIGN. This is the layout `vdpbf16ps` reads: lane j of a register holds the
/// even k index in its low 16 bits; and, with W = 32, two AMX B tiles side by side (16 rows
/// of 16 columns × a pair, 128 bytes apart).
#[inline(always)]
fn pack_pairs<const W: usize, const ALIGN: usize, const SIMD: bool, T: WithDType>(
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
fn pack_amx_a<T: WithDType>(
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
struct Workspace {
    a: Vec<Line>,
    b: Vec<Line>,
}

impl Workspace {
    fn buffers<P: Packed>(&mut self, a_len: usize, b_len: usize) -> (&mut [P], &mut [P]) {
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
fn with_workspace<R>(f: impl FnOnce(&mut Workspace) -> R) -> R {
    WORKSPACE.with(|ws| match ws.try_borrow_mut() {
        Ok(mut ws) => f(&mut ws),
        Err(_) => f(&mut Workspace::default()),
    })
}

// ---------------------------------------------------------------------------------------------
// Portable kernels (any CPU; the reference for the SIMD ones on the same panels)

/// Blocking of the F32-panel kernels, for Zen 3 (32 KiB L1d, 512 KiB L2 per core): the B
/// micro-panel is 512 × 16 F32 = 32 KiB (measured faster than 256, as the gemm crate's KC >=
/// 512), an A block 144 × 512 F32 = 288 KiB.
struct PortableF32;

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
struct PortableF32Wide;

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
struct PortablePairs<const MR: usize>;

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
struct PortableAmx;

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

// ---------------------------------------------------------------------------------------------
// x86-64 kernels selected at run time

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{pack_amx_a, pack_f32, pack_pairs, run_tile, Job, Micro, Workspace};
    use super::{AMX_KC, AMX_MC, AMX_MR, AMX_NC, AMX_NR};
    use super::{WIDE_KC, WIDE_MC, WIDE_MR, WIDE_NC, WIDE_NR};
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
        if super::pair_rows(job.a.rows()) == 8 {
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
            *o = super::bf16_bits_to_f32(h.to_bits());
        }
    }

    /// Blocking as `PortableF32`.
    struct Avx2Fma;

    const _: () = assert!(
        Avx2Fma::KC == super::PortableF32::KC
            && Avx512Bf16::<8>::KC == super::PortablePairs::<8>::KC
            && Avx512Bf16::<14>::KC == super::PortablePairs::<8>::KC
            && Avx512F32::KC == super::PortableF32Wide::KC
            && AmxBf16::KC == super::PortableAmx::KC
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
}
