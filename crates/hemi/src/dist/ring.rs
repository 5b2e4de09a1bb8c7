//! Collectives over a [`Transport`]'s paired send/receive: the ring all-reduce, its first
//! half alone (a reduce-scatter, for ZeRO stage 2) and a ring all-gather.
//!
//! **Ring all-reduce** of n values on N ranks (Patarasuk & Yuan 2009): the buffer is cut
//! into N chunks; in N − 1 reduce-scatter steps rank r sends chunk (r − s) mod N to rank
//! r + 1 and adds the chunk it receives from r − 1 into its own, so that rank r ends with
//! the complete sum of chunk (r + 1) mod N; N − 1 all-gather steps then pass the finished
//! chunks around. Each rank sends 2 (N − 1)/N · n values in all: the bandwidth optimum,
//! independent of N.
//!
//! **Fixed order.** Chunk c is summed as ((x_c + x_{c+1}) + x_{c+2}) + … (ranks mod N), the
//! same on every run with N ranks, and the owner's result is what everybody receives, so
//! all ranks hold the same bits and a run is reproducible for a given N. For N = 2 the
//! single addition is commutative, so the sum is also the one a single process adding two
//! gradients computes.
//!
//! **Wire dtypes.** Additions are in F32: a received F16/BF16 partial sum is widened, added to
//! the rank's own F32 values, and rounded to the wire dtype (round to nearest even) only when
//! sent on. The owner of a finished chunk rounds it once, keeps the rounded values itself and
//! sends them, so every rank ends with the same values. F16 is first multiplied by a power of
//! two agreed by all ranks (see [`Wire::F16`]); a bucket holding inf or NaN on any rank goes
//! as F32 instead, so that the non-finite value reaches every rank exactly as it would
//! without compression (and the loss scaler skips the step everywhere).

use std::time::Duration;

use half::{bf16, f16};

use super::{CommStats, Transport, Wire};
use crate::dtype::{convert, WithDType};
use crate::error::{Error, Result};

/// Chunk `c` of `n` values cut into `parts`: `c·n/parts .. (c+1)·n/parts`.
#[doc(hidden)]
pub fn chunk(n: usize, parts: usize, c: usize) -> std::ops::Range<usize> {
    c * n / parts..(c + 1) * n / parts
}

fn send_recv(
    t: &mut dyn Transport,
    send: &[u8],
    recv: &mut [u8],
    stats: &CommStats,
    timeout: Duration,
) -> Result<()> {
    let (r, n) = (t.rank(), t.size());
    stats.sent(send.len());
    t.sendrecv(send, (r + 1) % n, recv, (r + n - 1) % n, timeout)
}

/// Encodes `x` in the wire dtype into `out` (little-endian, `x.len() · wire.bytes()`).
fn encode(x: &[f32], wire: Wire, out: &mut Vec<u8>) {
    fn put<T: WithDType>(v: &[T], out: &mut Vec<u8>) {
        v.iter().for_each(|x| x.write_le(out));
    }
    out.clear();
    match wire {
        Wire::F32 => put(x, out),
        Wire::F16 => {
            let mut h = vec![f16::ZERO; x.len()];
            convert::f32_to_f16(x, &mut h);
            put(&h, out);
        }
        Wire::Bf16 => {
            let mut h = vec![bf16::ZERO; x.len()];
            convert::f32_to_bf16(x, &mut h);
            put(&h, out);
        }
    }
}

/// Decodes wire bytes into F32 values, each passed to `f(index, value)`.
fn decode(bytes: &[u8], wire: Wire, mut f: impl FnMut(usize, f32)) {
    fn get<T: WithDType>(b: &[u8]) -> Vec<T> {
        b.chunks_exact(std::mem::size_of::<T>())
            .map(T::read_le)
            .collect()
    }
    let widened = match wire {
        Wire::F32 => {
            for (i, c) in bytes.chunks_exact(4).enumerate() {
                f(i, f32::read_le(c));
            }
            return;
        }
        Wire::F16 => {
            let h = get::<f16>(bytes);
            let mut v = vec![0f32; h.len()];
            convert::f16_to_f32(&h, &mut v);
            v
        }
        Wire::Bf16 => {
            let h = get::<bf16>(bytes);
            let mut v = vec![0f32; h.len()];
            convert::bf16_to_f32(&h, &mut v);
            v
        }
    };
    for (i, x) in widened.into_iter().enumerate() {
        f(i, x);
    }
}

