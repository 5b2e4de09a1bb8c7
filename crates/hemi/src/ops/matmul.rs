//! Matrix products: `matmul` with PyTorch's semantics (dot, matrix-vector, matrix-matrix and
//! batched products with broadcast batch dims) and `linear` (x·Wᵀ + b, `F.linear`).
//!
//! Operands reach gemm as strided views: a transposed, broadcast or sliced operand costs no
//! copy (gemm takes a row and a column stride per matrix; batch dims are a loop over matrix
//! offsets). Half-precision operands are converted to F32 once, in bulk, multiplied with F32
//! accumulation, and the result is rounded once into the output dtype (the precision
//! contract); `linear` adds its bias before that one rounding. Mixed float dtypes promote
//! (`DType::promote`) and the output has the promoted dtype.
//!
//! Backward: dA = dC·Bᵀ and dB = Aᵀ·dC, written with transposed views and `matmul` itself
//! (so they are differentiable again), summed over broadcast batch dims.

use std::borrow::Cow;

use rayon::prelude::*;

use crate::cpu::gemm::{matmul_into_par, MatRef};
use crate::cpu::gemm_half::{self, HalfMat};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::layout::{broadcast_shapes, contiguous_strides};
use crate::tensor::{CpuStorage, FloatDType, Layout, Tensor};

/// Multiply-adds below which one matrix product stays on one thread (as `cpu::gemm`
/// decides); a batch of such products is spread over threads one matrix per task instead.
const SMALL_PRODUCT: usize = 64 * 64 * 64;

/// One operand of a product in the compute type: a buffer and where each element of the
/// view sits in it (`offset + Σ i_d * strides[d]`). An F16/BF16 operand of an F32 product
/// is not converted: `half` borrows its storage and `cpu::gemm_half` converts inside its
/// packing, block by block.
struct Operand<'a, C: Clone> {
    buf: Cow<'a, [C]>,
    half: Option<gemm_half::Operand<'a>>,
    offset: usize,
    strides: Vec<usize>,
}

