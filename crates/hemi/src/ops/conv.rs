//! 2-D convolution, the op entry point: validation, dtype promotion, the backend's conv
//! primitives (`backend::nn`: forward, and the input, weight and bias gradients), and the
//! fused conv + ReLU + max-pool block.
//!
//! Dtypes: the output has the promoted dtype of input, weight and bias (PyTorch's rule; F16
//! with BF16 gives F32). Inputs of one half dtype are multiplied as stored
//! (`cpu::gemm::blocked`), mixes are converted to the promoted dtype first; products are
//! summed in F32 (F64 for F64) and the output is rounded once (the precision contract).

use std::sync::Arc;

use crate::backend::nn::{conv_out_size, BlockGrads, Conv2dGeom};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Layout, Storage, Tensor};

use super::norm::{BatchNormParams, BnSaved};

const OP: &str = "conv2d";

/// Options of `conv2d`, PyTorch's `nn.functional.conv2d` arguments as (height, width) pairs.
/// The default is stride 1, no padding, dilation 1, one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step of the kernel (vertical, horizontal), each >= 1.
    pub stride: (usize, usize),
    /// Zero padding added to each side (top/bottom, left/right).
    pub padding: (usize, usize),
    /// Spacing between kernel taps (vertical, horizontal), each >= 1.
    pub dilation: (usize, usize),
    /// Channel groups; divides both channel counts (1: a dense convolution).
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
    /// The same options with `groups` channel groups.
    pub fn groups(self, groups: usize) -> Self {
        Conv2dOptions { groups, ..self }
    }
}

/// Checks the shapes and options of a convolution and works out its geometry (also for
/// `quant`'s INT8 convolution, so that both validate and size alike).
pub(crate) fn geometry(
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
            let w = cast(weight, dt)?;
            return cast(self, dt)?.conv2d_from(&w, Some(weight), b.as_ref(), opts);
        }
        self.conv2d_from(weight, None, bias, opts)
    }

    /// `conv2d` with `weight` cast by autocast from `source` (when given): the backward
    /// keeps the source rather than the cast (see `SavedWeight`).
    fn conv2d_from(
        &self,
        weight: &Tensor,
        source: Option<&Tensor>,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
    ) -> Result<Tensor> {
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
        let (x_saved, w_fwd) = (saved_operand(self, dtype)?, saved_operand(weight, dtype)?);
        let w_saved = SavedWeight::new(&w_fwd, source.unwrap_or(weight));
        let (x_dtype, w_dtype) = (self.dtype(), weight.dtype());
        let b_dtype = bias.map(|b| b.dtype());
        let want = (self.requires_grad(), weight.requires_grad());
        let bias_s = bias.map(|b| b.storage());
        let out = x_saved.storage().conv2d(
            x_saved.layout(),
            &w_fwd.storage(),
            w_fwd.layout(),
            bias.zip(bias_s.as_deref()).map(|(b, s)| (s, b.layout())),
            &geom,
            dtype,
        )?;
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&geom.out_shape()),
            OP,
            &inputs,
            move |g| {
                let g = as_dtype(g, dtype)?;
                let w = want.0.then(|| w_saved.get()).transpose()?;
                let dtypes = (x_dtype, w_dtype, b_dtype);
                conv_grads(&g, &x_saved, w.as_ref(), &geom, want, dtypes)
            },
        ))
    }
}

