//! Elementwise kernels over contiguous F32/F16/BF16 buffers that compute in F32 one
//! L1-sized chunk at a time: half-precision inputs are converted inside the loop (F16C /
//! the BF16 kernels of `dtype::convert`) and results rounded straight into the output
//! buffer, so no full-size F32 copy of an input or of the result ever exists. F32 inputs
//! are read in place. Chunks run in parallel.
//!
//! This keeps the memory of a half-precision training step at half-precision size: the
//! backward of a ReLU over a [512, 64, 32, 32] F16 activation used to build three
//! 128 MiB F32 vectors (gradient, saved input, result) before rounding.

use std::cell::RefCell;
use std::mem::MaybeUninit;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::cpu::reduce::sum_slice;
use crate::dtype::{convert, same_slice, same_slice_mut, DType, WithDType};
use crate::tensor::{CpuStorage, Layout};

/// Elements per chunk: 32 KiB of F32, three buffers fit in L1/L2 together.
const CHUNK: usize = 8192;

/// Values `start..start + buf.len()` of an F32, F16 or BF16 slice as F32: borrowed for F32,
/// converted into `buf` otherwise (the branch is chosen by `T`, at compile time).
pub fn read<'b, T: WithDType>(v: &'b [T], start: usize, buf: &'b mut [f32]) -> &'b [f32] {
    let end = start + buf.len();
    if let Some(v) = same_slice::<T, f32>(v) {
        &v[start..end]
    } else if let Some(v) = same_slice::<T, f16>(v) {
        convert::f16_to_f32(&v[start..end], buf);
        buf
    } else if let Some(v) = same_slice::<T, bf16>(v) {
        convert::bf16_to_f32(&v[start..end], buf);
        buf
    } else {
        unreachable!("chunked kernels take F32, F16 or BF16")
    }
}

/// `dst = src` rounded to `T` (F32, F16 or BF16; one bulk conversion, nearest-even).
pub fn write<T: WithDType>(src: &[f32], dst: &mut [T]) {
    if let Some(d) = same_slice_mut::<T, f32>(dst) {
        d.copy_from_slice(src);
    } else if let Some(d) = same_slice_mut::<T, f16>(dst) {
        convert::f32_to_f16(src, d);
    } else if let Some(d) = same_slice_mut::<T, bf16>(dst) {
        convert::f32_to_bf16(src, d);
    } else {
        unreachable!("chunked kernels take F32, F16 or BF16")
    }
}

/// The F32 sum of an F32, F16 or BF16 slice: `sum_slice` itself for F32, else converted a
/// chunk of 1024 at a time, the chunks' `sum_slice`s added in order.
pub fn sum<T: WithDType>(v: &[T]) -> f32 {
    if let Some(v) = same_slice::<T, f32>(v) {
        return sum_slice(v);
    }
    let mut buf = [0f32; 1024];
    let mut total = 0.0;
    for (i, c) in v.chunks(buf.len()).enumerate() {
        total += sum_slice(read(v, i * 1024, &mut buf[..c.len()]));
    }
    total
}

