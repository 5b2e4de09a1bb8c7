//! The forward hooks `quant` installs on `Linear` and `Conv2d`: INT8 inference (dynamic
//! and static), calibration observers, and fake quantisation for QAT.

use std::sync::Mutex;

use crate::cpu::chunked::{chunk, for_each_chunk3_init};

use super::observer::{Observer, ObserverKind};
use super::qtensor::QTensor;
use crate::backend::nn::Conv2dGeom;
use crate::cpu::qgemm::epilogue::{Act, Epilogue};
use crate::cpu::qgemm::pack::PackedB;
use crate::cpu::qgemm::qgemm;
use crate::cpu::qgemm::quant as k;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::{ForwardHook, LayerRef};
use crate::ops::conv::Conv2dOptions;
use crate::tensor::Tensor;

/// The geometry of a quantised layer.
#[derive(Clone, Debug)]
pub enum Geometry {
    /// `Linear`: `[.., in] -> [.., out]`.
    Linear,
    /// `Conv2d` (groups 1): weight `[out, in, kh, kw]`.
    Conv {
        /// Stride, padding, dilation.
        opts: Conv2dOptions,
    },
}

impl Geometry {
    /// A layer's geometry; grouped convolutions are an error (not quantised).
    pub fn of(layer: LayerRef<'_>) -> Result<Geometry> {
        match layer {
            LayerRef::Linear(_) => Ok(Geometry::Linear),
            LayerRef::Conv2d(c) if c.opts.groups != 1 => Err(Error::arg(
                "quantize",
                format!(
                    "grouped convolutions (groups {}) are not quantised",
                    c.opts.groups
                ),
            )),
            LayerRef::Conv2d(c) => Ok(Geometry::Conv { opts: c.opts }),
        }
    }
}

/// The INT8 weights of a layer: the quantised tensor (what is saved) and its packed form.
#[derive(Clone, Debug)]
pub struct QWeights {
    /// `[out, in(, kh, kw)]` s8, per output channel symmetric.
    pub weight: QTensor,
    /// F32 bias.
    pub bias: Option<Vec<f32>>,
    packed: PackedB,
    scales: Vec<f32>,
    geometry: Geometry,
}

impl QWeights {
    /// Quantises a layer's current float weights.
    pub fn from_layer(layer: LayerRef<'_>) -> Result<QWeights> {
        let geometry = Geometry::of(layer)?;
        let weight = QTensor::quantize_weight(layer.weight())?;
        let bias = layer.bias().map(|b| b.to_vec_f32());
        QWeights::new(weight, bias, geometry)
    }

    /// From saved parts.
    pub fn new(weight: QTensor, bias: Option<Vec<f32>>, geometry: Geometry) -> Result<QWeights> {
        let n = weight.shape()[0];
        let kk = weight.numel() / n.max(1);
        let q = weight
            .as_i8()
            .ok_or_else(|| Error::arg("quantize", "weights must be signed 8-bit"))?;
        if bias.as_ref().is_some_and(|b| b.len() != n) {
            return Err(Error::shape(
                "quantize",
                "bias length differs from the output channels",
            ));
        }
        let scales = weight.scales();
        if scales.len() != n {
            return Err(Error::arg(
                "quantize",
                "weights must be quantised per output channel",
            ));
        }
        if let Geometry::Conv { .. } = geometry {
            if weight.shape().len() != 4 {
                return Err(Error::shape(
                    "quantize",
                    "a conv weight must be [out, in, kh, kw]",
                ));
            }
        }
        let packed = PackedB::new(q, n, kk)?;
        Ok(QWeights {
            weight,
            bias,
            packed,
            scales,
            geometry,
        })
    }

