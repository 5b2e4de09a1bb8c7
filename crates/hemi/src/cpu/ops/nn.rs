//! `NnOps` on the CPU: inputs read through their layouts (borrowed when contiguous in the
//! type a kernel takes), the kernels of `cpu::gemm::matmul`, `cpu::conv` (with its fused
//! `block`), `cpu::pool`, `cpu::norm` and `cpu::attention`, and each result rounded once
//! into the dtype asked for.

use std::borrow::Cow;

use crate::backend::nn::{
    Act, ActSaved, AdaptivePool2dGeom, Affine, AttentionGeom, BatchNorm, BatchNormGeom,
    BatchNormMode, BlockGrads, Conv2dGeom, GradDTypes, Grads, Indices, LayerNorm, MaxPool2d, NnOps,
    Opt, Pool2dGeom, Qkv, Running, Saved, View,
};
use crate::cpu::gemm::matmul;
use crate::cpu::storage::CpuStorage;
use crate::cpu::{conv, norm, pool};
use crate::dtype::{DType, FloatDType, WithDType};
use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::Layout;

/// The elements `layout` addresses as `[T]` (the caller matched `T` to the dtype).
fn elems<'a, T: WithDType>(s: &'a CpuStorage, layout: &Layout) -> std::borrow::Cow<'a, [T]> {
    s.elems::<T>(layout).expect("dtype matched by the caller")
}

/// A statistic a forward saved in the compute type `C`.
fn stat<C: FloatDType>(s: &CpuStorage) -> &[C] {
    s.as_slice::<C>().expect("saved in the compute type")
}

fn wrong_dtype(op: &'static str, dtype: DType) -> Error {
    Error::dtype(op, dtype, "expected F32, F16 or BF16 tensors of one dtype")
}

/// A running statistic updated by a batch's (`norm::blend_running`), rounded once into
/// `running`'s dtype.
fn update_running<B: WithDType>(
    running: &CpuStorage,
    l: &Layout,
    batch: &[B],
    momentum: f64,
) -> CpuStorage {
    let new = norm::blend_running(&running.to_f64(l), batch, momentum);
    CpuStorage::from_f64(new, running.dtype())
}

/// The gradients of a norm rounded into the dtypes asked for (`None`: not wanted).
fn norm_grads<C: FloatDType>(
    (dx, dw, db): (Option<Vec<C>>, Vec<C>, Vec<C>),
    (dx_dt, dw_dt, db_dt): GradDTypes,
) -> Grads<CpuStorage> {
    Grads {
        dx: dx.zip(dx_dt).map(|(v, dt)| CpuStorage::store::<C>(v, dt)),
        dweight: dw_dt.map(|dt| CpuStorage::store::<C>(dw, dt)),
        dbias: db_dt.map(|dt| CpuStorage::store::<C>(db, dt)),
    }
}

/// `NnOps::batch_norm_act` over F32/F16/BF16 elements `T` (the input's dtype).
fn bn_act<T: WithDType>(
    (x, l): View<'_, CpuStorage>,
    g: BatchNormGeom,
    Act { residual, relu }: Act<'_, CpuStorage>,
    Affine { weight, bias }: Affine<'_, CpuStorage>,
    running: Running<'_, CpuStorage>,
    BatchNormMode {
        training,
        momentum,
        eps,
    }: BatchNormMode,
) -> Result<BatchNorm<CpuStorage>> {
    const OP: &str = "batch_norm_act";
    let xv = elems::<T>(x, l);
    let res = residual
        .map(|(r, lr)| r.elems::<T>(lr).ok_or_else(|| wrong_dtype(OP, r.dtype())))
        .transpose()?;
    let (mean, var, new_running) = if training {
        let (mean, var) = norm::bn_stats_t(&xv, g);
        let new_running = running.map(|((rm, lm), (rv, lv))| {
            let m = g.m() as f64;
            let unbiased = norm::unbiased_var(&var, m);
            (
                update_running(rm, lm, &mean, momentum),
                update_running(rv, lv, &unbiased, momentum),
            )
        });
        (mean, var, new_running)
    } else {
        let ((rm, lm), (rv, lv)) = running.ok_or_else(|| {
            Error::arg("batch_norm", "eval mode needs running_mean and running_var")
        })?;
        (rm.to_f32(lm).into_owned(), rv.to_f32(lv).into_owned(), None)
    };
    let rstd: Vec<f32> = norm::inv_std(&var, eps);
    let wv = weight.map(|(w, l)| w.to_f32(l));
    let bv = bias.map(|(b, l)| b.to_f32(l));
    let out = norm::bn_act_forward(
        &xv,
        res.as_deref(),
        g,
        &mean,
        &rstd,
        wv.as_deref(),
        bv.as_deref(),
        relu,
    );
    Ok(BatchNorm {
        out: CpuStorage::from_vec(out),
        mean: CpuStorage::from_vec(mean),
        invstd: CpuStorage::from_vec(rstd),
        running: new_running,
    })
}

