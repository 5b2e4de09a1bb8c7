//! The CPU's indexing kernels: row gathers, their scatter-add backward, concatenation.

use crate::backend::index::AlongDim;
use crate::dtype::FloatDType;

/// Rows `idx` of the `size` rows along the dim (each `inner` long), for each of `outer`
/// blocks: `index_select`.
pub(crate) fn gather_rows<T: Copy>(src: &[T], idx: &[usize], d: AlongDim) -> Vec<T> {
    let AlongDim { outer, size, inner } = d;
    let mut out = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in idx {
            out.extend_from_slice(&src[(o * size + i) * inner..][..inner]);
        }
    }
    out
}

/// The backward of `gather_rows`: gradient row `j` added into row `idx[j]` of zeros, in
/// order.
pub(crate) fn scatter_add_rows<C: FloatDType>(gv: &[C], idx: &[usize], d: AlongDim) -> Vec<C> {
    let AlongDim { outer, size, inner } = d;
    let mut acc = vec![C::zero(); outer * size * inner];
    let k = idx.len();
    for o in 0..outer {
        for (j, &i) in idx.iter().enumerate() {
            let dst = &mut acc[(o * size + i) * inner..][..inner];
            let src = &gv[(o * k + j) * inner..][..inner];
            dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
        }
    }
    acc
}

/// The parts (each `lens[p] · inner` values per block) side by side along the dim, for each
/// of `outer` blocks: `cat`.
pub(crate) fn cat_rows<T: Copy, S: AsRef<[T]>>(
    srcs: &[S],
    outer: usize,
    lens: &[usize],
    inner: usize,
) -> Vec<T> {
    let total: usize = lens.iter().sum();
    let mut out = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for (src, &len) in srcs.iter().zip(lens) {
            out.extend_from_slice(&src.as_ref()[o * len * inner..][..len * inner]);
        }
    }
    out
}
