//! The backend boundary: what a device's buffer must provide for the ops above it.
//!
//! Each backend (`cpu/`; `naive/`, the plain-loops reference that writes only the basic
//! primitives; `cuda/` behind the `cuda` feature) has one buffer type that implements
//! `BackendStorage`; `tensor::Storage` is the enum over them and dispatches each
//! call. Every primitive takes the layouts of its inputs (shape, strides, offset), so views
//! need no copy before a kernel, and returns a new contiguous buffer on the same device.
//! Ops validate shapes and dtypes, apply autocast and promotion, and record backward before
//! they call a primitive; primitives assume their arguments were checked.
//!
//! The primitives are grouped by area, one trait per file (as burn groups its backend
//! ops): `map` (casts, unary and binary maps with broadcasting, where, random fills),
//! `reduce` (sums, means, extrema, variances, softmax rows), `nn` (matmul, convolutions,
//! pools, norms), `loss` (classification losses, MSE), `index` (row gathers, their
//! scatter-add, concatenation), `train` (the fused unscale-and-check, the optimizer
//! updates). A backend implements them all (`Backend`), but 32 of the 59 methods have a
//! default body composed of the others (`compose`): a new backend writes 24 primitives and
//! 3 accessors, and overrides a default where its own kernel is faster.
//!
//! Each primitive is declared once, in its area's `primitives!` block (`declare`): the
//! declaration is the trait method a backend implements and the `Storage` method ops call,
//! which binds the receiver's buffer, checks that every other buffer is on the same device
//! (else an error naming the primitive and both devices) and wraps the results back into
//! `Storage`s. Only the constructors (`dropout_mask`, `cat`) have hand-written `Storage`
//! methods, since no receiver says which backend they are for.

use crate::cpu::storage::CpuStorage;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Layout;

pub mod compose;
pub mod declare;
pub mod index;
pub mod loss;
pub mod map;
pub mod nn;
pub mod reduce;
pub mod train;

/// Everything a backend provides: its buffer type implements every area's primitives.
pub trait Backend:
    BackendStorage
    + map::MapOps
    + reduce::ReduceOps
    + loss::LossOps
    + nn::NnOps
    + index::IndexOps
    + train::AmpOps
    + train::OptimOps
{
}

impl<T> Backend for T where
    T: BackendStorage
        + map::MapOps
        + reduce::ReduceOps
        + loss::LossOps
        + nn::NnOps
        + index::IndexOps
        + train::AmpOps
        + train::OptimOps
{
}

/// A backend's buffer of elements of one dtype.
pub trait BackendStorage: Sized + Clone + Send + Sync + std::fmt::Debug + 'static {
    /// The device this buffer lives on.
    fn device(&self) -> Device;
    /// The dtype of every element in the buffer.
    fn dtype(&self) -> DType;
    /// Elements in the buffer.
    fn len(&self) -> usize;
    /// True when the buffer holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The elements addressed by `layout` in a new contiguous buffer.
    fn copy_strided(&self, layout: &Layout) -> Result<Self>;
    /// The elements addressed by `layout` converted to `dtype` (nearest-even, overflow to
    /// ±inf, NaN kept; floats to I64 truncate toward zero).
    fn cast(&self, layout: &Layout, dtype: DType) -> Result<Self>;
    /// The elements addressed by `layout`, copied into host memory (contiguous): what the
    /// statistics' default bodies read, and the way to the host for every backend.
    fn download(&self, layout: &Layout) -> Result<CpuStorage>;
    /// A buffer on this buffer's device (whose values are not read) holding `host`'s
    /// elements: the constants a default composition needs (zeros, a flag).
    fn upload(&self, host: &CpuStorage) -> Result<Self>;
}
