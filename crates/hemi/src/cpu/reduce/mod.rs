//! The CPU's reductions: eight-lane sums (which vectorise and keep the rounding error of
//! long sums near that of pairwise summation), extrema with their indices, the shifted
//! two-pass variance, and softmax rows. Rows are split over the thread pool above
//! `PAR_THRESHOLD` elements; each row is reduced by one thread in a fixed order, so results
//! do not depend on the thread count.

pub mod loss;

use crate::cpu::chunked::{chunk, for_each_chunk, map_collect};
#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use crate::backend::reduce::{ReduceOp, Rows};
use crate::cpu::elementwise::map::PAR_THRESHOLD;
use crate::cpu::storage::CpuStorage;
use crate::dtype::{convert, same_slice_mut, FloatDType};
use crate::tensor::Layout;

/// Sum of a contiguous slice with eight accumulators.
#[inline(always)]
#[doc(hidden)]
pub fn sum_slice<C: FloatDType>(x: &[C]) -> C {
    let mut acc = [C::zero(); 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &r in rem {
        s += r;
    }
    s
}

/// Where `layout` (the reduced dims last, as `ops::reduce` permutes them) addresses a
/// contiguous block of memory in which the reduced dims come first, i.e. element (o, i) of
/// the [outer, inner] view lies at `base + i*outer + o`: the offset `base`. This is a sum over
/// leading dims (a bias gradient, `sum_to_shape` after a broadcast), which otherwise costs a
/// transposing gather of the whole input.
fn leading_reduction(layout: &Layout, outer: usize, inner: usize) -> Option<usize> {
    let (shape, strides) = (layout.shape(), layout.strides());
    if outer <= 1 || inner <= 1 {
        return None;
    }
    let mut prefix = 1;
    let q = (0..=shape.len()).find(|&q| {
        let found = prefix == outer;
        if q < shape.len() {
            prefix *= shape[q];
        }
        found
    })?;
    // Contiguous strides of the kept dims (scale 1) and of the reduced ones (scale outer);
    // dims of size 1 have no say.
    let fits = |dims: std::ops::Range<usize>, scale: usize| {
        let mut expect = scale;
        for d in dims.rev() {
            if shape[d] != 1 && strides[d] != expect {
                return false;
            }
            expect *= shape[d];
        }
        true
    };
    (fits(0..q, 1) && fits(q..shape.len(), outer)).then_some(layout.offset())
}

/// `out[o] = Σ_i x[base + i*outer + o]` for o < outer, i < inner, in the compute type: rows
/// converted a block of columns at a time and added in order, in partial sums of 64 rows
/// added in order (error near that of a 64-way blocked sum). Each column is summed by one
/// thread in the same order, whatever the thread count.
fn column_sums<C: FloatDType>(x: &CpuStorage, base: usize, outer: usize, inner: usize) -> Vec<C> {
    const COLS: usize = 256;
    const ROWS: usize = 64;
    let mut out = vec![C::zero(); outer];
    let block = |(jb, o): (usize, &mut [C])| {
        let (j0, w) = (jb * COLS, o.len());
        let (mut part, mut buf) = ([C::zero(); COLS], [C::zero(); COLS]);
        for rows in (0..inner).step_by(ROWS) {
            part[..w].fill(C::zero());
            for i in rows..inner.min(rows + ROWS) {
                let at = base + i * outer + j0;
                let buf = &mut buf[..w];
                load_run(x, at, buf);
                part[..w]
                    .iter_mut()
                    .zip(buf.iter())
                    .for_each(|(p, &b)| *p += b);
            }
            o.iter_mut().zip(&part[..w]).for_each(|(o, &p)| *o += p);
        }
    };
    if outer * inner < PAR_THRESHOLD {
        out.chunks_mut(COLS).enumerate().for_each(block);
    } else {
        crate::threads::nudge();
        for_each_chunk(&mut out, COLS, &|i, o| block((i, o)));
    }
    out
}

/// `buf = x[at .. at + buf.len()]` in the compute type, through the bulk converters.
fn load_run<C: FloatDType>(x: &CpuStorage, at: usize, buf: &mut [C]) {
    let r = at..at + buf.len();
    if let Some(b) = C::as_f32_mut(buf) {
        match x {
            CpuStorage::F32(v) => b.copy_from_slice(&v[r]),
            CpuStorage::F16(v) => convert::f16_to_f32(&v[r], b),
            CpuStorage::BF16(v) => convert::bf16_to_f32(&v[r], b),
            CpuStorage::F64(v) => b.iter_mut().zip(&v[r]).for_each(|(o, &x)| *o = x as f32),
            CpuStorage::I64(v) => b.iter_mut().zip(&v[r]).for_each(|(o, &x)| *o = x as f32),
        }
    } else if let Some(b) = same_slice_mut::<C, f64>(buf) {
        match x {
            CpuStorage::F64(v) => b.copy_from_slice(&v[r]),
            CpuStorage::F16(v) => convert::f16_to_f64(&v[r], b),
            CpuStorage::BF16(v) => convert::bf16_to_f64(&v[r], b),
            CpuStorage::F32(v) => b.iter_mut().zip(&v[r]).for_each(|(o, &x)| *o = x.into()),
            CpuStorage::I64(v) => b.iter_mut().zip(&v[r]).for_each(|(o, &x)| *o = x as f64),
        }
    } else {
        unreachable!("compute types are f32 and f64")
    }
}

/// `out[o] = f(values[o*inner .. (o+1)*inner])` in parallel over `o`.
pub(crate) fn reduce_rows<C: FloatDType>(
    v: &[C],
    outer: usize,
    inner: usize,
    f: impl Fn(&[C]) -> C + Sync,
) -> Vec<C> {
    if inner == 0 {
        return (0..outer).map(|_| f(&[])).collect();
    }
    if v.len() < PAR_THRESHOLD {
        v.chunks(inner).map(&f).collect()
    } else {
        crate::threads::nudge();
        map_collect(
            v.len().div_ceil(inner),
            1,
            || (),
            |_, i| f(chunk(v, i, inner)),
        )
    }
}

impl Rows {
    /// `f(row)` for every row, in row order; a row is a contiguous slice when `inner == 1`
    /// and is gathered into a buffer otherwise.
    pub(crate) fn reduce<C: FloatDType, R: Copy + Default + Send>(
        &self,
        x: &[C],
        f: impl Fn(&[C]) -> R + Sync,
    ) -> Vec<R> {
        let mut out = vec![R::default(); self.count()];
        if out.is_empty() {
            return out;
        }
        if self.len == 0 {
            out.iter_mut().for_each(|o| *o = f(&[]));
            return out;
        }
        let block = self.len * self.inner;
        let body = |ob: &mut [R], xb: &[C]| {
            if self.inner == 1 {
                ob[0] = f(xb);
                return;
            }
            let mut buf = vec![C::zero(); self.len];
            for (i, o) in ob.iter_mut().enumerate() {
                for (k, b) in buf.iter_mut().enumerate() {
                    *b = xb[k * self.inner + i];
                }
                *o = f(&buf);
            }
        };
        if x.len() < PAR_THRESHOLD {
            out.chunks_mut(self.inner)
                .zip(x.chunks(block))
                .for_each(|(o, xb)| body(o, xb));
        } else {
            crate::threads::nudge();
            for_each_chunk(&mut out, self.inner, &|i, o| body(o, chunk(x, i, block)));
        }
        out
    }

    /// `f(input rows, output row)` for every row: `K` inputs laid out like the tensor give
    /// one output laid out the same way.
    pub(crate) fn map<C: FloatDType, const K: usize>(
        &self,
        ins: [&[C]; K],
        f: impl Fn([&[C]; K], &mut [C]) + Sync,
    ) -> Vec<C> {
        let n = self.count() * self.len;
        debug_assert!(ins.iter().all(|x| x.len() == n));
        let mut out = vec![C::zero(); n];
        if n == 0 {
            return out;
        }
        let block = self.len * self.inner;
        let body = |b: usize, ob: &mut [C]| {
            let base = b * block;
            if self.inner == 1 {
                f(ins.map(|x| &x[base..base + block]), ob);
                return;
            }
            let mut bufs: [Vec<C>; K] = std::array::from_fn(|_| vec![C::zero(); self.len]);
            let mut row = vec![C::zero(); self.len];
            for i in 0..self.inner {
                for (buf, x) in bufs.iter_mut().zip(&ins) {
                    for (k, v) in buf.iter_mut().enumerate() {
                        *v = x[base + k * self.inner + i];
                    }
                }
                f(std::array::from_fn(|j| &bufs[j][..]), &mut row);
                for (k, &v) in row.iter().enumerate() {
                    ob[k * self.inner + i] = v;
                }
            }
        };
        if n < PAR_THRESHOLD {
            out.chunks_mut(block)
                .enumerate()
                .for_each(|(b, ob)| body(b, ob));
        } else {
            crate::threads::nudge();
            for_each_chunk(&mut out, block, &|b, ob| body(b, ob));
        }
        out
    }
}

/// The extreme (`Max`, or `Min` for any other op) of a non-empty row and the first index
/// where it occurs; a NaN wins over every number (the first NaN).
fn find<C: FloatDType>(op: ReduceOp, r: &[C]) -> (C, usize) {
    let max = op == ReduceOp::Max;
    let (mut best, mut at) = (r[0], 0);
    for (k, &v) in r.iter().enumerate().skip(1) {
        if best.is_nan() {
            break;
        }
        let better = if max { v > best } else { v < best };
        if better || v.is_nan() {
            (best, at) = (v, k);
        }
    }
    (best, at)
}

/// The largest value of a row (NaN if any is NaN; -inf for an empty row), for softmax.
///
/// Eight running maxima in a loop that vectorises (a max is exact, so their order changes
/// nothing); `find`'s scalar loop with its NaN test per element was most of a 30522-wide
/// log-softmax (BERT's masked-LM head). A NaN or a zero maximum (whose sign is the first
/// zero's) is settled by `find` itself, so every result is `find`'s.
pub(crate) fn row_max<C: FloatDType>(r: &[C]) -> C {
    if r.is_empty() {
        return C::neg_infinity();
    }
    let mut lanes = [C::neg_infinity(); 8];
    let mut nan = false;
    let chunks = r.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
            nan |= v.is_nan();
        }
    }
    let mut m = C::neg_infinity();
    for &v in lanes.iter().chain(tail) {
        m = if v > m { v } else { m };
        nan |= v.is_nan();
    }
    if nan || m == C::zero() {
        return find(ReduceOp::Max, r).0;
    }
    m
}

