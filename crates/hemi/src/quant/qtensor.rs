//! Quantised tensors: 8-bit integers with their scale and zero point.

use crate::cpu::qgemm::quant as k;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The integer type of a quantised tensor (PyTorch's `torch.qint8` / `torch.quint8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QDType {
    /// Signed, -128..=127 (weights).
    I8,
    /// Unsigned, 0..=255 (activations).
    U8,
}

impl QDType {
    /// `(qmin, qmax)`.
    pub fn range(self) -> (i32, i32) {
        match self {
            QDType::I8 => (-128, 127),
            QDType::U8 => (0, 255),
        }
    }
}

/// How values map to integers: `x ≈ (q - zero_point) · scale`.
#[derive(Clone, Debug, PartialEq)]
pub enum QScheme {
    /// One scale and zero point for the whole tensor.
    PerTensor {
        /// Step between neighbouring integers.
        scale: f32,
        /// The integer that stands for 0.0.
        zero_point: i32,
    },
    /// One scale and zero point per index of `axis` (per output channel for weights).
    PerChannel {
        /// The channel dimension.
        axis: usize,
        /// Per channel.
        scales: Vec<f32>,
        /// Per channel.
        zero_points: Vec<i32>,
    },
}

/// The integers of a quantised tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum QData {
    /// Signed.
    I8(Vec<i8>),
    /// Unsigned.
    U8(Vec<u8>),
}

/// A quantised tensor: host (CPU) integers, contiguous, row-major, with their scheme. Kept
/// apart from the float `Tensor` (see DESIGN.md, Quantisation).
#[derive(Clone, Debug, PartialEq)]
pub struct QTensor {
    shape: Vec<usize>,
    data: QData,
    scheme: QScheme,
}

fn host_f32(x: &Tensor, op: &'static str) -> Result<Vec<f32>> {
    if x.device() != Device::Cpu {
        return Err(Error::device(
            op,
            format!(
                "quantisation runs on the CPU; the tensor is on {}",
                x.device()
            ),
        ));
    }
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "quantises float tensors"));
    }
    x.try_to_vec_f32()
}

fn check_scale(op: &'static str, scale: f32, zero_point: i32, dt: QDType) -> Result<()> {
    let (lo, hi) = dt.range();
    if !(scale.is_finite() && scale > 0.0) {
        return Err(Error::arg(
            op,
            format!("scale must be finite and > 0, got {scale}"),
        ));
    }
    if zero_point < lo || zero_point > hi {
        return Err(Error::arg(
            op,
            format!("zero point {zero_point} outside {lo}..={hi}"),
        ));
    }
    Ok(())
}

impl QTensor {
    /// `torch.quantize_per_tensor(x, scale, zero_point, dtype)`: `q = clamp(zero_point +
    /// round_ties_even(x · (1/scale)), qmin, qmax)`.
    pub fn quantize_per_tensor(
        x: &Tensor,
        scale: f32,
        zero_point: i32,
        dtype: QDType,
    ) -> Result<QTensor> {
        const OP: &str = "quantize_per_tensor";
        check_scale(OP, scale, zero_point, dtype)?;
        let v = host_f32(x, OP)?;
        let data = match dtype {
            QDType::I8 => {
                let mut q = vec![0i8; v.len()];
                k::quantize_i8(&v, scale, zero_point, &mut q);
                QData::I8(q)
            }
            QDType::U8 => {
                let mut q = vec![0u8; v.len()];
                k::quantize_u8(&v, scale, zero_point, &mut q);
                QData::U8(q)
            }
        };
        Ok(QTensor {
            shape: x.shape().to_vec(),
            data,
            scheme: QScheme::PerTensor { scale, zero_point },
        })
    }

