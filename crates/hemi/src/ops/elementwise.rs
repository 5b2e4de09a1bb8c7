//! Elementwise ops: binary ops with broadcasting, ops with a scalar, unary maths and
//! activations, and `where`. Each computes in the compute type (F32 for half inputs) and
//! rounds once into the output dtype; each backward sits beside its forward.
//!
//! Dtypes: a binary op's output has the promoted dtype of its inputs (`DType::promote`,
//! PyTorch's rule: the wider float wins, F16 with BF16 gives F32); the gradient of each
//! input is cast back to that input's dtype by autograd.

use crate::dtype::DType;
use crate::dtype::WithDType as _;
#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::{FloatDType, Layout, Tensor};

pub(crate) use crate::cpu::map::{map, zip_map, PAR_THRESHOLD};

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::dtype(op, t.dtype(), "expected a float tensor"));
    }
    Ok(())
}

use crate::backend::map::BinaryOp as Binary;

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
        std::sync::Arc::new(out),
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
            let pick_a = op == Binary::Maximum;
            let ab = a.broadcast_to(&shape)?;
            let bb = b.broadcast_to(&shape)?;
            crate::with_compute!(g.dtype(), C => {
                let (gv, av, bv) = (g.values::<C>(), ab.values::<C>(), bb.values::<C>());
                let half = C::from_f64(0.5);
                let mut wa = Vec::with_capacity(gv.len());
                let mut wb = Vec::with_capacity(gv.len());
                for i in 0..gv.len() {
                    let (x, y) = (av[i], bv[i]);
                    let w = if x == y { half } else if (x > y) == pick_a { C::one() } else { C::zero() };
                    wa.push(gv[i] * w);
                    wb.push(gv[i] * (C::one() - w));
                }
                let dt = g.dtype();
                (
                    Tensor::from_values(wa, &shape, dt),
                    Tensor::from_values(wb, &shape, dt),
                )
            })
        }
    })
}

/// Unary elementwise maths, with the derivative written beside the function.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Unary {
    Neg,
    Exp,
    Log,
    Sqrt,
    Abs,
    Relu,
    /// GELU, exact form: x * Φ(x).
    Gelu,
    /// GELU, tanh approximation: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))).
    GeluTanh,
    Sigmoid,
    Tanh,
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
    /// x ^ p
    PowScalar(f64),
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_TANH_C: f64 = 0.044_715;

/// Evaluates `$body` with `$o` bound to `$op` in a match arm of its own variant, so that
/// `$o.f(..)` and `$o.df(..)` inline to that variant's formula and the loop around them
/// vectorises (a per-element match on the variant cost ~10% of a CNN training step).
macro_rules! specialize {
    ($op:expr, $o:ident => $body:expr) => {
        match $op {
            Unary::Neg => {
                let $o = Unary::Neg;
                $body
            }
            Unary::Exp => {
                let $o = Unary::Exp;
                $body
            }
            Unary::Log => {
                let $o = Unary::Log;
                $body
            }
            Unary::Sqrt => {
                let $o = Unary::Sqrt;
                $body
            }
            Unary::Abs => {
                let $o = Unary::Abs;
                $body
            }
            Unary::Relu => {
                let $o = Unary::Relu;
                $body
            }
            Unary::Gelu => {
                let $o = Unary::Gelu;
                $body
            }
            Unary::GeluTanh => {
                let $o = Unary::GeluTanh;
                $body
            }
            Unary::Sigmoid => {
                let $o = Unary::Sigmoid;
                $body
            }
            Unary::Tanh => {
                let $o = Unary::Tanh;
                $body
            }
            Unary::AddScalar(s) => {
                let $o = Unary::AddScalar(s);
                $body
            }
            Unary::MulScalar(s) => {
                let $o = Unary::MulScalar(s);
                $body
            }
            Unary::PowScalar(p) => {
                let $o = Unary::PowScalar(p);
                $body
            }
        }
    };
}

