//! What becomes of the INT8 GEMM's exact integer sums (`Epilogue`): raw i32, dequantised F32
//! (with bias and an activation, `Act`) or requantised u8, element by element
//! (`dequant_one`, `requant_one`) as the portable kernel stores them, or a tile's rows at a
//! time (`Sink`) as the packed kernels do, with the same bits.

use std::marker::PhantomData;

use super::MAX_NR;
use crate::backend::map::UnaryOp;
use crate::error::{Error, Result};

/// The activation of an F32 epilogue, applied to `y` after the bias: ReLU as `dequant_one`
/// does it, GELU (erf or tanh form) as `Tensor::gelu` / `gelu_tanh` compute it in F32
/// (`UnaryOp::f`), so a fused layer gives the bits of the layer followed by the op.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Act {
    /// `y` as it is.
    #[default]
    None,
    /// `max(y, 0)`.
    Relu,
    /// `0.5 · y · (1 + erf(y / √2))`.
    Gelu,
    /// The tanh approximation of GELU.
    GeluTanh,
}

impl Act {
    /// GELU of either form applied to `y` (identity for `None` and `Relu`, which
    /// `dequant_one` applies).
    #[inline(always)]
    fn after(self, y: f32) -> f32 {
        match self {
            Act::Gelu => UnaryOp::Gelu.f(y),
            Act::GeluTanh => UnaryOp::GeluTanh.f(y),
            Act::None | Act::Relu => y,
        }
    }
}

/// What happens to the exact integer sums `acc[i, j] = Σ_k A[i, k] · W[j, k]`.
///
/// With `c = acc[i, j] - a_zero[i] · colsum[j]` (i32, exact), every kernel computes, in this
/// order and without fused multiply-adds (so all kernels give the same bits):
/// `y = (c as f32) * (a_scale[i] * w_scale[j])`, then `y = y + bias[j]`, then
/// `y = max(y, 0)` with `relu` (F32: `act`; GELU there follows the same `y`).
pub enum Epilogue<'a> {
    /// The raw sums, row-major `[m, n]`, no zero-point correction.
    I32 {
        /// `m · n` outputs.
        out: &'a mut [i32],
    },
    /// Dequantised F32 outputs, row-major `[m, n]`.
    F32 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// The activation after the bias.
        act: Act,
        /// `m · n` outputs.
        out: &'a mut [f32],
    },
    /// Requantised u8 outputs, row-major `[m, n]`: `y` as for `F32`, then
    /// `q = clamp(round_ties_even(y * (1 / out_scale)) + out_zero, 0, 255)` (with `relu`,
    /// `y` was clamped at 0 first, so `q ≥ out_zero`).
    U8 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// Apply ReLU.
        relu: bool,
        /// Scale of the output.
        out_scale: f32,
        /// Zero point of the output, in 0..=255.
        out_zero: i32,
        /// `m · n` outputs.
        out: &'a mut [u8],
    },
}

impl Epilogue<'_> {
    pub(super) fn check(&self, m: usize, n: usize) -> Result<()> {
        let bad = |what: &str| Err(Error::shape("qgemm epilogue", what.to_string()));
        match self {
            Epilogue::I32 { out } => {
                if out.len() != m * n {
                    return bad("out length != m·n");
                }
            }
            Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("F32 epilogue lengths");
                }
            }
            Epilogue::U8 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("U8 epilogue lengths");
                }
            }
        }
        Ok(())
    }
}

/// The F32 value of the epilogue for one element (the definition every kernel follows).
#[inline(always)]
pub fn dequant_one(
    acc: i32,
    a_zero: i32,
    col_sum: i32,
    a_scale: f32,
    w_scale: f32,
    bias: f32,
    relu: bool,
) -> f32 {
    let c = acc.wrapping_sub(a_zero.wrapping_mul(col_sum));
    let y = (c as f32) * (a_scale * w_scale) + bias;
    if relu {
        y.max(0.0)
    } else {
        y
    }
}

/// The u8 value of the requantising epilogue for one F32 value `y`.
#[inline(always)]
pub fn requant_one(y: f32, inv_out_scale: f32, out_zero: i32) -> u8 {
    let q = (y * inv_out_scale).round_ties_even() + out_zero as f32;
    q.clamp(0.0, 255.0) as u8
}

#[inline(always)]
pub(super) fn store(epi: &mut Epilogue<'_>, i: usize, j: usize, n: usize, acc: i32, col_sum: i32) {
    match epi {
        Epilogue::I32 { out } => out[i * n + j] = acc,
        Epilogue::F32 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            act,
            out,
        } => {
            out[i * n + j] = act.after(dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *act == Act::Relu,
            ))
        }
        Epilogue::U8 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            relu,
            out_scale,
            out_zero,
            out,
        } => {
            let y = dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *relu,
            );
            out[i * n + j] = requant_one(y, 1.0 / *out_scale, *out_zero);
        }
    }
}

