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

use std::alloc::{GlobalAlloc, Layout, System};

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
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        advise(p, layout.size());
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        advise(p, new_size);
        p
    }
}
