//! Scaled-dot-product attention from `matmul`, maps and row reductions, the whole
//! `[.., lq, lk]` score tensor materialised (the CPU's fused kernel never holds it). The
//! steps and their roundings follow the CPU's kernel: scores `scale · q·kᵀ (+ mask)` in the
//! compute type, the row maximum subtracted, `exp`, the row sum, probabilities times its
//! reciprocal, log-sum-exp `max + ln(sum)`; the dropout factors are the same counter-based
//! hash of `(h·lq + i)·lk + j` (made on the host and uploaded); for BF16 the probabilities and
//! `dS` are rounded to BF16 before their products, as the CPU (and PyTorch's CPU flash
//! attention) do. A fully masked row (every score -inf) gives zeros and a log-sum-exp of
//! -inf, as the CPU's.

use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::{AttentionGeom, NnOps, Opt, Qkv, View};
use crate::backend::reduce::{ReduceOp, ReduceOps};
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Layout;

/// `l` with its last two dims swapped (a transposed view, no copy).
fn transposed(l: &Layout) -> Layout {
    let (mut shape, mut strides) = (l.shape().to_vec(), l.strides().to_vec());
    let r = shape.len();
    shape.swap(r - 2, r - 1);
    strides.swap(r - 2, r - 1);
    Layout::new(shape, strides, l.offset())
}

/// The shapes of one attention: the leading dims and the score layouts.
struct Shapes {
    lead: Vec<usize>,
    rows: usize,
    lk: usize,
}

impl Shapes {
    fn new(lq: &Layout, g: &AttentionGeom) -> Shapes {
        let r = lq.rank();
        Shapes {
            lead: lq.shape()[..r - 2].to_vec(),
            rows: g.batch * g.lq,
            lk: g.lk,
        }
    }
    /// `[.., a, b]` contiguous.
    fn mat(&self, a: usize, b: usize) -> Layout {
        let mut s = self.lead.clone();
        s.extend([a, b]);
        Layout::contiguous(&s)
    }
    /// The scores `[rows, lk]` with the reduced `lk` last (contiguous).
    fn flat(&self) -> Layout {
        Layout::contiguous(&[self.rows * self.lk])
    }
    /// A per-row value `[rows]` broadcast over the scores.
    fn per_row(&self) -> Layout {
        Layout::new(vec![self.rows, self.lk], vec![1, 0], 0)
    }
    fn scores(&self) -> Layout {
        Layout::contiguous(&[self.rows, self.lk])
    }
}

/// `scale · q·kᵀ (+ mask)` in `c`, contiguous `[.., lq, lk]`.
fn scores<B: NnOps + MapOps>(
    q: View<'_, B>,
    k: View<'_, B>,
    mask: Opt<'_, B>,
    g: &AttentionGeom,
    sh: &Shapes,
    c: DType,
) -> Result<B> {
    let lsc = sh.mat(g.lq, g.lk);
    let s = q.0.matmul(q.1, k.0, &transposed(k.1), None, c)?;
    let s = s.unary(&lsc, UnaryOp::MulScalar(g.scale), c)?;
    match mask {
        Some((m, lm)) => s.binary(&lsc, m, lm, BinaryOp::Add, c),
        None => Ok(s),
    }
}

/// The dropout factors `1/(1-p)` or 0 of every score, on `like`'s device in `c`.
fn dropout_factors<B: MapOps>(like: &B, g: &AttentionGeom, c: DType) -> Result<Option<B>> {
    let Some((p, seed)) = g.dropout else {
        return Ok(None);
    };
    let n = g.batch * g.lq * g.lk;
    let threshold = crate::rng::threshold53(p);
    let mut f = vec![0.0f64; n];
    let keep = match c {
        DType::F64 => 1.0 / (1.0 - p),
        _ => f64::from((1.0 / (1.0 - p)) as f32),
    };
    crate::rng::keep_factors(seed, 0, threshold, keep, 0.0, &mut f);
    Ok(Some(like.upload(&CpuStorage::from_f64(f, c))?))
}

