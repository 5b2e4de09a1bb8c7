//! The class losses from maps, reductions and a gather. The targets (one I64 per row) are
//! read on the host, to check them and to build what the maps need: the flat index of each
//! row's target (gathered with `index_select`), a 0/1 mask of the counted rows and, for the
//! backward, the one-hot matrix. Each step rounds where the CPU's loop rounds, so with the
//! same `exp` and sums the two agree bit for bit.

use super::{per_row, row_major, rows_layout};
use crate::backend::index::{AlongDim, IndexOps};
use crate::backend::loss::{ClassLoss, ClassLossForward, ClassSaved, Reduction};
use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::View;
use crate::backend::reduce::{ReduceOp, ReduceOps, Rows};
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// Each row's target class, `None` where it is the ignore index; a target outside
/// `0..classes` is `Error::Index` (read on the host).
fn targets<B: BackendStorage>(
    target: &B,
    lt: &Layout,
    loss: &ClassLoss,
    classes: usize,
) -> Result<Vec<Option<usize>>> {
    let host = target.download(lt)?;
    host.to_i64(&Layout::contiguous(&[host.len()]))
        .iter()
        .map(|&t| {
            if Some(t) == loss.ignore_index {
                Ok(None)
            } else if (0..classes as i64).contains(&t) {
                Ok(Some(t as usize))
            } else {
                Err(Error::Index {
                    op: loss.op,
                    index: t,
                    size: classes,
                })
            }
        })
        .collect()
}

/// One `dtype` value on `like`'s device.
fn scalar<B: BackendStorage>(like: &B, v: f64, dtype: DType) -> Result<B> {
    like.upload(&CpuStorage::from_f64(vec![v], dtype))
}

/// The 0/1 mask of the counted rows, on `like`'s device in `c`.
fn counted_mask<B: BackendStorage>(like: &B, t: &[Option<usize>], c: DType) -> Result<B> {
    let m = t.iter().map(|t| f64::from(u8::from(t.is_some()))).collect();
    like.upload(&CpuStorage::from_f64(m, c))
}

/// The class loss's forward (`LossOps::class_loss`): the log-probabilities (`softmax` with
/// `log` from logits), each row's `-lp[t]` gathered by `index_select`, with smoothing
/// `(1-ε)·nll - (ε/C)·Σ_c lp[c]`, 0 at ignored rows (`where_cond`), then the sum, or the
/// sum divided by the count of counted rows.
pub fn class_loss<B: ReduceOps + MapOps + IndexOps>(
    x: &B,
    layout: &Layout,
    target: &B,
    lt: &Layout,
    rows: Rows,
    loss: ClassLoss,
    out: DType,
) -> Result<ClassLossForward<B>> {
    let t = targets(target, lt, &loss, rows.len)?;
    let counted = t.iter().filter(|t| t.is_some()).count();
    let n = rows.count();
    let flat_n = Layout::contiguous(&[n]);
    let mut copy = None;
    let (lp_buf, lp_layout, log_probs) = if loss.from_logits {
        let lp = x.softmax(layout, rows, true, out)?;
        (None, rows_layout(rows, 0), Some(lp))
    } else {
        let (x, off) = row_major(x, layout, &mut copy)?;
        (Some(x), rows_layout(rows, off), None)
    };
    let lp: &B = match (&log_probs, lp_buf) {
        (Some(lp), _) => lp,
        (None, Some(x)) => x,
        (None, None) => unreachable!("either the log-softmax or the input"),
    };
    // The flat index of each row's target (row 0's first class where ignored: masked below).
    let ids: Vec<i64> = (0..n)
        .map(|r| (rows.start(r) + t[r].unwrap_or(0) * rows.inner + lp_layout.offset()) as i64)
        .collect();
    let ids = lp.upload(&CpuStorage::from_vec(ids))?;
    let total = lp.len();
    let all = Layout::contiguous(&[1, total, 1]);
    let along = AlongDim {
        outer: 1,
        size: total,
        inner: 1,
    };
    let picked = lp.index_select(&all, &ids, &flat_n, along)?;
    let mut per = picked.unary(&flat_n, UnaryOp::Neg, out)?;
    if loss.label_smoothing != 0.0 {
        let eps = loss.label_smoothing;
        let lens = Layout::new(
            vec![rows.outer, rows.inner, rows.len],
            vec![rows.len * rows.inner, 1, rows.inner],
            lp_layout.offset(),
        );
        let sum = lp.reduce(&lens, n, rows.len, ReduceOp::Sum, out)?;
        let kept = per.unary(&flat_n, UnaryOp::MulScalar(1.0 - eps), out)?;
        let spread = sum.unary(&flat_n, UnaryOp::MulScalar(eps / rows.len as f64), out)?;
        per = kept.binary(&flat_n, &spread, &flat_n, BinaryOp::Sub, out)?;
    }
    let mask = counted_mask(lp, &t, out)?;
    let zeros = scalar(lp, 0.0, out)?;
    let bcast = Layout::new(vec![n], vec![0], 0);
    let per = mask.where_cond(&flat_n, (&per, &flat_n), (&zeros, &bcast), out)?;
    let loss_out = match loss.reduction {
        Reduction::None => per,
        Reduction::Sum => per.reduce(&flat_n, 1, n, ReduceOp::Sum, out)?,
        Reduction::Mean => {
            let sum = per.reduce(&flat_n, 1, n, ReduceOp::Sum, out)?;
            let count = scalar(lp, counted as f64, out)?;
            let one = Layout::contiguous(&[1]);
            // All targets ignored: 0/0 = NaN, as PyTorch.
            sum.binary(&one, &count, &one, BinaryOp::Div, out)?
        }
    };
    Ok(ClassLossForward {
        loss: loss_out,
        log_probs,
        counted,
    })
}

