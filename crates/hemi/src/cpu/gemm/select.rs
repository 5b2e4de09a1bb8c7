//! Which kernel of hemi's blocked GEMM runs a product: the kernels and their formats
//! (`Kernel`), the one a test or benchmark forces (`force_kernel`), the BF16 route
//! (`Bf16Route`), and the choice by dtypes and shape (`select_kernel`, `kernel_for`,
//! `f32_kernel`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::blocked::Micro;
use super::blocked::{AMX_MR, AMX_NR, WIDE_MR, WIDE_NR};
use super::portable::{PortableAmx, PortableF32, PortableF32Wide, PortablePairs};
#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::DType;

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
    /// the bit only where every partial sum is exact (`tests/kernels/gemm_kernels.rs`), and each is
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
    pub(super) fn k_block(self) -> usize {
        match self {
            Kernel::PortableF32 | Kernel::Avx2Fma => PortableF32::KC,
            Kernel::PortableBf16Pairs | Kernel::Avx512Bf16 => PortablePairs::<8>::KC,
            Kernel::PortableF32Wide | Kernel::Avx512F32 => PortableF32Wide::KC,
            Kernel::PortableAmx | Kernel::AmxBf16 => PortableAmx::KC,
        }
    }

    /// (MR, NR): the tile of C one microkernel call computes in a product with `m` rows.
    pub(super) fn tile_shape(self, m: usize) -> (usize, usize) {
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
pub(super) fn pair_rows(m: usize) -> usize {
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
/// order). Callers that set it hold every other product off meanwhile (the tests that force
/// a kernel run each in a process of its own: `tests/kernels/gemm_kernels.rs`) and set it
/// back to `None`.
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
