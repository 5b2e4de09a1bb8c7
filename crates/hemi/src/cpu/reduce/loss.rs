//! The CPU's losses: cross-entropy and NLL row by row along the class dim (the rows of
//! `Rows`), and MSE; each with its fused backward. Per-row work runs in parallel above
//! `PAR_THRESHOLD` elements; reductions use `sum_slice`'s fixed order.

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

use crate::backend::loss::{ClassLoss, ClassLossForward, LossOps, Reduction};
use crate::backend::reduce::Rows;
use crate::cpu::elementwise::map::{map, zip_map, PAR_THRESHOLD};
use crate::cpu::reduce::{log_softmax_row, sum_slice};
use crate::cpu::storage::CpuStorage;
use crate::dtype::{DType, WithDType as _};
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// The target of each row: `None` where it is the ignore index, the class otherwise; a
/// target outside `0..classes` is `Error::Index`.
fn targets_of(
    target: &CpuStorage,
    lt: &Layout,
    loss: &ClassLoss,
    classes: usize,
) -> Result<Vec<Option<usize>>> {
    target
        .to_i64(lt)
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

impl LossOps for CpuStorage {
    fn class_loss(
        &self,
        layout: &Layout,
        target: &Self,
        lt: &Layout,
        rows: Rows,
        loss: ClassLoss,
        out: DType,
    ) -> Result<ClassLossForward<Self>> {
        let classes = rows.len;
        let targets = targets_of(target, lt, &loss, classes)?;
        let counted = targets.iter().filter(|t| t.is_some()).count();
        let smoothing = loss.label_smoothing;
        Ok(crate::with_compute!(out, C => {
            let xv = self.load::<C>(layout);
            let lp_owned = loss
                .from_logits
                .then(|| rows.map([&xv[..]], |[x], y| log_softmax_row(x, y)));
            let lp: &[C] = lp_owned.as_deref().unwrap_or(&xv);
            // Per position: (1-ε)·(-lp[t]) + (ε/C)·Σ_c(-lp[c]); 0 where ignored. With ε = 0
            // the smoothing sum is skipped (it may be -inf where the nll is finite).
            let keep = C::from_f64(1.0 - smoothing);
            let per_class = C::from_f64(smoothing / classes as f64);
            let loss_at = |r: usize, buf: &mut Vec<C>| -> C {
                let Some(t) = targets[r] else { return C::zero() };
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
                (0..n).into_par_iter().map_init(Vec::new, |buf, r| loss_at(r, buf)).collect()
            };
            let reduced = match loss.reduction {
                Reduction::None => losses,
                Reduction::Sum => vec![sum_slice(&losses)],
                // All targets ignored: 0/0 = NaN, as PyTorch.
                Reduction::Mean => vec![sum_slice(&losses) / C::from_f64(counted as f64)],
            };
            ClassLossForward {
                loss: CpuStorage::store::<C>(reduced, out),
                log_probs: lp_owned.map(|lp| CpuStorage::store::<C>(lp, out)),
                counted,
            }
        }))
    }

    fn class_loss_backward(
        &self,
        lg: &Layout,
        log_probs: Option<&Self>,
        target: &Self,
        lt: &Layout,
        rows: Rows,
        loss: ClassLoss,
        counted: usize,
        out: DType,
    ) -> Result<Self> {
        let classes = rows.len;
        let targets = targets_of(target, lt, &loss, classes)?;
        let smoothing = loss.label_smoothing;
        Ok(crate::with_compute!(out, C => {
            // d loss_r / d x[r, k] = scale_r · (p_k - q_k) for cross-entropy, -q_k for
            // NLL (w.r.t. the log-probabilities), with q = (1-ε)·onehot(t) + ε/C.
            let keep = C::from_f64(1.0 - smoothing);
            let per_class = C::from_f64(smoothing / classes as f64);
            let lp = log_probs.map(|s| s.load::<C>(&Layout::contiguous(&[s.len()])));
            let gv = self.load::<C>(lg);
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
                            Some(lp) => lp[o * block + at].exp(),
                            None => C::zero(),
                        };
                        gb[at] = s * (p - per_class);
                    }
                    gb[t * rows.inner + i] -= s * keep;
                }
            };
            let mut gi = vec![C::zero(); rows.outer * block];
            if gi.len() < PAR_THRESHOLD {
                gi.chunks_mut(block).enumerate().for_each(|(o, gb)| fill(o, gb));
            } else {
                crate::threads::nudge();
                gi.par_chunks_mut(block).enumerate().for_each(|(o, gb)| fill(o, gb));
            }
            CpuStorage::store::<C>(gi, out)
        }))
    }

    fn mse(
        &self,
        la: &Layout,
        target: &Self,
        lb: &Layout,
        reduction: Reduction,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            let diff = zip_map(&self.load::<C>(la), &target.load::<C>(lb), |a, b| a - b);
            let sq = map(&diff, |d| d * d);
            let n = diff.len();
            let loss = match reduction {
                Reduction::None => sq,
                Reduction::Sum => vec![sum_slice(&sq)],
                Reduction::Mean => vec![sum_slice(&sq) / C::from_f64(n as f64)],
            };
            (CpuStorage::store::<C>(loss, out), CpuStorage::store::<C>(diff, out))
        }))
    }

    fn mse_backward(
        &self,
        g: &Self,
        lg: &Layout,
        reduction: Reduction,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            // d/d input = 2 (input - target) · scale; d/d target is its negative.
            let diff = self.load::<C>(&Layout::contiguous(&[self.len()]));
            let gv = g.load::<C>(lg);
            let n = diff.len();
            let two = C::from_f64(2.0);
            let da: Vec<C> = match reduction {
                Reduction::None => zip_map(&diff, &gv, |d, g| two * d * g),
                Reduction::Sum => map(&diff, |d| two * d * gv[0]),
                Reduction::Mean => {
                    let s = two * gv[0] / C::from_f64(n as f64);
                    map(&diff, |d| d * s)
                }
            };
            let db = map(&da, |d| -d);
            (CpuStorage::store::<C>(da, out), CpuStorage::store::<C>(db, out))
        }))
    }
}
