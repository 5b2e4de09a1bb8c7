//! Indexing primitives: gathers of whole rows along a dim (embedding lookups,
//! `index_select`), their scatter-add backward, and concatenation.

use super::declare::primitives;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Layout, Storage};

/// A tensor seen as `[outer, size, inner]` around the indexed dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlongDim {
    /// Product of the dims before the indexed one.
    pub outer: usize,
    /// Size of the indexed dim (ids must lie in `0..size`).
    pub size: usize,
    /// Product of the dims after the indexed one: the length of each copied row.
    pub inner: usize,
}

primitives! {
    /// The indexing primitives a backend implements: row gathers along a dim (`index_select`,
    /// embedding lookups), their scatter-add backward and concatenation. `Storage` has a
    /// dispatching method of the same name for each.
    pub trait IndexOps {
        /// `out[o, j, :] = self[o, ids[j], :]` (self read through `l` as `[outer, size, inner]`,
        /// `ids` an I64 buffer read through `lids`, every id in `0..size` — the caller checked),
        /// copied exactly in the storage dtype; `outer * ids.len() * inner` elements.
        fn index_select(&self, l: &Layout, ids: &Self, lids: &Layout, d: AlongDim) -> Result<Self>;

        /// The backward of `index_select`: zeros of `[outer, size, inner]` with each
        /// `self[o, j, :]` (the output gradient, read through `l`) added into row `ids[j]`, in
        /// the compute type of `out` (F32 for half dtypes, so repeated ids accumulate in F32),
        /// rounded once into `out`.
        fn index_add_zeros(
            &self,
            l: &Layout,
            ids: &Self,
            lids: &Layout,
            d: AlongDim,
            out: DType,
        ) -> Result<Self>;

        /// Concatenation of `parts` (each of this buffer's dtype, read through its layout as
        /// `[outer, lens[i], inner]`) along the middle dim.
        fn cat(parts: &[(&Self, &Layout)], outer: usize, lens: &[usize], inner: usize) -> Result<Self>;
    }
}

impl Storage {
    /// `IndexOps::cat` over storages of one dtype on one device.
    pub fn cat(
        parts: &[(&Storage, &Layout)],
        outer: usize,
        lens: &[usize],
        inner: usize,
    ) -> Result<Storage> {
        let Some((first, _)) = parts.first() else {
            return Err(Error::arg("cat", "needs at least one tensor"));
        };
        if let Some((other, _)) = parts.iter().find(|(s, _)| s.device() != first.device()) {
            return Err(Error::device(
                "cat",
                format!("inputs on {} and {}", first.device(), other.device()),
            ));
        }
        #[allow(unreachable_patterns)]
        match first {
            Storage::Cpu(_) => {
                let cpu: Vec<_> = parts
                    .iter()
                    .map(|(s, l)| match s {
                        Storage::Cpu(c) => (c, *l),
                        _ => unreachable!("devices checked above"),
                    })
                    .collect();
                Ok(Storage::Cpu(crate::cpu::storage::CpuStorage::cat(
                    &cpu, outer, lens, inner,
                )?))
            }
            #[cfg(feature = "gpu")]
            Storage::Gpu(_) => {
                let gpu: Vec<_> = parts
                    .iter()
                    .map(|(s, l)| match s {
                        Storage::Gpu(g) => (g, *l),
                        _ => unreachable!("devices checked above"),
                    })
                    .collect();
                Ok(Storage::Gpu(crate::gpu::GpuStorage::cat(
                    &gpu, outer, lens, inner,
                )?))
            }
        }
    }
}
