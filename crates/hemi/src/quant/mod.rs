//! INT8 quantisation, as `torch.ao.quantization` does it: quantised tensors
//! ([`QTensor`]), observers, dynamic and static post-training quantisation of `Linear` and
//! `Conv2d` layers, and quantisation-aware training with fake quantisation.
//!
//! hemi's layers keep their types: quantising a model sets a [`ForwardHook`] on each of
//! its `Linear`/`Conv2d` layers (listed by `Module::layers_mut`) where PyTorch swaps the
//! modules. The integer arithmetic runs on host buffers in `cpu::qgemm::quant` (quantise,
//! dequantise, im2col) and `cpu::qgemm` (u8 × s8 → i32 GEMM on VNNI/AVX2).
//!
//! - [`quantize_dynamic`]: `Linear` weights to s8 per output channel, activations
//!   quantised per row at run time, F32 outputs (PyTorch's `quantize_dynamic`; the BERT
//!   case).
//! - [`prepare_static`] (observers on every layer's input and output), calibration batches
//!   through the float model, then [`convert_static`]: u8 activations with fixed scales,
//!   bias, ReLU and requantisation fused in the GEMM's epilogue (the CNN case).
//! - [`prepare_qat`]: fake quantisation of weights, inputs and outputs with a
//!   straight-through gradient; train, then [`convert_static`] (or calibrate afresh).
//! - [`save_quantized`] / [`load_quantized`]: a safetensors file with I8 weights and their
//!   scales (layout in DESIGN.md), which `hemi eval` runs.

pub mod layers;
pub mod observer;
pub mod qtensor;

pub use layers::{
    fake_quant_ste, fake_quant_weight, CalibrationHook, DynamicHook, FakeQuantHook, Geometry,
    QWeights, StaticHook,
};
pub use observer::{Observer, ObserverKind};
pub use qtensor::{QDType, QData, QScheme, QTensor};

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::nn::{ForwardHook, LayerMut, Module};
use crate::tensor::Tensor;

/// Which post-training quantisation a model carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Weights INT8, activations quantised at run time (Linear layers).
    Dynamic,
    /// Weights and activations INT8 with calibrated scales (Conv2d and Linear).
    Static,
}

impl Mode {
    /// `"dynamic"` / `"static"`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dynamic => "dynamic",
            Mode::Static => "static",
        }
    }
    /// Parses `dynamic` or `static`.
    pub fn parse(s: &str) -> Result<Mode> {
        match s {
            "dynamic" => Ok(Mode::Dynamic),
            "static" => Ok(Mode::Static),
            _ => Err(Error::arg(
                "quantize",
                format!("mode {s:?}: expected dynamic or static"),
            )),
        }
    }
}

fn layers_or_error(model: &mut dyn Module) -> Result<Vec<(String, LayerMut<'_>)>> {
    let layers = model.layers_mut();
    if layers.is_empty() {
        return Err(Error::arg(
            "quantize",
            "this model lists no Linear or Conv2d layers (Module::layers_mut)",
        ));
    }
    Ok(layers)
}

/// The layers `mode` would quantise in `model` (dynamic: every `Linear`; static: every
/// `Conv2d` and `Linear`), leaving the model as it is: a caller can refuse a model with none
/// before spending time on it.
pub fn quantizable_layers(model: &mut dyn Module, mode: Mode) -> Vec<String> {
    model
        .layers_mut()
        .into_iter()
        .filter(|(_, l)| mode == Mode::Static || matches!(l, LayerMut::Linear(_)))
        .map(|(n, _)| n)
        .collect()
}

/// Dynamic quantisation of every `Linear` layer; returns their names. Conv layers stay
/// float, as in PyTorch.
pub fn quantize_dynamic(model: &mut dyn Module) -> Result<Vec<String>> {
    let mut done = Vec::new();
    for (name, mut layer) in layers_or_error(model)? {
        if let LayerMut::Linear(_) = layer {
            let weights = QWeights::from_layer(layer.as_ref())?;
            *layer.hook_mut() = Some(Arc::new(DynamicHook { weights }));
            done.push(name);
        }
    }
    Ok(done)
}

