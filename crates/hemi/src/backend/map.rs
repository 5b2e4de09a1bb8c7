//! Elementwise primitives: unary and binary maps (with broadcasting through the layouts),
//! maps with a scalar, `where`, and random fills.

use super::declare::primitives;
use crate::dtype::DType;
use crate::error::Result;
use crate::rng::Generator;
use crate::tensor::storage::{dispatch, wrap};
use crate::tensor::{Layout, Storage};

/// The binary maps. `Maximum`/`Minimum` propagate NaN, as `torch.maximum`/`minimum`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (IEEE: division by zero gives ±inf or NaN).
    Div,
    /// Elementwise maximum (`torch.maximum`).
    Maximum,
    /// Elementwise minimum (`torch.minimum`).
    Minimum,
}

impl BinaryOp {
    /// The op's name as PyTorch spells it (`"add"`, `"maximum"`, ...), used in errors and
    /// by the autocast table.
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

/// The unary maths and activations, and the maps with a scalar. Each backend evaluates
/// the function and its derivative in the compute type (F32, F64 for F64).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `e^x`.
    Exp,
    /// Natural logarithm (`-inf` at 0, NaN below).
    Log,
    /// Square root (NaN below 0).
    Sqrt,
    /// `|x|`.
    Abs,
    /// `max(x, 0)`; NaN stays NaN.
    Relu,
    /// GELU, exact form: x * Φ(x).
    Gelu,
    /// GELU, tanh approximation: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))).
    GeluTanh,
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
    /// x ^ p (`x * x` for p = 2)
    PowScalar(f64),
    /// `min(max(x, lo), hi)` (`torch.clamp`); NaN stays NaN.
    Clamp(f64, f64),
}

impl UnaryOp {
    /// The op's name as PyTorch spells it (`"exp"`, `"gelu_tanh"`, `"clamp"`, ...), used in
    /// errors and by the autocast table.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Abs => "abs",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::AddScalar(_) => "add_scalar",
            UnaryOp::MulScalar(_) => "mul_scalar",
            UnaryOp::PowScalar(_) => "pow_scalar",
            UnaryOp::Clamp(..) => "clamp",
        }
    }

    /// True when the derivative is written in terms of the output `y` (exp, sqrt, sigmoid,
    /// tanh), so the backward saves the output; the others save the input `x`.
    pub fn backward_uses_output(self) -> bool {
        matches!(
            self,
            UnaryOp::Exp | UnaryOp::Sqrt | UnaryOp::Sigmoid | UnaryOp::Tanh
        )
    }
}

primitives! {
    /// The elementwise primitives a backend implements: binary maps with broadcasting through
    /// the layouts, unary maps and activations with their backward, `where`, and the random
    /// fills. `Storage` has a dispatching method of the same name for each.
    pub trait MapOps {
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

        /// `self = op(self, rhs)` in place, where `la` addresses all of `self` contiguously
        /// and `lb` the rhs elements of the same shape: the values and dtype `binary(la, rhs,
        /// lb, op, self.dtype())` gives, written over `self` (a gradient accumulated without a
        /// third buffer). The default computes `binary` and replaces the buffer.
        fn binary_assign(&mut self, la: &Layout, rhs: &Self, lb: &Layout, op: BinaryOp) -> Result<()> {
            *self = self.binary(la, rhs, lb, op, self.dtype())?;
            Ok(())
        }

        /// The gradients of `maximum`/`minimum` (`op`) for `self = g`, the output's gradient:
        /// `(g·w, g·(1-w))` with `w` 1 where `a` wins, 0 where `b` wins and 1/2 on ties, all
        /// three layouts of the output's shape (the inputs broadcast by their layouts). Computed
        /// in the compute type of `out`, both results contiguous in `out`. The caller checked
        /// that `op` is `Maximum` or `Minimum`.
        #[allow(clippy::too_many_arguments)]
        fn minmax_backward(
            &self,
            lg: &Layout,
            a: &Self,
            la: &Layout,
            b: &Self,
            lb: &Layout,
            op: BinaryOp,
            out: DType,
        ) -> Result<(Self, Self)>;

        /// `out[i] = op(x[i])` for the elements `layout` addresses, in the compute type of
        /// `out`, rounded once. The caller checked that the input is a float tensor.
        fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self>;

        /// The input gradient of `op` with `self = g` (the output's gradient): `g · op'(x)`,
        /// where `saved` holds the output `y` when `op.backward_uses_output()` and the input `x`
        /// otherwise (same shape as `g`). Computed in the compute type of `out`, rounded once.
        fn unary_backward(
            &self,
            lg: &Layout,
            saved: &Self,
            ls: &Layout,
            op: UnaryOp,
            out: DType,
        ) -> Result<Self>;

        /// `cond ? a : b` with `self = cond` (any dtype; true where nonzero, NaN included); the
        /// three layouts have the output's shape (broadcasting by zero strides). `a` and `b`
        /// are read in the compute type of `out` and the chosen value rounded into `out`.
        #[allow(clippy::too_many_arguments)]
        fn where_cond(
            &self,
            lc: &Layout,
            a: &Self,
            la: &Layout,
            b: &Self,
            lb: &Layout,
            out: DType,
        ) -> Result<Self>;

        /// The gradients of `where_cond` with `self = cond`: `(cond ? g : 0, cond ? 0 : g)`,
        /// both of `g`'s shape (the layouts have it), contiguous in `out`.
        fn where_backward(
            &self,
            lc: &Layout,
            g: &Self,
            lg: &Layout,
            out: DType,
        ) -> Result<(Self, Self)>;

        /// The scale factors of inverted dropout, on this backend: `n` values of `dtype` (a
        /// compute type, F32 or F64), element `i` `1 / (1 - p)` where
        /// `keep53(seed, i, threshold53(p))` (a counter-based hash, as attention's dropout uses)
        /// else 0, with `seed = rng.next_u64()`, one draw for the whole mask (all 0 without
        /// drawing when `p == 1`). The caller checked `0 < p <= 1`; the output is `x * mask` by
        /// `binary`.
        fn dropout_mask(n: usize, p: f64, rng: &mut Generator, dtype: DType) -> Result<Self>;
    }
}

impl Storage {
    /// `MapOps::dropout_mask` on the backend of `self` (whose values are not read).
    pub fn dropout_mask(
        &self,
        n: usize,
        p: f64,
        rng: &mut Generator,
        dtype: DType,
    ) -> Result<Storage> {
        fn on<B: MapOps>(_: &B, n: usize, p: f64, rng: &mut Generator, dt: DType) -> Result<B> {
            B::dropout_mask(n, p, rng, dt)
        }
        Ok(dispatch!(self, s => wrap!(self, on(s, n, p, rng, dtype)?)))
    }
}
