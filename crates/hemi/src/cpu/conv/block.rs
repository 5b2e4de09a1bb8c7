//! Convolution, bias, ReLU and a 2×2 stride-2 max-pool as one kernel, a small group of
//! images at a time: the block every small CNN repeats (`pool(relu(conv(x)))`).
//!
//! Run as three ops, the block writes the convolution's output for the whole batch, reads it
//! back for the ReLU, writes that, reads it back for the pool, and on the way back scatters
//! the pooled gradient into a full-size zeroed buffer, masks it with the ReLU into another,
//! and only then runs the convolution's backward: five full-size passes over memory per
//! direction (at batch 128, CifarNet's first block is 29 MB per pass). Here a group's
//! convolution output (one GEMM over its images side by side, >= 128 columns where the
//! batch allows, at most 16 images) exists only in
//! a scratch buffer while it is pooled; the backward rebuilds the group's masked output
//! gradient in scratch and runs the weight, bias and input gradients from it at once. The
//! batch never exists at full resolution, in time or in memory.
//!
//! The maths is the composition's: `pool(relu(y)) = relu(pool(y))` (ReLU is monotone), so
//! the pool runs on the convolution's F32 output and the ReLU on the pooled value; a pooled
//! value that is not positive passes no gradient (ReLU's derivative there is 0), which the
//! window index records as `MASKED`. F16/BF16 tensors are unfolded and multiplied as stored
//! (`cpu::gemm::blocked`: converted inside its packing, or BF16 pairs on `vdpbf16ps`), the
//! convolution output is F32, and the pooled output is rounded once, as the unfused ops
//! round it.

use crate::cpu::chunked::{for_each_chunk2_init, map_chunks, sum, write};
use crate::cpu::conv::im2col::{col2im_ld, im2col_ld};
use crate::cpu::conv::Conv2dGeom;
use crate::cpu::gemm::{product, MatRef};
use crate::cpu::runs::{add_in_order, Runs};
use crate::dtype::{same_slice_mut, WithDType};
use crate::tensor::CpuStorage;

/// Window index of a pooled value whose ReLU is zero (or NaN): no gradient flows back.
pub const MASKED: u8 = u8::MAX;

/// Values in one pooled output image: `c_out · (h_out / 2) · (w_out / 2)`.
#[doc(hidden)]
pub fn pooled_image(g: &Conv2dGeom) -> usize {
    g.c_out * (g.h_out / 2) * (g.w_out / 2)
}

/// Per-thread scratch of the forward: the group's column matrix (in the tensors' dtype), its
/// F32 convolution output and one pooled image in F32.
struct FwdScratch<T> {
    col: Vec<T>,
    y: Vec<f32>,
    pooled: Vec<f32>,
}

impl<T> Default for FwdScratch<T> {
    fn default() -> Self {
        FwdScratch {
            col: Vec::new(),
            y: Vec::new(),
            pooled: Vec::new(),
        }
    }
}

