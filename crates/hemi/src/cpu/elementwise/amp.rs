//! The CPU's loss-scaler kernel: unscale a gradient and note inf/NaN in one pass.

use crate::backend::train::{AmpOps, Log2Histogram};
use crate::cpu::storage::CpuStorage;
use crate::dtype::convert::{self, stochastic_round_bf16, stochastic_round_f16, Rounding};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Layout;

/// Elements converted and scaled per chunk: the F16/BF16 -> F32 conversion of a chunk is
/// still in L1 when the multiply-and-check loop reads it (16 KiB of F32).
const CHUNK: usize = 4096;

/// `x *= inv` over `o`; true when any input is inf or NaN.
fn scale_in_place(o: &mut [f32], inv: f32) -> bool {
    let mut bad = false;
    for x in o.iter_mut() {
        bad |= !x.is_finite();
        *x *= inv;
    }
    bad
}

impl AmpOps for CpuStorage {
    fn range_counts(&self, layout: &Layout, tiny: f64, max: f64) -> Result<(u64, u64)> {
        let (tiny, max) = (tiny as f32, max as f32);
        let (mut under, mut over) = (0u64, 0u64);
        for &g in self.to_f32(layout).iter() {
            let a = g.abs();
            if a > max || a.is_nan() {
                over += 1;
            } else if a < tiny && a != 0.0 {
                under += 1;
            }
        }
        Ok((under, over))
    }

    fn log2_histogram(&self, layout: &Layout) -> Result<Log2Histogram> {
        if self.dtype() == DType::I64 {
            return Err(Error::dtype(
                "log2_histogram",
                DType::I64,
                "histograms of float tensors only",
            ));
        }
        let mut h = Log2Histogram::default();
        for &x in self.to_f32(layout).iter() {
            h.add(x);
        }
        Ok(h)
    }

    fn norm_partial(&self, layout: &Layout, p: f64) -> Result<f64> {
        if self.dtype() == DType::I64 {
            return Err(Error::dtype(
                "norm",
                DType::I64,
                "norms of float tensors only",
            ));
        }
        let v = self.to_f64(layout);
        Ok(if p == f64::INFINITY {
            let mut m = 0.0f64;
            for &x in v.iter() {
                let a = x.abs();
                if a.is_nan() {
                    return Ok(f64::NAN);
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
        })
    }

    fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Self> {
        let values = self.to_f32(layout);
        Ok(match (dtype, rounding) {
            (DType::I64, _) => {
                return Err(Error::dtype(
                    "round_into",
                    dtype,
                    "rounds into float dtypes only",
                ))
            }
            (DType::F32 | DType::F64, _) | (_, Rounding::NearestEven) => {
                CpuStorage::from_f32(values.into_owned(), dtype)
            }
            (DType::F16, Rounding::Stochastic) => CpuStorage::F16(
                values
                    .iter()
                    .map(|&x| stochastic_round_f16(x, rng.next_u64()))
                    .collect(),
            ),
            (DType::BF16, Rounding::Stochastic) => {
                let mut out = Vec::with_capacity(values.len());
                for chunk in values.chunks(4) {
                    let mut bits = rng.next_u64();
                    for &x in chunk {
                        out.push(stochastic_round_bf16(x, bits as u16));
                        bits >>= 16;
                    }
                }
                CpuStorage::BF16(out)
            }
        })
    }

    fn unscale_check(&self, layout: &Layout, inv: f32, found_inf: &mut Self) -> Result<Self> {
        let flag = match found_inf {
            CpuStorage::F32(f) if f.len() == 1 => &mut f[0],
            f => {
                return Err(Error::arg(
                    "unscale_check",
                    format!(
                        "found_inf must be one F32 value, got {} {}",
                        f.len(),
                        f.dtype()
                    ),
                ))
            }
        };
        let (out, bad) = match (self, layout.contiguous_range()) {
            (CpuStorage::F64(_), _) => {
                let inv = f64::from(inv);
                let mut v = self.to_f64(layout).into_owned();
                let mut bad = false;
                for x in v.iter_mut() {
                    bad |= !x.is_finite();
                    *x *= inv;
                }
                (CpuStorage::F64(v), bad)
            }
            (CpuStorage::F32(v), Some(r)) => {
                let mut bad = false;
                let out = v[r]
                    .iter()
                    .map(|&x| {
                        bad |= !x.is_finite();
                        x * inv
                    })
                    .collect();
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::F16(v), Some(r)) => {
                let mut out = vec![0f32; r.len()];
                let mut bad = false;
                for (o, s) in out.chunks_mut(CHUNK).zip(v[r].chunks(CHUNK)) {
                    convert::f16_to_f32(s, o);
                    bad |= scale_in_place(o, inv);
                }
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::BF16(v), Some(r)) => {
                let mut out = vec![0f32; r.len()];
                let mut bad = false;
                for (o, s) in out.chunks_mut(CHUNK).zip(v[r].chunks(CHUNK)) {
                    convert::bf16_to_f32(s, o);
                    bad |= scale_in_place(o, inv);
                }
                (CpuStorage::F32(out), bad)
            }
            (CpuStorage::I64(_), _) => {
                return Err(Error::dtype(
                    "unscale_check",
                    DType::I64,
                    "gradients are float tensors",
                ))
            }
            _ => {
                // A strided gradient (rare: autograd makes contiguous ones): gather, then scale.
                let mut out = self.to_f32(layout).into_owned();
                let bad = scale_in_place(&mut out, inv);
                (CpuStorage::F32(out), bad)
            }
        };
        if bad {
            *flag = 1.0;
        }
        Ok(out)
    }
}
