//! The module an op runs in: a thread-local stack of `state_dict` path segments that
//! composite models push around their children (`layer3`, `1`; `encoder.layer`, `0`), so
//! that the precision checks (`ops::check`) and per-module precision pins
//! (`ops::autocast::PinnedPolicy`) can name an op's module without the ops knowing the
//! model. An op that reads a parameter is named by that parameter's module instead (a
//! `Linear` or `BatchNorm2d` does not know its own name; its weight does, see
//! `ops::check`). Pushing and popping a segment costs one thread-local access: the scopes
//! are always on.

use std::cell::RefCell;
use std::marker::PhantomData;

#[derive(Clone, Copy)]
enum Seg {
    Name(&'static str),
    Index(usize),
}

thread_local! {
    static PATH: RefCell<Vec<Seg>> = const { RefCell::new(Vec::new()) };
}

/// An open module scope; dropping it leaves the module. Not `Send`: scopes are per thread.
#[must_use = "the scope applies only while the guard is alive"]
pub struct ModuleScope {
    n: usize,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ModuleScope {
    fn drop(&mut self) {
        PATH.with(|p| {
            let mut p = p.borrow_mut();
            let keep = p.len().saturating_sub(self.n);
            p.truncate(keep);
        });
    }
}

fn push(segs: &[Seg]) -> ModuleScope {
    PATH.with(|p| p.borrow_mut().extend_from_slice(segs));
    ModuleScope {
        n: segs.len(),
        _not_send: PhantomData,
    }
}

/// Enters the child module `name` (a `state_dict` prefix such as `"bert"` or
/// `"encoder.layer"`; dots allowed).
pub fn enter(name: &'static str) -> ModuleScope {
    push(&[Seg::Name(name)])
}

/// Enters child `index` of the list `name` (`enter_index("layer3", 1)` is `layer3.1`).
pub fn enter_index(name: &'static str, index: usize) -> ModuleScope {
    push(&[Seg::Name(name), Seg::Index(index)])
}

/// Enters child `index` of a container whose children are named by position
/// (`Sequential`: `0`, `1`...).
pub fn enter_at(index: usize) -> ModuleScope {
    push(&[Seg::Index(index)])
}

/// The module path as it stands, to be entered again later (`replaced`): activation
/// checkpointing recomputes a segment's forward in the backward, outside the scopes its
/// forward ran in.
#[derive(Clone, Default)]
pub struct ScopePath(Vec<Seg>);

/// The current module path, kept (`replaced` enters it again).
pub fn snapshot() -> ScopePath {
    PATH.with(|p| ScopePath(p.borrow().clone()))
}

/// While alive, `path` is this thread's module path; the path before comes back when it
/// drops. Not `Send`.
#[must_use = "the path applies only while the guard is alive"]
pub struct ReplacedPath {
    saved: Vec<Seg>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ReplacedPath {
    fn drop(&mut self) {
        let saved = std::mem::take(&mut self.saved);
        PATH.with(|p| *p.borrow_mut() = saved);
    }
}

/// Makes `path` the module path until the guard drops.
pub fn replaced(path: &ScopePath) -> ReplacedPath {
    let saved = PATH.with(|p| std::mem::replace(&mut *p.borrow_mut(), path.0.clone()));
    ReplacedPath {
        saved,
        _not_send: PhantomData,
    }
}

/// The current module path (`"layer3.1"`; empty at the model's top level).
pub fn current() -> String {
    PATH.with(|p| {
        let p = p.borrow();
        let mut s = String::new();
        for seg in p.iter() {
            if !s.is_empty() {
                s.push('.');
            }
            match seg {
                Seg::Name(n) => s.push_str(n),
                Seg::Index(i) => s.push_str(&i.to_string()),
            }
        }
        s
    })
}

/// Whether a module path `path` lies in module `prefix` (segment-wise: `layer3.1.bn2` lies
/// in `layer3.1` and in `layer3`, not in `layer3.10`). The empty prefix holds every path.
pub fn within(path: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || path == prefix
        || (path.len() > prefix.len()
            && path.starts_with(prefix)
            && path.as_bytes()[prefix.len()] == b'.')
}
