//! Fused scaled-dot-product attention on the CPU, forward and backward, flash-attention
//! style: per head and block of up to 64 query rows, the scores `scale · Q_blk Kᵀ + mask`
//! are computed into a `[64, lk]` buffer in the compute type (F32, F64 for F64), turned into
//! probabilities row by row and multiplied by V, so no `[batch, lq, lk]` score tensor ever
//! exists. The forward keeps only the per-row log-sum-exp of the scores; the backward
//! recomputes each block's probabilities from it (Dao et al., "FlashAttention", 2022,
//! Algorithm 4, with the key dimension untiled). Heads run in parallel; within a head the
//! order of every sum is fixed (the GEMMs run single-threaded there), so the thread count
//! changes no bit.
//!
//! Inputs are read through their layouts: the block products are `cpu::gemm::product` on the
//! stored elements as strided views (F32 accumulation; F16/BF16 converted inside its
//! packing), so the `[B, H, L, D]` permutation of a `[B, L, H·D]` projection is read in
//! place, with no copy of the whole tensor. Results are rounded once into the inputs' dtype.
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
use crate::cpu::gemm::{product, MatRef};
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

/// Query rows per block: the block's scores are one `[BLOCK, lk]` compute-type buffer.
const BLOCK: usize = 64;

impl<'a, T: WithDType> Heads<'a, T> {
    /// Rows `r0..r0 + rows` of head `h` (all `cols` columns) as a GEMM operand, in place.
    fn mat(&self, h: usize, r0: usize, rows: usize, cols: usize) -> MatRef<'a, T> {
        let off = self.offs[h] + r0 * self.rs;
        MatRef {
            data: if rows == 0 || cols == 0 {
                &self.data[..0]
            } else {
                &self.data[off..]
            },
            rows,
            cols,
            rs: self.rs as isize,
            cs: self.cs as isize,
        }
    }
}

/// Row `i` of block `s` (`lk` wide) turned into probabilities: `scale · s + mask`, softmax;
/// returns the log-sum-exp (-inf for a fully masked row, whose probabilities are zeros).
fn softmax_row<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>) -> C {
    s.iter_mut().for_each(|x| *x *= scale);
    if let Some(m) = mask_row {
        for (x, &mj) in s.iter_mut().zip(m) {
            *x += mj;
        }
    }
    let mx = s.iter().fold(C::neg_infinity(), |a, &b| a.max(b));
    if mx == C::neg_infinity() {
        s.iter_mut().for_each(|x| *x = C::zero());
        return mx;
    }
    let mut sum = C::zero();
    for x in s.iter_mut() {
        *x = (*x - mx).exp();
        sum += *x;
    }
    let inv = C::one() / sum;
    s.iter_mut().for_each(|x| *x *= inv);
    mx + sum.ln()
}

/// The probabilities of a row recomputed from its log-sum-exp: `exp(scale · s + mask - lse)`.
fn probs_row<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>, lse: C) {
    if lse == C::neg_infinity() {
        s.iter_mut().for_each(|x| *x = C::zero());
        return;
    }
    match mask_row {
        Some(m) => {
            for (x, &mj) in s.iter_mut().zip(m) {
                *x = (*x * scale + mj - lse).exp();
            }
        }
        None => s.iter_mut().for_each(|x| *x = (*x * scale - lse).exp()),
    }
}

