//! Fused scaled-dot-product attention on the CPU, forward and backward, flash-attention
//! style: per head and block of query rows (`block_rows`: 128 for up to 128 keys), the scores `scale · Q_blk Kᵀ + mask`
//! are computed into a `[rows, lk]` buffer in the compute type (F32, F64 for F64), turned into
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
//! For BF16 inputs the probabilities (and, in the backward, `dS`) are rounded to BF16 before
//! their products (`rounds_probs`), as PyTorch's CPU flash attention does.
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

use crate::backend::nn::AttentionGeom;
use crate::cpu::chunked::{for_each_chunk2_init, for_each_chunk3_init};
use crate::cpu::elementwise::map::PAR_THRESHOLD;
use crate::cpu::gemm::{product, MatRef};
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
            threshold: crate::rng::threshold53(p),
            scale: 1.0 / (1.0 - p),
        })
    }

    /// The factor of probability `(h, i, j)`: `1/(1-p)` or 0, for a row of `lk`.
    fn factors<C: FloatDType>(&self, base: u64, out: &mut [C]) {
        let s = C::from_f64(self.scale);
        crate::rng::keep_factors(self.seed, base, self.threshold, s, C::zero(), out)
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

/// Whether the probabilities `P` (forward) and `P`, `dS` (backward) are rounded to the inputs'
/// dtype before their products, as PyTorch's CPU flash attention does for reduced-precision
/// inputs: for BF16, so that every product of the op is BF16 × BF16 and runs on the pair
/// kernels (`vdpbf16ps`) instead of widening V, dO, K and Q to F32 in the packing. The
/// softmax, its sums and every product's accumulation stay in F32.
fn rounds_probs<T: WithDType>() -> bool {
    T::DTYPE == DType::BF16
}

/// Query rows per block: up to 128, fewer for long keys so that a block's scores
/// (`rows × lk` F32) stay within 64 KiB. K and V are packed once per block, so at BERT's 128
/// tokens one block per head packs them once. The rows of a block change no sum of the
/// forward (each score and output element sums over d or lk alone); in the backward, dK and
/// dV add the blocks' products in block order.
fn block_rows(lq: usize, lk: usize) -> usize {
    (16384 / lk.max(1)).clamp(16, 128).min(lq).max(1)
}

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

/// Lanes of the row loops' partial sums and maxima: a fixed order of every sum, the same
/// bits whatever vector width the loop is compiled for.
const LANES: usize = 16;

/// `Σ parts` in a fixed pairwise order.
#[inline(always)]
fn lane_sum<C: FloatDType>(p: &[C; LANES]) -> C {
    let mut w = *p;
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            w[i] += w[i + n];
        }
    }
    w[0]
}

/// Row `i` of block `s` (`lk` wide) turned into probabilities: `scale · s + mask`, softmax;
/// returns the log-sum-exp (-inf for a fully masked row, whose probabilities are zeros).
/// e^x is `exp_fast` (F32: within 1.5 ulp, vectorised), the sum runs in `LANES` lanes.
#[inline(always)]
#[doc(hidden)]
pub fn softmax_row_lanes<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>) -> C {
    let mut mx = [C::neg_infinity(); LANES];
    let split = s.len() / LANES * LANES;
    match mask_row {
        Some(m) => {
            let (m, mt) = m[..s.len()].split_at(split);
            let (body, tail) = s.split_at_mut(split);
            for (cs, cm) in body.chunks_exact_mut(LANES).zip(m.chunks_exact(LANES)) {
                for j in 0..LANES {
                    let v = cs[j] * scale + cm[j];
                    cs[j] = v;
                    mx[j] = mx[j].max(v);
                }
            }
            for (j, (x, &mj)) in tail.iter_mut().zip(mt).enumerate() {
                *x = *x * scale + mj;
                mx[j] = mx[j].max(*x);
            }
        }
        None => {
            let (body, tail) = s.split_at_mut(split);
            for cs in body.chunks_exact_mut(LANES) {
                for j in 0..LANES {
                    let v = cs[j] * scale;
                    cs[j] = v;
                    mx[j] = mx[j].max(v);
                }
            }
            for (j, x) in tail.iter_mut().enumerate() {
                *x *= scale;
                mx[j] = mx[j].max(*x);
            }
        }
    }
    let mx = mx.iter().fold(C::neg_infinity(), |a, &b| a.max(b));
    if mx == C::neg_infinity() {
        s.iter_mut().for_each(|x| *x = C::zero());
        return mx;
    }
    let mut acc = [C::zero(); LANES];
    let (body, tail) = s.split_at_mut(split);
    for cs in body.chunks_exact_mut(LANES) {
        for j in 0..LANES {
            let e = (cs[j] - mx).exp_fast();
            cs[j] = e;
            acc[j] += e;
        }
    }
    for (j, x) in tail.iter_mut().enumerate() {
        *x = (*x - mx).exp_fast();
        acc[j] += *x;
    }
    let sum = lane_sum(&acc);
    let inv = C::one() / sum;
    s.iter_mut().for_each(|x| *x *= inv);
    mx + sum.ln()
}

