//! ZeRO stages 1 and 2 (Rajbhandari et al. 2020; DeepSpeed's ZeRO optimizer, PyTorch's
//! `ZeroRedundancyOptimizer`): every rank keeps the optimizer state and the F32 master
//! weights of its shard of the parameters only (stage 1), and with stage 2 also only its
//! shard of the reduced gradients. The results are the bits of plain data parallel.
//!
//! **The partition** is the ring's: the gradient buckets of [`super::GradReducer`] are cut
//! into N chunks each (`ring::chunk`), and rank r owns chunk (r + 1) mod N of every bucket:
//! the chunk whose sum the ring's reduce-scatter finishes on rank r. So stage 2 is the first
//! half of the all-reduce and stage 1 the whole of it, and every reduced gradient value is
//! the same F32 sum, added in the same order, as without ZeRO. A chunk may cut a parameter:
//! a rank's shard is a list of [`Piece`]s, each a contiguous element range of one parameter,
//! held as a flat tensor of the parameter's dtype (the "shard tensors"). The optimizer (and,
//! under fp16-master, the F32 masters) is built over the shard tensors; after its step, an
//! all-gather of the shard tensors (F32, F16 or BF16, as the model holds them) writes the
//! whole parameters on every rank.
//!
//! **Why the bits agree**: every optimizer's update, the loss scaler's unscaling and
//! clipping's scaling are element-wise (the kernels say the bits do not depend on the
//! split), so running them on slices changes nothing. What is not element-wise:
//! - the loss scaler's found-inf flag: each rank checks its shard, and the flag is reduced
//!   across ranks as in plain data parallel (an OR over shards is the OR over everything);
//! - the total norm of gradient clipping, a sequential f64 sum of squares per parameter in
//!   element order, then over parameters in order ([`ZeroShard::grad_norm`] reproduces it:
//!   a parameter cut by a chunk boundary continues its sum on the next chunk's owner);
//! - checkpoints: the shards' optimizer states are gathered into the unsharded format
//!   ([`ZeroShard::gather_state`]), and a resumed run slices that format again
//!   ([`ZeroShard::shard_state`]).

use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use super::ring::chunk;
use super::{ProcessGroup, ReducerConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, StateBuffer};
use crate::tensor::Tensor;

/// Which ZeRO stage a data-parallel run uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// Plain data parallel: every rank holds everything.
    #[default]
    Off,
    /// Optimizer state and F32 masters sharded; gradients all-reduced in full.
    One,
    /// As `One`, and gradients reduce-scattered: each rank keeps its shard of them.
    Two,
}

impl ZeroStage {
    /// 0, 1 or 2.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }

    /// The stage numbered `n` (0, 1 or 2).
    pub fn from_number(n: u8) -> Result<ZeroStage> {
        match n {
            0 => Ok(ZeroStage::Off),
            1 => Ok(ZeroStage::One),
            2 => Ok(ZeroStage::Two),
            _ => Err(Error::arg(
                "zero",
                format!("ZeRO stage {n} does not exist here (0: off, 1, 2)"),
            )),
        }
    }
}

/// Elements `range` of parameter `param`, held by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in the model's parameter list.
    pub param: usize,
    /// The element range within the (row-major) parameter.
    pub range: Range<usize>,
    /// The gradient bucket the parameter belongs to.
    pub bucket: usize,
    /// Where the piece starts within the rank's chunk of that bucket.
    pub at: usize,
}

/// The gradient buckets of `numel` (parameter sizes) for `bucket_bytes`: parameters in
/// reverse order, a bucket closing once it holds `bucket_bytes` of F32 gradients (the
/// order a backward completes gradients in; [`super::GradReducer`] launches them so).
#[doc(hidden)]
pub fn buckets(numel: &[usize], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0usize;
    for i in (0..numel.len()).rev() {
        if buckets.is_empty() || bytes >= bucket_bytes {
            buckets.push(Vec::new());
            bytes = 0;
        }
        buckets.last_mut().expect("pushed").push(i);
        bytes += numel[i] * 4;
    }
    buckets
}