/// Puts calibration observers of `kind` on every `Conv2d` and `Linear` (replacing other
/// hooks); run calibration batches through the model, then [`convert_static`].
pub fn prepare_static(model: &mut dyn Module, kind: ObserverKind) -> Result<Vec<String>> {
    let mut done = Vec::new();
    for (name, mut layer) in layers_or_error(model)? {
        *layer.hook_mut() = Some(Arc::new(CalibrationHook::new(kind)));
        done.push(name);
    }
    Ok(done)
}

/// Fake quantisation on every `Conv2d` and `Linear` for quantisation-aware training.
pub fn prepare_qat(model: &mut dyn Module) -> Result<Vec<String>> {
    let mut done = Vec::new();
    for (name, mut layer) in layers_or_error(model)? {
        *layer.hook_mut() = Some(Arc::new(FakeQuantHook::new()));
        done.push(name);
    }
    Ok(done)
}

/// Removes every hook: the model computes in float again.
pub fn remove_hooks(model: &mut dyn Module) {
    for (_, mut layer) in model.layers_mut() {
        *layer.hook_mut() = None;
    }
}

fn observed(hook: &Arc<dyn ForwardHook>) -> Option<(Observer, Observer)> {
    let any = hook.as_any();
    let get = |a: &std::sync::Mutex<Observer>| a.lock().ok().map(|o| o.clone());
    if let Some(c) = any.downcast_ref::<CalibrationHook>() {
        return Some((get(&c.input)?, get(&c.output)?));
    }
    if let Some(f) = any.downcast_ref::<FakeQuantHook>() {
        return Some((get(&f.input)?, get(&f.output)?));
    }
    None
}

/// Replaces the observers set by [`prepare_static`] (or [`prepare_qat`]) with INT8 layers
/// using the ranges they saw and the layers' current weights. Errors name a layer that
/// has no observer or saw no data.
pub fn convert_static(model: &mut dyn Module) -> Result<Vec<String>> {
    let mut plans = Vec::new();
    for (name, layer) in layers_or_error(model)? {
        let hook = layer.as_ref().hook().cloned();
        let (inp, out) = hook.as_ref().and_then(observed).ok_or_else(|| {
            Error::arg(
                "convert_static",
                format!("layer {name} has no observers (prepare_static first)"),
            )
        })?;
        if inp.batches() == 0 {
            return Err(Error::arg(
                "convert_static",
                format!("layer {name} saw no calibration data (did the batches reach it?)"),
            ));
        }
        let weights = QWeights::from_layer(layer.as_ref())?;
        plans.push((name, weights, inp.qparams_u8(), out.qparams_u8()));
    }
    let mut done = Vec::new();
    let layers = model.layers_mut();
    for ((name, mut layer), (pname, weights, input, output)) in layers.into_iter().zip(plans) {
        debug_assert_eq!(name, pname);
        *layer.hook_mut() = Some(Arc::new(StaticHook {
            weights,
            input,
            output,
        }));
        done.push(name);
    }
    Ok(done)
}

