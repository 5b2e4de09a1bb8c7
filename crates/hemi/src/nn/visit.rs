//! One traversal per module (burn's `Module::visit`): a module describes its tensors and
//! children once, in `state_dict` order, and `Module`'s lists (`tensors`, `tensors_mut`,
//! `layers_mut`, `batch_norms_mut`, `generators`, `set_training`) are walks over that
//! description, written here once for every module.
//!
//! Why a module writes two methods (`visit` and `visit_mut`) and not one: Rust cannot be
//! generic over `&` and `&mut`, and the lists need both (`tensors()` hands out `&Tensor`
//! from `&self`; `tensors_mut()`, `layers_mut()` and `batch_norms_mut()` hand out `&mut`
//! from `&mut self`). A macro could write both from one body only by rewriting its tokens
//! (`&` into `&mut`, `iter` into `iter_mut`) or through a small language of its own, which
//! loops (ResNet's stages, BERT's layers) and enums (ResNet's shortcuts) do not fit. Two
//! plain methods, the second the first with `mut` added, read as ordinary Rust, and the
//! compiler points at the line that is wrong; `tests/models/visit.rs` holds the two to the
//! same names for every built-in model.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::{BatchNorm2d, Kind, LayerMut, Slot};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// What a module is made of, described to a traversal: its named tensors and its children
/// (each under its `state_dict` name), in `state_dict` order; in `visit` also the
/// generators its dropout draws from and its train/eval flags. Every [`super::Module`] is
/// a `Visit`; parts of a model that are not modules themselves (BERT's layers) can be too,
/// and are then children like any other.
///
/// ```
/// use hemi::nn::{BatchNorm2d, Module, Visit, Visitor, VisitorMut};
/// use hemi::{DType, Tensor};
///
/// struct Head {
///     fc_w: Tensor,
///     bn: BatchNorm2d,
/// }
///
/// impl Module for Head {
///     fn forward(&self, x: &Tensor) -> hemi::Result<Tensor> {
///         self.bn.forward(x)?.flatten(1, -1)?.linear(&self.fc_w, None)
///     }
/// }
///
/// impl Visit for Head {
///     fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
///         v.param("fc.weight", &self.fc_w);
///         v.child("bn", &self.bn);
///     }
///     fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
///         v.param("fc.weight", &mut self.fc_w);
///         v.child("bn", &mut self.bn);
///     }
/// }
///
/// let mut head = Head {
///     fc_w: Tensor::zeros(&[2, 3], DType::F32)?.requires_grad_(),
///     bn: BatchNorm2d::new(3)?,
/// };
/// let names: Vec<String> = head.state_dict().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names[..3], ["fc.weight", "bn.weight", "bn.bias"]);
/// assert_eq!(head.batch_norms_mut().len(), 1);
/// head.set_training(false); // reaches the BatchNorm's flag
/// # Ok::<(), hemi::Error>(())
/// ```
pub trait Visit {
    /// Shows `v` the module's tensors, children, dropout generators and training flags, in
    /// `state_dict` order.
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>);

    /// Shows `v` the same tensors and children as `visit`, in the same order, mutable.
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>);

    /// The module as a layer `quant` can hook, for `Module::layers_mut`: only `Linear` and
    /// `Conv2d` are. Default: not one.
    fn as_layer_mut(&mut self) -> Option<LayerMut<'_>> {
        None
    }

    /// The module as a batch norm, for `Module::batch_norms_mut`: only `BatchNorm2d` is.
    /// Default: not one.
    fn as_batch_norm_mut(&mut self) -> Option<&mut BatchNorm2d> {
        None
    }
}

