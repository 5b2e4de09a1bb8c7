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

use std::sync::Arc;

use crate::backend::nn::{Act, ActSaved, Affine, BatchNormGeom, BatchNormMode, Saved};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Layout, Tensor};

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

/// A tensor's storage and layout, as the primitives take an optional input.
type Part = (Arc<crate::tensor::Storage>, Layout);

fn part(t: Option<&Tensor>) -> Option<Part> {
    t.map(|t| (t.storage(), t.layout().clone()))
}

fn as_ref(p: &Option<Part>) -> Option<(&crate::tensor::Storage, &Layout)> {
    p.as_ref().map(|(s, l)| (&**s, l))
}

/// The scale and shift of a norm as the primitives take them.
fn affine<'a>(w: &'a Option<Part>, b: &'a Option<Part>) -> Affine<'a, crate::tensor::Storage> {
    Affine {
        weight: as_ref(w),
        bias: as_ref(b),
    }
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
        self.batch_norm_act(
            running_mean,
            running_var,
            weight,
            bias,
            training,
            momentum,
            eps,
            None,
            false,
        )
    }

    /// `batch_norm(..)`, then `+ residual` (when given), then ReLU (when `relu`), as one op:
    /// ResNet's BN + ReLU and BN + shortcut + ReLU. The same values and gradients as
    /// `self.batch_norm(..)?.add(residual)?.relu()` (bit for bit in F32; in F16/BF16 the
    /// sum is rounded once instead of after each op), in one pass forward and two backward,
    /// keeping only the input and the output for the backward (the composition keeps three
    /// activations). F32, F16 and BF16 inputs with a residual of the same dtype and shape
    /// take the fused kernel; anything else runs the composition (same errors).
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_act(
        &self,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        const OP: &str = "batch_norm";
        let fused = residual.is_some() || relu;
        if fused {
            let dtype = self.dtype();
            let fits = matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
                && residual.is_none_or(|r| r.dtype() == dtype && r.shape() == self.shape());
            if !fits {
                let y = self.batch_norm_act(
                    running_mean,
                    running_var,
                    weight,
                    bias,
                    training,
                    momentum,
                    eps,
                    None,
                    false,
                )?;
                let y = match residual {
                    Some(r) => y.add(r)?,
                    None => y,
                };
                return if relu { y.relu() } else { Ok(y) };
            }
        }
        let p = BatchNormParams {
            running_mean,
            running_var,
            weight,
            bias,
            training,
            momentum,
            eps,
        };
        let BnForward {
            out,
            mean,
            invstd,
            d,
        } = self.batch_norm_forward(&p, residual, relu)?;
        let wp = part(weight);
        let shape = self.shape().to_vec();
        let dtype = self.dtype();
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let saved_x = self.detach();
        let need_dx = self.requires_grad();
        let (w_dtype, b_dtype) = (weight.map(|w| w.dtype()), bias.map(|b| b.dtype()));
        let cs = [d.c];
        let layout = Layout::contiguous(&shape);
        if fused {
            inputs.extend(residual);
            // The ReLU's mask is read from the output itself (as the ReLU op does), so the
            // node keeps the input and the output, nothing more.
            let saved_y = relu.then(|| Tensor::from_storage(out.clone(), layout.clone()));
            let want_res = residual.is_some_and(|r| r.requires_grad());
            let has_res = residual.is_some();
            return Ok(Tensor::from_op(
                out,
                layout,
                "batch_norm_act",
                &inputs,
                move |g| {
                    let g = if g.dtype() == dtype {
                        g.clone()
                    } else {
                        g.to_dtype(dtype)?
                    };
                    let yp = part(saved_y.as_ref());
                    let act = ActSaved {
                        y: as_ref(&yp),
                        want_residual: want_res,
                    };
                    let saved = Saved {
                        mean: &mean,
                        invstd: &invstd,
                        weight: as_ref(&wp),
                        from_input: training,
                    };
                    let (grads, dres) = g.storage().batch_norm_act_backward(
                        g.layout(),
                        act,
                        (&saved_x.storage(), saved_x.layout()),
                        d,
                        saved,
                        (need_dx.then_some(dtype), w_dtype, b_dtype),
                    )?;
                    let mut out = norm_grads(grads, &shape, &cs, &cs);
                    if has_res {
                        out.push(dres.map(|s| {
                            Tensor::from_storage(Arc::new(s), Layout::contiguous(&shape))
                        }));
                    }
                    Ok(out)
                },
            ));
        }
        Ok(Tensor::from_op(out, layout, OP, &inputs, move |g| {
            let saved = Saved {
                mean: &mean,
                invstd: &invstd,
                weight: as_ref(&wp),
                from_input: training,
            };
            let grads = g.storage().batch_norm_backward(
                g.layout(),
                (&saved_x.storage(), saved_x.layout()),
                d,
                saved,
                (need_dx.then_some(dtype), w_dtype, b_dtype),
            )?;
            Ok(norm_grads(grads, &shape, &cs, &cs))
        }))
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
        let dtype = self.dtype();
        let (wp, bp) = (part(weight), part(bias));
        let r = self
            .storage()
            .layer_norm(self.layout(), d, affine(&wp, &bp), eps)?;

        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let saved_x = self.detach();
        let need_dx = self.requires_grad();
        let (w_dtype, b_dtype) = (weight.map(|w| w.dtype()), bias.map(|b| b.dtype()));
        let pshape = normalized_shape.to_vec();
        let (mean, rstd) = (r.mean, r.rstd);
        Ok(Tensor::from_op(
            Arc::new(r.out),
            Layout::contiguous(&shape),
            OP,
            &inputs,
            move |g| {
                let saved = Saved {
                    mean: &mean,
                    invstd: &rstd,
                    weight: as_ref(&wp),
                    from_input: true,
                };
                let grads = g.storage().layer_norm_backward(
                    g.layout(),
                    (&saved_x.storage(), saved_x.layout()),
                    d,
                    saved,
                    (need_dx.then_some(dtype), w_dtype, b_dtype),
                )?;
                Ok(norm_grads(grads, &shape, &pshape, &pshape))
            },
        ))
    }
}

