//! BatchNorm2d and LayerNorm layers. Their tensors are marked `is_norm`: mixed-precision
//! presets keep them in F32.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{param, Conv2d, Kind, MaxPool2d, Module, Visit, Visitor, VisitorMut};
use crate::dist::ProcessGroup;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::norm::BatchNormParams;
use crate::tensor::Tensor;

/// PyTorch's `nn.BatchNorm2d(num_features, eps=1e-5, momentum=0.1, affine=True,
/// track_running_stats=True)`; state_dict: weight, bias, running_mean, running_var,
/// num_batches_tracked.
pub struct BatchNorm2d {
    /// Per-channel scale γ `[num_features]`, initialised to 1.
    pub weight: Tensor,
    /// Per-channel shift β `[num_features]`, initialised to 0.
    pub bias: Tensor,
    /// Running mean `[num_features]` used in eval mode, updated in training.
    pub running_mean: Tensor,
    /// Running (unbiased) variance `[num_features]` used in eval mode, updated in training.
    pub running_var: Tensor,
    /// Training batches seen (an I64 scalar, as PyTorch's buffer).
    pub num_batches_tracked: Tensor,
    /// Added to the variance before the square root (default 1e-5).
    pub eps: f64,
    /// Weight of the new batch's statistics in the running ones (default 0.1).
    pub momentum: f64,
    /// SyncBatchNorm: in training, the statistics are those of the batches of every rank of
    /// this group together (PyTorch's `nn.SyncBatchNorm`); `None` (the default): this
    /// process's batch only. Set by `dist::convert_sync_batch_norm`.
    pub sync: Option<Arc<ProcessGroup>>,
    pub(crate) training: AtomicBool,
}

impl BatchNorm2d {
    /// A batch norm over `num_features` channels of `[N, C, H, W]` (or `[N, C]`) inputs,
    /// with PyTorch's defaults; starts in training mode.
    pub fn new(num_features: usize) -> Result<Self> {
        Ok(BatchNorm2d {
            weight: param(Tensor::ones(&[num_features], DType::F32)?)?,
            bias: param(Tensor::zeros(&[num_features], DType::F32)?)?,
            running_mean: Tensor::zeros(&[num_features], DType::F32)?,
            running_var: Tensor::ones(&[num_features], DType::F32)?,
            num_batches_tracked: Tensor::zeros(&[], DType::I64)?,
            eps: 1e-5,
            momentum: 0.1,
            sync: None,
            training: AtomicBool::new(true),
        })
    }
}

impl BatchNorm2d {
    /// `relu(self.forward(x) + residual)` (the residual when given, the ReLU when `relu`)
    /// as one fused op (`Tensor::batch_norm_act`): the same values and gradients as the
    /// three layers, in one pass, keeping only `x` and the output for the backward.
    pub fn forward_act(&self, x: &Tensor, residual: Option<&Tensor>, relu: bool) -> Result<Tensor> {
        let training = self.count_batch()?;
        if let Some(g) = self.sync.as_ref().filter(|g| training && g.size() > 1) {
            return self.forward_sync(g, x, residual, relu);
        }
        let (rm, rv) = self.running();
        x.batch_norm_act(
            Some(&rm),
            Some(&rv),
            Some(&self.weight),
            Some(&self.bias),
            training,
            self.momentum,
            self.eps,
            residual,
            relu,
        )
    }

    /// `conv.forward(&relu(self.forward(x)))` as one fused op
    /// (`Tensor::batch_norm_relu_conv2d`): the same values and gradients, without keeping
    /// the ReLU's output for the backward (it is computed again there). A synchronised norm
    /// or a convolution with a forward hook (quantisation) runs the two layers.
    pub fn forward_relu_conv(&self, x: &Tensor, conv: &Conv2d) -> Result<Tensor> {
        if !self.fuses_with(conv) {
            return conv.forward(&self.forward_act(x, None, true)?);
        }
        let running = self.running();
        let bn = self.params(self.count_batch()?, &running);
        x.batch_norm_relu_conv2d(&bn, &conv.weight, conv.bias.as_ref(), conv.opts)
    }

    /// `self.forward(&conv.forward(x))` as one fused op (`Tensor::conv2d_batch_norm`): the
    /// same values and gradients, without keeping the convolution's output for the
    /// backward (it is computed again there). A synchronised norm or a convolution with a
    /// forward hook runs the two layers.
    pub fn forward_conv(&self, x: &Tensor, conv: &Conv2d) -> Result<Tensor> {
        if !self.fuses_with(conv) {
            return self.forward(&conv.forward(x)?);
        }
        let running = self.running();
        let bn = self.params(self.count_batch()?, &running);
        x.conv2d_batch_norm(&conv.weight, conv.bias.as_ref(), conv.opts, &bn)
    }

