//! The unit tests of `hemi::cuda::alloc` (`src/cuda/alloc.rs`), run against the built library.

use hemi::cuda::alloc::*;
use hemi::error::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::HashMap;

/// A fake device: addresses from a bump pointer (never reused, so overlap bugs show),
/// a capacity on live bytes, and a record of live raw allocations.
struct FakeRaw {
    next: u64,
    capacity: usize,
    live: HashMap<u64, usize>,
}

impl FakeRaw {
    fn new(capacity: usize) -> Self {
        FakeRaw {
            next: 0x1000_0000,
            capacity,
            live: HashMap::new(),
        }
    }
    fn live_bytes(&self) -> usize {
        self.live.values().sum()
    }
}

impl RawAllocator for FakeRaw {
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64> {
        if self.live_bytes() + bytes > self.capacity {
            return Err(Error::device("fake", format!("no room for {bytes} bytes")));
        }
        let p = self.next;
        self.next += bytes as u64 + 4096;
        self.live.insert(p, bytes);
        Ok(p)
    }
    fn raw_free(&mut self, ptr: u64) -> Result<()> {
        self.live
            .remove(&ptr)
            .map(drop)
            .ok_or_else(|| Error::device("fake", "bad free"))
    }
}

const MIB: usize = 1 << 20;

fn alloc(cap: usize) -> CachingAllocator<FakeRaw> {
    CachingAllocator::new(FakeRaw::new(cap))
}

#[test]
fn sizes_round_to_512_and_segments_to_2mib() {
    assert_eq!(round_size(0), Some(512));
    assert_eq!(round_size(1), Some(512));
    assert_eq!(round_size(512), Some(512));
    assert_eq!(round_size(513), Some(1024));
    assert_eq!(round_size(usize::MAX), None);
    assert_eq!(segment_size(512), Some(2 * MIB));
    assert_eq!(segment_size(MIB), Some(2 * MIB));
    assert_eq!(segment_size(MIB + 512), Some(2 * MIB));
    assert_eq!(segment_size(2 * MIB + 512), Some(4 * MIB));
    assert_eq!(segment_size(usize::MAX - 511), None);
    let mut a = alloc(usize::MAX);
    let e = a.malloc(usize::MAX - 3, 0).unwrap_err().to_string();
    assert!(e.contains("overflows"), "{e}");
}

