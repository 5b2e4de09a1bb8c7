//! What every Intel AMX kernel needs before its first tile instruction: whether the CPU has
//! the tile unit and the data type, whether the OS saves the tile state, Linux's permission
//! for the tile data, and the tile configuration and release. `gemm_half`'s `amx-bf16` and
//! `qgemm`'s `amx-i8` both use it.

use std::arch::x86_64::{__cpuid, __cpuid_count};
use std::sync::OnceLock;

/// An AMX data type (CPUID leaf 7, EDX bit).
#[derive(Clone, Copy, Debug)]
pub(crate) enum AmxType {
    /// `tdpbf16ps` (EDX bit 22).
    Bf16,
    /// `tdpbusd` and friends (EDX bit 25).
    Int8,
}

/// Whether this process may run AMX code on `ty`: the CPU has AMX-TILE and the type
/// (CPUID leaf 7), the OS saves the tile state (XCR0 bits 17 and 18), and Linux granted the
/// tile data to the process (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked
/// once per process; without it the first tile instruction faults), and the CPU
/// configuration allows AMX (`cpu::features::amx_allowed`: `--amx false`, `--cpu-level`
/// below native, or `HEMI_NO_AMX` turn it off, to measure the other kernels on an AMX CPU).
///
/// Answered once per type: CPUID is serialising, and in a virtual machine it traps to the
/// hypervisor (microseconds), while kernels ask this for every product (it was 5 % of a
/// ResNet-20 amp-bf16 training step on a 2-core Xeon VM).
pub(crate) fn usable(ty: AmxType) -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    static INT8: OnceLock<bool> = OnceLock::new();
    let (cell, bit) = match ty {
        AmxType::Bf16 => (&BF16, 22),
        AmxType::Int8 => (&INT8, 25),
    };
    crate::cpu::features::amx_allowed()
        && *cell.get_or_init(|| tiles_usable() && cpuid7_edx() >> bit & 1 == 1)
}

fn cpuid7_edx() -> u32 {
    // Leaf 7 exists when leaf 0 says so.
    if __cpuid(0).eax < 7 {
        0
    } else {
        __cpuid_count(7, 0).edx
    }
}

/// The tile unit, the OS's tile state and the permission, checked and asked once.
fn tiles_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| cpuid7_edx() >> 24 & 1 == 1 && os_saves_tiles() && request_tile_data())
}

fn os_saves_tiles() -> bool {
    // OSXSAVE (CPUID.1:ECX bit 27) makes XGETBV legal.
    if __cpuid(1).ecx >> 27 & 1 == 0 {
        return false;
    }
    let (lo, hi): (u32, u32);
    // SAFETY: XGETBV with ECX = 0 reads XCR0; OSXSAVE was checked above.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi,
            options(nomem, nostack, preserves_flags));
    }
    let xcr0 = (hi as u64) << 32 | lo as u64;
    xcr0 >> 17 & 3 == 3
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    const SYS_ARCH_PRCTL: usize = 158;
    let ret: isize;
    // SAFETY: the arch_prctl system call with these arguments only changes which extended
    // states this process may use; it reads and writes no user memory.
    unsafe {
        std::arch::asm!("syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile configuration (palette 1): tiles 0–7 of 16 rows × 64 bytes.
#[repr(C, align(64))]
pub(crate) struct TileConfig([u8; 64]);

impl TileConfig {
    /// Every tile 16 rows × 64 bytes.
    pub(crate) fn all_16x64() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        for t in 0..8 {
            c[16 + 2 * t] = 64; // bytes per row (colsb), little-endian u16
            c[48 + t] = 16; // rows
        }
        TileConfig(c)
    }

    /// Loads the configuration into this thread's tile unit (`ldtilecfg`) and returns the
    /// guard that releases it.
    ///
    /// # Safety
    /// [`usable`] must have returned true for the type the caller's tiles use.
    pub(crate) unsafe fn load(&self) -> TileRelease {
        // SAFETY: AMX is usable (the caller's contract); `self` is 64 aligned bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly));
        }
        TileRelease(())
    }
}

/// Releases the tile state when dropped (also when a panic unwinds through a product).
pub(crate) struct TileRelease(());

impl Drop for TileRelease {
    fn drop(&mut self) {
        // SAFETY: a TileRelease only comes from `TileConfig::load`, which configured the tiles.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}