/// ReLU and 2×2 pooling of one convolution output image (channel `c`'s plane at
/// `y[c * ld..]`, `ld` the row stride of a group's output matrix) into
/// `out [c_out, h_out/2, w_out/2]` and the window index of each maximum (row-major 0..4,
/// first maximum wins ties, the last NaN wins; `MASKED` where the ReLU gives 0 or NaN).
#[doc(hidden)]
pub fn relu_pool_image(
    y: &[f32],
    ld: usize,
    out: &mut [f32],
    idx: &mut [u8],
    g: &Conv2dGeom,
    fast: bool,
) {
    let (ho, wo) = (g.h_out, g.w_out);
    let (ph, pw) = (ho / 2, wo / 2);
    // The winners of each row's pairs, then of the two rows: every step is a loop of
    // selects with no branch (compares of random data mispredict half the time, which
    // made a branchy version cost as much as the GEMM) that the compiler vectorises.
    let mut top = vec![0f32; pw];
    let mut top_at = vec![0u8; pw];
    let mut bot = vec![0f32; pw];
    let mut bot_at = vec![0u8; pw];
    for c in 0..g.c_out {
        let plane = &y[c * ld..c * ld + ho * wo];
        for i in 0..ph {
            let r0 = &plane[2 * i * wo..2 * i * wo + 2 * pw];
            let r1 = &plane[(2 * i + 1) * wo..(2 * i + 1) * wo + 2 * pw];
            let base = (c * ph + i) * pw;
            let (o, ix) = (&mut out[base..base + pw], &mut idx[base..base + pw]);
            let done = if fast {
                row_pair_fast(r0, r1, o, ix)
            } else {
                0
            };
            pick_pairs(&r0[2 * done..], &mut top[done..], &mut top_at[done..], 0);
            pick_pairs(&r1[2 * done..], &mut bot[done..], &mut bot_at[done..], 2);
            for j in done..pw {
                // The top row's winner is the earlier element: the later (bottom) one
                // wins when larger or NaN — "first maximum, last NaN" over the window.
                let (a, b) = (top[j], bot[j]);
                let take = (b > a) | b.is_nan();
                let best = if take { b } else { a };
                let at = if take { bot_at[j] } else { top_at[j] };
                // ReLU of the maximum: NaN stays NaN (as `relu` keeps it) and, like a
                // non-positive maximum, passes no gradient.
                let pass = best > 0.0;
                o[j] = if pass | best.is_nan() { best } else { 0.0 };
                ix[j] = if pass { at } else { MASKED };
            }
        }
    }
}

/// The outputs of a row pair that the AVX2 kernel computes (all of them), or 0 without
/// AVX2 (the caller's plain loop then computes them).
#[inline]
fn row_pair_fast(r0: &[f32], r1: &[f32], out: &mut [f32], idx: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if cpu_has!(Avx2) {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { x86::row_pair_avx2::<true>(r0, r1, out, idx) };
    }
    let _ = (r0, r1, out, idx);
    0
}