impl Tensor {
    /// `conv2d(weight, bias, opts)`, then ReLU, then a 2×2 max-pool with stride 2 — the block
    /// of small CNNs — as one fused op (`cpu::conv::block`): the same values and gradients as
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

impl Tensor {
    /// `relu(batch_norm(self))` into `conv2d(weight, bias, opts)` — a ResNet block's
    /// BN + ReLU and the next convolution — as one op that never keeps the ReLU's output:
    /// the backward computes it again from `self` and the statistics (one elementwise pass
    /// with the forward's kernel, so the same bits) where the composition would have kept
    /// it for the convolution's weight gradient and the ReLU's mask. The same values,
    /// running statistics and gradients as
    /// `self.batch_norm_act(.., None, true)?.conv2d(weight, bias, opts)`, bit for bit, with
    /// one activation less alive from the forward to the backward (two of the six that a
    /// ResNet-50 bottleneck kept). Under autocast the convolution takes its
    /// operands in the autocast dtype as `conv2d` does. Eval mode, no graph, F64, or an
    /// input the convolution would cast run the composition (same results, same errors).
    pub fn batch_norm_relu_conv2d(
        &self,
        bn: &BatchNormParams<'_>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
    ) -> Result<Tensor> {
        use super::autocast::{cast, cast_opt, suspend, target};
        let compose = || self.batch_norm_params(bn, true)?.conv2d(weight, bias, opts);
        let dtype = self.dtype();
        if !BnSaved::applies(self, bn, &[weight]) {
            return compose();
        }
        // The convolution's operands as `conv2d` would take them from the norm's output,
        // which has this input's dtype.
        let (w, b) = match target(OP, &[Some(self), Some(weight), bias]) {
            Some(dt) if dt == dtype => (cast(weight, dt)?, cast_opt(bias, dt)?),
            Some(_) => return compose(),
            None => (weight.clone(), bias.cloned()),
        };
        if w.dtype() != dtype || b.as_ref().is_some_and(|b| b.dtype() != dtype) {
            return compose();
        }
        let geom = geometry(
            self.shape(),
            w.shape(),
            b.as_ref().map(|b| b.shape()),
            &opts,
        )?;
        let (z, bn_saved) = BnSaved::forward(self, bn, true, self.requires_grad())?;
        let x_saved = self.detach();
        let y = {
            let _no_graph = crate::autograd::no_grad();
            let _no_autocast = suspend();
            z.conv2d(&w, b.as_ref(), opts)?
        };
        drop(z);

        let mut inputs = vec![self];
        inputs.extend(bn.weight);
        inputs.extend(bn.bias);
        inputs.push(&w);
        inputs.extend(b.as_ref());
        let w_saved = SavedWeight::new(&saved_operand(&w, dtype)?, weight);
        let need_dw = w.requires_grad();
        let conv_b_dtype = b.as_ref().map(|b| b.dtype());
        let zl = Layout::contiguous(self.shape());
        let bn_inputs = 1 + usize::from(bn.weight.is_some()) + usize::from(bn.bias.is_some());
        Ok(Tensor::from_op(
            y.storage(),
            y.layout().clone(),
            "batch_norm_relu_conv2d",
            &inputs,
            move |g| {
                let g = as_dtype(g, dtype)?;
                // The ReLU's output again: the convolution's input and the ReLU's mask.
                let z = Tensor::from_storage(Arc::new(bn_saved.recompute(&x_saved)?), zl.clone());
                let want_dz = bn_saved.wants_grads();
                let w = want_dz.then(|| w_saved.get()).transpose()?;
                let dtypes = (dtype, dtype, conv_b_dtype);
                let mut conv = conv_grads(&g, &z, w.as_ref(), &geom, (want_dz, need_dw), dtypes)?;
                let mut grads = match conv.remove(0) {
                    Some(dz) => bn_saved.backward(&x_saved, &dz.storage(), Some(&z.storage()))?,
                    None => vec![None; bn_inputs],
                };
                grads.extend(conv);
                Ok(grads)
            },
        ))
    }
}

/// A max-pool's kernel, stride and padding.
type PoolArgs = ((usize, usize), (usize, usize), (usize, usize));

/// What follows the norm in `conv2d_norm`.
#[derive(Clone, Copy)]
enum Tail<'a> {
    /// Nothing (`conv2d_batch_norm`).
    Norm,
    /// ReLU, then a max-pool (`conv2d_batch_norm_relu_max_pool2d`).
    ReluMaxPool(PoolArgs),
    /// `+ residual`, then ReLU (`conv2d_batch_norm_add_relu`).
    AddRelu(&'a Tensor),
}

impl Tensor {
    /// `conv2d(weight, bias, opts)` into `batch_norm` — a ResNet's projection shortcut — as
    /// one op that keeps the convolution's input but not its output: the backward computes
    /// the convolution again (the same kernels, the same bits) for the norm's gradient. The
    /// same values, running statistics and gradients as the composition, bit for bit, with
    /// one activation less alive from the forward to the backward, for one more
    /// convolution forward in the backward. Autocast casts the operands as `conv2d` does;
    /// eval mode, no graph, F64 or mixed dtypes run the composition.
    pub fn conv2d_batch_norm(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
        bn: &BatchNormParams<'_>,
    ) -> Result<Tensor> {
        self.conv2d_norm(weight, bias, opts, bn, Tail::Norm)
    }