/// The probabilities of a row recomputed from its log-sum-exp: `exp(scale · s + mask - lse)`.
#[inline(always)]
#[doc(hidden)]
pub fn probs_row_lanes<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>, lse: C) {
    if lse == C::neg_infinity() {
        s.iter_mut().for_each(|x| *x = C::zero());
        return;
    }
    match mask_row {
        Some(m) => {
            for (x, &mj) in s.iter_mut().zip(m) {
                *x = (*x * scale + mj - lse).exp_fast();
            }
        }
        None => s
            .iter_mut()
            .for_each(|x| *x = (*x * scale - lse).exp_fast()),
    }
}

/// `dS = scale · P ∘ (dP - D)` over a row, `D = Σ_j P_j dP_j` (in `LANES` lanes), in place
/// of `dp`.
#[inline(always)]
#[doc(hidden)]
pub fn ds_row_lanes<C: FloatDType>(p: &[C], dp: &mut [C], scale: C) {
    let split = p.len() / LANES * LANES;
    let mut acc = [C::zero(); LANES];
    for (cp, cd) in p[..split]
        .chunks_exact(LANES)
        .zip(dp[..split].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] += cp[j] * cd[j];
        }
    }
    for (j, (&x, &y)) in p[split..].iter().zip(&dp[split..]).enumerate() {
        acc[j] += x * y;
    }
    let di = lane_sum(&acc);
    for (x, &pj) in dp.iter_mut().zip(p) {
        *x = pj * (*x - di) * scale;
    }
}

/// The row loops compiled for AVX2 and AVX-512 F: the crate's baseline is SSE2, and these
/// are a third of an attention forward. Same bits at every width (no FMA contraction, sums
/// in `LANES` fixed lanes).
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{ds_row_lanes, probs_row_lanes, softmax_row_lanes};

    macro_rules! at {
        ($feat:literal, $soft:ident, $probs:ident, $ds:ident) => {
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $soft(s: &mut [f32], scale: f32, m: Option<&[f32]>) -> f32 {
                softmax_row_lanes(s, scale, m)
            }
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $probs(s: &mut [f32], scale: f32, m: Option<&[f32]>, lse: f32) {
                probs_row_lanes(s, scale, m, lse)
            }
            /// # Safety
            /// The CPU has the feature.
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $ds(p: &[f32], dp: &mut [f32], scale: f32) {
                ds_row_lanes(p, dp, scale)
            }
        };
    }
    at!("avx512f", softmax_avx512, probs_avx512, ds_avx512);
    at!("avx2", softmax_avx2, probs_avx2, ds_avx2);
}

/// `softmax_row_lanes`, on the widest vector unit for F32.
#[doc(hidden)]
pub fn softmax_row<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>) -> C {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::elementwise::map::{f32_opt, vector_level, VectorLevel};
        let m = f32_opt(mask_row);
        let level = vector_level();
        if let (Some(s), Some(m), true) = (C::as_f32_mut(s), m, level != VectorLevel::Baseline) {
            let sc = scale.to_f64() as f32;
            // SAFETY: the CPU has the features (`vector_level`).
            let r = unsafe {
                if level == VectorLevel::Avx512 {
                    wide::softmax_avx512(s, sc, m)
                } else {
                    wide::softmax_avx2(s, sc, m)
                }
            };
            return C::from_f64(f64::from(r));
        }
    }
    softmax_row_lanes(s, scale, mask_row)
}

