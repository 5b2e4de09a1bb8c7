//! 2-D pooling kernels over plain buffers of planes `[planes, h, w]` (planes = N*C), each
//! plane pooled independently and in parallel: max (with the argmax kept for backward),
//! average, and adaptive average, forward and backward. No autograd and no validation here:
//! `ops/pool.rs` checks the shapes and `cpu::ops::nn` hands over contiguous buffers in the compute
//! type.

pub use crate::backend::nn::Pool2dGeom;
use crate::cpu::chunked;
use crate::cpu::storage::CpuStorage;
use crate::dtype::{DType, WithDType};
use crate::tensor::FloatDType;

/// Below this many output elements a pooling loop runs on one thread.
const PAR_MIN: usize = 1 << 14;

/// The window of output (oh, ow) clipped to the input: rows `h0..h1`, cols `w0..w1`, and
/// its size including padding (`(h1p - h0p) * (w1p - w0p)`, PyTorch's divisor with
/// count_include_pad).
#[inline]
fn window(g: &Pool2dGeom, oh: usize, ow: usize) -> (usize, usize, usize, usize, usize) {
    let (hs, he) = clip(oh, g.stride.0, g.padding.0, g.kernel.0, g.h);
    let (ws, we) = clip(ow, g.stride.1, g.padding.1, g.kernel.1, g.w);
    let padded = |o: usize, s: usize, p: usize, k: usize, size: usize| {
        // Start and end of the window in padded coordinates, end clipped to the padded
        // extent (as PyTorch computes pool_size).
        let start = o * s;
        let end = (start + k).min(size + 2 * p);
        end - start
    };
    let count = padded(oh, g.stride.0, g.padding.0, g.kernel.0, g.h)
        * padded(ow, g.stride.1, g.padding.1, g.kernel.1, g.w);
    (hs, he, ws, we, count)
}

/// Window `[o*s - p, o*s - p + k)` clipped to `[0, size)`.
#[inline]
fn clip(o: usize, s: usize, p: usize, k: usize, size: usize) -> (usize, usize) {
    let start = o * s;
    (
        (start.saturating_sub(p)).min(size),
        (start + k).saturating_sub(p).min(size),
    )
}

/// Runs `f(out_plane, in_plane)` for every plane, in parallel when the work is large.
fn for_each_plane<C: FloatDType, T: Send>(
    out: &mut [T],
    out_plane: usize,
    inp: &[C],
    in_plane: usize,
    f: impl Fn(&mut [T], &[C]) + Sync,
) {
    if out_plane == 0 || in_plane == 0 || out.is_empty() {
        return;
    }
    if out.len() < PAR_MIN {
        out.chunks_mut(out_plane)
            .zip(inp.chunks(in_plane))
            .for_each(|(o, i)| f(o, i));
    } else {
        crate::threads::nudge();
        // As many planes as the shorter side has (the serial loop's `zip`).
        let planes = out
            .len()
            .div_ceil(out_plane)
            .min(inp.len().div_ceil(in_plane));
        let end = (planes * out_plane).min(out.len());
        let out = &mut out[..end];
        chunked::for_each_chunk(out, out_plane, &|p, o| {
            f(o, chunked::chunk(inp, p, in_plane))
        });
    }
}

