//! The `Tensor` handle: a cheap-to-clone reference to shared storage with a layout, a dtype,
//! a device and (when it takes part in autograd) a node of the backward graph.
//!
//! Tensors are immutable values: ops make new tensors. The exception is a parameter's data,
//! which an optimizer replaces in place (`set_data`), visible to every clone of the handle,
//! as PyTorch's in-place updates of `param.data` are.

pub mod create;
pub mod layout;
pub mod storage;
pub mod view;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub use crate::cpu::storage::CpuStorage;
pub use crate::dtype::FloatDType;
pub use layout::Layout;
pub use storage::Storage;

use crate::autograd::{self, Node};
use crate::backend::map::BinaryOp;
use crate::dtype::{DType, WithDType};
use crate::error::{Error, Result};

pub use crate::device::Device;

/// Identity of a tensor handle (not of its storage), used by autograd and caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    /// A new id: every tensor made after this call has a larger one (activation
    /// checkpointing tells the tensors its segment made from those made before).
    pub(crate) fn next() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(1);
        TensorId(COUNTER.fetch_add(1, Ordering::Relaxed))
    }
}

pub(crate) struct TensorImpl {
    id: TensorId,
    storage: RwLock<Arc<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
    requires_grad: AtomicBool,
    grad_fn: Option<Arc<Node>>,
    grad: Mutex<Option<Tensor>>,
}

impl Drop for TensorImpl {
    /// Dismantles the graph behind this tensor iteratively: the default recursive drop of
    /// a long chain of nodes (tensor -> node -> input tensor -> node ...) would overflow the
    /// stack.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node>> = self.grad_fn.take().into_iter().collect();
        while let Some(node) = stack.pop() {
            let Ok(node) = Arc::try_unwrap(node) else {
                continue; // still shared: someone else drops it later
            };
            let Some(saved) = node.take() else { continue };
            // The closure's captured tensors drop here, each with its own graph: those are
            // the inputs too (captured clones), whose handles below are then the last.
            drop(saved.backward);
            for input in saved.inputs {
                if let Ok(mut inner) = Arc::try_unwrap(input.0) {
                    stack.extend(inner.grad_fn.take());
                }
            }
        }
    }
}

/// An n-dimensional array of F16, BF16, F32, F64 or I64 values.
#[derive(Clone)]
pub struct Tensor(Arc<TensorImpl>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor[{:?}, {}{}]",
            self.shape(),
            self.dtype(),
            if self.requires_grad() { ", grad" } else { "" }
        )
    }
}

impl Tensor {
    // ----- construction from parts -------------------------------------------------------

    /// A tensor over `storage` with `layout`, outside any graph.
    pub fn from_storage(storage: Arc<Storage>, layout: Layout) -> Tensor {
        let (dtype, device) = (storage.dtype(), storage.device());
        Tensor(Arc::new(TensorImpl {
            id: TensorId::next(),
            storage: RwLock::new(storage),
            layout,
            dtype,
            device,
            requires_grad: AtomicBool::new(false),
            grad_fn: None,
            grad: Mutex::new(None),
        }))
    }

    /// A contiguous tensor of `shape` owning `storage` (whose length must be the numel).
    pub(crate) fn from_contiguous(storage: impl Into<Storage>, shape: &[usize]) -> Tensor {
        let storage = storage.into();
        debug_assert_eq!(storage.len(), shape.iter().product::<usize>());
        Tensor::from_storage(Arc::new(storage), Layout::contiguous(shape))
    }

    /// The result of an op: records a backward node when grad mode is on and any input
    /// requires grad. `backward` maps the output's gradient to one gradient per input
    /// (`None` for inputs that get none); autograd casts each to its input's dtype.
    pub(crate) fn from_op(
        storage: Arc<Storage>,
        layout: Layout,
        op: &'static str,
        inputs: &[&Tensor],
        backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        let needs_grad = autograd::is_grad_enabled() && inputs.iter().any(|t| t.requires_grad());
        let (dtype, device) = (storage.dtype(), storage.device());
        // Precision checks and parameter names (`ops::check`): one flag read when off.
        let watched = crate::ops::check::named() || crate::ops::check::is_on();
        let site = if watched {
            crate::ops::check::site_of(inputs)
        } else {
            None
        };
        let grad_fn = needs_grad.then(|| {
            let mut node = Node::new(
                op,
                inputs.iter().map(|t| t.graph_edge()).collect(),
                Box::new(backward),
            );
            node.site = site.clone();
            Arc::new(node)
        });
        let out = Tensor(Arc::new(TensorImpl {
            id: TensorId::next(),
            storage: RwLock::new(storage),
            layout,
            dtype,
            device,
            requires_grad: AtomicBool::new(needs_grad),
            grad_fn,
            grad: Mutex::new(None),
        }));
        if watched {
            crate::ops::check::on_op(op, site.as_deref(), inputs, &out);
        }
        out
    }

