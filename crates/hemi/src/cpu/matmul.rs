//! The CPU's matrix product with PyTorch's batching: operands reach GEMM as strided views (a
//! transposed, broadcast or sliced operand costs no copy: GEMM takes a row and a column
//! stride per matrix, batch dims are a loop over matrix offsets). F16/BF16 operands of an F32
//! product are not converted: `cpu::gemm::product` hands them to `gemm_half` as stored, which
//! converts inside its packing, block by block.

use std::borrow::Cow;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::nn::merged_row_stride;
use crate::cpu::gemm::{product, MatRef};
use crate::dtype::{DType, FloatDType, WithDType};
use crate::tensor::layout::contiguous_strides;
use crate::tensor::{CpuStorage, Layout};

/// Multiply-adds below which one matrix product stays on one thread (as `cpu::gemm`
/// decides); a batch of such products is spread over threads one matrix per task instead.
const SMALL_PRODUCT: usize = 64 * 64 * 64;

/// One operand of a product: a buffer of elements `T` (the compute type, or F16/BF16 as
/// stored) and where each element of the view sits in it (`offset + Σ i_d * strides[d]`).
struct Operand<'a, T: Clone> {
    buf: Cow<'a, [T]>,
    offset: usize,
    strides: Vec<usize>,
}

/// Elements of storage a view spans (`max offset + 1`) and the distinct elements it can
/// address (a broadcast view, stride 0, has fewer than its numel).
fn span(layout: &Layout) -> (usize, usize) {
    let (shape, strides) = (layout.shape(), layout.strides());
    let extent: usize = shape
        .iter()
        .zip(strides)
        .map(|(&d, &s)| d.saturating_sub(1) * s)
        .sum();
    let distinct: usize = shape
        .iter()
        .zip(strides)
        .filter(|&(_, &s)| s != 0)
        .map(|(&d, _)| d)
        .product();
    (extent + 1, distinct)
}

impl<'a, T: WithDType> Operand<'a, T> {
    /// The storage span the view addresses, borrowed as stored (F16/BF16 of an F32 product).
    fn stored(v: &'a [T], layout: &Layout) -> Self {
        let start = layout.offset();
        Operand {
            buf: Cow::Borrowed(&v[start..start + span(layout).0]),
            offset: 0,
            strides: layout.strides().to_vec(),
        }
    }
}

impl<'a, C: FloatDType> Operand<'a, C> {
    /// The storage span the view addresses in the compute type, keeping the view's strides:
    /// borrowed when `C` is the storage type, else converted in bulk. A view that addresses
    /// little of its span (a thin slice of a large buffer) is gathered into a contiguous copy
    /// before conversion instead, so that no more than about twice its elements are
    /// converted.
    fn compute(storage: &'a CpuStorage, layout: &Layout) -> Self {
        let (span, distinct) = span(layout);
        if storage.dtype() == C::DTYPE || span <= 2 * distinct + 64 {
            let range = Layout::new(vec![span], vec![1], layout.offset());
            Operand {
                buf: storage.load::<C>(&range),
                offset: 0,
                strides: layout.strides().to_vec(),
            }
        } else {
            Operand {
                buf: storage.load::<C>(layout),
                offset: 0,
                strides: contiguous_strides(layout.shape()),
            }
        }
    }
}

impl<T: WithDType> Operand<'_, T> {
    /// The matrix (rows, cols) starting at `offset`, with the view's last two strides.
    fn mat(&self, offset: usize, rows: usize, cols: usize) -> MatRef<'_, T> {
        let r = self.strides.len();
        MatRef {
            data: &self.buf[offset..],
            rows,
            cols,
            rs: self.strides[r - 2] as isize,
            cs: self.strides[r - 1] as isize,
        }
    }

    /// Offset of each of the view's matrices for every index of the output batch `batch`
    /// (the view's batch dims aligned right; size-1 and missing dims repeat one matrix).
    fn batch_offsets(&self, shape: &[usize], batch: &[usize]) -> Vec<usize> {
        let own = &shape[..shape.len() - 2];
        let lead = batch.len() - own.len();
        let strides: Vec<usize> = (0..batch.len())
            .map(|j| match j.checked_sub(lead) {
                Some(i) if own[i] != 1 => self.strides[i],
                _ => 0,
            })
            .collect();
        let count: usize = batch.iter().product();
        let mut offsets = Vec::with_capacity(count);
        let mut idx = vec![0usize; batch.len()];
        let mut off = self.offset;
        for _ in 0..count {
            offsets.push(off);
            // Odometer increment, innermost dim fastest.
            for d in (0..batch.len()).rev() {
                idx[d] += 1;
                off += strides[d];
                if idx[d] < batch[d] {
                    break;
                }
                off -= strides[d] * batch[d];
                idx[d] = 0;
            }
        }
        offsets
    }
}

