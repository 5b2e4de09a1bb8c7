//! Per-op precision checks: a mode of the op entry points, off unless a replay of a failed
//! step or the precision doctor (`train::doctor`) switches it on for one forward and backward.
//!
//! Every op result passes through `Tensor::from_op`; with checks on, it looks at the result
//! (finite? largest magnitude?) and remembers the op's *site*: the module it ran in. A site
//! is the module of the parameters the op read (`layer3.1.conv2`, or
//! `layer3.1.bn1+layer3.1.conv2` for a fused op that reads two layers' parameters), else the
//! module scope the model was in (`ops::scope`, e.g. `bert.encoder.layer.3.attention.self`
//! for the attention's softmax). Casts and views of a parameter (autocast's F16 copy of a
//! weight, a transposed weight) keep its module. Graph nodes recorded under checks carry
//! their site, so the backward can name the first non-finite gradient too.
//!
//! Off, the mode costs one thread-local flag read per op.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use crate::dtype::DType;
use crate::tensor::{Tensor, TensorId};

thread_local! {
    /// The site of the op whose inputs autocast is casting now (`for_cast`).
    static CAST_SITE: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    /// The site of the last op autocast looked at (`note_op`).
    static OP_SITE: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    static NAMED: Cell<bool> = const { Cell::new(false) };
    static NAMES: RefCell<Vec<Names>> = const { RefCell::new(Vec::new()) };
    static ON: Cell<bool> = const { Cell::new(false) };
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Module paths of a model's parameters (and of their casts and views) by tensor id.
#[derive(Default, Clone)]
struct Names {
    module: HashMap<TensorId, Arc<str>>,
    param: HashMap<TensorId, Arc<str>>,
}

/// The module of the parameter named `name` (`"layer3.1.conv2.weight"` → `"layer3.1.conv2"`).
pub fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or("", |(m, _)| m)
}

/// Binds a model's parameters (`named_parameters`) to this thread while the guard lives:
/// ops that read them are named by their module (for the checks and for per-module
/// precision pins). Bind after casting the model (a cast makes new parameters).
pub fn bind_names(params: &[(String, Tensor)]) -> NamesGuard {
    let mut n = Names::default();
    for (name, t) in params {
        n.module.insert(t.id(), module_of(name).into());
        n.param.insert(t.id(), name.as_str().into());
    }
    NAMES.with(|s| s.borrow_mut().push(n));
    NAMED.with(|f| f.set(true));
    NamesGuard { _p: () }
}

/// Keeps a model's parameter names bound to the thread (`bind_names`).
#[must_use = "the names are bound only while the guard is alive"]
pub struct NamesGuard {
    _p: (),
}

impl Drop for NamesGuard {
    fn drop(&mut self) {
        NAMES.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            NAMED.with(|f| f.set(!s.is_empty()));
        });
    }
}

/// Whether parameter names are bound on this thread.
pub(crate) fn named() -> bool {
    NAMED.with(|f| f.get())
}

/// The modules of the bound parameters among `inputs`, in input order, without repeats.
pub(crate) fn owners(inputs: &[Option<&Tensor>]) -> Vec<Arc<str>> {
    if !named() {
        return Vec::new();
    }
    NAMES.with(|s| {
        let s = s.borrow();
        let Some(n) = s.last() else {
            return Vec::new();
        };
        let mut v: Vec<Arc<str>> = Vec::new();
        for t in inputs.iter().flatten() {
            if let Some(m) = n.module.get(&t.id()) {
                if !v.contains(m) {
                    v.push(m.clone());
                }
            }
        }
        v
    })
}

/// Ops whose result is a parameter's values in another dtype or shape: the result keeps
/// the parameter's module.
const CARRY: &[&str] = &[
    "to_dtype",
    "to_device",
    "contiguous",
    "reshape",
    "flatten",
    "t",
    "transpose",
    "permute",
    "narrow",
    "broadcast_to",
    "squeeze",
    "unsqueeze",
];