    /// `relu(self.forward(&conv.forward(x)) + residual)` as one fused op
    /// (`Tensor::conv2d_batch_norm_add_relu`): the same values and gradients, without
    /// keeping the convolution's output for the backward (it is computed again there). A
    /// synchronised norm or a convolution with a forward hook runs the layers one by one.
    pub fn forward_conv_add_relu(
        &self,
        x: &Tensor,
        conv: &Conv2d,
        residual: &Tensor,
    ) -> Result<Tensor> {
        if !self.fuses_with(conv) {
            return self.forward_act(&conv.forward(x)?, Some(residual), true);
        }
        let running = self.running();
        let bn = self.params(self.count_batch()?, &running);
        x.conv2d_batch_norm_add_relu(&conv.weight, conv.bias.as_ref(), conv.opts, &bn, residual)
    }

    /// `pool.forward(&relu(self.forward(&conv.forward(x))))` as one fused op
    /// (`Tensor::conv2d_batch_norm_relu_max_pool2d`, the ImageNet stem): the same values and
    /// gradients, keeping only `x` and the pool's argmax for the backward.
    pub fn forward_conv_relu_max_pool(
        &self,
        x: &Tensor,
        conv: &Conv2d,
        pool: &MaxPool2d,
    ) -> Result<Tensor> {
        if !self.fuses_with(conv) {
            return pool.forward(&self.forward_act(&conv.forward(x)?, None, true)?);
        }
        let running = self.running();
        let bn = self.params(self.count_batch()?, &running);
        x.conv2d_batch_norm_relu_max_pool2d(
            &conv.weight,
            conv.bias.as_ref(),
            conv.opts,
            &bn,
            pool.kernel,
            pool.stride,
            pool.padding,
        )
    }

    /// Whether this norm and `conv` may run as one fused op: not a synchronised norm (its
    /// statistics span the ranks), not a convolution with a forward hook (quantisation).
    fn fuses_with(&self, conv: &Conv2d) -> bool {
        self.sync.as_ref().is_none_or(|g| g.size() <= 1) && conv.hook.is_none()
    }

    /// The arguments of the functional batch norm for this layer, with `running` (from
    /// `running`).
    fn params<'a>(&'a self, training: bool, running: &'a (Tensor, Tensor)) -> BatchNormParams<'a> {
        BatchNormParams {
            running_mean: Some(&running.0),
            running_var: Some(&running.1),
            weight: Some(&self.weight),
            bias: Some(&self.bias),
            training,
            momentum: self.momentum,
            eps: self.eps,
        }
    }

    /// The running statistics the forward hands the op, which updates them in training:
    /// the layer's own, or, while a checkpointed segment's forward runs again in the
    /// backward (`autograd::is_recomputing`), handles on the same values that the op
    /// updates in vain. The recompute runs the very same op (so the same output), and the
    /// statistics are updated once per batch, by the forward, as without checkpointing.
    fn running(&self) -> (Tensor, Tensor) {
        if crate::autograd::is_recomputing() {
            (self.running_mean.detach(), self.running_var.detach())
        } else {
            (self.running_mean.clone(), self.running_var.clone())
        }
    }

    /// In training, counts one more batch in `num_batches_tracked` (not while a
    /// checkpointed segment is recomputed: the forward counted it); whether training.
    fn count_batch(&self) -> Result<bool> {
        let training = self.training.load(Ordering::Relaxed);
        if training && !crate::autograd::is_recomputing() {
            let n = self.num_batches_tracked.try_to_vec_i64()?[0];
            let count = Tensor::from_vec(vec![n + 1], &[])?;
            self.num_batches_tracked
                .set_data(&count.to_device(self.num_batches_tracked.device())?)?;
        }
        Ok(training)
    }
}