/// What `Visit::visit` shows a module's parts to. Implemented by the traversals of this
/// module; a module only calls it.
pub trait Visitor<'a> {
    /// A tensor of the module, named relative to it (`"weight"`); `is_norm`: it belongs to
    /// a normalisation layer (mixed-precision presets keep it F32).
    fn tensor(&mut self, name: &str, tensor: &'a Tensor, kind: Kind, is_norm: bool);

    /// A child module, whose names are then prefixed `name.` (`name` may hold dots:
    /// `"attention.self.query"`, `"layer1.0"`).
    fn child(&mut self, name: &str, child: &'a dyn Visit);

    /// A generator the module's dropout draws from (saved and restored by a replay of a
    /// step, `Module::generators`).
    fn generator(&mut self, _generator: &'a Mutex<Generator>) {}

    /// A train/eval flag of the module (set by `Module::set_training`).
    fn training(&mut self, _flag: &'a AtomicBool) {}

    /// A trained parameter, not of a norm layer: `tensor(name, t, Kind::Parameter, false)`.
    fn param(&mut self, name: &str, tensor: &'a Tensor) {
        self.tensor(name, tensor, Kind::Parameter, false);
    }

    /// A saved buffer, not of a norm layer: `tensor(name, t, Kind::Buffer, false)`.
    fn buffer(&mut self, name: &str, tensor: &'a Tensor) {
        self.tensor(name, tensor, Kind::Buffer, false);
    }
}

/// What `Visit::visit_mut` shows a module's parts to.
pub trait VisitorMut<'a> {
    /// The tensor `Visitor::tensor` was shown, mutable.
    fn tensor(&mut self, name: &str, tensor: &'a mut Tensor, kind: Kind, is_norm: bool);

    /// The child `Visitor::child` was shown, mutable.
    fn child(&mut self, name: &str, child: &'a mut dyn Visit);

    /// Says that the module's forward does not run its `Linear`/`Conv2d` layers' forward
    /// hooks (fused ops read their weights directly), so `Module::layers_mut` lists none of
    /// the layers under it, and quantisation refuses the module instead of hooking layers
    /// whose hooks would never run.
    fn hide_layers(&mut self) {}

    /// `Visitor::param`, mutable.
    fn param(&mut self, name: &str, tensor: &'a mut Tensor) {
        self.tensor(name, tensor, Kind::Parameter, false);
    }

    /// `Visitor::buffer`, mutable.
    fn buffer(&mut self, name: &str, tensor: &'a mut Tensor) {
        self.tensor(name, tensor, Kind::Buffer, false);
    }
}

// ---------------------------------------------------------------------------------------
// The traversals behind `Module`'s lists.

/// The `state_dict` path of the module being visited (`"layer1.0"`; empty at the top).
#[derive(Default)]
struct Path(String);

impl Path {
    /// `name` inside the current module.
    fn join(&self, name: &str) -> String {
        if self.0.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.0)
        }
    }
    /// Enters child `name`; returns what `leave` needs.
    fn enter(&mut self, name: &str) -> usize {
        let len = self.0.len();
        if len > 0 {
            self.0.push('.');
        }
        self.0.push_str(name);
        len
    }
    fn leave(&mut self, len: usize) {
        self.0.truncate(len);
    }
}

/// `Module::tensors`.
pub(crate) fn tensors<M: Visit + ?Sized>(m: &M) -> Vec<(String, &Tensor, Kind, bool)> {
    #[derive(Default)]
    struct Walk<'a> {
        path: Path,
        out: Vec<(String, &'a Tensor, Kind, bool)>,
    }
    impl<'a> Visitor<'a> for Walk<'a> {
        fn tensor(&mut self, name: &str, tensor: &'a Tensor, kind: Kind, is_norm: bool) {
            self.out.push((self.path.join(name), tensor, kind, is_norm));
        }
        fn child(&mut self, name: &str, child: &'a dyn Visit) {
            let len = self.path.enter(name);
            child.visit(self);
            self.path.leave(len);
        }
    }
    let mut w = Walk::default();
    m.visit(&mut w);
    w.out
}

/// `Module::tensors_mut`.
pub(crate) fn tensors_mut<M: Visit + ?Sized>(m: &mut M) -> Vec<Slot<'_>> {
    #[derive(Default)]
    struct Walk<'a> {
        path: Path,
        out: Vec<Slot<'a>>,
    }
    impl<'a> VisitorMut<'a> for Walk<'a> {
        fn tensor(&mut self, name: &str, tensor: &'a mut Tensor, kind: Kind, is_norm: bool) {
            self.out.push(Slot {
                name: self.path.join(name),
                tensor,
                kind,
                is_norm,
            });
        }
        fn child(&mut self, name: &str, child: &'a mut dyn Visit) {
            let len = self.path.enter(name);
            child.visit_mut(self);
            self.path.leave(len);
        }
    }
    let mut w = Walk::default();
    m.visit_mut(&mut w);
    w.out
}

