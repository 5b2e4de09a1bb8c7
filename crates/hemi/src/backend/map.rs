//! Elementwise primitives: unary and binary maps (with broadcasting through the layouts),
//! maps with a scalar, `where`, and random fills.

use super::declare::primitives;
use super::nn::View;
use crate::dtype::DType;
use crate::error::Result;
use crate::rng::Generator;
use crate::tensor::storage::{dispatch, wrap};
use crate::tensor::{Layout, Storage};

/// The binary maps. `Maximum`/`Minimum` propagate NaN, as `torch.maximum`/`minimum`.
///
/// This is hemi's one list of binary maps: the name, the f64 definition tests compare with
/// (`reference`) and every backend's expression (`cuda`; the CPU's loops in `cpu/map.rs`)
/// hang off it, so a backend cannot drift to another list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

    /// Every binary map (for generating a backend's kernels, and for tests).
    pub const ALL: [BinaryOp; 6] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
    ];

    /// The definition in f64: what every backend's F32 evaluation is tested against.
    pub fn reference(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Maximum if a.is_nan() || a > b => a,
            BinaryOp::Minimum if a.is_nan() || a < b => a,
            BinaryOp::Maximum | BinaryOp::Minimum => b,
        }
    }

    /// The CUDA C expression of `a` and `b` (F32), for the CUDA backend's generated kernels
    /// (`hemi_max`/`hemi_min` are its NaN-propagating helpers).
    pub fn cuda(self) -> &'static str {
        match self {
            BinaryOp::Add => "a + b",
            BinaryOp::Sub => "a - b",
            BinaryOp::Mul => "a * b",
            BinaryOp::Div => "a / b",
            BinaryOp::Maximum => "hemi_max(a, b)",
            BinaryOp::Minimum => "hemi_min(a, b)",
        }
    }

    /// The WGSL expression of `a` and `b` (F32), for the wgpu backend's generated kernels
    /// (`hemi_max`/`hemi_min`: the NaN-propagating helpers of `gpu::shaders`).
    pub fn wgsl(self) -> &'static str {
        match self {
            BinaryOp::Add => "a + b",
            BinaryOp::Sub => "a - b",
            BinaryOp::Mul => "a * b",
            BinaryOp::Div => "a / b",
            BinaryOp::Maximum => "hemi_max(a, b)",
            BinaryOp::Minimum => "hemi_min(a, b)",
        }
    }
}

/// `sqrt(2 / pi)`, GELU-tanh's outer constant.
pub const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// GELU-tanh's cubic coefficient.
pub const GELU_TANH_C: f64 = 0.044_715;

