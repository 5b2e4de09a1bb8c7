//! Rounding F32 values into a half-precision dtype: to nearest-even (the precision
//! contract's default) or stochastically (llm.c's and pure-BF16 training's write-back of F32
//! master values into low-precision weights).
//!
//! Why stochastic rounding: an update smaller than half an ulp of the weight is lost every
//! time under nearest-even (a BF16 weight of 1.0 ignores every increment below 2^-9), so a
//! model trained without F32 masters stalls. Rounding up with probability equal to the
//! distance already covered keeps the expected weight equal to the F32 value, so small
//! updates survive on average.

use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// How an F32 value becomes a lower-precision one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest, ties to even (IEEE 754's default; deterministic).
    #[default]
    NearestEven,
    /// Round to one of the two neighbouring representable values, up with probability
    /// `(x - down) / (up - down)`: unbiased, `E[round(x)] = x`.
    Stochastic,
}

/// Rounds F32 `values` (row-major, `shape`) into a new contiguous tensor of `dtype`.
///
/// F16 and BF16 round as `rounding` says; F32 is a copy and F64 an exact widening (there is
/// nothing to round). Under both roundings: representable values stay exact, NaN stays NaN,
/// ±inf stays ±inf, and a finite value beyond the dtype's largest finite value rounds as
/// nearest-even does (to the maximum or to inf), because there is no finite neighbour above
/// it to choose. `rng` is only drawn from for stochastic rounding into F16/BF16 (one
/// `next_u64` per F16 element, one per four BF16 elements).
pub fn round_f32_into(
    values: &[f32],
    shape: &[usize],
    dtype: DType,
    rounding: Rounding,
    rng: &mut Generator,
) -> Result<Tensor> {
    const OP: &str = "round_f32_into";
    let n: usize = shape.iter().product();
    if n != values.len() {
        return Err(Error::shape(
            OP,
            format!("{} values do not fill shape {shape:?}", values.len()),
        ));
    }
    match (dtype, rounding) {
        (DType::I64, _) => Err(Error::dtype(OP, dtype, "rounds into float dtypes only")),
        (DType::F32 | DType::F64, _) | (_, Rounding::NearestEven) => {
            Tensor::from_f32_vec(values.to_vec(), shape, dtype)
        }
        (DType::F16, Rounding::Stochastic) => {
            let out: Vec<f16> = values
                .iter()
                .map(|&x| stochastic_round_f16(x, rng.next_u64()))
                .collect();
            Tensor::from_vec(out, shape)
        }
        (DType::BF16, Rounding::Stochastic) => {
            let mut out = Vec::with_capacity(values.len());
            for chunk in values.chunks(4) {
                let mut bits = rng.next_u64();
                for &x in chunk {
                    out.push(stochastic_round_bf16(x, bits as u16));
                    bits >>= 16;
                }
            }
            Tensor::from_vec(out, shape)
        }
    }
}

/// Stochastic rounding of one F32 value into F16, driven by 64 random bits.
///
/// F16's spacing changes with the exponent and is uniform (2^-24) through the subnormal
/// range, so this works with the two neighbours themselves rather than a bit trick: `down`
/// is `|x|` truncated toward zero to F16, `up` the next F16 above it, and the value rounds up
/// when a uniform `u` in [0, 1) (53 bits from `bits`) is below `p = (|x| - down) / (up -
/// down)`. Both differences are exact in f64 and `up - down` is a power of two, so `p` is
/// exact and P(up) = p to within 2^-53. Values below the smallest subnormal (2^-24) round to
/// 0 or 2^-24. The sign is put back at the end, so negative values are symmetric.
pub fn stochastic_round_f16(x: f32, bits: u64) -> f16 {
    let a = x.abs();
    // NaN, inf and finite values beyond the largest F16 round as nearest-even does.
    if a.is_nan() || a > f16::MAX.to_f32() {
        return f16::from_f32(x);
    }
    let nearest = f16::from_f32(a);
    let down = if nearest.to_f32() > a {
        f16::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    let lo = f64::from(down.to_f32());
    let a64 = f64::from(a);
    let mag = if a64 == lo {
        down
    } else {
        // down < a <= MAX, so down < MAX and its successor is finite.
        let up = f16::from_bits(down.to_bits() + 1);
        let p = (a64 - lo) / (f64::from(up.to_f32()) - lo);
        let u = (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        if u < p {
            up
        } else {
            down
        }
    };
    if x.is_sign_negative() {
        -mag
    } else {
        mag
    }
}

/// Stochastic rounding of one F32 value into BF16, driven by 16 random bits.
///
/// BF16 is the top half of an F32, so the classic trick is exact: add 16 random bits to the
/// F32 bit pattern and drop the low 16 bits. The sum carries into the kept half with
/// probability (low 16 bits) / 2^16, which is exactly `(|x| - down) / (up - down)` because
/// the magnitude bits of a float are linear in its value between two neighbours (also across
/// the subnormal range and into the next binade, where a carry lands on the power of two).
/// Adding to the magnitude rounds away from zero for either sign, so negatives are symmetric.
/// A representable value has zero low bits and never carries. NaN, inf and values beyond the
/// largest finite BF16 round to nearest-even (for those, the carry would produce inf or
/// disturb the NaN payload).
pub fn stochastic_round_bf16(x: f32, bits: u16) -> bf16 {
    if x.is_nan() || x.abs() > bf16::MAX.to_f32() {
        return bf16::from_f32(x);
    }
    let b = x.to_bits().wrapping_add(u32::from(bits));
    bf16::from_bits((b >> 16) as u16)
}