/// The pieces rank `rank` of `ranks` owns: chunk (rank + 1) mod N of every bucket, cut at
/// parameter boundaries, in bucket order.
pub fn pieces(numel: &[usize], buckets: &[Vec<usize>], ranks: usize, rank: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    for (b, members) in buckets.iter().enumerate() {
        let len: usize = members.iter().map(|&i| numel[i]).sum();
        let own = chunk(len, ranks, (rank + 1) % ranks);
        let mut offset = 0;
        for &i in members {
            let (lo, hi) = (offset.max(own.start), (offset + numel[i]).min(own.end));
            if lo < hi {
                out.push(Piece {
                    param: i,
                    range: lo - offset..hi - offset,
                    bucket: b,
                    at: lo - own.start,
                });
            }
            offset += numel[i];
        }
    }
    out
}

/// One rank's shard of a model's parameters: the pieces it owns, a flat tensor for each
/// (what the optimizer updates), and the collectives that keep the whole parameters and the
/// checkpoints those of plain data parallel.
pub struct ZeroShard {
    stage: ZeroStage,
    group: Arc<ProcessGroup>,
    params: Vec<Tensor>,
    numel: Vec<usize>,
    buckets: Vec<Vec<usize>>,
    pieces: Vec<Piece>,
    shards: Vec<Tensor>,
    /// Per bucket: the indices of this rank's pieces in it.
    by_bucket: Vec<Vec<usize>>,
}

impl std::fmt::Debug for ZeroShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroShard")
            .field("stage", &self.stage)
            .field("rank", &self.group.rank())
            .field("pieces", &self.pieces.len())
            .finish()
    }
}

impl ZeroShard {
    /// This rank's shard of `params` (the model's parameters, in order), bucketed as
    /// `reducer` buckets gradients. Errors for `ZeroStage::Off`.
    pub fn new(
        stage: ZeroStage,
        group: Arc<ProcessGroup>,
        params: Vec<Tensor>,
        reducer: ReducerConfig,
    ) -> Result<ZeroShard> {
        if stage == ZeroStage::Off {
            return Err(Error::arg("ZeroShard", "ZeRO stage 0 has no shard"));
        }
        if reducer.bucket_bytes == 0 {
            return Err(Error::arg("ZeroShard", "bucket_bytes must be > 0"));
        }
        crate::optim::check_params("ZeroShard", &params)?;
        let numel: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let buckets = buckets(&numel, reducer.bucket_bytes);
        let pieces = pieces(&numel, &buckets, group.size(), group.rank());
        let mut by_bucket = vec![Vec::new(); buckets.len()];
        for (k, p) in pieces.iter().enumerate() {
            by_bucket[p.bucket].push(k);
        }
        let shards = pieces
            .iter()
            .map(|pc| slice_of(&params[pc.param], &pc.range))
            .collect::<Result<Vec<_>>>()?;
        Ok(ZeroShard {
            stage,
            group,
            params,
            numel,
            buckets,
            pieces,
            shards,
            by_bucket,
        })
    }

    /// The stage.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// This rank's pieces, in the order of [`ZeroShard::shards`].
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// One flat tensor per piece, of its parameter's dtype: build the optimizer over these.
    pub fn shards(&self) -> &[Tensor] {
        &self.shards
    }