impl BatchNorm2d {
    /// SyncBatchNorm's training forward: the mean over the batches of all ranks first, then
    /// the biased variance around it (two passes, so no cancellation of E[x²] − E[x]²), each
    /// an F32 all-reduce that is differentiable (its backward all-reduces the gradients), so
    /// the composed backward is the global batch's. Statistics in F32; the output has the
    /// input's dtype, as the fused op's.
    fn forward_sync(
        &self,
        g: &Arc<ProcessGroup>,
        x: &Tensor,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        use crate::dist::all_reduce_sum;
        let shape = x.shape().to_vec();
        let c = self.weight.numel();
        if shape.len() < 2 || shape[1] != c {
            return Err(Error::shape(
                "SyncBatchNorm",
                format!("expected [N, {c}, *] input, got {shape:?}"),
            ));
        }
        let (n, l) = (shape[0], x.numel() / (shape[0] * c).max(1));
        let count = g.sum_f64(&[(n * l) as f64])?[0];
        if count < 2.0 {
            return Err(Error::arg(
                "SyncBatchNorm",
                format!("needs more than one value per channel over all ranks, got {count}"),
            ));
        }
        let xf = x.to_dtype(DType::F32)?.reshape(&[n, c, l])?;
        let mean = all_reduce_sum(g, &xf.sum(&[0, 2], false)?)?.div_scalar(count)?;
        let d = xf.sub(&mean.reshape(&[1, c, 1])?)?;
        let var = all_reduce_sum(g, &d.square()?.sum(&[0, 2], false)?)?.div_scalar(count)?;
        let rstd = var.add_scalar(self.eps)?.sqrt()?;
        let col = |t: &Tensor| t.to_dtype(DType::F32)?.reshape(&[1, c, 1]);
        let mut y = d
            .div(&col(&rstd)?)?
            .mul(&col(&self.weight)?)?
            .add(&col(&self.bias)?)?
            .reshape(&shape)?
            .to_dtype(x.dtype())?;
        if let Some(r) = residual {
            y = y.add(r)?;
        }
        if relu {
            y = y.relu()?;
        }
        if crate::autograd::is_recomputing() {
            // The forward updated the running statistics (see `running`).
            return Ok(y);
        }
        let _ng = crate::autograd::no_grad();
        let m = self.momentum;
        let update = |running: &Tensor, batch: &Tensor| -> Result<()> {
            let new = running
                .to_dtype(DType::F32)?
                .mul_scalar(1.0 - m)?
                .add(&batch.detach().mul_scalar(m)?)?;
            running.set_data(&new.to_dtype(running.dtype())?)
        };
        update(&self.running_mean, &mean)?;
        update(&self.running_var, &var.mul_scalar(count / (count - 1.0))?)?;
        Ok(y)
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, None, false)
    }
}

/// state_dict: weight, bias, running_mean, running_var, num_batches_tracked, all `is_norm`.
impl Visit for BatchNorm2d {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.tensor("weight", &self.weight, Kind::Parameter, true);
        v.tensor("bias", &self.bias, Kind::Parameter, true);
        v.tensor("running_mean", &self.running_mean, Kind::Buffer, true);
        v.tensor("running_var", &self.running_var, Kind::Buffer, true);
        v.tensor(
            "num_batches_tracked",
            &self.num_batches_tracked,
            Kind::Buffer,
            true,
        );
        v.training(&self.training);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.tensor("weight", &mut self.weight, Kind::Parameter, true);
        v.tensor("bias", &mut self.bias, Kind::Parameter, true);
        v.tensor("running_mean", &mut self.running_mean, Kind::Buffer, true);
        v.tensor("running_var", &mut self.running_var, Kind::Buffer, true);
        v.tensor(
            "num_batches_tracked",
            &mut self.num_batches_tracked,
            Kind::Buffer,
            true,
        );
    }
    fn as_batch_norm_mut(&mut self) -> Option<&mut BatchNorm2d> {
        Some(self)
    }
}

/// PyTorch's `nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`.
pub struct LayerNorm {
    /// Elementwise scale `normalized_shape`, initialised to 1.
    pub weight: Tensor,
    /// Elementwise shift `normalized_shape`, initialised to 0.
    pub bias: Tensor,
    /// The trailing dims normalised over.
    pub normalized_shape: Vec<usize>,
    /// Added to the variance before the square root (default 1e-5; BERT uses 1e-12).
    pub eps: f64,
}

impl LayerNorm {
    /// A layer norm over the trailing dims `normalized_shape`, with PyTorch's defaults.
    pub fn new(normalized_shape: &[usize]) -> Result<Self> {
        Ok(LayerNorm {
            weight: param(Tensor::ones(normalized_shape, DType::F32)?)?,
            bias: param(Tensor::zeros(normalized_shape, DType::F32)?)?,
            normalized_shape: normalized_shape.to_vec(),
            eps: 1e-5,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            &self.normalized_shape,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
        )
    }
}

impl Visit for LayerNorm {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.tensor("weight", &self.weight, Kind::Parameter, true);
        v.tensor("bias", &self.bias, Kind::Parameter, true);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.tensor("weight", &mut self.weight, Kind::Parameter, true);
        v.tensor("bias", &mut self.bias, Kind::Parameter, true);
    }
}