/// A read-only view of a contiguous float buffer (the elementwise ops' fused kernels; the
/// kernels of `cpu::conv`, `conv_block` and `pool` take `&[T]` with `T: WithDType` and
/// `read` instead).
#[derive(Clone, Copy)]
pub enum Src<'a> {
    /// An F32 buffer slice.
    F32(&'a [f32]),
    /// An F16 buffer slice.
    F16(&'a [f16]),
    /// A BF16 buffer slice.
    BF16(&'a [bf16]),
}

impl<'a> Src<'a> {
    /// The contiguous values of `storage` under `layout`, if the layout is one contiguous
    /// run of an F32/F16/BF16 buffer.
    pub fn of(storage: &'a CpuStorage, layout: &Layout) -> Option<Src<'a>> {
        let r = layout.contiguous_range()?;
        Some(match storage {
            CpuStorage::F32(v) => Src::F32(&v[r]),
            CpuStorage::F16(v) => Src::F16(&v[r]),
            CpuStorage::BF16(v) => Src::BF16(&v[r]),
            _ => return None,
        })
    }

    /// The dtype of the viewed elements.
    pub fn dtype(&self) -> DType {
        match self {
            Src::F32(_) => DType::F32,
            Src::F16(_) => DType::F16,
            Src::BF16(_) => DType::BF16,
        }
    }

    /// Number of viewed elements.
    pub fn len(&self) -> usize {
        match self {
            Src::F32(v) => v.len(),
            Src::F16(v) => v.len(),
            Src::BF16(v) => v.len(),
        }
    }

    /// True when the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `start..start + buf.len()` as F32: borrowed for F32, converted into `buf`
    /// otherwise.
    pub fn read<'b>(&'b self, start: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let end = start + buf.len();
        match self {
            Src::F32(v) => &v[start..end],
            Src::F16(v) => {
                convert::f16_to_f32(&v[start..end], buf);
                buf
            }
            Src::BF16(v) => {
                convert::bf16_to_f32(&v[start..end], buf);
                buf
            }
        }
    }
}

/// Three CHUNK-long F32 buffers of this thread (a chunk's result and its two inputs),
/// allocated once: stack arrays were zeroed for every chunk, three 32 KiB memsets per 8192
/// elements.
fn with_scratch<R>(f: impl FnOnce(&mut [f32], &mut [f32], &mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    fn split(v: &mut [f32]) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let (r, rest) = v.split_at_mut(CHUNK);
        let (a, b) = rest.split_at_mut(CHUNK);
        (r, a, &mut b[..CHUNK])
    }
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < 3 * CHUNK {
                v.resize(3 * CHUNK, 0.0);
            }
            let (r, a, b) = split(&mut v);
            f(r, a, b)
        }
        // A chunked kernel started from inside another one's chunk.
        Err(_) => {
            let mut v = vec![0f32; 3 * CHUNK];
            let (r, a, b) = split(&mut v);
            f(r, a, b)
        }
    })
}

/// `src` rounded into `dst` (F32 copied), initialising it: half types a kilo-element at a
/// time through a small stack buffer.
fn write_uninit<T: WithDType>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    // (`<[MaybeUninit<T>]>::write_copy_of_slice` is newer than the crate's MSRV, hence the
    // plain loops.)
    if let Some(d) = same_slice_mut::<MaybeUninit<T>, MaybeUninit<f32>>(dst) {
        d.iter_mut().zip(src).for_each(|(d, &s)| {
            d.write(s);
        });
        return;
    }
    let mut tmp = [T::default(); 1024];
    for (s, d) in src.chunks(1024).zip(dst.chunks_mut(1024)) {
        let t = &mut tmp[..s.len()];
        write(s, t);
        d.iter_mut().zip(t.iter()).for_each(|(d, &v)| {
            d.write(v);
        });
    }
}

/// A new buffer of `n_blocks` blocks of `block` values, block `i` zeroed by the task that
/// then runs `kernel(state, i, block)` on it (`state` from `init`, once per task); blocks run
/// in parallel, at least `min_len` per task.
///
/// For outputs that kernels write block by block: `vec![0; len]` first was a serial memset of
/// the whole output (with the page faults of a fresh buffer) while the other workers spun, and
/// zeroing it in a separate parallel pass still sent every line to memory and back: 4–7 % of
/// the samples of a ResNet-20 training step on 2 Emerald Rapids cores either way. A block
/// zeroed just before its kernel stays in cache.
pub fn blocks_zeroed<T: Copy + Default + Send, S>(
    n_blocks: usize,
    block: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    kernel: impl Fn(&mut S, usize, &mut [T]) + Sync,
) -> Vec<T> {
    let (out, _) = blocks_zeroed2(
        n_blocks,
        block,
        (true, false),
        min_len,
        init,
        |s, i, o, _| kernel(s, i, o.expect("the first output is wanted")),
    );
    out
}