impl Unary {
    fn name(self) -> &'static str {
        match self {
            Unary::Neg => "neg",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Sqrt => "sqrt",
            Unary::Abs => "abs",
            Unary::Relu => "relu",
            Unary::Gelu => "gelu",
            Unary::GeluTanh => "gelu_tanh",
            Unary::Sigmoid => "sigmoid",
            Unary::Tanh => "tanh",
            Unary::AddScalar(_) => "add_scalar",
            Unary::MulScalar(_) => "mul_scalar",
            Unary::PowScalar(_) => "pow_scalar",
        }
    }

    #[inline(always)]
    fn f<C: FloatDType>(self, x: C) -> C {
        let c = C::from_f64;
        match self {
            Unary::Neg => -x,
            Unary::Exp => x.exp(),
            Unary::Log => x.ln(),
            Unary::Sqrt => x.sqrt(),
            Unary::Abs => x.abs(),
            // NaN stays NaN (NaN > 0 is false, so test it first).
            Unary::Relu => {
                if x > C::zero() || x.is_nan() {
                    x
                } else {
                    C::zero()
                }
            }
            Unary::Gelu => c(0.5) * x * (C::one() + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf()),
            Unary::GeluTanh => {
                let inner = c(SQRT_2_OVER_PI) * (x + c(GELU_TANH_C) * x * x * x);
                c(0.5) * x * (C::one() + inner.tanh())
            }
            Unary::Sigmoid => {
                // Stable for large |x|: never exponentiates a large positive number.
                if x >= C::zero() {
                    C::one() / (C::one() + (-x).exp())
                } else {
                    let e = x.exp();
                    e / (C::one() + e)
                }
            }
            Unary::Tanh => x.tanh(),
            Unary::AddScalar(s) => x + c(s),
            Unary::MulScalar(s) => x * c(s),
            Unary::PowScalar(p) => {
                if p == 2.0 {
                    x * x
                } else {
                    x.powf(c(p))
                }
            }
        }
    }

    /// dy/dx at input `x` with output `y`.
    #[inline(always)]
    fn df<C: FloatDType>(self, x: C, y: C) -> C {
        let c = C::from_f64;
        match self {
            Unary::Neg => -C::one(),
            Unary::Exp => y,
            Unary::Log => C::one() / x,
            Unary::Sqrt => c(0.5) / y,
            Unary::Abs => x.signum() * if x == C::zero() { C::zero() } else { C::one() },
            Unary::Relu => {
                if x > C::zero() {
                    C::one()
                } else {
                    C::zero()
                }
            }
            Unary::Gelu => {
                // Φ(x) + x φ(x)
                let cdf = c(0.5) * (C::one() + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf());
                let pdf = (-c(0.5) * x * x).exp() * c(0.398_942_280_401_432_7);
                cdf + x * pdf
            }
            Unary::GeluTanh => {
                let u = c(SQRT_2_OVER_PI) * (x + c(GELU_TANH_C) * x * x * x);
                let t = u.tanh();
                let du = c(SQRT_2_OVER_PI) * (C::one() + c(3.0 * GELU_TANH_C) * x * x);
                c(0.5) * (C::one() + t) + c(0.5) * x * (C::one() - t * t) * du
            }
            Unary::Sigmoid => y * (C::one() - y),
            Unary::Tanh => C::one() - y * y,
            Unary::AddScalar(_) => C::one(),
            Unary::MulScalar(s) => c(s),
            Unary::PowScalar(p) => {
                if p == 0.0 {
                    C::zero()
                } else {
                    c(p) * x.powf(c(p - 1.0))
                }
            }
        }
    }

    /// Ops whose backward needs the input (the others use only the output or nothing).
    fn backward_needs_output(self) -> bool {
        matches!(
            self,
            Unary::Exp | Unary::Sqrt | Unary::Sigmoid | Unary::Tanh
        )
    }
}

pub(crate) fn unary(x: &Tensor, op: Unary) -> Result<Tensor> {
    let name = op.name();
    require_float(name, x)?;
    if let Some(dt) = super::autocast::target(name, &[Some(x)]) {
        return unary(&super::autocast::cast(x, dt)?, op);
    }
    let dtype = x.dtype();
    if let Some(t) = unary_chunked(x, op) {
        return Ok(t);
    }
    crate::with_compute!(dtype, C => {
        let out = x.with_values::<C, _>(|v| specialize!(op, o => map(v, |v| o.f(v))));
        let storage = std::sync::Arc::new(crate::tensor::Storage::from(crate::tensor::CpuStorage::store::<C>(out, dtype)));
        let layout = crate::tensor::Layout::contiguous(x.shape());
        // The backward keeps what it needs: the output (a detached handle on the same
        // storage, so the node does not hold its own output) or the input.
        let uses_out = op.backward_needs_output();
        let saved = if uses_out {
            Tensor::from_storage(storage.clone(), layout.clone())
        } else {
            x.detach()
        };
        Ok(Tensor::from_op(storage, layout, name, &[x], move |g| {
            crate::with_compute!(g.dtype(), D => {
                let gv = g.values::<D>();
                let sv = saved.values::<D>();
                let gi = specialize!(op, o => if uses_out {
                    zip_map(&gv, &sv, |g, s| g * o.df(D::zero(), s))
                } else {
                    zip_map(&gv, &sv, |g, s| g * o.df(s, D::zero()))
                });
                Ok(vec![Some(Tensor::from_values(gi, g.shape(), g.dtype()))])
            })
        }))
    })
}

