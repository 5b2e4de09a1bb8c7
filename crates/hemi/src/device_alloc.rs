//! A caching device allocator, after PyTorch's `CUDACachingAllocator`: shared by the CUDA
//! backend (`cuda::alloc`, raw blocks from `cuMemAlloc`) and the wgpu backend (`gpu`, whose
//! raw allocations are wgpu buffers, one per segment, blocks bound at their offsets).
//!
//! `cudaMalloc`/`cudaFree` are slow and synchronise the device, and a training step allocates
//! the same sizes every step; so freed blocks are kept and reused instead of returned.
//!
//! - Requests are rounded up to [`ROUND`] (512) bytes.
//! - Requests of at most [`SMALL_SIZE`] (1 MiB) are carved from [`SMALL_SEGMENT`] (2 MiB)
//!   segments; larger ones get a segment of their size rounded up to [`LARGE_ROUND`] (2 MiB).
//!   The two kinds live in separate pools so small blocks do not fragment large segments.
//! - A request takes the best-fitting (smallest sufficient) free block of its pool and stream,
//!   and splits off the rest when it is big enough to be useful (small pool: at least
//!   [`ROUND`]; large pool: more than [`SMALL_SIZE`]).
//! - Freeing a block coalesces it with free neighbours of the same segment.
//! - Pools are per stream: a block freed on stream S is only reused by S, whose queue orders the
//!   reuse after the last kernel that touched it. (Using a block on a second stream needs an
//!   event, as PyTorch's `record_stream`; not provided yet.)
//! - When the raw allocator fails, every fully free cached segment is released and the request
//!   retried once; failing again is an `Error::Device` naming the request and the statistics.
//!
//! The bookkeeping is generic over [`RawAllocator`], so it is tested on the CPU with a fake.

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use crate::error::{Error, Result};

/// Allocation granularity: every block size is a multiple of this.
pub const ROUND: usize = 512;
/// Largest request served from the small pool.
pub const SMALL_SIZE: usize = 1 << 20;
/// Size of a small-pool segment.
pub const SMALL_SEGMENT: usize = 2 << 20;
/// Large-pool segments are rounded up to a multiple of this.
pub const LARGE_ROUND: usize = 2 << 20;

/// The device's own allocator (`cuMemAlloc`/`cuMemFree`, a wgpu buffer per segment), or a fake in tests.
pub trait RawAllocator {
    /// Allocates `bytes` bytes of device memory; the device address.
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64>;
    /// Frees an address `raw_alloc` returned.
    fn raw_free(&mut self, ptr: u64) -> Result<()>;
}

/// A stream's identity (its `CUstream` as an integer); each has its own pools.
pub type StreamId = u64;

/// Counters in bytes and calls, as `torch.cuda.memory_stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out (rounded sizes).
    pub allocated: usize,
    /// Bytes in segments obtained from the raw allocator.
    pub reserved: usize,
    /// The largest `allocated` since creation or the last `reset_peak_stats`.
    pub peak_allocated: usize,
    /// The largest `reserved` since creation or the last `reset_peak_stats`.
    pub peak_reserved: usize,
    /// Calls to `raw_alloc` that succeeded.
    pub raw_mallocs: u64,
    /// Calls to `raw_free`.
    pub raw_frees: u64,
    /// Requests served (`malloc` calls that succeeded).
    pub allocs: u64,
    /// Times a raw allocation failed and the cache was flushed to retry.
    pub oom_retries: u64,
    /// Live blocks.
    pub active_blocks: usize,
    /// Segments held.
    pub segments: usize,
}

impl fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocated {} B, reserved {} B, peak allocated {} B, peak reserved {} B, \
             {} segments, {} raw mallocs, {} raw frees",
            self.allocated,
            self.reserved,
            self.peak_allocated,
            self.peak_reserved,
            self.segments,
            self.raw_mallocs,
            self.raw_frees
        )
    }
}