    /// The handle a graph node keeps on one of its inputs. A leaf is kept as it is (the
    /// backward adds to its `.grad`); an op's result becomes a handle with the same id,
    /// graph, shape and dtype but no data. The graph then keeps alive only what each
    /// backward saved, not every input it was recorded with: a max-pool's input, a residual
    /// branch or an addend is freed once the forward is done with it, as PyTorch's graph
    /// holds edges to nodes, not tensors (ResNet-50 at batch 32: the stem's ReLU output and
    /// each projection shortcut's output). Only autograd reads these handles, never their
    /// data.
    fn graph_edge(&self) -> Tensor {
        let Some(node) = &self.0.grad_fn else {
            return self.clone();
        };
        let empty: Storage = CpuStorage::from_f32(Vec::new(), self.0.dtype).into();
        Tensor(Arc::new(TensorImpl {
            id: self.0.id,
            storage: RwLock::new(Arc::new(empty)),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            device: self.0.device,
            requires_grad: AtomicBool::new(self.requires_grad()),
            grad_fn: Some(node.clone()),
            grad: Mutex::new(None),
        }))
    }

    // ----- accessors ---------------------------------------------------------------------

    /// A process-unique id of this tensor (clones of the handle share it; views and
    /// detached copies get new ones), used by autograd and by the autocast cast cache.
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// The size of each dim (`tensor.shape` in PyTorch).
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }
    /// The same as [`Tensor::shape`] (candle's name).
    pub fn dims(&self) -> &[usize] {
        self.shape()
    }
    /// Number of dims (`tensor.dim()` in PyTorch).
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }
    /// Number of elements (`tensor.numel()`).
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// Where the storage lives.
    pub fn device(&self) -> Device {
        self.0.device
    }
    /// Shape, strides and offset of this view into its storage.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    /// Per-dim steps in elements through the storage (`tensor.stride()`).
    pub fn strides(&self) -> &[usize] {
        self.0.layout.strides()
    }
    /// True when the view is row-major without gaps (`tensor.is_contiguous()`).
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Size of dim `d` (negative counts from the end).
    pub fn dim(&self, d: isize) -> Result<usize> {
        Ok(self.shape()[self.0.layout.dim("dim", d)?])
    }
    /// The shared storage (cheap: clones an `Arc`).
    pub fn storage(&self) -> Arc<Storage> {
        self.0
            .storage
            .read()
            .expect("storage lock poisoned")
            .clone()
    }
    /// True when both handles view the same storage buffer.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage(), &other.storage())
    }

    // ----- autograd state ----------------------------------------------------------------

    /// Whether gradients are recorded for this tensor (`tensor.requires_grad`): a leaf
    /// marked with `set_requires_grad`, or a result of an op on such a tensor outside
    /// `no_grad`.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Marks a leaf tensor as a parameter whose `.grad` accumulates. Errors on a non-leaf
    /// (its gradient flows to its inputs instead) and on integer tensors.
    pub fn set_requires_grad(&self, on: bool) -> Result<()> {
        if self.0.grad_fn.is_some() {
            return Err(Error::Autograd(
                "set_requires_grad on a non-leaf tensor; detach() it first".into(),
            ));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::dtype(
                "set_requires_grad",
                self.dtype(),
                "only float tensors can require gradients",
            ));
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Builder form of `set_requires_grad(true)` for fresh leaves (panics only on integer
    /// tensors, a programming error rather than user input).
    pub fn requires_grad_(self) -> Tensor {
        self.set_requires_grad(true)
            .expect("requires_grad_ on an integer or non-leaf tensor");
        self
    }

    /// True when the tensor was not produced by a recorded op (a leaf of the graph: inputs,
    /// parameters, detached tensors).
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }

    pub(crate) fn grad_fn(&self) -> Option<&Arc<Node>> {
        self.0.grad_fn.as_ref()
    }

    /// The name of the recorded op that made this tensor (PyTorch's `grad_fn.name()`):
    /// which fused op a module ran, for instance. `None` for a leaf.
    pub fn grad_fn_name(&self) -> Option<&'static str> {
        self.0.grad_fn.as_ref().map(|n| n.op)
    }

    /// The accumulated gradient of a leaf (`None` before the first backward or after
    /// `zero_grad`).
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().expect("grad lock poisoned").clone()
    }

    /// Replaces the accumulated gradient (optimizers and the loss scaler use this).
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.grad.lock().expect("grad lock poisoned") = g;
    }

    /// Clears the gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    /// Adds `g` to the accumulated gradient.
    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        let mut slot = self.0.grad.lock().expect("grad lock poisoned");
        *slot = Some(match slot.take() {
            None => g,
            Some(old) => old.add_into(&g)?,
        });
        Ok(())
    }

    /// `self + other` for two gradients of one shape and dtype, written over `self`'s buffer
    /// when this handle is the only owner of all of it (no clone, view, graph edge or `Weak`
    /// shares it); `self.add(other)` otherwise. The same values either way: the backward's
    /// sums of gradients (a residual connection's two branches) need no third buffer.
    pub(crate) fn add_into(self, other: &Tensor) -> Result<Tensor> {
        if self.dtype() == other.dtype()
            && self.shape() == other.shape()
            && self.grad_fn().is_none()
            && Arc::strong_count(&self.0) == 1
            && Arc::weak_count(&self.0) == 0
            && self.0.layout.contiguous_range() == Some(0..self.numel())
        {
            let mut guard = self.0.storage.write().expect("storage lock poisoned");
            let rhs = other.storage();
            if guard.len() == self.numel() {
                if let Some(buf) = Arc::get_mut(&mut guard) {
                    buf.binary_assign(&self.0.layout, &rhs, other.layout(), BinaryOp::Add)?;
                    drop(guard);
                    return Ok(self);
                }
            }
        }
        self.add(other)
    }

    /// A handle on the same storage and layout, outside the graph.
    pub fn detach(&self) -> Tensor {
        Tensor::from_storage(self.storage(), self.0.layout.clone())
    }

    /// Runs reverse-mode differentiation from this scalar (one-element) tensor: every leaf
    /// that requires grad gets the gradient added to its `.grad`.
    /// Frees the graph as it goes (PyTorch's default): a second backward through it is an
    /// error; see `backward_retain_graph`.
    pub fn backward(&self) -> Result<()> {
        autograd::backward(self)
    }

    /// As `backward`, keeping the graph for another backward (`retain_graph=True`).
    pub fn backward_retain_graph(&self) -> Result<()> {
        autograd::backward_retain(self)
    }

    /// Replaces the data of this (whole, contiguous) tensor with `src`'s values, in place:
    /// all clones of the handle see the new values. Shapes and dtypes must match. The values
    /// land on this tensor's device (a checkpoint read on the CPU loads into a model on a
    /// GPU and stays there). Not recorded by autograd (an optimizer's update).
    pub fn set_data(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() || src.dtype() != self.dtype() {
            return Err(Error::shape(
                "set_data",
                format!(
                    "destination {:?} {} vs source {:?} {}",
                    self.shape(),
                    self.dtype(),
                    src.shape(),
                    src.dtype()
                ),
            ));
        }
        let whole = |t: &Tensor| {
            t.0.layout.contiguous_range() == Some(0..t.numel()) && t.storage().len() == t.numel()
        };
        if !whole(self) {
            return Err(Error::arg(
                "set_data",
                "destination must be a whole contiguous tensor, not a view",
            ));
        }
        let new = if whole(src) {
            src.storage()
        } else {
            Arc::new(src.storage().copy_strided(src.layout())?)
        };
        let device = self.device();
        let new = if new.device() == device {
            new
        } else {
            Arc::new(new.to_device(device)?)
        };
        *self.0.storage.write().expect("storage lock poisoned") = new;
        Ok(())
    }

    /// Runs `f` on this tensor's storage, mutably (a backend primitive that updates a buffer
    /// in place, such as an optimizer's state). Copies the buffer first when another handle
    /// shares it, so that handle keeps the values it saw. Not recorded by autograd.
    pub(crate) fn with_storage_mut<R>(&self, f: impl FnOnce(&mut Storage) -> R) -> R {
        let mut guard = self.0.storage.write().expect("storage lock poisoned");
        f(Arc::make_mut(&mut guard))
    }

    // ----- reading values back -----------------------------------------------------------

    /// `f` of the whole storage in host memory: borrowed on the CPU, downloaded from another
    /// device (a failed download, a lost GPU for one, is the device's `Error`).
    fn try_with_host<R>(&self, f: impl FnOnce(&CpuStorage) -> R) -> Result<R> {
        let storage = self.storage();
        let host = storage.to_cpu()?;
        Ok(f(&host))
    }

    /// `try_with_host`, panicking with the device's error (the `to_vec_*` conveniences).
    fn with_host<R>(&self, f: impl FnOnce(&CpuStorage) -> R) -> R {
        match self.try_with_host(f) {
            Ok(r) => r,
            Err(e) => panic!(
                "reading a tensor on {} back to the host: {e}",
                self.device()
            ),
        }
    }

    /// All elements in row-major order, converted to F32. Panics where the read-back from
    /// a device fails (a lost GPU): [`Tensor::try_to_vec_f32`] returns that `Error`.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        self.with_host(|h| h.to_f32(self.layout()).into_owned())
    }
    /// All elements in row-major order, converted to F64 (exact for every float dtype).
    /// Panics where the read-back fails: [`Tensor::try_to_vec_f64`] does not.
    pub fn to_vec_f64(&self) -> Vec<f64> {
        self.with_host(|h| h.to_f64(self.layout()).into_owned())
    }
    /// All elements in row-major order as i64 (floats truncate). Panics where the read-back
    /// fails: [`Tensor::try_to_vec_i64`] does not.
    pub fn to_vec_i64(&self) -> Vec<i64> {
        self.with_host(|h| h.to_i64(self.layout()).into_owned())
    }
    /// [`Tensor::to_vec_f32`], with a failed read-back from a device (a lost GPU, out of
    /// memory) as that device's `Error`.
    pub fn try_to_vec_f32(&self) -> Result<Vec<f32>> {
        self.try_with_host(|h| h.to_f32(self.layout()).into_owned())
    }
    /// [`Tensor::to_vec_f64`], with a failed read-back as the device's `Error`.
    pub fn try_to_vec_f64(&self) -> Result<Vec<f64>> {
        self.try_with_host(|h| h.to_f64(self.layout()).into_owned())
    }
    /// [`Tensor::to_vec_i64`], with a failed read-back as the device's `Error`.
    pub fn try_to_vec_i64(&self) -> Result<Vec<i64>> {
        self.try_with_host(|h| h.to_i64(self.layout()).into_owned())
    }
    /// All elements as their own Rust type; errors if `T` is not the tensor's dtype.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(
                "to_vec",
                self.dtype(),
                format!("asked for {}", T::DTYPE),
            ));
        }
        let s = self.storage().copy_strided(self.layout())?;
        Ok(s.into_cpu()?.into_vec().expect("dtype checked above"))
    }
    /// The value of a one-element tensor, as f64.
    pub fn to_scalar(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "to_scalar",
                format!("expected one element, got shape {:?}", self.shape()),
            ));
        }
        Ok(self.try_to_vec_f64()?[0])
    }

    /// The same values in `dtype` (differentiable: the gradient is cast back). Returns
    /// `self` unchanged when the dtype already matches.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let src_dtype = self.dtype();
        if self.requires_grad() && !dtype.is_float() {
            return Err(Error::dtype(
                "to_dtype",
                dtype,
                "casting a tensor that requires grad to an integer dtype",
            ));
        }
        let out = self.storage().cast(self.layout(), dtype)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(self.shape()),
            "to_dtype",
            &[self],
            move |g| Ok(vec![Some(g.to_dtype(src_dtype)?)]),
        ))
    }

    /// The same values on `device` (differentiable: the gradient moves back), as PyTorch's
    /// `tensor.to(device)`. Returns `self` when it is already there; an error names the
    /// device when it is absent or hemi was built without its backend.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        let src_device = self.device();
        if device == src_device {
            return Ok(self.clone());
        }
        let out = self
            .storage()
            .copy_strided(self.layout())?
            .to_device(device)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(self.shape()),
            "to_device",
            &[self],
            move |g| Ok(vec![Some(g.to_device(src_device)?)]),
        ))
    }

    /// A contiguous copy of this tensor, or itself when already contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = self.storage().copy_strided(self.layout())?;
        Ok(Tensor::from_op(
            Arc::new(out),
            Layout::contiguous(self.shape()),
            "contiguous",
            &[self],
            |g| Ok(vec![Some(g.clone())]),
        ))
    }

    pub(crate) fn new_view(
        &self,
        layout: Layout,
        op: &'static str,
        backward: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        Tensor::from_op(self.storage(), layout, op, &[self], backward)
    }
}