    /// The layer's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Rows of u8 activations for the GEMM and the output's shape: `[.., in]` rows for
    /// Linear, im2col rows for Conv.
    fn rows(&self, x: &Tensor) -> Result<(RowsPlan, Vec<usize>)> {
        let n = self.packed.n();
        let kk = self.packed.k();
        match &self.geometry {
            Geometry::Linear => {
                let s = x.shape();
                if s.is_empty() || s[s.len() - 1] != kk {
                    return Err(Error::shape(
                        "quantized linear",
                        format!("input {s:?}, expected [.., {kk}]"),
                    ));
                }
                let mut out = s.to_vec();
                *out.last_mut().expect("rank >= 1") = n;
                Ok((RowsPlan::Linear { m: x.numel() / kk }, out))
            }
            Geometry::Conv { opts } => {
                let g = crate::ops::conv::geometry(x.shape(), self.weight.shape(), None, opts)?;
                Ok((RowsPlan::Conv { g }, g.out_shape().to_vec()))
            }
        }
    }

    /// The INT8 product: `x` quantised with `input` (per tensor, static) or per row
    /// (dynamic, `None`), then requantised to `output` (static) or kept F32; `act` after the
    /// bias (GELU only with F32 outputs: a requantised output takes ReLU or nothing).
    fn run(
        &self,
        x: &Tensor,
        input: Option<(f32, i32)>,
        output: Option<(f32, i32)>,
        act: Act,
    ) -> Result<Tensor> {
        check_host(x, "quantized layer")?;
        // The input's own F32 elements where it is contiguous F32 (no copy).
        let storage = x.storage();
        let host = storage.to_cpu()?;
        let v = host.to_f32(x.layout());
        let relu = act == Act::Relu;
        let (plan, out_shape) = self.rows(x)?;
        let kk = self.packed.k();
        let n = self.packed.n();
        // Quantise the activations: per row (dynamic) or per tensor (static).
        let (a, m, a_scale, a_zero) = match plan {
            RowsPlan::Linear { m } => {
                let mut q = vec![0u8; m * kk];
                let mut sc = vec![0f32; m];
                let mut zp = vec![0i32; m];
                let rows = ((&mut q[..], kk.max(1)), (&mut sc[..], 1), (&mut zp[..], 1));
                for_each_chunk3_init(rows.0, rows.1, rows.2, 64, || (), &|_, i, q, s, z| {
                    let x = chunk(&v, i, kk.max(1));
                    let (s, z) = (&mut s[0], &mut z[0]);
                    let (sv, zv) = input.unwrap_or_else(|| {
                        let (lo, hi) = k::min_max(x);
                        k::affine_qparams(lo, hi, 0, 255)
                    });
                    k::quantize_u8(x, sv, zv, q);
                    *s = sv;
                    *z = zv;
                });
                (q, m, sc, zp)
            }
            RowsPlan::Conv { g } => {
                let (sv, zv) = match input {
                    Some(q) => q,
                    None => {
                        let (lo, hi) = k::min_max(&v);
                        k::affine_qparams(lo, hi, 0, 255)
                    }
                };
                let mut qx = vec![0u8; v.len()];
                k::quantize_u8(&v, sv, zv, &mut qx);
                let m = g.n * g.l();
                let mut cols = vec![0u8; m * kk];
                k::im2col_rows(&qx, zv as u8, &g, &mut cols);
                (cols, m, vec![sv; m], vec![zv; m])
            }
        };
        let mut y = vec![0f32; m * n];
        match output {
            None => qgemm(
                &a,
                m,
                kk,
                &self.packed,
                Epilogue::F32 {
                    a_scale: &a_scale,
                    a_zero: &a_zero,
                    w_scale: &self.scales,
                    bias: self.bias.as_deref(),
                    act,
                    out: &mut y,
                },
            )?,
            Some((os, oz)) => {
                if !matches!(act, Act::None | Act::Relu) {
                    return Err(Error::arg(
                        "quantized layer",
                        format!("{act:?} after a requantised output"),
                    ));
                }
                let mut q = vec![0u8; m * n];
                qgemm(
                    &a,
                    m,
                    kk,
                    &self.packed,
                    Epilogue::U8 {
                        a_scale: &a_scale,
                        a_zero: &a_zero,
                        w_scale: &self.scales,
                        bias: self.bias.as_deref(),
                        relu,
                        out_scale: os,
                        out_zero: oz,
                        out: &mut q,
                    },
                )?;
                k::dequantize_u8(&q, os, oz, &mut y);
            }
        }
        if let RowsPlan::Conv { g } = plan {
            let mut nchw = vec![0f32; y.len()];
            k::pixels_to_nchw(&y, g.n, g.l(), n, &mut nchw);
            y = nchw;
        }
        Tensor::from_vec(y, &out_shape)
    }
}