/// `unary` for contiguous F32/F16/BF16 tensors, chunk by chunk in F32 (`cpu::chunked`):
/// no full-size F32 copies of half-precision inputs, gradients or results. `None` for other
/// layouts and dtypes.
fn unary_chunked(x: &Tensor, op: Unary) -> Option<Tensor> {
    use crate::cpu::chunked::{map1, map2, Src};
    let dtype = x.dtype();
    let xs = x.storage();
    let src = Src::of(xs.as_cpu(), x.layout())?;
    // The variant is matched once per chunk, inside the kernel, so that each arm's loop is
    // compiled for a constant variant (a match outside the closure leaves `op` a captured
    // runtime value and the loop dispatches per element).
    let out = map1(src, dtype, move |a, out| {
        specialize!(op, o => for (y, &v) in out.iter_mut().zip(a) {
            *y = o.f(v);
        })
    })?;
    let storage = std::sync::Arc::new(crate::tensor::Storage::from(out));
    let layout = crate::tensor::Layout::contiguous(x.shape());
    let uses_out = op.backward_needs_output();
    let saved = if uses_out {
        Tensor::from_storage(storage.clone(), layout.clone())
    } else {
        x.detach()
    };
    Some(Tensor::from_op(
        storage,
        layout,
        op.name(),
        &[x],
        move |g| {
            let (gs, ss) = (g.storage(), saved.storage());
            let chunked = match (
                Src::of(gs.as_cpu(), g.layout()),
                Src::of(ss.as_cpu(), saved.layout()),
            ) {
                (Some(gv), Some(sv)) => map2(gv, sv, g.dtype(), move |g, s, out| {
                    specialize!(op, o => if uses_out {
                        for ((y, &g), &s) in out.iter_mut().zip(g).zip(s) {
                            *y = g * o.df(0.0, s);
                        }
                    } else {
                        for ((y, &g), &s) in out.iter_mut().zip(g).zip(s) {
                            *y = g * o.df(s, 0.0);
                        }
                    })
                }),
                _ => None,
            };
            let gi = match chunked {
                Some(st) => Tensor::from_storage(
                    std::sync::Arc::new(st.into()),
                    Layout::contiguous(g.shape()),
                ),
                None => crate::with_compute!(g.dtype(), D => {
                    let gv = g.values::<D>();
                    let sv = saved.values::<D>();
                    let gi = specialize!(op, o => if uses_out {
                        zip_map(&gv, &sv, |g, s| g * o.df(D::zero(), s))
                    } else {
                        zip_map(&gv, &sv, |g, s| g * o.df(s, D::zero()))
                    });
                    Tensor::from_values(gi, g.shape(), g.dtype())
                }),
            };
            Ok(vec![Some(gi)])
        },
    ))
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

    pub fn neg(&self) -> Result<Tensor> {
        unary(self, Unary::Neg)
    }
    pub fn exp(&self) -> Result<Tensor> {
        unary(self, Unary::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        unary(self, Unary::Log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(self, Unary::Sqrt)
    }
    pub fn abs(&self) -> Result<Tensor> {
        unary(self, Unary::Abs)
    }
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
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(self, Unary::Sigmoid)
    }
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
        let mask: Vec<bool> = cond
            .broadcast_to(&shape)?
            .to_vec_f64()
            .into_iter()
            .map(|c| c != 0.0)
            .collect();
        let mask = std::sync::Arc::new(mask);
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        crate::with_compute!(dtype, C => {
            let av = a.broadcast_to(&shape)?.values::<C>();
            let bv = b.broadcast_to(&shape)?.values::<C>();
            let out: Vec<C> = mask.iter().zip(av.iter().zip(&bv)).map(|(&m, (&x, &y))| if m { x } else { y }).collect();
            let shape2 = shape.clone();
            Ok(Tensor::from_compute(out, &shape, dtype, "where", &[a, b], move |g| {
                crate::with_compute!(g.dtype(), D => {
                    let gv = g.values::<D>();
                    let ga: Vec<D> = gv.iter().zip(mask.iter()).map(|(&g, &m)| if m { g } else { D::zero() }).collect();
                    let gb: Vec<D> = gv.iter().zip(mask.iter()).map(|(&g, &m)| if m { D::zero() } else { g }).collect();
                    let ga = Tensor::from_values(ga, &shape2, g.dtype());
                    let gb = Tensor::from_values(gb, &shape2, g.dtype());
                    Ok(vec![Some(ga.sum_to_shape(&a_shape)?), Some(gb.sum_to_shape(&b_shape)?)])
                })
            }))
        })
    }

    /// `value` where `mask` is nonzero, `self` elsewhere (`mask` broadcasts to `self`).
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let fill = Tensor::scalar(value, self.dtype());
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
