//! Fused scaled-dot-product attention on the CPU, forward and backward, flash-attention
//! style: per head, one query row at a time, the scores `scale · q_i·kⱼ + mask_ij` are
//! computed into a row buffer of `lk` values in the compute type (F32, F64 for F64), turned
//! into probabilities and multiplied by V, so no `[batch, lq, lk]` score tensor ever exists.
//! The forward keeps only the per-row log-sum-exp of the scores; the backward recomputes each
//! row's probabilities from it (Dao et al., "FlashAttention", 2022, Algorithm 4 without the
//! tiling a GPU needs). Heads run in parallel; within a head the order of every sum is fixed,
//! so the thread count changes no bit.
//!
//! Inputs are read through their layouts: each head's K and V (and Q in the backward) are
//! converted once into compute-type buffers (`lk·d` values, a few KiB at BERT's sizes),
//! straight from strided views such as the `[B, H, L, D]` permutation of a `[B, L, H·D]`
//! projection, with no copy of the whole tensor. Results are rounded once into the inputs'
//! dtype.
//!
//! Fully masked rows: a row whose scores are all -inf has no softmax; its output and its
//! gradients are zeros (as PyTorch's math path since 2.5, `_safe_softmax`). A large finite
//! negative mask is no special case: every score of the row is shifted alike and the
//! softmax is uniform over the row.
//!
//! Dropout: element (h, i, j) is dropped when a counter-based hash (splitmix64) of the seed
//! and the flat index `(h·lq + i)·lk + j` falls below `p`; kept ones are scaled by
//! `1/(1-p)`. The same seed gives the same mask in the forward and in the backward, with no
//! mask stored.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::backend::nn::AttentionGeom;
use crate::cpu::map::PAR_THRESHOLD;
use crate::dtype::{convert, same_slice, same_slice_mut, DType, FloatDType, WithDType};
use crate::tensor::Layout;

/// The heads of a rank >= 2 view: the storage offset of each head (row-major over the
/// leading dims) and the strides of the last two dims.
struct Heads<'a, T> {
    data: &'a [T],
    offs: Vec<usize>,
    rs: usize,
    cs: usize,
}

impl<'a, T: WithDType> Heads<'a, T> {
    fn new(data: &'a [T], l: &Layout, batch: usize) -> Self {
        let r = l.rank();
        let (shape, strides) = (&l.shape()[..r - 2], &l.strides()[..r - 2]);
        let mut offs = Vec::with_capacity(batch);
        let mut idx = vec![0usize; r - 2];
        let mut off = l.offset();
        for _ in 0..batch {
            offs.push(off);
            for d in (0..r - 2).rev() {
                idx[d] += 1;
                off += strides[d];
                if idx[d] < shape[d] {
                    break;
                }
                off -= strides[d] * shape[d];
                idx[d] = 0;
            }
        }
        Heads {
            data,
            offs,
            rs: l.strides()[r - 2],
            cs: l.strides()[r - 1],
        }
    }

    /// Row `i` of head `h` into `dst` (its length is the row's), in the compute type.
    fn row<C: FloatDType>(&self, h: usize, i: usize, dst: &mut [C]) {
        load_row(self.data, self.offs[h] + i * self.rs, self.cs, dst);
    }

    /// The first `rows` rows of head `h` into `dst` (`rows · cols` values, row-major).
    fn matrix<C: FloatDType>(&self, h: usize, rows: usize, cols: usize, dst: &mut [C]) {
        if cols == 0 {
            return;
        }
        for (i, d) in dst.chunks_exact_mut(cols).take(rows).enumerate() {
            self.row(h, i, d);
        }
    }
}

/// `dst.len()` values from `src[start]` with stride `cs`, converted to the compute type:
/// contiguous F32/F16/BF16 rows in bulk (F16C / the BF16 kernels), others one by one.
fn load_row<T: WithDType, C: FloatDType>(src: &[T], start: usize, cs: usize, dst: &mut [C]) {
    let n = dst.len();
    if cs == 1 || n <= 1 {
        let s = start..start + n;
        if let Some(d) = same_slice_mut::<C, f32>(dst) {
            if let Some(v) = same_slice::<T, f32>(src) {
                return d.copy_from_slice(&v[s]);
            }
            if let Some(v) = same_slice::<T, f16>(src) {
                return convert::f16_to_f32(&v[s], d);
            }
            if let Some(v) = same_slice::<T, bf16>(src) {
                return convert::bf16_to_f32(&v[s], d);
            }
        }
        if let (Some(d), Some(v)) = (same_slice_mut::<C, f64>(dst), same_slice::<T, f64>(src)) {
            return d.copy_from_slice(&v[s]);
        }
    }
    for (j, d) in dst.iter_mut().enumerate() {
        *d = C::from_f64(src[start + j * cs].to_f64());
    }
}

