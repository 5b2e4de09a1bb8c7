//! Parallel sums whose order is fixed by the shapes, never by the thread pool: the items
//! (images of a batch, rows of a layer norm) are cut into runs whose length is a function of
//! the item count only, each run sums its items in order into its own partial, and the
//! partials are added in run order. The result is the same bits on 1, 2 or 64 threads, so a
//! run resumed with another `--threads` continues exactly (issue 11; PyTorch does not
//! promise this).
//!
//! Why not rayon's `fold`/`reduce` or `.sum()`: they split where work-stealing happens to
//! split, so the grouping of the additions (and thus the rounding) changes with the pool
//! size and even from run to run. Splitting by `current_num_threads()` is steady within one
//! pool but still changes with its size.

use std::ops::{AddAssign, Range};

use crate::cpu::chunked::{for_each_chunk, map_collect};
use num_traits::Zero;

/// Most runs a sum is cut into. 16 divides evenly among 1, 2, 4, 8 and 16 threads, and the
/// extra cost over one partial per thread is small: at CifarNet's batch of 128, conv2's 16
/// weight-gradient partials are 4.7 MB to zero and add, against about 3 GFLOP of GEMM.
pub const MAX_RUNS: usize = 16;

/// How `n` items are cut into runs: `len` items per run (the last may be shorter), `count`
/// runs. A function of the arguments only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Runs {
    /// Items per run (the last run may be shorter).
    pub len: usize,
    /// Number of runs.
    pub count: usize,
}

impl Runs {
    /// At most `MAX_RUNS` runs of whole `unit`s (a run never cuts a unit, e.g. the images one
    /// GEMM takes together), each at least `min_len` items where `n` allows.
    pub fn new(n: usize, unit: usize, min_len: usize) -> Runs {
        let unit = unit.max(1);
        let units = n.div_ceil(unit);
        let min_units = min_len.div_ceil(unit).max(1);
        let per_run = units.div_ceil(MAX_RUNS).max(min_units) * unit;
        Runs {
            len: per_run,
            count: n.div_ceil(per_run),
        }
    }

    /// The items of run `r`.
    pub fn range(&self, r: usize, n: usize) -> Range<usize> {
        r * self.len..((r + 1) * self.len).min(n)
    }

    /// `f(r)` for every run, in parallel, the results in run order.
    pub fn map<T: Send>(&self, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
        crate::threads::nudge();
        map_collect(self.count, 1, || (), |_, r| f(r))
    }

    /// `f(scratch, r)` for every run, in parallel, the results in run order; `init()` makes
    /// one scratch per rayon task, reused by the runs that task takes (so it must carry no
    /// result from one run to the next).
    pub fn map_init<S, T: Send>(
        &self,
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize) -> T + Sync + Send,
    ) -> Vec<T> {
        crate::threads::nudge();
        map_collect(self.count, 1, init, f)
    }

    /// `add_in_order(self.map_init(init, f), len)` without every partial alive at once:
    /// the runs are computed a wave at a time (as many as fit `WAVE_BYTES`, at least one
    /// per thread) and each wave is added into the total in run order, so the sums are the
    /// same bits. ResNet-50's last 3×3 convolution at batch 32 has 16 weight-gradient
    /// partials of 9.4 MB: all of them at once were 151 MB on top of the activations at the
    /// start of the backward.
    pub fn sum_init<S, C>(
        &self,
        len: usize,
        init: impl Fn() -> S + Sync + Send,
        f: impl Fn(&mut S, usize) -> Vec<C> + Sync + Send,
    ) -> Vec<C>
    where
        C: Copy + Zero + AddAssign + Send + Sync,
    {
        let bytes = (len * std::mem::size_of::<C>()).max(1);
        let wave = (WAVE_BYTES / bytes).max(rayon::current_num_threads());
        let mut total: Option<Vec<C>> = None;
        for start in (0..self.count).step_by(wave) {
            let end = (start + wave).min(self.count);
            crate::threads::nudge();
            let parts: Vec<Vec<C>> = map_collect(end - start, 1, &init, |s, i| f(s, start + i));
            total = Some(add_in_order(total.into_iter().chain(parts).collect(), len));
        }
        total.unwrap_or_else(|| vec![C::zero(); len])
    }
}

/// The partials `Runs::sum_init` keeps alive at once beyond one per thread.
#[doc(hidden)]
pub const WAVE_BYTES: usize = 16 << 20;

/// Elements per parallel task of `add_in_order`.
#[doc(hidden)]
pub const ADD_CHUNK: usize = 1 << 14;

/// `out[i] = ((p0[i] + p1[i]) + p2[i]) + ...`: the partials added in run order, element by
/// element (so splitting the elements over threads does not change any sum), or `len` zeros
/// when there are none. Every partial holds `len` elements.
pub fn add_in_order<C>(partials: Vec<Vec<C>>, len: usize) -> Vec<C>
where
    C: Copy + Zero + AddAssign + Send + Sync,
{
    let mut it = partials.into_iter();
    let Some(mut out) = it.next() else {
        return vec![C::zero(); len];
    };
    let rest: Vec<Vec<C>> = it.collect();
    debug_assert!(out.len() == len && rest.iter().all(|p| p.len() == len));
    let add = |start: usize, o: &mut [C]| {
        for p in &rest {
            for (d, &v) in o.iter_mut().zip(&p[start..]) {
                *d += v;
            }
        }
    };
    if len * rest.len() < 4 * ADD_CHUNK {
        add(0, &mut out);
    } else {
        crate::threads::nudge();
        for_each_chunk(&mut out, ADD_CHUNK, &|i, o| add(i * ADD_CHUNK, o));
    }
    out
}
