//! Batch-norm and layer-norm kernels over contiguous buffers in the compute type (F32, or
//! F64 for F64 tensors), forward and the closed-form backward (as llm.c's
//! `layernorm_backward`), parallel over channels or rows. No autograd and no validation:
//! `ops/norm.rs` checks the shapes, `cpu::ops::nn` converts and rounds.

#[doc(hidden)]
pub mod in_place;

use crate::backend::nn::BatchNormGeom;
use crate::cpu::chunked;
use crate::cpu::elementwise::map::PAR_THRESHOLD;

// The per-channel constants of the forward's elementwise pass (shared with the AVX-512 loops).
use crate::cpu::norm::in_place::Apply as BnApply;
use crate::cpu::reduce::sum_slice;
use crate::cpu::runs::{add_in_order, Runs};
use crate::dtype::{same_slice_mut, WithDType};
use crate::tensor::FloatDType;

/// Channel `ch` of a `[n, c, s]` buffer: the `n` contiguous runs `v[(i*c + ch)*s ..][..s]`.
fn runs<C>(d: BatchNormGeom, v: &[C], ch: usize) -> impl Iterator<Item = &[C]> {
    (0..d.n).map(move |i| &v[(i * d.c + ch) * d.s..][..d.s])
}

/// `Σ f(x[i])` over a contiguous slice with eight accumulators (as `sum_slice`).
#[inline(always)]
#[doc(hidden)]
pub fn sum_map<C: FloatDType>(x: &[C], f: impl Fn(C) -> C) -> C {
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
    crate::threads::nudge();
    chunked::map_collect(count, min_len, || (), |_, i| f(i))
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
    crate::threads::nudge();
    let min_len = (PAR_THRESHOLD / block).max(1);
    chunked::for_each_chunk_min(&mut out, block, min_len, &|i, o| {
        let xb = chunked::chunk(x, i, block);
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
    crate::threads::nudge();
    let min_len = (PAR_THRESHOLD / block).max(1);
    chunked::for_each_chunk_min(&mut dx, block, min_len, &|i, o| {
        let (gb, xb) = (chunked::chunk(g, i, block), chunked::chunk(x, i, block));
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
///
/// One pass per row (statistics and output while the row is in L1), on the widest vector
/// unit for F32: the same operations in the same order at every width, so the same bits.
pub(crate) fn ln_forward<C: FloatDType>(
    x: &[C],
    d: usize,
    w: Option<&[C]>,
    b: Option<&[C]>,
    eps: f64,
) -> (Vec<C>, Vec<C>, Vec<C>) {
    let rows = x.len().checked_div(d).unwrap_or(0);
    let eps_c = C::from_f64(eps);
    let mut out = vec![C::zero(); x.len()];
    let (mut mean, mut rstd) = (vec![C::zero(); rows], vec![C::zero(); rows]);
    let chunk = d.max(1);
    crate::threads::nudge();
    // One chunk of `out` and one element of `mean` and `rstd` per row.
    let min_len = (PAR_THRESHOLD / chunk).max(1);
    chunked::for_each_chunk3_init(
        (&mut out, chunk),
        (&mut mean, 1),
        (&mut rstd, 1),
        min_len,
        || (),
        &|_, i, o, m, r| (m[0], r[0]) = ln_row(chunked::chunk(x, i, chunk), o, w, b, eps_c),
    );
    (out, mean, rstd)
}

/// One row of `ln_forward`: (mean, rstd), the output written to `o`.
#[inline(always)]
#[doc(hidden)]
pub fn ln_row_impl<C: FloatDType>(
    row: &[C],
    o: &mut [C],
    w: Option<&[C]>,
    b: Option<&[C]>,
    eps: C,
) -> (C, C) {
    let inv_d = C::one() / C::from_f64(row.len() as f64);
    let mean = sum_slice(row) * inv_d;
    let var = sum_map(row, |v| (v - mean) * (v - mean)) * inv_d;
    let rstd = C::one() / (var + eps).sqrt();
    let xhat = |v: C| (v - mean) * rstd;
    match (w, b) {
        (Some(w), Some(b)) => {
            for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(w).zip(b) {
                *o = xhat(v) * w + b;
            }
        }
        (Some(w), None) => {
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(w) {
                *o = xhat(v) * w + C::zero();
            }
        }
        (None, Some(b)) => {
            for ((o, &v), &b) in o.iter_mut().zip(row).zip(b) {
                *o = xhat(v) * C::one() + b;
            }
        }
        (None, None) => {
            for (o, &v) in o.iter_mut().zip(row) {
                *o = xhat(v) * C::one() + C::zero();
            }
        }
    }
    (mean, rstd)
}

/// `(1 - momentum) * running + momentum * batch` in F64: a running mean or variance after
/// a training batch.
pub(crate) fn blend_running<B: WithDType>(running: &[f64], batch: &[B], momentum: f64) -> Vec<f64> {
    running
        .iter()
        .zip(batch)
        .map(|(&r, &b)| (1.0 - momentum) * r + momentum * b.to_f64())
        .collect()
}

/// The unbiased variances (Bessel's correction over `m` values each) of biased ones, in F64.
pub(crate) fn unbiased_var<C: WithDType>(var: &[C], m: f64) -> Vec<f64> {
    var.iter().map(|&v| v.to_f64() * m / (m - 1.0)).collect()
}

/// `1 / sqrt(var + eps)` per channel, in the compute type.
pub(crate) fn inv_std<C: FloatDType>(var: &[C], eps: f64) -> Vec<C> {
    let eps_c = C::from_f64(eps);
    var.iter().map(|&v| C::one() / (v + eps_c).sqrt()).collect()
}

/// `ln_row_impl` compiled for AVX2 and AVX-512 F (F32).
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod wide {
    macro_rules! at {
        ($feat:literal, $name:ident) => {
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(
                row: &[f32],
                o: &mut [f32],
                w: Option<&[f32]>,
                b: Option<&[f32]>,
                eps: f32,
            ) -> (f32, f32) {
                super::ln_row_impl(row, o, w, b, eps)
            }
        };
    }
    at!("avx512f", ln_row_avx512);
    at!("avx2", ln_row_avx2);

    macro_rules! elementwise_at {
        ($feat:literal, $mask:ident, $dx:ident) => {
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub unsafe fn $mask(o: &mut [f32], g: &[f32], y: &[f32]) {
                super::relu_mask_impl(o, g, y)
            }

            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub unsafe fn $dx(o: &mut [f32], g: &[f32], x: &[f32], k: super::DxTrain) {
                super::dx_train_impl(o, g, x, k)
            }
        };
    }
    elementwise_at!("avx512f", relu_mask_avx512, dx_train_avx512);
    elementwise_at!("avx2", relu_mask_avx2, dx_train_avx2);

    macro_rules! apply_at {
        ($feat:literal, $name:ident) => {
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(o: &mut [f32], x: &[f32], r: Option<&[f32]>, k: super::BnApply) {
                super::bn_apply_impl(o, x, r, k)
            }
        };
    }
    apply_at!("avx512f", bn_apply_avx512);
    apply_at!("avx2", bn_apply_avx2);

    /// `relu_sums` with its eight accumulators in one AVX2 register each: the same products,
    /// sums and order per lane as `relu_sums_impl` (the compiler had left that loop mostly
    /// scalar), so the same bits. It is `in_place`'s F32 loop (AVX-only instructions)
    /// built for AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2; `y` (when given) and `x` are at least as long as `g`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn relu_sums_avx2(
        g: &[f32],
        y: Option<&[f32]>,
        x: &[f32],
        mu: f32,
        rs: f32,
    ) -> (f32, f32) {
        assert!(x.len() >= g.len() && y.is_none_or(|y| y.len() >= g.len()));
        // SAFETY: AVX2 (this function's feature); lengths asserted above.
        unsafe { crate::cpu::norm::in_place::x86::relu_sums_imp::<f32>(g, y, x, mu, rs) }
    }
}

/// `ln_row_impl`, on the widest vector unit for F32.
#[doc(hidden)]
pub fn ln_row<C: FloatDType>(
    row: &[C],
    o: &mut [C],
    w: Option<&[C]>,
    b: Option<&[C]>,
    eps: C,
) -> (C, C) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::elementwise::map::{f32_opt, vector_level, VectorLevel};
        let level = vector_level();
        if let (Some(r32), Some(o32), Some(w32), Some(b32), true) = (
            C::as_f32(row),
            C::as_f32_mut(o),
            f32_opt(w),
            f32_opt(b),
            level != VectorLevel::Baseline,
        ) {
            let e = eps.to_f64() as f32;
            // SAFETY: the CPU has the features (`vector_level`).
            let (m, r) = unsafe {
                if level == VectorLevel::Avx512 {
                    wide::ln_row_avx512(r32, o32, w32, b32, e)
                } else {
                    wide::ln_row_avx2(r32, o32, w32, b32, e)
                }
            };
            return (C::from_f64(f64::from(m)), C::from_f64(f64::from(r)));
        }
    }
    ln_row_impl(row, o, w, b, eps)
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
    crate::threads::nudge();
    let partials: Vec<Vec<C>> = if need_dx && d > 0 {
        chunked::map_chunks(&mut dx, runs.len * d, || (), &|_, r, o| run(r, Some(o)))
    } else {
        runs.map(|r| run(r, None))
    };
    let mut dweight = add_in_order(partials, 2 * d);
    let dbias = dweight.split_off(d);
    (need_dx.then_some(dx), dweight, dbias)
}

// ----- Batch norm over F32/F16/BF16 storage, fused with a residual add and a ReLU ----------
//
// The kernels below read the tensor's own elements (a channel's run at a time, converted to
// F32 in a run-sized buffer for F16/BF16, borrowed for F32) and round each result once into
// the storage dtype, so under autocast no F32 copy of an activation or of its gradient is
// ever made. They compute exactly what `bn_stats` / `bn_forward` / `bn_backward` compute in
// F32 (same sums in the same order), followed by `+ residual` and `relu` as the separate
// ops do them: for F32 the fused op gives the bits of the unfused composition.

/// Run `i` (image) of channel `ch` of a `[n, c, s]` buffer.
fn run_of<T>(d: BatchNormGeom, v: &[T], i: usize, ch: usize) -> &[T] {
    &v[(i * d.c + ch) * d.s..][..d.s]
}

/// Run `i` (image) of channel `ch` of a `[n, c, s]` buffer as F32 (borrowed for F32).
fn run_f32<'b, T: WithDType>(
    d: BatchNormGeom,
    v: &'b [T],
    i: usize,
    ch: usize,
    buf: &'b mut [f32],
) -> &'b [f32] {
    chunked::read(v, (i * d.c + ch) * d.s, &mut buf[..d.s])
}