/// Mean and sum of squared deviations of a row, in the compute type. The data are first
/// shifted by the row's first element, so the mean is found from small differences rather
/// than from a large running sum (1000 + noise in F32 keeps its noise); the second pass then
/// sums squared deviations from that mean, minus the corrected two-pass term
/// `(Σd)²/n` that cancels what is left of the mean's rounding error.
fn centered<C: FloatDType>(r: &[C]) -> (C, C) {
    if r.is_empty() {
        return (C::nan(), C::zero());
    }
    let n = C::from_f64(r.len() as f64);
    let shift = r[0];
    let mut lanes = [C::zero(); 8];
    for (k, &x) in r.iter().enumerate() {
        lanes[k % 8] += x - shift;
    }
    let mean = shift + sum_slice(&lanes) / n;
    let (mut s, mut ss) = ([C::zero(); 8], [C::zero(); 8]);
    for (k, &x) in r.iter().enumerate() {
        let d = x - mean;
        s[k % 8] += d;
        ss[k % 8] += d * d;
    }
    let s = sum_slice(&s);
    (mean, sum_slice(&ss) - s * s / n)
}

/// `y = exp(x - max) / Σ exp(x - max)`: subtracting the max keeps every exponent <= 0.
pub(crate) fn softmax_row<C: FloatDType>(x: &[C], y: &mut [C]) {
    let m = row_max(x);
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m).exp_fast();
    }
    let inv = C::one() / sum_slice(y);
    y.iter_mut().for_each(|y| *y *= inv);
}

