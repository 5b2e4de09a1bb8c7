//! `IndexOps` on the CPU: the indices and inputs read through their layouts, the gathers of
//! `cpu::index`.

use std::borrow::Cow;

use crate::backend::index::{AlongDim, IndexOps};
use crate::cpu::index::{cat_rows, gather_rows, scatter_add_rows};
use crate::cpu::storage::CpuStorage;
use crate::dtype::{DType, WithDType};
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// The elements `layout` addresses in `s` as `[T]`, row-major (borrowed when contiguous:
/// an embedding table is not copied per lookup), or an error naming `op`.
fn elems<'a, T: WithDType>(
    op: &'static str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<Cow<'a, [T]>> {
    s.elems(l)
        .ok_or_else(|| Error::dtype(op, s.dtype(), format!("expected {}", T::DTYPE)))
}

/// Indices as `usize` (the caller checked they are in range and non-negative).
fn ids_usize(op: &'static str, ids: &CpuStorage, l: &Layout) -> Result<Vec<usize>> {
    Ok(elems::<i64>(op, ids, l)?
        .iter()
        .map(|&i| i as usize)
        .collect())
}

impl IndexOps for CpuStorage {
    fn index_select(&self, l: &Layout, ids: &Self, lids: &Layout, d: AlongDim) -> Result<Self> {
        const OP: &str = "index_select";
        let idx = ids_usize(OP, ids, lids)?;
        Ok(crate::with_dtype!(self.dtype(), T => {
            let src = elems::<T>(OP, self, l)?;
            CpuStorage::from_vec(gather_rows(&src, &idx, d))
        }))
    }

    fn index_add_zeros(
        &self,
        l: &Layout,
        ids: &Self,
        lids: &Layout,
        d: AlongDim,
        out: DType,
    ) -> Result<Self> {
        let idx = ids_usize("index_add", ids, lids)?;
        Ok(crate::with_compute!(out, C => {
            let gv = self.load::<C>(l);
            CpuStorage::store::<C>(scatter_add_rows(&gv, &idx, d), out)
        }))
    }

    fn cat(parts: &[(&Self, &Layout)], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        let dtype = parts.first().map_or(DType::F32, |(s, _)| s.dtype());
        Ok(crate::with_dtype!(dtype, T => {
            let srcs = parts
                .iter()
                .map(|(s, l)| elems::<T>("cat", s, l))
                .collect::<Result<Vec<_>>>()?;
            CpuStorage::from_vec(cat_rows(&srcs, outer, lens, inner))
        }))
    }
}