/// `relu` as the unary op computes it (NaN passes through).
#[inline(always)]
fn relu_f32(z: f32) -> f32 {
    if z > 0.0 || z.is_nan() {
        z
    } else {
        0.0
    }
}

/// `f(scratch, i, ch)` for every run (image `i`, channel `ch`) of a `[n, c, s]` geometry,
/// image by image in parallel: `out[i * c + ch]`, with one `init()` scratch per rayon task.
/// Callers read the runs in memory order (a channel-major walk jumps `c·s` elements between
/// runs of `s`, as short as 64 elements in a ResNet's last stage) and compute each run's
/// value on its own, so folding a channel's runs in image order gives the same bits as a
/// channel-major loop.
fn per_run<R: Copy + Default + Send, S>(
    d: BatchNormGeom,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, usize) -> R + Sync + Send,
) -> Vec<R> {
    let mut out = vec![R::default(); d.n * d.c];
    if d.c == 0 {
        return out;
    }
    let block = (d.c * d.s).max(1);
    crate::threads::nudge();
    let min_len = (PAR_THRESHOLD / block).max(1);
    chunked::for_each_chunk_init(&mut out, d.c, min_len, init, &|scratch, i, o| {
        for (ch, o) in o.iter_mut().enumerate() {
            *o = f(scratch, i, ch);
        }
    });
    out
}