/// Runs `$body` with `$o` bound to the operand of `$s` under `$l` for an F32/F64 product in
/// `$C`: F16/BF16 as stored when `$C` is f32, else converted to `$C`.
macro_rules! with_operand {
    ($s:expr, $l:expr, $C:ty, |$o:ident| $body:expr) => {
        match $s {
            CpuStorage::F16(v) if <$C>::DTYPE == DType::F32 => {
                let $o = Operand::<f16>::stored(v, $l);
                $body
            }
            CpuStorage::BF16(v) if <$C>::DTYPE == DType::F32 => {
                let $o = Operand::<bf16>::stored(v, $l);
                $body
            }
            s => {
                let $o = Operand::<$C>::compute(s, $l);
                $body
            }
        }
    };
}

/// `a · b (+ bias)` in the compute type `C`: a [.., m, k], b [.., k, n] (rank >= 2, shapes
/// checked by the caller), batch dims broadcast to `batch`, plus `bias` [n] on every row.
/// Returns the row-major values of shape batch + [m, n], not yet rounded.
pub(crate) fn matmul<C: FloatDType>(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    batch: &[usize],
    bias: Option<&[C]>,
) -> Vec<C> {
    let (ra, rb) = (la.shape().len(), lb.shape().len());
    let (m, k, n) = (la.shape()[ra - 2], la.shape()[ra - 1], lb.shape()[rb - 1]);
    let count: usize = batch.iter().product();
    let mut out = match bias {
        // The bias row copied onto every output row (`cycle().take().collect()` built this
        // an element at a time: 5 % of a BERT amp-bf16 training step).
        Some(bias) => {
            let mut v = Vec::with_capacity(count * m * n);
            for _ in 0..count * m {
                v.extend_from_slice(&bias[..n]);
            }
            v
        }
        None => vec![C::zero(); count * m * n],
    };
    if out.is_empty() || k == 0 {
        return out;
    }
    with_operand!(a, la, C, |oa| with_operand!(b, lb, C, |ob| {
        batched(
            &mut out,
            &oa,
            la.shape(),
            &ob,
            lb.shape(),
            batch,
            bias.is_some(),
        )
    }));
    out
}

/// `out (+)= a · b` over the batch, `out` holding the bias rows when `accumulate`.
fn batched<C: FloatDType, A: WithDType, B: WithDType>(
    out: &mut [C],
    oa: &Operand<'_, A>,
    a_shape: &[usize],
    ob: &Operand<'_, B>,
    b_shape: &[usize],
    batch: &[usize],
    accumulate: bool,
) {
    let (ra, rb) = (a_shape.len(), b_shape.len());
    let (m, k, n) = (a_shape[ra - 2], a_shape[ra - 1], b_shape[rb - 1]);
    let count: usize = batch.iter().product();

    // Every matrix of a against the same b: one tall product (a linear layer's case).
    let b_count: usize = b_shape[..rb - 2].iter().product();
    if b_count == 1 {
        if let Some(rs) = merged_row_stride(a_shape, &oa.strides) {
            let tall = oa.mat(oa.offset, count * m, k).with_row_stride(rs as isize);
            product(out, tall, ob.mat(ob.offset, k, n), accumulate, true);
            return;
        }
    }

    let (offs_a, offs_b) = (
        oa.batch_offsets(a_shape, batch),
        ob.batch_offsets(b_shape, batch),
    );
    let one = |i: usize, dst: &mut [C], par: bool| {
        product(
            dst,
            oa.mat(offs_a[i], m, k),
            ob.mat(offs_b[i], k, n),
            accumulate,
            par,
        )
    };
    let work = m * n * k;
    if count > 1 && work < SMALL_PRODUCT && rayon::current_num_threads() > 1 {
        // Small matrices: one thread per group of matrices, gemm single-threaded.
        out.par_chunks_mut(m * n)
            .enumerate()
            .with_min_len(SMALL_PRODUCT / (4 * work.max(1)) + 1)
            .for_each(|(i, dst)| one(i, dst, false));
    } else {
        // Large matrices: gemm spreads each product over the threads.
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            one(i, dst, true);
        }
    }
}
