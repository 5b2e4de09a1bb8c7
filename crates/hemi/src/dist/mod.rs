//! Data-parallel training across processes: PyTorch's `DistributedDataParallel`, on MPI.
//!
//! N processes (ranks) each hold a replica of the model and train on every N-th sample
//! (`data::Shard`, PyTorch's `DistributedSampler`). After each backward the replicas'
//! gradients are averaged, so every rank takes the same optimizer step and the replicas stay
//! equal. The pieces, bottom to top:
//!
//! - [`Transport`]: one primitive, a paired send/receive of bytes between two ranks with a
//!   deadline. [`mpi::MpiTransport`] (cargo feature `mpi`) is MPI point-to-point
//!   (`MPI_Isend`/`MPI_Irecv`, polled so that a waiting rank sleeps instead of spinning a
//!   core); [`LocalTransport`] connects threads of one process, for tests.
//! - [`ring`]: the collectives hemi needs, written over that primitive: a ring all-reduce
//!   (reduce-scatter, then all-gather) whose additions happen in a fixed order for a given
//!   N, in F32, whatever dtype travels on the wire ([`Wire`]: F32, F16 pre-scaled by a power
//!   of two so the sums neither overflow nor underflow, or BF16), and an all-gather of byte
//!   strings. MPI's own `MPI_Allreduce` promises neither the order nor half-precision
//!   types, which is why the reduction is ours and only the transport is MPI's.
//! - [`ProcessGroup`]: a communication thread that owns the transport and runs collectives
//!   in submission order, so a bucket's all-reduce proceeds while the backward goes on.
//!   Every wait has a deadline: a rank that died or hangs makes the others fail with an
//!   error naming it, not wait forever.
//! - [`GradReducer`]: buckets of about 25 MB of gradients in reverse parameter order,
//!   launched from post-accumulate-grad hooks as soon as every gradient of a bucket is
//!   complete (and the buckets before it launched), averaged and written back by
//!   [`GradReducer::finish`].
//!
//! - [`zero`]: ZeRO stages 1 and 2: the optimizer state, F32 masters and (stage 2) reduced
//!   gradients of each rank's shard only, with the bits of plain data parallel.
//!
//! The training loop (`train::train` with `TrainConfig::dist`) adds the rest: a check at
//! start that every rank runs the same configuration on the same initial parameters, the
//! GradScaler's found-inf flag and the stop flag reduced across ranks, evaluation sharded
//! and summed, checkpoints written by rank 0 only.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
mod reducer;
pub mod ring;
mod sync;
pub mod zero;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use local::LocalTransport;
pub use reducer::{GradReducer, ReducerConfig};
pub use sync::{all_reduce_sum, broadcast_buffers, convert_sync_batch_norm};
pub use zero::{ZeroShard, ZeroStage};

use crate::error::{Error, Result};

/// Point-to-point messages between the ranks of one job: the only thing the collectives
/// need from a transport.
pub trait Transport: Send {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Sends `send` to rank `dst` while receiving exactly `recv.len()` bytes from rank
    /// `src` (both may be the same rank). Messages between two ranks arrive in the order they
    /// were sent. Fails (or, for MPI, aborts the job with a message) when nothing arrives
    /// within `timeout`.
    fn sendrecv(
        &mut self,
        send: &[u8],
        dst: usize,
        recv: &mut [u8],
        src: usize,
        timeout: Duration,
    ) -> Result<()>;
    /// Where each rank runs, indexed by rank (a host name, with its address where the
    /// launcher tells it), for messages that name a rank's host; empty where unknown.
    fn hosts(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The dtype gradients travel in during an all-reduce (PyTorch's DDP communication hooks:
/// none, `fp16_compress_hook`, `bf16_compress_hook`). Additions are in F32 either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// F32: 4 bytes a value, exact sums of the F32 values in a fixed order.
    F32,
    /// F16: 2 bytes a value. Before sending, a bucket is multiplied by the power of two that
    /// puts N × its largest magnitude (over all ranks) at or below 2^15, so no partial sum
    /// overflows F16 and small values keep as many bits as the range allows; the result is
    /// divided by it again (exactly).
    F16,
    /// BF16: 2 bytes a value; F32's range, 8 significant bits.
    Bf16,
}

impl Wire {
    /// `"f32"`, `"f16"`, `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            Wire::F32 => "f32",
            Wire::F16 => "f16",
            Wire::Bf16 => "bf16",
        }
    }