/// The batch norm half of `batch_norm_relu_conv2d`: what `batch_norm` takes besides the
/// input (see there).
#[derive(Clone, Copy, Debug)]
pub struct BatchNormParams<'a> {
    /// Updated in place in training; required in eval.
    pub running_mean: Option<&'a Tensor>,
    /// Updated in place in training (with the unbiased batch variance); required in eval.
    pub running_var: Option<&'a Tensor>,
    /// The affine scale `[C]`.
    pub weight: Option<&'a Tensor>,
    /// The affine shift `[C]`.
    pub bias: Option<&'a Tensor>,
    /// Batch statistics (and running updates) rather than the running statistics.
    pub training: bool,
    /// The running statistics' update factor.
    pub momentum: f64,
    /// Added to the variance.
    pub eps: f64,
}

/// A batch norm forward's results: the output, the statistics its backward reads, the
/// geometry.
struct BnForward {
    out: Arc<crate::tensor::Storage>,
    mean: crate::tensor::Storage,
    invstd: crate::tensor::Storage,
    d: BatchNormGeom,
}

/// What an op that fuses a batch norm (+ ReLU) with the ops around it keeps for the norm's
/// backward instead of the activations: the statistics and parameters. The caller keeps or
/// recomputes the norm's input; the ReLU's output, when needed, is computed again from it
/// with the forward's kernel (the same bits). Without the ReLU the norm is the plain
/// `batch_norm` (its own kernels, as the unfused layer runs).
pub(super) struct BnSaved {
    mean: crate::tensor::Storage,
    invstd: crate::tensor::Storage,
    d: BatchNormGeom,
    relu: bool,
    weight: Option<Part>,
    bias: Option<Part>,
    /// The gradients' dtypes: the input's when wanted, the parameters' when given.
    dtypes: (Option<DType>, Option<DType>, Option<DType>),
}