    /// `conv2d`, `batch_norm`, ReLU, then `max_pool2d(kernel, stride, padding)` — the
    /// ImageNet ResNets' stem — as one op that keeps only the convolution's input and the
    /// pool's argmax: the backward computes the convolution's output and the ReLU's output
    /// again (the same bits). (Finding the argmax again too saved its 24.5 MiB at ResNet-50
    /// batch 32 but cost 1.7 % of an amp-bf16 step in the unvectorised 3×3/2 pool.) The
    /// same values, running statistics and gradients as the composition, bit for bit (as
    /// `conv2d_batch_norm` otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_batch_norm_relu_max_pool2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
        bn: &BatchNormParams<'_>,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
    ) -> Result<Tensor> {
        self.conv2d_norm(
            weight,
            bias,
            opts,
            bn,
            Tail::ReluMaxPool((kernel, stride, padding)),
        )
    }

    /// `relu(batch_norm(conv2d(self, weight, bias, opts)) + residual)` — the end of a
    /// ResNet bottleneck — as one op that keeps the convolution's input and the output but
    /// not the convolution's output: the backward computes the convolution again (the same
    /// kernels, the same bits). Worth it where the convolution is cheap for the activation
    /// it makes (a 1×1 convolution reading few channels writing four times as many: 64 → 256
    /// in a ResNet-50's first stage, whose outputs are the largest tensors of the network).
    /// The same values, running statistics and gradients as the composition, bit for bit;
    /// `residual` must have the output's shape and the operands' dtype (else, and in eval
    /// mode, without a graph or in F64, the composition runs).
    pub fn conv2d_batch_norm_add_relu(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
        bn: &BatchNormParams<'_>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.conv2d_norm(weight, bias, opts, bn, Tail::AddRelu(residual))
    }

