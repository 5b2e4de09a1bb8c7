//! The CPU's loss-scaler and gradient-statistics kernels: unscale a gradient and note
//! inf/NaN in one pass; values out of a dtype's range, log2 histograms, norms; stochastic
//! rounding.

use half::{bf16, f16};

use crate::backend::train::Log2Histogram;
use crate::dtype::convert::{self, stochastic_round_bf16, stochastic_round_f16};
use crate::rng::Generator;

/// Elements converted and scaled per chunk: the F16/BF16 -> F32 conversion of a chunk is
/// still in L1 when the multiply-and-check loop reads it (16 KiB of F32).
const CHUNK: usize = 4096;

/// `x *= inv` over `o`; true when any input is inf or NaN.
pub(crate) fn scale_in_place(o: &mut [f32], inv: f32) -> bool {
    let mut bad = false;
    for x in o.iter_mut() {
        bad |= !x.is_finite();
        *x *= inv;
    }
    bad
}

/// How many values are below `tiny` in magnitude (and not zero), and how many above `max` or
/// NaN: the gradient values a dtype would flush or overflow.
pub(crate) fn range_counts(values: &[f32], tiny: f64, max: f64) -> (u64, u64) {
    let (tiny, max) = (tiny as f32, max as f32);
    let (mut under, mut over) = (0u64, 0u64);
    for &g in values.iter() {
        let a = g.abs();
        if a > max || a.is_nan() {
            over += 1;
        } else if a < tiny && a != 0.0 {
            under += 1;
        }
    }
    (under, over)
}

/// The values counted by binary exponent.
pub(crate) fn log2_histogram(values: &[f32]) -> Log2Histogram {
    let mut h = Log2Histogram::default();
    for &x in values.iter() {
        h.add(x);
    }
    h
}

/// `Σ |x|^p` (for `p = ∞`, `max |x|`, NaN if any value is NaN): one tensor's part of a norm.
pub(crate) fn norm_partial(v: &[f64], p: f64) -> f64 {
    if p == f64::INFINITY {
        let mut m = 0.0f64;
        for &x in v.iter() {
            let a = x.abs();
            if a.is_nan() {
                return f64::NAN;
            }
            m = m.max(a);
        }
        m
    } else if p == 2.0 {
        v.iter().map(|x| x * x).sum::<f64>()
    } else if p == 1.0 {
        v.iter().map(|x| x.abs()).sum::<f64>()
    } else {
        v.iter().map(|x| x.abs().powf(p)).sum::<f64>()
    }
}

/// `values` rounded stochastically to F16, a 64-bit draw per value.
pub(crate) fn stochastic_f16(values: &[f32], rng: &mut Generator) -> Vec<f16> {
    values
        .iter()
        .map(|&x| stochastic_round_f16(x, rng.next_u64()))
        .collect()
}

/// `values` rounded stochastically to BF16, a 64-bit draw per four values.
pub(crate) fn stochastic_bf16(values: &[f32], rng: &mut Generator) -> Vec<bf16> {
    let mut out = Vec::with_capacity(values.len());
    for chunk in values.chunks(4) {
        let mut bits = rng.next_u64();
        for &x in chunk {
            out.push(stochastic_round_bf16(x, bits as u16));
            bits >>= 16;
        }
    }
    out
}

/// `x *= inv` over an F64 gradient; true when any input is inf or NaN.
pub(crate) fn unscale_f64(v: &mut [f64], inv: f64) -> bool {
    let mut bad = false;
    for x in v.iter_mut() {
        bad |= !x.is_finite();
        *x *= inv;
    }
    bad
}

/// `v · inv` into a new F32 buffer; true when any input is inf or NaN.
pub(crate) fn unscale_f32(v: &[f32], inv: f32) -> (Vec<f32>, bool) {
    let mut bad = false;
    let out = v
        .iter()
        .map(|&x| {
            bad |= !x.is_finite();
            x * inv
        })
        .collect();
    (out, bad)
}

/// `v · inv` in F32, converted chunk by chunk; true when any input is inf or NaN.
pub(crate) fn unscale_f16(v: &[f16], inv: f32) -> (Vec<f32>, bool) {
    let mut out = vec![0f32; v.len()];
    let mut bad = false;
    for (o, s) in out.chunks_mut(CHUNK).zip(v.chunks(CHUNK)) {
        convert::f16_to_f32(s, o);
        bad |= scale_in_place(o, inv);
    }
    (out, bad)
}

/// `v · inv` in F32, converted chunk by chunk; true when any input is inf or NaN.
pub(crate) fn unscale_bf16(v: &[bf16], inv: f32) -> (Vec<f32>, bool) {
    let mut out = vec![0f32; v.len()];
    let mut bad = false;
    for (o, s) in out.chunks_mut(CHUNK).zip(v.chunks(CHUNK)) {
        convert::bf16_to_f32(s, o);
        bad |= scale_in_place(o, inv);
    }
    (out, bad)
}