impl BnSaved {
    /// Whether `x` may take a fused op: training with a graph to record (`x`, the norm's
    /// parameters or `other` want gradients) on F32/F16/BF16 `[N, C, H, W]`. Otherwise the
    /// caller runs the composition, which keeps nothing extra then.
    pub(super) fn applies(x: &Tensor, bn: &BatchNormParams<'_>, other: &[&Tensor]) -> bool {
        let wants = x.requires_grad()
            || [bn.weight, bn.bias]
                .into_iter()
                .flatten()
                .any(|t| t.requires_grad())
            || other.iter().any(|t| t.requires_grad());
        bn.training
            && crate::autograd::is_grad_enabled()
            && wants
            && x.rank() == 4
            && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
    }

    /// `batch_norm(x)`, then ReLU when `relu` (running statistics updated), as a contiguous
    /// tensor outside the graph, and what the backward needs; `need_dx`: whether the
    /// backward gives `x` a gradient.
    pub(super) fn forward(
        x: &Tensor,
        bn: &BatchNormParams<'_>,
        relu: bool,
        need_dx: bool,
    ) -> Result<(Tensor, BnSaved)> {
        BnSaved::forward_residual(x, bn, None, relu, need_dx)
    }

    /// `forward` with `residual` (of `x`'s shape and dtype) added before the ReLU.
    pub(super) fn forward_residual(
        x: &Tensor,
        bn: &BatchNormParams<'_>,
        residual: Option<&Tensor>,
        relu: bool,
        need_dx: bool,
    ) -> Result<(Tensor, BnSaved)> {
        let BnForward {
            out,
            mean,
            invstd,
            d,
        } = x.batch_norm_forward(bn, residual, relu)?;
        let z = Tensor::from_storage(out, Layout::contiguous(x.shape()));
        let saved = BnSaved {
            mean,
            invstd,
            d,
            relu,
            weight: part(bn.weight),
            bias: part(bn.bias),
            dtypes: (
                need_dx.then_some(x.dtype()),
                bn.weight.map(|t| t.dtype()),
                bn.bias.map(|t| t.dtype()),
            ),
        };
        Ok((z, saved))
    }

    /// The ReLU's output again from the norm's input `x` (contiguous, `x`'s shape).
    pub(super) fn recompute(&self, x: &Tensor) -> Result<crate::tensor::Storage> {
        x.storage().batch_norm_act_apply(
            x.layout(),
            self.d,
            (&self.mean, &self.invstd),
            affine(&self.weight, &self.bias),
            true,
        )
    }

    /// The gradients of the norm's input `x` and of the parameters that were given (in that
    /// order), from the gradient `dz` of the output (contiguous) and, with the ReLU, that
    /// output `z` (from `recompute`).
    pub(super) fn backward(
        &self,
        x: &Tensor,
        dz: &crate::tensor::Storage,
        z: Option<&crate::tensor::Storage>,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(self.backward_residual(x, dz, z, false)?.0)
    }

    /// `backward`, and with `want_res` the gradient of a residual added before the ReLU
    /// (the output's gradient through the ReLU's mask; `z` is then the output itself).
    pub(super) fn backward_residual(
        &self,
        x: &Tensor,
        dz: &crate::tensor::Storage,
        z: Option<&crate::tensor::Storage>,
        want_res: bool,
    ) -> Result<(Vec<Option<Tensor>>, Option<Tensor>)> {
        let shape = x.shape();
        let zl = Layout::contiguous(shape);
        let (xs, xl) = (x.storage(), x.layout());
        let (mean, invstd, w) = (&self.mean, &self.invstd, as_ref(&self.weight));
        let saved = Saved {
            mean,
            invstd,
            weight: w,
            from_input: true,
        };
        let (grads, dres) = if self.relu || want_res {
            let act = ActSaved {
                y: z.map(|z| (z, &zl)),
                want_residual: want_res,
            };
            dz.batch_norm_act_backward(&zl, act, (&xs, xl), self.d, saved, self.dtypes)?
        } else {
            let g = dz.batch_norm_backward(&zl, (&xs, xl), self.d, saved, self.dtypes)?;
            (g, None)
        };
        let cs = [self.d.c];
        let dres = dres.map(|s| Tensor::from_storage(Arc::new(s), zl.clone()));
        Ok((norm_grads(grads, shape, &cs, &cs), dres))
    }

