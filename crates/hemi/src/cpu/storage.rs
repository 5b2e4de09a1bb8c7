//! The CPU backend's buffer: one typed host vector per dtype, and the bridges between storage
//! dtypes and the compute types (F32, or F64 for F64 tensors) that kernels work in.

use std::borrow::Cow;

use half::{bf16, f16};

use crate::dtype::{convert, same_slice, DType, FloatDType, WithDType};
use crate::tensor::Layout;

/// A flat buffer of elements on the CPU.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// Half precision (IEEE binary16) elements.
    F16(Vec<f16>),
    /// bfloat16 elements.
    BF16(Vec<bf16>),
    /// Single precision elements.
    F32(Vec<f32>),
    /// Double precision elements (references and tests).
    F64(Vec<f64>),
    /// 64-bit integers (labels, token ids, indices).
    I64(Vec<i64>),
}

impl CpuStorage {
    /// A buffer holding `v` (its dtype is `T`'s).
    pub fn from_vec<T: WithDType>(v: Vec<T>) -> CpuStorage {
        let any: Box<dyn std::any::Any> = Box::new(v);
        let wrong = "T::DTYPE names T's own buffer type";
        match T::DTYPE {
            DType::F16 => CpuStorage::F16(*any.downcast().expect(wrong)),
            DType::BF16 => CpuStorage::BF16(*any.downcast().expect(wrong)),
            DType::F32 => CpuStorage::F32(*any.downcast().expect(wrong)),
            DType::F64 => CpuStorage::F64(*any.downcast().expect(wrong)),
            DType::I64 => CpuStorage::I64(*any.downcast().expect(wrong)),
        }
    }

    /// The whole buffer as `[T]`, or `None` when the dtype is not `T`'s.
    pub fn as_slice<T: WithDType>(&self) -> Option<&[T]> {
        match self {
            CpuStorage::F16(v) => same_slice(v),
            CpuStorage::BF16(v) => same_slice(v),
            CpuStorage::F32(v) => same_slice(v),
            CpuStorage::F64(v) => same_slice(v),
            CpuStorage::I64(v) => same_slice(v),
        }
    }