/// The dropout generators and training flags of a module and its children, in visiting
/// order (no names: `Module::generators` and `Module::set_training` need none).
#[derive(Default)]
struct State<'a> {
    generators: Vec<&'a Mutex<Generator>>,
    flags: Vec<&'a AtomicBool>,
}

impl<'a> State<'a> {
    fn of<M: Visit + ?Sized>(m: &'a M) -> Self {
        let mut w = State::default();
        m.visit(&mut w);
        w
    }
}

impl<'a> Visitor<'a> for State<'a> {
    fn tensor(&mut self, _: &str, _: &'a Tensor, _: Kind, _: bool) {}
    fn child(&mut self, _: &str, child: &'a dyn Visit) {
        child.visit(self);
    }
    fn generator(&mut self, generator: &'a Mutex<Generator>) {
        self.generators.push(generator);
    }
    fn training(&mut self, flag: &'a AtomicBool) {
        self.flags.push(flag);
    }
}

/// `Module::generators`, in visiting order.
pub(crate) fn generators<M: Visit + ?Sized>(m: &M) -> Vec<&Mutex<Generator>> {
    State::of(m).generators
}

/// `Module::set_training`: every flag of the module and its children.
pub(crate) fn set_training<M: Visit + ?Sized>(m: &M, training: bool) {
    for flag in State::of(m).flags {
        flag.store(training, Ordering::Relaxed);
    }
}

/// `Module::layers_mut`: the module itself when it is a layer (named `""`), else the layers
/// under it that no module hides (`VisitorMut::hide_layers`), named by their paths.
pub(crate) fn layers_mut<M: Visit + ?Sized>(m: &mut M) -> Vec<(String, LayerMut<'_>)> {
    #[derive(Default)]
    struct Walk<'a> {
        path: Path,
        out: Vec<(String, LayerMut<'a>)>,
        /// The module being visited called `hide_layers`.
        hidden: bool,
    }
    impl<'a> Walk<'a> {
        fn walk<M: Visit + ?Sized>(&mut self, m: &'a mut M) {
            // Asked twice: a borrow kept in a `Some` arm would still hold `m` in the other.
            if m.as_layer_mut().is_some() {
                let layer = m.as_layer_mut().expect("checked above");
                self.out.push((self.path.0.clone(), layer));
                return;
            }
            let (start, outer) = (self.out.len(), std::mem::take(&mut self.hidden));
            m.visit_mut(self);
            if self.hidden {
                self.out.truncate(start);
            }
            self.hidden = outer;
        }
    }
    impl<'a> VisitorMut<'a> for Walk<'a> {
        fn tensor(&mut self, _: &str, _: &'a mut Tensor, _: Kind, _: bool) {}
        fn child(&mut self, name: &str, child: &'a mut dyn Visit) {
            let len = self.path.enter(name);
            self.walk(child);
            self.path.leave(len);
        }
        fn hide_layers(&mut self) {
            self.hidden = true;
        }
    }
    let mut w = Walk::default();
    w.walk(m);
    w.out
}

/// `Module::batch_norms_mut`, in `state_dict` order.
pub(crate) fn batch_norms_mut<M: Visit + ?Sized>(m: &mut M) -> Vec<&mut BatchNorm2d> {
    struct Walk<'a>(Vec<&'a mut BatchNorm2d>);
    impl<'a> Walk<'a> {
        fn walk<M: Visit + ?Sized>(&mut self, m: &'a mut M) {
            if m.as_batch_norm_mut().is_some() {
                self.0.push(m.as_batch_norm_mut().expect("checked above"));
            } else {
                m.visit_mut(self);
            }
        }
    }
    impl<'a> VisitorMut<'a> for Walk<'a> {
        fn tensor(&mut self, _: &str, _: &'a mut Tensor, _: Kind, _: bool) {}
        fn child(&mut self, _: &str, child: &'a mut dyn Visit) {
            self.walk(child);
        }
    }
    let mut w = Walk(Vec::new());
    w.walk(m);
    w.0
}
