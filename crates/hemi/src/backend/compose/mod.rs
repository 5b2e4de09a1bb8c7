//! Default compositions: the fused primitives written with the basic ones, as burn's
//! backend traits give derived ops default bodies. They are the default bodies of the fused
//! primitives in `nn` (a backend that implements only the basic primitives gets them), and
//! the definition a backend's fused kernel is held to: the kernel tests run each CPU
//! override against the composition here on the same inputs (`tests/kernels/compose.rs`).
//!
//! A composition rounds where its parts round: `batch_norm_act` rounds the norm's output
//! into the storage dtype before the residual and the ReLU, where the CPU's fused kernel
//! rounds once, so on F16/BF16 the two agree to one rounding of the dtype, on F32 to a few
//! F32 ulps.

pub mod attention;
pub mod loss;
pub mod optim;
pub mod pool;

use crate::backend::loss::Reduction;
use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::{
    Act, ActSaved, Affine, BatchNorm, BatchNormGeom, BatchNormMode, BlockGrads, Conv2dGeom,
    GradDTypes, Grads, Indices, LayerNorm, NnOps, Opt, Pool2dGeom, Running, Saved, View,
};
use crate::backend::reduce::{ReduceOp, ReduceOps, Rows};
use crate::backend::train::{AmpOps, Log2Histogram};
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// A batch-norm input `[n, c, s]`, row-major from `offset`.
fn ncs(g: BatchNormGeom, offset: usize) -> Layout {
    Layout::new(vec![g.n, g.c, g.s], vec![g.c * g.s, g.s, 1], offset)
}

/// A per-channel vector `[c]` (layout `l`) broadcast over `[n, c, s]`.
fn per_channel(l: &Layout, g: BatchNormGeom) -> Layout {
    Layout::new(vec![g.n, g.c, g.s], vec![0, l.strides()[0], 0], l.offset())
}

/// `relu(batch_norm(x) + residual)`: `NnOps::batch_norm`, then `binary` add and `unary`
/// ReLU, each rounded into `x`'s dtype.
pub fn batch_norm_act<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: BatchNormGeom,
    Act { residual, relu }: Act<'_, B>,
    affine: Affine<'_, B>,
    running: Running<'_, B>,
    mode: BatchNormMode,
) -> Result<BatchNorm<B>> {
    let dtype = x.dtype();
    let mut bn = x.batch_norm(l, g, affine, running, mode)?;
    let ly = Layout::contiguous(l.shape());
    if let Some((r, lr)) = residual {
        bn.out = bn.out.binary(&ly, r, lr, BinaryOp::Add, dtype)?;
    }
    if relu {
        bn.out = bn.out.unary(&ly, UnaryOp::Relu, dtype)?;
    }
    Ok(bn)
}

/// The gradients of `batch_norm_act`: the output gradient through the ReLU (`unary_backward`
/// with the output `y` as the saved value: `y > 0` exactly where the input of the ReLU is),
/// that into `batch_norm_backward`, and the same masked gradient for the residual.
pub fn batch_norm_act_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    ActSaved { y, want_residual }: ActSaved<'_, B>,
    (x, lx): View<'_, B>,
    g: BatchNormGeom,
    saved: Saved<'_, B>,
    dtypes: GradDTypes,
) -> Result<(Grads<B>, Option<B>)> {
    let masked = match y {
        Some((y, ly)) => dy.unary_backward(ldy, y, ly, UnaryOp::Relu, x.dtype())?,
        None => dy.cast(ldy, x.dtype())?,
    };
    let lg = Layout::contiguous(ldy.shape());
    let grads = masked.batch_norm_backward(&lg, (x, lx), g, saved, dtypes)?;
    Ok((grads, want_residual.then_some(masked)))
}