/// Max pooling with padding as -inf: returns the maxima and, for each, its flat index
/// `h*W + w` in its plane. The first maximum in row-major window order wins ties; a NaN
/// wins over everything (PyTorch's rule, so NaN propagates).
///
/// The indices are `u32` (planes hold fewer than 2^32 values; `Pool2dGeom` is built from
/// checked shapes): the backward keeps them for every pooled value of the batch, and at 4
/// bytes instead of 8 they cost half what they did next to a half-precision activation.
pub fn max_pool2d_forward<C: FloatDType>(x: &[C], g: &Pool2dGeom) -> (Vec<C>, Vec<u32>) {
    let n = g.planes * g.out_plane();
    let mut out = vec![C::zero(); n];
    let mut idx = vec![0u32; n];
    let (n_out, n_in) = (g.out_plane(), g.in_plane());
    if n == 0 || n_in == 0 {
        return (out, idx);
    }
    let pair_windows = g.kernel == (2, 2) && g.stride == (2, 2) && g.padding == (0, 0);
    let body = |((o, ix), plane): ((&mut [C], &mut [u32]), &[C])| {
        if pair_windows {
            max_pool_2x2_plane(plane, o, ix, g);
            return;
        }
        for oh in 0..g.h_out {
            let (hs, he) = clip(oh, g.stride.0, g.padding.0, g.kernel.0, g.h);
            for ow in 0..g.w_out {
                let (ws, we) = clip(ow, g.stride.1, g.padding.1, g.kernel.1, g.w);
                let mut best = C::neg_infinity();
                let mut at = hs * g.w + ws;
                let mut nan_at = usize::MAX;
                for ih in hs..he {
                    let base = ih * g.w + ws;
                    for (j, &v) in plane[base..ih * g.w + we].iter().enumerate() {
                        // Branch-free: where the max sits is data, and a mispredicted
                        // branch per element costs more than the compares.
                        at = select(v > best, base + j, at);
                        nan_at = select(v.is_nan(), base + j, nan_at);
                        best = best.max(v);
                    }
                }
                // A NaN wins, the last one as in PyTorch (each NaN replaces the max).
                if nan_at != usize::MAX {
                    (best, at) = (C::nan(), nan_at);
                }
                o[oh * g.w_out + ow] = best;
                ix[oh * g.w_out + ow] = at as u32;
            }
        }
    };
    if n < PAR_MIN {
        out.chunks_mut(n_out)
            .zip(idx.chunks_mut(n_out))
            .zip(x.chunks(n_in))
            .for_each(body);
    } else {
        crate::threads::nudge();
        chunked::for_each_chunk2((&mut out, n_out), (&mut idx, n_out), 1, &|p, o, ix| {
            body(((o, ix), chunked::chunk(x, p, n_in)))
        });
    }
    (out, idx)
}

/// A 1×1, unpadded max pool: `x[:, :, ::sh, ::sw]` and where each value came from, in the
/// input's own element type (no F32 round trip: a one-element window's max is the element,
/// NaN included). ResNet's option-A shortcut subsamples this way; the general pool's
/// forward, which converts its whole input to F32 and back, was 1.5–1.9 % of a ResNet-20
/// amp-bf16 step (Emerald Rapids), this gather 0.4 %.
pub fn max_pool2d_1x1<T: Copy + Default + Send + Sync>(
    x: &[T],
    g: &Pool2dGeom,
) -> (Vec<T>, Vec<u32>) {
    debug_assert!(g.kernel == (1, 1) && g.padding == (0, 0));
    let (n_out, n_in) = (g.out_plane(), g.in_plane());
    // Every plane gathers from the same places.
    let at: Vec<u32> = (0..g.h_out)
        .flat_map(|oh| (0..g.w_out).map(move |ow| (oh * g.stride.0 * g.w + ow * g.stride.1) as u32))
        .collect();
    let n = g.planes * n_out;
    let (mut out, mut idx) = (vec![T::default(); n], vec![0u32; n]);
    if n_out == 0 {
        return (out, idx);
    }
    let body = |((o, ix), plane): ((&mut [T], &mut [u32]), &[T])| {
        for (o, &a) in o.iter_mut().zip(&at) {
            *o = plane[a as usize];
        }
        ix.copy_from_slice(&at);
    };
    crate::threads::nudge();
    // Planes in parallel (a serial gather was 1.2 % of a ResNet-20 amp-bf16 step).
    let min_len = (PAR_MIN / n_out).max(1);
    chunked::for_each_chunk2(
        (&mut out, n_out),
        (&mut idx, n_out),
        min_len,
        &|p, o, ix| body(((o, ix), chunked::chunk(x, p, n_in))),
    );
    (out, idx)
}