/// `f(ch, run)` for every run of `v` as F32 (`per_run`).
fn per_run_f32<T: WithDType>(
    d: BatchNormGeom,
    v: &[T],
    f: impl Fn(usize, &[f32]) -> f32 + Sync + Send,
) -> Vec<f32> {
    per_run(
        d,
        || vec![0f32; d.s],
        |buf, i, ch| f(ch, run_f32(d, v, i, ch, buf)),
    )
}

/// Channel `ch`'s values of `per_run`'s output, added in image order from zero.
fn fold_runs(d: BatchNormGeom, runs: &[f32], ch: usize) -> f32 {
    (0..d.n).fold(0f32, |acc, i| acc + runs[i * d.c + ch])
}

/// `bn_stats` over F32/F16/BF16 elements, in F32: each run's sum (then its sum of squared
/// deviations) on its own, the runs of a channel added in image order.
pub(crate) fn bn_stats_t<T: WithDType>(x: &[T], d: BatchNormGeom) -> (Vec<f32>, Vec<f32>) {
    let inv_m = 1.0 / d.m() as f32;
    let direct = in_place::level();
    let sums = if let Some(l) = direct {
        // SAFETY: `level()` found `l` available.
        per_run(
            d,
            || (),
            |_, i, ch| unsafe { in_place::sum(l, run_of(d, x, i, ch)) },
        )
    } else {
        per_run_f32(d, x, |_, r| sum_slice(r))
    };
    let mean: Vec<f32> = (0..d.c).map(|ch| fold_runs(d, &sums, ch) * inv_m).collect();
    let sq = if let Some(l) = direct {
        per_run(
            d,
            || (),
            // SAFETY: `level()` found `l` available.
            |_, i, ch| unsafe { in_place::sq_dev(l, run_of(d, x, i, ch), mean[ch]) },
        )
    } else {
        per_run_f32(d, x, |ch, r| {
            let mu = mean[ch];
            sum_map(r, |v| (v - mu) * (v - mu))
        })
    };
    let var = (0..d.c).map(|ch| fold_runs(d, &sq, ch) * inv_m).collect();
    (mean, var)
}

