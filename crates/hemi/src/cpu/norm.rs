//! Batch-norm and layer-norm kernels over contiguous buffers in the compute type (F32, or
//! F64 for F64 tensors), forward and the closed-form backward (as llm.c's
//! `layernorm_backward`), parallel over channels or rows. No autograd and no validation:
//! `ops/norm.rs` checks the shapes, `cpu::nn` converts and rounds.

use rayon::prelude::*;

use crate::backend::nn::BatchNormGeom;
use crate::cpu::map::PAR_THRESHOLD;
use crate::cpu::reduce::sum_slice;
use crate::cpu::runs::{add_in_order, Runs};
use crate::tensor::FloatDType;

/// Channel `ch` of a `[n, c, s]` buffer: the `n` contiguous runs `v[(i*c + ch)*s ..][..s]`.
fn runs<C>(d: BatchNormGeom, v: &[C], ch: usize) -> impl Iterator<Item = &[C]> {
    (0..d.n).map(move |i| &v[(i * d.c + ch) * d.s..][..d.s])
}

/// `Σ f(x[i])` over a contiguous slice with eight accumulators (as `sum_slice`).
fn sum_map<C: FloatDType>(x: &[C], f: impl Fn(C) -> C) -> C {
    let mut acc = [C::zero(); 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += f(c[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &r in rem {
        s += f(r);
    }
    s
}

/// `Σ f(a[i], b[i])` over two slices of equal length with eight accumulators.
fn sum_map2<C: FloatDType>(a: &[C], b: &[C], f: impl Fn(C, C) -> C) -> C {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [C::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += f(x[i], y[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in ra.iter().zip(rb) {
        s += f(x, y);
    }
    s
}

/// `f(0), ..., f(count - 1)` in parallel, each task doing at least `PAR_THRESHOLD`
/// elements of work (`work_each` per call), so small inputs stay on one thread.
fn par_map<T: Send>(
    count: usize,
    work_each: usize,
    f: impl Fn(usize) -> T + Sync + Send,
) -> Vec<T> {
    let min_len = (PAR_THRESHOLD / work_each.max(1)).max(1);
    (0..count)
        .into_par_iter()
        .with_min_len(min_len)
        .map(f)
        .collect()
}

/// Per-channel mean and biased variance (two passes: the variance sums squared deviations
/// from the mean, which does not cancel the way `E[x²] - E[x]²` does in F32).
pub(crate) fn bn_stats<C: FloatDType>(x: &[C], d: BatchNormGeom) -> (Vec<C>, Vec<C>) {
    let inv_m = C::one() / C::from_f64(d.m() as f64);
    let stats = par_map(d.c, d.m(), |ch| {
        let mean = runs(d, x, ch).map(sum_slice).fold(C::zero(), |a, b| a + b) * inv_m;
        let var = runs(d, x, ch)
            .map(|r| sum_map(r, |v| (v - mean) * (v - mean)))
            .fold(C::zero(), |a, b| a + b)
            * inv_m;
        (mean, var)
    });
    stats.into_iter().unzip()
}

/// `y = (x - mean[ch]) * (rstd[ch] * w[ch]) + b[ch]`.
pub(crate) fn bn_forward<C: FloatDType>(
    x: &[C],
    d: BatchNormGeom,
    mean: &[C],
    rstd: &[C],
    w: Option<&[C]>,
    b: Option<&[C]>,
) -> Vec<C> {
    let mut out = vec![C::zero(); x.len()];
    let block = (d.c * d.s).max(1);
    out.par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .with_min_len((PAR_THRESHOLD / block).max(1))
        .for_each(|(o, xb)| {
            for ch in 0..d.c {
                let scale = rstd[ch] * w.map_or(C::one(), |w| w[ch]);
                let shift = b.map_or(C::zero(), |b| b[ch]);
                let (o, xr) = (&mut o[ch * d.s..][..d.s], &xb[ch * d.s..][..d.s]);
                for (o, &v) in o.iter_mut().zip(xr) {
                    *o = (v - mean[ch]) * scale + shift;
                }
            }
        });
    out
}

/// Gradients of batch norm given the output gradient `g`.
///
/// With `dnorm = g * w` the gradient of `xhat`:
/// - `dbias[ch]   = Σ g`,  `dweight[ch] = Σ g * xhat` (sums over the channel's n*s values);
/// - training (the statistics depend on x):
///   `dx = rstd * (dnorm - dnorm_mean - xhat * dnorm_norm_mean)` with
///   `dnorm_mean = mean(dnorm) = w * dbias / m` and
///   `dnorm_norm_mean = mean(dnorm * xhat) = w * dweight / m`;
/// - eval (running statistics are constants): `dx = dnorm * rstd`.
///
/// Returns `(dx, dweight, dbias)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bn_backward<C: FloatDType>(
    g: &[C],
    x: &[C],
    d: BatchNormGeom,
    mean: &[C],
    rstd: &[C],
    w: Option<&[C]>,
    training: bool,
    need_dx: bool,
) -> (Option<Vec<C>>, Vec<C>, Vec<C>) {
    let sums = par_map(d.c, d.m(), |ch| {
        let (mu, rs) = (mean[ch], rstd[ch]);
        let dbias = runs(d, g, ch).map(sum_slice).fold(C::zero(), |a, b| a + b);
        let dweight = runs(d, g, ch)
            .zip(runs(d, x, ch))
            .map(|(gr, xr)| sum_map2(gr, xr, |g, v| g * ((v - mu) * rs)))
            .fold(C::zero(), |a, b| a + b);
        (dweight, dbias)
    });
    let (dweight, dbias): (Vec<C>, Vec<C>) = sums.into_iter().unzip();
    if !need_dx {
        return (None, dweight, dbias);
    }
    let inv_m = C::one() / C::from_f64(d.m() as f64);
    let mut dx = vec![C::zero(); x.len()];
    let block = (d.c * d.s).max(1);
    dx.par_chunks_mut(block)
        .zip(g.par_chunks(block).zip(x.par_chunks(block)))
        .with_min_len((PAR_THRESHOLD / block).max(1))
        .for_each(|(o, (gb, xb))| {
            for ch in 0..d.c {
                let wc = w.map_or(C::one(), |w| w[ch]);
                let (mu, rs) = (mean[ch], rstd[ch]);
                let (o, gr, xr) = (
                    &mut o[ch * d.s..][..d.s],
                    &gb[ch * d.s..][..d.s],
                    &xb[ch * d.s..][..d.s],
                );
                if training {
                    let dnorm_mean = wc * dbias[ch] * inv_m;
                    let dnorm_norm_mean = wc * dweight[ch] * inv_m;
                    for ((o, &g), &v) in o.iter_mut().zip(gr).zip(xr) {
                        let xhat = (v - mu) * rs;
                        *o = rs * (g * wc - dnorm_mean - xhat * dnorm_norm_mean);
                    }
                } else {
                    for (o, &g) in o.iter_mut().zip(gr) {
                        *o = g * wc * rs;
                    }
                }
            }
        });
    (Some(dx), dweight, dbias)
}

/// Per-row mean and 1/sqrt(var + eps) of rows of `d` values (llm.c keeps the same two for
/// its backward), then `y = xhat * w + b`. Returns (y, mean, rstd).
pub(crate) fn ln_forward<C: FloatDType>(
    x: &[C],
    d: usize,
    w: Option<&[C]>,
    b: Option<&[C]>,
    eps: f64,
) -> (Vec<C>, Vec<C>, Vec<C>) {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let eps_c = C::from_f64(eps);
    let inv_d = C::one() / C::from_f64(d as f64);
    let stats: Vec<(C, C)> = par_map(rows, d, |r| {
        let row = &x[r * d..][..d];
        let mean = sum_slice(row) * inv_d;
        let var = sum_map(row, |v| (v - mean) * (v - mean)) * inv_d;
        (mean, C::one() / (var + eps_c).sqrt())
    });
    let mut out = vec![C::zero(); x.len()];
    let chunk = d.max(1);
    out.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .enumerate()
        .with_min_len((PAR_THRESHOLD / chunk).max(1))
        .for_each(|(r, (o, row))| {
            let (mean, rstd) = stats[r];
            for (j, (o, &v)) in o.iter_mut().zip(row).enumerate() {
                let xhat = (v - mean) * rstd;
                let w = w.as_ref().map_or(C::one(), |w| w[j]);
                let b = b.as_ref().map_or(C::zero(), |b| b[j]);
                *o = xhat * w + b;
            }
        });
    let (mean, rstd) = stats.into_iter().unzip();
    (out, mean, rstd)
}

/// Gradients of layer norm over rows of `d` values, given per-row `mean` and `rstd`.
///
/// Per row, with `dnorm = g * w` the gradient of `xhat`:
/// `dnorm_mean = mean(dnorm)`, `dnorm_norm_mean = mean(dnorm * xhat)`,
/// `dx = rstd * (dnorm - dnorm_mean - xhat * dnorm_norm_mean)`;
/// across rows, `dweight = Σ g * xhat` and `dbias = Σ g`.
///
/// Returns `(dx, dweight, dbias)`.
pub(crate) fn ln_backward<C: FloatDType>(
    g: &[C],
    x: &[C],
    d: usize,
    mean: &[C],
    rstd: &[C],
    w: Option<&[C]>,
    need_dx: bool,
) -> (Option<Vec<C>>, Vec<C>, Vec<C>) {
    let inv_d = C::one() / C::from_f64(d as f64);
    let mut dx = vec![C::zero(); if need_dx { x.len() } else { 0 }];
    // The parameters' gradients sum over rows: in runs fixed by the shape (each at least
    // `PAR_THRESHOLD` values), added in run order, so the thread count changes no bit.
    let rows = mean.len();
    let runs = Runs::new(rows, 1, (PAR_THRESHOLD / d.max(1)).max(1));
    // One run's partial: dweight in [..d], dbias in [d..].
    let row = |r: usize, dx_row: Option<&mut [C]>, acc: &mut [C]| {
        let (mean, rstd) = (mean[r], rstd[r]);
        let (gr, xr) = (&g[r * d..][..d], &x[r * d..][..d]);
        let (dweight, dbias) = acc.split_at_mut(d);
        for j in 0..d {
            dbias[j] += gr[j];
            dweight[j] += gr[j] * ((xr[j] - mean) * rstd);
        }
        let Some(o) = dx_row else { return };
        let wj = |j: usize| w.map_or(C::one(), |w| w[j]);
        let (mut dnorm_sum, mut dnorm_norm_sum) = (C::zero(), C::zero());
        for j in 0..d {
            let dnorm = gr[j] * wj(j);
            dnorm_sum += dnorm;
            dnorm_norm_sum += dnorm * ((xr[j] - mean) * rstd);
        }
        let (dnorm_mean, dnorm_norm_mean) = (dnorm_sum * inv_d, dnorm_norm_sum * inv_d);
        for j in 0..d {
            let xhat = (xr[j] - mean) * rstd;
            o[j] = rstd * (gr[j] * wj(j) - dnorm_mean - xhat * dnorm_norm_mean);
        }
    };
    let run = |r: usize, dx_run: Option<&mut [C]>| {
        let mut acc = vec![C::zero(); 2 * d];
        let rows = runs.range(r, mean.len());
        match dx_run {
            Some(dx_run) => {
                for (i, o) in rows.zip(dx_run.chunks_exact_mut(d)) {
                    row(i, Some(o), &mut acc);
                }
            }
            None => rows.for_each(|i| row(i, None, &mut acc)),
        }
        acc
    };
    let partials: Vec<Vec<C>> = if need_dx && d > 0 {
        dx.par_chunks_mut(runs.len * d)
            .enumerate()
            .map(|(r, o)| run(r, Some(o)))
            .collect()
    } else {
        runs.map(|r| run(r, None))
    };
    let mut dweight = add_in_order(partials, 2 * d);
    let dbias = dweight.split_off(d);
    (need_dx.then_some(dx), dweight, dbias)
}
