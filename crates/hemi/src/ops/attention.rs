//! Scaled-dot-product attention (`torch.nn.functional.scaled_dot_product_attention`), one
//! fused backend primitive forward and one backward.
//!
//! `softmax(q·kᵀ · scale + mask) · v` per head. The scores, the softmax and both products
//! are computed in F32 (F64 for F64 inputs) a query row at a time, and the output is rounded
//! once into the inputs' dtype. The forward keeps only the per-row log-sum-exp of the
//! scores (F32, `[heads, Lq]`); the backward recomputes the probabilities from it
//! (flash-attention style) instead of keeping a `[heads, Lq, Lk]` probability tensor.
//! At BERT-MiniLM's shapes (B=32, H=12, L=64) that is 96 KiB saved instead of 3 MiB of
//! BF16 probabilities (6 MiB in F32) per attention call; the recomputation (one
//! `[64, 32] x [32, 64]` product and an exp per score, per head) measured within the
//! run-to-run noise, about 2 ms of the 22 ms forward + backward on 2 cores
//! (`tests/ops/attention.rs`, `attention_speed`, ignored).
//!
//! Masks: an additive float mask broadcastable to `[.., Lq, Lk]` (BERT's padding mask is
//! `[B, 1, 1, Lk]` of 0 and a large negative). It is read in F32 whatever its dtype and is
//! never cast by autocast (an F32 mask of `f32::MIN` cast to F16 would become -inf). A row
//! whose scores are all -inf has no softmax: its output and gradients are zeros (PyTorch's
//! math path since 2.5 does the same; older versions gave NaN). A large finite negative
//! mask gives a uniform softmax over such a row, never NaN. The mask gets no gradient.

use std::sync::Arc;

use crate::backend::nn::{AttentionGeom, Qkv};
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::{Layout, Tensor};

const OP: &str = "scaled_dot_product_attention";

type Part = Option<(Arc<crate::tensor::Storage>, Layout)>;

fn mask_ref(p: &Part) -> Option<(&crate::tensor::Storage, &Layout)> {
    p.as_ref().map(|(s, l)| (&**s, l))
}