/// The site of an op with these inputs: its parameters' modules, else the module scope.
pub(crate) fn site(inputs: &[Option<&Tensor>]) -> String {
    let o = owners(inputs);
    if o.is_empty() {
        crate::ops::scope::current()
    } else {
        o.iter().map(|m| &**m).collect::<Vec<_>>().join("+")
    }
}

/// Autocast is about to cast the inputs of an op with these inputs: remember its site, so
/// the casts are named by the op that needs them (`fc2`'s input cast, not a cast at the
/// model's top level). Only while names are bound or checks are on.
pub(crate) fn note_op(inputs: &[Option<&Tensor>]) {
    if named() || is_on() {
        let s: Arc<str> = site(inputs).into();
        OP_SITE.with(|o| *o.borrow_mut() = Some(s));
    }
}

/// Runs `f` (a cast autocast makes for the op last noted) named by that op's site.
pub(crate) fn for_cast<R>(f: impl FnOnce() -> R) -> R {
    if !(named() || is_on()) {
        return f();
    }
    let s = OP_SITE.with(|o| o.borrow().clone());
    let prev = CAST_SITE.with(|c| std::mem::replace(&mut *c.borrow_mut(), s));
    let r = f();
    CAST_SITE.with(|c| *c.borrow_mut() = prev);
    r
}

/// The site `Tensor::from_op` keeps in a graph node: only while checks are on.
pub(crate) fn site_of(inputs: &[&Tensor]) -> Option<Arc<str>> {
    if !is_on() {
        return None;
    }
    if let Some(s) = CAST_SITE.with(|c| c.borrow().clone()) {
        return Some(s);
    }
    let opt: Vec<Option<&Tensor>> = inputs.iter().map(|t| Some(*t)).collect();
    Some(site(&opt).into())
}

/// What `Tensor::from_op` does with a result while names are bound or checks are on:
/// a cast or view of a parameter keeps its module; with checks on, the result is checked.
pub(crate) fn on_op(op: &'static str, site: Option<&str>, inputs: &[&Tensor], out: &Tensor) {
    if named() && inputs.len() == 1 && CARRY.contains(&op) {
        NAMES.with(|s| {
            if let Some(n) = s.borrow_mut().last_mut() {
                if let Some(m) = n.module.get(&inputs[0].id()).cloned() {
                    n.module.insert(out.id(), m);
                }
            }
        });
    }
    // Ops a backward runs (under no_grad) are checked through their gradients instead, and
    // a checkpointed segment's forward run again in the backward was checked the first time.
    let Some(site) =
        site.filter(|_| crate::autograd::is_grad_enabled() && !crate::autograd::is_recomputing())
    else {
        return;
    };
    STATE.with(|s| {
        if let Some(st) = s.borrow_mut().as_mut() {
            st.forward_op(op, site, inputs, out);
        }
    });
}

/// What the backward does with the gradients one node produced, checks on.
pub(crate) fn on_grads(op: &'static str, site: Option<&Arc<str>>, grads: &[Option<Tensor>]) {
    if !ON.with(|f| f.get()) {
        return;
    }
    STATE.with(|s| {
        if let Some(st) = s.borrow_mut().as_mut() {
            st.backward_node(op, site, grads);
        }
    });
}

/// What the backward does with a parameter's (leaf's) gradient, checks on.
pub(crate) fn on_leaf_grad(t: &Tensor, g: &Tensor) {
    if !ON.with(|f| f.get()) {
        return;
    }
    let name = NAMES.with(|s| {
        s.borrow()
            .last()
            .and_then(|n| n.param.get(&t.id()).cloned())
    });
    STATE.with(|s| {
        if let Some(st) = s.borrow_mut().as_mut() {
            st.leaf(name, g);
        }
    });
}

/// Magnitudes at or below this round to zero in F16 (half its smallest subnormal, 2^-24;
/// the tie rounds to even, zero).
pub const F16_FLUSH: f64 = 2.980_232_238_769_531_2e-8;

