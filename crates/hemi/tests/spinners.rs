//! `hemi::threads`: spinners start on the other workers when a kernel nudges them, run the
//! pool's work, and leave once the pool has been idle for the limit. One test in its own
//! process, so that no other test's kernels nudge the pools meanwhile.

use std::time::{Duration, Instant};

use rayon::prelude::*;

fn wait_for(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !done() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn spinners_start_run_work_and_leave() {
    let limit = hemi::threads::spin_limit();
    assert!(!limit.is_zero(), "HEMI_SPIN_US=0 turns the spinners off");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        assert_eq!(hemi::threads::spinning(), 0);
        hemi::threads::nudge();
        // Both other workers start spinning (the caller does not).
        wait_for("two spinners", Duration::from_secs(10), || {
            hemi::threads::spinning() == 2
        });
        // Work split while they spin is done, and done right.
        for round in 0..200u64 {
            hemi::threads::nudge();
            let s: u64 = (0..10_000u64).into_par_iter().map(|x| x * round).sum();
            assert_eq!(s, 49_995_000 * round);
            assert!(hemi::threads::spinning() <= 2, "more spinners than workers");
        }
    });
    // Idle for the limit, they return to rayon's sleep; a later nudge starts them again.
    wait_for(
        "the spinners to leave",
        limit + Duration::from_secs(10),
        || hemi::threads::spinning() == 0,
    );
    pool.install(|| {
        hemi::threads::nudge();
        wait_for("spinners again", Duration::from_secs(10), || {
            hemi::threads::spinning() == 2
        });
    });
}
