//! Bucketed gradient averaging overlapped with the backward (PyTorch DDP's `Reducer`).

use std::sync::{Arc, Mutex};

use super::zero::{ZeroShard, ZeroStage};
use super::{ProcessGroup, Wire, Work};
use crate::autograd::{register_post_accumulate_grad_hook, HookHandle};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How gradients are bucketed and sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReducerConfig {
    /// The dtype on the wire (default F32).
    pub wire: Wire,
    /// A bucket closes once its gradients reach this many F32 bytes (default 25 MiB,
    /// DDP's `bucket_cap_mb=25`); a larger parameter gets a bucket of its own.
    pub bucket_bytes: usize,
}

impl Default for ReducerConfig {
    fn default() -> Self {
        ReducerConfig {
            wire: Wire::F32,
            bucket_bytes: 25 << 20,
        }
    }
}

struct State {
    /// Per bucket: parameters whose gradient is not complete yet.
    pending: Vec<usize>,
    /// Per parameter: its gradient is complete in this backward.
    ready: Vec<bool>,
    /// The next bucket to launch (buckets launch in order, the same on every rank).
    next: usize,
    works: Vec<Option<Pending>>,
    /// Per parameter: the dtype of its gradient when its bucket launched (ZeRO stage 2
    /// drops the whole gradient then).
    dtypes: Vec<DType>,
    /// Hooks launch buckets only while true (false: accumulation passes, DDP's `no_sync`).
    sync: bool,
    /// The first error a hook met; `finish` reports it.
    error: Option<String>,
}

/// A bucket's reduction in flight.
enum Pending {
    /// The all-reduce: the whole bucket's sums.
    All(Work<Vec<f32>>),
    /// ZeRO stage 2's reduce-scatter: this rank's chunk (its start, its sums).
    Scatter(Work<(usize, Vec<f32>)>),
}

struct Shared {
    group: Arc<ProcessGroup>,
    /// ZeRO: the shard whose gradients `finish` sets from the rank's chunk of each bucket.
    zero: Option<Arc<ZeroShard>>,
    params: Vec<Tensor>,
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
    wire: Wire,
    state: Mutex<State>,
}

/// Averages the gradients of `params` over the ranks of a group after every backward.
///
/// Parameters are cut into buckets in reverse order (the order a backward completes their
/// gradients in); a post-accumulate-grad hook on each parameter launches its bucket's
/// all-reduce on the group's communication thread as soon as the bucket's last gradient is
/// complete and every earlier bucket has launched, so communication overlaps the rest of
/// the backward. [`GradReducer::finish`], called after the backward, launches what is left
/// (a parameter without a gradient counts as zeros), waits, and replaces each gradient with
/// the average (the sum in F32, divided by N in F32, stored in the gradient's dtype).
pub struct GradReducer {
    shared: Arc<Shared>,
    _hooks: Vec<HookHandle>,
}

impl std::fmt::Debug for GradReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradReducer")
            .field("params", &self.shared.params.len())
            .field("buckets", &self.shared.buckets)
            .field("wire", &self.shared.wire)
            .finish()
    }
}

impl GradReducer {
    /// Buckets `params` and registers the hooks (removed when the reducer drops).
    pub fn new(
        group: Arc<ProcessGroup>,
        params: Vec<Tensor>,
        cfg: ReducerConfig,
    ) -> Result<GradReducer> {
        Self::build(group, params, cfg, None)
    }

    fn build(
        group: Arc<ProcessGroup>,
        params: Vec<Tensor>,
        cfg: ReducerConfig,
        zero: Option<Arc<ZeroShard>>,
    ) -> Result<GradReducer> {
        if cfg.bucket_bytes == 0 {
            return Err(Error::arg("GradReducer", "bucket_bytes must be > 0"));
        }
        let numel: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let buckets = super::zero::buckets(&numel, cfg.bucket_bytes);
        let mut bucket_of = vec![0; params.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        let state = State {
            pending: buckets.iter().map(Vec::len).collect(),
            ready: vec![false; params.len()],
            next: 0,
            works: buckets.iter().map(|_| None).collect(),
            dtypes: params.iter().map(Tensor::dtype).collect(),
            sync: true,
            error: None,
        };
        let shared = Arc::new(Shared {
            group,
            zero,
            params,
            buckets,
            bucket_of,
            wire: cfg.wire,
            state: Mutex::new(state),
        });
        let mut hooks = Vec::with_capacity(shared.params.len());
        for (i, p) in shared.params.iter().enumerate() {
            let s = Arc::downgrade(&shared);
            hooks.push(register_post_accumulate_grad_hook(p, move |_| {
                match s.upgrade() {
                    Some(s) => s.ready(i),
                    None => Ok(()),
                }
            })?);
        }
        Ok(GradReducer {
            shared,
            _hooks: hooks,
        })
    }

    /// A reducer for ZeRO (`zero`'s stage): `finish` also sets the gradients of the
    /// shard's tensors from this rank's chunk of every bucket. Stage 1 all-reduces and keeps
    /// the whole averaged gradients on the parameters too; stage 2 reduce-scatters, drops each
    /// parameter's gradient as soon as its bucket is launched, and leaves the parameters
    /// without gradients. The shard must have been made for the same group, parameters and
    /// bucket size.
    pub fn with_zero(
        group: Arc<ProcessGroup>,
        params: Vec<Tensor>,
        cfg: ReducerConfig,
        zero: Arc<ZeroShard>,
    ) -> Result<GradReducer> {
        let numel: Vec<usize> = params.iter().map(Tensor::numel).collect();
        if super::zero::buckets(&numel, cfg.bucket_bytes) != zero.buckets() {
            return Err(Error::arg(
                "GradReducer::with_zero",
                "the ZeRO shard was cut from other buckets than this reducer's",
            ));
        }
        Self::build(group, params, cfg, Some(zero))
    }

    /// The parameter indices of each bucket, in launch order.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.shared.buckets
    }

