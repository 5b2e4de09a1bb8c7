//! `MapOps` on the CPU: each primitive reads its inputs through their layouts and hands
//! them to the elementwise kernels (`cpu::elementwise::map`): contiguous F32/F16/BF16
//! operands chunk by chunk in F32 (`cpu::chunked`), others in the compute type, each result
//! rounded once into the dtype asked for.

use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::View;
use crate::cpu::chunked::{map1, map2, update2, Src};
use crate::cpu::elementwise::map::{
    binary_chunk, binary_vec, dropout_factors, minmax_grads, unary_backward_chunk,
    unary_backward_vec, unary_chunk, unary_vec, where_grads, where_vec,
};
use crate::cpu::storage::CpuStorage;
use crate::dtype::DType;
use crate::error::Result;
use crate::rng::Generator;
use crate::tensor::Layout;

impl MapOps for CpuStorage {
    fn binary_assign(&mut self, la: &Layout, rhs: &Self, lb: &Layout, op: BinaryOp) -> Result<()> {
        if la.contiguous_range() == Some(0..self.len()) {
            if let Some(b) = Src::of(rhs, lb) {
                if update2(self, b, move |x, y, o| binary_chunk(op, x, y, o)).is_some() {
                    return Ok(());
                }
            }
        }
        *self = self.binary(la, rhs, lb, op, self.dtype())?;
        Ok(())
    }

    fn binary(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Self> {
        // Contiguous F32/F16/BF16 operands of one shape (no broadcast): chunk by chunk in
        // F32, no full-size F32 copies of half operands (the same values: F32, one rounding).
        if let (Some(a), Some(b)) = (Src::of(self, la), Src::of(rhs, lb)) {
            if let Some(y) = map2(a, b, out, move |x, y, o| binary_chunk(op, x, y, o)) {
                return Ok(y);
            }
        }
        Ok(crate::with_compute!(out, C => {
            let (x, y) = (self.load::<C>(la), rhs.load::<C>(lb));
            CpuStorage::store::<C>(binary_vec(op, &x, &y), out)
        }))
    }

    fn minmax_backward(
        &self,
        lg: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        op: BinaryOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        Ok(crate::with_compute!(out, C => {
            let (gv, av, bv) = (self.load::<C>(lg), a.load::<C>(la), b.load::<C>(lb));
            let (wa, wb) = minmax_grads(op, &gv, &av, &bv);
            (CpuStorage::store::<C>(wa, out), CpuStorage::store::<C>(wb, out))
        }))
    }

    fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self> {
        // Contiguous F32/F16/BF16: chunk by chunk in F32, no full-size F32 copies. The
        // variant is matched once per chunk, inside the kernel, so that each arm's loop is
        // compiled for a constant variant (a match outside the closure leaves `op` a
        // captured runtime value and the loop dispatches per element).
        if let Some(src) = Src::of(self, layout) {
            if let Some(y) = map1(src, out, move |a, out| unary_chunk(op, a, out)) {
                return Ok(y);
            }
        }
        Ok(crate::with_compute!(out, C => {
            CpuStorage::store::<C>(unary_vec(op, &self.load::<C>(layout)), out)
        }))
    }

    fn unary_backward(
        &self,
        lg: &Layout,
        saved: &Self,
        ls: &Layout,
        op: UnaryOp,
        out: DType,
    ) -> Result<Self> {
        let uses_out = op.backward_uses_output();
        if let (Some(gv), Some(sv)) = (Src::of(self, lg), Src::of(saved, ls)) {
            let chunked = map2(gv, sv, out, move |g, s, out| {
                unary_backward_chunk(op, uses_out, g, s, out)
            });
            if let Some(gi) = chunked {
                return Ok(gi);
            }
        }
        Ok(crate::with_compute!(out, D => {
            let (gv, sv) = (self.load::<D>(lg), saved.load::<D>(ls));
            CpuStorage::store::<D>(unary_backward_vec(op, uses_out, &gv, &sv), out)
        }))
    }

    fn where_cond(
        &self,
        lc: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        let mask = self.to_f64(lc);
        Ok(crate::with_compute!(out, C => {
            let (av, bv) = (a.load::<C>(la), b.load::<C>(lb));
            CpuStorage::store::<C>(where_vec(&mask, &av, &bv), out)
        }))
    }

    fn where_backward(
        &self,
        lc: &Layout,
        g: &Self,
        lg: &Layout,
        out: DType,
    ) -> Result<(Self, Self)> {
        let mask = self.to_f64(lc);
        Ok(crate::with_compute!(out, D => {
            let (ga, gb) = where_grads(&mask, &g.load::<D>(lg));
            (CpuStorage::store::<D>(ga, out), CpuStorage::store::<D>(gb, out))
        }))
    }

    fn dropout_mask(n: usize, p: f64, rng: &mut Generator, dtype: DType) -> Result<Self> {
        Ok(crate::with_compute!(dtype, C => {
            CpuStorage::store::<C>(dropout_factors::<C>(n, p, rng), dtype)
        }))
    }
}