/// `NnOps::batch_norm_act_backward` over F32/F16/BF16 elements `T` (the input's dtype).
fn bn_act_backward<T: WithDType>(
    (dy, ldy): View<'_, CpuStorage>,
    ActSaved { y, want_residual }: ActSaved<'_, CpuStorage>,
    (x, lx): View<'_, CpuStorage>,
    g: BatchNormGeom,
    saved: Saved<'_, CpuStorage>,
    (dx_dt, dw_dt, db_dt): GradDTypes,
) -> Result<(Grads<CpuStorage>, Option<CpuStorage>)> {
    let (mean, invstd, weight, training) =
        (saved.mean, saved.invstd, saved.weight, saved.from_input);
    fn same<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
        s.elems::<T>(l)
            .ok_or_else(|| wrong_dtype("batch_norm_act_backward", s.dtype()))
    }
    let (gv, xv) = (same::<T>(dy, ldy)?, same::<T>(x, lx)?);
    let yv = y.map(|(y, l)| same::<T>(y, l)).transpose()?;
    let wv = weight.map(|(w, l)| w.to_f32(l));
    let r = norm::bn_act_backward(
        &gv,
        yv.as_deref(),
        &xv,
        g,
        stat::<f32>(mean),
        stat::<f32>(invstd),
        wv.as_deref(),
        training,
        dx_dt.is_some(),
        want_residual,
    );
    let grads = Grads {
        dx: r.dx.zip(dx_dt).map(|(v, dt)| {
            let s = CpuStorage::from_vec(v);
            if dt == T::DTYPE {
                s
            } else {
                CpuStorage::from_f64(s.to_f64(&Layout::contiguous(&[s.len()])).into_owned(), dt)
            }
        }),
        dweight: dw_dt.map(|dt| CpuStorage::from_f32(r.dweight, dt)),
        dbias: db_dt.map(|dt| CpuStorage::from_f32(r.dbias, dt)),
    };
    Ok((grads, r.dres.map(CpuStorage::from_vec)))
}

/// The elements of a float buffer as `[T]` (the caller matched `T` to the dtype of `q`).
fn slice<'a, T: WithDType>(op: &'static str, s: &'a CpuStorage) -> Result<&'a [T]> {
    s.as_slice::<T>().ok_or_else(|| {
        Error::dtype(
            op,
            s.dtype(),
            format!("expected {} like the queries", T::DTYPE),
        )
    })
}

/// `NnOps::attention` on the CPU.
fn attention(
    Qkv { q, k, v }: Qkv<'_, CpuStorage>,
    mask: Opt<'_, CpuStorage>,
    g: &AttentionGeom,
) -> Result<(CpuStorage, CpuStorage)> {
    const OP: &str = "scaled_dot_product_attention";
    let dtype = q.0.dtype();
    if !dtype.is_float() {
        return Err(Error::dtype(OP, dtype, "expected float queries"));
    }
    crate::with_dtype!(dtype, T => {
        crate::with_compute!(dtype, C => {
            let m = mask.map(|(m, l)| slice::<C>(OP, m).map(|m| (m, l))).transpose()?;
            let (out, lse) = crate::cpu::attention::forward::<T, C>(
                (slice(OP, q.0)?, q.1),
                (slice(OP, k.0)?, k.1),
                (slice(OP, v.0)?, v.1),
                m,
                g,
            );
            Ok((CpuStorage::from_vec(out), CpuStorage::from_vec(lse)))
        })
    })
}