    /// Convolution, batch norm and `tail`, as one op.
    fn conv2d_norm(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: Conv2dOptions,
        bn: &BatchNormParams<'_>,
        tail: Tail<'_>,
    ) -> Result<Tensor> {
        use super::autocast::{cast, cast_opt, target};
        use super::pool::{pooled_shape, window_geometry};
        let (pool, residual) = match tail {
            Tail::Norm => (None, None),
            Tail::ReluMaxPool(p) => (Some(p), None),
            Tail::AddRelu(r) => (None, Some(r)),
        };
        let relu = !matches!(tail, Tail::Norm);
        let compose = || {
            let y = self.conv2d(weight, bias, opts)?;
            let z = y.batch_norm_residual(bn, residual, relu)?;
            match pool {
                Some((k, s, p)) => z.max_pool2d(k, s, p),
                None => Ok(z),
            }
        };
        let mut others = vec![weight];
        others.extend(residual);
        if !BnSaved::applies(self, bn, &others) {
            return compose();
        }
        let (x, w, b) = match target(OP, &[Some(self), Some(weight), bias]) {
            Some(dt) => (cast(self, dt)?, cast(weight, dt)?, cast_opt(bias, dt)?),
            None => (self.clone(), weight.clone(), bias.cloned()),
        };
        let dtype = x.dtype();
        if w.dtype() != dtype || b.as_ref().is_some_and(|b| b.dtype() != dtype) {
            return compose();
        }
        let geom = geometry(x.shape(), w.shape(), b.as_ref().map(|b| b.shape()), &opts)?;
        if residual.is_some_and(|r| r.dtype() != dtype || r.shape() != geom.out_shape()) {
            return compose();
        }
        let (x_saved, w_fwd) = (saved_operand(&x, dtype)?, saved_operand(&w, dtype)?);
        let b_saved = b.as_ref().map(|b| b.detach());
        let conv = move |x_saved: &Tensor, w: &Tensor| -> Result<Tensor> {
            let bs = b_saved.as_ref().map(|b| b.storage());
            let y = x_saved.storage().conv2d(
                x_saved.layout(),
                &w.storage(),
                w.layout(),
                b_saved
                    .as_ref()
                    .zip(bs.as_deref())
                    .map(|(b, s)| (s, b.layout())),
                &geom,
                dtype,
            )?;
            Ok(Tensor::from_storage(
                Arc::new(y),
                Layout::contiguous(&geom.out_shape()),
            ))
        };
        let y = conv(&x_saved, &w_fwd)?;
        let pool_g = pool
            .map(|(k, s, p)| window_geometry("max_pool2d", &y, k, s, p))
            .transpose()?;
        let (z, bn_saved) = BnSaved::forward_residual(&y, bn, residual, relu, true)?;
        let out_shape = match &pool_g {
            Some(g) => pooled_shape(&y, g.h_out, g.w_out),
            None => y.shape().to_vec(),
        };
        drop(y);
        let (out, argmax) = match &pool_g {
            Some(g) => {
                let r = z.storage().max_pool2d(z.layout(), g, false)?;
                (Arc::new(r.out), Some(r.argmax))
            }
            None => (z.storage(), None),
        };
        drop(z);
        // With a residual the ReLU's mask is read from the output (as `batch_norm_act`
        // does): the next block's input, kept by its own convolution anyway.
        let out_saved =
            residual.map(|_| Tensor::from_storage(out.clone(), Layout::contiguous(&out_shape)));
        let want_res = residual.is_some_and(|r| r.requires_grad());

        let mut inputs = vec![&x, &w];
        inputs.extend(b.as_ref());
        inputs.extend(bn.weight);
        inputs.extend(bn.bias);
        inputs.extend(residual);
        let w_saved = SavedWeight::new(&w_fwd, weight);
        let want = (x.requires_grad(), w.requires_grad());
        let b_dtype = b.as_ref().map(|b| b.dtype());
        Ok(Tensor::from_op(
            out,
            Layout::contiguous(&out_shape),
            "conv2d_batch_norm",
            &inputs,
            move |g| {
                let g = as_dtype(g, dtype)?.contiguous()?;
                let w = w_saved.get()?;
                // The convolution's output again: the norm's input.
                let y = conv(&x_saved, &w)?;
                let gs = g.storage();
                let (pooled, z) = match (&pool_g, &argmax) {
                    (Some(pg), Some(am)) => {
                        let dz = gs.max_pool2d_backward(g.layout(), am, pg, dtype)?;
                        (Some(dz), Some(bn_saved.recompute(&y)?))
                    }
                    _ => (None, None),
                };
                let dz = pooled.as_ref().unwrap_or(&gs);
                let out_st = out_saved.as_ref().map(|o| o.storage());
                let z_or_out = z.as_ref().or(out_st.as_deref());
                let (mut grads, dres) = bn_saved.backward_residual(&y, dz, z_or_out, want_res)?;
                let has_res = out_st.is_some();
                drop((y, z, out_st, pooled, gs));
                let dy = grads
                    .remove(0)
                    .expect("the norm's input gradient was asked for");
                let dtypes = (dtype, dtype, b_dtype);
                let mut out = conv_grads(&dy, &x_saved, Some(&w), &geom, want, dtypes)?;
                out.extend(grads);
                if has_res {
                    out.push(dres);
                }
                Ok(out)
            },
        ))
    }
}

/// The weight a convolution's backward multiplies by. Under autocast that is a half copy
/// of an F32 weight; the backward keeps the F32 tensor instead (alive anyway as the
/// parameter) and casts it again (the same rounding, so the same bits), so that the copies
/// do not live from the forward to the backward: ResNet-50's 25.5 M weights are 49 MiB of
/// BF16 at the peak otherwise, against a cast of them per step. The source's storage is
/// held, so an optimizer that replaces the parameter's data in between does not change
/// this backward.
enum SavedWeight {
    /// The weight itself (detached).
    Kept(Tensor),
    /// An F32 source (detached) and the dtype autocast cast it to.
    Recast { source: Tensor, dtype: DType },
}

impl SavedWeight {
    /// For `weight`, autocast's cast of `source` (or `source` itself).
    fn new(weight: &Tensor, source: &Tensor) -> SavedWeight {
        if source.dtype() == DType::F32 && weight.dtype() != DType::F32 {
            SavedWeight::Recast {
                source: source.detach(),
                dtype: weight.dtype(),
            }
        } else {
            SavedWeight::Kept(weight.detach())
        }
    }

