//! Shapes, strides and offsets: how a tensor's elements sit in its storage.

use std::mem::MaybeUninit;

use crate::error::{Error, Result};

/// Gathers of at least this many elements copy their rows in parallel.
#[doc(hidden)]
pub const GATHER_PAR_LEN: usize = 1 << 17;
/// Elements per parallel part of a gather (whole rows).
const GATHER_CHUNK: usize = 1 << 15;

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc *= d;
    }
    strides
}

/// Where the elements of a tensor live in its storage: element `[i0, i1, ...]` is at
/// `offset + i0 * strides[0] + i1 * strides[1] + ...`. A stride of 0 is a broadcast dim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// The row-major layout of `shape`: strides are suffix products, offset 0.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A layout from its parts (`shape` and `strides` of the same length, in elements); the
    /// caller guarantees that every addressed element lies inside the buffer.
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// The size of each dim.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Elements to skip in the buffer per step along each dim (0 for a broadcast dim).
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Position of element `[0, 0, ...]` in the buffer, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Number of elements addressed (the product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the elements are in row-major order with no gaps (size-1 dims may have
    /// any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// The storage range `offset..offset+numel` when contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.numel())
    }

    /// Copies the elements this layout addresses out of `src`, in row-major order. The
    /// innermost dim is copied as a slice when its stride is 1.
    pub fn gather<T: Copy + Send + Sync>(&self, src: &[T]) -> Vec<T> {
        if let Some(r) = self.contiguous_range() {
            return src[r].to_vec();
        }
        let n = self.numel();
        let mut out: Vec<T> = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let inner = self.shape[self.rank() - 1];
        let rows = n / inner;
        let spare = &mut out.spare_capacity_mut()[..n];
        if n >= GATHER_PAR_LEN && rows > 1 && rayon::current_num_threads() > 1 {
            // A serial copy here left the other core waiting: the strided gradients a
            // backward makes contiguous are megabytes (1.3 % of the main thread in a BERT step).
            let chunk_rows = GATHER_CHUNK.div_ceil(inner).max(1);
            crate::threads::nudge();
            crate::cpu::chunked::for_each_chunk(spare, chunk_rows * inner, &|i, part| {
                self.gather_rows(src, i * chunk_rows, part)
            });
        } else {
            self.gather_rows(src, 0, spare);
        }
        // SAFETY: `gather_rows` wrote every element of every part, and the parts cover the
        // first n elements.
        unsafe { out.set_len(n) };
        out
    }

    /// Writes rows `first..` (a row being the last dim) of the addressed elements into
    /// `out`, as many whole rows as it holds.
    fn gather_rows<T: Copy>(&self, src: &[T], first: usize, out: &mut [MaybeUninit<T>]) {
        let rank = self.rank();
        let (inner, inner_stride) = (self.shape[rank - 1], self.strides[rank - 1]);
        let outer_shape = &self.shape[..rank - 1];
        let outer_strides = &self.strides[..rank - 1];
        // The multi-index of row `first` and its offset in `src`.
        let mut idx = vec![0usize; rank - 1];
        let mut base = self.offset;
        let mut rest = first;
        for d in (0..rank - 1).rev() {
            idx[d] = rest % outer_shape[d];
            rest /= outer_shape[d];
            base += idx[d] * outer_strides[d];
        }
        for row in out.chunks_mut(inner) {
            if inner_stride == 1 {
                for (o, &v) in row.iter_mut().zip(&src[base..base + inner]) {
                    o.write(v);
                }
            } else {
                for (i, o) in row.iter_mut().enumerate() {
                    o.write(src[base + i * inner_stride]);
                }
            }
            // Odometer increment over the outer dims.
            for d in (0..rank - 1).rev() {
                idx[d] += 1;
                base += outer_strides[d];
                if idx[d] < outer_shape[d] {
                    break;
                }
                base -= outer_strides[d] * outer_shape[d];
                idx[d] = 0;
            }
        }
    }

    /// Resolves a possibly negative dim index (`-1` is the last dim).
    pub fn dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        resolve_dim(op, dim, self.rank())
    }
}

/// Resolves a possibly negative dim against `rank`.
pub fn resolve_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(Error::Dim { op, dim, rank });
    }
    Ok(d as usize)
}

/// The broadcast shape of two shapes (NumPy/PyTorch rule: align from the right; sizes must
/// be equal or one of them 1).
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::shape(
                op,
                format!("cannot broadcast {a:?} with {b:?}"),
            ));
        };
    }
    Ok(out)
}

/// The number of elements of `shape`, checked: a product that overflows, or a tensor whose
/// bytes (at 8 per element, the widest dtype) would not fit in `isize`, is an error naming
/// `op` and the shape instead of a wrapped size that lets a kernel run out of bounds.
pub fn checked_numel(op: &'static str, shape: &[usize]) -> crate::error::Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n.checked_mul(8).is_some_and(|b| b <= isize::MAX as usize))
        .ok_or_else(|| {
            crate::error::Error::shape(op, format!("shape {shape:?} has too many elements"))
        })
}
