//! INT8 element loops on host buffers: affine quantisation and dequantisation (PyTorch's
//! `quantize_per_tensor` arithmetic), the qparams of a range, and the u8 im2col of the
//! quantised convolution. `quant` calls these; the INT8 GEMM is `cpu::qgemm`.

use crate::backend::nn::Conv2dGeom;

/// `q = clamp(zero_point + round_ties_even(x · (1 / scale)), qmin, qmax)`, PyTorch's
/// CPU quantisation (`inv_scale = 1.0f / scale`, `nearbyint`); ±inf saturate, NaN becomes
/// the zero point (PyTorch's result for NaN is unspecified).
///
/// Branch-free so that the loops below vectorise: the product is clamped to one step
/// beyond the representable codes first (which changes no result: anything past the
/// range saturates either way), so that |t| ≤ 512 and `(t + 1.5·2²³) - 1.5·2²³` is
/// `round_ties_even(t)` (in [2²³, 2²⁴) the F32 spacing is 1, and the addition rounds to
/// nearest even). No libm call, no SSE4.1 `roundps` needed.
#[inline(always)]
pub fn quantize_one(x: f32, inv_scale: f32, zero_point: i32, qmin: i32, qmax: i32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³
    let lo = (qmin - zero_point) as f32 - 1.0;
    let hi = (qmax - zero_point) as f32 + 1.0;
    let t = x * inv_scale;
    // NaN fails both comparisons and lands on 0 (the zero point).
    let t = if t >= lo {
        t
    } else if t < lo {
        lo
    } else {
        0.0
    };
    let t = if t <= hi { t } else { hi };
    let r = (t + MAGIC) - MAGIC;
    // SAFETY: `t` was clamped to [lo, hi] ⊂ [-512, 512] with NaN mapped to 0, so `r` is a
    // finite integer in i32's range. (`as i32` would add a per-lane NaN/overflow check
    // that stops the loop from vectorising.)
    let r: i32 = unsafe { r.to_int_unchecked() };
    (r + zero_point).clamp(qmin, qmax)
}

/// Runs `$body` (a loop) compiled for AVX-512 or AVX2 when the CPU has them: the same IEEE
/// operations in wider registers, so the results are the plain loop's bit for bit.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw")]
                unsafe fn wide512($($arg: $ty),*) $body
                #[target_feature(enable = "avx2")]
                unsafe fn wide256($($arg: $ty),*) $body
                if cpu_has!(Avx512bw) {
                    // SAFETY: the features were detected just above.
                    return unsafe { wide512($($arg),*) };
                }
                if cpu_has!(Avx2) {
                    // SAFETY: as above.
                    return unsafe { wide256($($arg),*) };
                }
            }
            $body
        }
    };
}

multiversion! {
    fn quantize_u8_into(x: &[f32], inv: f32, zero_point: i32, out: &mut [u8]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = quantize_one(v, inv, zero_point, 0, 255) as u8;
        }
    }
}

multiversion! {
    fn quantize_i8_into(x: &[f32], inv: f32, zero_point: i32, out: &mut [i8]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = quantize_one(v, inv, zero_point, -128, 127) as i8;
        }
    }
}

/// Quantises `x` to u8 with one scale and zero point.
pub fn quantize_u8(x: &[f32], scale: f32, zero_point: i32, out: &mut [u8]) {
    quantize_u8_into(x, 1.0 / scale, zero_point, out)
}

/// Quantises `x` to i8 with one scale and zero point.
pub fn quantize_i8(x: &[f32], scale: f32, zero_point: i32, out: &mut [i8]) {
    quantize_i8_into(x, 1.0 / scale, zero_point, out)
}

multiversion! {
    /// `(q - zero_point) · scale` for u8 values.
    pub fn dequantize_u8(q: &[u8], scale: f32, zero_point: i32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(q) {
            *o = (v as i32 - zero_point) as f32 * scale;
        }
    }
}

multiversion! {
    /// `(q - zero_point) · scale` for i8 values.
    pub fn dequantize_i8(q: &[i8], scale: f32, zero_point: i32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(q) {
            *o = (v as i32 - zero_point) as f32 * scale;
        }
    }
}

/// Lanes of the min/max accumulators: independent, so the loop vectorises.
const LANES: usize = 16;

multiversion! {
    fn min_max_lanes(x: &[f32], acc: &mut [[f32; LANES]; 2]) {
        let [lo, hi] = acc;
        for c in x.chunks_exact(LANES) {
            for i in 0..LANES {
                // NaN fails both comparisons: skipped.
                lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
                hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
            }
        }
    }
}