/// A 2×2 stride-2 max-pool (no ReLU) of the row pair `r0`, `r1` with the same kernel, for
/// `max_pool2d`: the maxima and their window indices (0..4 row-major; first maximum wins
/// ties, the last NaN wins). Returns how many outputs it computed: all of them, or 0
/// without AVX2.
pub(crate) fn max_pool_row_pair(r0: &[f32], r1: &[f32], out: &mut [f32], idx: &mut [u8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if cpu_has!(Avx2) {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { x86::row_pair_avx2::<false>(r0, r1, out, idx) };
    }
    let _ = (r0, r1, out, idx);
    0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::MASKED;
    use std::arch::x86_64::*;

    /// The even and odd elements of 16 consecutive floats at `p`, in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn deinterleave(p: *const f32) -> (__m256, __m256) {
        // SAFETY (caller): 16 floats are readable at p.
        let (lo, hi) = unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) };
        // shuffle_ps works per 128-bit lane: [lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6]; the
        // 64-bit permute puts the quarters back in order.
        let ev = _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi);
        let od = _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi);
        (in_order(ev), in_order(od))
    }

    /// Swaps the middle 64-bit quarters: [a b c d] -> [a c b d].
    #[inline]
    #[target_feature(enable = "avx2")]
    fn in_order(v: __m256) -> __m256 {
        _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
    }

    /// The later of two vectors where it is larger or NaN, and the mask of where it won.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pick(early: __m256, late: __m256) -> (__m256, __m256) {
        let take = _mm256_or_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(late, early),
            _mm256_cmp_ps::<_CMP_UNORD_Q>(late, late),
        );
        (_mm256_blendv_ps(early, late, take), take)
    }

    /// `relu_pool_image`'s rules for one row pair, 8 outputs at a time (the plain loop
    /// beside it is the reference, held equal by a test on random data with ties and NaN);
    /// without `RELU`, plain max-pooling (every window index kept).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_pair_avx2<const RELU: bool>(
        r0: &[f32],
        r1: &[f32],
        out: &mut [f32],
        idx: &mut [u8],
    ) -> usize {
        let len = out.len().min(idx.len()).min(r0.len() / 2).min(r1.len() / 2);
        let n = len / 8 * 8;
        for j in (0..n).step_by(8) {
            // SAFETY: j + 8 <= n <= r0.len() / 2, so 16 floats from 2j are in bounds.
            let (a0, a1) = unsafe { deinterleave(r0.as_ptr().add(2 * j)) };
            let (b0, b1) = unsafe { deinterleave(r1.as_ptr().add(2 * j)) };
            let (o, at) = eight::<RELU>(a0, a1, b0, b1);
            // SAFETY: j + 8 <= n <= out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), o) };
            for (d, &v) in idx[j..j + 8].iter_mut().zip(&at) {
                *d = v as u8;
            }
        }
        // The last (fewer than 8) outputs from zero-padded copies of the rows: the padded
        // lanes are computed and dropped. (Small CNN maps have such tails on every row:
        // 15 = 8 + 7, 6 = 0 + 6.)
        let rest = len - n;
        if rest > 0 {
            let (mut t0, mut t1) = ([0f32; 16], [0f32; 16]);
            t0[..2 * rest].copy_from_slice(&r0[2 * n..2 * len]);
            t1[..2 * rest].copy_from_slice(&r1[2 * n..2 * len]);
            // SAFETY: t0 and t1 hold 16 floats.
            let (a0, a1) = unsafe { deinterleave(t0.as_ptr()) };
            let (b0, b1) = unsafe { deinterleave(t1.as_ptr()) };
            let (o, at) = eight::<RELU>(a0, a1, b0, b1);
            let mut ob = [0f32; 8];
            // SAFETY: ob holds 8 floats.
            unsafe { _mm256_storeu_ps(ob.as_mut_ptr(), o) };
            out[n..len].copy_from_slice(&ob[..rest]);
            for (d, &v) in idx[n..len].iter_mut().zip(&at) {
                *d = v as u8;
            }
        }
        len
    }

    /// Eight pooled outputs from the even/odd elements of the top (a) and bottom (b) rows:
    /// values after the ReLU and window indices (`MASKED` where no gradient flows).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn eight<const RELU: bool>(
        a0: __m256,
        a1: __m256,
        b0: __m256,
        b1: __m256,
    ) -> (__m256, [i32; 8]) {
        let one = _mm256_set1_epi32(1);
        let mut at = [0i32; 8];
        let (top, t_take) = pick(a0, a1);
        let (bot, b_take) = pick(b0, b1);
        let (best, take) = pick(top, bot);
        // Window index: top row 0/1, bottom row 2/3.
        let t_at = _mm256_and_si256(_mm256_castps_si256(t_take), one);
        let b_at = _mm256_add_epi32(
            _mm256_and_si256(_mm256_castps_si256(b_take), one),
            _mm256_set1_epi32(2),
        );
        let w_at = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(t_at),
            _mm256_castsi256_ps(b_at),
            take,
        ));
        if !RELU {
            // SAFETY: `at` holds 8 i32.
            unsafe { _mm256_storeu_si256(at.as_mut_ptr().cast(), w_at) };
            return (best, at);
        }
        let pass = _mm256_cmp_ps::<_CMP_GT_OQ>(best, _mm256_setzero_ps());
        let keep = _mm256_or_ps(pass, _mm256_cmp_ps::<_CMP_UNORD_Q>(best, best));
        let o = _mm256_and_ps(best, keep);
        let w_at = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(_mm256_set1_epi32(MASKED as i32)),
            _mm256_castsi256_ps(w_at),
            pass,
        ));
        // SAFETY: `at` holds 8 i32.
        unsafe { _mm256_storeu_si256(at.as_mut_ptr().cast(), w_at) };
        (o, at)
    }
}

/// For each pair `(row[2j], row[2j+1])`: the later when it is larger or NaN, else the
/// earlier, and its window index (`first` or `first + 1`).
#[inline(always)]
fn pick_pairs(row: &[f32], best: &mut [f32], at: &mut [u8], first: u8) {
    for ((b, a), p) in best.iter_mut().zip(at.iter_mut()).zip(row.chunks_exact(2)) {
        let take = (p[1] > p[0]) | p[1].is_nan();
        *b = if take { p[1] } else { p[0] };
        *a = first + take as u8;
    }
}

