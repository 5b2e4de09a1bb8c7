//! Network primitives: matmul and batched matmul with F32 accumulation, convolutions
//! forward and backward (and the fused conv + ReLU + max-pool block), pools, batch and layer
//! norms, each with its backward.
//!
//! Dtypes: a primitive computes in the compute type of the promoted dtype of its float
//! inputs (F32 for F16, BF16 and F32; F64 when one is F64) unless it says otherwise, and
//! rounds each result once into the dtype it is asked for. The ops above decide the dtypes
//! (promotion, autocast) and check shapes; the geometry structs here carry the checked
//! shapes down.

use std::any::Any;
use std::sync::Arc;

use super::declare::{primitives, Lift};
use super::map::MapOps;
use super::reduce::ReduceOps;
use crate::dtype::DType;
use crate::tensor::Layout;

/// Output size of one spatial dim of a convolution (PyTorch's formula), or `None` when the
/// dilated kernel does not fit in the padded input.
pub fn conv_out_size(
    size: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let span = dilation * (kernel - 1) + 1;
    let padded = size + 2 * padding;
    (padded >= span).then(|| (padded - span) / stride + 1)
}

/// Shape of a 2-D convolution (validated by the caller: sizes fit, groups divide channels,
/// strides and dilations positive). Input `[n, c_in, h, w]`, weight
/// `[c_out, c_in/groups, kh, kw]`, output `[n, c_out, h_out, w_out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dGeom {
    /// Batch size (images).
    pub n: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height in pixels.
    pub h: usize,
    /// Input width in pixels.
    pub w: usize,
    /// Output channels (filters).
    pub c_out: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (vertical, horizontal), each >= 1.
    pub stride: (usize, usize),
    /// Zero padding added to each side (top/bottom, left/right).
    pub padding: (usize, usize),
    /// Spacing between kernel taps (vertical, horizontal), each >= 1; 1 is a dense kernel.
    pub dilation: (usize, usize),
    /// Number of channel groups; divides `c_in` and `c_out` (1: an ordinary convolution;
    /// `c_in`: depthwise).
    pub groups: usize,
    /// Output height, from `conv_out_size`.
    pub h_out: usize,
    /// Output width, from `conv_out_size`.
    pub w_out: usize,
}

impl Conv2dGeom {
    /// Output pixels per channel (the GEMM's N).
    pub fn l(&self) -> usize {
        self.h_out * self.w_out
    }
    /// Reduction length of one output element (the GEMM's K): c_in/groups * kh * kw.
    pub fn k(&self) -> usize {
        self.c_in / self.groups * self.kh * self.kw
    }
    /// Output channels per group (the GEMM's M).
    pub fn c_out_g(&self) -> usize {
        self.c_out / self.groups
    }
    /// Elements of one input image: `c_in * h * w`.
    pub fn in_image(&self) -> usize {
        self.c_in * self.h * self.w
    }
    /// Elements of one output image: `c_out * h_out * w_out`.
    pub fn out_image(&self) -> usize {
        self.c_out * self.l()
    }
    /// Elements of one image's column (im2col) matrix: `c_in * kh * kw * h_out * w_out`.
    pub fn col_len(&self) -> usize {
        self.c_in * self.kh * self.kw * self.l()
    }
    /// Elements of the weight: `c_out * (c_in / groups) * kh * kw`.
    pub fn weight_len(&self) -> usize {
        self.c_out * self.k()
    }
    /// The output shape `[n, c_out, h_out, w_out]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.n, self.c_out, self.h_out, self.w_out]
    }
    /// The input shape `[n, c_in, h, w]`.
    pub fn in_shape(&self) -> [usize; 4] {
        [self.n, self.c_in, self.h, self.w]
    }
    /// The weight shape `[c_out, c_in / groups, kh, kw]` (PyTorch's layout).
    pub fn weight_shape(&self) -> [usize; 4] {
        [self.c_out, self.c_in / self.groups, self.kh, self.kw]
    }
    /// Output of the fused conv + ReLU + 2×2 max-pool block: `[n, c_out, h_out/2, w_out/2]`
    /// (the pool drops an odd last row or column, as PyTorch's floor mode does).
    pub fn pooled_shape(&self) -> [usize; 4] {
        [self.n, self.c_out, self.h_out / 2, self.w_out / 2]
    }
    /// A 1x1 kernel with unit stride and no padding: the column matrix is the image itself,
    /// so im2col and col2im are skipped.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == (1, 1) && self.padding == (0, 0)
    }
}