/// Smallest and largest values of `x` (NaN skipped); `(0, 0)` when there are none.
pub fn min_max(x: &[f32]) -> (f32, f32) {
    let mut acc = [[f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]];
    min_max_lanes(x, &mut acc);
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    let tail = &x[x.len() / LANES * LANES..];
    for &v in acc[0].iter().chain(tail) {
        if v < lo {
            lo = v;
        }
    }
    for &v in acc[1].iter().chain(tail) {
        if v > hi {
            hi = v;
        }
    }
    if lo > hi {
        (0.0, 0.0)
    } else {
        (lo, hi)
    }
}

/// Affine (scale, zero point) covering `[lo, hi]` (widened to hold 0) in `qmin..=qmax`,
/// PyTorch's `_ObserverBase._calculate_qparams` for `per_tensor_affine`: `scale = (hi - lo)
/// / (qmax - qmin)` at least `f32::EPSILON`, `zero_point = qmin - round(lo / scale)`
/// clamped to the range.
pub fn affine_qparams(lo: f32, hi: f32, qmin: i32, qmax: i32) -> (f32, i32) {
    let lo = lo.min(0.0);
    let hi = hi.max(0.0);
    let scale = ((hi - lo) / (qmax - qmin) as f32).max(f32::EPSILON);
    let zp = qmin as f32 - (lo / scale).round_ties_even();
    let zp = if zp.is_finite() {
        zp as i64
    } else {
        qmin as i64
    };
    (scale, zp.clamp(qmin as i64, qmax as i64) as i32)
}

/// Symmetric scale for `[lo, hi]` in `qmin..=qmax` with zero point 0 (signed) — PyTorch's
/// `per_channel_symmetric` / `per_tensor_symmetric` for qint8: `max(-lo, hi) / ((qmax -
/// qmin) / 2)`, at least `f32::EPSILON`.
pub fn symmetric_scale(lo: f32, hi: f32, qmin: i32, qmax: i32) -> f32 {
    let m = (-lo.min(0.0)).max(hi.max(0.0));
    (m / ((qmax - qmin) as f32 / 2.0)).max(f32::EPSILON)
}

/// One row per output pixel (`n · h_out · w_out` rows of `g.k()` in the weight's
/// `[c][kh][kw]` order, pixel order n, oh, ow) of the contiguous u8 input `x`
/// `[n, c_in, h, w]` of a dense (groups 1) convolution; taps outside the input take `pad`
/// (the zero point, which stands for 0). The row-per-pixel transpose of `cpu::conv`'s
/// im2col, which the u8 × s8 GEMM takes as its A.
pub fn im2col_rows(x: &[u8], pad: u8, g: &Conv2dGeom, out: &mut [u8]) {
    let (h, w) = (g.h, g.w);
    let row = g.k();
    let mut r = 0;
    for b in 0..g.n {
        for oy in 0..g.h_out {
            for ox in 0..g.w_out {
                let dst = &mut out[r * row..(r + 1) * row];
                let mut t = 0;
                for ch in 0..g.c_in {
                    let plane = &x[(b * g.c_in + ch) * h * w..(b * g.c_in + ch + 1) * h * w];
                    for ky in 0..g.kh {
                        let iy =
                            (oy * g.stride.0 + ky * g.dilation.0) as isize - g.padding.0 as isize;
                        for kx in 0..g.kw {
                            let ix = (ox * g.stride.1 + kx * g.dilation.1) as isize
                                - g.padding.1 as isize;
                            dst[t] = if iy >= 0 && (iy as usize) < h && ix >= 0 && (ix as usize) < w
                            {
                                plane[iy as usize * w + ix as usize]
                            } else {
                                pad
                            };
                            t += 1;
                        }
                    }
                }
                r += 1;
            }
        }
    }
}

/// `[n·p, oc]` (pixel-major GEMM output) to `[n, oc, p]` (NCHW).
pub fn pixels_to_nchw(y: &[f32], n: usize, p: usize, oc: usize, out: &mut [f32]) {
    for b in 0..n {
        for px in 0..p {
            let src = &y[(b * p + px) * oc..(b * p + px + 1) * oc];
            for (ch, &v) in src.iter().enumerate() {
                out[(b * oc + ch) * p + px] = v;
            }
        }
    }
}

/// Fake quantisation (quantise then dequantise) of `x` per tensor, in place.
pub fn fake_quantize(x: &mut [f32], scale: f32, zero_point: i32, qmin: i32, qmax: i32) {
    let inv = 1.0 / scale;
    for v in x.iter_mut() {
        *v = (quantize_one(*v, inv, zero_point, qmin, qmax) - zero_point) as f32 * scale;
    }
}
