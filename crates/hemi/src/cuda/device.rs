//! Probing for CUDA before touching it.
//!
//! cudarc loads every CUDA library lazily with `dlopen` and *panics* on the first call if the
//! library is missing. hemi must return an error instead, so before any cudarc call this
//! module opens the same libraries itself (with `libloading`, under exactly the names cudarc
//! searches, taken from `cudarc::get_lib_name_candidates`) and turns a failure into an
//! [`Error::Device`] that names the library, the names tried, and what to install.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// One CUDA shared library that hemi's backend loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaLib {
    /// The stems cudarc searches, in its order (`cuda` -> `libcuda.so`, `libcuda.so.1`, ...).
    pub stems: &'static [&'static str],
    /// What it is, for messages.
    pub what: &'static str,
    /// What to install to get it.
    pub install: &'static str,
}

/// The CUDA driver API (`libcuda.so.1`); comes with the NVIDIA kernel driver, not the toolkit.
pub const DRIVER: CudaLib = CudaLib {
    stems: &["cuda", "nvcuda"],
    what: "the CUDA driver library",
    install: "install the NVIDIA GPU driver (it provides libcuda.so.1); inside a container, \
              run it with the GPU exposed (e.g. docker --gpus all)",
};

/// cuBLAS (`libcublas.so.13`): GEMM.
pub const CUBLAS: CudaLib = CudaLib {
    stems: &["cublas"],
    what: "cuBLAS",
    install: "install the CUDA 13 toolkit or the pip wheel nvidia-cublas",
};

/// cuBLASLt (`libcublasLt.so.13`): loaded by cuBLAS itself, and by the epilogue GEMMs.
pub const CUBLASLT: CudaLib = CudaLib {
    stems: &["cublasLt"],
    what: "cuBLASLt",
    install: "install the CUDA 13 toolkit or the pip wheel nvidia-cublas",
};

/// NVRTC (`libnvrtc.so.13`): compiles the generated kernels at run time.
pub const NVRTC: CudaLib = CudaLib {
    stems: &["nvrtc"],
    what: "NVRTC (the CUDA runtime compiler)",
    install: "install the CUDA 13 toolkit or the pip wheel nvidia-cuda-nvrtc",
};

/// Every library a [`super::CudaDevice`] needs, in the order they are checked.
pub const REQUIRED: [CudaLib; 4] = [DRIVER, CUBLAS, CUBLASLT, NVRTC];

impl CudaLib {
    /// The file names tried, exactly those cudarc's loader tries.
    pub fn candidates(&self) -> Vec<String> {
        // cudarc's list repeats some names; trying one twice tells nothing new.
        let mut names: Vec<String> = Vec::new();
        for n in self
            .stems
            .iter()
            .flat_map(|s| cudarc::get_lib_name_candidates(s))
        {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        names
    }

    /// Tries `load` on each candidate name; the name that loaded, or the error that says
    /// which library is missing, the names tried, the last loader error, and the fix.
    pub fn probe_with(
        &self,
        mut load: impl FnMut(&str) -> std::result::Result<(), String>,
    ) -> Result<String> {
        let names = self.candidates();
        let mut last = String::from("no candidate names");
        // A library that exists but fails to load (wrong version, missing dependency) says
        // more than "not found": report the first such failure if there is one.
        let mut broken: Option<String> = None;
        for name in &names {
            match load(name) {
                Ok(()) => return Ok(name.clone()),
                Err(e) => {
                    if broken.is_none()
                        && !e.contains("No such file")
                        && !e.contains("cannot open shared object")
                    {
                        broken = Some(e.clone());
                    }
                    last = e;
                }
            }
        }
        let last = match broken {
            Some(b) => format!("a candidate exists but failed to load: {b}"),
            None => last,
        };
        Err(Error::device(
            "cuda",
            format!(
                "could not load {what}: none of {names:?} was found (last loader error: {last}). \
                 To fix: {install}; if it is installed, add the directory that holds it to \
                 LD_LIBRARY_PATH",
                what = self.what,
                install = self.install,
            ),
        ))
    }

    /// Probes with the real dynamic loader (`dlopen`); the result is cached per library.
    pub fn probe(&self) -> Result<String> {
        static CACHE: [OnceLock<std::result::Result<String, String>>; 4] = [
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
        ];
        let load = |name: &str| {
            // SAFETY: loading a CUDA library runs its initialisers, which is what cudarc does
            // next anyway; the handle is closed again at once (cudarc keeps its own).
            unsafe { libloading::Library::new(name) }
                .map(drop)
                .map_err(|e| match std::error::Error::source(&e) {
                    Some(why) => format!("{e}: {why}"),
                    None => e.to_string(),
                })
        };
        match REQUIRED.iter().position(|l| l == self) {
            Some(i) => CACHE[i]
                .get_or_init(|| self.probe_with(load).map_err(|e| e.to_string()))
                .clone()
                .map_err(|msg| Error::device("cuda", strip_prefix(&msg))),
            None => self.probe_with(load),
        }
    }
}

/// An `Error::Device` string is "cuda: device error: MSG"; rebuilding the error from a cached
/// string must not repeat the prefix.
fn strip_prefix(msg: &str) -> String {
    msg.strip_prefix("cuda: device error: ")
        .unwrap_or(msg)
        .to_string()
}

/// Checks every library in `libs`, in order; the first missing one is the error.
pub fn probe_all(libs: &[CudaLib]) -> Result<()> {
    for lib in libs {
        lib.probe()?;
    }
    Ok(())
}

/// The number of CUDA devices; 0 when the driver is present but sees no GPU. An error when
/// the driver library cannot be loaded or fails to initialise.
pub fn device_count() -> Result<usize> {
    DRIVER.probe()?;
    use cudarc::driver::sys::cudaError_enum as E;
    match cudarc::driver::result::init() {
        Ok(()) => {}
        Err(e) if e.0 == E::CUDA_ERROR_NO_DEVICE => return Ok(0),
        Err(e) => return Err(Error::device("cuda", format!("cuInit failed: {e:?}"))),
    }
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::device("cuda", format!("cuDeviceGetCount failed: {e:?}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// True when at least one CUDA device can be used (driver loads, initialises, sees a GPU).
pub fn cuda_available() -> bool {
    matches!(device_count(), Ok(n) if n > 0)
}

/// Errors unless `ordinal` names one of `count` devices; the message gives both.
pub fn check_ordinal(ordinal: usize, count: usize) -> Result<()> {
    if ordinal < count {
        return Ok(());
    }
    let valid = match count {
        0 => "there is none".to_string(),
        1 => "the only one is cuda:0".to_string(),
        n => format!("valid ordinals are cuda:0 to cuda:{}", n - 1),
    };
    Err(Error::device(
        "cuda",
        format!("device cuda:{ordinal} requested, but {count} CUDA device(s) found ({valid})"),
    ))
}

/// Everything a context on device `ordinal` needs, checked in order: the libraries, then
/// that the ordinal exists.
pub fn check_device(ordinal: usize) -> Result<()> {
    probe_all(&REQUIRED)?;
    check_ordinal(ordinal, device_count()?)
}