/// Forward of the block over contiguous `x [n, c_in, h, w]` and weight of one dtype `T`
/// (F32, F16 or BF16), F32 bias: the pooled output in `T` and the window index of every
/// output.
pub fn forward<T: WithDType>(
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
) -> (CpuStorage, Vec<u8>) {
    let mut idx = vec![0u8; g.n * pooled_image(g)];
    let out = forward_into(x, w, bias, g, &mut idx);
    (CpuStorage::from_vec(out), idx)
}

fn forward_into<T: WithDType>(
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
    idx: &mut [u8],
) -> Vec<T> {
    let pooled = pooled_image(g);
    let mut out = vec![T::default(); g.n * pooled];
    if pooled == 0 {
        return out;
    }
    let (l, gs) = (g.l(), group_size(g));
    let single = g.n <= gs;
    crate::threads::nudge();
    for_each_chunk2_init(
        (&mut out, gs * pooled),
        (idx, gs * pooled),
        1,
        FwdScratch::default,
        &|s, gi, o, ix| {
            let cnt = o.len() / pooled;
            let ld = cnt * l;
            group_columns(x, g, gi * gs, cnt, &mut s.col);
            s.y.resize(g.c_out * ld, 0.0);
            let (k, m) = (g.k(), g.c_out_g());
            for grp in 0..g.groups {
                let a = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k);
                let b = MatRef::row_major(&s.col[grp * k * ld..], k, ld);
                let dst = &mut s.y[grp * m * ld..(grp + 1) * m * ld];
                if let Some(bias) = bias {
                    for (row, &b) in dst.chunks_exact_mut(ld).zip(&bias[grp * m..(grp + 1) * m]) {
                        row.fill(b);
                    }
                }
                product(dst, a, b, bias.is_some(), single);
            }
            s.pooled.resize(pooled, 0.0);
            for j in 0..cnt {
                let span = j * pooled..(j + 1) * pooled;
                relu_pool_image(
                    &s.y[j * l..],
                    ld,
                    &mut s.pooled,
                    &mut ix[span.clone()],
                    g,
                    true,
                );
                write(&s.pooled, &mut o[span]);
            }
        },
    );
    out
}

/// Images per GEMM: enough that a product has at least `GROUP_COLUMNS` columns (each image
/// adds `h_out*w_out`), at most 16.
fn group_size(g: &Conv2dGeom) -> usize {
    GROUP_COLUMNS
        .div_ceil(g.l().max(1))
        .clamp(1, 16)
        .min(g.n.max(1))
}

/// Columns per group. Small groups keep a group's column matrix and convolution output near
/// L2 instead of spilling them to L3 between im2col, the GEMM's packing and the pool; that
/// outweighs packing the weight once per image. CifarNet (one image per group at 128, 7 and 2
/// at the earlier 1024), `hemi bench train`, 6 alternating runs on the 2-core Zen 3, median
/// images/s: fp32 977 (128) / 940 (256) / 770 (1024); amp-fp16 870 / 845 / 785.
const GROUP_COLUMNS: usize = 128;

/// The column matrix of images `first..first + cnt` side by side: `[c_in*kh*kw, cnt*L]`,
/// image `j`'s columns at `j*L..(j+1)*L`.
fn group_columns<T: Copy + Default>(
    x: &[T],
    g: &Conv2dGeom,
    first: usize,
    cnt: usize,
    col: &mut Vec<T>,
) {
    let (l, rows, img) = (g.l(), g.c_in * g.kh * g.kw, g.in_image());
    let ld = cnt * l;
    col.resize(rows * ld, T::default());
    for j in 0..cnt {
        let xi = &x[(first + j) * img..(first + j + 1) * img];
        im2col_ld(xi, &mut col[j * l..], ld, g);
    }
}