/// `src` rounded once into `dst` (nearest-even; bulk for F16/BF16).
fn store_row<T: WithDType, C: FloatDType>(src: &[C], dst: &mut [T]) {
    if T::DTYPE != DType::F64 {
        if let Some(s) = same_slice::<C, f32>(src) {
            return crate::cpu::chunked::write(s, dst);
        }
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_f64(s.to_f64());
    }
}

/// `Σ a[i]·b[i]` with eight accumulators (vectorises; a fixed order).
#[inline]
fn dot<C: FloatDType>(a: &[C], b: &[C]) -> C {
    let mut acc = [C::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
#[inline]
fn axpy<C: FloatDType>(y: &mut [C], a: C, x: &[C]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The dropout decision of one probability: a splitmix64 hash of `seed` and the flat index,
/// its top 53 bits compared with `p · 2^53`.
struct Dropout {
    seed: u64,
    threshold: u64,
    /// `1 / (1 - p)`.
    scale: f64,
}

impl Dropout {
    fn new(g: &AttentionGeom) -> Option<Dropout> {
        g.dropout.map(|(p, seed)| Dropout {
            seed,
            threshold: (p * (1u64 << 53) as f64) as u64,
            scale: 1.0 / (1.0 - p),
        })
    }

    #[inline]
    fn keep(&self, idx: u64) -> bool {
        let mut z = self
            .seed
            .wrapping_add(idx.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) >= self.threshold
    }

    /// The factor of probability `(h, i, j)`: `1/(1-p)` or 0, for a row of `lk`.
    fn factors<C: FloatDType>(&self, base: u64, out: &mut [C]) {
        let s = C::from_f64(self.scale);
        for (j, z) in out.iter_mut().enumerate() {
            *z = if self.keep(base + j as u64) {
                s
            } else {
                C::zero()
            };
        }
    }
}

/// Row `i`'s scores of head `h`: `s[j] = scale · q·k_j + mask[i][j]`, and their maximum
/// (-inf when every score is -inf).
#[allow(clippy::too_many_arguments)]
fn scores<C: FloatDType>(
    q: &[C],
    kbuf: &[C],
    d: usize,
    scale: C,
    mask_row: Option<&[C]>,
    s: &mut [C],
) -> C {
    for (j, sj) in s.iter_mut().enumerate() {
        *sj = scale * dot(q, &kbuf[j * d..][..d]);
    }
    if let Some(m) = mask_row {
        for (sj, &mj) in s.iter_mut().zip(m) {
            *sj += mj;
        }
    }
    s.iter().fold(C::neg_infinity(), |a, &b| a.max(b))
}

/// The mask rows of one head, in a row buffer (loaded once when the mask does not vary by row).
struct MaskRows<'a, C> {
    heads: Option<&'a Heads<'a, C>>,
    buf: Vec<C>,
}

impl<'a, C: FloatDType> MaskRows<'a, C> {
    fn new(heads: Option<&'a Heads<'a, C>>, lk: usize) -> Self {
        MaskRows {
            heads,
            buf: vec![C::zero(); lk],
        }
    }

    /// Row `i` of head `h`'s mask, reloaded only when it can differ from the last one read.
    fn get(&mut self, h: usize, i: usize) -> Option<&[C]> {
        let m = self.heads?;
        if i == 0 || m.rs != 0 {
            m.row(h, i, &mut self.buf);
        }
        Some(&self.buf)
    }
}

/// The forward: the output `[batch, lq, dv]` in `T` and the per-row log-sum-exp in `C`.
pub(crate) fn forward<T: WithDType, C: FloatDType>(
    (q, lq_l): (&[T], &Layout),
    (k, lk_l): (&[T], &Layout),
    (v, lv_l): (&[T], &Layout),
    mask: Option<(&[C], &Layout)>,
    g: &AttentionGeom,
) -> (Vec<T>, Vec<C>) {
    let (lq, lk, d, dv) = (g.lq, g.lk, g.d, g.dv);
    let (qh, kh, vh) = (
        Heads::new(q, lq_l, g.batch),
        Heads::new(k, lk_l, g.batch),
        Heads::new(v, lv_l, g.batch),
    );
    let mh = mask.map(|(m, l)| Heads::new(m, l, g.batch));
    let drop = Dropout::new(g);
    let scale = C::from_f64(g.scale);
    let work = (lq * lk * (d + dv)).max(1);
    let heads: Vec<(Vec<T>, Vec<C>)> = (0..g.batch)
        .into_par_iter()
        .with_min_len((PAR_THRESHOLD / work).max(1))
        .map(|h| {
            let (mut kbuf, mut vbuf) = (vec![C::zero(); lk * d], vec![C::zero(); lk * dv]);
            kh.matrix(h, lk, d, &mut kbuf);
            vh.matrix(h, lk, dv, &mut vbuf);
            let mut masks = MaskRows::new(mh.as_ref(), lk);
            let (mut qrow, mut s, mut orow) =
                (vec![C::zero(); d], vec![C::zero(); lk], vec![C::zero(); dv]);
            let mut z = vec![C::zero(); if drop.is_some() { lk } else { 0 }];
            let mut out = vec![T::default(); lq * dv];
            let mut lse = vec![C::zero(); lq];
            for i in 0..lq {
                qh.row(h, i, &mut qrow);
                let mx = scores(&qrow, &kbuf, d, scale, masks.get(h, i), &mut s);
                orow.iter_mut().for_each(|o| *o = C::zero());
                if mx == C::neg_infinity() {
                    // A fully masked row: zeros (see the module notes).
                    lse[i] = mx;
                    store_row(&orow, &mut out[i * dv..][..dv]);
                    continue;
                }
                let mut sum = C::zero();
                for sj in s.iter_mut() {
                    *sj = (*sj - mx).exp();
                    sum += *sj;
                }
                lse[i] = mx + sum.ln();
                let inv = C::one() / sum;
                if let Some(drop) = &drop {
                    drop.factors(((h * lq + i) * lk) as u64, &mut z);
                    for (sj, &zj) in s.iter_mut().zip(&z) {
                        *sj = *sj * inv * zj;
                    }
                } else {
                    s.iter_mut().for_each(|sj| *sj *= inv);
                }
                for (j, &p) in s.iter().enumerate() {
                    axpy(&mut orow, p, &vbuf[j * dv..][..dv]);
                }
                store_row(&orow, &mut out[i * dv..][..dv]);
            }
            (out, lse)
        })
        .collect();
    let mut out = Vec::with_capacity(g.batch * lq * dv);
    let mut lse = Vec::with_capacity(g.batch * lq);
    for (o, l) in heads {
        out.extend_from_slice(&o);
        lse.extend_from_slice(&l);
    }
    (out, lse)
}

/// The backward: (dq, dk, dv) in `T`, contiguous `[batch, l, d]`.
///
/// Per row i, with `P` the softmax recomputed from the log-sum-exp, `Z` the dropout
/// factors (1 without dropout) and `dO` the output gradient:
/// `dV_j += P_ij Z_ij dO_i`, `dP_ij = Z_ij (dO_i · v_j)`, `D_i = Σ_j P_ij dP_ij`,
/// `dS_ij = P_ij (dP_ij - D_i)`, `dQ_i = scale Σ_j dS_ij k_j`, `dK_j += scale dS_ij q_i`.
#[allow(clippy::type_complexity)]
pub(crate) fn backward<T: WithDType, C: FloatDType>(
    (dout, ldo): (&[T], &Layout),
    (q, lq_l): (&[T], &Layout),
    (k, lk_l): (&[T], &Layout),
    (v, lv_l): (&[T], &Layout),
    mask: Option<(&[C], &Layout)>,
    lse: &[C],
    g: &AttentionGeom,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (lq, lk, d, dv) = (g.lq, g.lk, g.d, g.dv);
    let (qh, kh, vh, oh) = (
        Heads::new(q, lq_l, g.batch),
        Heads::new(k, lk_l, g.batch),
        Heads::new(v, lv_l, g.batch),
        Heads::new(dout, ldo, g.batch),
    );
    let mh = mask.map(|(m, l)| Heads::new(m, l, g.batch));
    let drop = Dropout::new(g);
    let scale = C::from_f64(g.scale);
    let work = (2 * lq * lk * (d + dv)).max(1);
    let heads: Vec<(Vec<T>, Vec<T>, Vec<T>)> = (0..g.batch)
        .into_par_iter()
        .with_min_len((PAR_THRESHOLD / work).max(1))
        .map(|h| {
            let mut qbuf = vec![C::zero(); lq * d];
            let (mut kbuf, mut vbuf) = (vec![C::zero(); lk * d], vec![C::zero(); lk * dv]);
            qh.matrix(h, lq, d, &mut qbuf);
            kh.matrix(h, lk, d, &mut kbuf);
            vh.matrix(h, lk, dv, &mut vbuf);
            let mut masks = MaskRows::new(mh.as_ref(), lk);
            let (mut dk, mut dvacc) = (vec![C::zero(); lk * d], vec![C::zero(); lk * dv]);
            let mut dq = vec![T::default(); lq * d];
            let (mut p, mut dp, mut dorow, mut dqrow) = (
                vec![C::zero(); lk],
                vec![C::zero(); lk],
                vec![C::zero(); dv],
                vec![C::zero(); d],
            );
            let mut z = vec![C::zero(); if drop.is_some() { lk } else { 0 }];
            for i in 0..lq {
                let l = lse[h * lq + i];
                let qrow = &qbuf[i * d..][..d];
                dqrow.iter_mut().for_each(|x| *x = C::zero());
                let mrow = masks.get(h, i);
                if l == C::neg_infinity() {
                    store_row(&dqrow, &mut dq[i * d..][..d]);
                    continue;
                }
                scores(qrow, &kbuf, d, scale, mrow, &mut p);
                p.iter_mut().for_each(|s| *s = (*s - l).exp());
                oh.row(h, i, &mut dorow);
                for (j, dpj) in dp.iter_mut().enumerate() {
                    *dpj = dot(&dorow, &vbuf[j * dv..][..dv]);
                }
                if let Some(drop) = &drop {
                    drop.factors(((h * lq + i) * lk) as u64, &mut z);
                    for j in 0..lk {
                        axpy(&mut dvacc[j * dv..][..dv], p[j] * z[j], &dorow);
                        dp[j] *= z[j];
                    }
                } else {
                    for j in 0..lk {
                        axpy(&mut dvacc[j * dv..][..dv], p[j], &dorow);
                    }
                }
                let di = dot(&p, &dp);
                for j in 0..lk {
                    let ds = p[j] * (dp[j] - di) * scale;
                    axpy(&mut dqrow, ds, &kbuf[j * d..][..d]);
                    axpy(&mut dk[j * d..][..d], ds, qrow);
                }
                store_row(&dqrow, &mut dq[i * d..][..d]);
            }
            let (mut dk_t, mut dv_t) = (vec![T::default(); lk * d], vec![T::default(); lk * dv]);
            store_row(&dk, &mut dk_t);
            store_row(&dvacc, &mut dv_t);
            (dq, dk_t, dv_t)
        })
        .collect();
    let (mut dq, mut dk, mut dv) = (
        Vec::with_capacity(g.batch * lq * d),
        Vec::with_capacity(g.batch * lk * d),
        Vec::with_capacity(g.batch * lk * dv),
    );
    for (a, b, c) in heads {
        dq.extend_from_slice(&a);
        dk.extend_from_slice(&b);
        dv.extend_from_slice(&c);
    }
    (dq, dk, dv)
}

// ----- the `NnOps` primitives over `CpuStorage` (dtype dispatch) ----------------------------

use crate::backend::nn::Opt;
use crate::cpu::storage::CpuStorage;
use crate::error::{Error, Result};

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
pub(crate) fn attention(
    q: (&CpuStorage, &Layout),
    k: (&CpuStorage, &Layout),
    v: (&CpuStorage, &Layout),
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
            let (out, lse) = forward::<T, C>(
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
pub(crate) fn attention_backward(
    dout: (&CpuStorage, &Layout),
    q: (&CpuStorage, &Layout),
    k: (&CpuStorage, &Layout),
    v: (&CpuStorage, &Layout),
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
            let (dq, dk, dv) = backward::<T, C>(
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