    /// Whether the backward has any gradient to give.
    pub(super) fn wants_grads(&self) -> bool {
        self.dtypes != (None, None, None)
    }
}

impl Tensor {
    /// `batch_norm_act(.., None, relu)` with `bn`'s arguments (the fused ops' composition).
    pub(super) fn batch_norm_params(&self, bn: &BatchNormParams<'_>, relu: bool) -> Result<Tensor> {
        self.batch_norm_residual(bn, None, relu)
    }

    /// `batch_norm_act(.., residual, relu)` with `bn`'s arguments.
    pub(super) fn batch_norm_residual(
        &self,
        bn: &BatchNormParams<'_>,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<Tensor> {
        self.batch_norm_act(
            bn.running_mean,
            bn.running_var,
            bn.weight,
            bn.bias,
            bn.training,
            bn.momentum,
            bn.eps,
            residual,
            relu,
        )
    }

    /// The checks, the primitive and the running statistics' update of `batch_norm_act`
    /// (the fused primitive with a residual or the ReLU, the plain one otherwise), without
    /// the graph.
    fn batch_norm_forward(
        &self,
        p: &BatchNormParams<'_>,
        residual: Option<&Tensor>,
        relu: bool,
    ) -> Result<BnForward> {
        const OP: &str = "batch_norm";
        let BatchNormParams {
            running_mean,
            running_var,
            weight,
            bias,
            training,
            momentum,
            eps,
        } = *p;
        let mode = BatchNormMode {
            training,
            momentum,
            eps,
        };
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
        let d = BatchNormGeom {
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

        let (wp, bp) = (part(weight), part(bias));
        let rp = part(residual);
        let running_p = running.map(|(m, v)| (part(Some(m)), part(Some(v))));
        let running_r = running_p
            .as_ref()
            .map(|(m, v)| (as_ref(m).expect("given"), as_ref(v).expect("given")));
        let r = if residual.is_some() || relu {
            let act = Act {
                residual: as_ref(&rp),
                relu,
            };
            self.storage().batch_norm_act(
                self.layout(),
                d,
                act,
                affine(&wp, &bp),
                running_r,
                mode,
            )?
        } else {
            self.storage()
                .batch_norm(self.layout(), d, affine(&wp, &bp), running_r, mode)?
        };
        if let (Some((rm, rv)), Some((new_m, new_v))) = (running, r.running) {
            rm.set_data(&Tensor::from_storage(
                Arc::new(new_m),
                Layout::contiguous(rm.shape()),
            ))?;
            rv.set_data(&Tensor::from_storage(
                Arc::new(new_v),
                Layout::contiguous(rv.shape()),
            ))?;
        }

        Ok(BnForward {
            out: Arc::new(r.out),
            mean: r.mean,
            invstd: r.invstd,
            d,
        })
    }
}

/// The gradients of a norm as tensors: the input's (when wanted), then the weight's and the
/// bias's for the parameters that were given.
fn norm_grads(
    g: crate::backend::nn::Grads<crate::tensor::Storage>,
    x_shape: &[usize],
    w_shape: &[usize],
    b_shape: &[usize],
) -> Vec<Option<Tensor>> {
    let t = |s, shape: &[usize]| Tensor::from_storage(Arc::new(s), Layout::contiguous(shape));
    let mut grads = vec![g.dx.map(|s| t(s, x_shape))];
    grads.extend(g.dweight.map(|s| Some(t(s, w_shape))));
    grads.extend(g.dbias.map(|s| Some(t(s, b_shape))));
    grads
}
