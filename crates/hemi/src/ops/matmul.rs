//! Matrix products: `matmul` with PyTorch's semantics (dot, matrix-vector, matrix-matrix and
//! batched products with broadcast batch dims) and `linear` (x·Wᵀ + b, `F.linear`).
//!
//! Both call the backend's `matmul` primitive (`backend::nn`), which takes the operands as
//! strided views: a transposed, broadcast or sliced operand costs no copy. Half-precision
//! operands are multiplied with F32 accumulation and the result is rounded once into the
//! output dtype (the precision contract); `linear` adds its bias before that one rounding. Mixed float dtypes promote
//! (`DType::promote`) and the output has the promoted dtype.
//!
//! Backward: dA = dC·Bᵀ and dB = Aᵀ·dC, written with transposed views and `matmul` itself
//! (so they are differentiable again), summed over broadcast batch dims.

use std::sync::Arc;

use crate::backend::nn::merged_row_stride;
use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::{Layout, Tensor};

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
    let mut shape = batch;
    shape.extend([m, n]);
    let (a_saved, b_saved) = (a.detach(), b.detach());
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    let out = a
        .storage()
        .matmul(a.layout(), &b.storage(), b.layout(), None, dtype)?;
    Ok(Tensor::from_op(
        Arc::new(out),
        Layout::contiguous(&shape),
        "matmul",
        &[a, b],
        move |g| {
            let ga = need_a
                .then(|| matmul_grad_lhs(g, &a_saved, &b_saved))
                .transpose()?;
            let gb = need_b
                .then(|| matmul_grad_rhs(g, &a_saved, &b_saved))
                .transpose()?;
            Ok(vec![ga, gb])
        },
    ))
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
    /// `[out, in]`, bias `[out]`; the result is `[.., out]`. Wᵀ is a strided view, never
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

        let mut inputs = vec![x, weight];
        inputs.extend(bias);
        let needs: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
        let (x_saved, w_saved) = (x.detach(), weight.detach());
        let bias_s = bias.map(|b| b.storage());
        let out = x2.storage().matmul(
            x2.layout(),
            &wt.storage(),
            wt.layout(),
            bias.zip(bias_s.as_deref()).map(|(b, s)| (s, b.layout())),
            dtype,
        )?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&shape),
            "linear",
            &inputs,
            move |g| {
                let mut grads = Vec::with_capacity(needs.len());
                // dx = dy · W: [.., out] x [out, in].
                grads.push(needs[0].then(|| g.matmul(&w_saved)).transpose()?);
                // dW = dyᵀ · x over all rows: [out, N] x [N, in].
                let g_rows = rows_2d(g)?;
                grads.push(
                    needs[1]
                        .then(|| g_rows.t()?.matmul(&rows_2d(&x_saved)?))
                        .transpose()?,
                );
                if needs.len() == 3 {
                    // db = Σ_rows dy.
                    grads.push(needs[2].then(|| g_rows.sum(&[0], false)).transpose()?);
                }
                Ok(grads)
            },
        ))
    }
}
