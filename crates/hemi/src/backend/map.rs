//! Elementwise primitives: unary and binary maps (with broadcasting through the layouts),
//! maps with a scalar, `where`, and random fills.

use super::BackendStorage;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::storage::{dispatch2, wrap};
use crate::tensor::{Layout, Storage};

/// The binary maps. `Maximum`/`Minimum` propagate NaN, as `torch.maximum`/`minimum`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

pub trait MapOps: BackendStorage {
    /// `out[i] = op(a[i], b[i])` for the elements the two layouts address (both of the
    /// output's shape; broadcasting is a layout with zero strides), computed in the compute
    /// type of `out` (F32, F64 for F64) and rounded once into `out`.
    fn binary(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Self>;
}

impl Storage {
    /// `MapOps::binary` on this storage's backend; `rhs` must be on the same device.
    pub fn binary(
        &self,
        la: &Layout,
        rhs: &Storage,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Storage> {
        Ok(dispatch2!(op.name(), self, rhs, a, b => wrap!(self, a.binary(la, b, lb, op, out)?)))
    }
}
