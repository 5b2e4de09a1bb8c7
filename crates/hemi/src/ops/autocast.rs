//! Autocast: a thread-local, nestable scope in which every op picks its compute dtype from
//! one policy table (PyTorch's `torch.autocast`, DESIGN.md "Autocast policy").
//!
//! ```
//! use hemi::{amp::autocast, DType, Tensor};
//! let x = Tensor::ones(&[2, 3], DType::F32).unwrap();
//! let w = Tensor::ones(&[4, 3], DType::F32).unwrap();
//! let y = {
//!     let _ac = autocast(DType::F16);
//!     x.linear(&w, None).unwrap()          // lower precision: F16 output
//! };
//! assert_eq!(y.dtype(), DType::F16);
//! assert_eq!(y.softmax(-1).unwrap().dtype(), DType::F32); // outside the scope: as is
//! ```
//!
//! Why the table lives at the op layer and not in `amp/`: every op entry point consults it
//! (as PyTorch's Autocast dispatch key sits in front of every op), and an op may only use
//! layers below it. `amp` re-exports the guard and the table.
//!
//! The policy of each op is in [`POLICY`]. Only two kinds of op do anything under
//! autocast: lower-precision ops cast their F32/F16/BF16 inputs to the autocast dtype, FP32
//! ops cast F16/BF16 inputs up to F32. F64 and integer inputs are never cast. Multi-input
//! ops already promote to the widest float input (their rule outside autocast too), and
//! pass-through ops keep their input dtypes. `batch_norm` keeps its input dtype and always
//! computes its statistics in F32 (its parameters and running statistics stay F32): the
//! FP32 batch-norm statistics of DESIGN.md, without an F32 copy of the activations.
//!
//! Casts of F32 leaf tensors that require grad (parameters) are cached for the life of the
//! outermost scope: a weight used by several layers or time steps is converted once, and
//! its gradient still flows back to the F32 parameter through the cast's backward. As in
//! PyTorch, the cache assumes parameters do not change inside the scope: keep the
//! optimizer step outside it. Backward passes run with autocast off.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::{Tensor, TensorId};

/// What autocast does to an op's inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CastPolicy {
    /// F32/F16/BF16 inputs are cast to the autocast dtype (GEMM-shaped ops).
    LowerPrecision,
    /// F16/BF16 inputs are cast up to F32; the output is F32 (ops whose range or
    /// accumulation needs it: exp, log, pow, softmax, losses, norms, reductions).
    Fp32,
    /// Inputs keep their dtypes; the op computes its statistics in F32 and returns the
    /// input's dtype (batch_norm).
    Fp32Statistics,
    /// Mixed float inputs promote to the widest one (the op's own rule).
    Promote,
    /// Inputs keep their dtypes (ops that do not change magnitudes or only move data).
    PassThrough,
}

use CastPolicy::*;