/// The row stride of the one tall matrix that dims `0..rank-1` of a view form, when they
/// merge (each non-unit dim's stride is the next non-unit dim's stride times its size):
/// then a batch of matrices times one matrix is a single product.
pub fn merged_row_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let r = shape.len();
    // The innermost non-unit dim sets the row stride; each outer one must continue it.
    let mut row_stride = None;
    let mut inner: Option<(usize, usize)> = None; // (size, stride) of the last non-unit dim
    for i in (0..r - 1).rev() {
        if shape[i] == 1 {
            continue;
        }
        match inner {
            Some((size, stride)) if strides[i] != size * stride => return None,
            Some(_) => {}
            None => row_stride = Some(strides[i]),
        }
        inner = Some((shape[i], strides[i]));
    }
    Some(row_stride.unwrap_or(strides[r - 2]))
}

/// Shape of a windowed 2-D pool (max or average) over `planes` planes (N*C) of `h x w`,
/// PyTorch's semantics without ceil_mode (validated by the caller: kernel and stride
/// positive, padding at most half the kernel, the kernel fits in the padded input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dGeom {
    /// Number of planes pooled independently (batch × channels).
    pub planes: usize,
    /// Input plane height.
    pub h: usize,
    /// Input plane width.
    pub w: usize,
    /// Window size (height, width).
    pub kernel: (usize, usize),
    /// Window step (vertical, horizontal).
    pub stride: (usize, usize),
    /// Implicit padding on each side (-inf for max pooling, zeros for average pooling).
    pub padding: (usize, usize),
    /// Output plane height.
    pub h_out: usize,
    /// Output plane width.
    pub w_out: usize,
}

impl Pool2dGeom {
    /// Elements of one input plane: `h * w`.
    pub fn in_plane(&self) -> usize {
        self.h * self.w
    }
    /// Elements of one output plane: `h_out * w_out`.
    pub fn out_plane(&self) -> usize {
        self.h_out * self.w_out
    }
}

/// Shape of an adaptive average pool: `planes` planes of `h x w` to `h_out x w_out` (all
/// positive, checked by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptivePool2dGeom {
    /// Number of planes pooled independently (batch × channels).
    pub planes: usize,
    /// Input plane height.
    pub h: usize,
    /// Input plane width.
    pub w: usize,
    /// Output plane height.
    pub h_out: usize,
    /// Output plane width.
    pub w_out: usize,
}

/// A batch-norm input seen as `[n, c, s]`, `s` the product of the spatial dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormGeom {
    /// Batch size (the first dim).
    pub n: usize,
    /// Channels (the second dim): one mean and variance each.
    pub c: usize,
    /// Spatial positions per channel and image (1 for `[n, c]` input).
    pub s: usize,
}

impl BatchNormGeom {
    /// Values per channel (the batch-statistics count).
    pub fn m(self) -> usize {
        self.n * self.s
    }
}

/// Shape of a scaled-dot-product attention (checked by the caller): `batch` heads (the
/// product of the leading dims), each with queries `[lq, d]`, keys `[lk, d]`, values
/// `[lk, dv]` and output `[lq, dv]`; the scores are `scale · q·kᵀ (+ mask)`. `dropout`: the
/// drop probability in (0, 1) and the seed of the counter-based mask (the same seed gives
/// the same mask in the forward and the backward, on any number of threads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionGeom {
    /// Number of independent heads: the product of the leading dims of `q`, `k` and `v`.
    pub batch: usize,
    /// Query length (rows of each head's scores).
    pub lq: usize,
    /// Key/value length (columns of each head's scores).
    pub lk: usize,
    /// Query and key feature size per head.
    pub d: usize,
    /// Value feature size per head (the output's last dim).
    pub dv: usize,
    /// Factor applied to `q·kᵀ` before the softmax, usually `1/sqrt(d)`.
    pub scale: f64,
    /// Dropout on the attention probabilities: `(probability, seed)`, or `None` for no
    /// dropout.
    pub dropout: Option<(f64, u64)>,
}