    /// Parses a name as written by [`Wire::name`].
    pub fn parse(s: &str) -> Result<Wire> {
        match s {
            "f32" => Ok(Wire::F32),
            "f16" => Ok(Wire::F16),
            "bf16" => Ok(Wire::Bf16),
            _ => Err(Error::arg(
                "allreduce",
                format!("unknown wire dtype {s:?} (f32, f16, bf16)"),
            )),
        }
    }

    /// Bytes a value takes on the wire.
    pub fn bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::F16 | Wire::Bf16 => 2,
        }
    }
}

/// Counters of one process group, read with [`ProcessGroup::stats`].
#[derive(Debug, Default)]
pub struct CommStats {
    bytes_sent: AtomicU64,
    messages: AtomicU64,
    wait_nanos: AtomicU64,
}

/// A snapshot of [`CommStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommSnapshot {
    /// Bytes this rank sent (payload, every collective).
    pub bytes_sent: u64,
    /// Messages this rank sent.
    pub messages: u64,
    /// Time the calling (training) thread spent blocked on collectives, in nanoseconds.
    pub wait_nanos: u64,
}

impl CommSnapshot {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &CommSnapshot) -> CommSnapshot {
        CommSnapshot {
            bytes_sent: self.bytes_sent - earlier.bytes_sent,
            messages: self.messages - earlier.messages,
            wait_nanos: self.wait_nanos - earlier.wait_nanos,
        }
    }
}

impl CommStats {
    pub(crate) fn sent(&self, bytes: usize) {
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
        self.messages.fetch_add(1, Ordering::Relaxed);
    }
    fn waited(&self, d: Duration) {
        self.wait_nanos
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
    fn snapshot(&self) -> CommSnapshot {
        CommSnapshot {
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            messages: self.messages.load(Ordering::Relaxed),
            wait_nanos: self.wait_nanos.load(Ordering::Relaxed),
        }
    }
}

enum Job {
    AllReduce {
        data: Vec<f32>,
        wire: Wire,
        reply: Sender<Result<Vec<f32>>>,
    },
    ReduceScatter {
        data: Vec<f32>,
        wire: Wire,
        reply: Sender<Result<(usize, Vec<f32>)>>,
    },
    AllGather {
        data: Vec<u8>,
        /// Every rank sends as many bytes (one message per ring step instead of two).
        fixed: bool,
        reply: Sender<Result<Vec<Vec<u8>>>>,
    },
}

/// The ranks of one job and a thread that runs their collectives.
///
/// Collectives run one at a time in the order they were submitted; every rank must submit
/// the same collectives in the same order (as with MPI and PyTorch's process groups). After
/// a failed collective the group is broken: every later call fails with the first error.
pub struct ProcessGroup {
    rank: usize,
    size: usize,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    stats: Arc<CommStats>,
    timeout: Duration,
    abort: Option<fn(i32)>,
    hosts: Vec<String>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A collective in flight ([`ProcessGroup::all_reduce`]).
pub struct Work<T> {
    rx: Receiver<Result<T>>,
    group_rank: usize,
    timeout: Duration,
    stats: Arc<CommStats>,
}

impl<T> Work<T> {
    /// Blocks until the collective finished (the time counts as communication wait).
    pub fn wait(self) -> Result<T> {
        let t0 = Instant::now();
        // The transport enforces the deadline per message; this one catches a stuck thread.
        let r = self
            .rx
            .recv_timeout(self.timeout + Duration::from_secs(5))
            .map_err(|_| {
                Error::Msg(format!(
                    "rank {}: a collective did not finish within {:.0} s (a rank has died or \
                     hangs)",
                    self.group_rank,
                    self.timeout.as_secs_f64()
                ))
            });
        self.stats.waited(t0.elapsed());
        r?
    }
}

impl ProcessGroup {
    /// Starts the communication thread over `transport`. `timeout` bounds every wait for a
    /// peer (PyTorch's process-group `timeout`).
    pub fn new(transport: Box<dyn Transport>, timeout: Duration) -> Result<ProcessGroup> {
        Self::start(move || Ok(transport), timeout, None)
    }