    /// The gradient buckets (parameter indices, in launch order).
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.buckets
    }

    /// Per-piece flags from per-parameter ones (a weight-decay mask).
    pub fn piece_flags(&self, per_param: &[bool]) -> Vec<bool> {
        self.pieces.iter().map(|p| per_param[p.param]).collect()
    }

    /// Copies the parameters' current values into the shard tensors (after a checkpoint
    /// was loaded into the model).
    pub fn refresh_from_params(&self) -> Result<()> {
        for (pc, s) in self.pieces.iter().zip(&self.shards) {
            s.set_data(&slice_of(&self.params[pc.param], &pc.range)?)?;
        }
        Ok(())
    }

    /// Clears the model parameters' gradients (the optimizer clears the shards').
    pub fn zero_param_grads(&self) {
        for p in &self.params {
            p.zero_grad();
        }
    }

    /// Sets the gradients of this rank's pieces of bucket `b` from `own`, the bucket's
    /// reduced chunk owned by this rank (sums over the ranks): each value divided by
    /// `ranks` in F32 and stored in `dtype[param]`, as plain data parallel averages.
    pub(crate) fn set_bucket_grads(&self, b: usize, own: &[f32], dtype: &[DType]) -> Result<()> {
        let n = self.group.size() as f32;
        for &k in &self.by_bucket[b] {
            let pc = &self.pieces[k];
            let len = pc.range.len();
            let avg: Vec<f32> = own[pc.at..pc.at + len].iter().map(|&x| x / n).collect();
            self.shards[k].set_grad(Some(Tensor::from_f32_vec(avg, &[len], dtype[pc.param])?));
        }
        Ok(())
    }

    /// After the optimizer stepped the shards: every rank's shard tensors, all-gathered, are
    /// written into the whole parameters (in the parameters' dtype, so the bytes sent are
    /// those of the model's weights).
    pub fn gather_params(&self) -> Result<()> {
        let mut mine = Vec::new();
        for s in &self.shards {
            put_bytes(s, &mut mine)?;
        }
        let all = self.group.all_gather(mine)?;
        let n = self.group.size();
        // Where each parameter's pieces lie in the ranks' blocks: (rank, byte offset, range).
        let mut sources: Vec<Vec<(usize, usize, Range<usize>)>> =
            vec![Vec::new(); self.params.len()];
        for (r, block) in all.iter().enumerate() {
            let mut at = 0;
            for pc in pieces(&self.numel, &self.buckets, n, r) {
                let len = pc.range.len() * dtype_bytes(self.params[pc.param].dtype());
                if at + len > block.len() {
                    return Err(Error::Msg(format!(
                        "rank {}: rank {r} sent {} bytes of its shard, fewer than its pieces hold",
                        self.group.rank(),
                        block.len()
                    )));
                }
                sources[pc.param].push((r, at, pc.range));
                at += len;
            }
        }
        // One parameter at a time, so that only one new buffer exists beside the blocks.
        for (i, p) in self.params.iter().enumerate() {
            let w = dtype_bytes(p.dtype());
            let mut bytes = vec![0u8; p.numel() * w];
            let mut filled = 0;
            for (r, at, range) in &sources[i] {
                let len = range.len() * w;
                bytes[range.start * w..range.end * w].copy_from_slice(&all[*r][*at..*at + len]);
                filled += range.len();
            }
            if filled != p.numel() {
                return Err(Error::Msg(format!(
                    "rank {}: the shards cover {filled} of parameter {i}'s {} values",
                    self.group.rank(),
                    p.numel()
                )));
            }
            p.set_data(&from_bytes(&bytes, p.shape(), p.dtype())?)?;
        }
        Ok(())
    }

    /// The total 2-norm of the gradients of `tensors` (one per piece, in piece order: the
    /// shard tensors, or their F32 masters), over every rank: the bits
    /// `optim::grad_norm(params, 2.0)` gives on the unsharded gradients. A collective: every
    /// rank calls it at the same point.
    ///
    /// The unsharded norm adds x² in f64 over each parameter's elements in order, then the
    /// parameters' sums in parameter order. A chunk that starts inside a parameter continues
    /// that parameter's sum from the previous chunk's owner: N − 1 rounds, in chunk order,
    /// each an all-gather of one f64 per bucket (chunk s is owned by rank s − 1 mod N).
    /// Then each parameter's sum, held by the rank that finished it, reaches every rank
    /// (an all-gather of one f64 per parameter) and is added in order.
    pub fn grad_norm(&self, tensors: &[Tensor]) -> Result<f64> {
        if tensors.len() != self.pieces.len() {
            return Err(Error::arg(
                "ZeroShard::grad_norm",
                format!(
                    "{} tensors for the {} pieces of this rank",
                    tensors.len(),
                    self.pieces.len()
                ),
            ));
        }
        let (n, r) = (self.group.size(), self.group.rank());
        let nb = self.buckets.len();
        let my_chunk = (r + 1) % n;
        let mut carry = vec![0f64; nb];
        let mut finished = vec![0f64; self.params.len()];
        for s in 0..n {
            let mut out = vec![0f64; nb];
            if s == my_chunk {
                for (b, ks) in self.by_bucket.iter().enumerate() {
                    // An empty chunk passes the carry on.
                    out[b] = carry[b];
                    for &k in ks {
                        let pc = &self.pieces[k];
                        let mut acc = if pc.range.start == 0 { 0.0 } else { carry[b] };
                        if let Some(g) = tensors[k].grad() {
                            for x in g.to_vec_f64() {
                                acc += x * x;
                            }
                        }
                        if pc.range.end == self.numel[pc.param] {
                            finished[pc.param] = acc;
                        } else {
                            out[b] = acc;
                        }
                    }
                }
            }
            if s + 1 < n {
                let all = self.group.all_gather_f64(&out)?;
                carry = all[(s + n - 1) % n].clone();
            }
        }
        // One rank finished each parameter; the others hold +0.0, which adds exactly.
        let sums = self.group.sum_f64(&finished)?;
        let mut total = 0.0f64;
        for s in sums {
            total += s;
        }
        Ok(total.sqrt())
    }

    /// The unsharded optimizer state from every rank's shard state (`mine`, this rank's
    /// `state_dict()`), on rank 0 (`None` elsewhere): the state plain data parallel would
    /// save, entry for entry and in its order. A collective.
    pub fn gather_state(&self, mine: &OptimizerState) -> Result<Option<OptimizerState>> {
        let all = self.group.all_gather(encode_state(mine))?;
        if self.group.rank() != 0 {
            return Ok(None);
        }
        let states = all
            .iter()
            .map(|b| decode_state(b))
            .collect::<Result<Vec<_>>>()?;
        let n = self.group.size();
        let per_rank: Vec<Vec<Piece>> = (0..n)
            .map(|r| pieces(&self.numel, &self.buckets, n, r))
            .collect();
        let shapes: Vec<Vec<usize>> = self.params.iter().map(|p| p.shape().to_vec()).collect();
        unshard_state(&states, &per_rank, &shapes).map(Some)
    }

    /// This rank's shard of an unsharded optimizer state (a checkpoint's), to load into the
    /// optimizer over the shard tensors.
    pub fn shard_state(&self, full: &OptimizerState) -> Result<OptimizerState> {
        let mut scalars = Vec::new();
        for (name, v) in &full.scalars {
            match split_index(name) {
                Some((pre, i, suf)) => {
                    self.check_index(name, i)?;
                    for (k, pc) in self.pieces.iter().enumerate() {
                        if pc.param == i {
                            scalars.push((format!("{pre}{k}{suf}"), *v));
                        }
                    }
                }
                None if is_count(name) => scalars.push((name.clone(), self.pieces.len() as f64)),
                None => scalars.push((name.clone(), *v)),
            }
        }
        let mut buffers = Vec::new();
        for b in &full.buffers {
            let Some((pre, i, suf)) = split_index(&b.name) else {
                return Err(Error::arg(
                    "ZeroShard::shard_state",
                    format!("buffer {:?} belongs to no parameter", b.name),
                ));
            };
            self.check_index(&b.name, i)?;
            if b.data.len() != self.numel[i] {
                return Err(Error::shape(
                    "ZeroShard::shard_state",
                    format!(
                        "buffer {:?} holds {} values, parameter {i} {}",
                        b.name,
                        b.data.len(),
                        self.numel[i]
                    ),
                ));
            }
            for (k, pc) in self.pieces.iter().enumerate() {
                if pc.param == i {
                    buffers.push(StateBuffer {
                        name: format!("{pre}{k}{suf}"),
                        shape: vec![pc.range.len()],
                        data: b.data[pc.range.clone()].to_vec(),
                    });
                }
            }
        }
        Ok(OptimizerState {
            optimizer: full.optimizer.clone(),
            scalars,
            buffers,
        })
    }

    fn check_index(&self, name: &str, i: usize) -> Result<()> {
        if i >= self.params.len() {
            return Err(Error::arg(
                "ZeroShard::shard_state",
                format!(
                    "state entry {name:?} names parameter {i}; the model has {}",
                    self.params.len()
                ),
            ));
        }
        Ok(())
    }
}