/// `NnOps::attention_backward` on the CPU.
fn attention_backward(
    dout: View<'_, CpuStorage>,
    Qkv { q, k, v }: Qkv<'_, CpuStorage>,
    mask: Opt<'_, CpuStorage>,
    lse: &CpuStorage,
    g: &AttentionGeom,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    const OP: &str = "scaled_dot_product_attention_backward";
    let dtype = q.0.dtype();
    if !dtype.is_float() {
        return Err(Error::dtype(OP, dtype, "expected float queries"));
    }
    crate::with_dtype!(dtype, T => {
        crate::with_compute!(dtype, C => {
            let m = mask.map(|(m, l)| slice::<C>(OP, m).map(|m| (m, l))).transpose()?;
            let (dq, dk, dv) = crate::cpu::attention::backward::<T, C>(
                (slice(OP, dout.0)?, dout.1),
                (slice(OP, q.0)?, q.1),
                (slice(OP, k.0)?, k.1),
                (slice(OP, v.0)?, v.1),
                m,
                slice::<C>(OP, lse)?,
                g,
            );
            Ok((
                CpuStorage::from_vec(dq),
                CpuStorage::from_vec(dk),
                CpuStorage::from_vec(dv),
            ))
        })
    })
}

impl NnOps for CpuStorage {
    fn matmul(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        bias: Opt<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        let (ra, rb) = (la.shape().len(), lb.shape().len());
        let batch = broadcast_shapes("matmul", &la.shape()[..ra - 2], &lb.shape()[..rb - 2])?;
        if out.is_half() && self.dtype() == out && rhs.dtype() == out {
            // Rounded tile by tile where it can be: the same bits, no F32 output matrix.
            let b = bias.map(|(b, l)| b.to_f32(l));
            let rounded = with_f32_or_half!(out, O => {
                matmul::matmul_round::<O>(self, la, rhs, lb, &batch, b.as_deref())
                    .map(CpuStorage::from_vec)
            }, _ => unreachable!("half dtype"));
            if let Some(st) = rounded {
                return Ok(st);
            }
        }
        Ok(crate::with_compute!(out, C => {
            let bias = bias.map(|(b, l)| b.load::<C>(l));
            let v = matmul::matmul::<C>(self, la, rhs, lb, &batch, bias.as_deref());
            CpuStorage::store::<C>(v, out)
        }))
    }