/// Every op of hemi and its autocast policy: the ops in `crate::ops` and the views and
/// casts of `Tensor`. A test checks that each public op entry point appears here.
pub const POLICY: &[(&str, CastPolicy)] = &[
    // Lower precision.
    ("matmul", LowerPrecision),
    ("linear", LowerPrecision),
    ("conv2d", LowerPrecision),
    ("conv2d_relu_max_pool2", LowerPrecision),
    ("batch_norm_relu_conv2d", LowerPrecision),
    ("conv2d_batch_norm", LowerPrecision),
    ("conv2d_batch_norm_relu_max_pool2d", LowerPrecision),
    ("conv2d_batch_norm_add_relu", LowerPrecision),
    ("scaled_dot_product_attention", LowerPrecision),
    // FP32.
    ("exp", Fp32),
    ("log", Fp32),
    ("pow_scalar", Fp32),
    ("square", Fp32),
    ("gelu", Fp32),
    ("gelu_tanh", Fp32),
    ("softmax", Fp32),
    ("log_softmax", Fp32),
    ("cross_entropy", Fp32),
    ("nll_loss", Fp32),
    ("mse_loss", Fp32),
    ("layer_norm", Fp32),
    ("sum", Fp32),
    ("sum_all", Fp32),
    ("sum_to_shape", Fp32),
    ("mean", Fp32),
    ("mean_all", Fp32),
    ("var", Fp32),
    // FP32 statistics, input dtype kept.
    ("batch_norm", Fp32Statistics),
    ("batch_norm_act", Fp32Statistics),
    // Promote to the widest input.
    ("add", Promote),
    ("sub", Promote),
    ("mul", Promote),
    ("div", Promote),
    ("maximum", Promote),
    ("minimum", Promote),
    ("where_cond", Promote),
    ("cat", Promote),
    ("stack", Promote),
    // Pass through.
    ("neg", PassThrough),
    ("abs", PassThrough),
    ("sqrt", PassThrough),
    ("relu", PassThrough),
    ("sigmoid", PassThrough),
    ("tanh", PassThrough),
    ("add_scalar", PassThrough),
    ("mul_scalar", PassThrough),
    ("div_scalar", PassThrough),
    ("masked_fill", PassThrough),
    ("dropout", PassThrough),
    ("max", PassThrough),
    ("min", PassThrough),
    ("max_dim", PassThrough),
    ("min_dim", PassThrough),
    ("argmax", PassThrough),
    ("argmin", PassThrough),
    ("max_pool2d", PassThrough),
    ("max_pool2d_with_indices", PassThrough),
    ("avg_pool2d", PassThrough),
    ("adaptive_avg_pool2d", PassThrough),
    ("embedding", PassThrough),
    ("index_select", PassThrough),
    ("reshape", PassThrough),
    ("flatten", PassThrough),
    ("permute", PassThrough),
    ("transpose", PassThrough),
    ("t", PassThrough),
    ("narrow", PassThrough),
    ("broadcast_to", PassThrough),
    ("squeeze", PassThrough),
    ("unsqueeze", PassThrough),
    ("contiguous", PassThrough),
    ("to_dtype", PassThrough),
    ("to_device", PassThrough),
    ("clamp", PassThrough),
];

/// The policy of `op`, or `None` for a name that is not an op.
pub fn policy(op: &str) -> Option<CastPolicy> {
    POLICY.iter().find(|(n, _)| *n == op).map(|&(_, p)| p)
}

/// Per-module and per-op precision pins (a precision policy, `amp::PrecisionPolicy`): an
/// op in a pinned module, or of a pinned kind, computes in the pinned dtype whatever the
/// preset says (its float inputs are cast to it). Keras' per-layer `dtype` policy;
/// PyTorch's nested `autocast(enabled=False)` around a module plus the casts it needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pins {
    /// Module paths (`state_dict` prefixes, `layer3.1.bn2`) and their dtype; a path pins
    /// every module inside it, and the longest matching path wins.
    pub modules: Vec<(String, DType)>,
    /// Op names (`softmax`, `layer_norm`) and their dtype; an op pin wins over a module pin.
    pub ops: Vec<(String, DType)>,
    /// Where no autocast scope is open (the F16/BF16-weight presets): the dtype unpinned
    /// GEMM-shaped ops compute in, so a pinned module's F32 output goes back to the
    /// preset's dtype at the next such op instead of promoting the rest of the model.
    pub lower: Option<DType>,
}

impl Pins {
    /// The pinned dtype of `op` run at `sites` (its parameters' modules, or its scope).
    fn dtype_of(&self, op: &str, sites: &[Arc<str>], scope: &str) -> Option<DType> {
        if let Some(&(_, d)) = self.ops.iter().find(|(n, _)| n == op) {
            return Some(d);
        }
        if self.modules.is_empty() {
            return None;
        }
        let best = |path: &str| {
            self.modules
                .iter()
                .filter(|(m, _)| crate::ops::scope::within(path, m))
                .max_by_key(|(m, _)| m.len())
                .map(|&(_, d)| d)
        };
        let found: Vec<DType> = if sites.is_empty() {
            best(scope).into_iter().collect()
        } else {
            sites.iter().filter_map(|s| best(s)).collect()
        };
        // A fused op that reads a pinned and an unpinned layer computes at the widest pin.
        found.into_iter().max_by_key(|d| match d {
            DType::F32 | DType::F64 => 2,
            _ => 1,
        })
    }
}