    /// Starts the communication thread and builds the transport on it with `make` (MPI is
    /// initialised on the thread that will make every MPI call). `abort`, when given, ends
    /// the whole job ([`ProcessGroup::abort`]).
    pub fn start(
        make: impl FnOnce() -> Result<Box<dyn Transport>> + Send + 'static,
        timeout: Duration,
        abort: Option<fn(i32)>,
    ) -> Result<ProcessGroup> {
        if timeout.is_zero() {
            return Err(Error::arg("ProcessGroup", "timeout must be > 0"));
        }
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (ready_tx, ready_rx) = channel::<Result<(usize, usize, Vec<String>)>>();
        let stats = Arc::new(CommStats::default());
        let thread_stats = stats.clone();
        let worker = std::thread::Builder::new()
            .name("hemi-comm".into())
            .spawn(move || {
                let mut t = match make() {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((t.rank(), t.size(), t.hosts())));
                comm_loop(t.as_mut(), jobs_rx, &thread_stats, timeout);
            })
            .map_err(|e| Error::Msg(format!("cannot start the communication thread: {e}")))?;
        let (rank, size, hosts) = match ready_rx.recv() {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Msg(
                    "the communication thread ended before its transport was ready".into(),
                ))
            }
        };
        Ok(ProcessGroup {
            rank,
            size,
            jobs: Mutex::new(Some(jobs_tx)),
            worker: Mutex::new(Some(worker)),
            stats,
            timeout,
            abort,
            hosts,
        })
    }

    /// A group of one rank (no communication at all).
    pub fn single() -> ProcessGroup {
        Self::new(
            Box::new(LocalTransport::group(1).remove(0)),
            Duration::from_secs(60),
        )
        .expect("a one-rank group starts")
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The deadline of every wait for a peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Where each rank runs, indexed by rank (`"node7 (10.0.0.7)"`: the host name, and the
    /// address where the launcher tells it), as the transport learnt it at start; empty
    /// where the transport cannot tell (threads of one process).
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// Bytes and messages sent, and time spent waiting, so far.
    pub fn stats(&self) -> CommSnapshot {
        self.stats.snapshot()
    }

    fn submit(&self, job: Job) -> Result<()> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let tx = jobs.as_ref().ok_or_else(|| self.gone())?;
        tx.send(job).map_err(|_| self.gone())
    }

    fn gone(&self) -> Error {
        Error::Msg(format!(
            "rank {}: the communication thread has stopped",
            self.rank
        ))
    }

    fn work<T>(&self, rx: Receiver<Result<T>>) -> Work<T> {
        Work {
            rx,
            group_rank: self.rank,
            timeout: self.timeout,
            stats: self.stats.clone(),
        }
    }

    /// Starts summing `data` over all ranks (each rank's values in F32, sent as `wire`);
    /// [`Work::wait`] returns the sum, the same bits on every rank.
    pub fn all_reduce(&self, data: Vec<f32>, wire: Wire) -> Result<Work<Vec<f32>>> {
        let (reply, rx) = channel();
        self.submit(Job::AllReduce { data, wire, reply })?;
        Ok(self.work(rx))
    }

    /// Starts the first half of [`ProcessGroup::all_reduce`] (ZeRO stage 2): [`Work::wait`]
    /// returns where this rank's chunk starts in `data` and the chunk's sums, the bits
    /// `all_reduce` gives there (the chunk is `ring::chunk(len, N, (rank + 1) mod N)`).
    pub fn reduce_scatter(&self, data: Vec<f32>, wire: Wire) -> Result<Work<(usize, Vec<f32>)>> {
        let (reply, rx) = channel();
        self.submit(Job::ReduceScatter { data, wire, reply })?;
        Ok(self.work(rx))
    }

    /// Every rank's `data`, in rank order (the lengths may differ).
    pub fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.gather(data, false)
    }

    /// Every rank's `data`, in rank order, where every rank sends the same number of bytes
    /// (half the messages of [`ProcessGroup::all_gather`]; a rank that sends another
    /// length is an error).
    pub fn all_gather_fixed(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.gather(data, true)
    }

