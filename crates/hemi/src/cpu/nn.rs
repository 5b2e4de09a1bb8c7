//! The CPU's network primitives (`NnOps`): inputs read through their layouts (borrowed when
//! contiguous in the type a kernel takes), the kernels of `cpu::{matmul, conv, conv_block,
//! pool, norm}`, and each result rounded once into the dtype asked for.

use half::{bf16, f16};
use num_traits::One;

use super::storage::CpuStorage;
use crate::backend::nn::{
    AdaptivePool2dGeom, BatchNorm, BatchNormGeom, Conv2dGeom, GradDTypes, Grads, Indices,
    LayerNorm, MaxPool2d, NnOps, Opt, Pool2dGeom, Running,
};
use crate::cpu::reduce::sum_slice;
use crate::cpu::{chunked, conv, conv_block, matmul, norm, pool};
use crate::dtype::{DType, FloatDType, WithDType};
use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::Layout;

/// Runs `$body` with the type alias `$T` bound to the element type of `$dtype`, one of F32,
/// F16 and BF16 (the dtypes the half-precision and fused kernels take); `$else` otherwise.
macro_rules! with_f32_or_half {
    ($dtype:expr, $T:ident => $body:expr, _ => $else:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            _ => $else,
        }
    };
}

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

/// `(1 - momentum) * running + momentum * batch`, computed in F64 and rounded once into
/// `running`'s dtype.
fn update_running<B: WithDType>(
    running: &CpuStorage,
    l: &Layout,
    batch: &[B],
    momentum: f64,
) -> CpuStorage {
    let new: Vec<f64> = running
        .to_f64(l)
        .iter()
        .zip(batch)
        .map(|(&r, &b)| (1.0 - momentum) * r + momentum * b.to_f64())
        .collect();
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

/// The bias gradient (per channel, `dy` summed over images and pixels) from an F32/F16/BF16
/// gradient, an image at a time in F32; the same order as the compute-type path.
fn conv_bias_grad_blocks<T: WithDType>(dy: &[T], g: &Conv2dGeom) -> Vec<f32> {
    let l = g.l();
    let mut acc = vec![0f32; g.c_out];
    let mut db = vec![0f32; g.out_image()];
    for n in 0..g.n {
        let img = chunked::read(dy, n * g.out_image(), &mut db);
        for (co, a) in acc.iter_mut().enumerate() {
            *a += sum_slice(&img[co * l..(co + 1) * l]);
        }
    }
    acc
}

/// Max-pool backward from a contiguous F32/F16/BF16 gradient into a half `out`: plane by
/// plane in F32, rounded into the half gradient.
fn max_pool2d_backward_blocks<T: WithDType>(
    dy: &[T],
    idx: &[u32],
    g: &Pool2dGeom,
    out: DType,
) -> CpuStorage {
    let n_out = g.out_plane();
    chunked::per_block(g.planes, g.in_plane(), out, |p, dx| {
        let mut buf = vec![0f32; n_out];
        let d = chunked::read(dy, p * n_out, &mut buf);
        for (&d, &i) in d.iter().zip(&idx[p * n_out..(p + 1) * n_out]) {
            dx[i as usize] += d;
        }
    })
    .expect("half dtype")
}

/// Gradient of the bias in the compute type: `dy` summed over the batch and the output
/// pixels, per channel.
fn conv_bias_grad<C: FloatDType>(dy: &[C], g: &Conv2dGeom) -> Vec<C> {
    let l = g.l();
    (0..g.c_out)
        .map(|co| {
            (0..g.n)
                .map(|n| sum_slice(&dy[(n * g.c_out + co) * l..(n * g.c_out + co + 1) * l]))
                .fold(C::zero(), |a, b| a + b)
        })
        .collect()
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
                CpuStorage::from_f32(conv_bias_grad_blocks(&dy, g), out)
            }, _ => unreachable!("half dtype")));
        }
        Ok(crate::with_compute!(dtype, C => {
            let dy = self.load::<C>(ldy);
            CpuStorage::store::<C>(conv_bias_grad(&dy, g), out)
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
            let (out, idx) = conv_block::forward(&x, &wv, b.as_deref(), g);
            Ok((out, Indices::new(idx)))
        }, _ => Err(wrong_dtype(OP, dtype)))
    }

    fn conv2d_relu_max_pool2_backward(
        &self,
        ldy: &Layout,
        indices: &Indices,
        x: &Self,
        lx: &Layout,
        w: &Self,
        lw: &Layout,
        g: &Conv2dGeom,
        want_dx: bool,
        has_bias: bool,
    ) -> Result<Grads<Self>> {
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
            let r = conv_block::backward(&dy, idx, &xv, &wv, g, want_dx);
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
        Ok(crate::with_compute!(dtype, C => {
            let (out, idx) = pool::max_pool2d_forward(&self.load::<C>(l), g);
            let indices = with_indices
                .then(|| CpuStorage::from_vec(idx.iter().map(|&i| i as i64).collect::<Vec<i64>>()));
            MaxPool2d {
                out: CpuStorage::store::<C>(out, dtype),
                argmax: Indices::new(idx),
                indices,
            }
        }))
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
        // Half precision: plane by plane in F32, rounded into the half gradient.
        if let (true, Some(r)) = (out.is_half(), ldy.contiguous_range()) {
            let done = with_f32_or_half!(self.dtype(), T => {
                let dy = &self.as_slice::<T>().expect("dtype matched")[r];
                Some(max_pool2d_backward_blocks(dy, idx, g, out))
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
        weight: Opt<'_, Self>,
        bias: Opt<'_, Self>,
        running: Running<'_, Self>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<BatchNorm<Self>> {
        let dtype = self.dtype();
        Ok(crate::with_compute!(dtype, C => {
            let x = self.load::<C>(l);
            let (mean, var, new_running) = if training {
                let (mean, var) = norm::bn_stats(&x, g);
                let new_running = running.map(|((rm, lm), (rv, lv))| {
                    let m = g.m() as f64;
                    let unbiased: Vec<f64> =
                        var.iter().map(|&v| v.to_f64() * m / (m - 1.0)).collect();
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
            let eps_c = C::from_f64(eps);
            let rstd: Vec<C> = var.iter().map(|&v| C::one() / (v + eps_c).sqrt()).collect();
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
        x: &Self,
        lx: &Layout,
        g: BatchNormGeom,
        mean: &Self,
        invstd: &Self,
        weight: Opt<'_, Self>,
        training: bool,
        dtypes: GradDTypes,
    ) -> Result<Grads<Self>> {
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

    fn layer_norm(
        &self,
        l: &Layout,
        d: usize,
        weight: Opt<'_, Self>,
        bias: Opt<'_, Self>,
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
        x: &Self,
        lx: &Layout,
        d: usize,
        mean: &Self,
        rstd: &Self,
        weight: Opt<'_, Self>,
        dtypes: GradDTypes,
    ) -> Result<Grads<Self>> {
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
}