/// The epilogue with its output as a raw pointer, so that tasks on several threads can write
/// their own tiles of it.
pub(super) struct Sink<'a> {
    out: Out,
    n: usize,
    col_sums: &'a [i32],
    a_scale: &'a [f32],
    a_zero: &'a [i32],
    w_scale: &'a [f32],
    bias: Option<&'a [f32]>,
    relu: bool,
    /// GELU after the dequantisation (F32 outputs).
    act: Act,
    inv_out_scale: f32,
    out_zero: i32,
    _out: PhantomData<&'a mut [u8]>,
}

#[derive(Clone, Copy)]
enum Out {
    I32(*mut i32),
    F32(*mut f32),
    U8(*mut u8),
}

// SAFETY: `qgemm` holds the epilogue's `&mut` output for the whole product, and its tasks
// write disjoint rectangles of it (`split`), each from one thread only.
unsafe impl Send for Sink<'_> {}
// SAFETY: as above.
unsafe impl Sync for Sink<'_> {}

impl<'a> Sink<'a> {
    /// `epi` after `Epilogue::check(m, n)` passed.
    pub(super) fn new(epi: Epilogue<'a>, col_sums: &'a [i32], n: usize) -> Sink<'a> {
        let mut sink = Sink {
            out: Out::I32(std::ptr::null_mut()),
            n,
            col_sums,
            a_scale: &[],
            a_zero: &[],
            w_scale: &[],
            bias: None,
            relu: false,
            act: Act::None,
            inv_out_scale: 1.0,
            out_zero: 0,
            _out: PhantomData,
        };
        match epi {
            Epilogue::I32 { out } => sink.out = Out::I32(out.as_mut_ptr()),
            Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                act,
                out,
            } => {
                sink = Sink {
                    out: Out::F32(out.as_mut_ptr()),
                    a_scale,
                    a_zero,
                    w_scale,
                    bias,
                    relu: act == Act::Relu,
                    act,
                    ..sink
                }
            }
            Epilogue::U8 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                relu,
                out_scale,
                out_zero,
                out,
            } => {
                sink = Sink {
                    out: Out::U8(out.as_mut_ptr()),
                    a_scale,
                    a_zero,
                    w_scale,
                    bias,
                    relu,
                    inv_out_scale: 1.0 / out_scale,
                    out_zero,
                    ..sink
                }
            }
        }
        sink
    }

    /// Writes rows `i0..i0 + h`, columns `j0..j0 + w` of the output from a tile's sums
    /// (row r at `acc[r · ld..]`), through `dequant_one` / `requant_one` element by element
    /// exactly as `store` does (inlined into each kernel, so it vectorises with its features).
    ///
    /// # Safety
    /// No other thread writes this rectangle, which lies inside the `[m, n]` output.
    #[inline(always)]
    pub(super) unsafe fn write(
        &self,
        i0: usize,
        j0: usize,
        h: usize,
        w: usize,
        acc: &[i32],
        ld: usize,
    ) {
        let cols = j0..j0 + w;
        let cs = &self.col_sums[cols.clone()];
        let mut row_f32 = [0f32; MAX_NR];
        for r in 0..h {
            let i = i0 + r;
            let acc = &acc[r * ld..][..w];
            let at = i * self.n + j0;
            // SAFETY: the caller's rectangle; `Epilogue::check` saw m·n outputs.
            let out_f32 = match self.out {
                Out::I32(p) => {
                    unsafe { std::slice::from_raw_parts_mut(p.add(at), w) }.copy_from_slice(acc);
                    continue;
                }
                // SAFETY: as above.
                Out::F32(p) => unsafe { std::slice::from_raw_parts_mut(p.add(at), w) },
                Out::U8(_) => &mut row_f32[..w],
            };
            let (az, sc) = (self.a_zero[i], self.a_scale[i]);
            let ws = &self.w_scale[cols.clone()];
            let bias = self.bias.map(|b| &b[cols.clone()]);
            if self.relu {
                dequant_row::<true>(acc, cs, az, sc, ws, bias, out_f32);
            } else {
                dequant_row::<false>(acc, cs, az, sc, ws, bias, out_f32);
            }
            if matches!(self.act, Act::Gelu | Act::GeluTanh) {
                out_f32.iter_mut().for_each(|y| *y = self.act.after(*y));
            }
            if let Out::U8(p) = self.out {
                // SAFETY: as above.
                let out = unsafe { std::slice::from_raw_parts_mut(p.add(at), w) };
                for (q, &y) in out.iter_mut().zip(&row_f32[..w]) {
                    *q = requant_one(y, self.inv_out_scale, self.out_zero);
                }
            }
        }
    }
}

/// `dequant_one` over one row of a tile.
#[inline(always)]
fn dequant_row<const RELU: bool>(
    acc: &[i32],
    col_sums: &[i32],
    a_zero: i32,
    a_scale: f32,
    w_scale: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let it = out.iter_mut().zip(acc).zip(col_sums).zip(w_scale);
    match bias {
        Some(bias) => {
            for ((((y, &x), &cs), &ws), &b) in it.zip(bias) {
                *y = dequant_one(x, a_zero, cs, a_scale, ws, b, RELU);
            }
        }
        None => {
            for (((y, &x), &cs), &ws) in it {
                *y = dequant_one(x, a_zero, cs, a_scale, ws, 0.0, RELU);
            }
        }
    }
}
