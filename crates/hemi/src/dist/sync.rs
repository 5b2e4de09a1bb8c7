//! Collectives on tensors: a differentiable all-reduce (SyncBatchNorm's statistics), the
//! conversion of a model's batch norms to SyncBatchNorm, and the broadcast of buffers.

use std::sync::Arc;

use super::{ProcessGroup, Wire};
use crate::dtype::DType;
use crate::error::Result;
use crate::nn::{Kind, Module};
use crate::tensor::Tensor;

/// The sum of `x` over the ranks of `g` (F32, the same bits on every rank). Differentiable:
/// the gradient of each rank's `x` is the sum of every rank's output gradient, so a loss
/// that depends on the global sum back-propagates to every rank's contribution (PyTorch's
/// `torch.distributed.nn.all_reduce`). Every rank must call it, in the same order, in the
/// forward and (when gradients flow) in the backward.
pub fn all_reduce_sum(g: &Arc<ProcessGroup>, x: &Tensor) -> Result<Tensor> {
    let shape = x.shape().to_vec();
    let sum = g.all_reduce(x.to_vec_f32(), Wire::F32)?.wait()?;
    let out = Tensor::from_vec(sum, &shape)?;
    let group = g.clone();
    Ok(Tensor::from_op(
        out.storage(),
        out.layout().clone(),
        "all_reduce_sum",
        &[x],
        move |grad| {
            let s = group.all_reduce(grad.to_vec_f32(), Wire::F32)?.wait()?;
            Ok(vec![Some(Tensor::from_vec(s, grad.shape())?)])
        },
    ))
}

/// Makes every `BatchNorm2d` of `model` a SyncBatchNorm over `g` (PyTorch's
/// `nn.SyncBatchNorm.convert_sync_batchnorm`); returns how many there were.
pub fn convert_sync_batch_norm(model: &mut dyn Module, g: &Arc<ProcessGroup>) -> usize {
    let bns = model.batch_norms_mut();
    let n = bns.len();
    for bn in bns {
        bn.sync = Some(g.clone());
    }
    n
}

/// Sets every buffer of `model` (batch-norm running statistics and counters) to rank 0's,
/// so that evaluation and checkpoints agree on every rank. PyTorch's DDP broadcasts the
/// buffers before every forward (`broadcast_buffers=True`); in training mode a batch norm
/// never reads its running statistics, so doing it before each evaluation gives the same
/// values for a fraction of the messages.
pub fn broadcast_buffers(g: &ProcessGroup, model: &mut dyn Module) -> Result<()> {
    if g.size() == 1 {
        return Ok(());
    }
    let mine: Vec<f64> = model
        .tensors()
        .into_iter()
        .filter(|(_, _, kind, _)| *kind == Kind::Buffer)
        .flat_map(|(_, t, _, _)| t.to_vec_f64())
        .collect();
    let all = g.all_gather_f64(&mine)?;
    // A rank with other buffers sent another length: the transport refused it above.
    let root = &all[0];
    let mut at = 0;
    for slot in model.tensors_mut() {
        if slot.kind != Kind::Buffer {
            continue;
        }
        let t: &Tensor = slot.tensor;
        let vals = &root[at..at + t.numel()];
        at += t.numel();
        let new = if t.dtype() == DType::I64 {
            Tensor::from_vec(vals.iter().map(|&v| v as i64).collect(), t.shape())?
        } else {
            Tensor::from_vec(vals.to_vec(), t.shape())?.to_dtype(t.dtype())?
        };
        t.set_data(&new)?;
    }
    Ok(())
}
