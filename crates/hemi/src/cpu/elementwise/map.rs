//! The CPU's elementwise maps: plain loops in the compute type, split over the thread pool
//! above `PAR_THRESHOLD` elements; unary maps of contiguous F32/F16/BF16 buffers run chunk
//! by chunk in F32 (`cpu::chunked`), without full-size F32 copies.

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use crate::backend::map::{BinaryOp, UnaryOp};
use crate::cpu::chunked::for_each_chunk;
use crate::dtype::FloatDType;
use crate::rng::Generator;

/// Below this many elements a loop runs on one thread (rayon's overhead dominates).
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// `out[i] = f(a[i], b[i])`, in parallel for large inputs.
pub(crate) fn zip_map<C: FloatDType>(a: &[C], b: &[C], f: impl Fn(C, C) -> C + Sync) -> Vec<C> {
    debug_assert_eq!(a.len(), b.len());
    if a.len() < PAR_THRESHOLD {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    let mut out = vec![C::zero(); a.len()];
    crate::threads::nudge();
    for_each_chunk(&mut out, PAR_THRESHOLD, &|i, o| {
        let start = i * PAR_THRESHOLD;
        let (x, y) = (&a[start..start + o.len()], &b[start..start + o.len()]);
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
    crate::threads::nudge();
    for_each_chunk(&mut out, PAR_THRESHOLD, &|i, o| {
        let x = &a[i * PAR_THRESHOLD..i * PAR_THRESHOLD + o.len()];
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

/// `o = x op y` over one F32 chunk, the op matched once per chunk (a per-element match on a
/// captured op keeps the loop scalar).
pub(crate) fn binary_chunk(op: BinaryOp, x: &[f32], y: &[f32], o: &mut [f32]) {
    macro_rules! each {
        ($f:expr) => {
            for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                *o = $f(x, y);
            }
        };
    }
    match op {
        BinaryOp::Add => each!(|x: f32, y: f32| x + y),
        BinaryOp::Sub => each!(|x: f32, y: f32| x - y),
        BinaryOp::Mul => each!(|x: f32, y: f32| x * y),
        BinaryOp::Div => each!(|x: f32, y: f32| x / y),
        op => each!(|x: f32, y: f32| apply(op, x, y)),
    }
}

use crate::backend::map::{GELU_TANH_C, SQRT_2_OVER_PI};

/// Evaluates `$body` with `$o` bound to `$op` in a match arm of its own variant, so that
/// `$o.f(..)` and `$o.df(..)` inline to that variant's formula and the loop around them
/// vectorises (a per-element match on the variant cost ~10% of a CNN training step).
macro_rules! specialize {
    ($op:expr, $o:ident => $body:expr) => {
        match $op {
            UnaryOp::Neg => {
                let $o = UnaryOp::Neg;
                $body
            }
            UnaryOp::Exp => {
                let $o = UnaryOp::Exp;
                $body
            }
            UnaryOp::Log => {
                let $o = UnaryOp::Log;
                $body
            }
            UnaryOp::Sqrt => {
                let $o = UnaryOp::Sqrt;
                $body
            }
            UnaryOp::Abs => {
                let $o = UnaryOp::Abs;
                $body
            }
            UnaryOp::Relu => {
                let $o = UnaryOp::Relu;
                $body
            }
            UnaryOp::Gelu => {
                let $o = UnaryOp::Gelu;
                $body
            }
            UnaryOp::GeluTanh => {
                let $o = UnaryOp::GeluTanh;
                $body
            }
            UnaryOp::Sigmoid => {
                let $o = UnaryOp::Sigmoid;
                $body
            }
            UnaryOp::Tanh => {
                let $o = UnaryOp::Tanh;
                $body
            }
            UnaryOp::AddScalar(s) => {
                let $o = UnaryOp::AddScalar(s);
                $body
            }
            UnaryOp::MulScalar(s) => {
                let $o = UnaryOp::MulScalar(s);
                $body
            }
            UnaryOp::Clamp(lo, hi) => {
                let $o = UnaryOp::Clamp(lo, hi);
                $body
            }
            UnaryOp::PowScalar(p) => {
                let $o = UnaryOp::PowScalar(p);
                $body
            }
        }
    };
}

/// `out[i] = op(a[i])` for an F32 chunk, on the widest vector unit this CPU has: the crate
/// is built for baseline x86-64 (SSE2), and the polynomial ops (GELU's erf and exp) ran 4
/// lanes wide. The same loop compiled with other features gives the same bits (IEEE +, ×,
/// min, max and selects, no contraction into FMA).
#[doc(hidden)]
pub fn unary_chunk(op: UnaryOp, a: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match vector_level() {
        // SAFETY: the CPU has the features (`vector_level`).
        VectorLevel::Avx512 => return unsafe { x86_loops::unary_avx512(op, a, out) },
        // SAFETY: as above.
        VectorLevel::Avx2 => return unsafe { x86_loops::unary_avx2(op, a, out) },
        VectorLevel::Baseline => {}
    }
    unary_loop(op, a, out)
}

/// `out[i] = g[i] · op'(s[i])` (s the saved input, or the output where `uses_out`) for F32
/// chunks, as `unary_chunk`.
#[doc(hidden)]
pub fn unary_backward_chunk(op: UnaryOp, uses_out: bool, g: &[f32], s: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match vector_level() {
        // SAFETY: the CPU has the features (`vector_level`).
        VectorLevel::Avx512 => {
            return unsafe { x86_loops::unary_backward_avx512(op, uses_out, g, s, out) }
        }
        // SAFETY: as above.
        VectorLevel::Avx2 => {
            return unsafe { x86_loops::unary_backward_avx2(op, uses_out, g, s, out) }
        }
        VectorLevel::Baseline => {}
    }
    unary_backward_loop(op, uses_out, g, s, out)
}

/// `out[i] = op(a[i])`: the loop `unary_chunk` runs, compiled at every vector width.
#[inline(always)]
#[doc(hidden)]
pub fn unary_loop(op: UnaryOp, a: &[f32], out: &mut [f32]) {
    specialize!(op, o => for (y, &v) in out.iter_mut().zip(a) {
        *y = o.f(v);
    })
}

/// `out[i] = g[i] · op'(s[i])`: the loop `unary_backward_chunk` runs, compiled at every
/// vector width.
#[inline(always)]
#[doc(hidden)]
pub fn unary_backward_loop(op: UnaryOp, uses_out: bool, g: &[f32], s: &[f32], out: &mut [f32]) {
    specialize!(op, o => if uses_out {
        for ((y, &g), &s) in out.iter_mut().zip(g).zip(s) {
            *y = g * o.df(0.0, s);
        }
    } else {
        for ((y, &g), &s) in out.iter_mut().zip(g).zip(s) {
            *y = g * o.df(s, 0.0);
        }
    })
}

/// An optional slice as F32 when `C` is `f32`: `Some(None)` for no slice, `None` when `C`
/// is another type (for the wide F32 row loops' dispatch).
pub(crate) fn f32_opt<C: FloatDType>(m: Option<&[C]>) -> Option<Option<&[f32]>> {
    match m {
        None => Some(None),
        Some(r) => C::as_f32(r).map(Some),
    }
}

/// The vector unit the wide F32 loops are compiled for.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum VectorLevel {
    Baseline,
    Avx2,
    Avx512,
}

/// The widest vector unit of this CPU, detected once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn vector_level() -> VectorLevel {
    static LEVEL: std::sync::OnceLock<VectorLevel> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        if cpu_has!(Avx512f) {
            VectorLevel::Avx512
        } else if cpu_has!(Avx2) {
            VectorLevel::Avx2
        } else {
            VectorLevel::Baseline
        }
    })
}

/// The elementwise loops compiled for AVX2 and AVX-512 F (the `#[inline(always)]` loops
/// above, inlined into functions with those features).
#[cfg(target_arch = "x86_64")]
#[doc(hidden)]
pub mod x86_loops {
    use super::{unary_backward_loop, unary_loop, UnaryOp};

    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn unary_avx512(op: UnaryOp, a: &[f32], out: &mut [f32]) {
        unary_loop(op, a, out)
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unary_avx2(op: UnaryOp, a: &[f32], out: &mut [f32]) {
        unary_loop(op, a, out)
    }

    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn unary_backward_avx512(
        op: UnaryOp,
        uses_out: bool,
        g: &[f32],
        s: &[f32],
        out: &mut [f32],
    ) {
        unary_backward_loop(op, uses_out, g, s, out)
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unary_backward_avx2(
        op: UnaryOp,
        uses_out: bool,
        g: &[f32],
        s: &[f32],
        out: &mut [f32],
    ) {
        unary_backward_loop(op, uses_out, g, s, out)
    }
}

impl UnaryOp {
    /// The function, in the compute type.
    #[inline(always)]
    #[doc(hidden)]
    pub fn f<C: FloatDType>(self, x: C) -> C {
        let c = C::from_f64;
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Abs => x.abs(),
            // NaN stays NaN (NaN > 0 is false, so test it first).
            UnaryOp::Relu => {
                if x > C::zero() || x.is_nan() {
                    x
                } else {
                    C::zero()
                }
            }
            UnaryOp::Gelu => {
                c(0.5) * x * (C::one() + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf())
            }
            UnaryOp::GeluTanh => {
                let inner = c(SQRT_2_OVER_PI) * (x + c(GELU_TANH_C) * x * x * x);
                c(0.5) * x * (C::one() + inner.tanh())
            }
            UnaryOp::Sigmoid => {
                // Stable for large |x|: never exponentiates a large positive number.
                if x >= C::zero() {
                    C::one() / (C::one() + (-x).exp())
                } else {
                    let e = x.exp();
                    e / (C::one() + e)
                }
            }
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::AddScalar(s) => x + c(s),
            UnaryOp::MulScalar(s) => x * c(s),
            UnaryOp::Clamp(lo, hi) => {
                if x < c(lo) {
                    c(lo)
                } else if x > c(hi) {
                    c(hi)
                } else {
                    x // NaN falls through unchanged
                }
            }
            UnaryOp::PowScalar(p) => {
                if p == 2.0 {
                    x * x
                } else {
                    x.powf(c(p))
                }
            }
        }
    }

    /// dy/dx at input `x` with output `y` (each op reads only the one its
    /// `backward_uses_output` names).
    #[inline(always)]
    pub(crate) fn df<C: FloatDType>(self, x: C, y: C) -> C {
        let c = C::from_f64;
        match self {
            UnaryOp::Neg => -C::one(),
            UnaryOp::Exp => y,
            UnaryOp::Log => C::one() / x,
            UnaryOp::Sqrt => c(0.5) / y,
            UnaryOp::Abs => x.signum() * if x == C::zero() { C::zero() } else { C::one() },
            UnaryOp::Relu => {
                if x > C::zero() {
                    C::one()
                } else {
                    C::zero()
                }
            }
            UnaryOp::Gelu => {
                // Φ(x) + x φ(x)
                let cdf = c(0.5) * (C::one() + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf());
                let pdf = (-c(0.5) * x * x).exp_fast() * c(0.398_942_280_401_432_7);
                cdf + x * pdf
            }
            UnaryOp::GeluTanh => {
                let u = c(SQRT_2_OVER_PI) * (x + c(GELU_TANH_C) * x * x * x);
                let t = u.tanh();
                let du = c(SQRT_2_OVER_PI) * (C::one() + c(3.0 * GELU_TANH_C) * x * x);
                c(0.5) * (C::one() + t) + c(0.5) * x * (C::one() - t * t) * du
            }
            UnaryOp::Sigmoid => y * (C::one() - y),
            UnaryOp::Tanh => C::one() - y * y,
            UnaryOp::AddScalar(_) => C::one(),
            UnaryOp::MulScalar(s) => c(s),
            // PyTorch passes the gradient where lo <= x <= hi (bounds included).
            UnaryOp::Clamp(lo, hi) => {
                if x >= c(lo) && x <= c(hi) {
                    C::one()
                } else {
                    C::zero()
                }
            }
            UnaryOp::PowScalar(p) => {
                if p == 0.0 {
                    C::zero()
                } else {
                    c(p) * x.powf(c(p - 1.0))
                }
            }
        }
    }
}

/// `x op y` element by element in the compute type, the op matched once, outside the loop,
/// so that each loop vectorises.
pub(crate) fn binary_vec<C: FloatDType>(op: BinaryOp, x: &[C], y: &[C]) -> Vec<C> {
    match op {
        BinaryOp::Add => zip_map(x, y, |x, y| x + y),
        BinaryOp::Sub => zip_map(x, y, |x, y| x - y),
        BinaryOp::Mul => zip_map(x, y, |x, y| x * y),
        BinaryOp::Div => zip_map(x, y, |x, y| x / y),
        op => zip_map(x, y, |x, y| apply(op, x, y)),
    }
}

/// The gradients of `maximum` / `minimum` (`op`) to `a` and `b` from the output's `g`: the
/// larger (smaller) input gets the gradient; ties split it evenly, as PyTorch.
pub(crate) fn minmax_grads<C: FloatDType>(
    op: BinaryOp,
    gv: &[C],
    av: &[C],
    bv: &[C],
) -> (Vec<C>, Vec<C>) {
    let pick_a = op == BinaryOp::Maximum;
    let half = C::from_f64(0.5);
    let mut wa = Vec::with_capacity(gv.len());
    let mut wb = Vec::with_capacity(gv.len());
    for i in 0..gv.len() {
        let (x, y) = (av[i], bv[i]);
        let w = if x == y {
            half
        } else if (x > y) == pick_a {
            C::one()
        } else {
            C::zero()
        };
        wa.push(gv[i] * w);
        wb.push(gv[i] * (C::one() - w));
    }
    (wa, wb)
}

/// `op` on every element in the compute type (the variant matched once, `specialize!`).
pub(crate) fn unary_vec<C: FloatDType>(op: UnaryOp, a: &[C]) -> Vec<C> {
    specialize!(op, o => map(a, |v| o.f(v)))
}

/// `g · op'` element by element in the compute type, `saved` being the op's output where
/// `uses_out`, else its input.
pub(crate) fn unary_backward_vec<D: FloatDType>(
    op: UnaryOp,
    uses_out: bool,
    gv: &[D],
    sv: &[D],
) -> Vec<D> {
    specialize!(op, o => if uses_out {
        zip_map(gv, sv, |g, s| g * o.df(D::zero(), s))
    } else {
        zip_map(gv, sv, |g, s| g * o.df(s, D::zero()))
    })
}

/// `a` where `mask` is non-zero, else `b`.
pub(crate) fn where_vec<C: FloatDType>(mask: &[f64], av: &[C], bv: &[C]) -> Vec<C> {
    mask.iter()
        .zip(av.iter().zip(bv.iter()))
        .map(|(&m, (&x, &y))| if m != 0.0 { x } else { y })
        .collect()
}

/// The gradients of `where` to its two branches: `g` where the mask picked the branch, else
/// zero.
pub(crate) fn where_grads<D: FloatDType>(mask: &[f64], gv: &[D]) -> (Vec<D>, Vec<D>) {
    let ga: Vec<D> = gv
        .iter()
        .zip(mask.iter())
        .map(|(&g, &m)| if m != 0.0 { g } else { D::zero() })
        .collect();
    let gb: Vec<D> = gv
        .iter()
        .zip(mask.iter())
        .map(|(&g, &m)| if m != 0.0 { D::zero() } else { g })
        .collect();
    (ga, gb)
}

/// Dropout's factors, `mask / (1 - p)`: `1/(1-p)` where kept, 0 where dropped.
pub(crate) fn dropout_factors<C: FloatDType>(n: usize, p: f64, rng: &mut Generator) -> Vec<C> {
    if p == 1.0 {
        vec![C::zero(); n]
    } else {
        // One draw from the generator; the elements decided from it in parallel (drawn in
        // order from the generator, the mask was 4 % of a BERT step, on one thread).
        let (seed, threshold) = (rng.next_u64(), crate::rng::threshold53(p));
        let scale = C::from_f64(1.0 / (1.0 - p));
        let mut f = vec![C::zero(); n];
        crate::threads::nudge();
        for_each_chunk(&mut f, PAR_THRESHOLD, &|c, out| {
            let base = (c * PAR_THRESHOLD) as u64;
            crate::rng::keep_factors(seed, base, threshold, scale, C::zero(), out)
        });
        f
    }
}
