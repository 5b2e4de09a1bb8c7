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

use super::map::{BinaryOp, MapOps, UnaryOp};
use super::nn::{
    BatchNorm, BatchNormGeom, Conv2dGeom, GradDTypes, Grads, Indices, NnOps, Opt, Pool2dGeom,
    Running,
};
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// `[n, c, s]` over the elements of `l` (a batch-norm input) when `l` addresses them in
/// row-major order, else `None` (the caller copies first).
fn ncs(l: &Layout, g: BatchNormGeom) -> Option<Layout> {
    l.is_contiguous()
        .then(|| Layout::new(vec![g.n, g.c, g.s], vec![g.c * g.s, g.s, 1], l.offset()))
}

/// A per-channel vector `[c]` (layout `l`) broadcast over `[n, c, s]`.
fn per_channel(l: &Layout, g: BatchNormGeom) -> Layout {
    Layout::new(vec![g.n, g.c, g.s], vec![0, l.strides()[0], 0], l.offset())
}

/// `relu(batch_norm(x) + residual)`: `NnOps::batch_norm`, then `binary` add and `unary`
/// ReLU, each rounded into `x`'s dtype.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_act<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: BatchNormGeom,
    residual: Opt<'_, B>,
    relu: bool,
    weight: Opt<'_, B>,
    bias: Opt<'_, B>,
    running: Running<'_, B>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<BatchNorm<B>> {
    let dtype = x.dtype();
    let mut bn = x.batch_norm(l, g, weight, bias, running, training, momentum, eps)?;
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
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_act_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    y: Opt<'_, B>,
    x: &B,
    lx: &Layout,
    g: BatchNormGeom,
    mean: &B,
    invstd: &B,
    weight: Opt<'_, B>,
    training: bool,
    dtypes: GradDTypes,
    want_residual: bool,
) -> Result<(Grads<B>, Option<B>)> {
    let masked = match y {
        Some((y, ly)) => dy.unary_backward(ldy, y, ly, UnaryOp::Relu, x.dtype())?,
        None => dy.cast(ldy, x.dtype())?,
    };
    let lg = Layout::contiguous(ldy.shape());
    let grads =
        masked.batch_norm_backward(&lg, x, lx, g, mean, invstd, weight, training, dtypes)?;
    Ok((grads, want_residual.then_some(masked)))
}

/// `batch_norm_act`'s output from given statistics: `((x - mean) · invstd) · weight + bias`,
/// per channel by broadcasting, in F32, rounded once into `x`'s dtype, then the ReLU.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_act_apply<B: NnOps + MapOps>(
    x: &B,
    l: &Layout,
    g: BatchNormGeom,
    mean: &B,
    invstd: &B,
    weight: Opt<'_, B>,
    bias: Opt<'_, B>,
    relu: bool,
) -> Result<B> {
    let dtype = x.dtype();
    let copied;
    let (x, lx) = match ncs(l, g) {
        Some(lx) => (x, lx),
        None => {
            copied = x.copy_strided(l)?;
            let lx = Layout::new(vec![g.n, g.c, g.s], vec![g.c * g.s, g.s, 1], 0);
            (&copied, lx)
        }
    };
    let out = Layout::contiguous(&[g.n, g.c, g.s]);
    let stat = per_channel(&Layout::contiguous(&[g.c]), g);
    let f32 = crate::dtype::DType::F32;
    let mut t = x.binary(&lx, mean, &stat, BinaryOp::Sub, f32)?;
    // The last step rounds into the storage dtype; the ones before stay in F32.
    let steps = [
        Some((invstd, stat.clone(), BinaryOp::Mul)),
        weight.map(|(w, lw)| (w, per_channel(lw, g), BinaryOp::Mul)),
        bias.map(|(b, lb)| (b, per_channel(lb, g), BinaryOp::Add)),
    ];
    let steps: Vec<_> = steps.into_iter().flatten().collect();
    for (i, (v, lv, op)) in steps.iter().enumerate() {
        let to = if i + 1 == steps.len() { dtype } else { f32 };
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
#[allow(clippy::too_many_arguments)]
pub fn conv2d_relu_max_pool2_backward<B: NnOps + MapOps>(
    dy: &B,
    ldy: &Layout,
    indices: &Indices,
    x: &B,
    lx: &Layout,
    w: &B,
    lw: &Layout,
    g: &Conv2dGeom,
    want_dx: bool,
    has_bias: bool,
) -> Result<Grads<B>> {
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