/// Elements `range` of `p` as a flat leaf tensor of `p`'s dtype (exact: F16 and BF16 widen to
/// F32 and round back without change).
fn slice_of(p: &Tensor, range: &Range<usize>) -> Result<Tensor> {
    let v = p.to_vec_f32();
    Tensor::from_f32_vec(v[range.clone()].to_vec(), &[range.len()], p.dtype())
}

fn dtype_bytes(d: DType) -> usize {
    match d {
        DType::F16 | DType::BF16 => 2,
        _ => 4,
    }
}

/// `t`'s values, little-endian, in its dtype (F32, F16 or BF16).
fn put_bytes(t: &Tensor, out: &mut Vec<u8>) -> Result<()> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()?
            .iter()
            .for_each(|x| out.extend(x.to_le_bytes())),
        DType::F16 => t
            .to_vec::<f16>()?
            .iter()
            .for_each(|x| out.extend(x.to_le_bytes())),
        DType::BF16 => t
            .to_vec::<bf16>()?
            .iter()
            .for_each(|x| out.extend(x.to_le_bytes())),
        d => {
            return Err(Error::dtype(
                "ZeroShard",
                d,
                "ZeRO shards F32, F16 and BF16 parameters",
            ))
        }
    }
    Ok(())
}

fn from_bytes(b: &[u8], shape: &[usize], dtype: DType) -> Result<Tensor> {
    match dtype {
        DType::F16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::BF16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
            shape,
        ),
        _ => Tensor::from_vec(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            shape,
        ),
    }
}