    /// The process group.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.shared.group
    }

    /// With `false`, backward passes only accumulate local gradients (DDP's `no_sync()`,
    /// for gradient accumulation); set it back to `true` before the last pass of a step.
    pub fn set_sync(&self, on: bool) {
        self.shared.lock().sync = on;
    }

    /// Launches the buckets not launched yet, waits for all, and replaces every gradient by
    /// its average over the ranks. Every rank must call it once after each synchronised
    /// backward.
    pub fn finish(&self) -> Result<()> {
        self.shared.finish()
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hook: parameter `i`'s gradient is complete.
    fn ready(&self, i: usize) -> Result<()> {
        let mut st = self.lock();
        if !st.sync {
            return Ok(());
        }
        if st.ready[i] {
            let msg = format!(
                "rank {}: the gradient of parameter {i} was completed twice before \
                 GradReducer::finish (call finish after every synchronised backward, or \
                 set_sync(false) for accumulation passes)",
                self.group.rank()
            );
            st.error.get_or_insert(msg.clone());
            return Err(Error::Msg(msg));
        }
        st.ready[i] = true;
        st.pending[self.bucket_of[i]] -= 1;
        while st.next < self.buckets.len() && st.pending[st.next] == 0 {
            let b = st.next;
            if let Err(e) = self.launch(&mut st, b) {
                st.error.get_or_insert(e.to_string());
                return Err(e);
            }
            st.next += 1;
        }
        Ok(())
    }

    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let members = &self.buckets[b];
        let total: usize = members.iter().map(|&i| self.params[i].numel()).sum();
        let mut buf = Vec::with_capacity(total);
        for &i in members {
            let p = &self.params[i];
            match p.grad() {
                Some(g) => {
                    st.dtypes[i] = g.dtype();
                    buf.extend(g.to_vec_f32());
                }
                None => {
                    st.dtypes[i] = p.dtype();
                    buf.resize(buf.len() + p.numel(), 0.0);
                }
            }
        }
        let stage2 = self.zero.as_ref().map(|z| z.stage()) == Some(ZeroStage::Two);
        st.works[b] = Some(if stage2 {
            // The copy in `buf` is all the reduction needs: free the whole gradients now.
            for &i in members {
                self.params[i].set_grad(None);
            }
            Pending::Scatter(self.group.reduce_scatter(buf, self.wire)?)
        } else {
            Pending::All(self.group.all_reduce(buf, self.wire)?)
        });
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        let mut st = self.lock();
        let result = self.finish_locked(&mut st);
        // Ready for the next backward whatever happened.
        st.pending = self.buckets.iter().map(Vec::len).collect();
        st.ready.iter_mut().for_each(|r| *r = false);
        st.next = 0;
        st.works.iter_mut().for_each(|w| *w = None);
        result
    }

    fn finish_locked(&self, st: &mut State) -> Result<()> {
        if let Some(e) = st.error.take() {
            return Err(Error::Msg(e));
        }
        while st.next < self.buckets.len() {
            let b = st.next;
            self.launch(st, b)?;
            st.next += 1;
        }
        let n = self.group.size() as f32;
        for (b, members) in self.buckets.iter().enumerate() {
            let work = st.works[b].take().expect("every bucket launched");
            let sum = match work {
                Pending::All(w) => w.wait()?,
                Pending::Scatter(w) => {
                    let (_, own) = w.wait()?;
                    let z = self.zero.as_ref().expect("stage 2 has a shard");
                    z.set_bucket_grads(b, &own, &st.dtypes)?;
                    continue;
                }
            };
            if let Some(z) = &self.zero {
                let (ranks, rank) = (self.group.size(), self.group.rank());
                let own = super::ring::chunk(sum.len(), ranks, (rank + 1) % ranks);
                z.set_bucket_grads(b, &sum[own], &st.dtypes)?;
            }
            let mut at = 0;
            for &i in members {
                let p = &self.params[i];
                let len = p.numel();
                let avg: Vec<f32> = sum[at..at + len].iter().map(|&x| x / n).collect();
                at += len;
                p.set_grad(Some(Tensor::from_f32_vec(avg, p.shape(), st.dtypes[i])?));
            }
        }
        Ok(())
    }
}