    /// `torch.quantize_per_channel(x, scales, zero_points, axis, dtype)`.
    pub fn quantize_per_channel(
        x: &Tensor,
        scales: &[f32],
        zero_points: &[i32],
        axis: usize,
        dtype: QDType,
    ) -> Result<QTensor> {
        const OP: &str = "quantize_per_channel";
        let shape = x.shape().to_vec();
        if axis >= shape.len() || shape[axis] != scales.len() || scales.len() != zero_points.len() {
            return Err(Error::shape(
                OP,
                format!(
                    "{} scales and {} zero points for axis {axis} of {shape:?}",
                    scales.len(),
                    zero_points.len()
                ),
            ));
        }
        for (&s, &z) in scales.iter().zip(zero_points) {
            check_scale(OP, s, z, dtype)?;
        }
        let v = host_f32(x, OP)?;
        let inner: usize = shape[axis + 1..].iter().product();
        let (qmin, qmax) = dtype.range();
        let q: Vec<i32> = v
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let c = (i / inner.max(1)) % scales.len();
                k::quantize_one(x, 1.0 / scales[c], zero_points[c], qmin, qmax)
            })
            .collect();
        let data = match dtype {
            QDType::I8 => QData::I8(q.into_iter().map(|x| x as i8).collect()),
            QDType::U8 => QData::U8(q.into_iter().map(|x| x as u8).collect()),
        };
        Ok(QTensor {
            shape,
            data,
            scheme: QScheme::PerChannel {
                axis,
                scales: scales.to_vec(),
                zero_points: zero_points.to_vec(),
            },
        })
    }

    /// A weight `[out, ...]` as symmetric signed 8-bit per output channel (axis 0), the
    /// scales from each channel's range (PyTorch's `PerChannelMinMaxObserver` with
    /// `per_channel_symmetric`, qint8: `scale = max|w| / 127.5`).
    pub fn quantize_weight(w: &Tensor) -> Result<QTensor> {
        let shape = w.shape();
        if shape.is_empty() || shape[0] == 0 {
            return Err(Error::shape(
                "quantize_weight",
                format!("weight of shape {shape:?}"),
            ));
        }
        let v = host_f32(w, "quantize_weight")?;
        let per = v.len() / shape[0];
        let scales: Vec<f32> = v
            .chunks(per.max(1))
            .map(|c| {
                let (lo, hi) = k::min_max(c);
                k::symmetric_scale(lo, hi, -128, 127)
            })
            .collect();
        let zeros = vec![0; scales.len()];
        QTensor::quantize_per_channel(w, &scales, &zeros, 0, QDType::I8)
    }

    /// Builds a quantised tensor from its parts (checked).
    pub fn from_parts(shape: Vec<usize>, data: QData, scheme: QScheme) -> Result<QTensor> {
        let n: usize = shape.iter().product();
        let len = match &data {
            QData::I8(v) => v.len(),
            QData::U8(v) => v.len(),
        };
        if len != n {
            return Err(Error::shape(
                "QTensor",
                format!("{len} values for shape {shape:?}"),
            ));
        }
        if let QScheme::PerChannel {
            axis,
            scales,
            zero_points,
        } = &scheme
        {
            if *axis >= shape.len()
                || shape[*axis] != scales.len()
                || scales.len() != zero_points.len()
            {
                return Err(Error::shape(
                    "QTensor",
                    format!("{} scales for axis {axis} of {shape:?}", scales.len()),
                ));
            }
        }
        Ok(QTensor {
            shape,
            data,
            scheme,
        })
    }

    /// The float values `(q - zero_point) · scale` (`Tensor.dequantize()`), F32.
    pub fn dequantize(&self) -> Result<Tensor> {
        let n = self.numel();
        let mut out = vec![0f32; n];
        match &self.scheme {
            QScheme::PerTensor { scale, zero_point } => match &self.data {
                QData::I8(q) => k::dequantize_i8(q, *scale, *zero_point, &mut out),
                QData::U8(q) => k::dequantize_u8(q, *scale, *zero_point, &mut out),
            },
            QScheme::PerChannel {
                axis,
                scales,
                zero_points,
            } => {
                let inner: usize = self.shape[axis + 1..].iter().product::<usize>().max(1);
                let c = scales.len();
                for (i, chunk) in out.chunks_mut(inner).enumerate() {
                    let ch = i % c;
                    let r = i * inner..(i + 1) * inner;
                    match &self.data {
                        QData::I8(q) => k::dequantize_i8(&q[r], scales[ch], zero_points[ch], chunk),
                        QData::U8(q) => k::dequantize_u8(&q[r], scales[ch], zero_points[ch], chunk),
                    }
                }
            }
        }
        Tensor::from_vec(out, &self.shape)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// The integers.
    pub fn data(&self) -> &QData {
        &self.data
    }
    /// The scheme.
    pub fn scheme(&self) -> &QScheme {
        &self.scheme
    }
    /// The integer type.
    pub fn qdtype(&self) -> QDType {
        match self.data {
            QData::I8(_) => QDType::I8,
            QData::U8(_) => QDType::U8,
        }
    }
    /// The signed integers, when the tensor is I8.
    pub fn as_i8(&self) -> Option<&[i8]> {
        match &self.data {
            QData::I8(v) => Some(v),
            QData::U8(_) => None,
        }
    }
    /// The per-channel scales (one per channel) or the single scale.
    pub fn scales(&self) -> Vec<f32> {
        match &self.scheme {
            QScheme::PerTensor { scale, .. } => vec![*scale],
            QScheme::PerChannel { scales, .. } => scales.clone(),
        }
    }
}