/// `probs_row_lanes`, on the widest vector unit for F32.
#[doc(hidden)]
pub fn probs_row<C: FloatDType>(s: &mut [C], scale: C, mask_row: Option<&[C]>, lse: C) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::elementwise::map::{f32_opt, vector_level, VectorLevel};
        let m = f32_opt(mask_row);
        let level = vector_level();
        if let (Some(s), Some(m), true) = (C::as_f32_mut(s), m, level != VectorLevel::Baseline) {
            let (sc, l) = (scale.to_f64() as f32, lse.to_f64() as f32);
            // SAFETY: the CPU has the features (`vector_level`).
            unsafe {
                if level == VectorLevel::Avx512 {
                    wide::probs_avx512(s, sc, m, l)
                } else {
                    wide::probs_avx2(s, sc, m, l)
                }
            }
            return;
        }
    }
    probs_row_lanes(s, scale, mask_row, lse)
}

/// `ds_row_lanes`, on the widest vector unit for F32.
#[doc(hidden)]
pub fn ds_row<C: FloatDType>(p: &[C], dp: &mut [C], scale: C) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::elementwise::map::{vector_level, VectorLevel};
        let level = vector_level();
        if let (Some(p), Some(dp), true) = (
            C::as_f32(p),
            C::as_f32_mut(dp),
            level != VectorLevel::Baseline,
        ) {
            let sc = scale.to_f64() as f32;
            // SAFETY: the CPU has the features (`vector_level`).
            unsafe {
                if level == VectorLevel::Avx512 {
                    wide::ds_avx512(p, dp, sc)
                } else {
                    wide::ds_avx2(p, dp, sc)
                }
            }
            return;
        }
    }
    ds_row_lanes(p, dp, scale)
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
    let bq_max = block_rows(lq, lk);
    // Every head writes its rows of the one output in place; the scratch (scores, the
    // block's output, the mask row, dropout factors) is made once per rayon split.
    let mut out = vec![T::default(); g.batch * lq * dv];
    let mut lse = vec![C::zero(); g.batch * lq];
    let scratch = || {
        (
            MaskRows::new(mh.as_ref(), lk),
            vec![C::zero(); bq_max * lk],
            vec![C::zero(); bq_max * dv],
            vec![C::zero(); if drop.is_some() { lk } else { 0 }],
            vec![T::default(); if rounds_probs::<T>() { bq_max * lk } else { 0 }],
        )
    };
    crate::threads::nudge();
    for_each_chunk2_init(
        (&mut out, (lq * dv).max(1)),
        (&mut lse, lq.max(1)),
        (PAR_THRESHOLD / work).max(1),
        scratch,
        &|(masks, s, o, z, sr), h, out, lse| {
            let (kt, vm) = (kh.mat(h, 0, lk, d).t(), vh.mat(h, 0, lk, dv));
            for i0 in (0..lq).step_by(bq_max) {
                let bq = bq_max.min(lq - i0);
                let (s, o) = (&mut s[..bq * lk], &mut o[..bq * dv]);
                product(s, qh.mat(h, i0, bq, d), kt, false, false);
                for r in 0..bq {
                    let i = i0 + r;
                    let row = &mut s[r * lk..][..lk];
                    lse[i] = softmax_row(row, scale, masks.get(h, i));
                    if let Some(drop) = &drop {
                        drop.factors(((h * lq + i) * lk) as u64, z);
                        row.iter_mut().zip(z.iter()).for_each(|(p, &zj)| *p *= zj);
                    }
                }
                if rounds_probs::<T>() {
                    let sr = &mut sr[..bq * lk];
                    store_row(s, sr);
                    product(o, MatRef::row_major(&sr[..], bq, lk), vm, false, false);
                } else {
                    product(o, MatRef::row_major(&s[..], bq, lk), vm, false, false);
                }
                if dv > 0 {
                    for (r, orow) in o.chunks_exact(dv).enumerate() {
                        store_row(orow, &mut out[(i0 + r) * dv..][..dv]);
                    }
                }
            }
        },
    );
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
    let nb = block_rows(lq, lk);
    let (mut dq_all, mut dk_all, mut dv_all) = (
        vec![T::default(); g.batch * lq * d],
        vec![T::default(); g.batch * lk * d],
        vec![T::default(); g.batch * lk * dv],
    );
    let scratch = || {
        (
            MaskRows::new(mh.as_ref(), lk),
            (vec![C::zero(); lk * d], vec![C::zero(); lk * dv]),
            (vec![C::zero(); nb * lk], vec![C::zero(); nb * lk]),
            vec![C::zero(); nb * d],
            vec![C::zero(); if drop.is_some() { lk } else { 0 }],
            vec![T::default(); if rounds_probs::<T>() { 2 * nb * lk } else { 0 }],
        )
    };
    crate::threads::nudge();
    for_each_chunk3_init(
        (&mut dq_all, (lq * d).max(1)),
        (&mut dk_all, (lk * d).max(1)),
        (&mut dv_all, (lk * dv).max(1)),
        (PAR_THRESHOLD / work).max(1),
        scratch,
        &|scr, h, dq, dk_t, dv_t| {
            let (masks, (dk, dvacc), (p, dp), dqb, z, rounded) = scr;
            let (km, vm) = (kh.mat(h, 0, lk, d), vh.mat(h, 0, lk, dv));
            for i0 in (0..lq).step_by(nb) {
                let bq = nb.min(lq - i0);
                let (p, dp, dqb) = (&mut p[..bq * lk], &mut dp[..bq * lk], &mut dqb[..bq * d]);
                let (qm, dom) = (qh.mat(h, i0, bq, d), oh.mat(h, i0, bq, dv));
                product(p, qm, km.t(), false, false);
                product(dp, dom, vm.t(), false, false);
                for r in 0..bq {
                    let i = i0 + r;
                    let (pr, dpr) = (&mut p[r * lk..][..lk], &mut dp[r * lk..][..lk]);
                    probs_row(pr, scale, masks.get(h, i), lse[h * lq + i]);
                    if let Some(drop) = &drop {
                        drop.factors(((h * lq + i) * lk) as u64, z);
                        dpr.iter_mut().zip(z.iter()).for_each(|(x, &zj)| *x *= zj);
                    }
                    // dS overwrites dP; P becomes P∘Z for dV.
                    ds_row(pr, dpr, scale);
                    if drop.is_some() {
                        pr.iter_mut().zip(z.iter()).for_each(|(x, &zj)| *x *= zj);
                    }
                }
                // The first block overwrites the accumulators left by the previous head.
                let (outs, ins) = ((&mut dvacc[..], &mut dqb[..], &mut dk[..]), (dom, km, qm));
                if rounds_probs::<T>() {
                    let (pr, dsr) = rounded[..2 * bq * lk].split_at_mut(bq * lk);
                    store_row(p, pr);
                    store_row(dp, dsr);
                    let (pm, dsm) = (
                        MatRef::row_major(&pr[..], bq, lk),
                        MatRef::row_major(&dsr[..], bq, lk),
                    );
                    block_grads(outs, (pm, dsm), ins, i0 > 0);
                } else {
                    let (pm, dsm) = (
                        MatRef::row_major(&p[..], bq, lk),
                        MatRef::row_major(&dp[..], bq, lk),
                    );
                    block_grads(outs, (pm, dsm), ins, i0 > 0);
                }
                if d > 0 {
                    for (r, row) in dqb.chunks_exact(d).enumerate() {
                        store_row(row, &mut dq[(i0 + r) * d..][..d]);
                    }
                }
            }
            if lq == 0 {
                dk.fill(C::zero());
                dvacc.fill(C::zero());
            }
            store_row(dk, dk_t);
            store_row(dvacc, dv_t);
        },
    );
    (dq_all, dk_all, dv_all)
}

/// One query block's share of the backward's products: `dV (+)= Pᵀ dO`, `dQ_blk = dS K`,
/// `dK (+)= dSᵀ Q` (`acc`: add to the earlier blocks'), with `P` and `dS` stored as `U` (F32,
/// or rounded to BF16 by `rounds_probs`).
#[allow(clippy::type_complexity)]
fn block_grads<C: FloatDType, U: WithDType, T: WithDType>(
    (dv, dq, dk): (&mut [C], &mut [C], &mut [C]),
    (p, ds): (MatRef<'_, U>, MatRef<'_, U>),
    (dout, k, q): (MatRef<'_, T>, MatRef<'_, T>, MatRef<'_, T>),
    acc: bool,
) {
    product(dv, p.t(), dout, acc, false);
    product(dq, ds, k, false, false);
    product(dk, ds.t(), q, acc, false);
}