/// The format tag in a quantised file's metadata.
pub const FORMAT: &str = "hemi-int8/1";

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serialises a quantised model: its float `state_dict` except that each quantised
/// layer's `weight` is I8 (`[out, ...]`), beside `weight_scale` (F32 `[out]`) and
/// `weight_zero_point` (I32 `[out]`, zeros); static layers add `input_scale`,
/// `input_zero_point`, `output_scale`, `output_zero_point` (scalars). Metadata: `format`,
/// `mode`, `layers` (comma-separated) and `extra`'s entries. Returns the bytes.
pub fn quantized_bytes(model: &mut dyn Module, extra: &HashMap<String, String>) -> Result<Vec<u8>> {
    // Per quantised layer: (name, weights, static params).
    type Layer = (String, QWeights, Option<((f32, i32), (f32, i32))>);
    let mut qlayers: Vec<Layer> = Vec::new();
    let mut mode = None;
    for (name, layer) in model.layers_mut() {
        let hook = layer.as_ref().hook().cloned();
        let Some(hook) = hook else { continue };
        let any = hook.as_any();
        let (m, entry) = if let Some(d) = any.downcast_ref::<DynamicHook>() {
            (Mode::Dynamic, (name, d.weights.clone(), None))
        } else if let Some(s) = any.downcast_ref::<StaticHook>() {
            (
                Mode::Static,
                (name, s.weights.clone(), Some((s.input, s.output))),
            )
        } else {
            return Err(Error::arg(
                "save_quantized",
                format!("layer {name} carries observers, not INT8 weights (convert first)"),
            ));
        };
        if mode.is_some_and(|x| x != m) {
            return Err(Error::arg(
                "save_quantized",
                "the model mixes dynamic and static layers",
            ));
        }
        mode = Some(m);
        qlayers.push(entry);
    }
    let mode =
        mode.ok_or_else(|| Error::arg("save_quantized", "the model has no quantised layers"))?;
    let qweight_names: HashMap<String, usize> = qlayers
        .iter()
        .enumerate()
        .map(|(i, (n, _, _))| (format!("{n}.weight"), i))
        .collect();
    let mut entries: Vec<Entry> = Vec::new();
    let mut weight_only = Vec::new();
    for (name, t) in model.state_dict() {
        if let Some(&i) = qweight_names.get(&name) {
            push_per_row(&mut entries, &name, &qlayers[i].1.weight);
            continue;
        }
        if is_embedding_table(&name, t.shape(), t.dtype()) {
            push_per_row(&mut entries, &name, &QTensor::quantize_weight(&t)?);
            weight_only.push(name);
            continue;
        }
        let (dt, bytes) = match t.dtype() {
            crate::DType::I64 => (
                StDtype::I64,
                t.to_vec_i64()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            ),
            _ => (StDtype::F32, f32_bytes(&t.to_vec_f32())),
        };
        entries.push((name, dt, t.shape().to_vec(), bytes));
    }
    for (name, _, st) in &qlayers {
        if let Some(((is, iz), (os, oz))) = st {
            entries.push((
                format!("{name}.input_scale"),
                StDtype::F32,
                vec![],
                f32_bytes(&[*is]),
            ));
            entries.push((
                format!("{name}.input_zero_point"),
                StDtype::I32,
                vec![],
                i32_bytes(&[*iz]),
            ));
            entries.push((
                format!("{name}.output_scale"),
                StDtype::F32,
                vec![],
                f32_bytes(&[*os]),
            ));
            entries.push((
                format!("{name}.output_zero_point"),
                StDtype::I32,
                vec![],
                i32_bytes(&[*oz]),
            ));
        }
    }
    let mut views = Vec::with_capacity(entries.len());
    for (name, dt, shape, bytes) in &entries {
        let v = TensorView::new(*dt, shape.clone(), bytes)
            .map_err(|e| Error::Msg(format!("safetensors: {name}: {e}")))?;
        views.push((name.clone(), v));
    }
    let mut meta = extra.clone();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("mode".into(), mode.name().into());
    meta.insert(
        "layers".into(),
        qlayers
            .iter()
            .map(|(n, _, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(","),
    );
    meta.insert("weight_only".into(), weight_only.join(","));
    safetensors::serialize(views, Some(meta)).map_err(|e| Error::Msg(format!("safetensors: {e}")))
}

/// A tensor of the file: name, dtype, shape, little-endian bytes.
type Entry = (String, StDtype, Vec<usize>, Vec<u8>);

/// `name` as I8 codes quantised per row, beside `{name}_scale` (F32) and
/// `{name}_zero_point` (I32, zeros).
fn push_per_row(entries: &mut Vec<Entry>, name: &str, q: &QTensor) {
    let codes = q.as_i8().expect("per-row weights are I8");
    let scales = q.scales();
    let n = scales.len();
    entries.push((
        name.to_string(),
        StDtype::I8,
        q.shape().to_vec(),
        codes.iter().map(|&x| x as u8).collect(),
    ));
    entries.push((
        format!("{name}_scale"),
        StDtype::F32,
        vec![n],
        f32_bytes(&scales),
    ));
    entries.push((
        format!("{name}_zero_point"),
        StDtype::I32,
        vec![n],
        i32_bytes(&vec![0; n]),
    ));
}

/// Embedding tables (`*embeddings.weight`, F32 `[rows, dim]`) are stored weight-only: I8
/// per row with F32 row scales (PyTorch quantises `nn.Embedding` per row the same way,
/// `float_qparams_weight_only_qconfig`), and dequantised when loaded; lookups stay float.
/// In a BERT they are half of the parameters.
fn is_embedding_table(name: &str, shape: &[usize], dtype: crate::DType) -> bool {
    name.ends_with("embeddings.weight") && shape.len() == 2 && dtype.is_float()
}

/// Writes [`quantized_bytes`] to `path` atomically; returns the file's size.
pub fn save_quantized(
    model: &mut dyn Module,
    path: &Path,
    extra: &HashMap<String, String>,
) -> Result<u64> {
    let bytes = quantized_bytes(model, extra)?;
    crate::io::atomic_write(path, &bytes)?;
    Ok(bytes.len() as u64)
}

/// The metadata of a quantised file (format checked).
pub fn quantized_metadata(what: &str, data: &[u8]) -> Result<HashMap<String, String>> {
    let bad = |msg: String| Error::Data {
        path: what.to_string(),
        msg,
    };
    let (_, meta) = SafeTensors::read_metadata(data)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad(format!(
            "not a hemi INT8 file (metadata format != {FORMAT:?})"
        )));
    }
    Ok(meta)
}