/// `batch_norm_act`'s output from given statistics: `((x - mean) · invstd) · weight + bias`,
/// per channel by broadcasting, in the compute type, rounded once into `x`'s dtype, then
/// the ReLU.
pub fn batch_norm_act_apply<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: BatchNormGeom,
    (mean, invstd): (&B, &B),
    Affine { weight, bias }: Affine<'_, B>,
    relu: bool,
) -> Result<B> {
    let dtype = x.dtype();
    let mut copy = None;
    let (x, off) = row_major(x, l, &mut copy)?;
    let lx = ncs(g, off);
    let out = Layout::contiguous(&[g.n, g.c, g.s]);
    let stat = per_channel(&Layout::contiguous(&[g.c]), g);
    let c = dtype.compute_type();
    let mut t = x.binary(&lx, mean, &stat, BinaryOp::Sub, c)?;
    // The last step rounds into the storage dtype; the ones before stay in F32.
    let steps = [
        Some((invstd, stat.clone(), BinaryOp::Mul)),
        weight.map(|(w, lw)| (w, per_channel(lw, g), BinaryOp::Mul)),
        bias.map(|(b, lb)| (b, per_channel(lb, g), BinaryOp::Add)),
    ];
    let steps: Vec<_> = steps.into_iter().flatten().collect();
    for (i, (v, lv, op)) in steps.iter().enumerate() {
        let to = if i + 1 == steps.len() { dtype } else { c };
        t = t.binary(&out, *v, lv, *op, to)?;
    }
    if relu {
        t = t.unary(&out, UnaryOp::Relu, dtype)?;
    }
    Ok(t)
}

/// What the composed `conv2d_relu_max_pool2` keeps for its backward: the pool's argmax and
/// the ReLU's output (its mask).
struct ConvReluPool<B> {
    argmax: Indices,
    relu: B,
}

/// The 2×2, stride-2 max pool of `conv2d_relu_max_pool2` over the convolution's output.
fn pool2(g: &Conv2dGeom) -> Pool2dGeom {
    Pool2dGeom {
        planes: g.n * g.c_out,
        h: g.h_out,
        w: g.w_out,
        kernel: (2, 2),
        stride: (2, 2),
        padding: (0, 0),
        h_out: g.h_out / 2,
        w_out: g.w_out / 2,
    }
}

/// `max_pool2d(relu(conv2d(x, w, bias)), 2, 2)`: `conv2d`, `unary` ReLU and `max_pool2d`,
/// each in the block's dtype.
pub fn conv2d_relu_max_pool2<B: NnOps + MapOps>(
    x: &B,
    lx: &Layout,
    w: &B,
    lw: &Layout,
    bias: Opt<'_, B>,
    g: &Conv2dGeom,
) -> Result<(B, Indices)> {
    let dtype = x.dtype();
    let ly = Layout::contiguous(&g.out_shape());
    let relu = x
        .conv2d(lx, w, lw, bias, g, dtype)?
        .unary(&ly, UnaryOp::Relu, dtype)?;
    let pooled = relu.max_pool2d(&ly, &pool2(g), false)?;
    let keep = ConvReluPool {
        argmax: pooled.argmax,
        relu,
    };
    Ok((pooled.out, Indices::new(keep)))
}

/// The gradients of `conv2d_relu_max_pool2`: `max_pool2d_backward`, the ReLU's
/// `unary_backward`, then the convolution's three backward primitives.
pub fn conv2d_relu_max_pool2_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    indices: &Indices,
    (x, lx): View<'_, B>,
    (w, lw): View<'_, B>,
    g: &Conv2dGeom,
    want: BlockGrads,
) -> Result<Grads<B>> {
    let (want_dx, has_bias) = (want.dx, want.bias);
    let keep: &ConvReluPool<B> = indices.get().ok_or_else(|| {
        Error::Msg(
            "conv2d_relu_max_pool2_backward: the indices are not from this backend's forward"
                .into(),
        )
    })?;
    let dtype = x.dtype();
    let ly = Layout::contiguous(&g.out_shape());
    let dr = dy.max_pool2d_backward(ldy, &keep.argmax, &pool2(g), dtype)?;
    let dconv = dr.unary_backward(&ly, &keep.relu, &ly, UnaryOp::Relu, dtype)?;
    Ok(Grads {
        dx: if want_dx {
            Some(dconv.conv2d_backward_input(&ly, w, lw, g, dtype)?)
        } else {
            None
        },
        dweight: Some(x.conv2d_backward_weight(lx, &dconv, &ly, g, dtype)?),
        dbias: if has_bias {
            Some(dconv.conv2d_backward_bias(&ly, g, dtype)?)
        } else {
            None
        },
    })
}

