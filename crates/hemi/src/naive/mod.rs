//! The naive backend (`Device::Naive`): a slow, plain reference device, as tinygrad's PYTHON
//! device is. Every buffer is a `Vec<f64>` whose values are exactly representable in the
//! buffer's dtype (each write is rounded into it; I64 labels and indices are held as exact
//! integers), and every primitive is a plain scalar loop: no threads, no SIMD, no call into
//! `crate::cpu`'s kernels.
//!
//! It implements only the basic primitives (the list below); everything else is a default
//! composition (`backend/compose.rs`). So it is two things at once:
//!
//! - **a reference**: `tests/ops/naive.rs` runs the op suite and `tests/models/naive.rs` a
//!   few training steps of CifarNet, ResNet and BERT on the CPU and here, and compares them
//!   within the dtype's tolerance;
//! - **the template for a new backend**: copy this folder, replace `Vec<f64>` by the
//!   device's buffer and each loop by a kernel, and the models train (DEVELOPERS.md,
//!   "Adding a backend").
//!
//! The primitives written here, 24 besides `BackendStorage`'s accessors `device`, `dtype`
//! and `len`: `BackendStorage`'s `copy_strided`, `cast`, `download`, `upload`; `MapOps`'
//! `binary`, `minmax_backward`, `unary`, `unary_backward`, `where_cond`, `dropout_mask`;
//! `ReduceOps`' `reduce`, `extreme_backward`, `extreme_dim`, `extreme_dim_backward`;
//! `NnOps`' `matmul`, `conv2d`, `conv2d_backward_input`, `conv2d_backward_weight`,
//! `max_pool2d`, `max_pool2d_backward`; `IndexOps`' `index_select`, `index_add_zeros`,
//! `cat`; `AmpOps`' `round_into`.
//!
//! Arithmetic, as each primitive's doc says, read the simplest way:
//!
//! - inputs are read **in the compute type** (`DType::compute_type` of the output: F32, or
//!   F64 for F64), which only changes an F64 input of an F32 computation;
//! - **elementwise maps** evaluate the op table's f64 definition (`UnaryOp::reference`,
//!   `derivative`, `BinaryOp::reference`) on those values, with the op's scalars rounded
//!   into the compute type as a kernel receives them, and round the result into the compute
//!   type and then into the output dtype (for `+ - * /` and `sqrt` of F32 values this is
//!   exactly the F32 operation; for `exp`, `tanh`, ... it is the correctly rounded value,
//!   within an ulp of any F32 library's);
//! - **sums and products** (reductions, matmul, convolutions, scatter-adds) accumulate in f64
//!   and round once into the output dtype;
//! - **copies** (`copy_strided`, gathers, `cat`, max-pool) move values unchanged.
//!
//! Dropout draws the same seed and decides each element with the same counter-based hash as
//! the CPU (`rng::keep53`), and stochastic rounding draws the same bits in the same order, so
//! both are bit-identical to the CPU's.

mod map;
mod nn;

use half::{bf16, f16};

use crate::backend::index::{AlongDim, IndexOps};
use crate::backend::train::AmpOps;
use crate::backend::BackendStorage;
use crate::cpu::storage::CpuStorage;
use crate::device::Device;
use crate::dtype::convert::{self, stochastic_round_bf16, stochastic_round_f16, Rounding};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Layout;

/// The naive backend implements every primitive: the basic ones here, the rest by their
/// default bodies (a compile-time check).
const _: fn() = || {
    fn is_backend<B: crate::backend::Backend>() {}
    is_backend::<NaiveStorage>();
};

/// A buffer of the naive backend: `dtype` and the elements as f64, each exactly
/// representable in `dtype` (floats rounded into it on every write, I64 values held as
/// exact integers).
#[derive(Clone, Debug, PartialEq)]
pub struct NaiveStorage {
    dtype: DType,
    data: Vec<f64>,
}

impl NaiveStorage {
    /// An empty buffer of `dtype`: a receiver for `upload` (how the host reaches this
    /// device).
    pub fn empty(dtype: DType) -> NaiveStorage {
        NaiveStorage {
            dtype,
            data: Vec::new(),
        }
    }

    /// `values` rounded into `dtype`, one rounding each.
    pub fn from_f64(values: Vec<f64>, dtype: DType) -> NaiveStorage {
        NaiveStorage {
            dtype,
            data: values.into_iter().map(|x| round(x, dtype)).collect(),
        }
    }

    /// The elements, as f64 (exact).
    pub fn values(&self) -> &[f64] {
        &self.data
    }

    /// The values `layout` addresses, row-major, unchanged.
    fn read(&self, layout: &Layout) -> Vec<f64> {
        offsets(layout).into_iter().map(|i| self.data[i]).collect()
    }

    /// The values `layout` addresses, row-major, read in the compute type `c` (rounded to
    /// F32 unless `c` is F64).
    fn read_in(&self, layout: &Layout, c: DType) -> Vec<f64> {
        offsets(layout)
            .into_iter()
            .map(|i| round(self.data[i], c))
            .collect()
    }

    /// Values that are already exact in `dtype` (copies, extrema, gathers).
    fn exact(values: Vec<f64>, dtype: DType) -> NaiveStorage {
        NaiveStorage {
            dtype,
            data: values,
        }
    }

