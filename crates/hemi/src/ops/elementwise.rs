//! Elementwise ops: binary ops with broadcasting, ops with a scalar, unary maths and
//! activations, and `where`. Each computes in the compute type (F32 for half inputs) and
//! rounds once into the output dtype; each backward sits beside its forward.
//!
//! Dtypes: a binary op's output has the promoted dtype of its inputs (`DType::promote`,
//! PyTorch's rule: the wider float wins, F16 with BF16 gives F32); the gradient of each
//! input is cast back to that input's dtype by autograd.

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::{Layout, Tensor};

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

use crate::backend::map::BinaryOp as Binary;
use crate::backend::map::UnaryOp as Unary;

fn binary(a: &Tensor, b: &Tensor, op: Binary) -> Result<Tensor> {
    let name = op.name();
    let shape = broadcast_shapes(name, a.shape(), b.shape())?;
    let dtype = a.dtype().promote(b.dtype());
    let (ab, bb) = (a.broadcast_to(&shape)?, b.broadcast_to(&shape)?);
    let out = a
        .storage()
        .binary(ab.layout(), &b.storage(), bb.layout(), op, dtype)?;
    let (a_saved, b_saved) = (a.detach(), b.detach());
    let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
    Ok(Tensor::from_op(
        Arc::new(out),
        Layout::contiguous(&shape),
        name,
        &[a, b],
        move |g| {
            let (ga, gb) = binary_backward(op, g, &a_saved, &b_saved)?;
            Ok(vec![
                Some(ga.sum_to_shape(&a_shape)?),
                Some(gb.sum_to_shape(&b_shape)?),
            ])
        },
    ))
}

/// Gradients of a binary op at broadcast shape (before reduction to the input shapes).
fn binary_backward(op: Binary, g: &Tensor, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok(match op {
        Binary::Add => (g.clone(), g.clone()),
        Binary::Sub => (g.clone(), g.neg()?),
        Binary::Mul => (g.mul(b)?, g.mul(a)?),
        Binary::Div => {
            let ga = g.div(b)?;
            // d(a/b)/db = -a/b^2 = -(a/b)/b
            let gb = ga.mul(a)?.div(b)?.neg()?;
            (ga, gb)
        }
        Binary::Maximum | Binary::Minimum => {
            // The larger (smaller) input gets the gradient; ties split it evenly, as
            // PyTorch does.
            let shape = g.shape().to_vec();
            let (ab, bb) = (a.broadcast_to(&shape)?, b.broadcast_to(&shape)?);
            let (ga, gb) = g.storage().minmax_backward(
                g.layout(),
                (&ab.storage(), ab.layout()),
                (&bb.storage(), bb.layout()),
                op,
                g.dtype(),
            )?;
            let layout = Layout::contiguous(&shape);
            (
                Tensor::from_storage(Arc::new(ga), layout.clone()),
                Tensor::from_storage(Arc::new(gb), layout),
            )
        }
    })
}

/// A unary map and its backward: the backward keeps what the derivative needs, the output
/// (a detached handle on the output's storage, so the node does not hold its own output)
/// or the input.
pub(crate) fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
    let name = op.name();
    require_float(name, x)?;
    if let Some(dt) = super::autocast::target(name, &[Some(x)]) {
        return unary(&super::autocast::cast(x, dt)?, op);
    }
    let storage = Arc::new(x.storage().unary(x.layout(), op, x.dtype())?);
    let layout = Layout::contiguous(x.shape());
    let saved = if op.backward_uses_output() {
        Tensor::from_storage(storage.clone(), layout.clone())
    } else {
        x.detach()
    };
    Ok(Tensor::from_op(storage, layout, name, &[x], move |g| {
        let gi = g.storage().unary_backward(
            g.layout(),
            &saved.storage(),
            saved.layout(),
            op,
            g.dtype(),
        )?;
        Ok(vec![Some(Tensor::from_storage(
            Arc::new(gi),
            Layout::contiguous(g.shape()),
        ))])
    }))
}