    fn gather(&self, data: Vec<u8>, fixed: bool) -> Result<Vec<Vec<u8>>> {
        let (reply, rx) = channel();
        self.submit(Job::AllGather { data, fixed, reply })?;
        self.work(rx).wait()
    }

    /// Every rank's values, in rank order (every rank passes as many).
    pub fn all_gather_f64(&self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.all_gather_fixed(bytes)?;
        Ok(all
            .iter()
            .map(|b| {
                b.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    /// The element-wise sum of every rank's `values`, added in rank order (the same bits on
    /// every rank).
    pub fn sum_f64(&self, values: &[f64]) -> Result<Vec<f64>> {
        let all = self.all_gather_f64(values)?;
        let mut out = vec![0.0; values.len()];
        for (r, v) in all.iter().enumerate() {
            if v.len() != values.len() {
                return Err(Error::Msg(format!(
                    "rank {}: rank {r} sent {} values where {} were expected",
                    self.rank,
                    v.len(),
                    values.len()
                )));
            }
            for (o, x) in out.iter_mut().zip(v) {
                *o += x;
            }
        }
        Ok(out)
    }

    /// Whether `flag` is true on any rank.
    pub fn any(&self, flag: bool) -> Result<bool> {
        let all = self.all_gather_fixed(vec![u8::from(flag)])?;
        Ok(all.iter().any(|b| b.first() == Some(&1)))
    }

    /// Waits until every rank got here.
    pub fn barrier(&self) -> Result<()> {
        self.all_gather_fixed(Vec::new()).map(|_| ())
    }

    /// Ends the whole job with exit code `code` where the transport can (MPI's
    /// `MPI_Abort`); returns where it cannot (threads of one process).
    pub fn abort(&self, code: i32) {
        if let Some(f) = self.abort {
            f(code);
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the jobs already submitted.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }
}

fn comm_loop(t: &mut dyn Transport, jobs: Receiver<Job>, stats: &CommStats, timeout: Duration) {
    let mut broken: Option<String> = None;
    let fail = |b: &Option<String>| Error::Msg(b.clone().unwrap_or_default());
    for job in jobs {
        match job {
            Job::AllReduce {
                mut data,
                wire,
                reply,
            } => {
                let r = match &broken {
                    Some(_) => Err(fail(&broken)),
                    None => ring::all_reduce(t, &mut data, wire, stats, timeout).map(|_| data),
                };
                if let Err(e) = &r {
                    broken.get_or_insert_with(|| e.to_string());
                }
                let _ = reply.send(r);
            }
            Job::ReduceScatter {
                mut data,
                wire,
                reply,
            } => {
                let r = match &broken {
                    Some(_) => Err(fail(&broken)),
                    None => ring::reduce_scatter(t, &mut data, wire, stats, timeout).map(|own| {
                        // Keep the own chunk only: the rest is scratch.
                        data.truncate(own.end);
                        data.drain(..own.start);
                        data.shrink_to_fit();
                        (own.start, data)
                    }),
                };
                if let Err(e) = &r {
                    broken.get_or_insert_with(|| e.to_string());
                }
                let _ = reply.send(r);
            }
            Job::AllGather { data, fixed, reply } => {
                let r = match &broken {
                    Some(_) => Err(fail(&broken)),
                    None if fixed => ring::all_gather_fixed(t, data, stats, timeout),
                    None => ring::all_gather(t, data, stats, timeout),
                };
                if let Err(e) = &r {
                    broken.get_or_insert_with(|| e.to_string());
                }
                let _ = reply.send(r);
            }
        }
    }
}

/// How a training run is distributed: the group, and how gradients are reduced.
#[derive(Clone, Debug)]
pub struct DistConfig {
    /// The ranks.
    pub group: Arc<ProcessGroup>,
    /// Buckets and wire dtype of the gradient all-reduce.
    pub reducer: ReducerConfig,
    /// ZeRO: shard the optimizer state and masters (stage 1) and the reduced gradients
    /// (stage 2) over the ranks (default off).
    pub zero: ZeroStage,
}