#[test]
fn small_blocks_share_a_segment_and_are_reused() {
    let mut a = alloc(64 * MIB);
    let x = a.malloc(1000, 0).unwrap();
    let y = a.malloc(3000, 0).unwrap();
    assert_eq!((x.size, y.size), (1024, 3072));
    assert_eq!(y.ptr, x.ptr + 1024, "split from the same segment");
    assert_eq!(a.stats().raw_mallocs, 1);
    assert_eq!(a.stats().reserved, 2 * MIB);
    a.free(x).unwrap();
    let z = a.malloc(700, 0).unwrap();
    assert_eq!(z.ptr, x.ptr, "the freed block is reused");
    assert_eq!(a.stats().raw_mallocs, 1);
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_takes_the_smallest_sufficient_block() {
    let mut a = alloc(64 * MIB);
    let h: Vec<_> = [4096, 512, 8192, 512, 2048, 512]
        .iter()
        .map(|&s| a.malloc(s, 0).unwrap())
        .collect();
    // Free the 4096, 8192 and 2048 blocks (separated by live 512s so they do not merge).
    for i in [0, 2, 4] {
        a.free(h[i]).unwrap();
    }
    let got = a.malloc(2000, 0).unwrap();
    assert_eq!(got.ptr, h[4].ptr, "2048 is the best fit for 2000");
    let got = a.malloc(3000, 0).unwrap();
    assert_eq!(got.ptr, h[0].ptr, "4096 is the best fit for 3000");
    a.check_invariants().unwrap();
}

#[test]
fn freed_neighbours_coalesce_back_into_the_whole_segment() {
    let mut a = alloc(64 * MIB);
    let h: Vec<_> = (0..5).map(|_| a.malloc(100_000, 0).unwrap()).collect();
    for i in [1, 3, 0, 4, 2] {
        a.free(h[i]).unwrap();
        a.check_invariants().unwrap();
    }
    assert_eq!(a.block_count(), 1, "one free block spanning the segment");
    // It can now serve a request bigger than any of the pieces.
    let big = a.malloc(MIB, 0).unwrap();
    assert_eq!(big.ptr, h[0].ptr);
    assert_eq!(a.stats().raw_mallocs, 1);
}

#[test]
fn large_requests_get_their_own_rounded_segment_and_split_only_big_remainders() {
    let mut a = alloc(1 << 40);
    let x = a.malloc(5 * MIB + 1, 0).unwrap();
    assert_eq!(a.stats().reserved, 6 * MIB);
    assert_eq!(
        x.size,
        6 * MIB,
        "a remainder < 1 MiB is not split off: the block keeps it"
    );
    a.free(x).unwrap();
    // A 2 MiB request reuses the 6 MiB segment and splits off the 4 MiB rest.
    let y = a.malloc(2 * MIB, 0).unwrap();
    assert_eq!((y.ptr, y.size), (x.ptr, 2 * MIB));
    let z = a.malloc(3 * MIB, 0).unwrap();
    assert_eq!(z.ptr, x.ptr + 2 * MIB as u64);
    assert_eq!(a.stats().raw_mallocs, 1);
    // Small requests never come from large segments.
    let s = a.malloc(4096, 0).unwrap();
    assert_eq!(a.stats().raw_mallocs, 2);
    assert!(s.ptr < x.ptr || s.ptr >= x.ptr + 6 * MIB as u64);
    a.check_invariants().unwrap();
}

#[test]
fn pools_are_per_stream() {
    let mut a = alloc(64 * MIB);
    let x = a.malloc(4096, 1).unwrap();
    a.free(x).unwrap();
    let y = a.malloc(4096, 2).unwrap();
    assert_ne!(y.ptr, x.ptr, "stream 2 must not reuse stream 1's block");
    assert_eq!(a.stats().raw_mallocs, 2);
    let z = a.malloc(4096, 1).unwrap();
    assert_eq!(z.ptr, x.ptr);
    a.check_invariants().unwrap();
}

#[test]
fn double_free_and_foreign_pointers_are_errors() {
    let mut a = alloc(64 * MIB);
    let x = a.malloc(4096, 0).unwrap();
    a.free(x).unwrap();
    let e = a.free(x).unwrap_err().to_string();
    assert!(e.contains("not a live allocation"), "{e}");
    let e = a
        .free(BlockHandle {
            ptr: 12345,
            size: 512,
            stream: 0,
        })
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }));
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_releases_only_wholly_free_segments() {
    let mut a = alloc(1 << 40);
    let keep = a.malloc(4096, 0).unwrap();
    let drop1 = a.malloc(4096, 0).unwrap();
    let big = a.malloc(10 * MIB, 0).unwrap();
    a.free(drop1).unwrap();
    a.free(big).unwrap();
    a.empty_cache().unwrap();
    let s = a.stats();
    assert_eq!((s.reserved, s.raw_frees, s.segments), (2 * MIB, 1, 1));
    assert_eq!(a.raw().live.len(), 1);
    assert_eq!(s.peak_reserved, 12 * MIB);
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved, 0);
    assert!(a.raw().live.is_empty());
    a.check_invariants().unwrap();
    a.reset_peak_stats();
    assert_eq!(a.stats().peak_reserved, 0);
}

#[test]
fn out_of_memory_frees_the_cache_and_retries_then_errors_clearly() {
    let mut a = alloc(8 * MIB);
    // Cache 6 MiB in freed large segments.
    let x = a.malloc(3 * MIB, 0).unwrap();
    let y = a.malloc(2 * MIB, 0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(a.stats().reserved, 6 * MIB);
    // 6 MiB does not fit beside the cache (8 MiB device) but does after flushing it.
    let z = a.malloc(6 * MIB, 0).unwrap();
    let s = a.stats();
    assert_eq!((s.oom_retries, s.raw_frees, s.reserved), (1, 2, 6 * MIB));
    a.check_invariants().unwrap();
    // 4 MiB more cannot fit at all: a clear error, the stats intact.
    let e = a.malloc(4 * MIB, 0).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(
        e,
        Error::Device {
            op: "device malloc",
            ..
        }
    ));
    for want in [
        "out of memory",
        "4194304 bytes",
        "reserved 6291456 B",
        "allocated 6291456 B",
    ] {
        assert!(msg.contains(want), "missing {want:?}: {msg}");
    }
    a.check_invariants().unwrap();
    a.free(z).unwrap();
    a.malloc(4 * MIB, 0).unwrap();
}