/// Largest magnitude and whether every value is finite.
fn scan(t: &Tensor) -> (f64, bool) {
    if !t.dtype().is_float() {
        return (0.0, true);
    }
    let mut m = 0f64;
    let mut finite = true;
    for v in t.to_vec_f32() {
        if v.is_finite() {
            m = m.max(f64::from(v.abs()));
        } else {
            finite = false;
        }
    }
    (m, finite)
}

/// The first op in forward order whose result was not finite.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardCulprit {
    /// Position of the op among the checked forward ops (0-based).
    pub index: usize,
    /// The op (`"linear"`, `"to_dtype"`, `"layer_norm"`).
    pub op: &'static str,
    /// The module it ran in (see the module doc).
    pub module: String,
    /// The dtype of its result.
    pub dtype: DType,
    /// The largest finite magnitude among its inputs.
    pub input_max_abs: f64,
    /// Non-finite values in its result, and how many of them are NaN.
    pub nonfinite: usize,
    /// Of those, NaN.
    pub nan: usize,
}

/// The first gradient in backward order that was not finite (its forward was finite).
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardCulprit {
    /// Position among the checked backward nodes (0-based).
    pub index: usize,
    /// The op whose backward produced it, or `None` for a parameter's gradient sum.
    pub op: Option<&'static str>,
    /// The module of that op (or of the parameter).
    pub module: String,
    /// The parameter, when the non-finite gradient is a parameter's.
    pub param: Option<String>,
    /// The dtype of the gradient.
    pub dtype: DType,
}

/// Per-module statistics the doctor reads (`record` mode).
#[derive(Clone, Debug, Default)]
pub struct ModuleRecord {
    /// The module's last result in forward order (a handle, not a copy).
    pub output: Option<Tensor>,
    /// Values of the gradients its ops' backwards produced.
    pub grad_count: u64,
    /// Of those, nonzero values that F16 flushes to zero once multiplied by the checks'
    /// `factor` (at or below 2^-25).
    pub grad_underflow: u64,
    /// Of those, values whose magnitude times `factor` exceeds F16's largest finite 65504.
    pub grad_overflow: u64,
    /// The largest finite gradient magnitude, as the backward computed it.
    pub grad_max_abs: f64,
}

/// What one checked forward and backward found.
#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    /// The first non-finite op result, in forward order.
    pub forward: Option<ForwardCulprit>,
    /// The first non-finite gradient, in backward order.
    pub backward: Option<BackwardCulprit>,
    /// Ops checked in the forward.
    pub forward_ops: usize,
    /// Backward nodes checked.
    pub backward_nodes: usize,
    /// `record` mode: per module, in order of first appearance.
    pub modules: Vec<(String, ModuleRecord)>,
}

struct State {
    report: CheckReport,
    record: bool,
    /// The forward is over (`end_forward`): later op results are not module outputs.
    forward_done: bool,
    scale: f64,
    index: HashMap<String, usize>,
}

impl State {
    fn module(&mut self, site: &str) -> &mut ModuleRecord {
        let i = match self.index.get(site) {
            Some(&i) => i,
            None => {
                self.report
                    .modules
                    .push((site.to_string(), ModuleRecord::default()));
                self.index
                    .insert(site.to_string(), self.report.modules.len() - 1);
                self.report.modules.len() - 1
            }
        };
        &mut self.report.modules[i].1
    }

    fn forward_op(&mut self, op: &'static str, site: &str, inputs: &[&Tensor], out: &Tensor) {
        let i = self.report.forward_ops;
        self.report.forward_ops += 1;
        if self.record && !self.forward_done && !CARRY.contains(&op) {
            self.module(site).output = Some(out.clone());
        }
        if self.report.forward.is_some() || !out.dtype().is_float() {
            return;
        }
        let vals = out.to_vec_f32();
        let nonfinite = vals.iter().filter(|v| !v.is_finite()).count();
        if nonfinite == 0 {
            return;
        }
        let nan = vals.iter().filter(|v| v.is_nan()).count();
        let input_max_abs = inputs.iter().map(|t| scan(t).0).fold(0.0, f64::max);
        self.report.forward = Some(ForwardCulprit {
            index: i,
            op,
            module: site.to_string(),
            dtype: out.dtype(),
            input_max_abs,
            nonfinite,
            nan,
        });
    }