/// `x`'s elements in a buffer that `l`'s row-major order addresses contiguously from
/// `offset`: `x` itself when `l` is contiguous, else a copy.
fn row_major<'a, B: BackendStorage>(
    x: &'a B,
    l: &Layout,
    copy: &'a mut Option<B>,
) -> Result<(&'a B, usize)> {
    if l.is_contiguous() {
        return Ok((x, l.offset()));
    }
    Ok((copy.insert(x.copy_strided(l)?), 0))
}

/// The rows of `r` seen with the reduced dim last (`[outer, inner, len]`), over a
/// row-major buffer starting at `offset`.
fn len_last(r: Rows, offset: usize) -> Layout {
    Layout::new(
        vec![r.outer, r.inner, r.len],
        vec![r.len * r.inner, 1, r.inner],
        offset,
    )
}

/// The rows of `r` in their own order (`[outer, len, inner]`), row-major from `offset`.
fn rows_layout(r: Rows, offset: usize) -> Layout {
    Layout::new(
        vec![r.outer, r.len, r.inner],
        vec![r.len * r.inner, r.inner, 1],
        offset,
    )
}

/// A per-row statistic (`[outer * inner]`, contiguous) broadcast over the rows' `len`.
fn per_row(r: Rows) -> Layout {
    Layout::new(vec![r.outer, r.len, r.inner], vec![r.inner, 0, 1], 0)
}

/// Softmax of each row: the row max (`reduce` Max) subtracted, `exp`, the row sum, and a
/// division (log-softmax: the log of the sum subtracted), in the compute type, the last
/// step rounded into `out`.
pub fn softmax<B: ReduceOps + MapOps>(
    x: &B,
    l: &Layout,
    rows: Rows,
    log: bool,
    out: DType,
) -> Result<B> {
    let c = out.compute_type();
    let mut copy = None;
    let (x, off) = row_major(x, l, &mut copy)?;
    let n = rows.count();
    let max = x.reduce(&len_last(rows, off), n, rows.len, ReduceOp::Max, c)?;
    let shifted = x.binary(
        &rows_layout(rows, off),
        &max,
        &per_row(rows),
        BinaryOp::Sub,
        c,
    )?;
    let own = rows_layout(rows, 0);
    let e = shifted.unary(&own, UnaryOp::Exp, c)?;
    let sum = e.reduce(&len_last(rows, 0), n, rows.len, ReduceOp::Sum, c)?;
    if log {
        let log_sum = sum.unary(&Layout::contiguous(&[n]), UnaryOp::Log, c)?;
        shifted.binary(&own, &log_sum, &per_row(rows), BinaryOp::Sub, out)
    } else {
        e.binary(&own, &sum, &per_row(rows), BinaryOp::Div, out)
    }
}

/// The gradient of `softmax` (`g` the output gradient, `y` the output): `y · (g - Σ g·y)`,
/// or `g - exp(y) · Σ g` for log-softmax, from maps and row sums.
pub fn softmax_backward<B: ReduceOps + MapOps>(
    g: &B,
    lg: &Layout,
    y: &B,
    ly: &Layout,
    rows: Rows,
    log: bool,
    out: DType,
) -> Result<B> {
    let c = out.compute_type();
    let (mut gc, mut yc) = (None, None);
    let (g, go) = row_major(g, lg, &mut gc)?;
    let (y, yo) = row_major(y, ly, &mut yc)?;
    let (gl, yl, own) = (
        rows_layout(rows, go),
        rows_layout(rows, yo),
        rows_layout(rows, 0),
    );
    let n = rows.count();
    if log {
        let sum = g.reduce(&len_last(rows, go), n, rows.len, ReduceOp::Sum, c)?;
        let p = y.unary(&yl, UnaryOp::Exp, c)?;
        let t = p.binary(&own, &sum, &per_row(rows), BinaryOp::Mul, c)?;
        g.binary(&gl, &t, &own, BinaryOp::Sub, out)
    } else {
        let gy = g.binary(&gl, y, &yl, BinaryOp::Mul, c)?;
        let dot = gy.reduce(&len_last(rows, 0), n, rows.len, ReduceOp::Sum, c)?;
        let t = g.binary(&gl, &dot, &per_row(rows), BinaryOp::Sub, c)?;
        y.binary(&yl, &t, &own, BinaryOp::Mul, out)
    }
}