/// What a forward keeps for its backward on the backend (max-pool's argmax, the fused
/// block's window indices): opaque above the boundary, read back by the backend that made
/// it.
#[derive(Clone)]
pub struct Indices(Arc<dyn Any + Send + Sync>);

impl Indices {
    /// Wraps a backend's value for a backward to read back with `get`.
    pub fn new<T: Any + Send + Sync>(v: T) -> Indices {
        Indices(Arc::new(v))
    }
    /// The backend's own value, `None` when it is of another type (another backend's).
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for Indices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Indices(..)")
    }
}

/// Result of `max_pool2d`: the maxima, the argmax the backward reads, and (when asked for)
/// the flat index `h*W + w` of each maximum within its plane as an I64 buffer.
#[derive(Clone, Debug)]
pub struct MaxPool2d<S> {
    /// The pooled maxima, in the input's dtype.
    pub out: S,
    /// Where each maximum came from, for `max_pool2d_backward` (backend-private).
    pub argmax: Indices,
    /// The flat index `h*W + w` of each maximum within its plane (I64), when asked for
    /// (PyTorch's `return_indices=True`).
    pub indices: Option<S>,
}

/// Result of `batch_norm`: the output, the per-channel mean and 1/sqrt(var + eps) the
/// backward reads (in the compute type: F32, or F64 for F64 input), and in training with
/// running statistics their updated values (each in its own dtype).
#[derive(Clone, Debug)]
pub struct BatchNorm<S> {
    /// The normalised, scaled and shifted output, in the input's dtype.
    pub out: S,
    /// Per-channel batch mean (or the running mean in eval), in the compute type.
    pub mean: S,
    /// Per-channel `1/sqrt(var + eps)`, in the compute type.
    pub invstd: S,
    /// The updated running (mean, var) in training with running statistics, each in its own
    /// dtype; `None` otherwise.
    pub running: Option<(S, S)>,
}

/// Result of `layer_norm`: the output and per-row mean and 1/sqrt(var + eps) (compute type).
#[derive(Clone, Debug)]
pub struct LayerNorm<S> {
    /// The normalised, scaled and shifted output, in the input's dtype.
    pub out: S,
    /// Per-row mean, in the compute type.
    pub mean: S,
    /// Per-row `1/sqrt(var + eps)`, in the compute type.
    pub rstd: S,
}

/// Gradients of a norm or of the fused block: the input's (when asked for), the weight's
/// and the bias's (when asked for, by giving their dtypes).
#[derive(Clone, Debug)]
pub struct Grads<S> {
    /// Gradient of the input, when asked for.
    pub dx: Option<S>,
    /// Gradient of the weight (scale), when asked for.
    pub dweight: Option<S>,
    /// Gradient of the bias (shift), when asked for.
    pub dbias: Option<S>,
}

/// An optional input of a primitive: its buffer and layout.
pub type Opt<'a, S> = Option<(&'a S, &'a Layout)>;

/// Batch norm's running (mean, var), each a buffer and its layout.
pub type Running<'a, S> = Option<((&'a S, &'a Layout), (&'a S, &'a Layout))>;

/// The dtypes of a norm's gradients (input, weight, bias); `None`: not wanted.
pub type GradDTypes = (Option<DType>, Option<DType>, Option<DType>);

/// An input of a primitive: its buffer and the layout it is read through.
pub type View<'a, S> = (&'a S, &'a Layout);

/// A norm's optional scale (`weight`) and shift (`bias`), per channel or per feature.
#[derive(Debug)]
pub struct Affine<'a, S> {
    /// Multiplies the normalised values.
    pub weight: Opt<'a, S>,
    /// Added after the scale.
    pub bias: Opt<'a, S>,
}

impl<S> Clone for Affine<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for Affine<'_, S> {}

impl<'a, S> Affine<'a, S> {
    /// Neither scale nor shift.
    pub fn none() -> Self {
        Affine {
            weight: None,
            bias: None,
        }
    }
}

