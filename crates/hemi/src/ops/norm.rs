//! Batch norm and layer norm, statistics in F32.
//!
//! Both normalise `xhat = (x - mean) * rstd` with `rstd = 1 / sqrt(var + eps)` and the
//! biased variance, then apply the affine `y = xhat * weight + bias`. Means, variances and
//! the sums of the backward are accumulated in the compute type (F32 for F16, BF16 and F32
//! inputs, F64 for F64), whatever the storage dtype; each result is rounded once.
//!
//! Dtypes: the output has the input's dtype. `weight`, `bias` and the running statistics
//! may have any float dtype and are read in the compute type: under mixed precision they
//! stay F32 while the activations are F16 or BF16 (autocast runs the normalisation on the
//! low-precision activations but never casts the norm's parameters), so an F16 input with
//! F32 parameters gives an F16 output, and the parameters' gradients come back in F32.
//!
//! The backward passes are the closed forms (as in llm.c's `layernorm_backward`), not a
//! chain of recorded ops; they are not differentiable a second time.

use rayon::prelude::*;

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use super::elementwise::PAR_THRESHOLD;
use super::reduce::sum_slice;
use crate::cpu::runs::{add_in_order, Runs};
use crate::dtype::WithDType as _;
use crate::error::{Error, Result};
use crate::tensor::{FloatDType, Tensor};

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