/// Writes `f(out)` into `o`: straight into it for F32, else into `buf` rounded into it.
#[inline]
fn emit<T: WithDType>(o: &mut [T], buf: &mut [f32], f: impl FnOnce(&mut [f32])) {
    if let Some(o) = same_slice_mut::<T, f32>(o) {
        f(o);
    } else {
        let buf = &mut buf[..o.len()];
        f(buf);
        chunked::write(buf, o);
    }
}

/// `y = act((x - mean) * (rstd * w) + b [+ residual])` per channel, `act` ReLU or none, in
/// F32, rounded once into `T`. Parallel over images.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bn_act_forward<T: WithDType>(
    x: &[T],
    residual: Option<&[T]>,
    d: BatchNormGeom,
    mean: &[f32],
    rstd: &[f32],
    w: Option<&[f32]>,
    b: Option<&[f32]>,
    relu: bool,
) -> Vec<T> {
    let block = (d.c * d.s).max(1);
    let (n_blocks, min_len) = (x.len() / block, (PAR_THRESHOLD / block).max(1));
    let k = |ch: usize| BnApply {
        mu: mean[ch],
        scale: rstd[ch] * w.map_or(1.0, |w| w[ch]),
        shift: b.map_or(0.0, |b| b[ch]),
        relu,
    };
    if let Some(l) = in_place::level() {
        let image = |_: &mut (), i, ob: &mut [_]| {
            for ch in 0..d.c {
                let rr = residual.map(|r| run_of(d, r, i, ch));
                let o = &mut ob[ch * d.s..][..d.s];
                // SAFETY: `level()` found `l` available.
                unsafe { in_place::apply(l, o, run_of(d, x, i, ch), rr, k(ch)) };
            }
        };
        // SAFETY: the runs of the channels tile each block, and `apply` writes every element
        // of its run.
        return unsafe { chunked::blocks_uninit(n_blocks, block, min_len, || (), image) };
    }
    chunked::blocks_zeroed(
        n_blocks,
        block,
        min_len,
        || (vec![0f32; d.s], vec![0f32; d.s], vec![0f32; d.s]),
        |(bx, br, bo), i, ob| {
            for ch in 0..d.c {
                let xr = run_f32(d, x, i, ch, bx);
                let rr = residual.map(|r| run_f32(d, r, i, ch, br));
                emit(&mut ob[ch * d.s..][..d.s], bo, |o| {
                    bn_apply(o, xr, rr, k(ch))
                });
            }
        },
    )
}

/// The gradients of `bn_act_forward`.
pub(crate) struct BnActGrads<T> {
    pub dx: Option<Vec<T>>,
    /// The residual's gradient: the output gradient through the ReLU.
    pub dres: Option<Vec<T>>,
    pub dweight: Vec<f32>,
    pub dbias: Vec<f32>,
}