impl Tensor {
    /// Scaled-dot-product attention with `self` as the queries, PyTorch's semantics:
    /// q `[.., Lq, D]`, k `[.., Lk, D]`, v `[.., Lk, Dv]` with equal leading dims (BERT:
    /// `[B, H, L, D]`; strided views such as a permuted `[B, L, H, D]` are read in place);
    /// `attn_mask` an additive float mask broadcastable to `[.., Lq, Lk]`;
    /// `scale` defaults to `1/sqrt(D)`. Returns `[.., Lq, Dv]` in the inputs' dtype (mixed float
    /// dtypes promote to the widest, as `matmul`; PyTorch refuses them).
    ///
    /// `dropout_p > 0` (training) drops attention probabilities with that probability and
    /// scales the kept ones by `1/(1 - dropout_p)`; the mask is drawn from `rng` (one
    /// `u64` seed per call, so the same generator state gives the same mask), and the
    /// backward applies the same mask. `dropout_p > 0` without an `rng` is an error, as is a
    /// `dropout_p` outside `[0, 1)`.
    ///
    /// Gradients flow to q, k and v (not to the mask). Under autocast, q, k and v are cast
    /// to the autocast dtype (a lower-precision op); the mask keeps its dtype.
    pub fn scaled_dot_product_attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        attn_mask: Option<&Tensor>,
        dropout_p: f64,
        rng: Option<&mut Generator>,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        use super::autocast::{cast, target};
        if let Some(dt) = target(OP, &[Some(self), Some(k), Some(v)]) {
            return cast(self, dt)?.scaled_dot_product_attention(
                &cast(k, dt)?,
                &cast(v, dt)?,
                attn_mask,
                dropout_p,
                rng,
                scale,
            );
        }
        let q = self;
        let shapes = format!(
            "q {:?}, k {:?}, v {:?}{}",
            q.shape(),
            k.shape(),
            v.shape(),
            attn_mask.map_or(String::new(), |m| format!(", mask {:?}", m.shape()))
        );
        for (what, t) in [("q", q), ("k", k), ("v", v)] {
            if !t.dtype().is_float() {
                return Err(Error::dtype(
                    OP,
                    t.dtype(),
                    format!("{what} must be a float tensor ({shapes})"),
                ));
            }
        }
        // Mixed float dtypes promote to the widest (the precision contract), as matmul does.
        let dtype = q.dtype().promote(k.dtype()).promote(v.dtype());
        if [q, k, v].iter().any(|t| t.dtype() != dtype) {
            return q.to_dtype(dtype)?.scaled_dot_product_attention(
                &k.to_dtype(dtype)?,
                &v.to_dtype(dtype)?,
                attn_mask,
                dropout_p,
                rng,
                scale,
            );
        }
        let bad = |why: &str| Error::shape(OP, format!("{shapes}: {why}"));
        let r = q.rank();
        if r < 2 || k.rank() != r || v.rank() != r {
            return Err(bad("q, k and v must have one rank, at least 2"));
        }
        let lead = &q.shape()[..r - 2];
        if &k.shape()[..r - 2] != lead || &v.shape()[..r - 2] != lead {
            return Err(bad("the leading (batch, head) dims of q, k and v differ"));
        }
        let (lq, d) = (q.shape()[r - 2], q.shape()[r - 1]);
        let (lk, dk) = (k.shape()[r - 2], k.shape()[r - 1]);
        let (lv, dv) = (v.shape()[r - 2], v.shape()[r - 1]);
        if dk != d {
            return Err(bad(&format!("q's last dim {d} and k's {dk} differ")));
        }
        if lv != lk {
            return Err(bad(&format!("k has {lk} keys and v {lv} values")));
        }
        if !(0.0..1.0).contains(&dropout_p) {
            return Err(Error::arg(
                OP,
                format!("dropout_p must be in [0, 1), got {dropout_p}"),
            ));
        }
        let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(Error::arg(OP, format!("scale must be finite, got {scale}")));
        }
        let seed = match (dropout_p > 0.0, rng) {
            (false, _) => None,
            (true, Some(rng)) => Some((dropout_p, rng.next_u64())),
            (true, None) => {
                return Err(Error::arg(
                    OP,
                    format!("dropout_p = {dropout_p} needs a random generator (rng is None)"),
                ))
            }
        };
        let mut scores_shape = lead.to_vec();
        scores_shape.extend([lq, lk]);
        // The mask in the compute type, as a broadcast view of [.., lq, lk]: a copy of the
        // mask's own (small) shape at most, never of the broadcast one.
        let compute = dtype.compute_type();
        let mask = match attn_mask {
            None => None,
            Some(m) => {
                if !m.dtype().is_float() {
                    return Err(Error::dtype(
                        OP,
                        m.dtype(),
                        format!("attn_mask must be an additive float mask ({shapes})"),
                    ));
                }
                let fits = m.rank() <= r
                    && broadcast_shapes(OP, m.shape(), &scores_shape)
                        .is_ok_and(|s| s == scores_shape);
                if !fits {
                    return Err(bad(&format!(
                        "attn_mask does not broadcast to the scores' shape {scores_shape:?}"
                    )));
                }
                Some(m.detach().to_dtype(compute)?.broadcast_to(&scores_shape)?)
            }
        };
        let g = AttentionGeom {
            batch: lead.iter().product(),
            lq,
            lk,
            d,
            dv,
            scale,
            dropout: seed,
        };
        let mask_part = mask.as_ref().map(|m| (m.storage(), m.layout().clone()));
        let (out, lse) = q.storage().attention(
            q.layout(),
            (&k.storage(), k.layout()),
            (&v.storage(), v.layout()),
            mask_ref(&mask_part),
            &g,
        )?;
        let mut out_shape = lead.to_vec();
        out_shape.extend([lq, dv]);
        let (qs, ks, vs) = (q.detach(), k.detach(), v.detach());
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(&out_shape),
            OP,
            &[q, k, v],
            move |grad| {
                let grad = if grad.dtype() == dtype {
                    grad.clone()
                } else {
                    grad.to_dtype(dtype)?
                };
                let (qst, kst, vst) = (qs.storage(), ks.storage(), vs.storage());
                let qkv = Qkv {
                    q: (&*qst, qs.layout()),
                    k: (&*kst, ks.layout()),
                    v: (&*vst, vs.layout()),
                };
                let (dq, dk, dv) = grad.storage().attention_backward(
                    grad.layout(),
                    qkv,
                    mask_ref(&mask_part),
                    &lse,
                    &g,
                )?;
                let t = |s, shape: &[usize]| {
                    Some(Tensor::from_storage(Arc::new(s), Layout::contiguous(shape)))
                };
                Ok(vec![
                    t(dq, qs.shape()),
                    t(dk, ks.shape()),
                    t(dv, vs.shape()),
                ])
            },
        ))
    }
}