/// The class loss's backward (`LossOps::class_loss_backward`): per row the scale `s` (the
/// row's gradient, the one gradient, or it divided by the count for the mean), then
/// `s·(p - ε/C) - s·(1-ε)·onehot(t)` with `p = exp(lp)` for cross-entropy and `p = 0` for NLL,
/// 0 at ignored rows.
pub fn class_loss_backward<B: ReduceOps + MapOps + IndexOps>(
    g: &B,
    lg: &Layout,
    ClassSaved { log_probs, counted }: ClassSaved<'_, B>,
    (target, lt): View<'_, B>,
    rows: Rows,
    loss: ClassLoss,
    out: DType,
) -> Result<B> {
    let t = targets(target, lt, &loss, rows.len)?;
    let one = Layout::contiguous(&[1]);
    let eps = loss.label_smoothing;
    let per_class = eps / rows.len as f64;
    // The per-row scale, [n].
    let s = match loss.reduction {
        Reduction::None | Reduction::Sum => g.cast(lg, out)?,
        Reduction::Mean => {
            let count = scalar(g, counted as f64, out)?;
            g.binary(lg, &count, &one, BinaryOp::Div, out)?
        }
    };
    let ls = match loss.reduction {
        Reduction::None => per_row(rows),
        _ => Layout::new(vec![rows.outer, rows.len, rows.inner], vec![0, 0, 0], 0),
    };
    let own = rows_layout(rows, 0);
    // s · (p - ε/C).
    let first = match log_probs {
        Some(lp) => {
            let p = lp.unary(&own, UnaryOp::Exp, out)?;
            let shifted = p.unary(&own, UnaryOp::AddScalar(-per_class), out)?;
            shifted.binary(&own, &s, &ls, BinaryOp::Mul, out)?
        }
        None => {
            let neg = s.unary(
                &Layout::contiguous(&[s.len()]),
                UnaryOp::MulScalar(-per_class),
                out,
            )?;
            let zero = scalar(g, 0.0, out)?;
            let z = Layout::new(vec![rows.outer, rows.len, rows.inner], vec![0, 0, 0], 0);
            zero.binary(&z, &neg, &ls, BinaryOp::Add, out)?
        }
    };
    // - s·(1-ε) at each counted row's target.
    let kept = s.unary(
        &Layout::contiguous(&[s.len()]),
        UnaryOp::MulScalar(1.0 - eps),
        out,
    )?;
    let mut onehot = vec![0.0; rows.outer * rows.len * rows.inner];
    for (r, t) in t.iter().enumerate() {
        if let Some(t) = t {
            onehot[rows.start(r) + t * rows.inner] = 1.0;
        }
    }
    let onehot = g.upload(&CpuStorage::from_f64(onehot, out))?;
    let at_target = onehot.binary(&own, &kept, &ls, BinaryOp::Mul, out)?;
    let grad = first.binary(&own, &at_target, &own, BinaryOp::Sub, out)?;
    // Ignored rows: 0.
    let mask = counted_mask(g, &t, out)?;
    let zeros = scalar(g, 0.0, out)?;
    let z = Layout::new(vec![rows.outer, rows.len, rows.inner], vec![0, 0, 0], 0);
    mask.where_cond(&per_row(rows), (&grad, &own), (&zeros, &z), out)
}