/// The forward: the output `[batch, lq, dv]` in `T` and the per-row log-sum-exp in `C`.
///
/// Per head and block of query rows: `S = Q_blk Kᵀ` and `O_blk = P V` are GEMMs on the
/// stored elements (`cpu::gemm::product`: F32 accumulation, half operands converted in its
/// packing, strided views read in place); the softmax runs on the block's F32 rows.
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
            let (kt, vm) = (kh.mat(h, 0, lk, d).t(), vh.mat(h, 0, lk, dv));
            let mut masks = MaskRows::new(mh.as_ref(), lk);
            let mut s = vec![C::zero(); BLOCK.min(lq) * lk];
            let mut o = vec![C::zero(); BLOCK.min(lq) * dv];
            let mut z = vec![C::zero(); if drop.is_some() { lk } else { 0 }];
            let mut out = vec![T::default(); lq * dv];
            let mut lse = vec![C::zero(); lq];
            for i0 in (0..lq).step_by(BLOCK) {
                let bq = BLOCK.min(lq - i0);
                let (s, o) = (&mut s[..bq * lk], &mut o[..bq * dv]);
                product(s, qh.mat(h, i0, bq, d), kt, false, false);
                for r in 0..bq {
                    let i = i0 + r;
                    let row = &mut s[r * lk..][..lk];
                    lse[i] = softmax_row(row, scale, masks.get(h, i));
                    if let Some(drop) = &drop {
                        drop.factors(((h * lq + i) * lk) as u64, &mut z);
                        row.iter_mut().zip(&z).for_each(|(p, &zj)| *p *= zj);
                    }
                }
                product(o, MatRef::row_major(&s[..], bq, lk), vm, false, false);
                if dv > 0 {
                    for (r, orow) in o.chunks_exact(dv).enumerate() {
                        store_row(orow, &mut out[(i0 + r) * dv..][..dv]);
                    }
                }
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
/// Per block of query rows, with `P` the softmax recomputed from the log-sum-exp, `Z` the
/// dropout factors (1 without dropout) and `dO` the output gradient (GEMMs as in the
/// forward): `dV += (P∘Z)ᵀ dO`, `dP = Z ∘ (dO Vᵀ)`, `D_i = Σ_j P_ij dP_ij`,
/// `dS = scale · P ∘ (dP - D)`, `dQ = dS K`, `dK += dSᵀ Q`.
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
            let (km, vm) = (kh.mat(h, 0, lk, d), vh.mat(h, 0, lk, dv));
            let mut masks = MaskRows::new(mh.as_ref(), lk);
            let (mut dk, mut dvacc) = (vec![C::zero(); lk * d], vec![C::zero(); lk * dv]);
            let nb = BLOCK.min(lq);
            let (mut p, mut dp) = (vec![C::zero(); nb * lk], vec![C::zero(); nb * lk]);
            let mut dqb = vec![C::zero(); nb * d];
            let mut dq = vec![T::default(); lq * d];
            let mut z = vec![C::zero(); if drop.is_some() { lk } else { 0 }];
            for i0 in (0..lq).step_by(BLOCK) {
                let bq = BLOCK.min(lq - i0);
                let (p, dp, dqb) = (&mut p[..bq * lk], &mut dp[..bq * lk], &mut dqb[..bq * d]);
                let (qm, dom) = (qh.mat(h, i0, bq, d), oh.mat(h, i0, bq, dv));
                product(p, qm, km.t(), false, false);
                product(dp, dom, vm.t(), false, false);
                for r in 0..bq {
                    let i = i0 + r;
                    let (pr, dpr) = (&mut p[r * lk..][..lk], &mut dp[r * lk..][..lk]);
                    probs_row(pr, scale, masks.get(h, i), lse[h * lq + i]);
                    if let Some(drop) = &drop {
                        drop.factors(((h * lq + i) * lk) as u64, &mut z);
                        dpr.iter_mut().zip(&z).for_each(|(x, &zj)| *x *= zj);
                    }
                    let di = dot(pr, dpr);
                    // dS overwrites dP; P becomes P∘Z for dV.
                    for (x, &pj) in dpr.iter_mut().zip(pr.iter()) {
                        *x = pj * (*x - di) * scale;
                    }
                    if drop.is_some() {
                        pr.iter_mut().zip(&z).for_each(|(x, &zj)| *x *= zj);
                    }
                }
                let (pm, dsm) = (
                    MatRef::row_major(&p[..], bq, lk),
                    MatRef::row_major(&dp[..], bq, lk),
                );
                product(&mut dvacc, pm.t(), dom, true, false);
                product(dqb, dsm, km, false, false);
                product(&mut dk, dsm.t(), qm, true, false);
                if d > 0 {
                    for (r, row) in dqb.chunks_exact(d).enumerate() {
                        store_row(row, &mut dq[(i0 + r) * d..][..d]);
                    }
                }
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