/// The exponent k of the F16 pre-scale 2^k for a bucket whose largest magnitude over all
/// ranks is `amax`, on `ranks` ranks: the largest k with ranks · amax · 2^k ≤ 2^15, so that
/// no partial sum can exceed F16's 65504; 0 for an all-zero bucket. Clamped so that 2^k
/// and 2^-k are normal F32 numbers.
pub fn f16_prescale_exponent(amax: f32, ranks: usize) -> i32 {
    if amax == 0.0 || !amax.is_finite() {
        return 0;
    }
    let bound = 32768.0 / (ranks as f64 * amax as f64);
    (bound.log2().floor() as i32).clamp(-120, 120)
}

fn pow2(k: i32) -> f32 {
    f32::from_bits(((127 + k) as u32) << 23)
}

/// Sums `data` over every rank of `t`, in place (see the module docs). The largest
/// magnitude is agreed first when `wire` is F16, which costs one small all-gather.
pub fn all_reduce(
    t: &mut dyn Transport,
    data: &mut [f32],
    wire: Wire,
    stats: &CommStats,
    timeout: Duration,
) -> Result<()> {
    let n_ranks = t.size();
    if n_ranks == 1 {
        return Ok(());
    }
    let (wire, k) = reduce_scatter_scaled(t, data, wire, stats, timeout)?;
    let r = t.rank();
    let n = data.len();
    let max_chunk = n.div_ceil(n_ranks) * wire.bytes();
    let (mut out, mut inbox) = (Vec::with_capacity(max_chunk), vec![0u8; max_chunk]);
    // All-gather.
    for s in 0..n_ranks - 1 {
        let send_c = chunk(n, n_ranks, (r + 1 + n_ranks - s) % n_ranks);
        let recv_c = chunk(n, n_ranks, (r + n_ranks - s) % n_ranks);
        encode(&data[send_c], wire, &mut out);
        let len = recv_c.len() * wire.bytes();
        send_recv(t, &out, &mut inbox[..len], stats, timeout)?;
        let dst = &mut data[recv_c];
        decode(&inbox[..len], wire, |i, v| dst[i] = v);
    }
    if k != 0 {
        let s = pow2(-k);
        data.iter_mut().for_each(|x| *x *= s);
    }
    Ok(())
}

/// The first half of [`all_reduce`] (ZeRO stage 2's gradient reduction): afterwards this
/// rank's own chunk of `data`, `chunk(len, N, (rank + 1) mod N)` (returned), holds the sum
/// over every rank with the very bits `all_reduce` gives there; the rest of `data` is
/// scratch. One rank: the whole of `data`, unchanged.
pub fn reduce_scatter(
    t: &mut dyn Transport,
    data: &mut [f32],
    wire: Wire,
    stats: &CommStats,
    timeout: Duration,
) -> Result<std::ops::Range<usize>> {
    let n_ranks = t.size();
    if n_ranks == 1 {
        return Ok(0..data.len());
    }
    let (_, k) = reduce_scatter_scaled(t, data, wire, stats, timeout)?;
    let own = chunk(data.len(), n_ranks, (t.rank() + 1) % n_ranks);
    if k != 0 {
        let s = pow2(-k);
        data[own.clone()].iter_mut().for_each(|x| *x *= s);
    }
    Ok(own)
}

