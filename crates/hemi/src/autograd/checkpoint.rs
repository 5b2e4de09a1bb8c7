//! Activation checkpointing: a segment of the forward pass whose activations are not kept
//! for the backward but computed again there (PyTorch's
//! `torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)`).
//!
//! `checkpoint(segment, inputs)` runs the segment's forward as usual, recording its graph,
//! then cuts that graph off: the result becomes the output of one `checkpoint` node whose
//! inputs are the segment's inputs and the parameters (leaves that require grad) its graph
//! reached, and whose backward keeps only the inputs' data. The segment's own graph, and
//! with it every activation its ops saved, is freed before the call returns. The backward
//! runs the forward again with the graph recorded, under the same conditions as the first
//! time, then a backward through that graph from the output's gradient, capturing the
//! inputs' and parameters' gradients (`autograd::grad`'s mode, no `.grad` touched), which
//! it hands to the outer sweep as its own. So parameters get their gradient through the
//! outer graph like any other use: post-accumulate hooks (data parallel) fire in order,
//! `autograd::grad` sees them, and a parameter also used outside the segment sums its uses
//! as it would without checkpointing.
//!
//! The same conditions, so that the gradients are bit for bit those of the run without
//! checkpointing:
//! - **Dropout**: the states of the generators the segment draws from
//!   (`Segment::generators`) are kept before its forward; the recompute sets them back, so
//!   it draws the same masks, and afterwards puts back the states it found (the run goes on
//!   as if the recompute had not drawn).
//! - **Autocast**: the forward's autocast settings (dtype and precision pins,
//!   `ops::autocast::current_state`) are opened again around the recompute (the backward
//!   itself runs with autocast off). Both passes cast parameters in a cast cache of their
//!   own (`ops::autocast::isolated`): a parameter used inside the segment and also outside
//!   it, in the same autocast region, gets two casts instead of one, and its gradient
//!   from the segment is cast to F32 before the uses are summed (about one rounding of a
//!   half dtype in that parameter's gradient; no built-in model has such a parameter).
//! - **Module path**: the module scope (`ops::scope`) the forward ran in is entered again,
//!   so per-module precision pins and the doctor's sites name the same modules.
//! - **State updates** happen once: while a recompute runs, `is_recomputing()` is true, and
//!   what updates state in a forward asks it. `BatchNorm2d` does not update its running
//!   statistics or `num_batches_tracked` a second time, and QAT's observers do not observe
//!   the batch a second time. (PyTorch's `checkpoint` updates batch-norm running
//!   statistics in both forwards, pytorch/pytorch#96136, which changes them; hemi's match
//!   the run without checkpointing.)
//!
//! A segment may read tensors that were computed before it only through its inputs: one it
//! captures that requires grad and is not a leaf (its gradient would have nowhere to go)
//! is an error naming the op that made it. Outside grad mode (`no_grad`, evaluation)
//! `checkpoint` just runs the forward.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::Capture;
use crate::error::{Error, Result};
use crate::ops::{autocast, scope};
use crate::rng::Generator;
use crate::tensor::{Tensor, TensorId};

/// A piece of a forward pass that activation checkpointing runs twice: once in the forward,
/// again in the backward. Both runs must compute the same thing from the same inputs; a
/// module keeps what it needs alive itself (the segments of hemi's models are replicas of
/// their layers: `nn::Replicate`).
pub trait Segment: Send + Sync {
    /// The segment's output for `inputs`.
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor>;

    /// The generators `forward` draws from (dropout): their states are kept before the
    /// forward and restored for the recompute. Default: none.
    fn generators(&self) -> Vec<&Mutex<Generator>> {
        Vec::new()
    }
}

/// A closure as a `Segment` (`checkpoint_fn`).
struct FnSegment<F> {
    f: F,
    generators: Vec<Arc<Mutex<Generator>>>,
}

impl<F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync> Segment for FnSegment<F> {
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor> {
        (self.f)(inputs)
    }
    fn generators(&self) -> Vec<&Mutex<Generator>> {
        self.generators.iter().map(|g| &**g).collect()
    }
}

/// `checkpoint` of a closure over `inputs`; `generators` are those it draws from (it owns
/// clones of the same `Arc`s), whose states the recompute restores.
///
/// ```
/// use hemi::autograd::checkpoint_fn;
/// use hemi::{DType, Generator, Tensor};
/// let w = Tensor::randn(&[4, 4], 0.0, 1.0, DType::F32, &mut Generator::new(0))?.requires_grad_();
/// let x = Tensor::randn(&[2, 4], 0.0, 1.0, DType::F32, &mut Generator::new(1))?;
/// let w2 = w.clone();
/// let y = checkpoint_fn(&[&x], Vec::new(), move |xs| xs[0].matmul(&w2.t()?)?.relu())?;
/// y.sum_all()?.backward()?;
/// assert!(w.grad().is_some());
/// # Ok::<(), hemi::Error>(())
/// ```
pub fn checkpoint_fn<F>(
    inputs: &[&Tensor],
    generators: Vec<Arc<Mutex<Generator>>>,
    f: F,
) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    checkpoint(Arc::new(FnSegment { f, generators }), inputs)
}