/// Gradients of the block: the input gradient in the tensors' dtype (when wanted), and the
/// weight and bias gradients in F32.
pub struct Grads {
    /// The input gradient in the tensors' dtype, when asked for.
    pub dx: Option<CpuStorage>,
    /// The weight gradient `[c_out, c_in/groups, kh, kw]`, row-major, in F32.
    pub dw: Vec<f32>,
    /// The bias gradient `[c_out]`, in F32.
    pub db: Vec<f32>,
}

/// One run's partial (weight, bias) gradients.
type Partial = (Vec<f32>, Vec<f32>);

/// Per-thread scratch of the backward: the group's masked output gradient and column
/// matrix in the tensors' dtype, the F32 column gradient (F16/BF16; F32 reuses the column
/// matrix) and one F32 input-gradient image.
struct BwdScratch<T> {
    dy: Vec<T>,
    col: Vec<T>,
    dcol: Vec<f32>,
    dx: Vec<f32>,
}

impl<T> Default for BwdScratch<T> {
    fn default() -> Self {
        BwdScratch {
            dy: Vec::new(),
            col: Vec::new(),
            dcol: Vec::new(),
            dx: Vec::new(),
        }
    }
}

/// Backward of the block from the pooled output gradient `dy`, the forward's window
/// indices, its input and its weight, all contiguous and of one dtype `T` (F32, F16 or
/// BF16).
///
/// The batch is cut into runs of whole GEMM groups fixed by the batch size (`Runs`, not by
/// the thread count); each run sums its weight and bias gradients into its own buffers,
/// added in run order afterwards, so the result is the same on any number of threads.
pub fn backward<T: WithDType>(
    dy: &[T],
    idx: &[u8],
    x: &[T],
    w: &[T],
    g: &Conv2dGeom,
    want_dx: bool,
) -> Grads {
    backward_as(dy, idx, x, w, g, want_dx)
}

fn backward_as<T: WithDType>(
    dy: &[T],
    idx: &[u8],
    x: &[T],
    w: &[T],
    g: &Conv2dGeom,
    want_dx: bool,
) -> Grads {
    // Runs start on group boundaries, so each run's groups are the forward's groups.
    let runs = Runs::new(g.n, group_size(g), 1);
    let (dx, partials) = if want_dx {
        let mut dx = vec![T::default(); g.n * g.in_image()];
        let p = backward_runs(dy, idx, x, w, g, runs, Some(&mut dx));
        (Some(CpuStorage::from_vec(dx)), p)
    } else {
        (None, backward_runs(dy, idx, x, w, g, runs, None))
    };
    let (pw, pb): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    Grads {
        dx,
        dw: add_in_order(pw, g.weight_len()),
        db: add_in_order(pb, g.c_out),
    }
}

/// The runs of the backward: each returns its partial (dw, db); `dx` (when wanted) is
/// written image by image.
fn backward_runs<T: WithDType>(
    dy: &[T],
    idx: &[u8],
    x: &[T],
    w: &[T],
    g: &Conv2dGeom,
    runs: Runs,
    dx: Option<&mut [T]>,
) -> Vec<Partial> {
    let single = runs.count == 1;
    let gs = group_size(g);
    // Scratch is per rayon task, reused by the runs the task takes (it holds no results).
    let run = |s: &mut BwdScratch<T>, r: usize, dx_run: Option<&mut [T]>| {
        let mut dw = vec![0f32; g.weight_len()];
        let mut db = vec![0f32; g.c_out];
        let mut dx_run = dx_run;
        let std::ops::Range { start, end } = runs.range(r, g.n);
        let mut first = start;
        while first < end {
            let cnt = gs.min(end - first);
            let local = first - start;
            let dxg = dx_run
                .as_deref_mut()
                .map(|d| &mut d[local * g.in_image()..(local + cnt) * g.in_image()]);
            let grads = (&mut dw[..], &mut db[..], dxg);
            group_backward(dy, idx, x, w, g, first..first + cnt, s, grads, single);
            first += cnt;
        }
        (dw, db)
    };
    crate::threads::nudge();
    match dx {
        Some(dx) if g.in_image() > 0 => map_chunks(
            dx,
            runs.len * g.in_image(),
            BwdScratch::default,
            &|s, r, d| run(s, r, Some(d)),
        ),
        _ => runs.map_init(BwdScratch::default, |s, r| run(s, r, None)),
    }
}