/// One plane of a 2×2, stride-2, unpadded max pool (CNNs' usual pool, a quarter of their
/// elementwise traffic): the window's four values are compared in row-major order with the
/// general loop's rules (first maximum wins ties, the last NaN wins) and no per-output
/// window clipping.
#[inline]
fn max_pool_2x2_plane<C: FloatDType>(plane: &[C], o: &mut [C], ix: &mut [u32], g: &Pool2dGeom) {
    let w = g.w;
    let mut at = vec![0u8; g.w_out];
    for oh in 0..g.h_out {
        let (r0, r1) = (2 * oh * w, (2 * oh + 1) * w);
        let (orow, irow) = (
            &mut o[oh * g.w_out..(oh + 1) * g.w_out],
            &mut ix[oh * g.w_out..(oh + 1) * g.w_out],
        );
        // F32 rows go through the fused conv block's vector kernel (window indices, turned
        // into flat ones below); the loop after it is the plain reference and the rest.
        let done = match (C::as_f32(plane), C::as_f32_mut(orow)) {
            (Some(p), Some(out)) => crate::cpu::conv::block::max_pool_row_pair(
                &p[r0..r0 + w],
                &p[r1..r1 + w],
                out,
                &mut at,
            ),
            _ => 0,
        };
        for (ow, (iv, &t)) in irow.iter_mut().zip(&at).enumerate().take(done) {
            let t = t as usize;
            *iv = ((2 * oh + (t >> 1)) * w + 2 * ow + (t & 1)) as u32;
        }
        let base = (2 * oh * w) as u32;
        let (top, bot) = (&plane[r0..r0 + w], &plane[r1..r1 + w]);
        for ow in done..g.w_out {
            let c = 2 * ow;
            let (mut best, mut at) = (top[c], c as u32);
            for (v, pos) in [
                (top[c + 1], c + 1),
                (bot[c], w + c),
                (bot[c + 1], w + c + 1),
            ] {
                let take = v > best || v.is_nan();
                best = if take { v } else { best };
                at = if take { pos as u32 } else { at };
            }
            orow[ow] = best;
            irow[ow] = base + at;
        }
    }
}

/// `if c { a } else { b }` without a branch.
#[inline]
fn select(c: bool, a: usize, b: usize) -> usize {
    let m = (c as usize).wrapping_neg();
    (a & m) | (b & !m)
}

/// Max pooling backward: each output gradient goes to its argmax (overlapping windows add).
pub fn max_pool2d_backward<C: FloatDType>(dy: &[C], idx: &[u32], g: &Pool2dGeom) -> Vec<C> {
    let mut dx = vec![C::zero(); g.planes * g.in_plane()];
    let n_out = g.out_plane();
    if n_out == 0 {
        return dx;
    }
    let body = |(p, dxp): (usize, &mut [C])| {
        let (d, i) = (
            &dy[p * n_out..(p + 1) * n_out],
            &idx[p * n_out..(p + 1) * n_out],
        );
        for (&d, &i) in d.iter().zip(i) {
            dxp[i as usize] += d;
        }
    };
    if dx.len() < PAR_MIN {
        dx.chunks_mut(g.in_plane()).enumerate().for_each(body);
    } else {
        crate::threads::nudge();
        chunked::for_each_chunk(&mut dx, g.in_plane(), &|p, dxp| body((p, dxp)));
    }
    dx
}

/// The divisor of output (oh, ow): the window size with or without its padded part.
#[inline]
fn avg_divisor(
    hs: usize,
    he: usize,
    ws: usize,
    we: usize,
    padded: usize,
    include_pad: bool,
) -> usize {
    if include_pad {
        padded
    } else {
        (he - hs) * (we - ws)
    }
}

/// Average pooling (padding counts as zeros; the divisor includes it when
/// `count_include_pad`, PyTorch's default).
pub fn avg_pool2d_forward<C: FloatDType>(
    x: &[C],
    g: &Pool2dGeom,
    count_include_pad: bool,
) -> Vec<C> {
    let mut out = vec![C::zero(); g.planes * g.out_plane()];
    for_each_plane(&mut out, g.out_plane(), x, g.in_plane(), |o, plane| {
        for oh in 0..g.h_out {
            for ow in 0..g.w_out {
                let (hs, he, ws, we, padded) = window(g, oh, ow);
                let mut s = C::zero();
                for ih in hs..he {
                    for &v in &plane[ih * g.w + ws..ih * g.w + we] {
                        s += v;
                    }
                }
                let div = avg_divisor(hs, he, ws, we, padded, count_include_pad);
                o[oh * g.w_out + ow] = s / C::from_f64(div as f64);
            }
        }
    });
    out
}

/// Average pooling backward: each output gradient spreads evenly over its window.
pub fn avg_pool2d_backward<C: FloatDType>(
    dy: &[C],
    g: &Pool2dGeom,
    count_include_pad: bool,
) -> Vec<C> {
    let mut dx = vec![C::zero(); g.planes * g.in_plane()];
    // Each plane of dx is written from the matching plane of dy: iterate dx planes.
    for_each_plane(&mut dx, g.in_plane(), dy, g.out_plane(), |dxp, dyp| {
        for oh in 0..g.h_out {
            for ow in 0..g.w_out {
                let (hs, he, ws, we, padded) = window(g, oh, ow);
                let div = avg_divisor(hs, he, ws, we, padded, count_include_pad);
                let d = dyp[oh * g.w_out + ow] / C::from_f64(div as f64);
                for ih in hs..he {
                    for v in &mut dxp[ih * g.w + ws..ih * g.w + we] {
                        *v += d;
                    }
                }
            }
        }
    });
    dx
}

