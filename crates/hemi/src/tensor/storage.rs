//! `Storage`: a tensor's buffer, on one backend. The enum is the backend boundary: code above
//! it (ops, autograd, nn, amp, optim, io) calls `Storage`'s methods, which dispatch to the
//! backend's implementation of `BackendStorage` (`crate::backend`); nothing above matches on
//! a backend's own buffer type.
//!
//! `Naive` is the reference backend (`crate::naive`): plain loops over f64 values, the
//! template for a new backend. `Gpu` (feature `gpu`) is the wgpu backend's buffer
//! (`crate::gpu`). A CUDA variant joins them behind the `cuda` feature once its kernels
//! implement the trait.

use std::borrow::Cow;

use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::naive::NaiveStorage;
use crate::tensor::Layout;

/// A tensor's buffer on one device.
#[derive(Clone, Debug)]
pub enum Storage {
    /// A buffer in host memory.
    Cpu(CpuStorage),
    /// A buffer of the naive reference backend (`Device::Naive`).
    Naive(NaiveStorage),
    /// A buffer on a GPU of the wgpu backend (`gpu:n`).
    #[cfg(feature = "gpu")]
    Gpu(crate::gpu::GpuStorage),
}

#[cfg(feature = "gpu")]
impl From<crate::gpu::GpuStorage> for Storage {
    fn from(s: crate::gpu::GpuStorage) -> Storage {
        Storage::Gpu(s)
    }
}

impl From<CpuStorage> for Storage {
    fn from(s: CpuStorage) -> Storage {
        Storage::Cpu(s)
    }
}

impl From<NaiveStorage> for Storage {
    fn from(s: NaiveStorage) -> Storage {
        Storage::Naive(s)
    }
}

/// Runs `$body` with `$s` bound to the backend buffer inside `$storage` (`$body` is compiled
/// once per variant, each time with `$s` of that backend's type). Name no variant in
/// `$body`: wrap a backend buffer with `wrap!`, so a new variant needs no edit at the call
/// sites.
macro_rules! dispatch {
    ($storage:expr, $s:ident => $body:expr) => {
        match $storage {
            $crate::tensor::Storage::Cpu($s) => $body,
            $crate::tensor::Storage::Naive($s) => $body,
            #[cfg(feature = "gpu")]
            $crate::tensor::Storage::Gpu($s) => $body,
        }
    };
}
pub(crate) use dispatch;

/// A backend buffer wrapped into its `Storage` variant (every backend's buffer type has a
/// `From` into `Storage`).
macro_rules! wrap {
    ($buf:expr) => {
        $crate::tensor::Storage::from($buf)
    };
}
pub(crate) use wrap;

impl Storage {
    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        dispatch!(self, s => BackendStorage::device(s))
    }

    /// The dtype of the buffer's elements.
    pub fn dtype(&self) -> DType {
        dispatch!(self, s => BackendStorage::dtype(s))
    }

    /// Number of elements in the buffer (not of a view over it).
    pub fn len(&self) -> usize {
        dispatch!(self, s => BackendStorage::len(s))
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer's size in bytes (elements × the dtype's size).
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// The elements addressed by `layout`, copied into a new contiguous buffer on the same
    /// device.
    pub fn copy_strided(&self, layout: &Layout) -> Result<Storage> {
        Ok(dispatch!(self, s => wrap!(BackendStorage::copy_strided(s, layout)?)))
    }

    /// The elements addressed by `layout` converted to `dtype` (contiguous, same device):
    /// round-to-nearest-even, overflow to ±inf, NaN kept.
    pub fn cast(&self, layout: &Layout, dtype: DType) -> Result<Storage> {
        Ok(dispatch!(self, s => wrap!(BackendStorage::cast(s, layout, dtype)?)))
    }

    /// The whole buffer as a host buffer: borrowed on the CPU, copied from other devices.
    pub fn to_cpu(&self) -> Result<Cow<'_, CpuStorage>> {
        match self {
            Storage::Cpu(s) => Ok(Cow::Borrowed(s)),
            other => dispatch!(other, s => {
                Ok(Cow::Owned(s.download(&Layout::contiguous(&[s.len()]))?))
            }),
        }
    }

    /// The buffer as a host buffer, taken without a copy on the CPU.
    pub fn into_cpu(self) -> Result<CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            other => Ok(other.to_cpu()?.into_owned()),
        }
    }

    /// A CPU buffer of `dtype` from little-endian bytes (a file's tensor data); `None`
    /// unless the byte count is a multiple of the element size.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<Storage> {
        CpuStorage::from_le_bytes(dtype, bytes).map(Storage::Cpu)
    }

    /// The whole buffer's little-endian bytes (read back to the host first).
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        Ok(self.to_cpu()?.to_le_bytes())
    }

    /// A buffer holding the same elements on `device`.
    pub fn to_device(&self, device: Device) -> Result<Storage> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let host = self.to_cpu()?;
        match device {
            Device::Cpu => Ok(Storage::Cpu(host.into_owned())),
            Device::Naive => Ok(Storage::Naive(
                NaiveStorage::empty(host.dtype()).upload(&host)?,
            )),
            #[cfg(feature = "gpu")]
            Device::Gpu(n) => Ok(Storage::Gpu(crate::gpu::GpuStorage::from_host(n, &host)?)),
            #[cfg(not(feature = "gpu"))]
            Device::Gpu(_) => Err(crate::error::Error::device(
                "to_device",
                format!(
                    "cannot place a tensor on {device}: hemi was built without the `gpu` \
                     feature (rebuild with `--features gpu`)"
                ),
            )),
            Device::Cuda(_) => Err(crate::error::Error::device(
                "to_device",
                if cfg!(feature = "cuda") {
                    format!(
                        "cannot place a tensor on {device}: the CUDA backend of this build \
                         (`--features cuda`) is not yet wired into tensors (DEVELOPERS.md)"
                    )
                } else {
                    format!(
                        "cannot place a tensor on {device}: hemi was built without the `cuda` \
                         feature (rebuild with `--features cuda`)"
                    )
                },
            )),
        }
    }
}
