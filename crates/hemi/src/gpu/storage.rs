//! `GpuStorage`, the wgpu backend's buffer, and its primitives: the basic ones that have a
//! kernel (copies, casts, transfers, unary and binary maps, reductions, matmul) and an error
//! naming the primitive for the others. Methods with a default body are not overridden, so
//! their compositions run here as soon as the primitives they use exist.

use std::sync::Arc;

use super::context::{context, groups_1d, groups_per_item, Block, GpuContext};
use super::shaders;
use crate::backend::index::{AlongDim, IndexOps};
use crate::backend::loss::LossOps;
use crate::backend::map::{BinaryOp, MapOps, UnaryOp};
use crate::backend::nn::{Conv2dGeom, Indices, MaxPool2d, NnOps, Opt, Pool2dGeom, View};
use crate::backend::reduce::{ReduceOp, ReduceOps, Rows};
use crate::backend::train::{AmpOps, OptimOps};
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::device::Device;
use crate::dtype::convert::Rounding;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Layout;

/// The wgpu backend implements every primitive (a compile-time check).
const _: fn() = || {
    fn is_backend<B: crate::backend::Backend>() {}
    is_backend::<GpuStorage>();
};

/// A buffer of `len` elements of one dtype on a GPU of the wgpu backend. F32 is a word an
/// element, F16 and BF16 two elements a word, F64 and I64 two words an element (stored,
/// copied and cast through the host; no kernel computes in them yet). Cloning shares the
/// device memory, which goes back to the device's cache when the last clone drops.
#[derive(Clone)]
pub struct GpuStorage {
    block: Arc<Block>,
    dtype: DType,
    len: usize,
}

impl std::fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuStorage({:?} x {} on {})",
            self.dtype,
            self.len,
            self.ctx().device()
        )
    }
}

/// The dtypes the kernels read and write.
fn in_shaders(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// A value the kernels index with as a `u32`, or an error naming `op`.
fn word(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::arg(
            op,
            format!(
                "{v} exceeds the GPU backend's 32-bit indexing (at most {})",
                u32::MAX
            ),
        )
    })
}

/// The strided-operand parameters (`gpu::shaders` module doc): `n` elements of `shape`,
/// scalars `c0`, `c1` as words, each operand's offset and strides.
fn strided_params(
    op: &'static str,
    n: usize,
    shape: &[usize],
    scalars: (u32, u32),
    operands: &[&Layout],
) -> Result<Vec<u32>> {
    let mut p = vec![word(op, n)?, word(op, shape.len())?, scalars.0, scalars.1];
    for &d in shape {
        p.push(word(op, d)?);
    }
    for l in operands {
        p.push(word(op, l.offset())?);
        for &s in l.strides() {
            p.push(word(op, s)?);
        }
    }
    Ok(p)
}

impl GpuStorage {
    /// `host`'s elements on `gpu:ordinal` (the context is created on first use).
    pub fn from_host(ordinal: usize, host: &CpuStorage) -> Result<GpuStorage> {
        Self::upload_to(&context(ordinal)?, host)
    }

    fn upload_to(ctx: &Arc<GpuContext>, host: &CpuStorage) -> Result<GpuStorage> {
        let block = ctx.upload_bytes(&host.to_le_bytes())?;
        Ok(GpuStorage {
            block: Arc::new(block),
            dtype: host.dtype(),
            len: host.len(),
        })
    }

    /// The context (device, queue, caches) this buffer lives on.
    pub fn ctx(&self) -> &Arc<GpuContext> {
        self.block.ctx()
    }

