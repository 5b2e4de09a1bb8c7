//! The CPU's matrix product with PyTorch's batching: operands reach GEMM as strided views (a
//! transposed, broadcast or sliced operand costs no copy: GEMM takes a row and a column
//! stride per matrix, batch dims are a loop over matrix offsets). F16/BF16 operands of an F32
//! product are not converted: `cpu::gemm::product` hands them to hemi's blocked GEMM as
//! stored, which converts inside its packing, block by block.

use std::borrow::Cow;

use crate::cpu::chunked::{for_each_chunk, for_each_chunk_min};
use half::{bf16, f16};

use crate::backend::nn::merged_row_stride;
use crate::cpu::gemm::{blocked, select};
use crate::cpu::gemm::{product, MatRef};
use crate::dtype::{DType, FloatDType, WithDType};
use crate::tensor::layout::contiguous_strides;
use crate::tensor::{CpuStorage, Layout};

/// Multiply-adds below which one matrix product stays on one thread (as `cpu::gemm`
/// decides); a batch of such products is spread over threads one matrix per task instead.
const SMALL_PRODUCT: usize = 64 * 64 * 64;
/// Outputs of at least this many elements are filled (zeros or bias rows) in parallel.
const FILL_PAR_LEN: usize = 1 << 17;
/// Elements per parallel part of that fill (whole rows).
const FILL_CHUNK: usize = 1 << 15;

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
    let mut out = filled_rows(count * m, n, bias);
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

/// `a · b (+ bias)` rounded into the half dtype `O` as each tile is summed
/// (`blocked::gemm_round`), when both operands are stored in `O`, the product is one tall
/// matrix product (b has no batch dims and a's rows merge: a linear layer under autocast)
/// and its inner dim fits one k block; `None` otherwise. The bits of `matmul::<f32>`
/// followed by `CpuStorage::from_f32`.
pub(crate) fn matmul_round<O: WithDType>(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    batch: &[usize],
    bias: Option<&[f32]>,
) -> Option<Vec<O>> {
    let (ra, rb) = (la.shape().len(), lb.shape().len());
    let (m, k, n) = (la.shape()[ra - 2], la.shape()[ra - 1], lb.shape()[rb - 1]);
    let count: usize = batch.iter().product();
    let b_count: usize = lb.shape()[..rb - 2].iter().product();
    let a_count: usize = la.shape()[..ra - 2].iter().product();
    if b_count != 1 || a_count != count || a.dtype() != O::DTYPE || b.dtype() != O::DTYPE {
        return None;
    }
    let rows = count * m;
    let kernel = select::kernel_for(O::DTYPE, O::DTYPE, rows, k, n);
    if !blocked::rounds_in_tiles(kernel, k) {
        return None;
    }
    let rs = merged_row_stride(la.shape(), la.strides())?;
    let (av, bv) = (a.as_slice::<O>()?, b.as_slice::<O>()?);
    let (oa, ob) = (Operand::stored(av, la), Operand::stored(bv, lb));
    let tall = oa.mat(oa.offset, rows, k).with_row_stride(rs as isize);
    let mut out: Vec<O> = Vec::with_capacity(rows * n);
    let dst = &mut out.spare_capacity_mut()[..rows * n];
    if !blocked::gemm_round(kernel, dst, tall, ob.mat(ob.offset, k, n), bias, true) {
        return None;
    }
    // SAFETY: `gemm_round` returned true: it wrote all rows * n elements.
    unsafe { out.set_len(rows * n) };
    Some(out)
}

/// `rows` copies of `row` (zeros where it is `None`), each `n` long, as one vector. Large
/// outputs are written in parallel into the vector's uninitialised capacity. This fill of a
/// linear layer's output (a memset, or the bias copied onto every row) ran on one thread
/// while the other waited: 3.5 % of the main thread's time in a BERT amp-bf16 step.
#[doc(hidden)]
pub fn filled_rows<C: FloatDType>(rows: usize, n: usize, row: Option<&[C]>) -> Vec<C> {
    let len = rows * n;
    let mut out: Vec<C> = Vec::with_capacity(len);
    let fill = |dst: &mut [std::mem::MaybeUninit<C>]| match row {
        Some(row) => {
            for d in dst.chunks_mut(n.max(1)) {
                for (d, &v) in d.iter_mut().zip(&row[..n]) {
                    d.write(v);
                }
            }
        }
        None => dst.iter_mut().for_each(|d| {
            d.write(C::zero());
        }),
    };
    let spare = &mut out.spare_capacity_mut()[..len];
    if len >= FILL_PAR_LEN && n > 0 && rayon::current_num_threads() > 1 {
        let chunk_rows = (FILL_CHUNK / n).max(1);
        crate::threads::nudge();
        for_each_chunk(spare, chunk_rows * n, &|_, d| fill(d));
    } else {
        fill(spare);
    }
    // SAFETY: `fill` wrote every one of the first `len` elements (whole rows of `n`).
    unsafe { out.set_len(len) };
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
        crate::threads::nudge();
        let min_len = SMALL_PRODUCT / (4 * work.max(1)) + 1;
        for_each_chunk_min(out, m * n, min_len, &|i, dst| one(i, dst, false));
    } else {
        // Large matrices: gemm spreads each product over the threads.
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            one(i, dst, true);
        }
    }
}