    fn backward_node(
        &mut self,
        op: &'static str,
        site: Option<&Arc<str>>,
        grads: &[Option<Tensor>],
    ) {
        let i = self.report.backward_nodes;
        self.report.backward_nodes += 1;
        let module = site.map_or_else(String::new, |s| s.to_string());
        for g in grads.iter().flatten() {
            if !g.dtype().is_float() {
                continue;
            }
            let vals = g.to_vec_f32();
            if self.record {
                let factor = self.scale;
                let r = self.module(&module);
                r.grad_count += vals.len() as u64;
                for &v in &vals {
                    let a = f64::from(v.abs());
                    if !a.is_finite() {
                        continue;
                    }
                    r.grad_max_abs = r.grad_max_abs.max(a);
                    let s = a * factor;
                    if v != 0.0 && s <= F16_FLUSH {
                        r.grad_underflow += 1;
                    } else if s > 65504.0 {
                        r.grad_overflow += 1;
                    }
                }
            }
            if self.report.backward.is_none() && vals.iter().any(|v| !v.is_finite()) {
                self.report.backward = Some(BackwardCulprit {
                    index: i,
                    op: Some(op),
                    module: module.clone(),
                    param: None,
                    dtype: g.dtype(),
                });
            }
        }
    }

    fn leaf(&mut self, name: Option<Arc<str>>, g: &Tensor) {
        if self.report.backward.is_some() || !g.dtype().is_float() {
            return;
        }
        if scan(g).1 {
            return;
        }
        let i = self.report.backward_nodes;
        self.report.backward = Some(BackwardCulprit {
            index: i,
            op: None,
            module: name.as_deref().map(module_of).unwrap_or("").to_string(),
            param: name.map(|n| n.to_string()),
            dtype: g.dtype(),
        });
    }
}

/// Switches the per-op checks on for this thread while the guard lives; `finish` returns
/// what they found. With `record`, also keeps the doctor's per-module statistics, counting
/// gradient values times `factor` against F16's range (the doctor's FP32 reference runs
/// unscaled and asks what the preset's loss scale would make of its gradients).
pub fn begin(record: bool, factor: f64) -> CheckGuard {
    STATE.with(|s| {
        *s.borrow_mut() = Some(State {
            report: CheckReport::default(),
            record,
            forward_done: false,
            scale: if factor > 0.0 { factor } else { 1.0 },
            index: HashMap::new(),
        })
    });
    ON.with(|f| f.set(true));
    CheckGuard { _p: () }
}

/// Per-op checks on this thread (`begin`).
#[must_use = "the checks are on only while the guard is alive"]
pub struct CheckGuard {
    _p: (),
}

impl CheckGuard {
    /// The model's forward (and loss) is done: ops from here on (the loss scaling) are not
    /// recorded as module outputs, though still checked.
    pub fn end_forward(&self) {
        STATE.with(|s| {
            if let Some(st) = s.borrow_mut().as_mut() {
                st.forward_done = true;
            }
        });
    }

    /// Ends the checks and returns their findings.
    pub fn finish(self) -> CheckReport {
        let r = STATE.with(|s| s.borrow_mut().take());
        ON.with(|f| f.set(false));
        r.map(|s| s.report).unwrap_or_default()
    }
}

impl Drop for CheckGuard {
    fn drop(&mut self) {
        ON.with(|f| f.set(false));
        let r = STATE.with(|s| s.borrow_mut().take());
        drop(r);
    }
}

/// Whether per-op checks are on for this thread.
pub fn is_on() -> bool {
    ON.with(|f| f.get())
}