    /// The weight as the forward multiplied by it.
    fn get(&self) -> Result<Tensor> {
        match self {
            SavedWeight::Kept(w) => Ok(w.clone()),
            SavedWeight::Recast { source, dtype } => source.to_dtype(*dtype)?.contiguous(),
        }
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
    let dtype = x.dtype();
    let w_saved = weight.detach().contiguous()?;
    let bias_s = bias.map(|b| b.storage());
    let (out, idx) = x.storage().conv2d_relu_max_pool2(
        x.layout(),
        &w_saved.storage(),
        w_saved.layout(),
        bias.zip(bias_s.as_deref()).map(|(b, s)| (s, b.layout())),
        &geom,
    )?;
    let x_saved = x.detach();
    let want_dx = input.requires_grad();
    let has_bias = bias.is_some();
    let mut inputs = vec![input, weight];
    inputs.extend(bias);
    Ok(Tensor::from_op(
        Arc::new(out),
        Layout::contiguous(&geom.pooled_shape()),
        op,
        &inputs,
        move |g| {
            let g = as_dtype(g, dtype)?;
            let grads = g.storage().conv2d_relu_max_pool2_backward(
                g.layout(),
                &idx,
                (&x_saved.storage(), x_saved.layout()),
                (&w_saved.storage(), w_saved.layout()),
                &geom,
                BlockGrads {
                    dx: want_dx,
                    bias: has_bias,
                },
            )?;
            let t = |s: Storage, shape: &[usize]| {
                Tensor::from_storage(Arc::new(s), Layout::contiguous(shape))
            };
            let mut out = vec![
                grads.dx.map(|s| t(s, x_saved.shape())),
                grads.dweight.map(|s| t(s, w_saved.shape())),
            ];
            if let Some(db) = grads.dbias {
                out.push(Some(t(db, &[geom.c_out])));
            }
            Ok(out)
        },
    ))
}

/// A convolution operand as the backward keeps it: detached, and for F16/BF16 convolutions
/// a contiguous copy (half-size), so that every layout takes the same kernels and gives the
/// same bits.
fn saved_operand(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype.is_half() {
        t.detach().contiguous()
    } else {
        Ok(t.detach())
    }
}

/// A convolution's gradients from its output gradient `g`, in the order of its inputs:
/// the input's (when `want.0`, with the weight `w`), the weight's (when `want.1`, with the
/// saved input `x`), the bias's (when the bias has a dtype); `dtypes`: input, weight, bias.
fn conv_grads(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    geom: &Conv2dGeom,
    want: (bool, bool),
    (x_dtype, w_dtype, b_dtype): (DType, DType, Option<DType>),
) -> Result<Vec<Option<Tensor>>> {
    let (gs, gl) = (g.storage(), g.layout());
    let dx = match (want.0, w) {
        (true, Some(w)) => {
            Some(gs.conv2d_backward_input(gl, &w.storage(), w.layout(), geom, x_dtype)?)
        }
        _ => None,
    };
    let dw = want
        .1
        .then(|| {
            let xs = x.storage();
            xs.conv2d_backward_weight(x.layout(), &gs, gl, geom, w_dtype)
        })
        .transpose()?;
    let db = b_dtype
        .map(|bd| gs.conv2d_backward_bias(gl, geom, bd))
        .transpose()?;
    let t =
        |s: Storage, shape: &[usize]| Tensor::from_storage(Arc::new(s), Layout::contiguous(shape));
    let mut grads = vec![
        dx.map(|s| t(s, &geom.in_shape())),
        dw.map(|s| t(s, &geom.weight_shape())),
    ];
    grads.extend(db.map(|db| Some(t(db, &[geom.c_out]))));
    Ok(grads)
}

/// `g` in `dtype`: the backward kernels read a gradient of the output's dtype. (For F32 and
/// F64 outputs this is exactly the conversion to the compute type the kernels would make.)
fn as_dtype(g: &Tensor, dtype: DType) -> Result<Tensor> {
    if g.dtype() == dtype {
        Ok(g.clone())
    } else {
        g.to_dtype(dtype)
    }
}