/// `dx = y ⊙ (g - Σ g⊙y)`.
fn softmax_backward_row<C: FloatDType>(g: &[C], y: &[C], dx: &mut [C]) {
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = g * y;
    }
    let dot = sum_slice(dx);
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = y * (g - dot);
    }
}

/// `y = (x - max) - ln Σ exp(x - max)`: finite for logits far apart (1e4 and -1e4).
#[doc(hidden)]
pub fn log_softmax_row<C: FloatDType>(x: &[C], y: &mut [C]) {
    let m = row_max(x);
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m).exp_fast();
    }
    let lse = sum_slice(y).ln();
    for (y, &x) in y.iter_mut().zip(x) {
        *y = (x - m) - lse;
    }
}

/// `dx = g - exp(y) · Σ g`.
fn log_softmax_backward_row<C: FloatDType>(g: &[C], y: &[C], dx: &mut [C]) {
    let sg = sum_slice(g);
    for ((d, &g), &y) in dx.iter_mut().zip(g).zip(y) {
        *d = g - y.exp_fast() * sg;
    }
}

/// `op` over the `inner` values of each of `outer` rows of `x` (as `layout` addresses it) in
/// the compute type: sums and means of a leading reduction (the rows are the columns of a
/// contiguous matrix) as column sums, without gathering the transpose.
pub(crate) fn reduce_as<C: FloatDType>(
    x: &CpuStorage,
    layout: &Layout,
    outer: usize,
    inner: usize,
    op: ReduceOp,
) -> Vec<C> {
    if let (ReduceOp::Sum | ReduceOp::Mean, Some(base)) =
        (op, leading_reduction(layout, outer, inner))
    {
        let mut y = column_sums::<C>(x, base, outer, inner);
        if op == ReduceOp::Mean {
            let scale = C::one() / C::from_f64(inner as f64);
            y.iter_mut().for_each(|v| *v *= scale);
        }
        return y;
    }
    let v = x.load::<C>(layout);
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            let scale = if op == ReduceOp::Mean {
                C::one() / C::from_f64(inner as f64)
            } else {
                C::one()
            };
            reduce_rows(&v, outer, inner, |r| sum_slice(r) * scale)
        }
        ReduceOp::Max | ReduceOp::Min => reduce_rows(&v, outer, inner, |r| find(op, r).0),
        ReduceOp::Var { correction } => {
            let divisor = C::from_f64(inner.saturating_sub(correction) as f64);
            reduce_rows(&v, outer, inner, |r| centered(r).1 / divisor)
        }
    }
}

