//! The CPU's losses: cross-entropy and NLL row by row along the class dim (the rows of
//! `Rows`), and MSE; each with its fused backward. Per-row work runs in parallel above
//! `PAR_THRESHOLD` elements; reductions use `sum_slice`'s fixed order.

use crate::cpu::chunked::{for_each_chunk, map_collect};
#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use crate::backend::loss::{ClassLoss, Reduction};
use crate::backend::reduce::Rows;
use crate::cpu::elementwise::map::{map, zip_map, PAR_THRESHOLD};
use crate::cpu::reduce::{log_softmax_row, sum_slice};
use crate::dtype::FloatDType;

/// Cross-entropy or NLL (`loss`) of every row of `x` (logits, or log-probabilities where
/// `!loss.from_logits`) against `targets` (`None`: ignored), reduced as `loss.reduction`
/// asks over the `counted` targets not ignored; and the log-probabilities computed from
/// logits, which the backward reads.
pub(crate) fn class_loss<C: FloatDType>(
    xv: &[C],
    targets: &[Option<usize>],
    counted: usize,
    rows: Rows,
    loss: &ClassLoss,
) -> (Vec<C>, Option<Vec<C>>) {
    let classes = rows.len;
    let smoothing = loss.label_smoothing;
    let lp_owned = loss
        .from_logits
        .then(|| rows.map([xv], |[x], y| log_softmax_row(x, y)));
    let lp: &[C] = lp_owned.as_deref().unwrap_or(xv);
    // Per position: (1-ε)·(-lp[t]) + (ε/C)·Σ_c(-lp[c]); 0 where ignored. With ε = 0 the
    // smoothing sum is skipped (it may be -inf where the nll is finite).
    let keep = C::from_f64(1.0 - smoothing);
    let per_class = C::from_f64(smoothing / classes as f64);
    let loss_at = |r: usize, buf: &mut Vec<C>| -> C {
        let Some(t) = targets[r] else {
            return C::zero();
        };
        let (start, step) = (rows.start(r), rows.inner);
        let nll = -lp[start + t * step];
        if smoothing == 0.0 {
            return nll;
        }
        buf.clear();
        buf.extend((0..classes).map(|k| lp[start + k * step]));
        keep * nll - per_class * sum_slice(buf)
    };
    let n = rows.count();
    let losses: Vec<C> = if n * classes < PAR_THRESHOLD {
        let mut buf = Vec::new();
        (0..n).map(|r| loss_at(r, &mut buf)).collect()
    } else {
        crate::threads::nudge();
        map_collect(n, 1, Vec::new, |buf, r| loss_at(r, buf))
    };
    let reduced = match loss.reduction {
        Reduction::None => losses,
        Reduction::Sum => vec![sum_slice(&losses)],
        // All targets ignored: 0/0 = NaN, as PyTorch.
        Reduction::Mean => vec![sum_slice(&losses) / C::from_f64(counted as f64)],
    };
    (reduced, lp_owned)
}

/// The gradient of `class_loss` to its input from the loss's gradient `gv` and the
/// log-probabilities `lp` computed from logits (`None`: the input was log-probabilities).
pub(crate) fn class_loss_grads<C: FloatDType>(
    gv: &[C],
    lp: Option<&[C]>,
    targets: &[Option<usize>],
    counted: usize,
    rows: Rows,
    loss: &ClassLoss,
) -> Vec<C> {
    let classes = rows.len;
    let smoothing = loss.label_smoothing;
    // d loss_r / d x[r, k] = scale_r · (p_k - q_k) for cross-entropy, -q_k for NLL (w.r.t.
    // the log-probabilities), with q = (1-ε)·onehot(t) + ε/C.
    let keep = C::from_f64(1.0 - smoothing);
    let per_class = C::from_f64(smoothing / classes as f64);
    let scale = |r: usize| match loss.reduction {
        Reduction::None => gv[r],
        Reduction::Sum => gv[0],
        Reduction::Mean => gv[0] / C::from_f64(counted as f64),
    };
    let block = rows.len * rows.inner;
    let fill = |o: usize, gb: &mut [C]| {
        for i in 0..rows.inner {
            let r = o * rows.inner + i;
            let Some(t) = targets[r] else { continue };
            let s = scale(r);
            for k in 0..classes {
                let at = k * rows.inner + i;
                let p = match &lp {
                    Some(lp) => lp[o * block + at].exp_fast(),
                    None => C::zero(),
                };
                gb[at] = s * (p - per_class);
            }
            gb[t * rows.inner + i] -= s * keep;
        }
    };
    let mut gi = vec![C::zero(); rows.outer * block];
    if gi.len() < PAR_THRESHOLD {
        gi.chunks_mut(block)
            .enumerate()
            .for_each(|(o, gb)| fill(o, gb));
    } else {
        crate::threads::nudge();
        for_each_chunk(&mut gi, block, &|o, gb| fill(o, gb));
    }
    gi
}

/// Mean squared error of `a` against `b`, reduced as asked, and the differences `a - b`,
/// which the backward reads.
pub(crate) fn mse<C: FloatDType>(a: &[C], b: &[C], reduction: Reduction) -> (Vec<C>, Vec<C>) {
    let diff = zip_map(a, b, |a, b| a - b);
    let sq = map(&diff, |d| d * d);
    let n = diff.len();
    let loss = match reduction {
        Reduction::None => sq,
        Reduction::Sum => vec![sum_slice(&sq)],
        Reduction::Mean => vec![sum_slice(&sq) / C::from_f64(n as f64)],
    };
    (loss, diff)
}

/// The gradients of `mse` to the input and the target from the saved differences and the
/// loss's gradient: d/d input = 2 (input - target) · scale; d/d target is its negative.
pub(crate) fn mse_grads<C: FloatDType>(
    diff: &[C],
    gv: &[C],
    reduction: Reduction,
) -> (Vec<C>, Vec<C>) {
    let n = diff.len();
    let two = C::from_f64(2.0);
    let da: Vec<C> = match reduction {
        Reduction::None => zip_map(diff, gv, |d, g| two * d * g),
        Reduction::Sum => map(diff, |d| two * d * gv[0]),
        Reduction::Mean => {
            let s = two * gv[0] / C::from_f64(n as f64);
            map(diff, |d| d * s)
        }
    };
    let db = map(&da, |d| -d);
    (da, db)
}
