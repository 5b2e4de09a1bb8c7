//! What this CPU has, and what hemi may use of it: the one place that asks the CPU for its
//! instruction sets, and the explicit CPU configuration every kernel choice goes through.
//!
//! Kernels never call `is_x86_feature_detected!` themselves: they ask [`has`], which is the
//! CPU's answer capped by the configuration. The configuration is library state set by
//! [`configure`] (the CLI sets it from `--cpu-level`, `--amx` and `--bf16-route`) before the
//! first kernel runs; it changes which kernel runs and so the bits of some results (each
//! kernel sums in its own order, every one within the dtype's bound of an f64 reference).
//! Environment variables only override it, documented in the README:
//!
//! | variable | overrides | values |
//! |---|---|---|
//! | `HEMI_CPU_LEVEL` | `level` | `native`, `avx512`, `avx2`, `portable` |
//! | `HEMI_NO_AMX` (set) | `amx` | AMX off |
//! | `HEMI_BF16_GEMM` | `bf16_route` | `pairs` (`vdpbf16ps`), `f32` (widen to F32) |
//!
//! Capping at a level is how one machine measures another's kernels: on an AVX-512 CPU,
//! `--cpu-level avx2` runs exactly the kernels an AVX2 + FMA + F16C CPU (Zen 3, most
//! laptops) runs, and `portable` the plain-Rust twins of them all.

use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};

/// The instruction sets hemi's kernels ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    /// AVX (256-bit float).
    Avx,
    /// AVX2 (256-bit integer).
    Avx2,
    /// FMA3.
    Fma,
    /// F16C (8 F16 ↔ F32 conversions an instruction).
    F16c,
    /// AVX-VNNI (256-bit `vpdpbusd`).
    AvxVnni,
    /// AVX-512 Foundation.
    Avx512f,
    /// AVX-512 byte and word.
    Avx512bw,
    /// AVX-512 doubleword and quadword.
    Avx512dq,
    /// AVX-512 vector length (128/256-bit forms).
    Avx512vl,
    /// AVX-512 BF16 (`vdpbf16ps`, `vcvtneps2bf16`).
    Avx512bf16,
    /// AVX-512 VNNI.
    Avx512vnni,
}

impl Feature {
    /// The lowest [`CpuLevel`] that may use this feature.
    #[doc(hidden)]
    pub fn level(self) -> CpuLevel {
        match self {
            Feature::Avx | Feature::Avx2 | Feature::Fma | Feature::F16c | Feature::AvxVnni => {
                CpuLevel::Avx2
            }
            Feature::Avx512f
            | Feature::Avx512bw
            | Feature::Avx512dq
            | Feature::Avx512vl
            | Feature::Avx512bf16
            | Feature::Avx512vnni => CpuLevel::Avx512,
        }
    }

    /// Whether the CPU (and the OS) support it, whatever the configuration.
    pub fn detected(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as d;
            match self {
                Feature::Avx => d!("avx"),
                Feature::Avx2 => d!("avx2"),
                Feature::Fma => d!("fma"),
                Feature::F16c => d!("f16c"),
                Feature::AvxVnni => d!("avxvnni"),
                Feature::Avx512f => d!("avx512f"),
                Feature::Avx512bw => d!("avx512bw"),
                Feature::Avx512dq => d!("avx512dq"),
                Feature::Avx512vl => d!("avx512vl"),
                Feature::Avx512bf16 => d!("avx512bf16"),
                Feature::Avx512vnni => d!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// The most hemi's kernels may use of the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuLevel {
    /// The plain-Rust twins only (no SIMD kernel, no AMX).
    Portable,
    /// AVX2 + FMA + F16C (and AVX-VNNI): what most laptops, desktops and older servers
    /// have (Zen 3, Haswell to Alder Lake). No AVX-512, no AMX.
    Avx2,
    /// Also AVX-512 (F, BW, DQ, VL, BF16, VNNI); no AMX.
    Avx512,
    /// Everything the CPU has, AMX included (the default).
    Native,
}

impl CpuLevel {
    /// `"portable"`, `"avx2"`, `"avx512"`, `"native"`.
    pub fn name(self) -> &'static str {
        match self {
            CpuLevel::Portable => "portable",
            CpuLevel::Avx2 => "avx2",
            CpuLevel::Avx512 => "avx512",
            CpuLevel::Native => "native",
        }
    }

    /// The level `s` names; an error lists the names.
    pub fn parse(s: &str) -> Result<CpuLevel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "portable" => Ok(CpuLevel::Portable),
            "avx2" => Ok(CpuLevel::Avx2),
            "avx512" | "avx-512" => Ok(CpuLevel::Avx512),
            "native" => Ok(CpuLevel::Native),
            other => Err(Error::arg(
                "cpu level",
                format!("{other:?}: expected native, avx512, avx2 or portable"),
            )),
        }
    }
}