    /// An uninitialised buffer of `len` elements of `dtype` on `ctx`.
    fn empty(ctx: &Arc<GpuContext>, dtype: DType, len: usize) -> Result<GpuStorage> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::arg("gpu malloc", format!("{len} elements overflow")))?;
        Ok(GpuStorage {
            block: Arc::new(ctx.alloc(bytes.next_multiple_of(4))?),
            dtype,
            len,
        })
    }

    /// Errors unless `other` is on this buffer's device (two GPUs are two backends' worth
    /// of memory, though one Rust type).
    fn same(&self, op: &'static str, other: &GpuStorage) -> Result<()> {
        if Arc::ptr_eq(self.ctx(), other.ctx()) {
            Ok(())
        } else {
            Err(Error::device(
                op,
                format!(
                    "inputs on {} and {}",
                    self.ctx().device(),
                    other.ctx().device()
                ),
            ))
        }
    }

    /// The error of a primitive that has no GPU kernel yet.
    fn not_yet(&self, op: &'static str) -> Error {
        Error::device(
            op,
            format!(
                "{op} is not on the GPU backend yet ({}); move its inputs to the CPU with \
                 to_device(Device::Cpu) (DEVELOPERS.md lists what the backend has)",
                self.ctx().device()
            ),
        )
    }

    fn check_dtype(&self, op: &'static str, d: DType) -> Result<()> {
        if in_shaders(d) {
            Ok(())
        } else {
            Err(Error::dtype(
                op,
                d,
                format!(
                    "the GPU backend ({}) computes in F32, F16 and BF16 only",
                    self.ctx().device()
                ),
            ))
        }
    }

    /// An elementwise kernel over `shape`: `expr` of the operands (their values as F32, or
    /// their bits with `bits`), into a new contiguous buffer of `out`.
    #[allow(clippy::too_many_arguments)]
    fn map_kernel(
        &self,
        op: &'static str,
        shape: &[usize],
        operands: &[(&GpuStorage, &Layout)],
        expr: &str,
        scalars: (f64, f64),
        out: DType,
        bits: bool,
    ) -> Result<GpuStorage> {
        for (s, _) in operands {
            self.same(op, s)?;
            self.check_dtype(op, s.dtype)?;
        }
        self.check_dtype(op, out)?;
        let ctx = self.ctx();
        let n: usize = shape.iter().product();
        let dst = Self::empty(ctx, out, n)?;
        let layouts: Vec<&Layout> = operands.iter().map(|(_, l)| *l).collect();
        let c = ((scalars.0 as f32).to_bits(), (scalars.1 as f32).to_bits());
        let params = strided_params(op, n, shape, c, &layouts)?;
        let dtypes: Vec<DType> = operands.iter().map(|(s, _)| s.dtype).collect();
        let src = shaders::map(&dtypes, expr, out, bits);
        let threads = if out == DType::F32 { n } else { n.div_ceil(2) };
        let inputs: Vec<&Block> = operands.iter().map(|(s, _)| &*s.block).collect();
        ctx.launch(op, &src, &params, &dst.block, &inputs, groups_1d(threads))?;
        Ok(dst)
    }

    /// The host route for dtypes no kernel handles (F64, I64): read back, run `f` on the
    /// CPU, upload the result.
    fn via_host(
        &self,
        layout: &Layout,
        f: impl FnOnce(&CpuStorage, &Layout) -> CpuStorage,
    ) -> Result<GpuStorage> {
        let host = self.download(layout)?;
        let r = f(&host, &Layout::contiguous(layout.shape()));
        Self::upload_to(self.ctx(), &r)
    }

    /// This F32 buffer's values as `out` (contiguous `[len]`), or itself when `out` is F32.
    fn f32_into(self, out: DType) -> Result<GpuStorage> {
        if out == DType::F32 {
            return Ok(self);
        }
        let l = Layout::contiguous(&[self.len]);
        self.cast(&l, out)
    }
}

impl BackendStorage for GpuStorage {
    fn device(&self) -> Device {
        self.ctx().device()
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        if !in_shaders(self.dtype) {
            return self.via_host(layout, |h, l| h.gather(l));
        }
        let shape = layout.shape();
        self.map_kernel(
            "copy_strided",
            shape,
            &[(self, layout)],
            "a",
            (0.0, 0.0),
            self.dtype,
            true,
        )
    }

    fn cast(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        if dtype == self.dtype {
            return self.copy_strided(layout);
        }
        if !in_shaders(self.dtype) || !in_shaders(dtype) {
            return self.via_host(layout, |h, l| h.cast(l, dtype));
        }
        self.map_kernel(
            "cast",
            layout.shape(),
            &[(self, layout)],
            "a",
            (0.0, 0.0),
            dtype,
            false,
        )
    }

    fn download(&self, layout: &Layout) -> Result<CpuStorage> {
        let size = self.dtype.size_in_bytes();
        let whole = layout.is_contiguous() && layout.offset() == 0;
        let bytes = if whole {
            self.ctx()
                .download_bytes(&self.block, layout.numel() * size)?
        } else if in_shaders(self.dtype) {
            let c = self.copy_strided(layout)?;
            c.ctx().download_bytes(&c.block, layout.numel() * size)?
        } else {
            let all = self.ctx().download_bytes(&self.block, self.len * size)?;
            let host = CpuStorage::from_le_bytes(self.dtype, &all).ok_or_else(|| {
                Error::device("download", "a read-back of the wrong size".to_string())
            })?;
            return Ok(host.gather(layout));
        };
        CpuStorage::from_le_bytes(self.dtype, &bytes)
            .ok_or_else(|| Error::device("download", "a read-back of the wrong size".to_string()))
    }

