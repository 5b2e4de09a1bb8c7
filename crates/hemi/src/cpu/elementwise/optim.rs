//! The CPU's optimizer updates: PyTorch's `_single_tensor_sgd` and `_single_tensor_adam`
//! element by element in F32, rounding where ATen's CPU kernels round, each loop built
//! twice (with FMA where the CPU has it, and portable) and chosen at run time.

use crate::cpu::chunked::{
    chunk, for_each_chunk, for_each_chunk2, for_each_chunk3_init, for_each_chunk4,
};

use crate::backend::train::{AdamDecay, AdamScalars, SgdFlags, SgdScalars};

/// Whether the update loops can run their FMA build: x86-64 with AVX2 and FMA (checked once
/// per call; `cpu_has!` reads cached answers).
///
/// Why the loops care (PyTorch parity, see `sgd.rs` and `adam.rs`): PyTorch's CPU kernels
/// fuse `a + alpha * b` into one fused multiply-add, and hemi's loops reproduce that with
/// `f32::mul_add`. `mul_add` is correctly rounded on every target, so both builds give the
/// same bits; but without the `fma` target feature it is a call to libm's `fmaf` per element,
/// many times slower than the one `vfmadd` instruction (and it stops vectorization). The x86
/// default target has no FMA, hence a copy of each loop compiled with
/// `#[target_feature(enable = "avx2,fma")]`, chosen at run time. (aarch64's baseline has FMA.)
#[inline]
fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        cpu_has!(Avx2) && cpu_has!(Fma)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Elements per parallel job of an update: the loops are a few operations per element and
/// bound by memory, so jobs are large.
const CHUNK: usize = 1 << 15;

/// The SGD update of `p` by `g` (momentum buffer `b`, empty without momentum) over
/// `CHUNK`-element parts in parallel (each element's update depends on that element alone,
/// so the bits do not depend on the split).
pub(crate) fn sgd_par(p: &mut [f32], g: &[f32], b: &mut [f32], s: SgdScalars, f: SgdFlags) {
    crate::threads::nudge();
    if f.momentum {
        for_each_chunk2((p, CHUNK), (b, CHUNK), 1, &|i, p, b| {
            sgd_dispatch(p, chunk(g, i, CHUNK), b, s, f)
        });
    } else {
        for_each_chunk(p, CHUNK, &|i, p| {
            sgd_dispatch(p, chunk(g, i, CHUNK), &mut [], s, f)
        });
    }
}

/// The Adam update of `p` by `g` with its state (`m`, `v`, and `max` for AMSGrad), the loop
/// built for the weight decay asked for.
pub(crate) fn adam(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
    k: AdamScalars,
    decay: AdamDecay,
) {
    match decay {
        AdamDecay::None => adam_par::<NO_DECAY>(p, g, m, v, max, k),
        AdamDecay::L2 => adam_par::<L2>(p, g, m, v, max, k),
        AdamDecay::Decoupled => adam_par::<DECOUPLED>(p, g, m, v, max, k),
    }
}

/// `adam_loop` over `CHUNK`-element parts in parallel (each element's update depends on that
/// element alone, so the bits do not depend on the split).
fn adam_par<const DECAY: u8>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: Option<&mut [f32]>,
    k: AdamScalars,
) {
    crate::threads::nudge();
    let (p, m, v) = ((p, CHUNK), (m, CHUNK), (v, CHUNK));
    match max {
        Some(x) => for_each_chunk4(p, m, v, (x, CHUNK), &|i, p, m, v, x| {
            adam_loop::<DECAY, true>(p, chunk(g, i, CHUNK), m, v, x, k)
        }),
        None => for_each_chunk3_init(p, m, v, 1, || (), &|_, i, p, m, v| {
            adam_loop::<DECAY, false>(p, chunk(g, i, CHUNK), m, v, &mut [], k)
        }),
    }
}

/// The SGD loop for these flags (each combination its own branch-free build).
fn sgd_dispatch(p: &mut [f32], g: &[f32], b: &mut [f32], s: SgdScalars, f: SgdFlags) {
    if !f.momentum {
        return match f.weight_decay {
            false => sgd_loop::<false, false, false, false>(p, g, &mut [], s),
            true => sgd_loop::<true, false, false, false>(p, g, &mut [], s),
        };
    }
    match (f.weight_decay, f.first, f.nesterov) {
        (false, false, false) => sgd_loop::<false, true, false, false>(p, g, b, s),
        (false, false, true) => sgd_loop::<false, true, false, true>(p, g, b, s),
        (false, true, false) => sgd_loop::<false, true, true, false>(p, g, b, s),
        (false, true, true) => sgd_loop::<false, true, true, true>(p, g, b, s),
        (true, false, false) => sgd_loop::<true, true, false, false>(p, g, b, s),
        (true, false, true) => sgd_loop::<true, true, false, true>(p, g, b, s),
        (true, true, false) => sgd_loop::<true, true, true, false>(p, g, b, s),
        (true, true, true) => sgd_loop::<true, true, true, true>(p, g, b, s),
    }
}