/// Agrees the F16 pre-scale, scales `data` by it and runs the reduce-scatter steps, leaving
/// the owner's chunk rounded to the wire dtype as every rank will receive it. Returns the
/// wire dtype actually used (F32 where a bucket holds inf or NaN) and the exponent k of the
/// pre-scale 2^k (0: none), which the caller undoes.
fn reduce_scatter_scaled(
    t: &mut dyn Transport,
    data: &mut [f32],
    wire: Wire,
    stats: &CommStats,
    timeout: Duration,
) -> Result<(Wire, i32)> {
    let n_ranks = t.size();
    let mut wire = wire;
    let mut k = 0;
    if wire == Wire::F16 {
        let local = data.iter().fold(0f32, |m, &x| {
            if x.is_finite() {
                m.max(x.abs())
            } else {
                f32::INFINITY
            }
        });
        let all = all_gather_fixed(t, local.to_le_bytes().to_vec(), stats, timeout)?;
        let amax = all
            .iter()
            .map(|b| f32::from_le_bytes(b[..4].try_into().expect("4 bytes")))
            .fold(0f32, f32::max);
        if amax.is_finite() {
            k = f16_prescale_exponent(amax, n_ranks);
        } else {
            wire = Wire::F32;
        }
    }
    if k != 0 {
        let s = pow2(k);
        data.iter_mut().for_each(|x| *x *= s);
    }
    let r = t.rank();
    let n = data.len();
    let max_chunk = n.div_ceil(n_ranks) * wire.bytes();
    let (mut out, mut inbox) = (Vec::with_capacity(max_chunk), vec![0u8; max_chunk]);
    for s in 0..n_ranks - 1 {
        let send_c = chunk(n, n_ranks, (r + n_ranks - s) % n_ranks);
        let recv_c = chunk(n, n_ranks, (r + 2 * n_ranks - s - 1) % n_ranks);
        encode(&data[send_c], wire, &mut out);
        let len = recv_c.len() * wire.bytes();
        send_recv(t, &out, &mut inbox[..len], stats, timeout)?;
        let dst = &mut data[recv_c];
        decode(&inbox[..len], wire, |i, v| dst[i] += v);
    }
    // The owner rounds its finished chunk once, like everybody will receive it.
    let own = chunk(n, n_ranks, (r + 1) % n_ranks);
    if wire != Wire::F32 {
        encode(&data[own.clone()], wire, &mut out);
        let dst = &mut data[own];
        decode(&out, wire, |i, v| dst[i] = v);
    }
    Ok((wire, k))
}

/// Every rank's `mine`, in rank order (the byte strings may differ in length): N − 1 ring
/// steps, each passing on the string received in the step before.
pub fn all_gather(
    t: &mut dyn Transport,
    mine: Vec<u8>,
    stats: &CommStats,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let (r, n) = (t.rank(), t.size());
    let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); n];
    blocks[r] = mine;
    for s in 0..n.saturating_sub(1) {
        let send_i = (r + n - s) % n;
        let recv_i = (r + 2 * n - s - 1) % n;
        let len = (blocks[send_i].len() as u64).to_le_bytes();
        let mut got = [0u8; 8];
        send_recv(t, &len, &mut got, stats, timeout)?;
        let want = u64::from_le_bytes(got);
        if want > (1u64 << 40) {
            return Err(Error::Msg(format!(
                "rank {r}: a peer announced a message of {want} bytes (the ranks are out of \
                 step)"
            )));
        }
        let mut buf = vec![0u8; want as usize];
        let send = std::mem::take(&mut blocks[send_i]);
        send_recv(t, &send, &mut buf, stats, timeout)?;
        blocks[send_i] = send;
        blocks[recv_i] = buf;
    }
    Ok(blocks)
}

/// [`all_gather`] where every rank's string has the length of `mine`: N − 1 ring steps of
/// one message each (a peer sending another length is the transport's size error).
pub fn all_gather_fixed(
    t: &mut dyn Transport,
    mine: Vec<u8>,
    stats: &CommStats,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let (r, n) = (t.rank(), t.size());
    let len = mine.len();
    let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); n];
    blocks[r] = mine;
    for s in 0..n.saturating_sub(1) {
        let send_i = (r + n - s) % n;
        let recv_i = (r + 2 * n - s - 1) % n;
        let mut buf = vec![0u8; len];
        let send = std::mem::take(&mut blocks[send_i]);
        send_recv(t, &send, &mut buf, stats, timeout)?;
        blocks[send_i] = send;
        blocks[recv_i] = buf;
    }
    Ok(blocks)
}