/// A matrix of an operand: in the compute type, or half-precision values.
#[derive(Clone, Copy)]
enum Mat<'a, C> {
    Plain(MatRef<'a, C>),
    Half(HalfMat<'a>),
}

/// A matrix as `gemm_half` takes it (F32 compute only).
fn as_half<C: FloatDType>(m: Mat<'_, C>) -> HalfMat<'_> {
    match m {
        Mat::Half(h) => h,
        Mat::Plain(p) => HalfMat {
            data: gemm_half::Operand::F32(C::as_f32(p.data).expect("half operands: F32 compute")),
            rows: p.rows,
            cols: p.cols,
            rs: p.rs,
            cs: p.cs,
        },
    }
}

/// `dst (+)= a · b`: the `gemm` crate when both matrices are in the compute type, else
/// hemi's GEMM (`cpu::gemm_half`, F32 accumulation) on the half-precision values as stored.
fn product_into<C: FloatDType>(dst: &mut [C], a: Mat<'_, C>, b: Mat<'_, C>, acc: bool, par: bool) {
    match (a, b) {
        (Mat::Plain(a), Mat::Plain(b)) => matmul_into_par(dst, a, b, acc, par),
        _ => {
            let dst = C::as_f32_mut(dst).expect("half operands: F32 compute");
            gemm_half::gemm(dst, as_half(a), as_half(b), acc, par);
        }
    }
}

impl<'a, C: FloatDType> Operand<'a, C> {
    /// The storage span the view addresses, keeping the view's strides: borrowed when `C`
    /// is the storage type, else converted in bulk. A view that addresses little of its
    /// span (a thin slice of a large buffer) is gathered into a contiguous copy before
    /// conversion instead, so that no more than about twice its elements are converted.
    fn new(storage: &'a CpuStorage, layout: &Layout) -> Self {
        let (shape, strides) = (layout.shape(), layout.strides());
        let extent: usize = shape
            .iter()
            .zip(strides)
            .map(|(&d, &s)| d.saturating_sub(1) * s)
            .sum();
        let span = extent + 1;
        // Distinct elements the view can address: a broadcast view (stride 0) has fewer
        // than its numel, so compare the span with the numel of the non-broadcast dims.
        let distinct: usize = shape
            .iter()
            .zip(strides)
            .filter(|&(_, &s)| s != 0)
            .map(|(&d, _)| d)
            .product();
        if C::DTYPE == DType::F32 {
            let range = layout.offset()..layout.offset() + span;
            let half = match storage {
                CpuStorage::F16(v) => Some(gemm_half::Operand::F16(v).slice(range)),
                CpuStorage::BF16(v) => Some(gemm_half::Operand::BF16(v).slice(range)),
                _ => None,
            };
            if half.is_some() {
                return Operand {
                    buf: Cow::Owned(Vec::new()),
                    half,
                    offset: 0,
                    strides: strides.to_vec(),
                };
            }
        }
        if storage.dtype() == C::DTYPE || span <= 2 * distinct + 64 {
            let range = Layout::new(vec![span], vec![1], layout.offset());
            Operand {
                buf: CpuStorage::load::<C>(storage, &range),
                half: None,
                offset: 0,
                strides: strides.to_vec(),
            }
        } else {
            Operand {
                buf: CpuStorage::load::<C>(storage, layout),
                half: None,
                offset: 0,
                strides: contiguous_strides(shape),
            }
        }
    }

    /// The matrix (rows, cols) starting at `offset`, with the view's last two strides.
    fn mat(&self, offset: usize, rows: usize, cols: usize) -> Mat<'_, C> {
        let r = self.strides.len();
        let (rs, cs) = (self.strides[r - 2] as isize, self.strides[r - 1] as isize);
        match self.half {
            Some(h) => Mat::Half(HalfMat {
                data: h.slice(offset..),
                rows,
                cols,
                rs,
                cs,
            }),
            None => Mat::Plain(MatRef {
                data: &self.buf[offset..],
                rows,
                cols,
                rs,
                cs,
            }),
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

/// The row stride of the one tall matrix that dims `0..rank-1` of a view form, when they
/// merge (each non-unit dim's stride is the next non-unit dim's stride times its size):
/// then a batch of matrices times one matrix is a single product.
fn merged_row_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let r = shape.len();
    // The innermost non-unit dim sets the row stride; each outer one must continue it.
    let mut row_stride = None;
    let mut inner: Option<(usize, usize)> = None; // (size, stride) of the last non-unit dim
    for i in (0..r - 1).rev() {
        if shape[i] == 1 {
            continue;
        }
        match inner {
            Some((size, stride)) if strides[i] != size * stride => return None,
            Some(_) => {}
            None => row_stride = Some(strides[i]),
        }
        inner = Some((shape[i], strides[i]));
    }
    Some(row_stride.unwrap_or(strides[r - 2]))
}

/// `a · b` in the compute type: a [.., m, k], b [.., k, n] (rank >= 2; shapes checked by the
/// caller), batch dims broadcast to `batch`, plus `bias` [n] on every row. Returns the
/// row-major values of shape batch + [m, n], not yet rounded into the output dtype.
fn product<C: FloatDType>(a: &Tensor, b: &Tensor, batch: &[usize], bias: Option<&[C]>) -> Vec<C> {
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let count: usize = batch.iter().product();
    let mut out = match bias {
        Some(bias) => bias.iter().copied().cycle().take(count * m * n).collect(),
        None => vec![C::zero(); count * m * n],
    };
    if out.is_empty() || k == 0 {
        return out;
    }
    let accumulate = bias.is_some();
    let (sa, sb) = (a.storage(), b.storage());
    let (oa, ob) = (
        Operand::<C>::new(sa.as_cpu(), a.layout()),
        Operand::<C>::new(sb.as_cpu(), b.layout()),
    );

    // Every matrix of a against the same b: one tall product (a linear layer's case).
    let b_count: usize = b.shape()[..rb - 2].iter().product();
    if b_count == 1 {
        if let Some(rs) = merged_row_stride(a.shape(), &oa.strides) {
            let tall = match oa.mat(oa.offset, count * m, k) {
                Mat::Plain(p) => Mat::Plain(MatRef {
                    rs: rs as isize,
                    ..p
                }),
                Mat::Half(h) => Mat::Half(HalfMat {
                    rs: rs as isize,
                    ..h
                }),
            };
            product_into(&mut out, tall, ob.mat(ob.offset, k, n), accumulate, true);
            return out;
        }
    }

    let (offs_a, offs_b) = (
        oa.batch_offsets(a.shape(), batch),
        ob.batch_offsets(b.shape(), batch),
    );
    let one = |i: usize, dst: &mut [C], par: bool| {
        product_into(
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
    out
}

fn require_float(op: &'static str, t: &Tensor, shapes: &str) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(
            op,
            t.dtype(),
            format!("{shapes}: expected float tensors"),
        ));
    }
    Ok(())
}

/// A 2-D view [N, last] of a tensor of rank >= 1 (all leading dims merged into rows): a
/// view when the strides allow, a copy otherwise.
fn rows_2d(t: &Tensor) -> Result<Tensor> {
    let r = t.rank();
    if r == 1 {
        return t.unsqueeze(0);
    }
    if r == 2 {
        return Ok(t.clone());
    }
    let last = t.shape()[r - 1];
    let rows: usize = t.shape()[..r - 1].iter().product();
    let l = t.layout();
    match merged_row_stride(l.shape(), l.strides()) {
        Some(rs) => {
            let orig = t.shape().to_vec();
            let layout = Layout::new(vec![rows, last], vec![rs, l.strides()[r - 1]], l.offset());
            Ok(t.new_view(layout, "rows_2d", move |g| {
                Ok(vec![Some(g.reshape(&orig)?)])
            }))
        }
        None => t.reshape(&[rows, last]),
    }
}

/// The recorded product of two operands of rank >= 2 whose shapes fit, with batch dims
/// broadcast to `batch`.
fn matmul_op(a: &Tensor, b: &Tensor, batch: Vec<usize>) -> Result<Tensor> {
    let dtype = a.dtype().promote(b.dtype());
    let (m, n) = (a.shape()[a.rank() - 2], b.shape()[b.rank() - 1]);
    let mut shape = batch.clone();
    shape.extend([m, n]);
    let (a_saved, b_saved) = (a.detach(), b.detach());
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    crate::with_compute!(dtype, C => {
        let out = product::<C>(a, b, &batch, None);
        Ok(Tensor::from_compute(out, &shape, dtype, "matmul", &[a, b], move |g| {
            let ga = need_a.then(|| matmul_grad_lhs(g, &a_saved, &b_saved)).transpose()?;
            let gb = need_b.then(|| matmul_grad_rhs(g, &a_saved, &b_saved)).transpose()?;
            Ok(vec![ga, gb])
        }))
    })
}

/// dA = dC · Bᵀ, summed over the batch dims that A was broadcast along.
fn matmul_grad_lhs(g: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    g.matmul(&b.transpose(-1, -2)?)?.sum_to_shape(a.shape())
}

/// dB = Aᵀ · dC, summed over the batch dims that B was broadcast along. When B is one
/// matrix shared by the whole batch, Σᵢ AᵢᵀdCᵢ is a single product of the stacked
/// matrices, [k, batch·m] x [batch·m, n], with no batch of partial products to sum.
fn matmul_grad_rhs(g: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let b_count: usize = b.shape()[..b.rank() - 2].iter().product();
    if b_count == 1 && a.rank() > 2 {
        return rows_2d(a)?.t()?.matmul(&rows_2d(g)?)?.reshape(b.shape());
    }
    a.transpose(-1, -2)?.matmul(g)?.sum_to_shape(b.shape())
}

impl Tensor {
    /// Matrix product with `torch.matmul`'s semantics:
    /// - 1-D x 1-D: the dot product (a zero-dim tensor);
    /// - 2-D x 2-D: the matrix product;
    /// - 1-D x n-D: the vector is a row [1, k] whose added dim is removed from the result;
    ///   n-D x 1-D: the vector is a column [k, 1], likewise;
    /// - batched (either rank >= 3): the last two dims are matrices, the leading dims are
    ///   batch dims and broadcast.
    ///
    /// The output dtype is the promoted dtype of the operands; sums accumulate in F32 (F64
    /// for F64) and the result is rounded once. Integer operands are an error.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        use super::autocast::{cast, target};
        if let Some(dt) = target("matmul", &[Some(self), Some(other)]) {
            return cast(self, dt)?.matmul(&cast(other, dt)?);
        }
        let (a, b) = (self, other);
        let shapes = format!("{:?} x {:?}", a.shape(), b.shape());
        require_float("matmul", a, &shapes)?;
        require_float("matmul", b, &shapes)?;
        let mismatch = |why: &str| Error::shape("matmul", format!("{shapes}: {why}"));
        if a.rank() == 0 || b.rank() == 0 {
            return Err(mismatch("both operands need at least one dim"));
        }
        let (ra, rb) = (a.rank(), b.rank());
        let ka = a.shape()[ra - 1];
        let kb = if rb == 1 {
            b.shape()[0]
        } else {
            b.shape()[rb - 2]
        };
        if ka != kb {
            return Err(mismatch(&format!("inner dims {ka} and {kb} differ")));
        }
        let a_batch = &a.shape()[..ra.saturating_sub(2)];
        let b_batch = &b.shape()[..rb.saturating_sub(2)];
        let batch = broadcast_shapes("matmul", a_batch, b_batch)
            .map_err(|_| mismatch("batch dims do not broadcast"))?;

        let a2 = if ra == 1 { a.unsqueeze(0)? } else { a.clone() };
        let b2 = if rb == 1 { b.unsqueeze(1)? } else { b.clone() };
        let out = matmul_op(&a2, &b2, batch)?;
        // Remove the dims the 1-D operands gained.
        let out = if ra == 1 { out.squeeze(-2)? } else { out };
        if rb == 1 {
            out.squeeze(-1)
        } else {
            Ok(out)
        }
    }

    /// `self · weightᵀ + bias` (`torch.nn.functional.linear`): input [.., in], weight
    /// [out, in], bias [out]; the result is [.., out]. Wᵀ is a strided view, never
    /// materialised; the bias is added before the single rounding of the result. The
    /// output dtype is the promoted dtype of all operands.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        use super::autocast::{cast, cast_opt, target};
        if let Some(dt) = target("linear", &[Some(self), Some(weight), bias]) {
            let b = cast_opt(bias, dt)?;
            return cast(self, dt)?.linear(&cast(weight, dt)?, b.as_ref());
        }
        let x = self;
        let shapes = format!(
            "input {:?}, weight {:?}{}",
            x.shape(),
            weight.shape(),
            bias.map_or(String::new(), |b| format!(", bias {:?}", b.shape()))
        );
        require_float("linear", x, &shapes)?;
        require_float("linear", weight, &shapes)?;
        if let Some(b) = bias {
            require_float("linear", b, &shapes)?;
        }
        let mismatch = |why: &str| Error::shape("linear", format!("{shapes}: {why}"));
        if weight.rank() != 2 {
            return Err(mismatch("weight must be 2-D [out, in]"));
        }
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        if x.rank() == 0 || x.shape()[x.rank() - 1] != in_f {
            return Err(mismatch(
                "the input's last dim must equal the weight's in features",
            ));
        }
        if bias.is_some_and(|b| b.shape() != [out_f]) {
            return Err(mismatch("bias must be 1-D [out]"));
        }

        let mut dtype = x.dtype().promote(weight.dtype());
        if let Some(b) = bias {
            dtype = dtype.promote(b.dtype());
        }
        let mut shape = x.shape()[..x.rank() - 1].to_vec();
        shape.push(out_f);
        let x2 = if x.rank() == 1 {
            x.detach().unsqueeze(0)?
        } else {
            x.detach()
        };
        let wt = weight.detach().t()?; // [in, out], the transposed view
        let batch = x2.shape()[..x2.rank() - 2].to_vec();

        let mut inputs = vec![x, weight];
        inputs.extend(bias);
        let needs: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
        let (x_saved, w_saved) = (x.detach(), weight.detach());
        crate::with_compute!(dtype, C => {
            let bias_v = bias.map(|b| b.values::<C>());
            let out = product::<C>(&x2, &wt, &batch, bias_v.as_deref());
            Ok(Tensor::from_compute(out, &shape, dtype, "linear", &inputs, move |g| {
                let mut grads = Vec::with_capacity(needs.len());
                // dx = dy · W: [.., out] x [out, in].
                grads.push(needs[0].then(|| g.matmul(&w_saved)).transpose()?);
                // dW = dyᵀ · x over all rows: [out, N] x [N, in].
                let g_rows = rows_2d(g)?;
                grads.push(needs[1].then(|| g_rows.t()?.matmul(&rows_2d(&x_saved)?)).transpose()?);
                if needs.len() == 3 {
                    // db = Σ_rows dy.
                    grads.push(needs[2].then(|| g_rows.sum(&[0], false)).transpose()?);
                }
                Ok(grads)
            }))
        })
    }
}
