//! The CPU's elementwise maps: plain loops in the compute type, split over the thread pool
//! above `PAR_THRESHOLD` elements.

use rayon::prelude::*;

use super::storage::CpuStorage;
use crate::backend::map::{BinaryOp, MapOps};
use crate::dtype::{DType, FloatDType};
use crate::error::Result;
use crate::tensor::Layout;

/// Below this many elements a loop runs on one thread (rayon's overhead dominates).
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// `out[i] = f(a[i], b[i])`, in parallel for large inputs.
pub(crate) fn zip_map<C: FloatDType>(a: &[C], b: &[C], f: impl Fn(C, C) -> C + Sync) -> Vec<C> {
    debug_assert_eq!(a.len(), b.len());
    if a.len() < PAR_THRESHOLD {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    let mut out = vec![C::zero(); a.len()];
    out.par_chunks_mut(PAR_THRESHOLD)
        .zip(a.par_chunks(PAR_THRESHOLD).zip(b.par_chunks(PAR_THRESHOLD)))
        .for_each(|(o, (x, y))| {
            for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                *o = f(x, y);
            }
        });
    out
}

/// `out[i] = f(a[i])`, in parallel for large inputs.
pub(crate) fn map<C: FloatDType>(a: &[C], f: impl Fn(C) -> C + Sync) -> Vec<C> {
    if a.len() < PAR_THRESHOLD {
        return a.iter().map(|&x| f(x)).collect();
    }
    let mut out = vec![C::zero(); a.len()];
    out.par_chunks_mut(PAR_THRESHOLD)
        .zip(a.par_chunks(PAR_THRESHOLD))
        .for_each(|(o, x)| {
            for (o, &x) in o.iter_mut().zip(x) {
                *o = f(x);
            }
        });
    out
}

/// One binary op on two compute-type values.
pub(crate) fn apply<C: FloatDType>(op: BinaryOp, x: C, y: C) -> C {
    match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Maximum => {
            if x.is_nan() || y.is_nan() {
                C::nan()
            } else if x >= y {
                x
            } else {
                y
            }
        }
        BinaryOp::Minimum => {
            if x.is_nan() || y.is_nan() {
                C::nan()
            } else if x <= y {
                x
            } else {
                y
            }
        }
    }
}

impl MapOps for CpuStorage {
    fn binary(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            let (x, y) = (self.load::<C>(la), rhs.load::<C>(lb));
            CpuStorage::store::<C>(zip_map(&x, &y, |x, y| apply(op, x, y)), out)
        }))
    }
}