    /// The result of an elementwise map computed in f64: rounded into the compute type of
    /// `out`, then into `out`.
    fn mapped(values: Vec<f64>, out: DType) -> NaiveStorage {
        let c = out.compute_type();
        NaiveStorage::from_f64(values.into_iter().map(|x| round(x, c)).collect(), out)
    }
}

/// `x` rounded into `dtype` once: nearest-even, overflow to ±inf, NaN kept; into I64 by
/// truncation toward zero (saturating, NaN to 0, as Rust's `as`).
pub fn round(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F32 => f64::from(x as f32),
        DType::F16 => {
            let mut out = [f16::ZERO];
            convert::f64_to_f16(&[x], &mut out);
            out[0].to_f64()
        }
        DType::BF16 => {
            let mut out = [bf16::ZERO];
            convert::f64_to_bf16(&[x], &mut out);
            out[0].to_f64()
        }
        DType::I64 => x as i64 as f64,
    }
}

/// The buffer positions of the elements `layout` addresses, in row-major order (an odometer
/// over the shape).
fn offsets(layout: &Layout) -> Vec<usize> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let n = layout.numel();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx = vec![0usize; shape.len()];
    let mut pos = layout.offset();
    for _ in 0..n {
        out.push(pos);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            pos += strides[d];
            if idx[d] < shape[d] {
                break;
            }
            pos -= strides[d] * shape[d];
            idx[d] = 0;
        }
    }
    out
}

impl BackendStorage for NaiveStorage {
    fn device(&self) -> Device {
        Device::Naive
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn len(&self) -> usize {
        self.data.len()
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        Ok(NaiveStorage::exact(self.read(layout), self.dtype))
    }

    fn cast(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        Ok(NaiveStorage::from_f64(self.read(layout), dtype))
    }

    fn download(&self, layout: &Layout) -> Result<CpuStorage> {
        // Every value is exact in the dtype, so this conversion rounds nothing.
        Ok(CpuStorage::from_f64(self.read(layout), self.dtype))
    }

    fn upload(&self, host: &CpuStorage) -> Result<Self> {
        let all = Layout::contiguous(&[host.len()]);
        Ok(NaiveStorage::exact(
            host.to_f64(&all).into_owned(),
            host.dtype(),
        ))
    }
}

impl IndexOps for NaiveStorage {
    fn index_select(&self, l: &Layout, ids: &Self, lids: &Layout, d: AlongDim) -> Result<Self> {
        let (src, ids) = (self.read(l), ids.read(lids));
        let mut out = Vec::with_capacity(d.outer * ids.len() * d.inner);
        for o in 0..d.outer {
            for &id in &ids {
                let row = (o * d.size + id as usize) * d.inner;
                out.extend_from_slice(&src[row..row + d.inner]);
            }
        }
        Ok(NaiveStorage::exact(out, self.dtype))
    }

    fn index_add_zeros(
        &self,
        l: &Layout,
        ids: &Self,
        lids: &Layout,
        d: AlongDim,
        out: DType,
    ) -> Result<Self> {
        let (g, ids) = (self.read_in(l, out.compute_type()), ids.read(lids));
        let mut acc = vec![0.0; d.outer * d.size * d.inner];
        for o in 0..d.outer {
            for (j, &id) in ids.iter().enumerate() {
                let (to, from) = (
                    (o * d.size + id as usize) * d.inner,
                    (o * ids.len() + j) * d.inner,
                );
                for i in 0..d.inner {
                    acc[to + i] += g[from + i];
                }
            }
        }
        Ok(NaiveStorage::from_f64(acc, out))
    }

    fn cat(parts: &[(&Self, &Layout)], outer: usize, lens: &[usize], inner: usize) -> Result<Self> {
        let dtype = parts.first().map_or(DType::F32, |(s, _)| s.dtype);
        let srcs: Vec<Vec<f64>> = parts.iter().map(|(s, l)| s.read(l)).collect();
        let mut out = Vec::with_capacity(outer * lens.iter().sum::<usize>() * inner);
        for o in 0..outer {
            for (src, &len) in srcs.iter().zip(lens) {
                out.extend_from_slice(&src[o * len * inner..(o + 1) * len * inner]);
            }
        }
        Ok(NaiveStorage::exact(out, dtype))
    }
}

impl AmpOps for NaiveStorage {
    fn round_into(
        &self,
        layout: &Layout,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Self> {
        let values: Vec<f32> = self.read(layout).into_iter().map(|x| x as f32).collect();
        let out: Vec<f64> = match (dtype, rounding) {
            (DType::I64, _) => {
                return Err(Error::dtype(
                    "round_into",
                    dtype,
                    "rounds into float dtypes only",
                ))
            }
            (DType::F32 | DType::F64, _) | (_, Rounding::NearestEven) => {
                values.iter().map(|&x| round(f64::from(x), dtype)).collect()
            }
            // One 64-bit draw per element.
            (DType::F16, Rounding::Stochastic) => values
                .iter()
                .map(|&x| stochastic_round_f16(x, rng.next_u64()).to_f64())
                .collect(),
            // One 64-bit draw per four elements, 16 bits each, lowest first.
            (DType::BF16, Rounding::Stochastic) => {
                let mut out = Vec::with_capacity(values.len());
                for chunk in values.chunks(4) {
                    let mut bits = rng.next_u64();
                    for &x in chunk {
                        out.push(stochastic_round_bf16(x, bits as u16).to_f64());
                        bits >>= 16;
                    }
                }
                out
            }
        };
        Ok(NaiveStorage::exact(out, dtype))
    }
}