#[derive(Clone, Copy)]
enum RowsPlan {
    Linear { m: usize },
    Conv { g: Conv2dGeom },
}

fn host_values(x: &Tensor, op: &'static str) -> Result<Vec<f32>> {
    check_host(x, op)?;
    x.try_to_vec_f32()
}

/// INT8 layers take float tensors in host memory.
fn check_host(x: &Tensor, op: &'static str) -> Result<()> {
    if x.device() != Device::Cpu {
        return Err(Error::device(
            op,
            format!("INT8 layers run on the CPU; input on {}", x.device()),
        ));
    }
    if !x.dtype().is_float() {
        return Err(Error::dtype(op, x.dtype(), "takes float inputs"));
    }
    Ok(())
}

/// The ReLU flag of a hook call as an epilogue activation.
fn relu_act(relu: bool) -> Act {
    if relu {
        Act::Relu
    } else {
        Act::None
    }
}

/// Dynamic quantisation (`torch.ao.quantization.quantize_dynamic`): INT8 weights, the
/// activations quantised per row at run time from their own range, F32 outputs.
pub struct DynamicHook {
    /// The INT8 weights.
    pub weights: QWeights,
}

impl ForwardHook for DynamicHook {
    fn forward(&self, _layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor> {
        self.weights.run(x, None, None, relu_act(relu))
    }
    /// GELU in the GEMM's epilogue, on each tile while it is in cache.
    fn forward_gelu(&self, _layer: LayerRef<'_>, x: &Tensor, tanh: bool) -> Result<Tensor> {
        let act = if tanh { Act::GeluTanh } else { Act::Gelu };
        self.weights.run(x, None, None, act)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Static quantisation: input and output scales fixed by calibration; the layer computes
/// u8 → INT8 GEMM → bias, ReLU and requantisation to u8 in one epilogue. Between layers
/// the u8 outputs travel dequantised (exactly representable F32), so pooling and reshapes
/// need no integer twins; the values are those of an all-integer pipeline.
pub struct StaticHook {
    /// The INT8 weights.
    pub weights: QWeights,
    /// Input (scale, zero point).
    pub input: (f32, i32),
    /// Output (scale, zero point).
    pub output: (f32, i32),
}

impl ForwardHook for StaticHook {
    fn forward(&self, _layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor> {
        self.weights
            .run(x, Some(self.input), Some(self.output), relu_act(relu))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn float_forward(layer: LayerRef<'_>, x: &Tensor, w: &Tensor, relu: bool) -> Result<Tensor> {
    let y = match layer {
        LayerRef::Linear(l) => x.linear(w, l.bias.as_ref())?,
        LayerRef::Conv2d(c) => x.conv2d(w, c.bias.as_ref(), c.opts)?,
    };
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}

/// Calibration: the float forward, with observers on the layer's input and output.
pub struct CalibrationHook {
    /// Sees the inputs.
    pub input: Mutex<Observer>,
    /// Sees the outputs (after ReLU where fused).
    pub output: Mutex<Observer>,
}

impl CalibrationHook {
    /// Observers of `kind` on both sides.
    pub fn new(kind: ObserverKind) -> CalibrationHook {
        CalibrationHook {
            input: Mutex::new(Observer::new(kind)),
            output: Mutex::new(Observer::new(kind)),
        }
    }
}

fn lock(m: &Mutex<Observer>) -> Result<std::sync::MutexGuard<'_, Observer>> {
    m.lock()
        .map_err(|_| Error::Msg("quant: observer lock poisoned".into()))
}

impl ForwardHook for CalibrationHook {
    fn forward(&self, layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor> {
        let y = float_forward(layer, x, layer.weight(), relu)?;
        lock(&self.input)?.observe(&host_values(x, "calibration")?);
        lock(&self.output)?.observe(&host_values(&y, "calibration")?);
        Ok(y)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `x` fake-quantised to u8 with (scale, zp), with the straight-through estimator of
/// PyTorch's `fake_quantize_per_tensor_affine`: the gradient passes where the rounded code
/// `round(x / scale) + zp` lies in 0..=255 (so up to half a step beyond the range) and is
/// 0 elsewhere. Computed as `x·m + detach(fq(x) - x·m)` with the 0/1 mask `m`, which
/// equals `fq(x)` up to one F32 rounding.
pub fn fake_quant_ste(x: &Tensor, scale: f32, zp: i32) -> Result<Tensor> {
    let v = host_values(x, "fake_quantize")?;
    let inv = 1.0 / scale;
    // The mask is `round(x/scale) + zp ∈ 0..=255`. `quantize_one` with codes one beyond that
    // range tells inside from outside without a libm `round` (`round_ties_even` was a call
    // per activation); it maps NaN to the zero point, which the mask blocks.
    let mask: Vec<f32> = v
        .iter()
        .map(|&x| {
            let code = k::quantize_one(x, inv, zp, -1, 256);
            ((0..=255).contains(&code) & !x.is_nan()) as u8 as f32
        })
        .collect();
    let mut fq = v;
    k::fake_quantize(&mut fq, scale, zp, 0, 255);
    // Rounded to x's dtype as they are made, not made in F32 and converted.
    let mask = Tensor::from_f32_vec(mask, x.shape(), x.dtype())?;
    let fq = Tensor::from_f32_vec(fq, x.shape(), x.dtype())?;
    let xm = x.mul(&mask)?;
    let delta = fq.sub(&xm.detach())?.detach();
    xm.add(&delta)
}

/// A weight fake-quantised per output channel (symmetric s8, its current range), with a
/// straight-through gradient.
pub fn fake_quant_weight(w: &Tensor) -> Result<Tensor> {
    let fq = QTensor::quantize_weight(w)?
        .dequantize()?
        .to_dtype(w.dtype())?;
    let delta = fq.sub(&w.detach())?.detach();
    w.add(&delta)
}

/// Quantisation-aware training (`prepare_qat`): weights fake-quantised per channel from
/// their current range, inputs and outputs fake-quantised per tensor with moving-average
/// observers (updated while gradients are recorded, i.e. in training steps, not in
/// evaluation under `no_grad`).
pub struct FakeQuantHook {
    /// Sees the inputs.
    pub input: Mutex<Observer>,
    /// Sees the outputs (after ReLU where fused).
    pub output: Mutex<Observer>,
}

impl FakeQuantHook {
    /// Moving-average observers with PyTorch's averaging constant 0.01.
    pub fn new() -> FakeQuantHook {
        FakeQuantHook {
            input: Mutex::new(Observer::new(ObserverKind::MovingAverage(0.01))),
            output: Mutex::new(Observer::new(ObserverKind::MovingAverage(0.01))),
        }
    }
    /// Starts from calibrated observers.
    pub fn from_observers(input: Observer, output: Observer) -> FakeQuantHook {
        FakeQuantHook {
            input: Mutex::new(input),
            output: Mutex::new(output),
        }
    }
}

impl Default for FakeQuantHook {
    fn default() -> Self {
        FakeQuantHook::new()
    }
}

impl ForwardHook for FakeQuantHook {
    fn forward(&self, layer: LayerRef<'_>, x: &Tensor, relu: bool) -> Result<Tensor> {
        // Not again when a checkpointed segment's forward runs again in the backward.
        let observing = crate::autograd::is_grad_enabled() && !crate::autograd::is_recomputing();
        let (si, zi) = {
            let mut o = lock(&self.input)?;
            if observing || o.batches() == 0 {
                o.observe(&host_values(x, "fake_quantize")?);
            }
            o.qparams_u8()
        };
        let xq = fake_quant_ste(x, si, zi)?;
        let wq = fake_quant_weight(layer.weight())?;
        let y = float_forward(layer, &xq, &wq, relu)?;
        let (so, zo) = {
            let mut o = lock(&self.output)?;
            if observing || o.batches() == 0 {
                o.observe(&host_values(&y, "fake_quantize")?);
            }
            o.qparams_u8()
        };
        fake_quant_ste(&y, so, zo)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