/// One step of a training loop: parameters live across steps; activations are allocated
/// forward and freed backward; gradients and optimizer temporaries come and go.
fn training_step(a: &mut CachingAllocator<FakeRaw>) {
    let acts: Vec<_> = [3 * MIB, 600_000, 600_000, 150_000, 150_000, 40_000, 4_000]
        .iter()
        .map(|&s| a.malloc(s, 0).unwrap())
        .collect();
    let mut grads = Vec::new();
    for (i, act) in acts.into_iter().enumerate().rev() {
        let g = a.malloc(act.size / 2 + 100, 0).unwrap();
        let tmp = a.malloc(12_345 + 1000 * i, 0).unwrap();
        a.free(tmp).unwrap();
        a.free(act).unwrap();
        grads.push(g);
    }
    let scratch = a.malloc(5 * MIB, 0).unwrap();
    a.free(scratch).unwrap();
    for g in grads {
        a.free(g).unwrap();
    }
}

#[test]
fn repeated_training_steps_need_no_raw_allocations_after_the_first() {
    let mut a = alloc(1 << 40);
    let params: Vec<_> = [2 * MIB, 300_000, 1024]
        .iter()
        .map(|&s| a.malloc(s, 0).unwrap())
        .collect();
    training_step(&mut a);
    let after_first = a.stats();
    a.check_invariants().unwrap();
    for _ in 0..20 {
        training_step(&mut a);
        a.check_invariants().unwrap();
    }
    let s = a.stats();
    assert!(after_first.raw_mallocs > 0);
    assert_eq!(
        s.raw_mallocs, after_first.raw_mallocs,
        "steps 2..21 allocated raw memory"
    );
    assert_eq!(s.raw_frees, 0);
    assert_eq!(s.peak_reserved, after_first.peak_reserved);
    assert_eq!(s.peak_allocated, after_first.peak_allocated);
    assert_eq!(s.allocs, after_first.allocs + 20 * (after_first.allocs - 3));
    for p in params {
        a.free(p).unwrap();
    }
    assert_eq!(a.stats().allocated, 0);
}

#[test]
fn random_alloc_free_sequences_keep_the_invariants() {
    for seed in 0..8u64 {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut a = alloc(256 * MIB);
        let mut live: Vec<(BlockHandle, usize)> = Vec::new();
        for step in 0..1500 {
            let r: f64 = rng.random();
            if r < 0.55 || live.is_empty() {
                let size = match rng.random_range(0..10) {
                    0..=5 => rng.random_range(0..20_000),
                    6..=8 => rng.random_range(0..1_200_000),
                    _ => rng.random_range(0..12 * MIB),
                };
                let stream = rng.random_range(0..3);
                match a.malloc(size, stream) {
                    Ok(h) => {
                        assert!(h.size >= size && h.size % ROUND == 0);
                        live.push((h, size));
                    }
                    Err(e) => assert!(e.to_string().contains("out of memory"), "{e}"),
                }
            } else if r < 0.98 {
                let i = rng.random_range(0..live.len());
                let (h, _) = live.swap_remove(i);
                a.free(h).unwrap();
            } else {
                a.empty_cache().unwrap();
            }
            if let Err(e) = a.check_invariants() {
                panic!("seed {seed} step {step}: {e}");
            }
            // Live blocks never overlap, and each lies inside a live raw allocation.
            let mut spans: Vec<_> = live
                .iter()
                .map(|(h, _)| (h.ptr, h.ptr + h.size as u64))
                .collect();
            spans.sort();
            assert!(
                spans.windows(2).all(|w| w[0].1 <= w[1].0),
                "seed {seed} step {step}: overlap"
            );
            for (lo, hi) in &spans {
                assert!(a
                    .raw()
                    .live
                    .iter()
                    .any(|(&p, &n)| p <= *lo && *hi <= p + n as u64));
            }
            let s = a.stats();
            assert_eq!(s.reserved, a.raw().live_bytes());
            assert_eq!(s.allocated, live.iter().map(|(h, _)| h.size).sum::<usize>());
        }
        for (h, _) in live {
            a.free(h).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved, 0);
        assert!(a.raw().live.is_empty());
    }
}