/// The unary maths and activations, and the maps with a scalar. Each backend evaluates
/// the function and its derivative in the compute type (F32, F64 for F64).
///
/// This is hemi's one list of unary maps: the name, the f64 definition and derivative
/// (`reference`, `derivative`) and every backend's expression (`cuda`, with the op's scalars
/// as the kernel arguments `c0`, `c1`; the CPU's vectorised loops in `cpu/map.rs`) hang off
/// it. A new op is a variant here; the compiler then names every backend that lacks it.
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

    /// Every unary map, the ones with scalars at sample values (for generating a backend's
    /// kernels, which take the scalars as arguments, and for tests).
    pub const ALL: [UnaryOp; 14] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::AddScalar(0.75),
        UnaryOp::MulScalar(-1.5),
        UnaryOp::PowScalar(2.0),
        UnaryOp::Clamp(-0.5, 1.25),
    ];

    /// The op's scalars `(c0, c1)` (0 where it has fewer).
    pub fn scalars(self) -> (f64, f64) {
        match self {
            UnaryOp::AddScalar(c) | UnaryOp::MulScalar(c) | UnaryOp::PowScalar(c) => (c, 0.0),
            UnaryOp::Clamp(lo, hi) => (lo, hi),
            _ => (0.0, 0.0),
        }
    }

    /// The definition in f64: what every backend's evaluation is tested against.
    pub fn reference(self, x: f64) -> f64 {
        let (k, a) = (SQRT_2_OVER_PI, GELU_TANH_C);
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Relu if x < 0.0 => 0.0,
            UnaryOp::Relu => x,
            UnaryOp::Gelu => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
            UnaryOp::GeluTanh => 0.5 * x * (1.0 + (k * (x + a * x * x * x)).tanh()),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::AddScalar(c) => x + c,
            UnaryOp::MulScalar(c) => x * c,
            UnaryOp::PowScalar(p) => x.powf(p),
            UnaryOp::Clamp(_, _) if x.is_nan() => x,
            UnaryOp::Clamp(lo, hi) => x.max(lo).min(hi),
        }
    }

    /// The derivative in f64 at `x` (PyTorch's conventions at the kinks: ReLU' (0) = 0,
    /// |x|' (0) = 0, clamp's slope 1 on the closed interval).
    pub fn derivative(self, x: f64) -> f64 {
        let (k, a) = (SQRT_2_OVER_PI, GELU_TANH_C);
        match self {
            UnaryOp::Neg => -1.0,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => 1.0 / x,
            UnaryOp::Sqrt => 0.5 / x.sqrt(),
            UnaryOp::Abs => x.signum() * f64::from(u8::from(x != 0.0)),
            UnaryOp::Relu => f64::from(u8::from(x > 0.0)),
            UnaryOp::Gelu => {
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)) + x * pdf
            }
            UnaryOp::GeluTanh => {
                let t = (k * (x + a * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * a * x * x)
            }
            UnaryOp::Sigmoid => {
                let y = 1.0 / (1.0 + (-x).exp());
                y * (1.0 - y)
            }
            UnaryOp::Tanh => 1.0 - x.tanh().powi(2),
            UnaryOp::AddScalar(_) => 1.0,
            UnaryOp::MulScalar(c) => c,
            UnaryOp::PowScalar(p) => p * x.powf(p - 1.0),
            UnaryOp::Clamp(lo, hi) => f64::from(u8::from(x >= lo && x <= hi)),
        }
    }

    /// The CUDA C expression of `x` (F32), the op's scalars as the kernel's `float c0, c1`
    /// (`hemi_erf`-free: CUDA's `erff`, `tanhf`, `powf`). NaN passes through ReLU and clamp,
    /// as in PyTorch.
    pub fn cuda(self) -> &'static str {
        match self {
            UnaryOp::Neg => "-x",
            UnaryOp::Exp => "expf(x)",
            UnaryOp::Log => "logf(x)",
            UnaryOp::Sqrt => "sqrtf(x)",
            UnaryOp::Abs => "fabsf(x)",
            UnaryOp::Relu => "(x < 0.0f ? 0.0f : x)",
            UnaryOp::Gelu => "0.5f * x * (1.0f + erff(x * 0.70710678118654752f))",
            UnaryOp::GeluTanh => {
                "0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)))"
            }
            UnaryOp::Sigmoid => "1.0f / (1.0f + expf(-x))",
            UnaryOp::Tanh => "tanhf(x)",
            UnaryOp::AddScalar(_) => "x + c0",
            UnaryOp::MulScalar(_) => "x * c0",
            UnaryOp::PowScalar(_) => "(c0 == 2.0f ? x * x : powf(x, c0))",
            UnaryOp::Clamp(..) => "(x != x ? x : fminf(fmaxf(x, c0), c1))",
        }
    }

    /// The WGSL expression of `x` (F32) for the wgpu backend's generated kernels, the op's
    /// scalars as `c0`, `c1` (read from the kernel's parameters). WGSL has no erf and its
    /// `pow` and `tanh` are loose at the edges, so `gpu::shaders` supplies `hemi_erf`,
    /// `hemi_pow` (integer powers of negative bases) and `hemi_tanh` (no inf/inf for large
    /// |x|). NaN passes through ReLU and clamp, as in PyTorch.
    pub fn wgsl(self) -> &'static str {
        match self {
            UnaryOp::Neg => "-x",
            UnaryOp::Exp => "exp(x)",
            UnaryOp::Log => "log(x)",
            UnaryOp::Sqrt => "sqrt(x)",
            UnaryOp::Abs => "abs(x)",
            UnaryOp::Relu => "select(x, 0.0, x < 0.0)",
            UnaryOp::Gelu => "0.5 * x * (1.0 + hemi_erf(x * 0.70710678118654752))",
            UnaryOp::GeluTanh => {
                "0.5 * x * (1.0 + hemi_tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))"
            }
            UnaryOp::Sigmoid => "1.0 / (1.0 + exp(-x))",
            UnaryOp::Tanh => "hemi_tanh(x)",
            UnaryOp::AddScalar(_) => "x + c0",
            UnaryOp::MulScalar(_) => "x * c0",
            UnaryOp::PowScalar(_) => "hemi_pow(x, c0)",
            UnaryOp::Clamp(..) => "select(min(max(x, c0), c1), x, hemi_isnan(x))",
        }
    }

    /// The WGSL expression of the derivative from the saved value `s` (the output `y` where
    /// `backward_uses_output`, else the input `x`), the scalars as `c0`, `c1`; the helpers
    /// are `gpu::shaders`' (`BACKWARD_HELPERS`). The naive backend's `slope` in F32.
    pub fn wgsl_slope(self) -> &'static str {
        match self {
            UnaryOp::Neg => "-1.0",
            UnaryOp::Exp => "s",
            UnaryOp::Log => "1.0 / s",
            UnaryOp::Sqrt => "0.5 / s",
            UnaryOp::Abs => "hemi_sign(s)",
            UnaryOp::Relu => "select(0.0, 1.0, s > 0.0)",
            UnaryOp::Gelu => "hemi_gelu_slope(s)",
            UnaryOp::GeluTanh => "hemi_gelu_tanh_slope(s)",
            UnaryOp::Sigmoid => "s * (1.0 - s)",
            UnaryOp::Tanh => "1.0 - s * s",
            UnaryOp::AddScalar(_) => "1.0",
            UnaryOp::MulScalar(_) => "c0",
            // x^0 has slope 0 everywhere (0^-1 would make it NaN at 0).
            UnaryOp::PowScalar(_) => "select(c0 * hemi_pow(s, c0 - 1.0), 0.0, c0 == 0.0)",
            UnaryOp::Clamp(..) => "select(0.0, 1.0, s >= c0 && s <= c1)",
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
        fn minmax_backward(
            &self,
            lg: &Layout,
            a: View<'_, Self>,
            b: View<'_, Self>,
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
        fn where_cond(
            &self,
            lc: &Layout,
            a: View<'_, Self>,
            b: View<'_, Self>,
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
        ) -> Result<(Self, Self)> {
            super::compose::where_backward(self, lc, g, lg, out)
        }

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
        // A GPU has an ordinal the constructor cannot know: the mask goes to this tensor's.
        #[cfg(feature = "gpu")]
        if let Storage::Gpu(g) = self {
            let mask = crate::gpu::GpuStorage::dropout_mask_on(g.ctx(), n, p, rng, dtype)?;
            return Ok(Storage::Gpu(mask));
        }
        Ok(dispatch!(self, s => wrap!(on(s, n, p, rng, dtype)?)))
    }
}