/// Loads a file written by [`save_quantized`] into a float `model` of the same
/// architecture: the float tensors (quantised weights dequantised) strictly by name, then
/// the INT8 hooks. Returns the mode and the metadata. Errors name the file and tensor.
pub fn load_quantized(
    model: &mut dyn Module,
    what: &str,
    data: &[u8],
) -> Result<(Mode, HashMap<String, String>)> {
    let bad = |msg: String| Error::Data {
        path: what.to_string(),
        msg,
    };
    let meta = quantized_metadata(what, data)?;
    let mode = Mode::parse(meta.get("mode").map(String::as_str).unwrap_or(""))
        .map_err(|e| bad(e.to_string()))?;
    let qnames: Vec<String> = meta
        .get("layers")
        .map(|s| {
            s.split(',')
                .filter(|x| !x.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let st = SafeTensors::deserialize(data)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let get = |name: &str, dt: StDtype| -> Result<(Vec<usize>, Vec<u8>)> {
        let v = st
            .tensor(name)
            .map_err(|_| bad(format!("tensor {name} is missing")))?;
        if v.dtype() != dt {
            return Err(bad(format!(
                "tensor {name} is {:?}, expected {dt:?}",
                v.dtype()
            )));
        }
        Ok((v.shape().to_vec(), v.data().to_vec()))
    };
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let i32s = |b: &[u8]| -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let scalar_f = |name: String| -> Result<f32> {
        let (_, b) = get(&name, StDtype::F32)?;
        f32s(&b)
            .first()
            .copied()
            .ok_or_else(|| bad(format!("tensor {name} is empty")))
    };
    let scalar_i = |name: String| -> Result<i32> {
        let (_, b) = get(&name, StDtype::I32)?;
        i32s(&b)
            .first()
            .copied()
            .ok_or_else(|| bad(format!("tensor {name} is empty")))
    };
    // An I8 tensor `w` quantised per row, with `{w}_scale` and `{w}_zero_point`.
    let per_row_i8 = |w: &str| -> Result<QTensor> {
        let (shape, b) = get(w, StDtype::I8)?;
        let (_, sb) = get(&format!("{w}_scale"), StDtype::F32)?;
        let (_, zb) = get(&format!("{w}_zero_point"), StDtype::I32)?;
        let q = QTensor::from_parts(
            shape,
            QData::I8(b.iter().map(|&x| x as i8).collect()),
            QScheme::PerChannel {
                axis: 0,
                scales: f32s(&sb),
                zero_points: i32s(&zb),
            },
        )
        .map_err(|e| bad(format!("{w}: {e}")))?;
        if q.scales().iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(bad(format!(
                "{w}_scale holds a scale that is not finite and > 0"
            )));
        }
        Ok(q)
    };
    // Quantised weights.
    let mut qweights: HashMap<String, QTensor> = HashMap::new();
    for name in &qnames {
        qweights.insert(name.clone(), per_row_i8(&format!("{name}.weight"))?);
    }
    let weight_only: std::collections::HashSet<&str> = meta
        .get("weight_only")
        .map(|s| s.split(',').filter(|x| !x.is_empty()).collect())
        .unwrap_or_default();
    // The float state dict: every model tensor by name.
    let mut state = Vec::new();
    for (name, _) in model.state_dict() {
        if weight_only.contains(name.as_str()) {
            let q = per_row_i8(&name)?;
            state.push((name.clone(), q.dequantize()?));
            continue;
        }
        if let Some(layer) = name
            .strip_suffix(".weight")
            .filter(|l| qweights.contains_key(*l))
        {
            state.push((name.clone(), qweights[layer].dequantize()?));
            continue;
        }
        let v = st
            .tensor(&name)
            .map_err(|_| bad(format!("tensor {name} is missing")))?;
        let n: usize = v.shape().iter().product();
        let tensor = match v.dtype() {
            StDtype::F32 if v.data().len() == 4 * n => Tensor::from_vec(f32s(v.data()), v.shape())?,
            StDtype::I64 if v.data().len() == 8 * n => {
                let vals: Vec<i64> = v
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                Tensor::from_vec(vals, v.shape())?
            }
            dt => {
                return Err(bad(format!(
                    "tensor {name}: {dt:?} with {} bytes",
                    v.data().len()
                )))
            }
        };
        state.push((name, tensor));
    }
    model
        .load_state_dict(&state)
        .map_err(|e| bad(e.to_string()))?;
    // Hooks.
    let mut statics = HashMap::new();
    if mode == Mode::Static {
        for name in &qnames {
            let input = (
                scalar_f(format!("{name}.input_scale"))?,
                scalar_i(format!("{name}.input_zero_point"))?,
            );
            let output = (
                scalar_f(format!("{name}.output_scale"))?,
                scalar_i(format!("{name}.output_zero_point"))?,
            );
            for (what_, (s, z)) in [("input", input), ("output", output)] {
                if !(s.is_finite() && s > 0.0 && (0..=255).contains(&z)) {
                    return Err(bad(format!(
                        "{name}.{what_}: scale {s} / zero point {z} invalid"
                    )));
                }
            }
            statics.insert(name.clone(), (input, output));
        }
    }
    let mut found = 0;
    for (name, mut layer) in model.layers_mut() {
        let Some(q) = qweights.remove(&name) else {
            continue;
        };
        let weights = Geometry::of(layer.as_ref())
            .and_then(|geometry| {
                let bias = layer.as_ref().bias().map(|b| b.to_vec_f32());
                QWeights::new(q, bias, geometry)
            })
            .map_err(|e| bad(format!("{name}: {e}")))?;
        let hook: Arc<dyn ForwardHook> = match mode {
            Mode::Dynamic => Arc::new(DynamicHook { weights }),
            Mode::Static => {
                let (input, output) = statics[&name];
                Arc::new(StaticHook {
                    weights,
                    input,
                    output,
                })
            }
        };
        *layer.hook_mut() = Some(hook);
        found += 1;
    }
    if let Some(name) = qweights.keys().next() {
        return Err(bad(format!(
            "quantised layer {name} is not a Linear/Conv2d layer of this model"
        )));
    }
    debug_assert_eq!(found, qnames.len());
    Ok((mode, meta))
}