    /// The elements `layout` addresses as `[T]`, row-major: borrowed when contiguous;
    /// `None` when the dtype is not `T`'s.
    pub fn elems<T: WithDType>(&self, layout: &Layout) -> Option<Cow<'_, [T]>> {
        let v = self.as_slice::<T>()?;
        Some(match layout.contiguous_range() {
            Some(r) => Cow::Borrowed(&v[r]),
            None => Cow::Owned(layout.gather(v)),
        })
    }

    /// The elements' little-endian bytes, in buffer order (the safetensors layout).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        fn bytes<T: WithDType>(v: &[T]) -> Vec<u8> {
            let mut out = Vec::with_capacity(v.len() * T::DTYPE.size_in_bytes());
            v.iter().for_each(|x| x.write_le(&mut out));
            out
        }
        crate::with_dtype!(self.dtype(), T => bytes::<T>(self.as_slice().expect("T is the buffer's type")))
    }

    /// A buffer of `dtype` from little-endian bytes; `None` unless the byte count is a
    /// multiple of the element size.
    pub fn from_le_bytes(dtype: DType, b: &[u8]) -> Option<CpuStorage> {
        let size = dtype.size_in_bytes();
        if !b.len().is_multiple_of(size) {
            return None;
        }
        Some(crate::with_dtype!(dtype, T => CpuStorage::from_vec(
            b.chunks_exact(size).map(T::read_le).collect::<Vec<T>>()
        )))
    }

    /// The buffer as `Vec<T>`, or `None` when the dtype is not `T`'s.
    pub fn into_vec<T: WithDType>(self) -> Option<Vec<T>> {
        let any: Box<dyn std::any::Any> = match self {
            CpuStorage::F16(v) => Box::new(v),
            CpuStorage::BF16(v) => Box::new(v),
            CpuStorage::F32(v) => Box::new(v),
            CpuStorage::F64(v) => Box::new(v),
            CpuStorage::I64(v) => Box::new(v),
        };
        any.downcast::<Vec<T>>().ok().map(|b| *b)
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I64(_) => DType::I64,
        }
    }

    /// Number of elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
        }
    }

    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer's size in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }

    /// Copies the elements addressed by `layout` into a new contiguous storage.
    pub fn gather(&self, layout: &Layout) -> CpuStorage {
        match self {
            CpuStorage::F16(v) => CpuStorage::F16(layout.gather(v)),
            CpuStorage::BF16(v) => CpuStorage::BF16(layout.gather(v)),
            CpuStorage::F32(v) => CpuStorage::F32(layout.gather(v)),
            CpuStorage::F64(v) => CpuStorage::F64(layout.gather(v)),
            CpuStorage::I64(v) => CpuStorage::I64(layout.gather(v)),
        }
    }

    /// The elements addressed by `layout` converted to F32 (one bulk conversion).
    pub fn to_f32(&self, layout: &Layout) -> Cow<'_, [f32]> {
        if let CpuStorage::F32(v) = self {
            if let Some(r) = layout.contiguous_range() {
                return Cow::Borrowed(&v[r]);
            }
            return Cow::Owned(layout.gather(v));
        }
        let g = self.gather_cow(layout);
        Cow::Owned(match &*g {
            CpuStorage::F16(v) => convert::f16_to_f32_vec(v),
            CpuStorage::BF16(v) => convert::bf16_to_f32_vec(v),
            CpuStorage::F64(v) => v.iter().map(|&x| x as f32).collect(),
            CpuStorage::I64(v) => v.iter().map(|&x| x as f32).collect(),
            CpuStorage::F32(_) => unreachable!(),
        })
    }

    /// The elements addressed by `layout` converted to F64.
    pub fn to_f64(&self, layout: &Layout) -> Cow<'_, [f64]> {
        if let CpuStorage::F64(v) = self {
            if let Some(r) = layout.contiguous_range() {
                return Cow::Borrowed(&v[r]);
            }
            return Cow::Owned(layout.gather(v));
        }
        let g = self.gather_cow(layout);
        let mut out = vec![0f64; layout.numel()];
        match &*g {
            CpuStorage::F16(v) => convert::f16_to_f64(v, &mut out),
            CpuStorage::BF16(v) => convert::bf16_to_f64(v, &mut out),
            CpuStorage::F32(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = f64::from(*x)),
            CpuStorage::I64(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = *x as f64),
            CpuStorage::F64(_) => unreachable!(),
        }
        Cow::Owned(out)
    }

    /// The elements addressed by `layout` as i64 (floats truncate toward zero).
    pub fn to_i64(&self, layout: &Layout) -> Cow<'_, [i64]> {
        match self {
            CpuStorage::I64(v) => match layout.contiguous_range() {
                Some(r) => Cow::Borrowed(&v[r]),
                None => Cow::Owned(layout.gather(v)),
            },
            _ => Cow::Owned(self.to_f64(layout).iter().map(|&x| x as i64).collect()),
        }
    }

    fn gather_cow(&self, layout: &Layout) -> Cow<'_, CpuStorage> {
        match layout.contiguous_range() {
            Some(r) if r.start == 0 && r.end == self.len() => Cow::Borrowed(self),
            _ => Cow::Owned(self.gather(layout)),
        }
    }

    /// Rounds F32 values into a storage of `dtype` (one bulk conversion, nearest-even).
    pub fn from_f32(v: Vec<f32>, dtype: DType) -> CpuStorage {
        match dtype {
            DType::F32 => CpuStorage::F32(v),
            DType::F16 | DType::BF16 => CpuStorage::from_f32_slice(&v, dtype),
            DType::F64 => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
            DType::I64 => CpuStorage::I64(v.into_iter().map(|x| x as i64).collect()),
        }
    }

    /// `from_f32` of borrowed values, for the half dtypes (others copy, then `from_f32`).
    fn from_f32_slice(v: &[f32], dtype: DType) -> CpuStorage {
        match dtype {
            DType::F16 => CpuStorage::F16(convert::f32_to_f16_vec(v)),
            DType::BF16 => CpuStorage::BF16(convert::f32_to_bf16_vec(v)),
            _ => CpuStorage::from_f32(v.to_vec(), dtype),
        }
    }

    /// Rounds F64 values into a storage of `dtype` (a single rounding).
    pub fn from_f64(v: Vec<f64>, dtype: DType) -> CpuStorage {
        match dtype {
            DType::F64 => CpuStorage::F64(v),
            DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
            DType::F16 => {
                let mut out = vec![f16::ZERO; v.len()];
                convert::f64_to_f16(&v, &mut out);
                CpuStorage::F16(out)
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; v.len()];
                convert::f64_to_bf16(&v, &mut out);
                CpuStorage::BF16(out)
            }
            DType::I64 => CpuStorage::I64(v.into_iter().map(|x| x as i64).collect()),
        }
    }

    /// Converts the addressed elements to `dtype` (contiguous result).
    pub fn cast(&self, layout: &Layout, dtype: DType) -> CpuStorage {
        if dtype == self.dtype() {
            return self.gather(layout);
        }
        match (self, dtype) {
            (CpuStorage::I64(_), _)
            | (_, DType::I64)
            | (CpuStorage::F64(_), _)
            | (_, DType::F64) => CpuStorage::from_f64(self.to_f64(layout).into_owned(), dtype),
            // Converted straight from the source where it is contiguous F32 (autocast casts
            // every weight each forward; a copy first was 1 % of a BERT amp-bf16 step).
            _ => match self.to_f32(layout) {
                Cow::Borrowed(v) => CpuStorage::from_f32_slice(v, dtype),
                v => CpuStorage::from_f32(v.into_owned(), dtype),
            },
        }
    }
}