/// How BF16 × BF16 products run on a CPU with AVX-512 BF16 and no usable AMX (see
/// `gemm_half::Bf16Route`): `None` takes the CPU vendor's faster route.
pub use super::gemm::select::Bf16Route;

/// The CPU configuration: which of the CPU's instruction sets hemi's kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// The highest level of kernels (default: native).
    pub level: CpuLevel,
    /// Whether AMX tiles may be used where the CPU and the OS allow them (default: yes;
    /// only at the native level).
    pub amx: bool,
    /// The BF16 product route; `None`: the vendor's (pairs on AMD, widened on Intel).
    pub bf16_route: Option<Bf16Route>,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            level: CpuLevel::Native,
            amx: true,
            bf16_route: None,
        }
    }
}

/// The configuration [`configure`] asked for (the default until it is called).
static REQUESTED: Mutex<Option<CpuConfig>> = Mutex::new(None);
/// The configuration in force: fixed by the first kernel's question.
static IN_FORCE: OnceLock<CpuConfig> = OnceLock::new();

fn requested() -> CpuConfig {
    REQUESTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_default()
}

/// `c` with the environment's documented overrides applied (module docs); a value that
/// names nothing is reported on stderr and ignored.
fn with_overrides(mut c: CpuConfig) -> CpuConfig {
    if let Ok(v) = std::env::var("HEMI_CPU_LEVEL") {
        match CpuLevel::parse(&v) {
            Ok(l) => c.level = l,
            Err(e) => eprintln!("hemi: HEMI_CPU_LEVEL: {e}; ignored"),
        }
    }
    if std::env::var_os("HEMI_NO_AMX").is_some() {
        c.amx = false;
    }
    if let Ok(v) = std::env::var("HEMI_BF16_GEMM") {
        match Bf16Route::parse(&v) {
            Ok(r) => c.bf16_route = Some(r),
            Err(e) => eprintln!("hemi: HEMI_BF16_GEMM: {e}; ignored"),
        }
    }
    c
}

/// Sets the CPU configuration. Call it before the first tensor op: kernels are chosen (and
/// some choices cached) on first use, so once one has run, a configuration other than the
/// one in force is an error saying so. Environment variables override it (module docs).
pub fn configure(cfg: CpuConfig) -> Result<()> {
    let mut requested = REQUESTED.lock().unwrap_or_else(|e| e.into_inner());
    let asked = requested.unwrap_or_default();
    if IN_FORCE.get().is_some() && cfg != asked {
        return Err(Error::Msg(format!(
            "the CPU configuration cannot change once a kernel has run (it is {}; asked for \
             {}): call hemi::cpu::features::configure before the first tensor op",
            describe(&asked),
            describe(&cfg)
        )));
    }
    *requested = Some(cfg);
    Ok(())
}

/// The configuration in force: [`configure`]'s, with the environment's overrides applied,
/// fixed by the first call (kernels ask before they choose).
pub fn current() -> CpuConfig {
    *IN_FORCE.get_or_init(|| with_overrides(requested()))
}

/// Whether kernels may use `f`: the CPU has it and the configuration's level allows it.
#[inline]
pub fn has(f: Feature) -> bool {
    current().level >= f.level() && f.detected()
}

/// Whether AMX may be used (the CPU's and the OS's support is checked by `cpu::amx`).
pub fn amx_allowed() -> bool {
    let c = current();
    c.level == CpuLevel::Native && c.amx
}

/// `level avx2, amx off, bf16 route f32`: the configuration in words, for logs and
/// benchmark records.
pub fn describe(c: &CpuConfig) -> String {
    format!(
        "level {}, amx {}, bf16 route {}",
        c.level.name(),
        if c.amx { "on" } else { "off" },
        c.bf16_route.map_or("auto", Bf16Route::name)
    )
}

/// The CPU's instruction sets (detected, whatever the configuration) as names, for the
/// record of a benchmark.
pub fn detected_names() -> Vec<&'static str> {
    use Feature::*;
    [
        (Avx2, "avx2"),
        (Fma, "fma"),
        (F16c, "f16c"),
        (AvxVnni, "avxvnni"),
        (Avx512f, "avx512f"),
        (Avx512bw, "avx512bw"),
        (Avx512bf16, "avx512bf16"),
        (Avx512vnni, "avx512vnni"),
    ]
    .into_iter()
    .filter(|(f, _)| f.detected())
    .map(|(_, n)| n)
    .collect()
}