/// `sgd_kernel` compiled with FMA where the CPU has it (`has_fma` says why), else as is.
#[doc(hidden)]
pub fn sgd_loop<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    s: SgdScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma<
            const WD: bool,
            const MOMENTUM: bool,
            const FIRST: bool,
            const NESTEROV: bool,
        >(
            p: &mut [f32],
            g: &[f32],
            buf: &mut [f32],
            s: SgdScalars,
        ) {
            sgd_kernel::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s)
        }
        // SAFETY: selected only after `has_fma()` detected AVX2 and FMA.
        return unsafe { fma::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s) };
    }
    sgd_kernel::<WD, MOMENTUM, FIRST, NESTEROV>(p, g, buf, s)
}

/// PyTorch's `_single_tensor_sgd`, element by element, rounding where its CPU kernels round:
/// every `x.add(y, alpha=a)` is one fused multiply-add `y * a + x` (ATen's vectorised `add`
/// is `fmadd(other, alpha, self)`, and its scalar tail is contracted the same way), and
/// `buf.mul_(momentum)` is a separate F32 product. The configuration is in the const
/// parameters so that each loop is branch-free and vectorises.
#[inline(always)]
#[doc(hidden)]
pub fn sgd_kernel<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    s: SgdScalars,
) {
    let n = p.len();
    let g = &g[..n];
    let buf = if MOMENTUM { &mut buf[..n] } else { buf };
    for i in 0..n {
        // grad = grad.add(param, alpha=weight_decay)
        let mut d = if WD {
            p[i].mul_add(s.weight_decay, g[i])
        } else {
            g[i]
        };
        if MOMENTUM {
            // First step: buf = grad.clone(); then buf.mul_(momentum).add_(grad, alpha=1-dampening)
            let b = if FIRST {
                d
            } else {
                d.mul_add(s.keep, buf[i] * s.momentum)
            };
            buf[i] = b;
            // grad = grad.add(buf, alpha=momentum) (Nesterov), else grad = buf
            d = if NESTEROV {
                b.mul_add(s.momentum, d)
            } else {
                b
            };
        }
        // param.add_(grad, alpha=-lr)
        p[i] = d.mul_add(s.neg_lr, p[i]);
    }
}

/// Where weight decay enters (`adam_kernel`'s `DECAY`).
#[doc(hidden)]
pub const NO_DECAY: u8 = 0;
/// Adam: `g = g + wd * p`.
#[doc(hidden)]
pub const L2: u8 = 1;
/// AdamW: `p = p * (1 - lr * wd)`.
#[doc(hidden)]
pub const DECOUPLED: u8 = 2;

/// `adam_kernel` compiled with FMA where the CPU has it (`optimizer::has_fma` says why).
#[doc(hidden)]
pub fn adam_loop<const DECAY: u8, const AMSGRAD: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: &mut [f32],
    k: AdamScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma<const DECAY: u8, const AMSGRAD: bool>(
            p: &mut [f32],
            g: &[f32],
            m: &mut [f32],
            v: &mut [f32],
            max: &mut [f32],
            k: AdamScalars,
        ) {
            adam_kernel::<DECAY, AMSGRAD>(p, g, m, v, max, k)
        }
        // SAFETY: selected only after `has_fma()` detected AVX2 and FMA.
        return unsafe { fma::<DECAY, AMSGRAD>(p, g, m, v, max, k) };
    }
    adam_kernel::<DECAY, AMSGRAD>(p, g, m, v, max, k)
}

/// PyTorch's `_single_tensor_adam` (non-capturable branch), element by element, rounding
/// where its CPU kernels round: `add` with alpha, `lerp` and `addcmul` are fused
/// multiply-adds (ATen's vectorised kernels use `fmadd`, its scalar tails are contracted the
/// same way), `addcdiv` is `p + (value * m) / denom` with three roundings, and the square
/// root is the IEEE one.
#[inline(always)]
#[doc(hidden)]
pub fn adam_kernel<const DECAY: u8, const AMSGRAD: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    max: &mut [f32],
    k: AdamScalars,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let max = if AMSGRAD { &mut max[..n] } else { max };
    for i in 0..n {
        let (mut pi, mut gi) = (p[i], g[i]);
        if DECAY == DECOUPLED {
            pi *= k.decay; // param.mul_(1 - lr * weight_decay)
        } else if DECAY == L2 {
            gi = pi.mul_add(k.decay, gi); // grad.add(param, alpha=weight_decay)
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let base = if k.lerp_small { m[i] } else { gi };
        m[i] = k.lerp_coeff.mul_add(gi - m[i], base);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let mut vi = (k.one_minus_beta2 * gi).mul_add(gi, v[i] * k.beta2);
        v[i] = vi;
        if AMSGRAD {
            // torch.maximum: NaN if either is NaN
            vi = if vi.is_nan() || max[i].is_nan() {
                f32::NAN
            } else {
                vi.max(max[i])
            };
            max[i] = vi;
        }
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = vi.sqrt() / k.bias_correction2_sqrt + k.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p[i] = pi + (k.neg_step_size * m[i]) / denom;
    }
}