/// `blocks_zeroed` without the zeroing (`blocks_uninit2` for one output).
///
/// # Safety
/// `kernel` initialises every element of each block it receives.
pub unsafe fn blocks_uninit<T: Copy + Send, S>(
    n_blocks: usize,
    block: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    kernel: impl Fn(&mut S, usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    // SAFETY: forwarded.
    let (out, _) = unsafe {
        blocks_uninit2(
            n_blocks,
            block,
            (true, false),
            min_len,
            init,
            |s, i, o, _| kernel(s, i, o.expect("the first output is wanted")),
        )
    };
    out
}

/// `blocks_zeroed` for two outputs of the same blocks, each wanted or not (an output not
/// wanted is empty and its blocks `None`).
pub fn blocks_zeroed2<T: Copy + Default + Send, S>(
    n_blocks: usize,
    block: usize,
    wants: (bool, bool),
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    kernel: impl Fn(&mut S, usize, Option<&mut [T]>, Option<&mut [T]>) + Sync,
) -> (Vec<T>, Vec<T>) {
    let zeroed = |d: Option<&mut [MaybeUninit<T>]>| {
        d.map(|d| {
            d.iter_mut().for_each(|d| {
                d.write(T::default());
            });
            // SAFETY: every element of `d` was just written.
            unsafe { &mut *(d as *mut [MaybeUninit<T>] as *mut [T]) }
        })
    };
    // SAFETY: every block handed to `kernel` was zeroed first, so each is initialised
    // whatever `kernel` writes.
    unsafe {
        blocks_uninit2(n_blocks, block, wants, min_len, init, |s, i, a, b| {
            kernel(s, i, zeroed(a), zeroed(b))
        })
    }
}

/// `blocks_zeroed2` without the zeroing, for kernels that write every element of the blocks
/// they are given (batch norm's AVX-512 loops): the memset of each block was 3 % of a
/// ResNet-20 amp-bf16 step on 2 Emerald Rapids cores.
///
/// # Safety
/// `kernel` initialises every element of each block it receives.
pub unsafe fn blocks_uninit2<T: Copy + Send, S>(
    n_blocks: usize,
    block: usize,
    (want_a, want_b): (bool, bool),
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    kernel: impl Fn(&mut S, usize, Option<&mut [MaybeUninit<T>]>, Option<&mut [MaybeUninit<T>]>) + Sync,
) -> (Vec<T>, Vec<T>) {
    let len = n_blocks * block;
    let (la, lb) = (if want_a { len } else { 0 }, if want_b { len } else { 0 });
    let (mut a, mut b): (Vec<T>, Vec<T>) = (Vec::with_capacity(la), Vec::with_capacity(lb));
    if len > 0 && (want_a || want_b) {
        let pa = SendPtr(a.spare_capacity_mut().as_mut_ptr());
        let pb = SendPtr(b.spare_capacity_mut().as_mut_ptr());
        crate::threads::nudge();
        for_each_block(n_blocks, min_len, init, |state, i| {
            let part = |p: &SendPtr<T>, wanted: bool| {
                // SAFETY: block i of a buffer with capacity for `n_blocks` blocks; each
                // index is taken by one task only, so the blocks are disjoint.
                wanted.then(|| unsafe { std::slice::from_raw_parts_mut(p.0.add(i * block), block) })
            };
            kernel(state, i, part(&pa, want_a), part(&pb, want_b));
        });
    }
    // SAFETY: `kernel` initialised every block of each wanted output (the caller's promise;
    // none when `len` is 0); a panic in it propagates before this line, dropping both
    // vectors at length 0.
    unsafe {
        a.set_len(la);
        b.set_len(lb);
    }
    (a, b)
}

/// `body(state, i)` for every `i` in `0..n` in parallel, at least `min_len` indices per task,
/// `state` made by `init()` once per task of rayon's split (rayon's `for_each_init`).
///
/// Through one type-erased pipeline ([`for_each_erased`]): a `for_each_init` per caller
/// compiled rayon's splitting and job machinery again for every kernel closure, a quarter of
/// the library's LLVM IR (`cargo llvm-lines`: 214 `for_each` pipelines) and of its build
/// time. The indirect call per index costs nothing beside a block's work.
pub fn for_each_block<S>(
    n: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    body: impl Fn(&mut S, usize) + Sync,
) {
    let init = || {
        let state = Box::into_raw(Box::new(init())).cast::<()>();
        ErasedState {
            state,
            // SAFETY: `state` came from `Box<S>::into_raw` just above.
            drop: |p| drop(unsafe { Box::from_raw(p.cast::<S>()) }),
        }
    };
    // SAFETY: every `ErasedState` this pipeline holds was made by `init` above from an `S`.
    let body = |e: &mut ErasedState, i: usize| body(unsafe { &mut *e.state.cast::<S>() }, i);
    for_each_erased(n, min_len, &init, &body);
}

/// A task's state of [`for_each_block`], its type erased; dropped as the `S` it holds.
struct ErasedState {
    state: *mut (),
    drop: fn(*mut ()),
}

impl Drop for ErasedState {
    fn drop(&mut self) {
        (self.drop)(self.state)
    }
}

/// The one `for_each_init` pipeline of [`for_each_block`]. The states never leave their task
/// and are dropped before this returns, so the `S` they hold may borrow from the caller.
fn for_each_erased(
    n: usize,
    min_len: usize,
    init: &(dyn Fn() -> ErasedState + Sync + Send),
    body: &(dyn Fn(&mut ErasedState, usize) + Sync),
) {
    (0..n)
        .into_par_iter()
        .with_min_len(min_len.max(1))
        .for_each_init(init, body);
}

/// `body(i, chunk)` for the `chunk_len`-sized chunks of `out` (the last one shorter) in
/// parallel (rayon's `par_chunks_mut(..).enumerate().for_each(..)`): through
/// [`for_each_block`]'s one pipeline, not a rayon pipeline per element type or kernel
/// closure.
pub fn for_each_chunk<T: Send>(
    out: &mut [T],
    chunk_len: usize,
    body: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    for_each_chunk_init(out, chunk_len, 1, || (), &|_, i, o| body(i, o));
}

/// `body(i, chunk)` for the `chunk_len`-sized chunks of `out` (the last one shorter) in
/// parallel, at least `min_len` chunks per task (`par_chunks_mut(..).enumerate()
/// .with_min_len(..)`), through [`for_each_block`]'s one pipeline.
pub fn for_each_chunk_min<T: Send>(
    out: &mut [T],
    chunk_len: usize,
    min_len: usize,
    body: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    for_each_chunk_init(out, chunk_len, min_len, || (), &|_, i, o| body(i, o));
}

/// [`for_each_chunk_min`] with per-task state: `init()` makes one `S` for each task of
/// rayon's split (rayon's `for_each_init`), passed to `body(state, i, chunk)`.
pub fn for_each_chunk_init<T: Send, S>(
    out: &mut [T],
    chunk_len: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    body: &(dyn Fn(&mut S, usize, &mut [T]) + Sync),
) {
    let a = Chunks::new(out, chunk_len);
    // SAFETY: each chunk index is taken by one task only.
    for_each_block(a.count, min_len, init, |s, i| {
        body(s, i, unsafe { a.get(i) })
    });
}

/// `body(i, a_i, b_i)` for the chunks `a_i` of `a.0` (`a.1` long) and `b_i` of `b.0` (`b.1`
/// long), the last ones shorter, as many as the shorter list has (rayon's `zip` of two
/// `par_chunks_mut`), in parallel, at least `min_len` per task: one `for_each_block`
/// pipeline instead of a zipped rayon pipeline per kernel closure. Read-only inputs are cut
/// by the body with [`chunk`].
#[allow(clippy::type_complexity)]
pub fn for_each_chunk2<A: Send, B: Send>(
    a: (&mut [A], usize),
    b: (&mut [B], usize),
    min_len: usize,
    body: &(dyn Fn(usize, &mut [A], &mut [B]) + Sync),
) {
    for_each_chunk2_init(a, b, min_len, || (), &|_, i, a, b| body(i, a, b));
}

/// [`for_each_chunk2`] with per-task state: `init()` makes one `S` for each task of rayon's
/// split (rayon's `for_each_init`), passed to `body(state, i, a_i, b_i)`.
#[allow(clippy::type_complexity)]
pub fn for_each_chunk2_init<A: Send, B: Send, S>(
    a: (&mut [A], usize),
    b: (&mut [B], usize),
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    body: &(dyn Fn(&mut S, usize, &mut [A], &mut [B]) + Sync),
) {
    let (a, b) = (Chunks::new(a.0, a.1), Chunks::new(b.0, b.1));
    let n = a.count.min(b.count);
    // SAFETY: each chunk index is taken by one task only.
    for_each_block(n, min_len, init, |s, i| unsafe {
        body(s, i, a.get(i), b.get(i))
    });
}

/// [`for_each_chunk2`] over four mutable slices (Adam's parameters and state).
#[allow(clippy::type_complexity)]
pub fn for_each_chunk4<A: Send, B: Send, C: Send, D: Send>(
    a: (&mut [A], usize),
    b: (&mut [B], usize),
    c: (&mut [C], usize),
    d: (&mut [D], usize),
    body: &(dyn Fn(usize, &mut [A], &mut [B], &mut [C], &mut [D]) + Sync),
) {
    let (a, b) = (Chunks::new(a.0, a.1), Chunks::new(b.0, b.1));
    let (c, d) = (Chunks::new(c.0, c.1), Chunks::new(d.0, d.1));
    let n = a.count.min(b.count).min(c.count).min(d.count);
    // SAFETY: each chunk index is taken by one task only.
    for_each_block(
        n,
        1,
        || (),
        |_, i| unsafe { body(i, a.get(i), b.get(i), c.get(i), d.get(i)) },
    );
}

/// `f(state, i, chunk_i)` for the `chunk_len`-sized chunks of `v` (the last one shorter) in
/// parallel, the results in chunk order (rayon's `par_chunks_mut(..).enumerate()
/// .map_init(init, ..).collect()`), through [`map_collect`].
pub fn map_chunks<T: Send, S, R: Send>(
    v: &mut [T],
    chunk_len: usize,
    init: impl Fn() -> S + Sync + Send,
    f: &(dyn Fn(&mut S, usize, &mut [T]) -> R + Sync),
) -> Vec<R> {
    let v = Chunks::new(v, chunk_len);
    // SAFETY: each chunk index is taken by one task only.
    map_collect(v.count, 1, init, |s, i| f(s, i, unsafe { v.get(i) }))
}

/// [`for_each_chunk2_init`] over three mutable slices.
#[allow(clippy::type_complexity)]
pub fn for_each_chunk3_init<A: Send, B: Send, C: Send, S>(
    a: (&mut [A], usize),
    b: (&mut [B], usize),
    c: (&mut [C], usize),
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    body: &(dyn Fn(&mut S, usize, &mut [A], &mut [B], &mut [C]) + Sync),
) {
    let (a, b, c) = (
        Chunks::new(a.0, a.1),
        Chunks::new(b.0, b.1),
        Chunks::new(c.0, c.1),
    );
    let n = a.count.min(b.count).min(c.count);
    // SAFETY: each chunk index is taken by one task only.
    for_each_block(n, min_len, init, |s, i| unsafe {
        body(s, i, a.get(i), b.get(i), c.get(i))
    });
}

/// Chunk `i` of `v` cut into `len`-sized chunks, the last one shorter (the `i`-th item of
/// `v.par_chunks(len)`), for the read-only inputs of a [`for_each_chunk2`] body.
pub fn chunk<T>(v: &[T], i: usize, len: usize) -> &[T] {
    &v[i * len..((i + 1) * len).min(v.len())]
}

/// `f(state, i)` for every `i` in `0..n` in parallel, the results in index order (rayon's
/// `(0..n).into_par_iter().with_min_len(min_len).map_init(init, f).collect()`), `state`
/// made by `init()` once per task: through [`for_each_block`]'s one pipeline, not a
/// `collect` pipeline per closure. Each result depends on its index only, so the vector is
/// the same whatever the split.
pub fn map_collect<S, T: Send>(
    n: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize) -> T + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(n);
    let p = SendPtr(out.spare_capacity_mut().as_mut_ptr());
    for_each_block(n, min_len, init, |s, i| {
        let v = f(s, i);
        // SAFETY: slot i < n of the capacity, written by the one task that takes i.
        unsafe { (*p.at(i)).write(v) };
    });
    // SAFETY: every index of 0..n was written above (a panic in `f` propagates before this
    // line, leaking the results written so far, never exposing an unwritten one).
    unsafe { out.set_len(n) };
    out
}

