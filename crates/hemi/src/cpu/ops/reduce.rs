//! `ReduceOps` on the CPU: each primitive reads its inputs in the compute type and hands
//! them to the reductions (`cpu::reduce`), each result rounded once into the dtype asked for.

use crate::backend::nn::View;
use crate::backend::reduce::{ReduceOp, ReduceOps, Rows};
use crate::cpu::reduce::{
    extreme_grads, extreme_rows, extreme_rows_grads, reduce_as, softmax_backward_rows,
    softmax_rows, var_grads,
};
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Layout;

impl ReduceOps for CpuStorage {
    fn reduce(
        &self,
        layout: &Layout,
        outer: usize,
        inner: usize,
        op: ReduceOp,
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            CpuStorage::store::<C>(reduce_as::<C>(self, layout, outer, inner, op), out)
        }))
    }

    fn extreme_backward(
        &self,
        layout: &Layout,
        (m, lm): View<'_, Self>,
        (g, lg): View<'_, Self>,
        (outer, inner): (usize, usize),
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, D => {
            let (xv, mv, gv) = (self.load::<D>(layout), m.load::<D>(lm), g.load::<D>(lg));
            CpuStorage::store::<D>(extreme_grads(&xv, &mv, &gv, outer, inner), out)
        }))
    }

    fn var_backward(
        &self,
        layout: &Layout,
        (g, lg): View<'_, Self>,
        (outer, inner): (usize, usize),
        correction: usize,
        out: DType,
    ) -> Result<Self> {
        let divisor = inner.saturating_sub(correction) as f64;
        Ok(crate::with_compute!(out, C => {
            let (xv, gv) = (self.load::<C>(layout), g.load::<C>(lg));
            CpuStorage::store::<C>(var_grads(&xv, &gv, outer, inner, divisor), out)
        }))
    }

    fn extreme_dim(
        &self,
        layout: &Layout,
        rows: Rows,
        op: ReduceOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            let (values, index) = extreme_rows(rows, &self.load::<C>(layout), op);
            (CpuStorage::store::<C>(values, out), CpuStorage::from_vec(index))
        }))
    }

    fn extreme_dim_backward(
        &self,
        lg: &Layout,
        index: &Self,
        li: &Layout,
        rows: Rows,
        out: DType,
    ) -> Result<Self> {
        let at = index.to_i64(li);
        Ok(crate::with_compute!(out, D => {
            CpuStorage::store::<D>(extreme_rows_grads(rows, &self.load::<D>(lg), &at), out)
        }))
    }

    fn softmax(&self, layout: &Layout, rows: Rows, log: bool, out: DType) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            CpuStorage::store::<C>(softmax_rows(rows, &self.load::<C>(layout), log), out)
        }))
    }

    fn softmax_backward(
        &self,
        lg: &Layout,
        y: &Self,
        ly: &Layout,
        rows: Rows,
        log: bool,
        out: DType,
    ) -> Result<Self> {
        Ok(crate::with_compute!(out, C => {
            let (gv, yv) = (self.load::<C>(lg), y.load::<C>(ly));
            CpuStorage::store::<C>(softmax_backward_rows(rows, &gv, &yv, log), out)
        }))
    }
}