fn require_float(op: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(
            op,
            t.dtype(),
            format!("{what} must be a float tensor, got shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

fn check_eps(op: &'static str, eps: f64) -> Result<()> {
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::arg(
            op,
            format!("eps must be finite and >= 0, got {eps}"),
        ));
    }
    Ok(())
}

/// `weight` or `bias` (or a running statistic) must be a float tensor of `shape`.
fn check_param(
    op: &'static str,
    what: &str,
    p: Option<&Tensor>,
    shape: &[usize],
    x: &Tensor,
) -> Result<()> {
    let Some(p) = p else { return Ok(()) };
    require_float(op, what, p)?;
    if p.shape() != shape {
        return Err(Error::shape(
            op,
            format!(
                "{what} has shape {:?}, expected {shape:?} for input {:?}",
                p.shape(),
                x.shape()
            ),
        ));
    }
    Ok(())
}

// ----- batch norm -------------------------------------------------------------------------

/// A batch-norm input seen as `[n, c, s]`, `s` the product of the spatial dims: channel
/// `ch` holds the `n` contiguous runs `v[(i*c + ch)*s ..][..s]`.
#[derive(Clone, Copy, Debug)]
struct Ncs {
    n: usize,
    c: usize,
    s: usize,
}

impl Ncs {
    /// Values per channel (the batch-statistics count).
    fn m(self) -> usize {
        self.n * self.s
    }
    fn runs<C>(self, v: &[C], ch: usize) -> impl Iterator<Item = &[C]> {
        (0..self.n).map(move |i| &v[(i * self.c + ch) * self.s..][..self.s])
    }
}

/// Per-channel mean and biased variance (two passes: the variance sums squared deviations
/// from the mean, which does not cancel the way `E[x²] - E[x]²` does in F32).
fn bn_stats<C: FloatDType>(x: &[C], d: Ncs) -> (Vec<C>, Vec<C>) {
    let inv_m = C::one() / C::from_f64(d.m() as f64);
    let stats = par_map(d.c, d.m(), |ch| {
        let mean = d.runs(x, ch).map(sum_slice).fold(C::zero(), |a, b| a + b) * inv_m;
        let var = d
            .runs(x, ch)
            .map(|r| sum_map(r, |v| (v - mean) * (v - mean)))
            .fold(C::zero(), |a, b| a + b)
            * inv_m;
        (mean, var)
    });
    stats.into_iter().unzip()
}

/// `y = (x - mean[ch]) * (rstd[ch] * w[ch]) + b[ch]`.
fn bn_forward<C: FloatDType>(
    x: &[C],
    d: Ncs,
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
fn bn_backward<C: FloatDType>(
    g: &[C],
    x: &[C],
    d: Ncs,
    mean: &[C],
    rstd: &[C],
    w: Option<&[C]>,
    training: bool,
    need_dx: bool,
) -> (Option<Vec<C>>, Vec<C>, Vec<C>) {
    let sums = par_map(d.c, d.m(), |ch| {
        let (mu, rs) = (mean[ch], rstd[ch]);
        let dbias = d.runs(g, ch).map(sum_slice).fold(C::zero(), |a, b| a + b);
        let dweight = d
            .runs(g, ch)
            .zip(d.runs(x, ch))
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

/// Replaces `running`'s values by `(1 - momentum) * running + momentum * batch`, computed
/// in F64 and rounded once into `running`'s dtype.
fn update_running<C: FloatDType>(running: &Tensor, batch: &[C], momentum: f64) -> Result<()> {
    let new: Vec<f64> = running
        .to_vec_f64()
        .iter()
        .zip(batch)
        .map(|(&r, &b)| (1.0 - momentum) * r + momentum * b.to_f64())
        .collect();
    running.set_data(&Tensor::from_f64_vec(
        new,
        running.shape(),
        running.dtype(),
    )?)
}

impl Tensor {
    /// Batch normalisation of `self` `[N, C, *]` over every dim but the channel dim 1, with
    /// PyTorch's semantics (`torch.nn.functional.batch_norm`):
    ///
    /// - `training`: normalise with the batch statistics (mean and biased variance over N
    ///   and the spatial dims); when given, `running_mean` and `running_var` (`[C]`) are
    ///   updated in place (`set_data`) to `(1 - momentum) * running + momentum * batch`,
    ///   the running variance taking the unbiased batch variance. Needs more than one value
    ///   per channel.
    /// - eval: normalise with `running_mean` and `running_var`, which are then required.
    ///
    /// `weight` and `bias` (`[C]`) are optional. The statistics are computed in F32 (F64
    /// for F64 input); the output has the input's dtype even when the parameters are F32
    /// and the input F16 or BF16 (mixed precision keeps norm parameters in F32). The
    /// running statistics get no gradient.
    #[allow(clippy::too_many_arguments)] // mirrors torch.nn.functional.batch_norm
    pub fn batch_norm(
        &self,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<Tensor> {
        const OP: &str = "batch_norm";
        require_float(OP, "input", self)?;
        if self.rank() < 2 {
            return Err(Error::shape(
                OP,
                format!(
                    "input must be [N, C, *] (rank >= 2), got {:?}",
                    self.shape()
                ),
            ));
        }
        check_eps(OP, eps)?;
        if !momentum.is_finite() {
            return Err(Error::arg(
                OP,
                format!("momentum must be finite, got {momentum}"),
            ));
        }
        let shape = self.shape().to_vec();
        let d = Ncs {
            n: shape[0],
            c: shape[1],
            s: shape[2..].iter().product(),
        };
        let cs = [d.c];
        check_param(OP, "weight", weight, &cs, self)?;
        check_param(OP, "bias", bias, &cs, self)?;
        check_param(OP, "running_mean", running_mean, &cs, self)?;
        check_param(OP, "running_var", running_var, &cs, self)?;
        let running = match (running_mean, running_var) {
            (Some(m), Some(v)) => Some((m, v)),
            (None, None) => None,
            _ => {
                return Err(Error::arg(
                    OP,
                    "give both running_mean and running_var, or neither",
                ))
            }
        };
        if training && d.m() <= 1 {
            return Err(Error::shape(
                OP,
                format!(
                    "training needs more than one value per channel, got input {:?}",
                    shape
                ),
            ));
        }
        if !training && running.is_none() {
            return Err(Error::arg(
                OP,
                "eval mode (training = false) needs running_mean and running_var",
            ));
        }

        let dtype = self.dtype();
        crate::with_compute!(dtype, C => {
            let x = self.values::<C>();
            let (mean, var) = if training {
                let (mean, var) = bn_stats(&x, d);
                if let Some((rm, rv)) = running {
                    let m = d.m() as f64;
                    let unbiased: Vec<f64> = var.iter().map(|&v| v.to_f64() * m / (m - 1.0)).collect();
                    update_running(rm, &mean, momentum)?;
                    update_running(rv, &unbiased, momentum)?;
                }
                (mean, var)
            } else {
                let (rm, rv) = running.expect("checked above");
                (rm.values::<C>(), rv.values::<C>())
            };
            let eps_c = C::from_f64(eps);
            let rstd: Vec<C> = var.iter().map(|&v| C::one() / (v + eps_c).sqrt()).collect();
            let wv = weight.map(|w| w.values::<C>());
            let bv = bias.map(|b| b.values::<C>());
            let out = bn_forward(&x, d, &mean, &rstd, wv.as_deref(), bv.as_deref());

            let mut inputs = vec![self];
            inputs.extend(weight);
            inputs.extend(bias);
            let saved_x = self.detach();
            let need_dx = self.requires_grad();
            let (w_dtype, b_dtype) = (weight.map(|w| w.dtype()), bias.map(|b| b.dtype()));
            Ok(Tensor::from_compute(out, self.shape(), dtype, OP, &inputs, move |g| {
                let gv = g.values::<C>();
                let xv = saved_x.values::<C>();
                let (dx, dweight, dbias) =
                    bn_backward(&gv, &xv, d, &mean, &rstd, wv.as_deref(), training, need_dx);
                let mut grads = vec![dx.map(|dx| Tensor::from_values(dx, &shape, dtype))];
                if let Some(wd) = w_dtype {
                    grads.push(Some(Tensor::from_values(dweight, &[d.c], wd)));
                }
                if let Some(bd) = b_dtype {
                    grads.push(Some(Tensor::from_values(dbias, &[d.c], bd)));
                }
                Ok(grads)
            }))
        })
    }

    /// Layer normalisation over the trailing dims `normalized_shape` (PyTorch's
    /// `torch.nn.functional.layer_norm`): each row of `D = prod(normalized_shape)` values
    /// is normalised with its own mean and biased variance, then scaled by `weight` and
    /// shifted by `bias` (both of shape `normalized_shape`, optional). Statistics in F32
    /// (F64 for F64 input); the output has the input's dtype, whatever the parameters'
    /// float dtype (as for `batch_norm`).
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm";
        require_float(OP, "input", self)?;
        if let Some(dt) = super::autocast::target(OP, &[Some(self), weight, bias]) {
            use super::autocast::{cast, cast_opt};
            let (w, b) = (cast_opt(weight, dt)?, cast_opt(bias, dt)?);
            return cast(self, dt)?.layer_norm(normalized_shape, w.as_ref(), b.as_ref(), eps);
        }
        check_eps(OP, eps)?;
        let shape = self.shape().to_vec();
        let k = normalized_shape.len();
        if k == 0 || k > shape.len() || shape[shape.len() - k..] != *normalized_shape {
            return Err(Error::shape(
                OP,
                format!(
                    "normalized_shape {normalized_shape:?} must be non-empty and end the \
                     input shape {shape:?}"
                ),
            ));
        }
        check_param(OP, "weight", weight, normalized_shape, self)?;
        check_param(OP, "bias", bias, normalized_shape, self)?;
        let d: usize = normalized_shape.iter().product();
        let rows = self.numel().checked_div(d).unwrap_or(0);
        let dtype = self.dtype();
        crate::with_compute!(dtype, C => {
            let x = self.values::<C>();
            let eps_c = C::from_f64(eps);
            let inv_d = C::one() / C::from_f64(d as f64);
            // Per row: mean and rstd (llm.c keeps the same two for its backward).
            let stats: Vec<(C, C)> = par_map(rows, d, |r| {
                let row = &x[r * d..][..d];
                let mean = sum_slice(row) * inv_d;
                let var = sum_map(row, |v| (v - mean) * (v - mean)) * inv_d;
                (mean, C::one() / (var + eps_c).sqrt())
            });
            let wv = weight.map(|w| w.values::<C>());
            let bv = bias.map(|b| b.values::<C>());
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
                        let w = wv.as_ref().map_or(C::one(), |w| w[j]);
                        let b = bv.as_ref().map_or(C::zero(), |b| b[j]);
                        *o = xhat * w + b;
                    }
                });

            let mut inputs = vec![self];
            inputs.extend(weight);
            inputs.extend(bias);
            let saved_x = self.detach();
            let need_dx = self.requires_grad();
            let (w_dtype, b_dtype) = (weight.map(|w| w.dtype()), bias.map(|b| b.dtype()));
            let pshape = normalized_shape.to_vec();
            Ok(Tensor::from_compute(out, self.shape(), dtype, OP, &inputs, move |g| {
                let gv = g.values::<C>();
                let xv = saved_x.values::<C>();
                let (dx, dweight, dbias) = ln_backward(&gv, &xv, d, &stats, wv.as_deref(), need_dx);
                let mut grads = vec![dx.map(|dx| Tensor::from_values(dx, &shape, dtype))];
                if let Some(wd) = w_dtype {
                    grads.push(Some(Tensor::from_values(dweight, &pshape, wd)));
                }
                if let Some(bd) = b_dtype {
                    grads.push(Some(Tensor::from_values(dbias, &pshape, bd)));
                }
                Ok(grads)
            }))
        })
    }
}

/// Gradients of layer norm over rows of `d` values, given per-row `(mean, rstd)`.
///
/// Per row, with `dnorm = g * w` the gradient of `xhat`:
/// `dnorm_mean = mean(dnorm)`, `dnorm_norm_mean = mean(dnorm * xhat)`,
/// `dx = rstd * (dnorm - dnorm_mean - xhat * dnorm_norm_mean)`;
/// across rows, `dweight = Σ g * xhat` and `dbias = Σ g`.
///
/// Returns `(dx, dweight, dbias)`.
fn ln_backward<C: FloatDType>(
    g: &[C],
    x: &[C],
    d: usize,
    stats: &[(C, C)],
    w: Option<&[C]>,
    need_dx: bool,
) -> (Option<Vec<C>>, Vec<C>, Vec<C>) {
    let inv_d = C::one() / C::from_f64(d as f64);
    let mut dx = vec![C::zero(); if need_dx { x.len() } else { 0 }];
    // The parameters' gradients sum over rows: in runs fixed by the shape (each at least
    // `PAR_THRESHOLD` values), added in run order, so the thread count changes no bit.
    let rows = stats.len();
    let runs = Runs::new(rows, 1, (PAR_THRESHOLD / d.max(1)).max(1));
    // One run's partial: dweight in [..d], dbias in [d..].
    let row = |r: usize, dx_row: Option<&mut [C]>, acc: &mut [C]| {
        let (mean, rstd) = stats[r];
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
        let rows = runs.range(r, stats.len());
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
