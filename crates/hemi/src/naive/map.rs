//! `MapOps` and `ReduceOps` of the naive backend: the op table's f64 definitions element by
//! element, and reductions accumulated in f64 (rules in the module doc of `naive`).

use super::{round, NaiveStorage};
use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::View;
use crate::backend::reduce::{ReduceOp, ReduceOps, Rows};
use crate::dtype::DType;
use crate::error::Result;
use crate::rng::{keep53, threshold53, Generator};
use crate::tensor::Layout;

/// `op` with its scalars rounded into the compute type `c`, as a kernel receives them.
fn scalars_in(op: UnaryOp, c: DType) -> UnaryOp {
    let r = |x: f64| round(x, c);
    match op {
        UnaryOp::AddScalar(s) => UnaryOp::AddScalar(r(s)),
        UnaryOp::MulScalar(s) => UnaryOp::MulScalar(r(s)),
        UnaryOp::PowScalar(p) => UnaryOp::PowScalar(r(p)),
        UnaryOp::Clamp(lo, hi) => UnaryOp::Clamp(r(lo), r(hi)),
        op => op,
    }
}

/// `op'` from the saved value `s`: the output `y` where `op.backward_uses_output()`, else
/// the input `x` (the op table's derivative; `x^0` has slope 0 everywhere).
fn slope(op: UnaryOp, s: f64) -> f64 {
    match op {
        UnaryOp::Exp => s,
        UnaryOp::Sqrt => 0.5 / s,
        UnaryOp::Sigmoid => s * (1.0 - s),
        UnaryOp::Tanh => 1.0 - s * s,
        UnaryOp::PowScalar(0.0) => 0.0,
        op => op.derivative(s),
    }
}

/// The share of the gradient `a` gets in `maximum`/`minimum` (`op`): 1 where `a` wins, 0
/// where `b` wins, 1/2 on ties.
fn minmax_weight(op: BinaryOp, a: f64, b: f64) -> f64 {
    if a == b {
        0.5
    } else if (a > b) == (op == BinaryOp::Maximum) {
        1.0
    } else {
        0.0
    }
}

impl MapOps for NaiveStorage {
    fn binary(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (a, b) = (self.read_in(la, c), rhs.read_in(lb, c));
        let y = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| op.reference(x, y))
            .collect();
        Ok(NaiveStorage::mapped(y, out))
    }

    fn minmax_backward(
        &self,
        lg: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        op: BinaryOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        let c = out.compute_type();
        let (g, a, b) = (self.read_in(lg, c), a.read_in(la, c), b.read_in(lb, c));
        let (mut ga, mut gb) = (Vec::with_capacity(g.len()), Vec::with_capacity(g.len()));
        for i in 0..g.len() {
            let w = minmax_weight(op, a[i], b[i]);
            ga.push(g[i] * w);
            gb.push(g[i] * (1.0 - w));
        }
        Ok((NaiveStorage::mapped(ga, out), NaiveStorage::mapped(gb, out)))
    }

    fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self> {
        let c = out.compute_type();
        let op = scalars_in(op, c);
        let y = self
            .read_in(layout, c)
            .into_iter()
            .map(|x| op.reference(x))
            .collect();
        Ok(NaiveStorage::mapped(y, out))
    }

    fn unary_backward(
        &self,
        lg: &Layout,
        saved: &Self,
        ls: &Layout,
        op: UnaryOp,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let op = scalars_in(op, c);
        let (g, s) = (self.read_in(lg, c), saved.read_in(ls, c));
        let dx = g.iter().zip(&s).map(|(&g, &s)| g * slope(op, s)).collect();
        Ok(NaiveStorage::mapped(dx, out))
    }

    fn where_cond(
        &self,
        lc: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let cond = self.read(lc);
        let (a, b) = (a.read_in(la, c), b.read_in(lb, c));
        let y = (0..cond.len())
            .map(|i| if cond[i] != 0.0 { a[i] } else { b[i] })
            .collect();
        Ok(NaiveStorage::mapped(y, out))
    }

    fn dropout_mask(n: usize, p: f64, rng: &mut Generator, dtype: DType) -> Result<Self> {
        if p == 1.0 {
            return Ok(NaiveStorage::from_f64(vec![0.0; n], dtype));
        }
        let (seed, threshold) = (rng.next_u64(), threshold53(p));
        let scale = 1.0 / (1.0 - p);
        let mask = (0..n as u64)
            .map(|i| {
                if keep53(seed, i, threshold) {
                    scale
                } else {
                    0.0
                }
            })
            .collect();
        Ok(NaiveStorage::mapped(mask, dtype))
    }
}