/// `"inner.3.exp_avg"` → `("inner.", 3, ".exp_avg")`: the first dot-separated segment made
/// of digits is a parameter index (the optimizer state's naming, `optim::OptimizerState`).
#[doc(hidden)]
pub fn split_index(name: &str) -> Option<(&str, usize, &str)> {
    let mut start = 0;
    for seg in name.split('.') {
        if !seg.is_empty() && seg.bytes().all(|c| c.is_ascii_digit()) {
            let i = seg.parse().ok()?;
            return Some((&name[..start], i, &name[start + seg.len()..]));
        }
        start += seg.len() + 1;
    }
    None
}

/// `num_params`, also behind a prefix (`inner.num_params`).
fn is_count(name: &str) -> bool {
    name == "num_params" || name.ends_with(".num_params")
}

/// An entry of a state list as laid out unsharded: a plain entry, or a run of entries with
/// per-parameter names sharing a prefix (`0.exp_avg`, `0.exp_avg_sq`, `1.exp_avg`, ...),
/// written grouped by parameter in ascending order, each parameter's keys in their order.
#[derive(Debug, PartialEq)]
enum Slot {
    Plain(String),
    Run(String),
}

fn slots<'a>(names: impl Iterator<Item = &'a str>) -> Vec<Slot> {
    let mut out: Vec<Slot> = Vec::new();
    for name in names {
        match split_index(name) {
            Some((pre, _, _)) => {
                if out.last() != Some(&Slot::Run(pre.to_string())) {
                    out.push(Slot::Run(pre.to_string()));
                }
            }
            None => out.push(Slot::Plain(name.to_string())),
        }
    }
    out
}

