//! The CPU's indexing kernels: row gathers, their scatter-add backward, concatenation.

use std::borrow::Cow;

use num_traits::Zero;

use crate::backend::index::{AlongDim, IndexOps};
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
        let AlongDim { outer, size, inner } = d;
        Ok(crate::with_dtype!(self.dtype(), T => {
            let src = elems::<T>(OP, self, l)?;
            let mut out = Vec::with_capacity(outer * idx.len() * inner);
            for o in 0..outer {
                for &i in &idx {
                    out.extend_from_slice(&src[(o * size + i) * inner..][..inner]);
                }
            }
            CpuStorage::from_vec(out)
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
        let AlongDim { outer, size, inner } = d;
        Ok(crate::with_compute!(out, C => {
            let gv = self.load::<C>(l);
            let mut acc = vec![C::zero(); outer * size * inner];
            let k = idx.len();
            for o in 0..outer {
                for (j, &i) in idx.iter().enumerate() {
                    let dst = &mut acc[(o * size + i) * inner..][..inner];
                    let src = &gv[(o * k + j) * inner..][..inner];
                    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
                }
            }
            CpuStorage::store::<C>(acc, out)
        }))
    }

    fn cat(parts: &[(&Self, &Layout)], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        let dtype = parts.first().map_or(DType::F32, |(s, _)| s.dtype());
        let total: usize = lens.iter().sum();
        Ok(crate::with_dtype!(dtype, T => {
            let srcs = parts
                .iter()
                .map(|(s, l)| elems::<T>("cat", s, l))
                .collect::<Result<Vec<_>>>()?;
            let mut out = Vec::with_capacity(outer * total * inner);
            for o in 0..outer {
                for (src, &len) in srcs.iter().zip(lens) {
                    out.extend_from_slice(&src[o * len * inner..][..len * inner]);
                }
            }
            CpuStorage::from_vec(out)
        }))
    }
}
