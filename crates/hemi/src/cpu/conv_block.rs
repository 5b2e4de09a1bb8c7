//! Convolution, bias, ReLU and a 2×2 stride-2 max-pool as one kernel, image by image: the
//! block every small CNN repeats (`pool(relu(conv(x)))`).
//!
//! Run as three ops, the block writes the convolution's output for the whole batch, reads it
//! back for the ReLU, writes that, reads it back for the pool, and on the way back scatters
//! the pooled gradient into a full-size zeroed buffer, masks it with the ReLU into another,
//! and only then runs the convolution's backward: five full-size passes over memory per
//! direction (at batch 128, CifarNet's first block is 29 MB per pass). Here each image's
//! convolution output exists only in an L2-sized scratch buffer while it is pooled; the
//! backward rebuilds each image's masked output gradient in scratch and runs the weight,
//! bias and input gradients from it at once. The batch never exists at full resolution, in
//! time or in memory.
//!
//! The maths is the composition's: `pool(relu(y)) = relu(pool(y))` (ReLU is monotone), so
//! the pool runs on the convolution's F32 output and the ReLU on the pooled value; a pooled
//! value that is not positive passes no gradient (ReLU's derivative there is 0), which the
//! window index records as `MASKED`. For F16/BF16 tensors the images are converted to F32
//! one at a time and the pooled output is rounded once, as the unfused ops round it.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::cpu::chunked::Src;
use crate::cpu::conv::{columns, image_backward_input, image_forward, Conv2dGeom};
use crate::cpu::gemm::{matmul_into_par, MatRef};
use crate::dtype::{convert, DType};
use crate::ops::reduce::sum_slice;
use crate::tensor::CpuStorage;

/// Window index of a pooled value whose ReLU is zero (or NaN): no gradient flows back.
pub const MASKED: u8 = u8::MAX;

/// Output of the block: `[n, c_out, h_out / 2, w_out / 2]` (the pool drops an odd last row
/// or column, as PyTorch's floor mode does).
pub fn pooled_shape(g: &Conv2dGeom) -> [usize; 4] {
    [g.n, g.c_out, g.h_out / 2, g.w_out / 2]
}

fn pooled_image(g: &Conv2dGeom) -> usize {
    g.c_out * (g.h_out / 2) * (g.w_out / 2)
}

/// A buffer element type the F32 results are rounded into.
trait Store: Copy + Default + Send + Sync {
    fn store(src: &[f32], dst: &mut [Self]);
}