/// Where a group's backward adds its weight and bias gradients (F32) and writes its input
/// gradient (when wanted).
type GroupGrads<'a, T> = (&'a mut [f32], &'a mut [f32], Option<&'a mut [T]>);

/// Images `images` of the backward, side by side: their masked output gradients rebuilt
/// in scratch as one `[c_out, cnt*L]` matrix (the gradient's own values, so exact in its
/// dtype), then `dw += dy · colᵀ` (one product over all their pixels), `db += Σ dy`, and,
/// when wanted, `dx = col2im(wᵀ · dy)` image by image.
#[allow(clippy::too_many_arguments)]
fn group_backward<T: WithDType>(
    dy: &[T],
    idx: &[u8],
    x: &[T],
    w: &[T],
    g: &Conv2dGeom,
    images: std::ops::Range<usize>,
    s: &mut BwdScratch<T>,
    (dw, db, dx): GroupGrads<'_, T>,
    par: bool,
) {
    let pooled = pooled_image(g);
    let (ho, wo) = (g.h_out, g.w_out);
    let (ph, pw) = (ho / 2, wo / 2);
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let (first, cnt) = (images.start, images.len());
    let ld = cnt * l;
    s.dy.clear();
    s.dy.resize(g.c_out * ld, T::default());
    for j in 0..cnt {
        let i = first + j;
        let dyp = &dy[i * pooled..(i + 1) * pooled];
        let ix = &idx[i * pooled..(i + 1) * pooled];
        for c in 0..g.c_out {
            let plane = &mut s.dy[c * ld + j * l..c * ld + (j + 1) * l];
            for r in 0..ph {
                for q in 0..pw {
                    let o = (c * ph + r) * pw + q;
                    // Branch-free (whether a window passes a gradient is data): a masked
                    // window writes 0 into its own first cell, which is 0 already.
                    let t = ix[o];
                    let pass = t != MASKED;
                    let t = if pass { t as usize } else { 0 };
                    let v = if pass { dyp[o] } else { T::default() };
                    plane[(2 * r + (t >> 1)) * wo + 2 * q + (t & 1)] = v;
                }
            }
        }
    }
    for (b, row) in db.iter_mut().zip(s.dy.chunks_exact(ld)) {
        *b += sum(row);
    }
    group_columns(x, g, first, cnt, &mut s.col);
    for grp in 0..g.groups {
        let a = MatRef::row_major(&s.dy[grp * m * ld..], m, ld);
        let bt = MatRef::row_major(&s.col[grp * k * ld..], k, ld).t();
        product(&mut dw[grp * m * k..(grp + 1) * m * k], a, bt, true, par);
    }
    if let Some(dx) = dx {
        // wᵀ · dy, in F32: into the spent column matrix when that is F32, else a buffer of
        // its own.
        let dcol: &mut [f32] = match same_slice_mut::<T, f32>(&mut s.col) {
            Some(col) => col,
            None => {
                s.dcol.resize(g.groups * k * ld, 0.0);
                &mut s.dcol
            }
        };
        for grp in 0..g.groups {
            let wt = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k).t();
            let b = MatRef::row_major(&s.dy[grp * m * ld..], m, ld);
            let dst = &mut dcol[grp * k * ld..(grp + 1) * k * ld];
            product(dst, wt, b, false, par);
        }
        s.dx.resize(g.in_image(), 0.0);
        for (j, dxi) in dx.chunks_exact_mut(g.in_image()).enumerate().take(cnt) {
            s.dx.fill(0.0);
            col2im_ld(&dcol[j * l..], &mut s.dx, ld, g);
            write(&s.dx, dxi);
        }
    }
}