/// A live allocation: the device address and the (rounded) size that is usable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHandle {
    /// The device address of the block's first byte.
    pub ptr: u64,
    /// Usable bytes: the request rounded up to the allocator's granularity.
    pub size: usize,
    /// The stream whose pool the block belongs to (it is reused only on that stream).
    pub stream: StreamId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum PoolKind {
    Small,
    Large,
}

type BlockId = usize;

#[derive(Clone, Debug)]
struct Block {
    ptr: u64,
    size: usize,
    stream: StreamId,
    pool: PoolKind,
    allocated: bool,
    /// Neighbours within the same segment, by address.
    prev: Option<BlockId>,
    next: Option<BlockId>,
}

/// The free-list key: best fit is the first key at or after (pool, stream, size, 0, 0).
type FreeKey = (PoolKind, StreamId, usize, u64, BlockId);

/// The caching allocator over a raw allocator `R`.
pub struct CachingAllocator<R: RawAllocator> {
    raw: R,
    blocks: HashMap<BlockId, Block>,
    next_id: BlockId,
    free: BTreeSet<FreeKey>,
    /// Live blocks by address.
    live: HashMap<u64, BlockId>,
    /// Segment base address -> first block of the segment.
    segments: HashMap<u64, BlockId>,
    stats: MemoryStats,
}

/// `bytes` rounded up to [`ROUND`] (at least one unit), or `None` on overflow.
pub fn round_size(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(ROUND)
}

/// The segment size for a rounded request.
pub fn segment_size(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_SEGMENT)
    } else {
        rounded.checked_next_multiple_of(LARGE_ROUND)
    }
}

impl<R: RawAllocator> CachingAllocator<R> {
    /// An empty allocator over `raw`: no segments, zeroed statistics.
    pub fn new(raw: R) -> Self {
        CachingAllocator {
            raw,
            blocks: HashMap::new(),
            next_id: 0,
            free: BTreeSet::new(),
            live: HashMap::new(),
            segments: HashMap::new(),
            stats: MemoryStats::default(),
        }
    }

