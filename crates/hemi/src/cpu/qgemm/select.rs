//! Which INT8 kernel runs a product: the kernels (`QKernel`), the best one this CPU runs
//! (`QKernel::best`), and the layout each packs its weights in.

use super::pack::{AmxTiles, I16Pairs, Shape, Vnni256, Vnni512};
#[cfg(target_arch = "x86_64")]
use super::x86;
use super::AMX_MIN_M;

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
    pub(super) fn shape(self) -> Option<Shape> {
        match self {
            QKernel::Portable => None,
            QKernel::PortableVnni512 | QKernel::Avx512Vnni => Some(Shape::of::<Vnni512>()),
            QKernel::PortableVnni256 | QKernel::AvxVnni => Some(Shape::of::<Vnni256>()),
            QKernel::PortableI16Pairs | QKernel::Avx2I16 => Some(Shape::of::<I16Pairs>()),
            QKernel::PortableAmx | QKernel::AmxInt8 => Some(Shape::of::<AmxTiles>()),
        }
    }

    /// The kernel that runs an m-row product on weights packed for `self`.
    pub(super) fn for_rows(self, m: usize) -> QKernel {
        match self {
            QKernel::AmxInt8 if m <= AMX_MIN_M => QKernel::Avx512Vnni,
            QKernel::PortableAmx if m <= AMX_MIN_M => QKernel::PortableVnni512,
            k => k,
        }
    }
}
