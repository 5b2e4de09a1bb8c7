//! The process's allocator: the system one, with large blocks marked for transparent huge
//! pages.
//!
//! Activations are big, short-lived buffers (a BERT layer at batch 64 × 128 tokens writes
//! 12–50 MB per op). glibc serves them with fresh `mmap`s, so every forward pays one page
//! fault per 4 KiB touched: in `perf`, 26 % of an INT8 BERT forward at batch 64 was page
//! faults. Linux's transparent huge pages are usually set to `madvise`; advising blocks of
//! 4 MiB and more makes their faults 2 MiB at a time (that forward: 907 → 804 ms on an
//! Intel Xeon, 2 cores). Advice only: where THP is off the call does nothing, and the
//! memory is the same memory.
//!
//! It can also count the bytes it hands out and takes back (`count_heap`, off unless
//! asked): `hemi bench train` reports a step's heap above what lives between steps, the
//! memory activation checkpointing saves, which peak RSS blurs with whatever the heap
//! kept from earlier steps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Whether allocations are counted (`count_heap`); off, the allocator reads one flag.
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Bytes allocated minus bytes freed since counting started (blocks from before may be
/// freed after, so it may go below zero: only differences mean something).
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The largest `LIVE` since the last `reset_heap_peak`.
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// Starts counting the heap bytes the process allocates and frees (`hemi bench train`'s
/// step memory): two atomic additions per allocation from then on.
pub fn count_heap() {
    COUNTING.store(true, Ordering::SeqCst);
}

/// The counted live heap bytes now (see `LIVE`).
pub fn heap_live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// The largest live heap since the last reset, and a reset of it to the live bytes now.
pub fn reset_heap_peak() -> isize {
    let now = LIVE.load(Ordering::SeqCst);
    PEAK.swap(now, Ordering::SeqCst)
}

fn grew(n: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let now = LIVE.fetch_add(n as isize, Ordering::Relaxed) + n as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

fn shrank(n: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_sub(n as isize, Ordering::Relaxed);
    }
}

/// Blocks at least this large are advised.
const ADVISE_FROM: usize = 4 << 20;
/// The huge page size the advice is aligned to.
const HUGE_PAGE: usize = 2 << 20;

/// `System`, plus `madvise(MADV_HUGEPAGE)` on the whole 2 MiB pages inside large blocks.
pub struct HugePageAlloc;

fn advise(ptr: *mut u8, len: usize) {
    if ptr.is_null() || len < ADVISE_FROM {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + len) & !(HUGE_PAGE - 1);
    if end > start {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: [start, end) lies inside the block just allocated; MADV_HUGEPAGE changes
        // how its pages are backed, not their contents. Failure (THP off) is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments; `advise` only
// gives advice on memory inside the block it returns.
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(layout) };
        advise(p, layout.size());
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        advise(p, layout.size());
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        advise(p, new_size);
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}