    fn upload(&self, host: &CpuStorage) -> Result<Self> {
        Self::upload_to(self.ctx(), host)
    }
}

impl MapOps for GpuStorage {
    fn binary(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        op: BinaryOp,
        out: DType,
    ) -> Result<Self> {
        self.map_kernel(
            "binary",
            la.shape(),
            &[(self, la), (rhs, lb)],
            op.wgsl(),
            (0.0, 0.0),
            out,
            false,
        )
    }

    fn minmax_backward(
        &self,
        _lg: &Layout,
        _a: View<'_, Self>,
        _b: View<'_, Self>,
        _op: BinaryOp,
        _out: DType,
    ) -> Result<(Self, Self)> {
        Err(self.not_yet("minmax_backward"))
    }

    fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self> {
        self.map_kernel(
            "unary",
            layout.shape(),
            &[(self, layout)],
            op.wgsl(),
            op.scalars(),
            out,
            false,
        )
    }

    fn unary_backward(
        &self,
        _lg: &Layout,
        _saved: &Self,
        _ls: &Layout,
        _op: UnaryOp,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("unary_backward"))
    }

    fn where_cond(
        &self,
        _lc: &Layout,
        _a: View<'_, Self>,
        _b: View<'_, Self>,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("where_cond"))
    }

    fn dropout_mask(_n: usize, _p: f64, _rng: &mut Generator, _dtype: DType) -> Result<Self> {
        Err(Error::device(
            "dropout_mask",
            "dropout_mask is not on the GPU backend yet; move its input to the CPU with \
             to_device(Device::Cpu)"
                .to_string(),
        ))
    }
}

impl ReduceOps for GpuStorage {
    fn reduce(
        &self,
        layout: &Layout,
        outer: usize,
        inner: usize,
        op: ReduceOp,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "reduce";
        self.check_dtype(OP, self.dtype)?;
        self.check_dtype(OP, out)?;
        let (name, correction) = match op {
            ReduceOp::Sum => ("sum", 0),
            ReduceOp::Mean => ("mean", 0),
            ReduceOp::Max => ("max", 0),
            ReduceOp::Min => ("min", 0),
            ReduceOp::Var { correction } => ("var", correction),
        };
        let ctx = self.ctx();
        let dst = Self::empty(ctx, DType::F32, outer)?;
        let mut params = strided_params(
            OP,
            outer,
            layout.shape(),
            (word(OP, inner)?, word(OP, correction)?),
            &[layout],
        )?;
        params[0] = word(OP, outer)?;
        let src = shaders::reduce(self.dtype, name);
        ctx.launch(
            OP,
            &src,
            &params,
            &dst.block,
            &[&self.block],
            groups_per_item(outer),
        )?;
        dst.f32_into(out)
    }

    fn extreme_backward(
        &self,
        _layout: &Layout,
        _m: View<'_, Self>,
        _g: View<'_, Self>,
        _runs: (usize, usize),
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("extreme_backward"))
    }

    fn extreme_dim(
        &self,
        _layout: &Layout,
        _rows: Rows,
        _op: ReduceOp,
        _out: DType,
    ) -> Result<(Self, Self)> {
        Err(self.not_yet("extreme_dim"))
    }

    fn extreme_dim_backward(
        &self,
        _lg: &Layout,
        _index: &Self,
        _li: &Layout,
        _rows: Rows,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("extreme_dim_backward"))
    }
}

/// Batch strides of an operand of rank `r` (its last two dims the matrix) against the
/// broadcast batch shape `batch`: 0 where it lacks the dim or has size 1.
fn batch_strides(l: &Layout, batch: &[usize]) -> Vec<usize> {
    let r = l.rank() - 2;
    let lead = batch.len() - r;
    (0..batch.len())
        .map(|i| {
            if i < lead || l.shape()[i - lead] == 1 {
                0
            } else {
                l.strides()[i - lead]
            }
        })
        .collect()
}