/// How a batch norm normalises: with the batch's statistics (`training`) or the running
/// ones; the running update's `momentum`; `eps` added to the variance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormMode {
    /// Batch statistics (and the running update) when true, running statistics otherwise.
    pub training: bool,
    /// Weight of the batch statistic in the running update.
    pub momentum: f64,
    /// Added to the variance before the inverse square root.
    pub eps: f64,
}

/// The activation end of the fused batch norm: an optional residual added to the
/// normalised output, then the ReLU when `relu`.
#[derive(Debug)]
pub struct Act<'a, S> {
    /// Added before the ReLU (`x`'s shape and dtype).
    pub residual: Opt<'a, S>,
    /// Apply the ReLU.
    pub relu: bool,
}

/// What a norm's backward reads from its forward: the per-channel (per-row) `mean` and
/// `invstd` it returned, the scale it applied, and whether the statistics were computed from
/// the input (training batch norm, layer norm: the gradient flows through them) or given
/// (batch norm on running statistics).
#[derive(Debug)]
pub struct Saved<'a, S> {
    /// The forward's mean, in the compute type.
    pub mean: &'a S,
    /// The forward's `1/sqrt(var + eps)`, in the compute type.
    pub invstd: &'a S,
    /// The scale the forward applied.
    pub weight: Opt<'a, S>,
    /// The statistics depend on the input.
    pub from_input: bool,
}

/// The activation end of the fused batch norm's backward: the output `y` when the ReLU was
/// applied (its mask), and whether the residual's gradient is wanted.
#[derive(Debug)]
pub struct ActSaved<'a, S> {
    /// The forward's output, given when it applied the ReLU.
    pub y: Opt<'a, S>,
    /// Return the residual's gradient too.
    pub want_residual: bool,
}

/// The gradients the fused conv + ReLU + pool block's backward returns besides the
/// weight's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGrads {
    /// The input's gradient.
    pub dx: bool,
    /// The bias's gradient (the block had a bias).
    pub bias: bool,
}

/// Attention's inputs: the queries, keys and values, each a view.
#[derive(Debug)]
pub struct Qkv<'a, S> {
    /// Queries `[.., lq, d]`.
    pub q: View<'a, S>,
    /// Keys `[.., lk, d]`.
    pub k: View<'a, S>,
    /// Values `[.., lk, dv]`.
    pub v: View<'a, S>,
}