#[derive(Clone)]
struct Scope {
    /// `Some(dtype)` enabled, `None` disabled.
    dtype: Option<DType>,
    /// Pins in force in this scope (not inherited by nested scopes).
    pins: Option<Arc<Pins>>,
}

#[derive(Default)]
struct State {
    /// One entry per open scope.
    scopes: Vec<Scope>,
    /// Casts of F32 parameters, alive until the outermost scope closes.
    cache: HashMap<(TensorId, DType), Tensor>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// An open autocast scope; dropping it restores the enclosing one. Not `Send`: autocast is
/// per thread.
#[must_use = "autocast applies only while the guard is alive"]
pub struct AutocastGuard {
    _not_send: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // The guard may drop during unwinding; never panic here.
        let cache = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.scopes.pop();
            if s.scopes.is_empty() {
                std::mem::take(&mut s.cache)
            } else {
                HashMap::new()
            }
        });
        // Cached casts hold graph nodes; drop them outside the borrow.
        drop(cache);
    }
}

fn push(dtype: Option<DType>, pins: Option<Arc<Pins>>) -> AutocastGuard {
    STATE.with(|s| s.borrow_mut().scopes.push(Scope { dtype, pins }));
    AutocastGuard {
        _not_send: PhantomData,
    }
}

/// Opens an autocast scope to `dtype` (F16 or BF16) on this thread. Any other dtype opens a
/// disabled scope: autocast to F32 means full precision (and F64 or I64 is not a
/// lower-precision float type).
pub fn autocast(dtype: DType) -> AutocastGuard {
    autocast_enabled(dtype, true)
}

/// `autocast(dtype)` when `enabled`, else a scope with autocast off (PyTorch's
/// `torch.autocast(..., enabled=False)`, which also switches off an enclosing scope).
pub fn autocast_enabled(dtype: DType, enabled: bool) -> AutocastGuard {
    let on = enabled && matches!(dtype, DType::F16 | DType::BF16);
    push(on.then_some(dtype), None)
}

/// A scope with precision pins: autocast to `dtype` (`None`: autocast off) where `pins`
/// do not say otherwise. Pins apply to the ops called in this scope only, not in nested
/// ones (a backward pass, an `autocast_enabled(_, false)` inside, runs without them).
pub fn autocast_pinned(dtype: Option<DType>, pins: Arc<Pins>) -> AutocastGuard {
    let dtype = dtype.filter(|d| matches!(d, DType::F16 | DType::BF16));
    push(dtype, Some(pins))
}

/// The dtype autocast casts to on this thread now, if a scope is enabled.
pub fn autocast_dtype() -> Option<DType> {
    STATE.with(|s| s.borrow().scopes.last().and_then(|sc| sc.dtype))
}

/// Whether an enabled autocast scope is open on this thread.
pub fn is_autocast_enabled() -> bool {
    autocast_dtype().is_some()
}

/// Casts of parameters held by the current outermost scope (for tests and diagnostics).
pub fn cached_casts() -> usize {
    STATE.with(|s| s.borrow().cache.len())
}

/// A disabled scope (backward passes run under one).
pub(crate) fn suspend() -> AutocastGuard {
    push(None, None)
}

/// The autocast settings in force on this thread: the innermost scope's dtype and pins
/// (`current_state`), to be opened again later by `isolated`. Activation checkpointing
/// (`autograd::checkpoint`) recomputes a segment's forward in the backward, where no scope
/// of the forward is open any more, under the settings of its forward.
#[derive(Clone, Default)]
pub struct AutocastState {
    scope: Option<Scope>,
}

impl AutocastState {
    /// The dtype autocast casts to in this state, if enabled.
    pub fn dtype(&self) -> Option<DType> {
        self.scope.as_ref().and_then(|s| s.dtype)
    }
}

/// The settings of the innermost open scope (none open: autocast off).
pub fn current_state() -> AutocastState {
    STATE.with(|s| AutocastState {
        scope: s.borrow().scopes.last().cloned(),
    })
}