/// Calls the AVX-512 or AVX2 build of an elementwise loop where the CPU has it (one
/// detection, cached), else the portable loop: `widest!(avx512, avx2, portable, (args))`.
macro_rules! widest {
    ($avx512:path, $avx2:path, $portable:path, ($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            use crate::cpu::elementwise::map::{vector_level, VectorLevel};
            // SAFETY: the CPU has the features the build needs (`vector_level`).
            match vector_level() {
                VectorLevel::Avx512 => unsafe { $avx512($($arg),*) },
                VectorLevel::Avx2 => unsafe { $avx2($($arg),*) },
                VectorLevel::Baseline => $portable($($arg),*),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $portable($($arg),*)
        }
    }};
}

/// The output gradient through the ReLU (`g · [y > 0]`, as the ReLU's backward) into `buf`,
/// or `g` itself without one.
#[inline]
#[doc(hidden)]
pub fn through_relu<'b>(g: &'b [f32], y: Option<&[f32]>, buf: &'b mut [f32]) -> &'b [f32] {
    let Some(y) = y else { return g };
    let buf = &mut buf[..g.len()];
    widest!(
        wide::relu_mask_avx512,
        wide::relu_mask_avx2,
        relu_mask_impl,
        (buf, g, y)
    );
    buf
}

/// `o = g · [y > 0]` elementwise (the compiler vectorises it at the width it is built for;
/// elementwise, so every width gives the same bits).
#[inline(always)]
#[doc(hidden)]
pub fn relu_mask_impl(o: &mut [f32], g: &[f32], y: &[f32]) {
    for ((o, &g), &y) in o.iter_mut().zip(g).zip(y) {
        *o = g * if y > 0.0 { 1.0 } else { 0.0 };
    }
}

/// One run of the forward's output: `(x − mu)·scale + shift`, plus the residual, then the
/// ReLU (elementwise: the same bits at every vector width).
fn bn_apply(o: &mut [f32], x: &[f32], r: Option<&[f32]>, k: BnApply) {
    widest!(
        wide::bn_apply_avx512,
        wide::bn_apply_avx2,
        bn_apply_impl,
        (o, x, r, k)
    )
}

/// `bn_apply`'s loop, which the AVX2 and AVX-512 builds inline.
#[inline(always)]
#[doc(hidden)]
pub fn bn_apply_impl(o: &mut [f32], x: &[f32], r: Option<&[f32]>, k: BnApply) {
    let BnApply {
        mu,
        scale,
        shift,
        relu,
    } = k;
    for (o, &v) in o.iter_mut().zip(x) {
        *o = (v - mu) * scale + shift;
    }
    if let Some(r) = r {
        for (o, &r) in o.iter_mut().zip(r) {
            *o += r;
        }
    }
    if relu {
        for o in o.iter_mut() {
            *o = relu_f32(*o);
        }
    }
}

/// The per-channel constants of the training-mode input gradient.
#[derive(Clone, Copy)]
#[doc(hidden)]
pub struct DxTrain {
    pub mu: f32,
    pub rs: f32,
    pub wc: f32,
    pub dm: f32,
    pub dn: f32,
}

/// `o = rs · (g·wc − dm − xhat·dn)` with `xhat = (x − mu)·rs`: batch norm's input gradient
/// in training, one run (elementwise: the same bits at every vector width).
fn dx_train(o: &mut [f32], g: &[f32], x: &[f32], k: DxTrain) {
    widest!(
        wide::dx_train_avx512,
        wide::dx_train_avx2,
        dx_train_impl,
        (o, g, x, k)
    )
}

/// `dx_train`'s loop, which the AVX2 and AVX-512 builds inline.
#[inline(always)]
#[doc(hidden)]
pub fn dx_train_impl(o: &mut [f32], g: &[f32], x: &[f32], k: DxTrain) {
    let DxTrain { mu, rs, wc, dm, dn } = k;
    for ((o, &g), &v) in o.iter_mut().zip(g).zip(x) {
        let xhat = (v - mu) * rs;
        *o = rs * (g * wc - dm - xhat * dn);
    }
}