/// A layer norm's weight or bias (of the normalized shape, any rank, `d` elements) read
/// row-major and broadcast over `rows` rows of `d`: itself when contiguous, else a copy.
fn per_column<'a, B: BackendStorage>(
    (p, l): (&'a B, &Layout),
    rows: usize,
    d: usize,
    copy: &'a mut Option<B>,
) -> Result<(&'a B, Layout)> {
    let (p, off) = row_major(p, l, copy)?;
    Ok((p, Layout::new(vec![rows, d], vec![0, 1], off)))
}

/// Layer normalisation of rows of `d`: the row mean (`reduce` Mean), the centred values, the
/// biased variance as the mean of their squares, `rstd = (var + eps)^(-1/2)`, then
/// `xhat · weight + bias`, in the compute type, the last step rounded into `x`'s dtype.
pub fn layer_norm<B: ReduceOps + MapOps>(
    x: &B,
    l: &Layout,
    d: usize,
    Affine { weight, bias }: Affine<'_, B>,
    eps: f64,
) -> Result<LayerNorm<B>> {
    let (dtype, c) = (x.dtype(), x.dtype().compute_type());
    let rows = l.numel().checked_div(d).unwrap_or(0);
    let mut copy = None;
    let (x, off) = row_major(x, l, &mut copy)?;
    let lx = Layout::new(vec![rows, d], vec![d, 1], off);
    let own = Layout::contiguous(&[rows, d]);
    let stat = Layout::new(vec![rows, d], vec![1, 0], 0);
    let flat = Layout::contiguous(&[rows]);
    let mean = x.reduce(&lx, rows, d, ReduceOp::Mean, c)?;
    let centred = x.binary(&lx, &mean, &stat, BinaryOp::Sub, c)?;
    let sq = centred.unary(&own, UnaryOp::PowScalar(2.0), c)?;
    let var = sq.reduce(&own, rows, d, ReduceOp::Mean, c)?;
    let rstd =
        var.unary(&flat, UnaryOp::AddScalar(eps), c)?
            .unary(&flat, UnaryOp::PowScalar(-0.5), c)?;
    let (mut wc, mut bc) = (None, None);
    let weight = weight
        .map(|w| per_column(w, rows, d, &mut wc))
        .transpose()?;
    let bias = bias.map(|b| per_column(b, rows, d, &mut bc)).transpose()?;
    let steps = [
        Some((&rstd, stat.clone(), BinaryOp::Mul)),
        weight.map(|(w, lw)| (w, lw, BinaryOp::Mul)),
        bias.map(|(b, lb)| (b, lb, BinaryOp::Add)),
    ];
    let steps: Vec<_> = steps.into_iter().flatten().collect();
    let mut t = centred;
    for (i, (v, lv, op)) in steps.iter().enumerate() {
        let to = if i + 1 == steps.len() { dtype } else { c };
        t = t.binary(&own, *v, lv, *op, to)?;
    }
    Ok(LayerNorm { out: t, mean, rstd })
}