/// The gradient of a max or min over rows of `inner` values: each row's `g` split evenly
/// among the elements equal to the row's extreme `m`.
pub(crate) fn extreme_grads<D: FloatDType>(
    xv: &[D],
    mv: &[D],
    gv: &[D],
    outer: usize,
    inner: usize,
) -> Vec<D> {
    let mut gi = vec![D::zero(); outer * inner];
    if inner > 0 {
        // Both are exact values of the input dtype, so `==` finds the winners; the count of
        // ties is exact in any order.
        let hit = |x: D, m: D| x == m || (x.is_nan() && m.is_nan());
        for ((gr, r), (&m, &g)) in gi
            .chunks_mut(inner)
            .zip(xv.chunks(inner))
            .zip(mv.iter().zip(gv.iter()))
        {
            let ties = r.iter().filter(|&&x| hit(x, m)).count();
            let t = D::from_f64(ties as f64);
            for (d, &x) in gr.iter_mut().zip(r) {
                *d = if hit(x, m) { g / t } else { D::zero() };
            }
        }
    }
    gi
}

/// The gradient of the variance of rows of `inner` values with `divisor` (`inner -
/// correction`): d var / d x_i = 2 (x_i - mean) / divisor (the mean's own dependence on x_i
/// sums to zero).
pub(crate) fn var_grads<C: FloatDType>(
    xv: &[C],
    gv: &[C],
    outer: usize,
    inner: usize,
    divisor: f64,
) -> Vec<C> {
    let two = C::from_f64(2.0) / C::from_f64(divisor);
    let mut gi = vec![C::zero(); outer * inner];
    if inner > 0 {
        gi.chunks_mut(inner)
            .zip(xv.chunks(inner))
            .zip(gv.iter())
            .for_each(|((o, r), &g)| {
                let mean = centered(r).0;
                for (o, &x) in o.iter_mut().zip(r) {
                    *o = g * two * (x - mean);
                }
            });
    }
    gi
}

/// The max or min (`op`) of every row and its index in the row.
pub(crate) fn extreme_rows<C: FloatDType>(rows: Rows, x: &[C], op: ReduceOp) -> (Vec<C>, Vec<i64>) {
    let found: Vec<(C, usize)> = rows.reduce(x, |r| find(op, r));
    let index: Vec<i64> = found.iter().map(|&(_, k)| k as i64).collect();
    let values: Vec<C> = found.iter().map(|&(v, _)| v).collect();
    (values, index)
}

/// The gradient of `extreme_rows`: the whole gradient goes to the element each output came
/// from (`at`, its index in its row).
pub(crate) fn extreme_rows_grads<D: FloatDType>(rows: Rows, gv: &[D], at: &[i64]) -> Vec<D> {
    let mut gi = vec![D::zero(); rows.count() * rows.len];
    for (r, (&k, &g)) in at.iter().zip(gv.iter()).enumerate() {
        gi[rows.start(r) + k as usize * rows.inner] = g;
    }
    gi
}

/// Softmax (or log-softmax, `log`) of every row.
pub(crate) fn softmax_rows<C: FloatDType>(rows: Rows, xv: &[C], log: bool) -> Vec<C> {
    rows.map([xv], |[x], y| {
        if log {
            log_softmax_row(x, y)
        } else {
            softmax_row(x, y)
        }
    })
}

/// The input gradient of `softmax_rows` from the output gradient `g` and the output `y`.
pub(crate) fn softmax_backward_rows<C: FloatDType>(
    rows: Rows,
    gv: &[C],
    yv: &[C],
    log: bool,
) -> Vec<C> {
    rows.map([gv, yv], |[g, y], dx| {
        if log {
            log_softmax_backward_row(g, y, dx)
        } else {
            softmax_backward_row(g, y, dx)
        }
    })
}