/// One run's `(Σ gz·xhat, Σ gz)` with `gz = g · [y > 0]` (`g` without `y`), in one loop:
/// each sum keeps its own eight accumulators, so the bits are those of `through_relu`
/// followed by `sum_map2` and `sum_slice`, without a buffer for `gz`.
fn relu_sums(g: &[f32], y: Option<&[f32]>, x: &[f32], mu: f32, rs: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::elementwise::map::{vector_level, VectorLevel};
        // SAFETY: the CPU has the features (`vector_level`).
        if vector_level() != VectorLevel::Baseline {
            return unsafe { wide::relu_sums_avx2(g, y, x, mu, rs) };
        }
    }
    relu_sums_impl(g, y, x, mu, rs)
}

/// `relu_sums` in plain Rust: lane `i` of the eight accumulators takes elements `i`, `i + 8`,
/// … in order (the AVX2 kernel's lanes), then `relu_sums_finish`.
#[doc(hidden)]
pub fn relu_sums_impl(g: &[f32], y: Option<&[f32]>, x: &[f32], mu: f32, rs: f32) -> (f32, f32) {
    let (mut aw, mut ab) = ([0f32; 8], [0f32; 8]);
    let full = g.len() / 8 * 8;
    let x = &x[..g.len()];
    if let Some(y) = y {
        assert_eq!(y.len(), g.len());
    }
    // Fixed-size chunks: no bounds checks inside.
    let xs = x[..full].chunks_exact(8);
    match y {
        Some(y) => {
            for ((g8, y8), x8) in g[..full].chunks_exact(8).zip(y.chunks_exact(8)).zip(xs) {
                for i in 0..8 {
                    let z = g8[i] * if y8[i] > 0.0 { 1.0 } else { 0.0 };
                    ab[i] += z;
                    aw[i] += z * ((x8[i] - mu) * rs);
                }
            }
        }
        None => {
            for (g8, x8) in g[..full].chunks_exact(8).zip(xs) {
                for i in 0..8 {
                    let z = g8[i];
                    ab[i] += z;
                    aw[i] += z * ((x8[i] - mu) * rs);
                }
            }
        }
    }
    relu_sums_finish(aw, ab, g, y, x, mu, rs)
}

/// The eight lanes folded pairwise, then the elements past the last multiple of eight.
#[inline(always)]
fn relu_sums_finish(
    aw: [f32; 8],
    ab: [f32; 8],
    g: &[f32],
    y: Option<&[f32]>,
    x: &[f32],
    mu: f32,
    rs: f32,
) -> (f32, f32) {
    let fold = |a: [f32; 8]| ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    let (mut sw, mut sb) = (fold(aw), fold(ab));
    for j in g.len() / 8 * 8..g.len() {
        let z = match y {
            Some(y) => g[j] * if y[j] > 0.0 { 1.0 } else { 0.0 },
            None => g[j],
        };
        sb += z;
        sw += z * ((x[j] - mu) * rs);
    }
    (sw, sb)
}