/// The gradients of `layer_norm` from the closed form: with `xhat = (x - mean) · rstd` and
/// `h = dy · weight`, `dx = rstd · (h - mean(h) - xhat · mean(h · xhat))` per row,
/// `dweight = Σ_rows dy · xhat`, `dbias = Σ_rows dy`.
pub fn layer_norm_backward<B: ReduceOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    (x, lx): View<'_, B>,
    d: usize,
    saved: Saved<'_, B>,
    dtypes: GradDTypes,
) -> Result<Grads<B>> {
    let (mean, rstd, weight) = (saved.mean, saved.invstd, saved.weight);
    let c = x.dtype().compute_type();
    let rows = lx.numel().checked_div(d).unwrap_or(0);
    let (mut dc, mut xc) = (None, None);
    let (dy, doff) = row_major(dy, ldy, &mut dc)?;
    let (x, xoff) = row_major(x, lx, &mut xc)?;
    let (ld, lxr) = (
        Layout::new(vec![rows, d], vec![d, 1], doff),
        Layout::new(vec![rows, d], vec![d, 1], xoff),
    );
    let own = Layout::contiguous(&[rows, d]);
    let stat = Layout::new(vec![rows, d], vec![1, 0], 0);
    // Column sums: the rows reduced, each column's run last.
    let cols = |l: &Layout| {
        Layout::new(
            vec![d, rows],
            vec![l.strides()[1], l.strides()[0]],
            l.offset(),
        )
    };
    let xhat = x.binary(&lxr, mean, &stat, BinaryOp::Sub, c)?.binary(
        &own,
        rstd,
        &stat,
        BinaryOp::Mul,
        c,
    )?;
    let dweight = match dtypes.1 {
        Some(t) => {
            let p = dy.binary(&ld, &xhat, &own, BinaryOp::Mul, c)?;
            Some(p.reduce(&cols(&own), d, rows, ReduceOp::Sum, t)?)
        }
        None => None,
    };
    let dbias = match dtypes.2 {
        Some(t) => Some(dy.reduce(&cols(&ld), d, rows, ReduceOp::Sum, t)?),
        None => None,
    };
    let dx = match dtypes.0 {
        Some(t) => {
            let h = match weight {
                Some(w) => {
                    let mut copy = None;
                    let (w, lw) = per_column(w, rows, d, &mut copy)?;
                    dy.binary(&ld, w, &lw, BinaryOp::Mul, c)?
                }
                None => dy.cast(&ld, c)?,
            };
            let mh = h.reduce(&own, rows, d, ReduceOp::Mean, c)?;
            let hx = h.binary(&own, &xhat, &own, BinaryOp::Mul, c)?;
            let mhx = hx.reduce(&own, rows, d, ReduceOp::Mean, c)?;
            let inner = h.binary(&own, &mh, &stat, BinaryOp::Sub, c)?.binary(
                &own,
                &xhat.binary(&own, &mhx, &stat, BinaryOp::Mul, c)?,
                &own,
                BinaryOp::Sub,
                c,
            )?;
            Some(inner.binary(&own, rstd, &stat, BinaryOp::Mul, t)?)
        }
        None => None,
    };
    Ok(Grads { dx, dweight, dbias })
}

/// The bias gradient of `conv2d`: the output gradient summed over images and pixels per
/// channel (`reduce` Sum over the view `[c_out, n, pixels]`).
pub fn conv2d_backward_bias<B: ReduceOps>(
    dy: &B,
    ldy: &Layout,
    g: &Conv2dGeom,
    out: DType,
) -> Result<B> {
    let mut copy = None;
    let (dy, off) = row_major(dy, ldy, &mut copy)?;
    let (n, c, p) = (g.n, g.c_out, g.h_out * g.w_out);
    let l = Layout::new(vec![c, n, p], vec![p, c * p, 1], off);
    dy.reduce(&l, c, n * p, ReduceOp::Sum, out)
}

/// A batch-norm input (`[n, c, s]` row-major from `offset`) seen channel-major, each
/// channel's `n · s` values last: the view `reduce` sums per channel.
fn channel_runs(g: BatchNormGeom, offset: usize) -> Layout {
    Layout::new(vec![g.c, g.n, g.s], vec![g.s, g.c * g.s, 1], offset)
}