/// The unsharded state from the ranks' shard states; `pieces[r]` are rank r's pieces (the
/// shard states' indices), `shapes` the parameters' shapes.
#[doc(hidden)]
pub fn unshard_state(
    states: &[OptimizerState],
    pieces: &[Vec<Piece>],
    shapes: &[Vec<usize>],
) -> Result<OptimizerState> {
    const OP: &str = "ZeroShard::gather_state";
    let first = &states[0];
    if let Some(s) = states.iter().find(|s| s.optimizer != first.optimizer) {
        return Err(Error::Msg(format!(
            "{OP}: the ranks run different optimizers ({:?}, {:?})",
            first.optimizer, s.optimizer
        )));
    }
    let bad = |r: usize, name: &str| {
        Error::Msg(format!(
            "{OP}: rank {r}'s state entry {name:?} names a piece it does not hold"
        ))
    };
    // The layout: the rank with the most slots has every run (a rank may hold no state
    // for some prefix, e.g. no pieces at all).
    let layout = |names: &dyn Fn(&OptimizerState) -> Vec<String>| -> Vec<Slot> {
        states
            .iter()
            .map(|s| slots(names(s).iter().map(String::as_str)))
            .max_by_key(Vec::len)
            .unwrap_or_default()
    };
    let scalar_names =
        |s: &OptimizerState| -> Vec<String> { s.scalars.iter().map(|(n, _)| n.clone()).collect() };
    let buffer_names =
        |s: &OptimizerState| -> Vec<String> { s.buffers.iter().map(|b| b.name.clone()).collect() };

    // Scalars: per-parameter ones must agree among the pieces of a parameter.
    let mut per_param: Vec<(String, usize, String, f64)> = Vec::new();
    for (r, s) in states.iter().enumerate() {
        for (name, v) in &s.scalars {
            if let Some((pre, k, suf)) = split_index(name) {
                let pc = pieces[r].get(k).ok_or_else(|| bad(r, name))?;
                let full = (pre.to_string(), pc.param, suf.to_string());
                match per_param
                    .iter()
                    .find(|(a, b, c, _)| (a, b, c) == (&full.0, &full.1, &full.2))
                {
                    Some(&(_, _, _, w)) if w.to_bits() != v.to_bits() => {
                        return Err(Error::Msg(format!(
                            "{OP}: the pieces of parameter {} disagree on {pre}{}{suf} ({w} vs {v})",
                            pc.param, pc.param
                        )))
                    }
                    Some(_) => {}
                    None => per_param.push((full.0, full.1, full.2, *v)),
                }
            }
        }
    }
    let mut scalars = Vec::new();
    for slot in layout(&scalar_names) {
        match slot {
            Slot::Plain(name) => {
                let v = if is_count(&name) {
                    shapes.len() as f64
                } else {
                    first.scalar(&name).ok_or_else(|| {
                        Error::Msg(format!("{OP}: rank 0's state has no scalar {name:?}"))
                    })?
                };
                scalars.push((name, v));
            }
            Slot::Run(pre) => {
                let mut run: Vec<&(String, usize, String, f64)> =
                    per_param.iter().filter(|e| e.0 == pre).collect();
                // Stable: keys keep their order of first appearance within a parameter.
                run.sort_by_key(|e| e.1);
                scalars.extend(run.iter().map(|(p, i, s, v)| (format!("{p}{i}{s}"), *v)));
            }
        }
    }

    // Buffers: assembled from the pieces; each must be covered exactly once.
    struct Full {
        pre: String,
        param: usize,
        suf: String,
        data: Vec<f32>,
        filled: usize,
    }
    let mut fulls: Vec<Full> = Vec::new();
    for (r, s) in states.iter().enumerate() {
        for b in &s.buffers {
            let (pre, k, suf) = split_index(&b.name).ok_or_else(|| bad(r, &b.name))?;
            let pc = pieces[r].get(k).ok_or_else(|| bad(r, &b.name))?;
            if b.data.len() != pc.range.len() {
                return Err(Error::Msg(format!(
                    "{OP}: rank {r}'s buffer {:?} holds {} values for a piece of {}",
                    b.name,
                    b.data.len(),
                    pc.range.len()
                )));
            }
            let j = match fulls
                .iter()
                .position(|f| f.pre == pre && f.param == pc.param && f.suf == suf)
            {
                Some(j) => j,
                None => {
                    let numel = shapes[pc.param].iter().product();
                    fulls.push(Full {
                        pre: pre.to_string(),
                        param: pc.param,
                        suf: suf.to_string(),
                        data: vec![0.0; numel],
                        filled: 0,
                    });
                    fulls.len() - 1
                }
            };
            fulls[j].data[pc.range.clone()].copy_from_slice(&b.data);
            fulls[j].filled += pc.range.len();
        }
    }
    if let Some(f) = fulls.iter().find(|f| f.filled != f.data.len()) {
        return Err(Error::Msg(format!(
            "{OP}: the shards hold {} of the {} values of {}{}{}",
            f.filled,
            f.data.len(),
            f.pre,
            f.param,
            f.suf
        )));
    }
    let mut buffers = Vec::new();
    let mut taken = vec![false; fulls.len()];
    for slot in layout(&buffer_names) {
        let Slot::Run(pre) = slot else {
            continue;
        };
        let mut run: Vec<usize> = (0..fulls.len())
            .filter(|&j| fulls[j].pre == pre && !taken[j])
            .collect();
        run.sort_by_key(|&j| fulls[j].param);
        for j in run {
            taken[j] = true;
            let f = &mut fulls[j];
            buffers.push(StateBuffer {
                name: format!("{}{}{}", f.pre, f.param, f.suf),
                shape: shapes[f.param].clone(),
                data: std::mem::take(&mut f.data),
            });
        }
    }
    Ok(OptimizerState {
        optimizer: first.optimizer.clone(),
        scalars,
        buffers,
    })
}