impl NnOps for GpuStorage {
    fn matmul(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        bias: Opt<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "matmul";
        self.same(OP, rhs)?;
        self.check_dtype(OP, self.dtype)?;
        self.check_dtype(OP, rhs.dtype)?;
        self.check_dtype(OP, out)?;
        let (ra, rb) = (la.rank(), lb.rank());
        let batch = crate::tensor::layout::broadcast_shapes(
            OP,
            &la.shape()[..ra - 2],
            &lb.shape()[..rb - 2],
        )?;
        let (m, k, n) = (la.shape()[ra - 2], la.shape()[ra - 1], lb.shape()[rb - 1]);
        let count: usize = batch.iter().product();
        let ctx = self.ctx();
        let dst = Self::empty(ctx, DType::F32, count * m * n)?;
        let mut params = vec![
            word(OP, m)?,
            word(OP, n)?,
            word(OP, k)?,
            word(OP, batch.len())?,
            word(OP, la.offset())?,
            word(OP, la.strides()[ra - 2])?,
            word(OP, la.strides()[ra - 1])?,
            word(OP, lb.offset())?,
            word(OP, lb.strides()[rb - 2])?,
            word(OP, lb.strides()[rb - 1])?,
            0,
        ];
        for v in batch
            .iter()
            .chain(&batch_strides(la, &batch))
            .chain(&batch_strides(lb, &batch))
        {
            params.push(word(OP, *v)?);
        }
        word(OP, count * m * n)?;
        let bias = match bias {
            Some((b, lbias)) => {
                self.same(OP, b)?;
                Some(b.cast(lbias, DType::F32)?)
            }
            None => None,
        };
        let mut inputs: Vec<&Block> = vec![&self.block, &rhs.block];
        if let Some(b) = &bias {
            inputs.push(&b.block);
        }
        let src = shaders::matmul(self.dtype, rhs.dtype, bias.is_some());
        let groups = (
            word(OP, n.div_ceil(16))?,
            word(OP, m.div_ceil(16))?,
            word(OP, count)?,
        );
        if count * m * n > 0 {
            ctx.launch(OP, &src, &params, &dst.block, &inputs, groups)?;
        }
        dst.f32_into(out)
    }

    fn conv2d(
        &self,
        _lx: &Layout,
        _w: &Self,
        _lw: &Layout,
        _bias: Opt<'_, Self>,
        _g: &Conv2dGeom,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("conv2d"))
    }

    fn conv2d_backward_input(
        &self,
        _ldy: &Layout,
        _w: &Self,
        _lw: &Layout,
        _g: &Conv2dGeom,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("conv2d_backward_input"))
    }

    fn conv2d_backward_weight(
        &self,
        _lx: &Layout,
        _dy: &Self,
        _ldy: &Layout,
        _g: &Conv2dGeom,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("conv2d_backward_weight"))
    }

    fn max_pool2d(
        &self,
        _l: &Layout,
        _g: &Pool2dGeom,
        _with_indices: bool,
    ) -> Result<MaxPool2d<Self>> {
        Err(self.not_yet("max_pool2d"))
    }

    fn max_pool2d_backward(
        &self,
        _ldy: &Layout,
        _argmax: &Indices,
        _g: &Pool2dGeom,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("max_pool2d_backward"))
    }
}

impl IndexOps for GpuStorage {
    fn index_select(&self, _l: &Layout, _ids: &Self, _lids: &Layout, _d: AlongDim) -> Result<Self> {
        Err(self.not_yet("index_select"))
    }

    fn index_add_zeros(
        &self,
        _l: &Layout,
        _ids: &Self,
        _lids: &Layout,
        _d: AlongDim,
        _out: DType,
    ) -> Result<Self> {
        Err(self.not_yet("index_add_zeros"))
    }

    fn cat(
        parts: &[(&Self, &Layout)],
        _outer: usize,
        _lens: &[usize],
        _inner: usize,
    ) -> Result<Self> {
        Err(match parts.first() {
            Some((s, _)) => s.not_yet("cat"),
            None => Error::arg("cat", "needs at least one tensor"),
        })
    }
}

impl LossOps for GpuStorage {}

impl AmpOps for GpuStorage {
    fn round_into(
        &self,
        _layout: &Layout,
        _dtype: DType,
        _rounding: Rounding,
        _rng: &mut Generator,
    ) -> Result<Self> {
        Err(self.not_yet("round_into"))
    }
}

impl OptimOps for GpuStorage {}