/// Adaptive pooling window `i` of `out` over `size`: PyTorch's
/// `[floor(i*size/out), ceil((i+1)*size/out))`.
#[inline]
pub fn adaptive_window(i: usize, out: usize, size: usize) -> (usize, usize) {
    (i * size / out, ((i + 1) * size).div_ceil(out))
}

/// Adaptive average pooling of `[planes, h, w]` to `[planes, h_out, w_out]`.
pub fn adaptive_avg_pool2d_forward<C: FloatDType>(
    x: &[C],
    planes: usize,
    (h, w): (usize, usize),
    (h_out, w_out): (usize, usize),
) -> Vec<C> {
    let mut out = vec![C::zero(); planes * h_out * w_out];
    for_each_plane(&mut out, h_out * w_out, x, h * w, |o, plane| {
        for oh in 0..h_out {
            let (hs, he) = adaptive_window(oh, h_out, h);
            for ow in 0..w_out {
                let (ws, we) = adaptive_window(ow, w_out, w);
                let mut s = C::zero();
                for ih in hs..he {
                    for &v in &plane[ih * w + ws..ih * w + we] {
                        s += v;
                    }
                }
                o[oh * w_out + ow] = s / C::from_f64(((he - hs) * (we - ws)) as f64);
            }
        }
    });
    out
}

/// Adaptive average pooling backward.
pub fn adaptive_avg_pool2d_backward<C: FloatDType>(
    dy: &[C],
    planes: usize,
    (h, w): (usize, usize),
    (h_out, w_out): (usize, usize),
) -> Vec<C> {
    let mut dx = vec![C::zero(); planes * h * w];
    for_each_plane(&mut dx, h * w, dy, h_out * w_out, |dxp, dyp| {
        for oh in 0..h_out {
            let (hs, he) = adaptive_window(oh, h_out, h);
            for ow in 0..w_out {
                let (ws, we) = adaptive_window(ow, w_out, w);
                let d = dyp[oh * w_out + ow] / C::from_f64(((he - hs) * (we - ws)) as f64);
                for ih in hs..he {
                    for v in &mut dxp[ih * w + ws..ih * w + we] {
                        *v += d;
                    }
                }
            }
        }
    });
    dx
}

/// Max-pool backward from a contiguous F32/F16/BF16 gradient into a half `out`: plane by
/// plane in F32, rounded into the half gradient.
pub(crate) fn max_pool2d_backward_blocks<T: WithDType>(
    dy: &[T],
    idx: &[u32],
    g: &Pool2dGeom,
    out: DType,
) -> CpuStorage {
    let n_out = g.out_plane();
    if g.kernel.0 <= g.stride.0 && g.kernel.1 <= g.stride.1 && T::DTYPE == out {
        // Windows that do not overlap: each input takes at most one output's gradient, so
        // the F32 plane holds `0 + dy` rounded back to `T` exactly (−0 made +0, NaNs
        // quietened, as the sum does), scattered in `T` into a zeroed plane: the output
        // plane is never converted (ResNet's 1×1 subsampling shortcut, 1.9 % of a
        // ResNet-20 amp-bf16 step before).
        let init = || {
            (
                vec![0f32; n_out],
                vec![0f32; n_out],
                vec![T::from_f64(0.0); n_out],
            )
        };
        let min_len = (1usize << 14).div_ceil(g.in_plane().max(1));
        let dx = chunked::blocks_zeroed(g.planes, g.in_plane(), min_len, init, |s, p, dx| {
            let (fa, fb, h) = s;
            let d = chunked::read(dy, p * n_out, fa);
            for (b, &v) in fb.iter_mut().zip(d) {
                *b = v + 0.0;
            }
            chunked::write(fb, h);
            for (&v, &i) in h.iter().zip(&idx[p * n_out..(p + 1) * n_out]) {
                dx[i as usize] = v;
            }
        });
        return CpuStorage::from_vec(dx);
    }
    let buf = || vec![0f32; n_out];
    chunked::per_block_with(g.planes, g.in_plane(), out, buf, |buf, p, dx| {
        let d = chunked::read(dy, p * n_out, buf);
        for (&d, &i) in d.iter().zip(&idx[p * n_out..(p + 1) * n_out]) {
            dx[i as usize] += d;
        }
    })
    .expect("half dtype")
}