/// The lowest finite value of the compute type `c` (F32 or F64).
fn lowest(c: DType) -> f64 {
    match c {
        DType::F64 => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// `x` rounded to BF16 (and back into the compute type's products) where the inputs are BF16.
fn probs_for_product<B: MapOps>(x: B, l: &Layout, dtype: DType) -> Result<B> {
    if dtype == DType::BF16 {
        x.cast(l, DType::BF16)
    } else {
        Ok(x)
    }
}

/// The forward (`NnOps::attention`): the output in `q`'s dtype and the per-row log-sum-exp
/// `[batch, lq]` in the compute type.
pub fn attention<B: NnOps + MapOps + ReduceOps>(
    Qkv { q, k, v }: Qkv<'_, B>,
    mask: Opt<'_, B>,
    g: &AttentionGeom,
) -> Result<(B, B)> {
    let dtype = q.0.dtype();
    let c = dtype.compute_type();
    let sh = Shapes::new(q.1, g);
    let s = scores(q, k, mask, g, &sh, c)?;
    let (flat, rows) = (sh.flat(), Layout::contiguous(&[sh.rows]));
    let lsc = sh.scores();
    let max = s.reduce(&flat, sh.rows, sh.lk, ReduceOp::Max, c)?;
    // A fully masked row's maximum is -inf: shift it by the lowest finite value instead, so
    // its exponentials are 0 (not NaN), and let its sum count as 1, so its probabilities are
    // 0. Every other row's sum is at least 1 (its maximum's e^0), so neither changes it.
    let lowest = s.upload(&CpuStorage::from_f64(vec![lowest(c)], c))?;
    let one = s.upload(&CpuStorage::from_f64(vec![1.0], c))?;
    let scalar = Layout::new(vec![sh.rows], vec![0], 0);
    let shift = max.binary(&rows, &lowest, &scalar, BinaryOp::Maximum, c)?;
    let e = s
        .binary(&lsc, &shift, &sh.per_row(), BinaryOp::Sub, c)?
        .unary(&lsc, UnaryOp::Exp, c)?;
    let sum = e.reduce(&flat, sh.rows, sh.lk, ReduceOp::Sum, c)?;
    let sum = sum.binary(&rows, &one, &scalar, BinaryOp::Maximum, c)?;
    let inv = one.binary(&scalar, &sum, &rows, BinaryOp::Div, c)?;
    let mut p = e.binary(&lsc, &inv, &sh.per_row(), BinaryOp::Mul, c)?;
    if let Some(z) = dropout_factors(&p, g, c)? {
        p = p.binary(&lsc, &z, &lsc, BinaryOp::Mul, c)?;
    }
    let p = probs_for_product(p, &lsc, dtype)?;
    let out = p.matmul(&sh.mat(g.lq, g.lk), v.0, v.1, None, dtype)?;
    let lse = sum
        .unary(&rows, UnaryOp::Log, c)?
        .binary(&rows, &max, &rows, BinaryOp::Add, c)?;
    Ok((out, lse))
}

/// The backward (`NnOps::attention_backward`) with `P = exp(scores - lse)` recomputed, `Z`
/// the dropout factors: `dV = (P∘Z)ᵀ dO`, `dP = Z ∘ (dO Vᵀ)`, `D = Σ_j P dP`,
/// `dS = P ∘ (dP - D) · scale`, `dQ = dS K`, `dK = dSᵀ Q`, each in `q`'s dtype.
pub fn attention_backward<B: NnOps + MapOps + ReduceOps>(
    dout: View<'_, B>,
    Qkv { q, k, v }: Qkv<'_, B>,
    mask: Opt<'_, B>,
    lse: &B,
    g: &AttentionGeom,
) -> Result<(B, B, B)> {
    let dtype = q.0.dtype();
    let c = dtype.compute_type();
    let sh = Shapes::new(q.1, g);
    let (flat, rows, lsc) = (sh.flat(), Layout::contiguous(&[sh.rows]), sh.scores());
    let s = scores(q, k, mask, g, &sh, c)?;
    // A fully masked row's log-sum-exp is -inf: the lowest finite value in its place makes
    // its probabilities exp(-inf) = 0, as the forward's.
    let lowest = s.upload(&CpuStorage::from_f64(vec![lowest(c)], c))?;
    let scalar = Layout::new(vec![sh.rows], vec![0], 0);
    let lse = lse.binary(&rows, &lowest, &scalar, BinaryOp::Maximum, c)?;
    let p = s
        .binary(&lsc, &lse, &sh.per_row(), BinaryOp::Sub, c)?
        .unary(&lsc, UnaryOp::Exp, c)?;
    let mut dp = dout.0.matmul(dout.1, v.0, &transposed(v.1), None, c)?;
    let z = dropout_factors(&p, g, c)?;
    if let Some(z) = &z {
        dp = dp.binary(&lsc, z, &lsc, BinaryOp::Mul, c)?;
    }
    let pdp = p.binary(&lsc, &dp, &lsc, BinaryOp::Mul, c)?;
    let d = pdp.reduce(&flat, sh.rows, sh.lk, ReduceOp::Sum, c)?;
    let ds = dp
        .binary(&lsc, &d, &sh.per_row(), BinaryOp::Sub, c)?
        .binary(&lsc, &p, &lsc, BinaryOp::Mul, c)?
        .unary(&lsc, UnaryOp::MulScalar(g.scale), c)?;
    let pz = match &z {
        Some(z) => p.binary(&lsc, z, &lsc, BinaryOp::Mul, c)?,
        None => p,
    };
    let pz = probs_for_product(pz, &lsc, dtype)?;
    let ds = probs_for_product(ds, &lsc, dtype)?;
    let lqk = sh.mat(g.lq, g.lk);
    let dv = pz.matmul(&transposed(&lqk), dout.0, dout.1, None, dtype)?;
    let dq = ds.matmul(&lqk, k.0, k.1, None, dtype)?;
    let dk = ds.matmul(&transposed(&lqk), q.0, q.1, None, dtype)?;
    Ok((dq, dk, dv))
}