    fn conv2d(
        &self,
        lx: &Layout,
        w: &Self,
        lw: &Layout,
        bias: Opt<'_, Self>,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        // All F16 or all BF16 (autocast's case): unfolded and multiplied as stored, each
        // image's F32 result rounded into the output, so the batch never exists in F32.
        if out.is_half() && self.dtype() == out && w.dtype() == out {
            return Ok(with_f32_or_half!(out, T => {
                let (x, wv) = (elems::<T>(self, lx), elems::<T>(w, lw));
                let b = bias.map(|(b, l)| b.to_f32(l));
                conv::conv2d_forward_blocks(&x, &wv, b.as_deref(), g)
            }, _ => unreachable!("half dtype")));
        }
        Ok(crate::with_compute!(out, C => {
            let (x, wv) = (self.load::<C>(lx), w.load::<C>(lw));
            let b = bias.map(|(b, l)| b.load::<C>(l));
            CpuStorage::store::<C>(conv::conv2d_forward(&x, &wv, b.as_deref(), g), out)
        }))
    }

    fn conv2d_backward_input(
        &self,
        ldy: &Layout,
        w: &Self,
        lw: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        let dtype = self.dtype();
        if dtype.is_half() && w.dtype() == dtype && out == dtype {
            return Ok(with_f32_or_half!(dtype, T => {
                let (dy, wv) = (elems::<T>(self, ldy), elems::<T>(w, lw));
                conv::conv2d_backward_input_blocks(&dy, &wv, g)
            }, _ => unreachable!("half dtype")));
        }
        Ok(crate::with_compute!(dtype.promote(w.dtype()), C => {
            let (dy, wv) = (self.load::<C>(ldy), w.load::<C>(lw));
            CpuStorage::store::<C>(conv::conv2d_backward_input(&dy, &wv, g), out)
        }))
    }

    fn conv2d_backward_weight(
        &self,
        lx: &Layout,
        dy: &Self,
        ldy: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        let dtype = self.dtype();
        if dtype.is_half() && dy.dtype() == dtype {
            return Ok(with_f32_or_half!(dtype, T => {
                let (x, dyv) = (elems::<T>(self, lx), elems::<T>(dy, ldy));
                let dw = conv::conv2d_backward_weight::<T, f32>(&x, &dyv, g);
                CpuStorage::from_f32(dw, out)
            }, _ => unreachable!("half dtype")));
        }
        Ok(crate::with_compute!(dtype.promote(dy.dtype()), C => {
            let (x, dyv) = (self.load::<C>(lx), dy.load::<C>(ldy));
            CpuStorage::store::<C>(conv::conv2d_backward_weight::<C, C>(&x, &dyv, g), out)
        }))
    }

    fn conv2d_backward_bias(&self, ldy: &Layout, g: &Conv2dGeom, out: DType) -> Result<Self> {
        let dtype = self.dtype();
        if dtype.is_half() {
            return Ok(with_f32_or_half!(dtype, T => {
                let dy = elems::<T>(self, ldy);
                CpuStorage::from_f32(conv::conv_bias_grad_blocks(&dy, g), out)
            }, _ => unreachable!("half dtype")));
        }
        Ok(crate::with_compute!(dtype, C => {
            let dy = self.load::<C>(ldy);
            CpuStorage::store::<C>(conv::conv_bias_grad(&dy, g), out)
        }))
    }

    fn conv2d_relu_max_pool2(
        &self,
        lx: &Layout,
        w: &Self,
        lw: &Layout,
        bias: Opt<'_, Self>,
        g: &Conv2dGeom,
    ) -> Result<(Self, Indices)> {
        const OP: &str = "conv2d_relu_max_pool2";
        let dtype = self.dtype();
        if w.dtype() != dtype {
            return Err(wrong_dtype(OP, w.dtype()));
        }
        with_f32_or_half!(dtype, T => {
            let (x, wv) = (elems::<T>(self, lx), elems::<T>(w, lw));
            let b = bias.map(|(b, l)| b.to_f32(l));
            let (out, idx) = conv::block::forward(&x, &wv, b.as_deref(), g);
            Ok((out, Indices::new(idx)))
        }, _ => Err(wrong_dtype(OP, dtype)))
    }

    fn conv2d_relu_max_pool2_backward(
        &self,
        ldy: &Layout,
        indices: &Indices,
        (x, lx): View<'_, Self>,
        (w, lw): View<'_, Self>,
        g: &Conv2dGeom,
        want: BlockGrads,
    ) -> Result<Grads<Self>> {
        let (want_dx, has_bias) = (want.dx, want.bias);
        const OP: &str = "conv2d_relu_max_pool2_backward";
        let dtype = self.dtype();
        if x.dtype() != dtype || w.dtype() != dtype {
            return Err(wrong_dtype(OP, dtype));
        }
        let idx: &Vec<u8> = indices
            .get()
            .ok_or_else(|| Error::arg(OP, "indices of another backend"))?;
        with_f32_or_half!(dtype, T => {
            let (dy, xv, wv) = (elems::<T>(self, ldy), elems::<T>(x, lx), elems::<T>(w, lw));
            let r = conv::block::backward(&dy, idx, &xv, &wv, g, want_dx);
            Ok(Grads {
                dx: r.dx,
                dweight: Some(CpuStorage::from_f32(r.dw, dtype)),
                dbias: has_bias.then(|| CpuStorage::from_f32(r.db, dtype)),
            })
        }, _ => Err(wrong_dtype(OP, dtype)))
    }

    fn max_pool2d(
        &self,
        l: &Layout,
        g: &Pool2dGeom,
        with_indices: bool,
    ) -> Result<MaxPool2d<Self>> {
        let dtype = self.dtype();
        // A 1×1 unpadded window is a gather, done in the stored dtype.
        let gathered = match l.contiguous_range() {
            Some(r) if g.kernel == (1, 1) && g.padding == (0, 0) => {
                with_f32_or_half!(dtype, T => {
                    let x = &self.as_slice::<T>().expect("dtype matched")[r];
                    let (out, idx) = pool::max_pool2d_1x1(x, g);
                    Some((CpuStorage::from_vec(out), idx))
                }, _ => None)
            }
            _ => None,
        };
        let (out, idx) = match gathered {
            Some(done) => done,
            None => crate::with_compute!(dtype, C => {
                let (out, idx) = pool::max_pool2d_forward(&self.load::<C>(l), g);
                (CpuStorage::store::<C>(out, dtype), idx)
            }),
        };
        let indices = with_indices
            .then(|| CpuStorage::from_vec(idx.iter().map(|&i| i as i64).collect::<Vec<i64>>()));
        Ok(MaxPool2d {
            out,
            argmax: Indices::new(idx),
            indices,
        })
    }

    fn max_pool2d_backward(
        &self,
        ldy: &Layout,
        argmax: &Indices,
        g: &Pool2dGeom,
        out: DType,
    ) -> Result<Self> {
        let idx: &Vec<u32> = argmax
            .get()
            .ok_or_else(|| Error::arg("max_pool2d_backward", "indices of another backend"))?;
        // Half precision: plane by plane in F32, rounded into the half gradient. A strided
        // gradient (ResNet's padded shortcut hands back a channel slice) is gathered as
        // stored first, not widened to F32 and pooled on the F32 path.
        if out.is_half() {
            let done = with_f32_or_half!(self.dtype(), T => {
                let all = self.as_slice::<T>().expect("dtype matched");
                let dy = match ldy.contiguous_range() {
                    Some(r) => Cow::Borrowed(&all[r]),
                    None => Cow::Owned(ldy.gather(all)),
                };
                Some(pool::max_pool2d_backward_blocks(&dy, idx, g, out))
            }, _ => None);
            if let Some(st) = done {
                return Ok(st);
            }
        }
        Ok(crate::with_compute!(out, C => {
            let dx = pool::max_pool2d_backward(&self.load::<C>(ldy), idx, g);
            CpuStorage::store::<C>(dx, out)
        }))
    }

    fn avg_pool2d(&self, l: &Layout, g: &Pool2dGeom, count_include_pad: bool) -> Result<Self> {
        let dtype = self.dtype();
        Ok(crate::with_compute!(dtype, C => {
            let out = pool::avg_pool2d_forward(&self.load::<C>(l), g, count_include_pad);
            CpuStorage::store::<C>(out, dtype)
        }))
    }

    fn avg_pool2d_backward(
        &self,
        ldy: &Layout,
        g: &Pool2dGeom,
        count_include_pad: bool,
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            let dx = pool::avg_pool2d_backward(&self.load::<C>(ldy), g, count_include_pad);
            CpuStorage::store::<C>(dx, out)
        }))
    }

    fn adaptive_avg_pool2d(&self, l: &Layout, g: &AdaptivePool2dGeom) -> Result<Self> {
        let dtype = self.dtype();
        Ok(crate::with_compute!(dtype, C => {
            let out = pool::adaptive_avg_pool2d_forward(
                &self.load::<C>(l),
                g.planes,
                (g.h, g.w),
                (g.h_out, g.w_out),
            );
            CpuStorage::store::<C>(out, dtype)
        }))
    }

    fn adaptive_avg_pool2d_backward(
        &self,
        ldy: &Layout,
        g: &AdaptivePool2dGeom,
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            let dx = pool::adaptive_avg_pool2d_backward(
                &self.load::<C>(ldy),
                g.planes,
                (g.h, g.w),
                (g.h_out, g.w_out),
            );
            CpuStorage::store::<C>(dx, out)
        }))
    }

    fn batch_norm(
        &self,
        l: &Layout,
        g: BatchNormGeom,
        affine: Affine<'_, Self>,
        running: Running<'_, Self>,
        mode: BatchNormMode,
    ) -> Result<BatchNorm<Self>> {
        let dtype = self.dtype();
        if matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            let act = Act {
                residual: None,
                relu: false,
            };
            return self.batch_norm_act(l, g, act, affine, running, mode);
        }
        let (
            Affine { weight, bias },
            BatchNormMode {
                training,
                momentum,
                eps,
            },
        ) = (affine, mode);
        Ok(crate::with_compute!(dtype, C => {
            let x = self.load::<C>(l);
            let (mean, var, new_running) = if training {
                let (mean, var) = norm::bn_stats(&x, g);
                let new_running = running.map(|((rm, lm), (rv, lv))| {
                    let m = g.m() as f64;
                    let unbiased = norm::unbiased_var(&var, m);
                    (
                        update_running(rm, lm, &mean, momentum),
                        update_running(rv, lv, &unbiased, momentum),
                    )
                });
                (mean, var, new_running)
            } else {
                let ((rm, lm), (rv, lv)) = running.ok_or_else(|| {
                    Error::arg("batch_norm", "eval mode needs running_mean and running_var")
                })?;
                (rm.load::<C>(lm).into_owned(), rv.load::<C>(lv).into_owned(), None)
            };
            let rstd: Vec<C> = norm::inv_std(&var, eps);
            let wv = weight.map(|(w, l)| w.load::<C>(l));
            let bv = bias.map(|(b, l)| b.load::<C>(l));
            let out = norm::bn_forward(&x, g, &mean, &rstd, wv.as_deref(), bv.as_deref());
            BatchNorm {
                out: CpuStorage::store::<C>(out, dtype),
                mean: CpuStorage::from_vec(mean),
                invstd: CpuStorage::from_vec(rstd),
                running: new_running,
            }
        }))
    }

    fn batch_norm_backward(
        &self,
        ldy: &Layout,
        (x, lx): View<'_, Self>,
        g: BatchNormGeom,
        saved: Saved<'_, Self>,
        dtypes: GradDTypes,
    ) -> Result<Grads<Self>> {
        if matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) && self.dtype() == x.dtype() {
            let act = ActSaved {
                y: None,
                want_residual: false,
            };
            let (grads, _) = self.batch_norm_act_backward(ldy, act, (x, lx), g, saved, dtypes)?;
            return Ok(grads);
        }
        let (mean, invstd, weight, training) =
            (saved.mean, saved.invstd, saved.weight, saved.from_input);
        Ok(crate::with_compute!(x.dtype(), C => {
            let (gv, xv) = (self.load::<C>(ldy), x.load::<C>(lx));
            let wv = weight.map(|(w, l)| w.load::<C>(l));
            let r = norm::bn_backward(
                &gv,
                &xv,
                g,
                stat::<C>(mean),
                stat::<C>(invstd),
                wv.as_deref(),
                training,
                dtypes.0.is_some(),
            );
            norm_grads(r, dtypes)
        }))
    }

    fn batch_norm_act(
        &self,
        l: &Layout,
        g: BatchNormGeom,
        act: Act<'_, Self>,
        affine: Affine<'_, Self>,
        running: Running<'_, Self>,
        mode: BatchNormMode,
    ) -> Result<BatchNorm<Self>> {
        with_f32_or_half!(self.dtype(), T => bn_act::<T>(
            (self, l), g, act, affine, running, mode,
        ), _ => Err(wrong_dtype("batch_norm_act", self.dtype())))
    }

    fn batch_norm_act_backward(
        &self,
        ldy: &Layout,
        act: ActSaved<'_, Self>,
        x: View<'_, Self>,
        g: BatchNormGeom,
        saved: Saved<'_, Self>,
        dtypes: GradDTypes,
    ) -> Result<(Grads<Self>, Option<Self>)> {
        with_f32_or_half!(x.0.dtype(), T => bn_act_backward::<T>(
            (self, ldy), act, x, g, saved, dtypes,
        ), _ => Err(wrong_dtype("batch_norm_act_backward", x.0.dtype())))
    }

    fn batch_norm_act_apply(
        &self,
        l: &Layout,
        g: BatchNormGeom,
        (mean, invstd): (&Self, &Self),
        Affine { weight, bias }: Affine<'_, Self>,
        relu: bool,
    ) -> Result<Self> {
        let (wv, bv) = (
            weight.map(|(w, l)| w.to_f32(l)),
            bias.map(|(b, l)| b.to_f32(l)),
        );
        with_f32_or_half!(self.dtype(), T => Ok(CpuStorage::from_vec(norm::bn_act_forward(
            &elems::<T>(self, l),
            None,
            g,
            stat::<f32>(mean),
            stat::<f32>(invstd),
            wv.as_deref(),
            bv.as_deref(),
            relu,
        ))), _ => Err(wrong_dtype("batch_norm_act_apply", self.dtype())))
    }

    fn layer_norm(
        &self,
        l: &Layout,
        d: usize,
        Affine { weight, bias }: Affine<'_, Self>,
        eps: f64,
    ) -> Result<LayerNorm<Self>> {
        let dtype = self.dtype();
        Ok(crate::with_compute!(dtype, C => {
            let x = self.load::<C>(l);
            let wv = weight.map(|(w, l)| w.load::<C>(l));
            let bv = bias.map(|(b, l)| b.load::<C>(l));
            let (out, mean, rstd) = norm::ln_forward(&x, d, wv.as_deref(), bv.as_deref(), eps);
            LayerNorm {
                out: CpuStorage::store::<C>(out, dtype),
                mean: CpuStorage::from_vec(mean),
                rstd: CpuStorage::from_vec(rstd),
            }
        }))
    }

    fn layer_norm_backward(
        &self,
        ldy: &Layout,
        (x, lx): View<'_, Self>,
        d: usize,
        saved: Saved<'_, Self>,
        dtypes: GradDTypes,
    ) -> Result<Grads<Self>> {
        let (mean, rstd, weight) = (saved.mean, saved.invstd, saved.weight);
        Ok(crate::with_compute!(x.dtype(), C => {
            let (gv, xv) = (self.load::<C>(ldy), x.load::<C>(lx));
            let wv = weight.map(|(w, l)| w.load::<C>(l));
            let r = norm::ln_backward(
                &gv,
                &xv,
                d,
                stat::<C>(mean),
                stat::<C>(rstd),
                wv.as_deref(),
                dtypes.0.is_some(),
            );
            norm_grads(r, dtypes)
        }))
    }

    fn attention(
        &self,
        lq: &Layout,
        k: View<'_, Self>,
        v: View<'_, Self>,
        mask: Opt<'_, Self>,
        g: &AttentionGeom,
    ) -> Result<(Self, Self)> {
        attention(
            Qkv {
                q: (self, lq),
                k,
                v,
            },
            mask,
            g,
        )
    }

    fn attention_backward(
        &self,
        ldout: &Layout,
        qkv: Qkv<'_, Self>,
        mask: Opt<'_, Self>,
        lse: &Self,
        g: &AttentionGeom,
    ) -> Result<(Self, Self, Self)> {
        attention_backward((self, ldout), qkv, mask, lse, g)
    }
}