impl Store for f32 {
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Store for f16 {
    fn store(src: &[f32], dst: &mut [f16]) {
        convert::f32_to_f16(src, dst);
    }
}

impl Store for bf16 {
    fn store(src: &[f32], dst: &mut [bf16]) {
        convert::f32_to_bf16(src, dst);
    }
}

/// Per-thread scratch of the forward: one converted input image, one convolution output
/// image, the column matrix and one pooled image in F32.
#[derive(Default)]
struct FwdScratch {
    x: Vec<f32>,
    y: Vec<f32>,
    col: Vec<f32>,
    pooled: Vec<f32>,
}

/// ReLU and 2×2 pooling of one convolution output image `y [c_out, h_out, w_out]` into
/// `out [c_out, h_out/2, w_out/2]` and the window index of each maximum (row-major 0..4,
/// first maximum wins ties, the last NaN wins; `MASKED` where the ReLU gives 0 or NaN).
fn relu_pool_image(y: &[f32], out: &mut [f32], idx: &mut [u8], g: &Conv2dGeom) {
    let (ho, wo) = (g.h_out, g.w_out);
    let (ph, pw) = (ho / 2, wo / 2);
    for c in 0..g.c_out {
        let plane = &y[c * ho * wo..(c + 1) * ho * wo];
        for i in 0..ph {
            let r0 = &plane[2 * i * wo..2 * i * wo + wo];
            let r1 = &plane[(2 * i + 1) * wo..(2 * i + 1) * wo + wo];
            let base = (c * ph + i) * pw;
            for (j, (o, ix)) in out[base..base + pw]
                .iter_mut()
                .zip(&mut idx[base..base + pw])
                .enumerate()
            {
                let k = 2 * j;
                let (mut best, mut at) = (r0[k], 0u8);
                for (v, pos) in [(r0[k + 1], 1u8), (r1[k], 2), (r1[k + 1], 3)] {
                    let take = v > best || v.is_nan();
                    best = if take { v } else { best };
                    at = if take { pos } else { at };
                }
                // ReLU of the maximum: NaN stays NaN (as `relu` keeps it) and, like a
                // non-positive maximum, passes no gradient.
                let pass = best > 0.0;
                *o = if pass || best.is_nan() { best } else { 0.0 };
                *ix = if pass { at } else { MASKED };
            }
        }
    }
}

/// Forward of the block over a contiguous F32/F16/BF16 input `x [n, c_in, h, w]` with F32
/// weight and bias: the pooled output in `dtype` and the window index of every output.
pub fn forward(
    x: Src<'_>,
    w: &[f32],
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
    dtype: DType,
) -> Option<(CpuStorage, Vec<u8>)> {
    let out_len = g.n * pooled_image(g);
    let mut idx = vec![0u8; out_len];
    let storage = match dtype {
        DType::F32 => CpuStorage::F32(forward_into::<f32>(x, w, bias, g, &mut idx)),
        DType::F16 => CpuStorage::F16(forward_into::<f16>(x, w, bias, g, &mut idx)),
        DType::BF16 => CpuStorage::BF16(forward_into::<bf16>(x, w, bias, g, &mut idx)),
        _ => return None,
    };
    Some((storage, idx))
}

fn forward_into<T: Store>(
    x: Src<'_>,
    w: &[f32],
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
    idx: &mut [u8],
) -> Vec<T> {
    let pooled = pooled_image(g);
    let mut out = vec![T::default(); g.n * pooled];
    if pooled == 0 {
        return out;
    }
    out.par_chunks_mut(pooled)
        .zip(idx.par_chunks_mut(pooled))
        .enumerate()
        .for_each_init(FwdScratch::default, |s, (i, (o, ix))| {
            s.x.resize(g.in_image(), 0.0);
            s.y.resize(g.out_image(), 0.0);
            s.pooled.resize(pooled, 0.0);
            let xi = x.read(i * g.in_image(), &mut s.x);
            image_forward(xi, w, bias, &mut s.y, &mut s.col, g, false);
            relu_pool_image(&s.y, &mut s.pooled, ix, g);
            T::store(&s.pooled, o);
        });
    out
}

/// Gradients of the block: the input gradient in `dx_dtype` (when `dx_dtype` is given),
/// and the weight and bias gradients in F32.
pub struct Grads {
    pub dx: Option<CpuStorage>,
    pub dw: Vec<f32>,
    pub db: Vec<f32>,
}

/// Per-thread scratch of the backward.
#[derive(Default)]
struct BwdScratch {
    dy_pooled: Vec<f32>,
    dy: Vec<f32>,
    x: Vec<f32>,
    col: Vec<f32>,
    dx: Vec<f32>,
}

/// Backward of the block from the pooled output gradient `dy` (contiguous, F32/F16/BF16),
/// the forward's window indices, its input and its F32 weight.
///
/// The batch is split into one contiguous run of images per thread; each run sums its
/// weight and bias gradients into its own buffers, added in run order afterwards (the
/// result depends on the thread count, never on scheduling, as `conv2d`'s does).
pub fn backward(
    dy: Src<'_>,
    idx: &[u8],
    x: Src<'_>,
    w: &[f32],
    g: &Conv2dGeom,
    dx_dtype: Option<DType>,
) -> Grads {
    let runs = g.n.min(rayon::current_num_threads()).max(1);
    let per_run = g.n.div_ceil(runs).max(1);
    let (dx, partials) = match dx_dtype {
        None => (None, backward_runs::<f32>(dy, idx, x, w, g, per_run, None)),
        Some(DType::F16) => {
            let mut dx = vec![f16::ZERO; g.n * g.in_image()];
            let p = backward_runs(dy, idx, x, w, g, per_run, Some(&mut dx));
            (Some(CpuStorage::F16(dx)), p)
        }
        Some(DType::BF16) => {
            let mut dx = vec![bf16::ZERO; g.n * g.in_image()];
            let p = backward_runs(dy, idx, x, w, g, per_run, Some(&mut dx));
            (Some(CpuStorage::BF16(dx)), p)
        }
        Some(_) => {
            let mut dx = vec![0f32; g.n * g.in_image()];
            let p = backward_runs(dy, idx, x, w, g, per_run, Some(&mut dx));
            (Some(CpuStorage::F32(dx)), p)
        }
    };
    let mut it = partials.into_iter();
    let (mut dw, mut db) = it
        .next()
        .unwrap_or_else(|| (vec![0.0; g.weight_len()], vec![0.0; g.c_out]));
    for (pw, pb) in it {
        dw.iter_mut().zip(&pw).for_each(|(d, v)| *d += v);
        db.iter_mut().zip(&pb).for_each(|(d, v)| *d += v);
    }
    Grads { dx, dw, db }
}

/// The runs of the backward: each returns its partial (dw, db); `dx` (when wanted) is
/// written image by image.
fn backward_runs<T: Store>(
    dy: Src<'_>,
    idx: &[u8],
    x: Src<'_>,
    w: &[f32],
    g: &Conv2dGeom,
    per_run: usize,
    dx: Option<&mut [T]>,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    let n_runs = g.n.div_ceil(per_run);
    let single = n_runs == 1;
    let run = |r: usize, dx_run: Option<&mut [T]>| {
        let mut dw = vec![0f32; g.weight_len()];
        let mut db = vec![0f32; g.c_out];
        let mut s = BwdScratch::default();
        let mut dx_run = dx_run;
        for i in r * per_run..((r + 1) * per_run).min(g.n) {
            let local = i - r * per_run;
            let dxi = dx_run
                .as_deref_mut()
                .map(|d| &mut d[local * g.in_image()..(local + 1) * g.in_image()]);
            image_backward(dy, idx, x, w, g, i, &mut s, &mut dw, &mut db, dxi, single);
        }
        (dw, db)
    };
    match dx {
        Some(dx) if g.in_image() > 0 => dx
            .par_chunks_mut(per_run * g.in_image())
            .enumerate()
            .map(|(r, d)| run(r, Some(d)))
            .collect(),
        _ => (0..n_runs)
            .into_par_iter()
            .map(|r| run(r, None))
            .collect(),
    }
}

/// One image of the backward: the masked output gradient rebuilt in scratch, then
/// `dw += dy · colᵀ`, `db += Σ dy`, and `dx = col2im(wᵀ · dy)` when wanted.
#[allow(clippy::too_many_arguments)]
fn image_backward<T: Store>(
    dy: Src<'_>,
    idx: &[u8],
    x: Src<'_>,
    w: &[f32],
    g: &Conv2dGeom,
    i: usize,
    s: &mut BwdScratch,
    dw: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [T]>,
    par: bool,
) {
    let pooled = pooled_image(g);
    let (ho, wo) = (g.h_out, g.w_out);
    let (ph, pw) = (ho / 2, wo / 2);
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    s.dy_pooled.resize(pooled, 0.0);
    let dyp = dy.read(i * pooled, &mut s.dy_pooled);
    let ix = &idx[i * pooled..(i + 1) * pooled];
    s.dy.clear();
    s.dy.resize(g.out_image(), 0.0);
    for c in 0..g.c_out {
        for r in 0..ph {
            for q in 0..pw {
                let o = (c * ph + r) * pw + q;
                let t = ix[o];
                if t != MASKED {
                    let (dr, dc) = ((t >> 1) as usize, (t & 1) as usize);
                    s.dy[c * l + (2 * r + dr) * wo + 2 * q + dc] = dyp[o];
                }
            }
        }
    }
    for (b, row) in db.iter_mut().zip(s.dy.chunks_exact(l)) {
        *b += sum_slice(row);
    }
    s.x.resize(g.in_image(), 0.0);
    let xi = x.read(i * g.in_image(), &mut s.x);
    let col = columns(xi, &mut s.col, g);
    for grp in 0..g.groups {
        let a = MatRef::row_major(&s.dy[grp * m * l..(grp + 1) * m * l], m, l);
        let bt = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l).t();
        matmul_into_par(&mut dw[grp * m * k..(grp + 1) * m * k], a, bt, true, par);
    }
    if let Some(dx) = dx {
        s.dx.clear();
        s.dx.resize(g.in_image(), 0.0);
        let mut col_scratch = std::mem::take(&mut s.col);
        image_backward_input(&s.dy, w, &mut s.dx, &mut col_scratch, g, par);
        s.col = col_scratch;
        T::store(&s.dx, dx);
    }
}
