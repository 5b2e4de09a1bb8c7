//! The CPU backend's primitives: every `impl *Ops for CpuStorage` block, one file per area
//! of `backend/` (`map`, `reduce`, `loss`, `nn`, `index`, `train`), and `BackendStorage`
//! here. A primitive reads its inputs through their layouts (borrowed where contiguous in
//! the type a kernel takes), picks the kernel by dtype, and stores the result in the dtype
//! asked for; the loops are the kernel families' (`cpu::elementwise`, `cpu::reduce`,
//! `cpu::gemm`, `cpu::conv`, `cpu::norm`, `cpu::pool`, `cpu::attention`, `cpu::index`).

mod index;
mod loss;
mod map;
mod nn;
mod reduce;
mod train;

use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Layout;

/// The CPU backend implements every primitive (a compile-time check).
const _: fn() = || {
    fn is_backend<B: crate::backend::Backend>() {}
    is_backend::<CpuStorage>();
};

impl BackendStorage for CpuStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }
    fn len(&self) -> usize {
        CpuStorage::len(self)
    }
    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        Ok(self.gather(layout))
    }
    fn cast(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        Ok(CpuStorage::cast(self, layout, dtype))
    }
    fn download(&self, layout: &Layout) -> Result<CpuStorage> {
        Ok(self.gather(layout))
    }
    fn upload(&self, host: &CpuStorage) -> Result<Self> {
        Ok(host.clone())
    }
}