/// An optimizer state as bytes (for the all-gather of [`ZeroShard::gather_state`]).
fn encode_state(s: &OptimizerState) -> Vec<u8> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let mut out = Vec::new();
    put_str(&mut out, &s.optimizer);
    out.extend((s.scalars.len() as u64).to_le_bytes());
    for (n, v) in &s.scalars {
        put_str(&mut out, n);
        out.extend(v.to_le_bytes());
    }
    out.extend((s.buffers.len() as u64).to_le_bytes());
    for b in &s.buffers {
        put_str(&mut out, &b.name);
        out.extend((b.shape.len() as u64).to_le_bytes());
        for d in &b.shape {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend((b.data.len() as u64).to_le_bytes());
        for x in &b.data {
            out.extend(x.to_le_bytes());
        }
    }
    out
}

fn decode_state(b: &[u8]) -> Result<OptimizerState> {
    struct Rd<'a>(&'a [u8]);
    impl Rd<'_> {
        fn take(&mut self, n: usize) -> Result<&[u8]> {
            if self.0.len() < n {
                return Err(Error::Msg(
                    "ZeroShard::gather_state: a rank sent a truncated optimizer state".into(),
                ));
            }
            let (a, rest) = self.0.split_at(n);
            self.0 = rest;
            Ok(a)
        }
        fn u64(&mut self) -> Result<u64> {
            Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
        }
        fn len(&mut self) -> Result<usize> {
            let n = self.u64()?;
            usize::try_from(n)
                .ok()
                .filter(|&n| n <= self.0.len())
                .ok_or_else(|| {
                    Error::Msg("ZeroShard::gather_state: a rank sent a corrupt state".into())
                })
        }
        fn str(&mut self) -> Result<String> {
            let n = self.len()?;
            String::from_utf8(self.take(n)?.to_vec())
                .map_err(|_| Error::Msg("ZeroShard::gather_state: a name is not UTF-8".into()))
        }
    }
    let mut r = Rd(b);
    let optimizer = r.str()?;
    let ns = r.len()?;
    let mut scalars = Vec::with_capacity(ns);
    for _ in 0..ns {
        let n = r.str()?;
        scalars.push((n, f64::from_bits(r.u64()?)));
    }
    let nb = r.len()?;
    let mut buffers = Vec::with_capacity(nb);
    for _ in 0..nb {
        let name = r.str()?;
        let nd = r.len()?;
        let shape = (0..nd)
            .map(|_| r.u64().map(|d| d as usize))
            .collect::<Result<Vec<_>>>()?;
        let len = r.len()?;
        let data = r
            .take(
                len.checked_mul(4)
                    .ok_or_else(|| Error::Msg("corrupt state".into()))?,
            )?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect();
        buffers.push(StateBuffer { name, shape, data });
    }
    Ok(OptimizerState {
        optimizer,
        scalars,
        buffers,
    })
}