    /// The counters so far (`torch.cuda.memory_stats`).
    pub fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// Restarts the peaks from the current values (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&mut self) {
        self.stats.peak_allocated = self.stats.allocated;
        self.stats.peak_reserved = self.stats.reserved;
    }

    /// The raw allocator underneath (the driver, or a fake in tests).
    pub fn raw(&self) -> &R {
        &self.raw
    }

    /// The number of blocks, free and live, across all segments (for the unit tests in
    /// `tests/cuda/unit/`).
    #[doc(hidden)]
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    fn key(&self, id: BlockId) -> FreeKey {
        let b = &self.blocks[&id];
        (b.pool, b.stream, b.size, b.ptr, id)
    }

    fn insert_block(&mut self, b: Block) -> BlockId {
        let id = self.next_id;
        self.next_id += 1;
        self.blocks.insert(id, b);
        id
    }

    /// Allocates at least `bytes` bytes for use on `stream`.
    pub fn malloc(&mut self, bytes: usize, stream: StreamId) -> Result<BlockHandle> {
        let too_big = || {
            Error::device(
                "device malloc",
                format!("cannot allocate {bytes} bytes: the size overflows when rounded"),
            )
        };
        let size = round_size(bytes).ok_or_else(too_big)?;
        let seg = segment_size(size).ok_or_else(too_big)?;
        let pool = if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let id = match self.best_fit(pool, stream, size) {
            Some(id) => {
                let k = self.key(id);
                self.free.remove(&k);
                id
            }
            None => self.new_segment(pool, stream, seg, bytes, size)?,
        };
        self.split(id, size);
        let b = self.blocks.get_mut(&id).expect("block exists");
        b.allocated = true;
        let handle = BlockHandle {
            ptr: b.ptr,
            size: b.size,
            stream,
        };
        self.live.insert(handle.ptr, id);
        let s = &mut self.stats;
        s.allocated += handle.size;
        s.peak_allocated = s.peak_allocated.max(s.allocated);
        s.allocs += 1;
        s.active_blocks += 1;
        Ok(handle)
    }

    fn best_fit(&self, pool: PoolKind, stream: StreamId, size: usize) -> Option<BlockId> {
        let (p, s, _, _, id) = *self.free.range((pool, stream, size, 0, 0)..).next()?;
        (p == pool && s == stream).then_some(id)
    }

    fn new_segment(
        &mut self,
        pool: PoolKind,
        stream: StreamId,
        seg: usize,
        bytes: usize,
        size: usize,
    ) -> Result<BlockId> {
        let ptr = match self.raw.raw_alloc(seg) {
            Ok(p) => p,
            Err(_) => {
                // Out of memory (or any failure): give back what the cache holds, retry once.
                self.stats.oom_retries += 1;
                self.release_free_segments()?;
                self.raw.raw_alloc(seg).map_err(|e| {
                    Error::device(
                        "device malloc",
                        format!(
                            "out of memory: tried to allocate {bytes} bytes ({size} rounded, in a \
                             new {seg}-byte segment) after freeing the cache; {}; device said: {e}",
                            self.stats
                        ),
                    )
                })?
            }
        };
        self.stats.raw_mallocs += 1;
        self.stats.reserved += seg;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        self.stats.segments += 1;
        let id = self.insert_block(Block {
            ptr,
            size: seg,
            stream,
            pool,
            allocated: false,
            prev: None,
            next: None,
        });
        self.segments.insert(ptr, id);
        Ok(id)
    }

    /// Splits free-list-detached block `id` so it is `size` bytes, if the rest is worth keeping.
    fn split(&mut self, id: BlockId, size: usize) {
        let b = self.blocks[&id].clone();
        let rest = b.size - size;
        let worth = match b.pool {
            PoolKind::Small => rest >= ROUND,
            PoolKind::Large => rest > SMALL_SIZE,
        };
        if !worth {
            return;
        }
        let rid = self.insert_block(Block {
            ptr: b.ptr + size as u64,
            size: rest,
            stream: b.stream,
            pool: b.pool,
            allocated: false,
            prev: Some(id),
            next: b.next,
        });
        if let Some(n) = b.next {
            self.blocks.get_mut(&n).expect("next exists").prev = Some(rid);
        }
        let bm = self.blocks.get_mut(&id).expect("block exists");
        bm.size = size;
        bm.next = Some(rid);
        let k = self.key(rid);
        self.free.insert(k);
    }

    /// Returns a block to its stream's pool, merging it with free neighbours.
    pub fn free(&mut self, handle: BlockHandle) -> Result<()> {
        let id = self.live.remove(&handle.ptr).ok_or_else(|| {
            Error::device(
                "device free",
                format!(
                    "0x{:x} is not a live allocation of this allocator (freed twice?)",
                    handle.ptr
                ),
            )
        })?;
        let size = self.blocks[&id].size;
        self.blocks.get_mut(&id).expect("block exists").allocated = false;
        self.stats.allocated -= size;
        self.stats.active_blocks -= 1;
        let mut id = id;
        if let Some(p) = self.blocks[&id].prev {
            if !self.blocks[&p].allocated {
                id = self.merge(p, id);
            }
        }
        if let Some(n) = self.blocks[&id].next {
            if !self.blocks[&n].allocated {
                id = self.merge(id, n);
            }
        }
        let k = self.key(id);
        self.free.insert(k);
        Ok(())
    }

    /// Merges free block `b` into its free predecessor `a` (either may be on the free list);
    /// returns `a`, now off the free list.
    fn merge(&mut self, a: BlockId, b: BlockId) -> BlockId {
        for x in [a, b] {
            let k = self.key(x);
            self.free.remove(&k);
        }
        let bb = self.blocks.remove(&b).expect("block exists");
        if let Some(n) = bb.next {
            self.blocks.get_mut(&n).expect("next exists").prev = Some(a);
        }
        let ab = self.blocks.get_mut(&a).expect("block exists");
        ab.size += bb.size;
        ab.next = bb.next;
        a
    }

    fn release_free_segments(&mut self) -> Result<()> {
        let whole: Vec<(u64, BlockId)> = self
            .segments
            .iter()
            .map(|(p, id)| (*p, *id))
            .filter(|(_, id)| {
                let b = &self.blocks[id];
                !b.allocated && b.next.is_none()
            })
            .collect();
        for (ptr, id) in whole {
            let k = self.key(id);
            self.raw.raw_free(ptr)?;
            self.free.remove(&k);
            let b = self.blocks.remove(&id).expect("block exists");
            self.segments.remove(&ptr);
            self.stats.reserved -= b.size;
            self.stats.raw_frees += 1;
            self.stats.segments -= 1;
        }
        Ok(())
    }

    /// Frees every cached segment that holds no live block (`torch.cuda.empty_cache`).
    pub fn empty_cache(&mut self) -> Result<()> {
        self.release_free_segments()
    }

    /// Checks the bookkeeping: segments tile exactly into blocks, live blocks do not overlap,
    /// no two free neighbours are left unmerged, the free list is exactly the free blocks,
    /// and the statistics match. A description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = 0usize;
        let mut allocated = 0usize;
        let mut reserved = 0usize;
        let mut live = 0usize;
        let mut free_blocks = BTreeSet::new();
        let mut ranges = Vec::new();
        for (&base, &first) in &self.segments {
            if self.blocks[&first].prev.is_some() {
                return Err(format!("segment 0x{base:x}: first block has a predecessor"));
            }
            let mut cur = Some(first);
            let mut addr = base;
            let mut prev: Option<BlockId> = None;
            let mut prev_free = false;
            while let Some(id) = cur {
                let b = self.blocks.get(&id).ok_or(format!("dangling block {id}"))?;
                seen += 1;
                if b.ptr != addr {
                    return Err(format!(
                        "gap or overlap at 0x{addr:x} (block at 0x{:x})",
                        b.ptr
                    ));
                }
                if b.prev != prev {
                    return Err(format!("block 0x{:x}: broken prev link", b.ptr));
                }
                if b.size == 0 || b.size % ROUND != 0 {
                    return Err(format!(
                        "block 0x{:x}: size {} not a positive multiple of {ROUND}",
                        b.ptr, b.size
                    ));
                }
                if b.allocated {
                    allocated += b.size;
                    live += 1;
                    if self.live.get(&b.ptr) != Some(&id) {
                        return Err(format!(
                            "allocated block 0x{:x} missing from the live map",
                            b.ptr
                        ));
                    }
                    prev_free = false;
                } else {
                    if prev_free {
                        return Err(format!("free neighbours not coalesced at 0x{:x}", b.ptr));
                    }
                    prev_free = true;
                    free_blocks.insert((b.pool, b.stream, b.size, b.ptr, id));
                }
                addr += b.size as u64;
                prev = Some(id);
                cur = b.next;
            }
            let seg = (addr - base) as usize;
            reserved += seg;
            ranges.push((base, addr));
        }
        ranges.sort();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("segments overlap".into());
        }
        if seen != self.blocks.len() {
            return Err(format!(
                "{} blocks reachable, {} stored",
                seen,
                self.blocks.len()
            ));
        }
        if free_blocks != self.free {
            return Err("free list differs from the free blocks".into());
        }
        let s = &self.stats;
        if s.allocated != allocated
            || s.reserved != reserved
            || s.active_blocks != live
            || live != self.live.len()
            || s.segments != self.segments.len()
        {
            return Err(format!(
                "stats {s:?} disagree: allocated {allocated}, reserved {reserved}, live {live}"
            ));
        }
        if s.peak_allocated < s.allocated
            || s.peak_reserved < s.reserved
            || s.reserved < s.allocated
        {
            return Err(format!("inconsistent peaks/totals: {s:?}"));
        }
        if s.raw_mallocs - s.raw_frees != s.segments as u64 {
            return Err(format!("raw mallocs - frees != segments: {s:?}"));
        }
        Ok(())
    }
}
