//! `GpuStorage`, the wgpu backend's buffer, and its primitives: the 24 basic ones of the
//! backend contract (DEVELOPERS.md, "Adding a backend"), each a WGSL kernel (`shaders`).
//! Methods with a default body are not overridden: their compositions run here on these.

use std::sync::Arc;

use super::context::{context, groups_1d, groups_per_item, Block, GpuContext};
use super::shaders::{self, Load};
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
use crate::rng::{threshold53, Generator};
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

/// The contiguous layout of `l`'s shape: how a buffer downloaded through `l` is read.
fn row_major(l: &Layout) -> Layout {
    Layout::contiguous(l.shape())
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

    /// `host`'s elements on the device of `ctx` (a context of its own from
    /// [`GpuContext::open`], or the shared one of [`context`]).
    pub fn from_host_on(ctx: &Arc<GpuContext>, host: &CpuStorage) -> Result<GpuStorage> {
        Self::upload_to(ctx, host)
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

    /// An elementwise kernel over `shape`: `expr` of the operands (each read as its `Load`
    /// says; with `bits`, the first operand's bits copied) and the functions in `prelude`,
    /// into a new contiguous buffer of `out`.
    #[allow(clippy::too_many_arguments)]
    fn map_kernel(
        &self,
        op: &'static str,
        shape: &[usize],
        operands: &[(&GpuStorage, &Layout, Load)],
        prelude: &str,
        expr: &str,
        scalars: (f64, f64),
        out: DType,
        bits: bool,
    ) -> Result<GpuStorage> {
        for (s, _, load) in operands {
            self.same(op, s)?;
            if *load != Load::Nonzero {
                self.check_dtype(op, s.dtype)?;
            }
        }
        self.check_dtype(op, out)?;
        // An operand read through a layout of another shape (the same number of elements,
        // row-major: `mse_backward`'s flat difference against the loss's gradient) is made
        // contiguous first, then read as the iteration shape.
        let mut owned: Vec<(GpuStorage, Layout)> = Vec::new();
        for (s, l, _) in operands {
            if l.shape() != shape {
                let own = if l.is_contiguous() {
                    (GpuStorage::clone(s), l.offset())
                } else {
                    (s.copy_strided(l)?, 0)
                };
                let c = Layout::contiguous(shape);
                let lc = Layout::new(shape.to_vec(), c.strides().to_vec(), own.1);
                owned.push((own.0, lc));
            }
        }
        let mut fixed = owned.iter();
        let operands: Vec<(&GpuStorage, &Layout, Load)> = operands
            .iter()
            .map(|&(s, l, load)| match l.shape() != shape {
                true => {
                    let (s, l) = fixed.next().expect("one per reshaped operand");
                    (s, l, load)
                }
                false => (s, l, load),
            })
            .collect();
        let ctx = self.ctx();
        let n: usize = shape.iter().product();
        let dst = Self::empty(ctx, out, n)?;
        let layouts: Vec<&Layout> = operands.iter().map(|(_, l, _)| *l).collect();
        let c = ((scalars.0 as f32).to_bits(), (scalars.1 as f32).to_bits());
        let params = strided_params(op, n, shape, c, &layouts)?;
        let inputs: Vec<(DType, Load)> = operands.iter().map(|(s, _, l)| (s.dtype, *l)).collect();
        let native = ctx.native_f16();
        let src = shaders::map(&inputs, prelude, expr, out, bits, native);
        // A word per thread: one F32 element or two halves.
        let threads = if out == DType::F32 { n } else { n.div_ceil(2) };
        let blocks: Vec<&Block> = operands.iter().map(|(s, _, _)| &*s.block).collect();
        ctx.launch(op, &src, &params, &dst.block, &blocks, groups_1d(threads))?;
        Ok(dst)
    }

    /// The elements `layout` addresses as a contiguous F32 buffer (row-major): this buffer
    /// itself when it is one already, else the cast kernel's copy (exact for F16 and BF16;
    /// F64 and I64 are rounded into F32 on the host, as the compute type reads them).
    fn f32_view(&self, layout: &Layout) -> Result<GpuStorage> {
        let whole = layout.is_contiguous() && layout.offset() == 0 && layout.numel() == self.len;
        if self.dtype == DType::F32 && whole {
            Ok(self.clone())
        } else {
            self.cast(layout, DType::F32)
        }
    }

    /// A convolution operand: the elements `layout` addresses as a contiguous buffer the
    /// kernel binds as `array<ty>`, `ty` the returned WGSL type: F16 itself on the native
    /// route (copied first unless it is the whole buffer), else F32 (`f32_view`).
    fn conv_view(&self, layout: &Layout) -> Result<(GpuStorage, &'static str)> {
        if self.dtype == DType::F16 && self.ctx().native_f16() {
            let whole =
                layout.is_contiguous() && layout.offset() == 0 && layout.numel() == self.len;
            let v = if whole {
                self.clone()
            } else {
                self.copy_strided(layout)?
            };
            Ok((v, "f16"))
        } else {
            Ok((self.f32_view(layout)?, "f32"))
        }
    }

    /// An I64 buffer of ids the kernels read as words (`2i` the low word of element `i`) and
    /// the element offset of the first id: the buffer itself where `layout` is contiguous,
    /// else a contiguous copy.
    fn id_words(&self, op: &'static str, layout: &Layout) -> Result<(GpuStorage, u32)> {
        if self.dtype != DType::I64 {
            return Err(Error::dtype(op, self.dtype, "ids must be I64"));
        }
        if layout.is_contiguous() {
            Ok((self.clone(), word(op, layout.offset())?))
        } else {
            Ok((self.copy_strided(layout)?, 0))
        }
    }

    /// Runs the one-dimensional kernel `src` with `threads` threads into a new F32 buffer of
    /// `len` elements.
    fn f32_kernel(
        &self,
        op: &'static str,
        src: &str,
        params: &[u32],
        inputs: &[&Block],
        threads: usize,
        len: usize,
    ) -> Result<GpuStorage> {
        word(op, threads)?;
        let ctx = self.ctx();
        let dst = Self::empty(ctx, DType::F32, len)?;
        ctx.launch(op, src, params, &dst.block, inputs, groups_1d(threads))?;
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
            &[(self, layout, Load::Bits)],
            "",
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
            &[(self, layout, Load::Value)],
            "",
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
        if [self.dtype, rhs.dtype, out].iter().any(|&d| !in_shaders(d)) {
            self.same("binary", rhs)?;
            let (a, b) = (self.download(la)?, rhs.download(lb)?);
            let r = a.binary(&row_major(la), &b, &row_major(lb), op, out)?;
            return Self::upload_to(self.ctx(), &r);
        }
        self.map_kernel(
            "binary",
            la.shape(),
            &[(self, la, Load::Value), (rhs, lb, Load::Value)],
            "",
            op.wgsl(),
            (0.0, 0.0),
            out,
            false,
        )
    }

    fn minmax_backward(
        &self,
        lg: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        op: BinaryOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        // g · w and g · (1 - w), w the share `a` gets (operands: a = g, b = a, c = b).
        let max = op == BinaryOp::Maximum;
        let w = format!("hemi_minmax_weight(b, c, {max})");
        let operands = [
            (self, lg, Load::Value),
            (a, la, Load::Value),
            (b, lb, Load::Value),
        ];
        let shape = lg.shape();
        let (pre, scalars) = (shaders::BACKWARD_HELPERS, (0.0, 0.0));
        let ga = self.map_kernel(
            "minmax_backward",
            shape,
            &operands,
            pre,
            &format!("a * {w}"),
            scalars,
            out,
            false,
        )?;
        let gb = self.map_kernel(
            "minmax_backward",
            shape,
            &operands,
            pre,
            &format!("a * (1.0 - {w})"),
            scalars,
            out,
            false,
        )?;
        Ok((ga, gb))
    }

    fn unary(&self, layout: &Layout, op: UnaryOp, out: DType) -> Result<Self> {
        if !in_shaders(self.dtype) || !in_shaders(out) {
            let r = self.download(layout)?.unary(&row_major(layout), op, out)?;
            return Self::upload_to(self.ctx(), &r);
        }
        self.map_kernel(
            "unary",
            layout.shape(),
            &[(self, layout, Load::Value)],
            "",
            op.wgsl(),
            op.scalars(),
            out,
            false,
        )
    }

    fn unary_backward(
        &self,
        lg: &Layout,
        saved: &Self,
        ls: &Layout,
        op: UnaryOp,
        out: DType,
    ) -> Result<Self> {
        let prelude = format!(
            "{}fn slope(s: f32, c0: f32, c1: f32) -> f32 {{ _ = c1; return {}; }}\n",
            shaders::BACKWARD_HELPERS,
            op.wgsl_slope()
        );
        self.map_kernel(
            "unary_backward",
            lg.shape(),
            &[(self, lg, Load::Value), (saved, ls, Load::Value)],
            &prelude,
            "a * slope(b, c0, c1)",
            op.scalars(),
            out,
            false,
        )
    }

    fn where_cond(
        &self,
        lc: &Layout,
        (a, la): View<'_, Self>,
        (b, lb): View<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        // Operands: a = the condition as 1.0/0.0, b and c the values.
        self.map_kernel(
            "where_cond",
            lc.shape(),
            &[
                (self, lc, Load::Nonzero),
                (a, la, Load::Value),
                (b, lb, Load::Value),
            ],
            "",
            "select(c, b, a != 0.0)",
            (0.0, 0.0),
            out,
            false,
        )
    }

    /// On `gpu:0`: the constructor has no buffer to name its device, so `Storage::dropout_mask`
    /// calls [`GpuStorage::dropout_mask_on`] with its tensor's device instead.
    fn dropout_mask(n: usize, p: f64, rng: &mut Generator, dtype: DType) -> Result<Self> {
        Self::dropout_mask_on(&context(0)?, n, p, rng, dtype)
    }
}

impl GpuStorage {
    /// `MapOps::dropout_mask` on `ctx`'s device: the CPU's counter-based hash (`rng::keep53`,
    /// splitmix64 in 64-bit emulation) on the same seed, so the mask is the CPU's bit for
    /// bit. F64 masks are made on the host and uploaded.
    pub fn dropout_mask_on(
        ctx: &Arc<GpuContext>,
        n: usize,
        p: f64,
        rng: &mut Generator,
        dtype: DType,
    ) -> Result<GpuStorage> {
        const OP: &str = "dropout_mask";
        if !in_shaders(dtype) {
            let host = CpuStorage::dropout_mask(n, p, rng, dtype)?;
            return Self::upload_to(ctx, &host);
        }
        // p == 1 drops everything without drawing: a threshold no hash reaches.
        let (seed, threshold, scale) = if p == 1.0 {
            (0, 1u64 << 53, 0.0f32)
        } else {
            (rng.next_u64(), threshold53(p), (1.0 / (1.0 - p)) as f32)
        };
        let params = [
            word(OP, n)?,
            seed as u32,
            (seed >> 32) as u32,
            threshold as u32,
            (threshold >> 32) as u32,
            scale.to_bits(),
        ];
        let dst = Self::empty(ctx, DType::F32, n)?;
        ctx.launch(
            OP,
            &shaders::dropout_mask(),
            &params,
            &dst.block,
            &[],
            groups_1d(n),
        )?;
        dst.f32_into(dtype)
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
        let src = shaders::reduce(self.dtype, name, ctx.native_f16());
        ctx.launch(
            OP,
            &src,
            &params,
            &dst.block,
            &[&*self.block],
            groups_per_item(outer),
        )?;
        dst.f32_into(out)
    }

    fn extreme_backward(
        &self,
        layout: &Layout,
        (m, lm): View<'_, Self>,
        (g, lg): View<'_, Self>,
        (outer, inner): (usize, usize),
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "extreme_backward";
        self.same(OP, m)?;
        self.same(OP, g)?;
        self.check_dtype(OP, out)?;
        let (x, m, g) = (self.f32_view(layout)?, m.f32_view(lm)?, g.f32_view(lg)?);
        let params = [word(OP, outer)?, word(OP, inner)?];
        let blocks = [&*x.block, &*m.block, &*g.block];
        let src = shaders::extreme_backward();
        self.f32_kernel(OP, &src, &params, &blocks, outer, outer * inner)?
            .f32_into(out)
    }

    fn extreme_dim(
        &self,
        layout: &Layout,
        rows: Rows,
        op: ReduceOp,
        out: DType,
    ) -> Result<(Self, Self)> {
        const OP: &str = "extreme_dim";
        self.check_dtype(OP, out)?;
        let x = self.f32_view(layout)?;
        let count = rows.count();
        let index = Self::empty(self.ctx(), DType::I64, count)?;
        let params = [
            word(OP, count)?,
            word(OP, rows.len)?,
            word(OP, rows.inner.max(1))?,
            u32::from(op == ReduceOp::Max),
        ];
        let src = shaders::extreme_dim();
        let values =
            self.f32_kernel(OP, &src, &params, &[&*x.block, &*index.block], count, count)?;
        Ok((values.f32_into(out)?, index))
    }

    fn extreme_dim_backward(
        &self,
        lg: &Layout,
        index: &Self,
        li: &Layout,
        rows: Rows,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "extreme_dim_backward";
        self.same(OP, index)?;
        self.check_dtype(OP, out)?;
        let g = self.f32_view(lg)?;
        let (index, at) = index.id_words(OP, li)?;
        let n = rows.count() * rows.len;
        let params = [
            word(OP, n)?,
            word(OP, rows.len)?,
            word(OP, rows.inner.max(1))?,
            at,
        ];
        let src = shaders::extreme_dim_backward();
        self.f32_kernel(OP, &src, &params, &[&*g.block, &*index.block], n, n)?
            .f32_into(out)
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
        let src = shaders::matmul(self.dtype, rhs.dtype, bias.is_some(), ctx.native_f16());
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
        lx: &Layout,
        w: &Self,
        lw: &Layout,
        bias: Opt<'_, Self>,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "conv2d";
        self.same(OP, w)?;
        self.check_dtype(OP, out)?;
        let ((x, tx), (w, tw)) = (self.conv_view(lx)?, w.conv_view(lw)?);
        let bias = match bias {
            Some((b, lb)) => {
                self.same(OP, b)?;
                Some(b.f32_view(lb)?)
            }
            None => None,
        };
        let n = g.n * g.out_image();
        let mut params = conv_params(OP, n, g)?;
        params.push(u32::from(bias.is_some()));
        // Without a bias the weight stands in for its binding (never read).
        let b = bias.as_ref().unwrap_or(&w);
        let src = shaders::conv2d(tx, tw);
        self.f32_kernel(OP, &src, &params, &[&*x.block, &*w.block, &*b.block], n, n)?
            .f32_into(out)
    }

    fn conv2d_backward_input(
        &self,
        ldy: &Layout,
        w: &Self,
        lw: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "conv2d_backward_input";
        self.same(OP, w)?;
        self.check_dtype(OP, out)?;
        let ((dy, tdy), (w, tw)) = (self.conv_view(ldy)?, w.conv_view(lw)?);
        let n = g.n * g.in_image();
        let params = conv_params(OP, n, g)?;
        let src = shaders::conv2d_backward_input(tdy, tw);
        self.f32_kernel(OP, &src, &params, &[&*dy.block, &*w.block], n, n)?
            .f32_into(out)
    }

    fn conv2d_backward_weight(
        &self,
        lx: &Layout,
        dy: &Self,
        ldy: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "conv2d_backward_weight";
        self.same(OP, dy)?;
        self.check_dtype(OP, out)?;
        let ((x, tx), (dy, tdy)) = (self.conv_view(lx)?, dy.conv_view(ldy)?);
        let n = g.weight_len();
        let params = conv_params(OP, n, g)?;
        let src = shaders::conv2d_backward_weight(tx, tdy);
        self.f32_kernel(OP, &src, &params, &[&*x.block, &*dy.block], n, n)?
            .f32_into(out)
    }

    fn max_pool2d(
        &self,
        l: &Layout,
        g: &Pool2dGeom,
        with_indices: bool,
    ) -> Result<MaxPool2d<Self>> {
        const OP: &str = "max_pool2d";
        self.check_dtype(OP, self.dtype)?;
        let x = self.f32_view(l)?;
        let n = g.planes * g.out_plane();
        let ctx = self.ctx();
        // The argmax: a word per output (u32 positions, plane included).
        let arg = ctx.alloc(n.max(1) * 4)?;
        let indices = Self::empty(ctx, DType::I64, if with_indices { n } else { 0 })?;
        let mut params = pool_params(OP, n, g)?;
        params.push(u32::from(with_indices));
        let src = shaders::max_pool2d();
        let y = self.f32_kernel(OP, &src, &params, &[&*x.block, &arg, &*indices.block], n, n)?;
        Ok(MaxPool2d {
            out: y.f32_into(self.dtype)?,
            argmax: Indices::new(Argmax(Arc::new(arg))),
            indices: with_indices.then_some(indices),
        })
    }

    fn max_pool2d_backward(
        &self,
        ldy: &Layout,
        argmax: &Indices,
        g: &Pool2dGeom,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "max_pool2d_backward";
        let Argmax(arg) = argmax
            .get()
            .ok_or_else(|| Error::arg(OP, "indices of another backend"))?;
        if !Arc::ptr_eq(arg.ctx(), self.ctx()) {
            return Err(Error::device(
                OP,
                format!(
                    "indices on {} and {}",
                    arg.ctx().device(),
                    self.ctx().device()
                ),
            ));
        }
        self.check_dtype(OP, out)?;
        let dy = self.f32_view(ldy)?;
        let n = g.planes * g.in_plane();
        let params = pool_params(OP, n, g)?;
        let src = shaders::max_pool2d_backward();
        self.f32_kernel(OP, &src, &params, &[&*dy.block, &**arg], n, n)?
            .f32_into(out)
    }
}

/// What `max_pool2d` keeps for its backward: a word per output, the flat input position
/// (plane included) of its maximum, on the device.
struct Argmax(Arc<Block>);

/// The convolution kernels' parameters: `n` threads, then `g` (`shaders::CONV_GEOM`).
fn conv_params(op: &'static str, n: usize, g: &Conv2dGeom) -> Result<Vec<u32>> {
    [
        n,
        g.n,
        g.c_in,
        g.h,
        g.w,
        g.c_out,
        g.kh,
        g.kw,
        g.stride.0,
        g.stride.1,
        g.padding.0,
        g.padding.1,
        g.dilation.0,
        g.dilation.1,
        g.groups,
        g.h_out,
        g.w_out,
    ]
    .into_iter()
    .map(|v| word(op, v))
    .collect()
}

/// The pooling kernels' parameters: `n` threads, then `g` (`shaders::POOL_GEOM`).
fn pool_params(op: &'static str, n: usize, g: &Pool2dGeom) -> Result<Vec<u32>> {
    [
        n,
        g.h,
        g.w,
        g.kernel.0,
        g.kernel.1,
        g.stride.0,
        g.stride.1,
        g.padding.0,
        g.padding.1,
        g.h_out,
        g.w_out,
    ]
    .into_iter()
    .map(|v| word(op, v))
    .collect()
}

impl IndexOps for GpuStorage {
    fn index_select(&self, l: &Layout, ids: &Self, lids: &Layout, d: AlongDim) -> Result<Self> {
        const OP: &str = "index_select";
        self.same(OP, ids)?;
        if !in_shaders(self.dtype) {
            // F64 and I64 tables: the CPU's gather on the host.
            let (h, hi) = (self.download(l)?, ids.download(lids)?);
            let r = h.index_select(
                &Layout::contiguous(l.shape()),
                &hi,
                &Layout::contiguous(lids.shape()),
                d,
            )?;
            return Self::upload_to(self.ctx(), &r);
        }
        let src = self.f32_view(l)?;
        let (ids, at) = ids.id_words(OP, lids)?;
        let nids = lids.numel();
        let n = d.outer * nids * d.inner;
        let params = [
            word(OP, n)?,
            word(OP, d.size)?,
            word(OP, d.inner.max(1))?,
            word(OP, nids.max(1))?,
            at,
        ];
        let k = shaders::index_select();
        self.f32_kernel(OP, &k, &params, &[&*src.block, &*ids.block], n, n)?
            .f32_into(self.dtype)
    }

    fn index_add_zeros(
        &self,
        l: &Layout,
        ids: &Self,
        lids: &Layout,
        d: AlongDim,
        out: DType,
    ) -> Result<Self> {
        const OP: &str = "index_add_zeros";
        self.same(OP, ids)?;
        self.check_dtype(OP, out)?;
        let g = self.f32_view(l)?;
        let (ids, at) = ids.id_words(OP, lids)?;
        let nids = lids.numel();
        let n = d.outer * d.size * d.inner;
        let params = [
            word(OP, n)?,
            word(OP, d.size.max(1))?,
            word(OP, d.inner.max(1))?,
            word(OP, nids)?,
            at,
        ];
        let k = shaders::index_add_zeros();
        self.f32_kernel(OP, &k, &params, &[&*g.block, &*ids.block], n, n)?
            .f32_into(out)
    }

    fn cat(parts: &[(&Self, &Layout)], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        const OP: &str = "cat";
        let Some((first, _)) = parts.first() else {
            return Err(Error::arg(OP, "needs at least one tensor"));
        };
        for (p, _) in parts {
            first.same(OP, p)?;
        }
        let dtype = first.dtype;
        if !in_shaders(dtype) {
            let hosts = parts
                .iter()
                .map(|(p, l)| Ok((p.download(l)?, Layout::contiguous(l.shape()))))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<(&CpuStorage, &Layout)> = hosts.iter().map(|(h, l)| (h, l)).collect();
            return Self::upload_to(first.ctx(), &CpuStorage::cat(&refs, outer, lens, inner)?);
        }
        let total: usize = lens.iter().sum();
        let ctx = first.ctx();
        let dst = Self::empty(ctx, DType::F32, outer * total * inner)?;
        let src = shaders::cat_part();
        let mut start = 0;
        for ((p, l), &len) in parts.iter().zip(lens) {
            let part = p.f32_view(l)?;
            let n = outer * len * inner;
            let params = [
                word(OP, n)?,
                word(OP, len.max(1))?,
                word(OP, inner.max(1))?,
                word(OP, total)?,
                word(OP, start)?,
            ];
            ctx.launch(OP, &src, &params, &dst.block, &[&*part.block], groups_1d(n))?;
            start += len;
        }
        dst.f32_into(dtype)
    }
}

impl LossOps for GpuStorage {}

impl AmpOps for GpuStorage {
    fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Self> {
        const OP: &str = "round_into";
        // The values as F32 first (an F64 source rounds here, as the CPU's `as f32`).
        let x = self.f32_view(layout)?;
        let all = Layout::contiguous(&[x.len]);
        match (dtype, rounding) {
            (DType::I64, _) => Err(Error::dtype(OP, dtype, "rounds into float dtypes only")),
            (DType::F32 | DType::F64, _) | (_, Rounding::NearestEven) => x.cast(&all, dtype),
            (_, Rounding::Stochastic) => {
                // The CPU's draws in the CPU's order, made on the host: one 64-bit draw per
                // F16 element, one per four BF16 elements.
                let n = x.len;
                let (draws, bf16) = match dtype {
                    DType::F16 => (n, 0),
                    _ => (n.div_ceil(4), 1),
                };
                let bytes: Vec<u8> = (0..draws)
                    .flat_map(|_| rng.next_u64().to_le_bytes())
                    .collect();
                let ctx = self.ctx();
                let bits = ctx.upload_bytes(&bytes)?;
                let wide = Self::empty(ctx, DType::F32, n)?;
                ctx.launch(
                    OP,
                    &shaders::stochastic_round(),
                    &[word(OP, n)?, bf16],
                    &wide.block,
                    &[&*x.block, &bits],
                    groups_1d(n),
                )?;
                let dst = Self::empty(ctx, dtype, n)?;
                ctx.launch(
                    OP,
                    &shaders::pack_halves(),
                    &[word(OP, n)?],
                    &dst.block,
                    &[&*wide.block],
                    groups_1d(n.div_ceil(2)),
                )?;
                Ok(dst)
            }
        }
    }
}

impl OptimOps for GpuStorage {}