/// `(1 - momentum) · running + momentum · batch`, in F64, rounded into the running
/// buffer's dtype.
fn update_running<B: MapOps>(running: (&B, &Layout), batch: &B, momentum: f64) -> Result<B> {
    let (r, lr) = running;
    let f64 = DType::F64;
    let kept = r.unary(lr, UnaryOp::MulScalar(1.0 - momentum), f64)?;
    let new = batch.unary(
        &Layout::contiguous(lr.shape()),
        UnaryOp::MulScalar(momentum),
        f64,
    )?;
    let flat = Layout::contiguous(lr.shape());
    kept.binary(&flat, &new, &flat, BinaryOp::Add, r.dtype())
}

/// Batch normalisation: per channel the batch mean and biased variance (`reduce` Mean and
/// Var over the channel's values) in training, the running statistics otherwise;
/// `invstd = (var + eps)^(-1/2)`; the output as `batch_norm_act_apply` without the ReLU;
/// in training with running buffers, their update with the unbiased variance.
pub fn batch_norm<B: NnOps + MapOps + ReduceOps>(
    x: &B,
    l: &Layout,
    g: BatchNormGeom,
    affine: Affine<'_, B>,
    running: Running<'_, B>,
    BatchNormMode {
        training,
        momentum,
        eps,
    }: BatchNormMode,
) -> Result<BatchNorm<B>> {
    let c = x.dtype().compute_type();
    let flat = Layout::contiguous(&[g.c]);
    let (mean, var, new_running) = if training {
        let mut copy = None;
        let (xs, off) = row_major(x, l, &mut copy)?;
        let runs = channel_runs(g, off);
        let mean = xs.reduce(&runs, g.c, g.m(), ReduceOp::Mean, c)?;
        let var = xs.reduce(&runs, g.c, g.m(), ReduceOp::Var { correction: 0 }, c)?;
        let new_running = match running {
            Some((rm, rv)) => {
                let unbiased = xs.reduce(&runs, g.c, g.m(), ReduceOp::Var { correction: 1 }, c)?;
                Some((
                    update_running(rm, &mean, momentum)?,
                    update_running(rv, &unbiased, momentum)?,
                ))
            }
            None => None,
        };
        (mean, var, new_running)
    } else {
        let ((rm, lm), (rv, lv)) = running.ok_or_else(|| {
            Error::arg("batch_norm", "eval mode needs running_mean and running_var")
        })?;
        (rm.cast(lm, c)?, rv.cast(lv, c)?, None)
    };
    let invstd =
        var.unary(&flat, UnaryOp::AddScalar(eps), c)?
            .unary(&flat, UnaryOp::PowScalar(-0.5), c)?;
    let out = batch_norm_act_apply(x, l, g, (&mean, &invstd), affine, false)?;
    Ok(BatchNorm {
        out,
        mean,
        invstd,
        running: new_running,
    })
}