primitives! {
    /// The network primitives a backend implements: matmul, convolutions (and the fused conv +
    /// ReLU + max-pool block), pools, batch and layer norms and attention, each with its
    /// backward. `Storage` has a method of the same name for each that dispatches to the right
    /// backend; `ops/` calls those, never this trait directly.
    pub trait NnOps: MapOps + ReduceOps {
        /// `a · b (+ bias)`: `a` [.., m, k] (this buffer), `b` [.., k, n], both rank >= 2 with
        /// batch dims that broadcast (checked by the caller), `bias` `[n]` added to every row
        /// before the one rounding. Returns batch + [m, n] in `out`, the promoted dtype of the
        /// float inputs; sums in F32 (F64 for F64). Transposed, broadcast and sliced views cost
        /// no copy; F16/BF16 operands are multiplied as stored.
        fn matmul(
            &self,
            la: &Layout,
            rhs: &Self,
            lb: &Layout,
            bias: Opt<'_, Self>,
            out: DType,
        ) -> Result<Self>;

        /// 2-D convolution (cross-correlation): input `[n, c_in, h, w]` (this buffer), weight
        /// `[c_out, c_in/groups, kh, kw]`, optional bias `[c_out]` -> `[n, c_out, h_out, w_out]`
        /// in `out`, the promoted dtype of the float inputs (checked by the caller).
        fn conv2d(
            &self,
            lx: &Layout,
            w: &Self,
            lw: &Layout,
            bias: Opt<'_, Self>,
            g: &Conv2dGeom,
            out: DType,
        ) -> Result<Self>;

        /// Gradient of `conv2d` with respect to its input, from the output gradient `dy` (this
        /// buffer, `[n, c_out, h_out, w_out]`) and the weight: `[n, c_in, h, w]` in `out`.
        fn conv2d_backward_input(
            &self,
            ldy: &Layout,
            w: &Self,
            lw: &Layout,
            g: &Conv2dGeom,
            out: DType,
        ) -> Result<Self>;

        /// Gradient of `conv2d` with respect to its weight, from the input `x` (this buffer) and
        /// the output gradient `dy`: `[c_out, c_in/groups, kh, kw]` in `out`. The batch's sum
        /// is cut into runs fixed by the batch size, so the thread count changes no bit.
        fn conv2d_backward_weight(
            &self,
            lx: &Layout,
            dy: &Self,
            ldy: &Layout,
            g: &Conv2dGeom,
            out: DType,
        ) -> Result<Self>;

        /// Gradient of `conv2d` with respect to its bias: `dy` (this buffer) summed over the
        /// images and the output pixels, per channel, into `[c_out]` in `out`.
        fn conv2d_backward_bias(&self, ldy: &Layout, g: &Conv2dGeom, out: DType) -> Result<Self> {
            super::compose::conv2d_backward_bias(self, ldy, g, out)
        }

        /// `max_pool2d(relu(conv2d(x, w, bias)), 2, 2)` in one pass (the block of small CNNs):
        /// `x` (this buffer), `w` and `bias` all of one dtype, F32, F16 or BF16 (checked by the
        /// caller, as `h_out, w_out >= 2`); returns the pooled output `g.pooled_shape()` in that
        /// dtype and the window of each output for the backward.
        fn conv2d_relu_max_pool2(
            &self,
            lx: &Layout,
            w: &Self,
            lw: &Layout,
            bias: Opt<'_, Self>,
            g: &Conv2dGeom,
        ) -> Result<(Self, Indices)> {
            super::compose::conv2d_relu_max_pool2(self, lx, w, lw, bias, g)
        }

        /// Gradients of `conv2d_relu_max_pool2` from the pooled output gradient `dy` (this
        /// buffer, of the block's dtype), the forward's indices, input and weight: the input's
        /// when `want.dx`, the weight's, and the bias's when `want.bias`, all in the block's
        /// dtype.
        fn conv2d_relu_max_pool2_backward(
            &self,
            ldy: &Layout,
            indices: &Indices,
            x: View<'_, Self>,
            w: View<'_, Self>,
            g: &Conv2dGeom,
            want: BlockGrads,
        ) -> Result<Grads<Self>> {
            super::compose::conv2d_relu_max_pool2_backward(self, ldy, indices, x, w, g, want)
        }

        /// Max pooling of the planes of this buffer (padding -inf), in its dtype: the maxima,
        /// their argmax (first maximum wins ties, a NaN wins), and the I64 flat indices when
        /// `with_indices`. The caller checked that a plane holds fewer than 2^32 values.
        fn max_pool2d(&self, l: &Layout, g: &Pool2dGeom, with_indices: bool)
            -> Result<MaxPool2d<Self>>;

        /// Gradient of `max_pool2d` from the output gradient (this buffer) and the forward's
        /// argmax: each gradient added to its maximum's input, in the compute type of `out`.
        fn max_pool2d_backward(
            &self,
            ldy: &Layout,
            argmax: &Indices,
            g: &Pool2dGeom,
            out: DType,
        ) -> Result<Self>;

        /// Average pooling of the planes of this buffer (padding counts as zeros, and in the
        /// divisor when `count_include_pad`), in its dtype.
        fn avg_pool2d(&self, l: &Layout, g: &Pool2dGeom, count_include_pad: bool) -> Result<Self> {
            super::compose::pool::avg_pool2d(self, l, g, count_include_pad)
        }

        /// Gradient of `avg_pool2d`: each output gradient spread evenly over its window, in the
        /// compute type of `out`.
        fn avg_pool2d_backward(
            &self,
            ldy: &Layout,
            g: &Pool2dGeom,
            count_include_pad: bool,
            out: DType,
        ) -> Result<Self> {
            super::compose::pool::avg_pool2d_backward(self, ldy, g, count_include_pad, out)
        }

        /// Adaptive average pooling of the planes of this buffer (PyTorch's windows
        /// `[floor(i*H/out), ceil((i+1)*H/out))`), in its dtype.
        fn adaptive_avg_pool2d(&self, l: &Layout, g: &AdaptivePool2dGeom) -> Result<Self> {
            super::compose::pool::adaptive_avg_pool2d(self, l, g)
        }

        /// Gradient of `adaptive_avg_pool2d`, in the compute type of `out`.
        fn adaptive_avg_pool2d_backward(
            &self,
            ldy: &Layout,
            g: &AdaptivePool2dGeom,
            out: DType,
        ) -> Result<Self> {
            super::compose::pool::adaptive_avg_pool2d_backward(self, ldy, g, out)
        }

        /// Batch normalisation of this buffer `[n, c, s]` per channel, in its dtype, statistics
        /// in its compute type: with the batch's mean and biased variance (two passes) when
        /// `mode.training`, else with `running` (mean, var); then `* weight + bias`. In training
        /// with `running`, also returns `(1 - momentum) * running + momentum * batch` (the
        /// unbiased variance; computed in F64, rounded into each running buffer's dtype).
        fn batch_norm(
            &self,
            l: &Layout,
            g: BatchNormGeom,
            affine: Affine<'_, Self>,
            running: Running<'_, Self>,
            mode: BatchNormMode,
        ) -> Result<BatchNorm<Self>> {
            super::compose::batch_norm(self, l, g, affine, running, mode)
        }

        /// Gradients of `batch_norm` (closed form) from the output gradient (this buffer), the
        /// input `x`, the forward's `mean` and `invstd` and the weight: `dx` in `dx_dtype` when
        /// given, dweight = Σ g·xhat and dbias = Σ g per channel in the dtypes given. All read in
        /// the compute type of `x`. `saved.from_input`: the statistics depend on x.
        fn batch_norm_backward(
            &self,
            ldy: &Layout,
            x: View<'_, Self>,
            g: BatchNormGeom,
            saved: Saved<'_, Self>,
            dtypes: GradDTypes,
        ) -> Result<Grads<Self>> {
            super::compose::batch_norm_backward(self, ldy, x, g, saved, dtypes)
        }

        /// `relu(batch_norm(x) + residual)` in one pass (ResNet's BN + ReLU and BN + add + ReLU),
        /// `x` this buffer, `residual` (optional, `x`'s shape and dtype) and the ReLU (when
        /// `relu`) applied to the F32 result before its one rounding into `x`'s dtype, F32, F16
        /// or BF16 (checked by the caller). Statistics, running statistics and the returned
        /// `mean`/`invstd` as `batch_norm`.
        fn batch_norm_act(
            &self,
            l: &Layout,
            g: BatchNormGeom,
            act: Act<'_, Self>,
            affine: Affine<'_, Self>,
            running: Running<'_, Self>,
            mode: BatchNormMode,
        ) -> Result<BatchNorm<Self>> {
            super::compose::batch_norm_act(self, l, g, act, affine, running, mode)
        }

        /// Gradients of `batch_norm_act` from the output gradient (this buffer), the output `y`
        /// (given when the ReLU was applied: its mask), the input `x` and the forward's `mean`
        /// and `invstd`: the norm's gradients as `batch_norm_backward` (`dx` in `x`'s dtype), and
        /// when `want_residual` the residual's gradient (the output gradient through the ReLU,
        /// in `x`'s dtype).
        fn batch_norm_act_backward(
            &self,
            ldy: &Layout,
            act: ActSaved<'_, Self>,
            x: View<'_, Self>,
            g: BatchNormGeom,
            saved: Saved<'_, Self>,
            dtypes: GradDTypes,
        ) -> Result<(Grads<Self>, Option<Self>)> {
            super::compose::batch_norm_act_backward(self, ldy, act, x, g, saved, dtypes)
        }

        /// `batch_norm_act`'s output again (without residual), from the same input `x` (this
        /// buffer) and the `(mean, invstd)` that call returned (`stats`): the same bits, for a backward
        /// that recomputes an activation instead of keeping it (`Tensor::batch_norm_relu_conv2d`).
        fn batch_norm_act_apply(
            &self,
            l: &Layout,
            g: BatchNormGeom,
            stats: (&Self, &Self),
            affine: Affine<'_, Self>,
            relu: bool,
        ) -> Result<Self> {
            super::compose::batch_norm_act_apply(self, l, g, stats, affine, relu)
        }

        /// Layer normalisation of the rows of `d` values of this buffer, in its dtype,
        /// statistics in its compute type, then `* weight + bias` (each of the normalized
        /// shape, `d` values read row-major through its layout, whatever its rank).
        fn layer_norm(
            &self,
            l: &Layout,
            d: usize,
            affine: Affine<'_, Self>,
            eps: f64,
        ) -> Result<LayerNorm<Self>> {
            super::compose::layer_norm(self, l, d, affine, eps)
        }

        /// Gradients of `layer_norm` (closed form, as llm.c's) from the output gradient (this
        /// buffer), the input, the forward's per-row `mean` and `rstd` and the weight; dtypes
        /// (dx, dweight, dbias) as for `batch_norm_backward`. The sums over rows run in runs
        /// fixed by the shape, so the thread count changes no bit.
        fn layer_norm_backward(
            &self,
            ldy: &Layout,
            x: View<'_, Self>,
            d: usize,
            saved: Saved<'_, Self>,
            dtypes: GradDTypes,
        ) -> Result<Grads<Self>> {
            super::compose::layer_norm_backward(self, ldy, x, d, saved, dtypes)
        }

        /// Fused scaled-dot-product attention: `softmax(scale · q·kᵀ + mask) · v` per head, with
        /// dropout on the probabilities when `g.dropout` is set. `q` (this buffer), `k`, `v` are
        /// views of rank >= 2 whose leading dims (all equal) enumerate the `g.batch` heads, of one
        /// dtype; `mask` (in the compute type: F32, or F64 for F64) is a view of the same rank
        /// broadcast to `[.., lq, lk]`. Scores, softmax and products in the compute type, never
        /// the whole score tensor at once; returns the output `[.., lq, dv]` rounded once into
        /// `q`'s dtype and the per-row log-sum-exp of the scores (compute type, `[batch, lq]`),
        /// all the backward needs besides the inputs.
        fn attention(
            &self,
            lq: &Layout,
            k: View<'_, Self>,
            v: View<'_, Self>,
            mask: Opt<'_, Self>,
            g: &AttentionGeom,
        ) -> Result<(Self, Self)> {
            super::compose::attention::attention(Qkv { q: (self, lq), k, v }, mask, g)
        }

        /// Gradients of `attention` from the output gradient `dout` (this buffer, `[.., lq, dv]`),
        /// the inputs and the forward's log-sum-exp: the scores and probabilities are recomputed
        /// row by row. Returns (dq, dk, dv), contiguous, in `q`'s dtype.
        fn attention_backward(
            &self,
            ldout: &Layout,
            qkv: Qkv<'_, Self>,
            mask: Opt<'_, Self>,
            lse: &Self,
            g: &AttentionGeom,
        ) -> Result<(Self, Self, Self)> {
            super::compose::attention::attention_backward((self, ldout), qkv, mask, lse, g)
        }
    }
}

impl<B: Lift<S>, S> Lift<MaxPool2d<S>> for MaxPool2d<B> {
    fn lift(self) -> MaxPool2d<S> {
        MaxPool2d {
            out: self.out.lift(),
            argmax: self.argmax,
            indices: self.indices.lift(),
        }
    }
}

impl<B: Lift<S>, S> Lift<BatchNorm<S>> for BatchNorm<B> {
    fn lift(self) -> BatchNorm<S> {
        BatchNorm {
            out: self.out.lift(),
            mean: self.mean.lift(),
            invstd: self.invstd.lift(),
            running: self.running.lift(),
        }
    }
}

impl<B: Lift<S>, S> Lift<LayerNorm<S>> for LayerNorm<B> {
    fn lift(self) -> LayerNorm<S> {
        LayerNorm {
            out: self.out.lift(),
            mean: self.mean.lift(),
            rstd: self.rstd.lift(),
        }
    }
}

impl<B: Lift<S>, S> Lift<Grads<S>> for Grads<B> {
    fn lift(self) -> Grads<S> {
        Grads {
            dx: self.dx.lift(),
            dweight: self.dweight.lift(),
            dbias: self.dbias.lift(),
        }
    }
}
