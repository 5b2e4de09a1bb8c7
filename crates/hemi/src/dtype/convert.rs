//! Bulk conversion between F32/F64 and F16/BF16. Placeholder bodies (scalar) until the fast
//! paths land; the signatures are the contract the rest of hemi uses.

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// F32 -> F16, round to nearest-even. `src.len() == dst.len()`.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    dst.convert_from_f32_slice(src);
}
/// F16 -> F32, exact.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    src.convert_to_f32_slice(dst);
}
/// F32 -> BF16, round to nearest-even, NaN stays a quiet NaN.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f32(*s);
    }
}
/// BF16 -> F32, exact.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}
/// F64 -> F16, one rounding (direct, not through F32).
pub fn f64_to_f16(src: &[f64], dst: &mut [f16]) {
    dst.convert_from_f64_slice(src);
}
/// F16 -> F64, exact.
pub fn f16_to_f64(src: &[f16], dst: &mut [f64]) {
    src.convert_to_f64_slice(dst);
}
/// F64 -> BF16, one rounding.
pub fn f64_to_bf16(src: &[f64], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f64(*s);
    }
}
/// BF16 -> F64, exact.
pub fn bf16_to_f64(src: &[bf16], dst: &mut [f64]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f64();
    }
}