/// While alive, `state` is this thread's only scope, with a cast cache of its own; the
/// thread's scopes and cache come back when it drops. Not `Send`.
#[must_use = "the state applies only while the guard is alive"]
pub struct IsolatedGuard {
    saved: Option<State>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for IsolatedGuard {
    fn drop(&mut self) {
        let Some(saved) = self.saved.take() else {
            return;
        };
        let inner = STATE.with(|s| std::mem::replace(&mut *s.borrow_mut(), saved));
        // The isolated casts hold graph nodes; drop them outside the borrow.
        drop(inner);
    }
}

/// Opens `state` as the thread's only scope, with an empty cast cache (so a parameter cast
/// here is cast here, not taken from an enclosing scope's cache: its cast and the graph
/// node of the cast belong to the region, and are freed with it). Scopes opened inside
/// nest as usual.
pub fn isolated(state: &AutocastState) -> IsolatedGuard {
    let fresh = State {
        scopes: state.scope.iter().cloned().collect(),
        cache: HashMap::new(),
    };
    let saved = STATE.with(|s| std::mem::replace(&mut *s.borrow_mut(), fresh));
    IsolatedGuard {
        saved: Some(saved),
        _not_send: PhantomData,
    }
}

/// The dtype `op`'s float inputs must be cast to under the current scope, or `None` when
/// nothing is to be cast (no scope, or every eligible input already has that dtype).
pub(crate) fn target(op: &'static str, inputs: &[Option<&Tensor>]) -> Option<DType> {
    let (ac, pins) = STATE.with(|s| {
        let s = s.borrow();
        match s.scopes.last() {
            Some(sc) => (sc.dtype, sc.pins.clone()),
            None => (None, None),
        }
    });
    crate::ops::check::note_op(inputs);
    let pinned = pins.as_ref().and_then(|p| {
        let sites = crate::ops::check::owners(inputs);
        let scope = if sites.is_empty() {
            crate::ops::scope::current()
        } else {
            String::new()
        };
        p.dtype_of(op, &sites, &scope)
    });
    let want = match (pinned, ac) {
        (Some(d), _) => d,
        (None, Some(ac)) => match policy(op) {
            Some(LowerPrecision) => ac,
            Some(Fp32) => DType::F32,
            Some(Fp32Statistics | Promote | PassThrough) => return None,
            None => {
                debug_assert!(false, "op {op} has no autocast policy");
                return None;
            }
        },
        (None, None) => match (pins.as_ref().and_then(|p| p.lower), policy(op)) {
            (Some(d), Some(LowerPrecision)) => d,
            _ => return None,
        },
    };
    inputs
        .iter()
        .flatten()
        .any(|t| eligible(t, want))
        .then_some(want)
}

/// Whether autocast casts `t` to `want`: F32/F16/BF16 tensors of another dtype, except
/// that FP32 ops leave F32 alone (F64 and integers are never touched).
fn eligible(t: &Tensor, want: DType) -> bool {
    let d = t.dtype();
    d != want && matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// `t` cast to `dtype` when eligible, else `t` itself. Casts of F32 leaves that require
/// grad are cached for the outermost scope when the graph is being recorded (a cast made
/// under `no_grad` carries no backward, so it is not reused).
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if !eligible(t, dtype) {
        return Ok(t.clone());
    }
    let cacheable = t.dtype() == DType::F32
        && STATE.with(|s| !s.borrow().scopes.is_empty())
        && t.is_leaf()
        && t.requires_grad()
        && crate::autograd::is_grad_enabled();
    if !cacheable {
        return crate::ops::check::for_cast(|| t.to_dtype(dtype));
    }
    let key = (t.id(), dtype);
    if let Some(c) = STATE.with(|s| s.borrow().cache.get(&key).cloned()) {
        return Ok(c);
    }
    let c = crate::ops::check::for_cast(|| t.to_dtype(dtype))?;
    STATE.with(|s| s.borrow_mut().cache.insert(key, c.clone()));
    Ok(c)
}

/// `cast` for an optional input.
pub(crate) fn cast_opt(t: Option<&Tensor>, dtype: DType) -> Result<Option<Tensor>> {
    t.map(|t| cast(t, dtype)).transpose()
}
