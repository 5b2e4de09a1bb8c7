//! Keeps rayon's idle workers spinning between the parallel kernels of a training step.
//!
//! A rayon worker that finds no work spins for a few dozen rounds and then sleeps on a
//! condition variable. Waking it costs a futex call and, on a virtual machine, waking a
//! halted vCPU. A training step alternates short parallel kernels with short serial stretches
//! (graph bookkeeping, small ops), several hundred times per step. On 2 Zen 5 cores, a
//! `rayon::join` of two tasks after a serial stretch of only 20 µs cost 35–58 µs more
//! than the same join with no stretch. In a BERT amp-bf16 step the two cores were idle for
//! 8.7 % of their time, the worker asleep about 400 times per step.
//!
//! [`nudge`] starts one spinner on every other worker of the current pool, unless one is
//! running or about to run. A spinner is a rayon job that calls [`rayon::yield_now`] in a
//! loop. It runs whatever work appears: the other half of a `join`, a chunk of a
//! `par_iter`, a job injected from outside the pool. It never sleeps, so it starts that work
//! within a microsecond. After [`spin_limit`] without work it returns, and rayon's own
//! sleeping takes over again. The parallel kernels call `nudge` before they split their
//! work, so while a step runs the other workers stay awake, and a few milliseconds after it
//! ends they sleep. This is OpenMP's wait policy (spin for a while, then sleep), which is
//! what PyTorch's CPU kernels run on.
//!
//! `HEMI_SPIN_US` sets the limit in microseconds. `0` turns spinning off: plain rayon,
//! for a machine shared with other work where a spinning core costs more than it saves.
//! Spinning changes only when work starts, never what it computes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a spinner waits for work before it returns, when `HEMI_SPIN_US` is not set.
/// Longer than the serial stretches inside a step (mostly well under 1 ms). It is also
/// short enough that a finished step does not hold a core for long.
const DEFAULT_SPIN: Duration = Duration::from_millis(5);

/// `spin_loop` hints between two looks for work (about a microsecond on Zen 5, where a
/// look itself costs about 0.1 µs).
const IDLE_PAUSES: usize = 32;

/// Spinners running now.
static SPINNING: AtomicUsize = AtomicUsize::new(0);
/// A spinner broadcast is queued or running; cleared by the last spinner to leave.
static ARMED: AtomicBool = AtomicBool::new(false);

/// How long an idle worker spins before it goes back to rayon's sleep (`HEMI_SPIN_US`,
/// default 5 ms). Zero means no spinning.
pub fn spin_limit() -> Duration {
    static LIMIT: OnceLock<Duration> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("HEMI_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_SPIN, Duration::from_micros)
    })
}

/// Number of spinners running now (for tests and diagnostics).
pub fn spinning() -> usize {
    SPINNING.load(Ordering::Acquire)
}

/// Starts a spinner on every other worker of the current rayon pool (the global pool when
/// the caller is not a worker; then on all but one), unless spinners are already running or
/// queued. Cheap when
/// they are: one atomic load. Does nothing with one thread or with `HEMI_SPIN_US=0`.
#[inline]
pub fn nudge() {
    if ARMED.load(Ordering::Relaxed) {
        return;
    }
    nudge_cold();
}

#[cold]
fn nudge_cold() {
    let limit = spin_limit();
    if limit.is_zero() || rayon::current_num_threads() < 2 {
        return;
    }
    if ARMED.swap(true, Ordering::AcqRel) {
        return;
    }
    // The caller keeps one core: it is a worker of the pool, or (when it is outside the
    // pool and waits for the pool's work) worker 0 stays out of spinning so that the
    // caller's serial stretches do not compete with `threads` spinners for `threads` cores.
    let keep = rayon::current_thread_index().unwrap_or(0);
    rayon::spawn_broadcast(move |ctx| {
        if ctx.index() != keep {
            spin(limit);
        }
    });
}

/// Runs rayon work as it appears until `limit` passes without any.
fn spin(limit: Duration) {
    SPINNING.fetch_add(1, Ordering::AcqRel);
    let mut idle_since: Option<Instant> = None;
    let mut idle_rounds = 0u32;
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                idle_since = None;
                idle_rounds = 0;
            }
            Some(rayon::Yield::Idle) => {
                idle_rounds = idle_rounds.wrapping_add(1);
                // The clock and the OS are asked every 64 empty rounds, not on every one.
                if idle_rounds.is_multiple_of(64) {
                    let now = Instant::now();
                    let since = *idle_since.get_or_insert(now);
                    if now.duration_since(since) >= limit {
                        break;
                    }
                    // Lets another runnable thread (a data loader) have this core.
                    std::thread::yield_now();
                } else {
                    // A pause between looks: each look reads the other workers' deques,
                    // whose cache lines the worker pushing jobs is writing.
                    for _ in 0..IDLE_PAUSES {
                        std::hint::spin_loop();
                    }
                }
            }
            None => break,
        }
    }
    // The last spinner out re-arms `nudge`. A nudge that comes before this store sees
    // ARMED still set and returns; the work it was about to split is then found by rayon's
    // own wake-up, as without spinning.
    if SPINNING.fetch_sub(1, Ordering::AcqRel) == 1 {
        ARMED.store(false, Ordering::Release);
    }
}
