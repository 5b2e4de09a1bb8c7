//! 2-D convolution, the op entry point: validation, dtype promotion, dispatch to the
//! im2col-and-GEMM kernels in `cpu/conv.rs`, and the backward (input, weight, bias) beside
//! the forward.
//!
//! Dtypes: the output has the promoted dtype of input, weight and bias (PyTorch's rule; F16
//! with BF16 gives F32). Inputs of one half dtype are multiplied as stored (`gemm_half`), mixes
//! are converted to the promoted dtype first; products are summed in F32 (F64 for F64) and the
//! output is rounded once (the precision contract).

use crate::cpu::conv::{
    conv2d_backward_input, conv2d_backward_weight, conv2d_forward, conv_out_size, Conv2dGeom,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::reduce::sum_slice;
use crate::tensor::Tensor;

const OP: &str = "conv2d";

/// Options of `conv2d`, PyTorch's `nn.functional.conv2d` arguments as (height, width) pairs.
/// The default is stride 1, no padding, dilation 1, one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }
}

impl Conv2dOptions {
    /// The same stride along both dims.
    pub fn stride(self, s: usize) -> Self {
        Conv2dOptions {
            stride: (s, s),
            ..self
        }
    }
    /// The same padding along both dims.
    pub fn padding(self, p: usize) -> Self {
        Conv2dOptions {
            padding: (p, p),
            ..self
        }
    }
    /// The same dilation along both dims.
    pub fn dilation(self, d: usize) -> Self {
        Conv2dOptions {
            dilation: (d, d),
            ..self
        }
    }
    pub fn groups(self, groups: usize) -> Self {
        Conv2dOptions { groups, ..self }
    }
}

/// Checks the shapes and options of a convolution and works out its geometry.
fn geometry(
    x: &[usize],
    w: &[usize],
    bias: Option<&[usize]>,
    o: &Conv2dOptions,
) -> Result<Conv2dGeom> {
    let shapes = || format!("input {x:?}, weight {w:?}, options {o:?}");
    if x.len() != 4 {
        return Err(Error::shape(
            OP,
            format!("input must be 4-D [N, C_in, H, W]; got {}", shapes()),
        ));
    }
    if w.len() != 4 {
        return Err(Error::shape(
            OP,
            format!(
                "weight must be 4-D [C_out, C_in/groups, kh, kw]; got {}",
                shapes()
            ),
        ));
    }
    if o.stride.0 == 0 || o.stride.1 == 0 {
        return Err(Error::arg(
            OP,
            format!("stride must be positive; got {}", shapes()),
        ));
    }
    if o.dilation.0 == 0 || o.dilation.1 == 0 {
        return Err(Error::arg(
            OP,
            format!("dilation must be positive; got {}", shapes()),
        ));
    }
    let (n, c_in, h, wd) = (x[0], x[1], x[2], x[3]);
    let (c_out, c_in_g, kh, kw) = (w[0], w[1], w[2], w[3]);
    if o.groups == 0 || c_in % o.groups != 0 || c_out % o.groups != 0 {
        return Err(Error::arg(
            OP,
            format!(
                "groups {} must be positive and divide C_in {c_in} and C_out {c_out}; got {}",
                o.groups,
                shapes()
            ),
        ));
    }
    if c_in_g * o.groups != c_in {
        return Err(Error::shape(
            OP,
            format!(
                "input has {c_in} channels but the weight expects {} (C_in/groups {c_in_g} x \
                 groups {}); got {}",
                c_in_g * o.groups,
                o.groups,
                shapes()
            ),
        ));
    }
    if c_in == 0 || h == 0 || wd == 0 || kh == 0 || kw == 0 {
        return Err(Error::shape(
            OP,
            format!(
                "channels, spatial sizes and kernel sizes must be non-zero; got {}",
                shapes()
            ),
        ));
    }
    if let Some(b) = bias {
        if b != [c_out] {
            return Err(Error::shape(
                OP,
                format!(
                    "bias must be [C_out] = [{c_out}]; got bias {b:?}, {}",
                    shapes()
                ),
            ));
        }
    }
    let h_out = conv_out_size(h, kh, o.stride.0, o.padding.0, o.dilation.0);
    let w_out = conv_out_size(wd, kw, o.stride.1, o.padding.1, o.dilation.1);
    let (Some(h_out), Some(w_out)) = (h_out, w_out) else {
        return Err(Error::shape(
            OP,
            format!(
                "kernel {kh}x{kw} (dilated {}x{}) is larger than the padded input {}x{}; got {}",
                o.dilation.0 * (kh - 1) + 1,
                o.dilation.1 * (kw - 1) + 1,
                h + 2 * o.padding.0,
                wd + 2 * o.padding.1,
                shapes()
            ),
        ));
    };
    Ok(Conv2dGeom {
        n,
        c_in,
        h,
        w: wd,
        c_out,
        kh,
        kw,
        stride: o.stride,
        padding: o.padding,
        dilation: o.dilation,
        groups: o.groups,
        h_out,
        w_out,
    })
}

