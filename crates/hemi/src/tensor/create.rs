//! Creating tensors: constants, ranges, data from Rust vectors, seeded random values.

use std::sync::Arc;

use half::{bf16, f16};

use super::layout::checked_numel;
use super::{CpuStorage, Layout, Tensor};
use crate::dtype::{DType, WithDType};
use crate::error::{Error, Result};
use crate::rng::Generator;

fn check_len(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    let n = checked_numel(op, shape)?;
    if n != len {
        return Err(Error::shape(
            op,
            format!("{len} values do not fill shape {shape:?} ({n} elements)"),
        ));
    }
    Ok(())
}

impl Tensor {
    /// A tensor of `shape` holding `data` (row-major) in its own dtype.
    pub fn from_vec<T: WithDType>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        check_len("from_vec", data.len(), shape)?;
        Ok(Tensor::from_contiguous(CpuStorage::from_vec(data), shape))
    }

    /// A tensor of `shape` and `dtype` from f64 values, rounded once into `dtype`.
    pub fn from_f64_vec(data: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        check_len("from_f64_vec", data.len(), shape)?;
        Ok(Tensor::from_contiguous(
            CpuStorage::from_f64(data, dtype),
            shape,
        ))
    }

    /// A tensor of `shape` and `dtype` from f32 values, rounded into `dtype`.
    pub fn from_f32_vec(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        check_len("from_f32_vec", data.len(), shape)?;
        Ok(Tensor::from_contiguous(
            CpuStorage::from_f32(data, dtype),
            shape,
        ))
    }

    /// A zero-dimensional tensor holding `value`.
    pub fn scalar(value: f64, dtype: DType) -> Tensor {
        Tensor::from_contiguous(CpuStorage::from_f64(vec![value], dtype), &[])
    }

    /// Every element `value`.
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let n = checked_numel("full", shape)?;
        let storage = match dtype {
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(value); n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(value); n]),
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::I64 => CpuStorage::I64(vec![value as i64; n]),
        };
        Ok(Tensor::from_contiguous(storage, shape))
    }

    /// A tensor of `shape` filled with 0 (`torch.zeros`); a leaf without gradient.
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype)
    }

    /// A tensor of `shape` filled with 1 (`torch.ones`); a leaf without gradient.
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }

    /// Zeros of this tensor's shape and dtype, on its device (`torch.zeros_like`).
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype())?.to_device(self.device())
    }

    /// Ones of this tensor's shape and dtype, on its device (`torch.ones_like`).
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self.dtype())?.to_device(self.device())
    }

    /// `start, start+step, ...` below `end` (as `torch.arange`), one-dimensional.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::arg(
                "arange",
                format!("start {start}, end {end}, step {step}: need finite values and step != 0"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
        Tensor::from_f64_vec(v, &[n], dtype)
    }

    /// Uniform values in [lo, hi), drawn in f64 from `rng` and rounded into `dtype`.
    pub fn rand(
        shape: &[usize],
        lo: f64,
        hi: f64,
        dtype: DType,
        rng: &mut Generator,
    ) -> Result<Tensor> {
        if lo.partial_cmp(&hi).is_none_or(|o| o.is_gt()) {
            return Err(Error::arg(
                "rand",
                format!("need lo <= hi, got {lo} and {hi}"),
            ));
        }
        let n = checked_numel("rand", shape)?;
        let v: Vec<f64> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
        Tensor::from_f64_vec(v, shape, dtype)
    }

    /// Normal values with `mean` and `std`, drawn in f64 from `rng`.
    pub fn randn(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        rng: &mut Generator,
    ) -> Result<Tensor> {
        if std.is_nan() || std < 0.0 {
            return Err(Error::arg("randn", format!("std must be >= 0, got {std}")));
        }
        let n = checked_numel("randn", shape)?;
        let v: Vec<f64> = (0..n).map(|_| mean + std * rng.normal()).collect();
        Tensor::from_f64_vec(v, shape, dtype)
    }

    /// Integers uniform in [0, high), as I64 (labels, indices).
    pub fn randint(shape: &[usize], high: u64, rng: &mut Generator) -> Result<Tensor> {
        if high == 0 {
            return Err(Error::arg("randint", "high must be > 0"));
        }
        let n = checked_numel("randint", shape)?;
        let v: Vec<i64> = (0..n).map(|_| rng.below(high) as i64).collect();
        Tensor::from_vec(v, shape)
    }

    /// A tensor over a fresh copy of `storage` laid out by `layout` (used by views tests).
    pub fn from_storage_layout(storage: CpuStorage, layout: Layout) -> Result<Tensor> {
        let max = layout
            .shape()
            .iter()
            .zip(layout.strides())
            .map(|(&d, &s)| d.saturating_sub(1) * s)
            .sum::<usize>()
            + layout.offset();
        if layout.numel() > 0 && max >= storage.len() {
            return Err(Error::shape(
                "from_storage_layout",
                format!(
                    "layout {layout:?} reaches past storage of {} elements",
                    storage.len()
                ),
            ));
        }
        Ok(Tensor::from_storage(Arc::new(storage.into()), layout))
    }
}