thread_local! {
    static RECOMPUTING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is running a checkpointed segment's forward again, in the backward:
/// a forward that updates state (batch-norm running statistics, observers) must not update
/// it now, it did the first time.
pub fn is_recomputing() -> bool {
    RECOMPUTING.with(|r| r.get())
}

/// Sets the recompute flag until dropped.
struct Recomputing {
    prev: bool,
}

impl Recomputing {
    fn enter() -> Recomputing {
        Recomputing {
            prev: RECOMPUTING.with(|r| r.replace(true)),
        }
    }
}

impl Drop for Recomputing {
    fn drop(&mut self) {
        RECOMPUTING.with(|r| r.set(self.prev));
    }
}

/// Turns graph recording on until dropped (the backward runs with it off).
struct EnableGrad {
    prev: bool,
}

impl EnableGrad {
    fn enter() -> EnableGrad {
        EnableGrad {
            prev: super::GRAD_ENABLED.with(|g| g.replace(true)),
        }
    }
}

impl Drop for EnableGrad {
    fn drop(&mut self) {
        super::GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

fn lock(g: &Mutex<Generator>) -> Result<std::sync::MutexGuard<'_, Generator>> {
    g.lock()
        .map_err(|_| Error::Msg("checkpoint: generator lock poisoned".into()))
}

fn states(gens: &[&Mutex<Generator>]) -> Result<Vec<Generator>> {
    gens.iter().map(|g| Ok(lock(g)?.clone())).collect()
}

fn set_states(gens: &[&Mutex<Generator>], states: &[Generator]) -> Result<()> {
    for (g, s) in gens.iter().zip(states) {
        *lock(g)? = s.clone();
    }
    Ok(())
}

/// The segment's inputs as tensors of its own over the same data: where an input wants a
/// gradient, a leaf that requires grad if the input is a leaf (a parameter), else the result
/// of an identity op on such a leaf, so that the segment's ops see what they saw without
/// checkpointing (autocast caches the casts of leaves, not of activations). Their gradients
/// are captured before they reach the leaf behind.
fn own_inputs(inputs: &[Tensor], wants: &[bool], leaf: &[bool]) -> Result<Vec<Tensor>> {
    inputs
        .iter()
        .zip(wants.iter().zip(leaf))
        .map(|(t, (&w, &leaf))| {
            let l = t.detach();
            if !w {
                return Ok(l);
            }
            l.set_requires_grad(true)?;
            if leaf {
                return Ok(l);
            }
            Ok(Tensor::from_op(
                l.storage(),
                l.layout().clone(),
                "checkpoint_input",
                &[&l],
                |g| Ok(vec![Some(g.clone())]),
            ))
        })
        .collect()
}

/// What the forward's graph showed: the parameters (leaves that require grad other than the
/// segment's inputs) in a fixed order, and the number of graph edges into each input and
/// parameter (each edge brings one gradient in the backward; the output itself counts one
/// if it is an input).
struct Reached {
    params: Vec<Tensor>,
    edges: HashMap<TensorId, usize>,
}

/// Walks `out`'s graph down to the segment's inputs and the leaves. A non-leaf made before
/// `start` that is not an input is an error.
fn reached(out: &Tensor, inputs: &[Tensor], start: TensorId) -> Result<Reached> {
    let stop: HashSet<TensorId> = inputs.iter().map(Tensor::id).collect();
    let mut edges: HashMap<TensorId, usize> = HashMap::new();
    let mut seen = HashSet::new();
    let mut params = Vec::new();
    if stop.contains(&out.id()) {
        edges.insert(out.id(), 1);
    }
    let mut stack = vec![out.clone()];
    while let Some(t) = stack.pop() {
        if !t.requires_grad() || stop.contains(&t.id()) || !seen.insert(t.id()) {
            continue;
        }
        let Some(node) = t.grad_fn() else {
            params.push(t);
            continue;
        };
        if t.id() < start {
            return Err(Error::Autograd(format!(
                "checkpoint: the segment reads a tensor made before it (by `{}`) that \
                 requires grad; pass it as one of the segment's inputs",
                node.op
            )));
        }
        for inp in node.inputs() {
            if inp.requires_grad() && (inp.is_leaf() || stop.contains(&inp.id())) {
                *edges.entry(inp.id()).or_default() += 1;
            }
            stack.push(inp);
        }
    }
    Ok(Reached { params, edges })
}

/// `parts` (the gradients that reached one input or parameter, in order) in `k` slots: one
/// each, the rest empty (a gradient rule may give some edges none); more than `k` (not
/// expected: the recompute records the forward's graph) are summed into the last slot.
fn slots(mut parts: Vec<Tensor>, k: usize) -> Result<Vec<Option<Tensor>>> {
    while parts.len() > k.max(1) {
        let last = parts.pop().expect("more than one");
        let prev = parts.pop().expect("more than one");
        parts.push(prev.add(&last)?);
    }
    let mut v: Vec<Option<Tensor>> = parts.into_iter().map(Some).collect();
    v.resize_with(k, || None);
    Ok(v)
}

/// Runs `segment` on `inputs` without keeping its activations for the backward (see the
/// module): the result's backward computes the segment's forward again and backpropagates
/// through it. Outside grad mode, the plain forward.
pub fn checkpoint(segment: Arc<dyn Segment>, inputs: &[&Tensor]) -> Result<Tensor> {
    let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    if !super::is_grad_enabled() {
        return segment.forward(&owned);
    }
    let before = states(&segment.generators())?;
    let ac = autocast::current_state();
    let path = scope::snapshot();
    let wants: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let leaf: Vec<bool> = inputs.iter().map(|t| t.is_leaf()).collect();
    let start = TensorId::next();
    let inner = own_inputs(&owned, &wants, &leaf)?;
    let out = {
        let _ac = autocast::isolated(&ac);
        segment.forward(&inner)?
    };
    if !out.requires_grad() {
        // Nothing in the segment wants a gradient: there is no graph to cut.
        return Ok(out);
    }
    let Reached { params, edges } = reached(&out, &inner, start)?;
    let (dtype, shape) = (out.dtype(), out.shape().to_vec());
    let (storage, layout) = (out.storage(), out.layout().clone());
    // The segment's graph, and the activations its ops saved, go here.
    drop(out);
    // Each input and parameter once per edge the segment's graph has into it, so that the
    // outer sweep adds their gradients one by one, in the order it would without
    // checkpointing (a residual connection around the segment adds its gradient to the
    // input's first part, not to their sum).
    let count = |t: &Tensor| edges.get(&t.id()).copied().unwrap_or(0).max(1);
    let in_slots: Vec<usize> = inner
        .iter()
        .zip(&wants)
        .map(|(t, &w)| if w { count(t) } else { 1 })
        .collect();
    let param_slots: Vec<usize> = params.iter().map(count).collect();
    let mut graph_inputs: Vec<&Tensor> = Vec::new();
    for (t, &k) in inputs.iter().zip(&in_slots) {
        graph_inputs.extend(std::iter::repeat_n(*t, k));
    }
    for (p, &k) in params.iter().zip(&param_slots) {
        graph_inputs.extend(std::iter::repeat_n(p, k));
    }
    drop(inner);
    let saved: Vec<Tensor> = owned.iter().map(Tensor::detach).collect();
    let kept_params = params.clone();
    Ok(Tensor::from_op(
        storage,
        layout,
        "checkpoint",
        &graph_inputs,
        move |g| {
            let _grad = EnableGrad::enter();
            let inner = own_inputs(&saved, &wants, &leaf)?;
            let out = {
                let _rec = Recomputing::enter();
                let _path = scope::replaced(&path);
                let _ac = autocast::isolated(&ac);
                let gens = segment.generators();
                let now = states(&gens)?;
                set_states(&gens, &before)?;
                let out = segment.forward(&inner);
                set_states(&gens, &now)?;
                out?
            };
            if out.dtype() != dtype || out.shape() != shape.as_slice() {
                return Err(Error::Autograd(format!(
                    "checkpoint: the segment's recomputed output is {:?} {}, its forward's was \
                     {shape:?} {dtype} (a segment must compute the same thing twice)",
                    out.shape(),
                    out.dtype()
                )));
            }
            if !out.requires_grad() {
                return Err(Error::Autograd(
                    "checkpoint: the segment's recomputed output has no graph (it was recorded \
                     in the forward)"
                        .into(),
                ));
            }
            let wanted: HashSet<TensorId> = inner
                .iter()
                .zip(&wants)
                .filter(|(_, &w)| w)
                .map(|(t, _)| t.id())
                .chain(kept_params.iter().map(Tensor::id))
                .collect();
            drop(_grad);
            let mut got = super::sweep(&out, g.clone(), Some(Capture::Parts(&wanted)), false)?;
            drop(out);
            let mut grads = Vec::new();
            for ((t, &w), &k) in inner.iter().zip(&wants).zip(&in_slots) {
                if w {
                    grads.extend(slots(got.remove(&t.id()).unwrap_or_default(), k)?);
                } else {
                    grads.push(None);
                }
            }
            for (p, &k) in kept_params.iter().zip(&param_slots) {
                grads.extend(slots(got.remove(&p.id()).unwrap_or_default(), k)?);
            }
            Ok(grads)
        },
    ))
}