/// The gradients of `batch_norm` (closed form): with `xhat = (x - mean) · invstd`,
/// `dbias = Σ g`, `dweight = Σ g · xhat` per channel, and `dx = weight · invstd ·
/// (g - mean(g) - xhat · mean(g · xhat))` in training (`weight · invstd · g` otherwise).
pub fn batch_norm_backward<B: NnOps + MapOps + ReduceOps>(
    dy: &B,
    ldy: &Layout,
    (x, lx): View<'_, B>,
    g: BatchNormGeom,
    saved: Saved<'_, B>,
    dtypes: GradDTypes,
) -> Result<Grads<B>> {
    let (mean, invstd, weight, training) =
        (saved.mean, saved.invstd, saved.weight, saved.from_input);
    let c = x.dtype().compute_type();
    let (mut dc, mut xc) = (None, None);
    let (dy, doff) = row_major(dy, ldy, &mut dc)?;
    let (x, xoff) = row_major(x, lx, &mut xc)?;
    let own = ncs(g, 0);
    let stat = per_channel(&Layout::contiguous(&[g.c]), g);
    let runs = channel_runs(g, 0);
    let xhat = x
        .binary(&ncs(g, xoff), mean, &stat, BinaryOp::Sub, c)?
        .binary(&own, invstd, &stat, BinaryOp::Mul, c)?;
    let gc = dy.cast(&ncs(g, doff), c)?;
    let gx = gc.binary(&own, &xhat, &own, BinaryOp::Mul, c)?;
    let dweight = match dtypes.1 {
        Some(t) => Some(gx.reduce(&runs, g.c, g.m(), ReduceOp::Sum, t)?),
        None => None,
    };
    let dbias = match dtypes.2 {
        Some(t) => Some(gc.reduce(&runs, g.c, g.m(), ReduceOp::Sum, t)?),
        None => None,
    };
    let dx = match dtypes.0 {
        Some(t) => {
            let centred = if training {
                let mg = gc.reduce(&runs, g.c, g.m(), ReduceOp::Mean, c)?;
                let mgx = gx.reduce(&runs, g.c, g.m(), ReduceOp::Mean, c)?;
                let t2 = xhat.binary(&own, &mgx, &stat, BinaryOp::Mul, c)?;
                gc.binary(&own, &mg, &stat, BinaryOp::Sub, c)?.binary(
                    &own,
                    &t2,
                    &own,
                    BinaryOp::Sub,
                    c,
                )?
            } else {
                gc
            };
            let scaled = match weight {
                Some((w, lw)) => {
                    let s = centred.binary(&own, invstd, &stat, BinaryOp::Mul, c)?;
                    s.binary(&own, w, &per_channel(lw, g), BinaryOp::Mul, t)?
                }
                None => centred.binary(&own, invstd, &stat, BinaryOp::Mul, t)?,
            };
            Some(scaled)
        }
        None => None,
    };
    Ok(Grads { dx, dweight, dbias })
}

/// The gradient of `reduce` with `Var { correction }`: each run's mean (`reduce` Mean), the
/// centred values times `2 / max(0, inner - correction)`, times the run's output gradient.
pub fn var_backward<B: ReduceOps + MapOps>(
    x: &B,
    layout: &Layout,
    (g, lg): View<'_, B>,
    (outer, inner): (usize, usize),
    correction: usize,
    out: DType,
) -> Result<B> {
    let c = out.compute_type();
    let (mut xc, mut gc) = (None, None);
    let (x, xo) = row_major(x, layout, &mut xc)?;
    let (g, go) = row_major(g, lg, &mut gc)?;
    let lx = Layout::new(vec![outer, inner], vec![inner, 1], xo);
    let per_run = |offset| Layout::new(vec![outer, inner], vec![1, 0], offset);
    let own = Layout::contiguous(&[outer, inner]);
    let mean = x.reduce(&lx, outer, inner, ReduceOp::Mean, c)?;
    let two_over_n = 2.0 / inner.saturating_sub(correction) as f64;
    x.binary(&lx, &mean, &per_run(0), BinaryOp::Sub, c)?
        .unary(&own, UnaryOp::MulScalar(two_over_n), c)?
        .binary(&own, g, &per_run(go), BinaryOp::Mul, out)
}

/// Mean squared error: the difference (`binary` Sub), its square, and for `Sum`/`Mean` the
/// `reduce` over every element; returns the loss and the difference.
pub fn mse<B: ReduceOps + MapOps>(
    a: &B,
    la: &Layout,
    target: &B,
    lb: &Layout,
    reduction: Reduction,
    out: DType,
) -> Result<(B, B)> {
    let n = la.numel();
    let flat = Layout::contiguous(&[n]);
    let diff = a.binary(la, target, lb, BinaryOp::Sub, out)?;
    let sq = diff.unary(&flat, UnaryOp::PowScalar(2.0), out)?;
    let loss = match reduction {
        Reduction::None => sq,
        Reduction::Sum => sq.reduce(&flat, 1, n, ReduceOp::Sum, out)?,
        Reduction::Mean => sq.reduce(&flat, 1, n, ReduceOp::Mean, out)?,
    };
    Ok((loss, diff))
}