/// Gradients of `bn_act_forward` from the output gradient `g`, the output `y` (when the
/// ReLU was applied) and the input `x`: two passes, the per-channel sums (each run summed
/// on its own in parallel over images, a channel's runs added in image order: no dependence
/// on the thread count) and then the elementwise `dx` (the closed form of `bn_backward`) and
/// the residual's gradient.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bn_act_backward<T: WithDType>(
    g: &[T],
    y: Option<&[T]>,
    x: &[T],
    d: BatchNormGeom,
    mean: &[f32],
    rstd: &[f32],
    w: Option<&[f32]>,
    training: bool,
    need_dx: bool,
    need_dres: bool,
) -> BnActGrads<T> {
    // Each run's (Σ g·xhat, Σ g) through the ReLU, in memory order; a channel's runs added
    // in image order.
    let direct = in_place::level();
    let s_buf = if direct.is_some() { 0 } else { d.s };
    let pairs = per_run(
        d,
        || std::array::from_fn::<_, 3, _>(|_| vec![0f32; s_buf]),
        |[bg, by, bx], i, ch| {
            if let Some(l) = direct {
                let yr = y.map(|y| run_of(d, y, i, ch));
                let (gr, xr) = (run_of(d, g, i, ch), run_of(d, x, i, ch));
                // SAFETY: `level()` found `l` available; the runs are `d.s` long.
                return unsafe { in_place::relu_sums(l, gr, yr, xr, mean[ch], rstd[ch]) };
            }
            let gr = run_f32(d, g, i, ch, bg);
            let yr = y.map(|y| run_f32(d, y, i, ch, by));
            let xr = run_f32(d, x, i, ch, bx);
            relu_sums(gr, yr, xr, mean[ch], rstd[ch])
        },
    );
    let sums: Vec<(f32, f32)> = (0..d.c)
        .map(|ch| {
            (0..d.n).fold((0f32, 0f32), |(w, b), i| {
                let (pw, pb) = pairs[i * d.c + ch];
                (w + pw, b + pb)
            })
        })
        .collect();
    let (dweight, dbias): (Vec<f32>, Vec<f32>) = sums.into_iter().unzip();
    if !need_dx && !need_dres {
        return BnActGrads {
            dx: None,
            dres: None,
            dweight,
            dbias,
        };
    }
    let inv_m = 1.0 / d.m() as f32;
    let block = (d.c * d.s).max(1);
    let n = d.n;
    let image =
        |i: usize, dxb: Option<&mut [T]>, drb: Option<&mut [T]>, bufs: &mut [Vec<f32>; 5]| {
            let [bg, by, bx, bz, bo] = bufs;
            let (mut dxb, mut drb) = (dxb, drb);
            for ch in 0..d.c {
                let gr = run_f32(d, g, i, ch, bg);
                let yr = y.map(|y| run_f32(d, y, i, ch, by));
                let gz = through_relu(gr, yr, bz);
                if let Some(drb) = drb.as_deref_mut() {
                    chunked::write(gz, &mut drb[ch * d.s..][..d.s]);
                }
                let Some(dxb) = dxb.as_deref_mut() else {
                    continue;
                };
                let wc = w.map_or(1.0, |w| w[ch]);
                let (mu, rs) = (mean[ch], rstd[ch]);
                let o = &mut dxb[ch * d.s..][..d.s];
                if training {
                    let xr = run_f32(d, x, i, ch, bx);
                    let dnorm_mean = wc * dbias[ch] * inv_m;
                    let dnorm_norm_mean = wc * dweight[ch] * inv_m;
                    let k = DxTrain {
                        mu,
                        rs,
                        wc,
                        dm: dnorm_mean,
                        dn: dnorm_norm_mean,
                    };
                    emit(o, bo, |o| dx_train(o, gz, xr, k));
                } else {
                    emit(o, bo, |o| {
                        for (o, &g) in o.iter_mut().zip(gz) {
                            *o = g * wc * rs;
                        }
                    });
                }
            }
        };
    let init = || std::array::from_fn::<_, 5, _>(|_| vec![0f32; d.s]);
    let min_len = (PAR_THRESHOLD / block).max(1);
    let n_blocks = if d.c * d.s == 0 { 0 } else { n };
    let wants = (need_dx, need_dres);
    let (dx, dres) = if let Some(l) = direct {
        let k = |ch: usize| {
            let wc = w.map_or(1.0, |w| w[ch]);
            in_place::Dx {
                training,
                mu: mean[ch],
                rs: rstd[ch],
                wc,
                dm: wc * dbias[ch] * inv_m,
                dn: wc * dweight[ch] * inv_m,
            }
        };
        let image = |_: &mut (), i, mut o: Option<&mut [_]>, mut r: Option<&mut [_]>| {
            for ch in 0..d.c {
                let run = ch * d.s..(ch + 1) * d.s;
                let yr = y.map(|y| run_of(d, y, i, ch));
                let (gr, xr) = (run_of(d, g, i, ch), run_of(d, x, i, ch));
                let o = o.as_deref_mut().map(|b| &mut b[run.clone()]);
                let r = r.as_deref_mut().map(|b| &mut b[run]);
                // SAFETY: `level()` found `l` available.
                unsafe { in_place::dx(l, gr, yr, xr, k(ch), o, r) };
            }
        };
        // SAFETY: the runs of the channels tile each block, and `dx` writes every element
        // of the runs it is given.
        unsafe { chunked::blocks_uninit2(n_blocks, block, wants, min_len, || (), image) }
    } else {
        chunked::blocks_zeroed2(n_blocks, block, wants, min_len, init, |b, i, o, r| {
            image(i, o, r, b)
        })
    };
    BnActGrads {
        dx: need_dx.then_some(dx),
        dres: need_dres.then_some(dres),
        dweight,
        dbias,
    }
}