impl Tensor {
    /// 2-D convolution (cross-correlation, as PyTorch's `conv2d`): input `[N, C_in, H, W]`,
    /// weight `[C_out, C_in/groups, kh, kw]`, optional bias `[C_out]` -> output
    /// `[N, C_out, H_out, W_out]` with `H_out = (H + 2*pad - dil*(kh-1) - 1) / stride + 1`
    /// (likewise W). The output dtype is the promoted dtype of the inputs; sums are
    /// accumulated in F32 (F64 for F64) and rounded once.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
    ) -> Result<Tensor> {
        use super::autocast::{cast, cast_opt, target};
        if let Some(dt) = target(OP, &[Some(self), Some(weight), bias]) {
            let b = cast_opt(bias, dt)?;
            return cast(self, dt)?.conv2d(&cast(weight, dt)?, b.as_ref(), opts);
        }
        let geom = geometry(self.shape(), weight.shape(), bias.map(|b| b.shape()), &opts)?;
        let mut dtype = self.dtype().promote(weight.dtype());
        for t in [Some(self), Some(weight), bias].into_iter().flatten() {
            if !t.dtype().is_float() {
                return Err(Error::dtype(OP, t.dtype(), "expected float tensors"));
            }
            dtype = dtype.promote(t.dtype());
        }
        // What the backward needs: the inputs (detached, not the graph) and which of them
        // want a gradient (the input of a first layer usually does not: skip its GEMMs).
        let (x_saved, w_saved) = (self.detach(), weight.detach());
        let (x_dtype, w_dtype) = (self.dtype(), weight.dtype());
        let b_dtype = bias.map(|b| b.dtype());
        let want = (self.requires_grad(), weight.requires_grad());
        if let Some(t) = conv2d_half(self, weight, bias, &geom, dtype, want) {
            return Ok(t);
        }
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        crate::with_compute!(dtype, C => {
            let out = self.with_values::<C, _>(|x| {
                weight.with_values::<C, _>(|w| match bias {
                    Some(b) => b.with_values::<C, _>(|b| conv2d_forward(x, w, Some(b), &geom)),
                    None => conv2d_forward(x, w, None, &geom),
                })
            });
            Ok(Tensor::from_compute(out, &geom.out_shape(), dtype, OP, &inputs, move |g| {
                g.with_values::<C, _>(|dy| {
                    let dx = want.0.then(|| {
                        let dx = w_saved.with_values::<C, _>(|w| conv2d_backward_input(dy, w, &geom));
                        Tensor::from_values(dx, x_saved.shape(), x_dtype)
                    });
                    let dw = want.1.then(|| {
                        let dw = x_saved.with_values::<C, _>(|x| conv2d_backward_weight(x, dy, &geom));
                        Tensor::from_values(dw, w_saved.shape(), w_dtype)
                    });
                    let mut grads = vec![dx, dw];
                    if let Some(b_dtype) = b_dtype {
                        grads.push(Some(Tensor::from_values(bias_grad(dy, &geom), &[geom.c_out], b_dtype)));
                    }
                    Ok(grads)
                })
            }))
        })
    }
}