impl Tensor {
    /// `self + other` with broadcasting.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Add)
    }
    /// `self - other` with broadcasting.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Sub)
    }
    /// `self * other` with broadcasting.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Mul)
    }
    /// `self / other` with broadcasting.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Div)
    }
    /// Elementwise maximum with broadcasting (NaN propagates; ties split the gradient).
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Maximum)
    }
    /// Elementwise minimum with broadcasting.
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        binary(self, other, Binary::Minimum)
    }

    /// `-x`, elementwise, in the input's dtype.
    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Unary::Neg)
    }
    /// `e^x`, elementwise; under autocast computed in F32 (the FP32 list).
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Unary::Exp)
    }
    /// Natural logarithm, elementwise (`-inf` at 0, NaN below); under autocast computed in
    /// F32.
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Unary::Log)
    }
    /// Square root, elementwise (NaN below 0).
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(self, Unary::Sqrt)
    }
    /// `|x|`, elementwise.
    pub fn abs(&self) -> Result<Tensor> {
        unary(self, Unary::Abs)
    }
    /// `max(x, 0)`, elementwise (NaN stays NaN); passes through autocast in its input's
    /// dtype.
    pub fn relu(&self) -> Result<Tensor> {
        unary(self, Unary::Relu)
    }
    /// GELU with the exact erf form.
    pub fn gelu(&self) -> Result<Tensor> {
        unary(self, Unary::Gelu)
    }
    /// GELU with the tanh approximation (`approximate='tanh'`).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        unary(self, Unary::GeluTanh)
    }
    /// Logistic sigmoid `1 / (1 + e^-x)`, elementwise.
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(self, Unary::Sigmoid)
    }
    /// Hyperbolic tangent, elementwise.
    pub fn tanh(&self) -> Result<Tensor> {
        unary(self, Unary::Tanh)
    }
    /// `self + c`.
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        unary(self, Unary::AddScalar(c))
    }
    /// `self * c`.
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        unary(self, Unary::MulScalar(c))
    }
    /// `self / c`.
    pub fn div_scalar(&self, c: f64) -> Result<Tensor> {
        if c == 0.0 {
            return unary(self, Unary::MulScalar(f64::INFINITY));
        }
        unary(self, Unary::MulScalar(1.0 / c))
    }
    /// Every element limited to `[lo, hi]` (`torch.clamp`; NaN stays NaN). The gradient
    /// passes where `lo <= x <= hi`. Errors when `lo > hi` or a bound is NaN.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return Err(Error::arg(
                "clamp",
                format!("need lo <= hi (not NaN), got lo {lo}, hi {hi}"),
            ));
        }
        unary(self, Unary::Clamp(lo, hi))
    }
    /// `self ^ p` for a scalar exponent.
    pub fn pow_scalar(&self, p: f64) -> Result<Tensor> {
        unary(self, Unary::PowScalar(p))
    }
    /// `self * self`.
    pub fn square(&self) -> Result<Tensor> {
        unary(self, Unary::PowScalar(2.0))
    }

    /// `cond ? a : b` elementwise with broadcasting over all three; `cond` is true where
    /// nonzero (any dtype). The output has the promoted dtype of `a` and `b`.
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let shape = broadcast_shapes("where", a.shape(), b.shape())?;
        let shape = broadcast_shapes("where", cond.shape(), &shape)?;
        let dtype = a.dtype().promote(b.dtype());
        // The condition is kept (a detached view broadcast to the output) for the backward.
        let cond = cond.detach().broadcast_to(&shape)?;
        let (ab, bb) = (a.broadcast_to(&shape)?, b.broadcast_to(&shape)?);
        let out = cond.storage().where_cond(
            cond.layout(),
            (&ab.storage(), ab.layout()),
            (&bb.storage(), bb.layout()),
            dtype,
        )?;
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        let layout = Layout::contiguous(&shape);
        Ok(Tensor::from_op(
            Arc::new(out),
            layout.clone(),
            "where",
            &[a, b],
            move |g| {
                let (ga, gb) = cond.storage().where_backward(
                    cond.layout(),
                    &g.storage(),
                    g.layout(),
                    g.dtype(),
                )?;
                let ga = Tensor::from_storage(Arc::new(ga), layout.clone());
                let gb = Tensor::from_storage(Arc::new(gb), layout.clone());
                Ok(vec![
                    Some(ga.sum_to_shape(&a_shape)?),
                    Some(gb.sum_to_shape(&b_shape)?),
                ])
            },
        ))
    }

    /// `value` where `mask` is nonzero, `self` elsewhere (`mask` broadcasts to `self`).
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let fill = Tensor::scalar(value, self.dtype()).to_device(self.device())?;
        let out = Tensor::where_cond(mask, &fill, self)?;
        if out.shape() != self.shape() {
            return Err(Error::shape(
                "masked_fill",
                format!(
                    "mask {:?} does not broadcast to {:?}",
                    mask.shape(),
                    self.shape()
                ),
            ));
        }
        Ok(out)
    }
}

/// Promotion helper for ops that take several float inputs.
pub fn promote_all(ts: &[&Tensor]) -> DType {
    ts.iter()
        .map(|t| t.dtype())
        .reduce(DType::promote)
        .unwrap_or(DType::F32)
}