/// A mutable slice cut into chunks that the tasks of [`for_each_block`] take by index.
struct Chunks<T> {
    ptr: *mut T,
    len: usize,
    chunk: usize,
    count: usize,
}

// SAFETY: tasks take disjoint chunks (each index once), as with `par_chunks_mut`.
unsafe impl<T: Send> Send for Chunks<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Chunks<T> {}

impl<T> Chunks<T> {
    fn new(v: &mut [T], chunk: usize) -> Chunks<T> {
        assert!(chunk != 0, "chunk_size must not be zero");
        Chunks {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            chunk,
            count: v.len().div_ceil(chunk),
        }
    }

    /// Chunk `i` (`i < count`).
    ///
    /// # Safety
    /// No other reference to chunk `i` is alive while the returned one is.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get<'a>(&self, i: usize) -> &'a mut [T] {
        debug_assert!(i < self.count);
        let start = i * self.chunk;
        let len = self.chunk.min(self.len - start);
        // SAFETY: `start..start + len` lies in the slice; the caller keeps it unaliased.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// A buffer's start, shared by the tasks that write its disjoint blocks.
struct SendPtr<T>(*mut MaybeUninit<T>);

impl<T> SendPtr<T> {
    /// Element `i` of the buffer (a method, so closures capture the whole `SendPtr`, not
    /// its raw pointer field).
    fn at(&self, i: usize) -> *mut MaybeUninit<T> {
        self.0.wrapping_add(i)
    }
}
// SAFETY: the tasks write disjoint blocks through it (`blocks_zeroed2`).
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// A new buffer of `n` values of `T`, chunk `i` (`CHUNK` values from `i·CHUNK`) computed in
/// F32 by `kernel(start, result, scratch_a, scratch_b)` and rounded once into it; chunks
/// run in parallel. The buffer is never zero-filled first (that memset was a pass over
/// every elementwise op's output).
fn collect<T: WithDType + Send, K>(n: usize, kernel: &K) -> Vec<T>
where
    K: Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync,
{
    let mut out: Vec<T> = Vec::with_capacity(n);
    crate::threads::nudge();
    for_each_chunk(&mut out.spare_capacity_mut()[..n], CHUNK, &|i, o| {
        with_scratch(|r, a, b| {
            let r = &mut r[..o.len()];
            kernel(i * CHUNK, r, a, b);
            write_uninit(r, o);
        })
    });
    // SAFETY: the chunks cover the first n elements, and `write_uninit` initialised each
    // chunk whole (a panic in a kernel propagates before this line, dropping `out` at
    // length 0).
    unsafe { out.set_len(n) };
    out
}

/// `out[i] = f(a[i])` for a chunk: `kernel(start, out, scratch_a, scratch_b)` fills `out`.
fn run<K>(n: usize, dtype: DType, kernel: K) -> Option<CpuStorage>
where
    K: Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync,
{
    Some(match dtype {
        DType::F32 => CpuStorage::F32(collect(n, &kernel)),
        DType::F16 => CpuStorage::F16(collect(n, &kernel)),
        DType::BF16 => CpuStorage::BF16(collect(n, &kernel)),
        _ => return None,
    })
}

/// `out = f(a)` elementwise into a new buffer of `dtype` (F32, F16 or BF16); `f` maps a
/// chunk of inputs to a chunk of outputs of the same length.
pub fn map1(a: Src<'_>, dtype: DType, f: impl Fn(&[f32], &mut [f32]) + Sync) -> Option<CpuStorage> {
    run(a.len(), dtype, |start, out, ab, _| {
        let av = a.read(start, &mut ab[..out.len()]);
        f(av, out);
    })
}

/// `out = f(a, b)` elementwise (equal lengths) into a new buffer of `dtype`.
pub fn map2(
    a: Src<'_>,
    b: Src<'_>,
    dtype: DType,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) -> Option<CpuStorage> {
    if a.len() != b.len() {
        return None;
    }
    run(a.len(), dtype, |start, out, ab, bb| {
        let av = a.read(start, &mut ab[..out.len()]);
        let bv = b.read(start, &mut bb[..out.len()]);
        f(av, bv, out);
    })
}

/// `dst[i] = f(dst[i], b[i])` in place (equal lengths; `dst` F32, F16 or BF16, all of it):
/// the same F32 values and the same single rounding as `map2` into a new buffer of `dst`'s
/// dtype, without the new buffer. `None` (and `dst` untouched) for other dtypes or lengths.
pub fn update2(
    dst: &mut CpuStorage,
    b: Src<'_>,
    f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
) -> Option<()> {
    fn each<T: WithDType + Send>(
        dst: &mut [T],
        b: Src<'_>,
        f: impl Fn(&[f32], &[f32], &mut [f32]) + Sync,
    ) {
        crate::threads::nudge();
        for_each_chunk(dst, CHUNK, &|i, o| {
            with_scratch(|ob, ab, bb| {
                let n = o.len();
                // `a` is read into its own buffer first, so `f` never sees its output
                // aliased.
                let av = &mut ab[..n];
                av.copy_from_slice(read(o, 0, &mut ob[..n]));
                let bv = b.read(i * CHUNK, &mut bb[..n]);
                let out = &mut ob[..n];
                f(av, bv, out);
                write(out, o);
            })
        });
    }
    let len = match dst {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        _ => return None,
    };
    if len != b.len() {
        return None;
    }
    match dst {
        CpuStorage::F32(v) => each(v, b, f),
        CpuStorage::F16(v) => each(v, b, f),
        CpuStorage::BF16(v) => each(v, b, f),
        _ => unreachable!("checked above"),
    }
    Some(())
}

/// A new buffer of `dtype` made of `n_blocks` blocks of `block_len` values, each computed
/// in F32 by `kernel(block, out)` (into the output itself for F32, else into a block-sized
/// F32 buffer rounded once into the output): per-image or per-plane kernels over
/// half-precision tensors without a full-size F32 result. Blocks run in parallel.
pub fn per_block(
    n_blocks: usize,
    block_len: usize,
    dtype: DType,
    kernel: impl Fn(usize, &mut [f32]) + Sync,
) -> Option<CpuStorage> {
    per_block_with(
        n_blocks,
        block_len,
        dtype,
        || (),
        |_, i, out| kernel(i, out),
    )
}

/// `per_block` with per-task scratch: `init()` makes one `S` for each task of rayon's split
/// (not per block), which `kernel(scratch, block, out)` reuses, e.g. an im2col buffer.
pub fn per_block_with<S>(
    n_blocks: usize,
    block_len: usize,
    dtype: DType,
    init: impl Fn() -> S + Sync + Send,
    kernel: impl Fn(&mut S, usize, &mut [f32]) + Sync,
) -> Option<CpuStorage> {
    if block_len == 0 {
        return CpuStorage::from_f32(Vec::new(), dtype).into();
    }
    Some(match dtype {
        DType::F32 => CpuStorage::F32(blocks_zeroed(n_blocks, block_len, 1, &init, &kernel)),
        DType::F16 => CpuStorage::F16(rounded_blocks(
            n_blocks,
            block_len,
            &init,
            &kernel,
            convert::f32_to_f16,
        )),
        DType::BF16 => CpuStorage::BF16(rounded_blocks(
            n_blocks,
            block_len,
            &init,
            &kernel,
            convert::f32_to_bf16,
        )),
        _ => return None,
    })
}

/// The blocks of `per_block_with` for a half output `T`: each computed into a zeroed F32
/// buffer kept with the task's scratch, then rounded into the output.
fn rounded_blocks<S, T: Copy + Default + Send>(
    n_blocks: usize,
    block_len: usize,
    init: &(impl Fn() -> S + Sync + Send),
    kernel: &(impl Fn(&mut S, usize, &mut [f32]) + Sync),
    round: fn(&[f32], &mut [T]),
) -> Vec<T> {
    blocks_zeroed(
        n_blocks,
        block_len,
        1,
        || (init(), vec![0f32; block_len]),
        |(s, buf), i, o| {
            buf.fill(0.0);
            kernel(s, i, buf);
            round(buf, o);
        },
    )
}