/// The gradients of `mse` from the difference it returned (`diff`, contiguous) and the
/// loss's gradient `g`: `2 · diff · g` (divided by the count for `Mean`; `g` per element
/// for `Reduction::None`, else one value broadcast), and its negation for the target.
pub fn mse_backward<B: MapOps>(
    diff: &B,
    g: &B,
    lg: &Layout,
    reduction: Reduction,
    out: DType,
) -> Result<(B, B)> {
    let n = diff.len();
    let flat = Layout::contiguous(&[n]);
    let (lg, scale) = match reduction {
        Reduction::None => (lg.clone(), 2.0),
        Reduction::Sum => (Layout::new(vec![n], vec![0], lg.offset()), 2.0),
        Reduction::Mean => (Layout::new(vec![n], vec![0], lg.offset()), 2.0 / n as f64),
    };
    let da = diff.unary(&flat, UnaryOp::MulScalar(scale), out)?.binary(
        &flat,
        g,
        &lg,
        BinaryOp::Mul,
        out,
    )?;
    let db = da.unary(&flat, UnaryOp::Neg, out)?;
    Ok((da, db))
}

/// `n` zeros of `dtype` on `like`'s device.
fn zeros<B: BackendStorage>(like: &B, n: usize, dtype: DType) -> Result<B> {
    like.upload(&CpuStorage::from_f32(vec![0.0; n], dtype))
}

/// The gradients of `where_cond`: `where_cond(cond, g, 0)` and `where_cond(cond, 0, g)`.
pub fn where_backward<B: MapOps>(
    cond: &B,
    lc: &Layout,
    g: &B,
    lg: &Layout,
    out: DType,
) -> Result<(B, B)> {
    let z = zeros(cond, lg.numel(), out)?;
    let lz = Layout::contiguous(lg.shape());
    Ok((
        cond.where_cond(lc, (g, lg), (&z, &lz), out)?,
        cond.where_cond(lc, (&z, &lz), (g, lg), out)?,
    ))
}

/// The loss scaler's unscale-and-check: `g · inv` by `unary` (in F32, F64 for F64), and the
/// flag set (uploaded) when `g`'s largest magnitude is not finite (`norm_partial` with
/// p = ∞ is NaN or inf exactly when an element is).
pub fn unscale_check<B: MapOps + AmpOps>(
    g: &B,
    layout: &Layout,
    inv: f32,
    found_inf: &mut B,
) -> Result<B> {
    if found_inf.dtype() != DType::F32 || found_inf.len() != 1 {
        return Err(Error::arg(
            "unscale_check",
            format!(
                "found_inf must be one F32 value, got {} {}",
                found_inf.len(),
                found_inf.dtype()
            ),
        ));
    }
    let out = g.dtype().compute_type();
    let y = g.unary(layout, UnaryOp::MulScalar(f64::from(inv)), out)?;
    if !g.norm_partial(layout, f64::INFINITY)?.is_finite() {
        *found_inf = found_inf.upload(&CpuStorage::from_vec(vec![1.0f32]))?;
    }
    Ok(y)
}

/// The elements `layout` addresses on the host, contiguous, with their layout.
fn on_host<B: BackendStorage>(x: &B, layout: &Layout) -> Result<(CpuStorage, Layout)> {
    let h = x.download(layout)?;
    let l = Layout::contiguous(&[h.len()]);
    Ok((h, l))
}

/// `norm_partial` on the host: the elements downloaded, the CPU's loop run. The statistics
/// are read once per step or less, so a backend may leave them to this default.
pub fn norm_partial<B: BackendStorage>(x: &B, layout: &Layout, p: f64) -> Result<f64> {
    let (h, l) = on_host(x, layout)?;
    AmpOps::norm_partial(&h, &l, p)
}

/// `range_counts` on the host (as `norm_partial`).
pub fn range_counts<B: BackendStorage>(
    x: &B,
    layout: &Layout,
    tiny: f64,
    max: f64,
) -> Result<(u64, u64)> {
    let (h, l) = on_host(x, layout)?;
    AmpOps::range_counts(&h, &l, tiny, max)
}

/// `log2_histogram` on the host (as `norm_partial`).
pub fn log2_histogram<B: BackendStorage>(x: &B, layout: &Layout) -> Result<Log2Histogram> {
    let (h, l) = on_host(x, layout)?;
    AmpOps::log2_histogram(&h, &l)
}