impl Tensor {
    /// `conv2d(weight, bias, opts)`, then ReLU, then a 2×2 max-pool with stride 2 — the block
    /// of small CNNs — as one fused op (`cpu::conv_block`): the same values and gradients as
    /// `self.conv2d(..)?.relu()?.max_pool2d((2, 2), (2, 2), (0, 0))`, without the
    /// full-resolution activation ever being stored (less memory, one pass instead of five).
    /// F32, F16 and BF16 tensors of one dtype take the fused kernel; other dtype mixes and
    /// F64 run the three ops (same results, same errors).
    pub fn conv2d_relu_max_pool2(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
    ) -> Result<Tensor> {
        use super::autocast::{cast, cast_opt, target};
        const BLOCK: &str = "conv2d_relu_max_pool2";
        if let Some(dt) = target(BLOCK, &[Some(self), Some(weight), bias]) {
            let b = cast_opt(bias, dt)?;
            return cast(self, dt)?.conv2d_relu_max_pool2(&cast(weight, dt)?, b.as_ref(), opts);
        }
        let unfused = || {
            self.conv2d(weight, bias, opts)?
                .relu()?
                .max_pool2d((2, 2), (2, 2), (0, 0))
        };
        let geom = geometry(self.shape(), weight.shape(), bias.map(|b| b.shape()), &opts)?;
        let dtype = self.dtype();
        let same = |t: &Tensor| t.dtype() == dtype;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            || !same(weight)
            || !bias.is_none_or(same)
            || geom.h_out < 2
            || geom.w_out < 2
        {
            return unfused();
        }
        let x = if self.is_contiguous() {
            self.clone()
        } else {
            self.contiguous()?
        };
        conv_block(&x, self, weight, bias, geom, BLOCK)
    }
}

/// The fused block on a contiguous F32/F16/BF16 input `x` (a contiguous copy of `input`,
/// or `input` itself): forward, and a backward that runs in one pass per group of images.
fn conv_block(
    x: &Tensor,
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    geom: Conv2dGeom,
    op: &'static str,
) -> Result<Tensor> {
    use crate::cpu::chunked::Src;
    use crate::cpu::conv_block::{backward, forward, pooled_shape};
    use crate::tensor::Layout;
    use std::sync::Arc;
    let dtype = x.dtype();
    let w_saved = weight.detach().contiguous()?;
    let (out, idx) = {
        let (xs, ws) = (x.storage(), w_saved.storage());
        let b = bias.map(|b| b.values::<f32>());
        Src::of(xs.as_cpu(), x.layout())
            .zip(Src::of(ws.as_cpu(), w_saved.layout()))
            .and_then(|(xsrc, wsrc)| forward(xsrc, wsrc, b.as_deref(), &geom))
            .ok_or_else(|| Error::dtype(op, dtype, "expected F32, F16 or BF16 of one dtype"))?
    };
    let idx = Arc::new(idx);
    let x_saved = x.detach();
    let want_dx = input.requires_grad();
    let has_bias = bias.is_some();
    let mut inputs = vec![input, weight];
    inputs.extend(bias);
    Ok(Tensor::from_op(
        Arc::new(out.into()),
        Layout::contiguous(&pooled_shape(&geom)),
        op,
        &inputs,
        move |g| {
            let g = contiguous_as(g, dtype)?;
            let (gs, xs, ws) = (g.storage(), x_saved.storage(), w_saved.storage());
            let grads = Src::of(gs.as_cpu(), g.layout())
                .zip(Src::of(xs.as_cpu(), x_saved.layout()))
                .zip(Src::of(ws.as_cpu(), w_saved.layout()))
                .and_then(|((dy, x), w)| backward(dy, &idx, x, w, &geom, want_dx))
                .ok_or_else(|| Error::dtype(op, g.dtype(), "gradient of the block"))?;
            let dx = grads.dx.map(|st| {
                Tensor::from_storage(Arc::new(st.into()), Layout::contiguous(x_saved.shape()))
            });
            let mut out = vec![
                dx,
                Some(Tensor::from_values(grads.dw, w_saved.shape(), dtype)),
            ];
            if has_bias {
                out.push(Some(Tensor::from_values(grads.db, &[geom.c_out], dtype)));
            }
            Ok(out)
        },
    ))
}