impl CpuStorage {
    /// The addressed elements converted to the compute type `C` (borrowed when already
    /// contiguous in `C`).
    pub fn load<C: FloatDType>(&self, layout: &Layout) -> Cow<'_, [C]> {
        match C::DTYPE {
            DType::F64 => cow_same(self.to_f64(layout)),
            _ => cow_same(self.to_f32(layout)),
        }
    }

    /// Rounds compute-type values into a buffer of `dtype` (one rounding, nearest-even).
    pub fn store<C: FloatDType>(v: Vec<C>, dtype: DType) -> CpuStorage {
        match CpuStorage::from_vec(v) {
            CpuStorage::F32(v) => CpuStorage::from_f32(v, dtype),
            CpuStorage::F64(v) => CpuStorage::from_f64(v, dtype),
            _ => unreachable!("compute types are f32 and f64"),
        }
    }
}

/// A `Cow<[A]>` as `Cow<[B]>` when `A` and `B` are the same type (checked by the callers'
/// dispatch on `DTYPE`).
fn cow_same<A: WithDType, B: WithDType>(c: Cow<'_, [A]>) -> Cow<'_, [B]> {
    match c {
        Cow::Borrowed(s) => Cow::Borrowed(same_slice(s).expect("same compute type")),
        Cow::Owned(v) => Cow::Owned(
            CpuStorage::from_vec(v)
                .into_vec()
                .expect("same compute type"),
        ),
    }
}

/// Runs `$body` with the type alias `$C` bound to the compute type of `$dtype`
/// (`f64` for F64, `f32` otherwise).
#[macro_export]
macro_rules! with_compute {
    ($dtype:expr, $C:ident => $body:expr) => {
        if $dtype == $crate::dtype::DType::F64 {
            type $C = f64;
            $body
        } else {
            type $C = f32;
            $body
        }
    };
}