/// The extreme of `values` (`Max` or `Min`) and its position: the first on ties, the first
/// NaN if any.
fn extreme(op: ReduceOp, values: impl Iterator<Item = f64>) -> (f64, usize) {
    let (mut best, mut at) = (f64::NAN, usize::MAX);
    for (k, v) in values.enumerate() {
        if v.is_nan() {
            return (v, k);
        }
        let better = match op {
            ReduceOp::Max => v > best,
            _ => v < best,
        };
        if at == usize::MAX || better {
            (best, at) = (v, k);
        }
    }
    (best, at)
}

/// Two passes in f64: the mean, then the squared deviations from it, over `n - correction`.
fn variance(run: &[f64], correction: usize) -> f64 {
    if run.is_empty() {
        return f64::NAN;
    }
    let mean = run.iter().sum::<f64>() / run.len() as f64;
    let ss: f64 = run.iter().map(|&x| (x - mean) * (x - mean)).sum();
    ss / run.len().saturating_sub(correction) as f64
}

impl ReduceOps for NaiveStorage {
    fn reduce(
        &self,
        layout: &Layout,
        outer: usize,
        inner: usize,
        op: ReduceOp,
        out: DType,
    ) -> Result<Self> {
        let x = self.read_in(layout, out.compute_type());
        let y = (0..outer)
            .map(|o| {
                let run = &x[o * inner..(o + 1) * inner];
                match op {
                    ReduceOp::Sum => run.iter().sum(),
                    ReduceOp::Mean => run.iter().sum::<f64>() * (1.0 / inner as f64),
                    ReduceOp::Max | ReduceOp::Min => extreme(op, run.iter().copied()).0,
                    ReduceOp::Var { correction } => variance(run, correction),
                }
            })
            .collect();
        Ok(NaiveStorage::from_f64(y, out))
    }

    fn extreme_backward(
        &self,
        layout: &Layout,
        (m, lm): View<'_, Self>,
        (g, lg): View<'_, Self>,
        (outer, inner): (usize, usize),
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (x, m, g) = (self.read_in(layout, c), m.read_in(lm, c), g.read_in(lg, c));
        let hit = |x: f64, m: f64| x == m || (x.is_nan() && m.is_nan());
        let mut dx = vec![0.0; outer * inner];
        for o in 0..outer {
            let run = o * inner..(o + 1) * inner;
            let ties = x[run.clone()].iter().filter(|&&v| hit(v, m[o])).count();
            for i in run {
                if hit(x[i], m[o]) {
                    dx[i] = g[o] / ties as f64;
                }
            }
        }
        Ok(NaiveStorage::mapped(dx, out))
    }

    fn extreme_dim(
        &self,
        layout: &Layout,
        rows: Rows,
        op: ReduceOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        let x = self.read_in(layout, out.compute_type());
        let (mut values, mut index) = (Vec::new(), Vec::new());
        for r in 0..rows.count() {
            let start = rows.start(r);
            let (v, k) = extreme(op, (0..rows.len).map(|k| x[start + k * rows.inner]));
            values.push(v);
            index.push(k as f64);
        }
        Ok((
            NaiveStorage::from_f64(values, out),
            NaiveStorage::exact(index, DType::I64),
        ))
    }

    fn extreme_dim_backward(
        &self,
        lg: &Layout,
        index: &Self,
        li: &Layout,
        rows: Rows,
        out: DType,
    ) -> Result<Self> {
        let (g, at) = (self.read_in(lg, out.compute_type()), index.read(li));
        let mut dx = vec![0.0; rows.count() * rows.len];
        for r in 0..rows.count() {
            dx[rows.start(r) + at[r] as usize * rows.inner] = g[r];
        }
        Ok(NaiveStorage::mapped(dx, out))
    }
}