/// `conv2d` when the inputs are all F16 or all BF16 (autocast's case): the kernels unfold and
/// multiply the images as stored (`cpu::conv::*_blocks`, `gemm_half`) and round each image's
/// F32 result into the output, so neither the batch nor its gradients exist in F32. `None`
/// otherwise (the general path handles it).
fn conv2d_half(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    geom: &Conv2dGeom,
    dtype: DType,
    want: (bool, bool),
) -> Option<Tensor> {
    use crate::cpu::chunked::Src;
    use crate::cpu::conv::{
        conv2d_backward_input_blocks, conv2d_backward_weight_blocks, conv2d_forward_blocks,
    };
    use crate::tensor::Layout;
    use std::sync::Arc;
    let same = |t: &Tensor| t.dtype() == dtype;
    if !matches!(dtype, DType::F16 | DType::BF16)
        || !same(x)
        || !same(weight)
        || !bias.is_none_or(same)
    {
        return None;
    }
    // Contiguous copies (half-size) of strided views, so that every layout takes the same
    // kernels and gives the same bits.
    let (x_saved, w_saved) = (
        x.detach().contiguous().ok()?,
        weight.detach().contiguous().ok()?,
    );
    let out = {
        let (xs, ws) = (x_saved.storage(), w_saved.storage());
        let b = bias.map(|b| b.values::<f32>());
        let xsrc = Src::of(xs.as_cpu(), x_saved.layout())?;
        let wsrc = Src::of(ws.as_cpu(), w_saved.layout())?;
        conv2d_forward_blocks(xsrc, wsrc, b.as_deref(), geom)?
    };
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    let geom = *geom;
    Some(Tensor::from_op(
        Arc::new(out.into()),
        Layout::contiguous(&geom.out_shape()),
        OP,
        &inputs,
        move |g| {
            let g = contiguous_as(g, dtype)?;
            let gs = g.storage();
            let dy = Src::of(gs.as_cpu(), g.layout())
                .ok_or_else(|| Error::dtype(OP, g.dtype(), "gradient of a half conv2d"))?;
            let dx = if want.0 {
                let ws = w_saved.storage();
                let wsrc = Src::of(ws.as_cpu(), w_saved.layout()).expect("checked in the forward");
                let st = conv2d_backward_input_blocks(dy, wsrc, &geom)
                    .ok_or_else(|| Error::dtype(OP, dy.dtype(), "gradient of a half conv2d"))?;
                Some(Tensor::from_storage(
                    Arc::new(st.into()),
                    Layout::contiguous(x_saved.shape()),
                ))
            } else {
                None
            };
            let dw = if want.1 {
                let xs = x_saved.storage();
                let xsrc = Src::of(xs.as_cpu(), x_saved.layout()).expect("checked in the forward");
                let dw = conv2d_backward_weight_blocks(xsrc, dy, &geom)
                    .ok_or_else(|| Error::dtype(OP, dy.dtype(), "gradient of a half conv2d"))?;
                Some(Tensor::from_values(dw, w_saved.shape(), dtype))
            } else {
                None
            };
            let mut grads = vec![dx, dw];
            if has_bias {
                grads.push(Some(Tensor::from_values(
                    bias_grad_blocks(dy, &geom),
                    &[geom.c_out],
                    dtype,
                )));
            }
            Ok(grads)
        },
    ))
}

/// `g` contiguous and in `dtype` (the half kernels read a gradient of the output's dtype).
fn contiguous_as(g: &Tensor, dtype: DType) -> Result<Tensor> {
    let g = if g.dtype() == dtype {
        g.clone()
    } else {
        g.to_dtype(dtype)?
    };
    if g.is_contiguous() {
        Ok(g)
    } else {
        g.contiguous()
    }
}

/// The bias gradient (per channel, `dy` summed over images and pixels) from a contiguous
/// F32/F16/BF16 gradient, summed in the order of `bias_grad`.
fn bias_grad_blocks(dy: crate::cpu::chunked::Src<'_>, g: &Conv2dGeom) -> Vec<f32> {
    let l = g.l();
    let mut acc = vec![0f32; g.c_out];
    let mut db = vec![0f32; g.out_image()];
    for n in 0..g.n {
        let img = dy.read(n * g.out_image(), &mut db);
        for (co, a) in acc.iter_mut().enumerate() {
            *a += sum_slice(&img[co * l..(co + 1) * l]);
        }
    }
    acc
}

/// Gradient of the bias: `dy` summed over the batch and the output pixels, per channel.
fn bias_grad<C: crate::tensor::FloatDType>(dy: &[C], g: &Conv2dGeom) -> Vec<C> {
    let l = g.l();
    (0..g.c_out)
        .map(|co| {
            (0..g.n)
                .map(|n| sum_slice(&dy[(n * g.c_out + co) * l..(n * g.c_out + co + 1) * l]))
                .fold(C::zero(), |a, b| a + b)
        })
        .collect()
}
