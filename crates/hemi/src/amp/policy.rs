//! Precision policies: per-module and per-op precision pins over a preset (Keras' per-layer
//! `dtype` policy; PyTorch's nested `autocast(enabled=False)` around a module, with the
//! casts it needs done for you).
//!
//! A policy file is JSON:
//!
//! ```json
//! { "modules": { "layer3.1.bn2": "f32", "bert.encoder.layer.0": "f32" },
//!   "ops": { "softmax": "f32" } }
//! ```
//!
//! A module path is a `state_dict` prefix of the model (`hemi doctor` prints them; a path
//! pins every module inside it, the longest matching path wins). An op is one whose
//! precision autocast decides (`CastPolicy::LowerPrecision` or `Fp32` in
//! [`POLICY`](crate::ops::autocast::POLICY)); an op pin wins over a module pin. Pinned ops
//! compute in the pinned dtype under every preset: their float inputs are cast to it, and
//! with the F16/BF16-weight presets a module pinned to F32 also keeps F32 weights.
//!
//! ```
//! use hemi::amp::{Precision, PrecisionPolicy};
//! use hemi::models::registry;
//! let mut model = registry::build("mlp", [1, 28, 28], 10, 0).unwrap();
//! let policy = PrecisionPolicy::from_json(r#"{"modules": {"fc2": "f32"}}"#).unwrap();
//! policy.validate(&*model).unwrap();
//! let p = Precision::AmpFp16;
//! policy.prepare_model(p, &mut *model).unwrap();
//! let x = hemi::Tensor::ones(&[2, 1, 28, 28], hemi::DType::F32).unwrap();
//! let y = {
//!     let _scope = policy.scope(p, &*model);
//!     model.forward(&x).unwrap()
//! };
//! assert_eq!(y.dtype(), hemi::DType::F32); // fc2 computed in F32
//! ```

use std::path::Path;
use std::sync::Arc;

use crate::amp::Precision;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Kind, Module};
use crate::ops::autocast::{autocast_pinned, policy, AutocastGuard, CastPolicy, Pins};
use crate::ops::check::{bind_names, module_of, NamesGuard};

/// Per-module and per-op precision pins (see the module doc for the file format).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrecisionPolicy {
    /// Module path → dtype, in file order.
    pub modules: Vec<(String, DType)>,
    /// Op name → dtype, in file order.
    pub ops: Vec<(String, DType)>,
}

fn parse_dtype(what: &str, s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => Ok(DType::F32),
        "f16" | "fp16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err(Error::arg(
            "policy",
            format!("{what}: unknown dtype {s:?}; one of f32, f16, bf16"),
        )),
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// Levenshtein distance, for "did you mean" lists.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Up to `n` of `candidates` nearest to `s`.
fn nearest<'a>(s: &str, candidates: &'a [String], n: usize) -> Vec<&'a str> {
    let mut v: Vec<(usize, &str)> = candidates
        .iter()
        .map(|c| (distance(s, c), c.as_str()))
        .collect();
    v.sort();
    v.into_iter().take(n).map(|(_, c)| c).collect()
}

/// Every module path of `model` that a policy may name: each `state_dict` prefix that
/// holds a parameter (`layer3`, `layer3.1`, `layer3.1.bn2`), in `state_dict` order.
pub fn module_paths(model: &dyn Module) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (name, _, kind, _) in model.tensors() {
        if kind != Kind::Parameter {
            continue;
        }
        let m = module_of(&name);
        let mut prefix = String::new();
        for seg in m.split('.').filter(|s| !s.is_empty()) {
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(seg);
            if !out.contains(&prefix) {
                out.push(prefix.clone());
            }
        }
    }
    out
}

/// The ops a policy may pin: those whose compute dtype autocast decides.
pub fn pinnable_ops() -> Vec<String> {
    crate::ops::autocast::POLICY
        .iter()
        .filter(|(_, p)| matches!(p, CastPolicy::LowerPrecision | CastPolicy::Fp32))
        .map(|(n, _)| n.to_string())
        .collect()
}

impl PrecisionPolicy {
    /// Parses a policy (the JSON of the module doc).
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::arg("policy", format!("not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| {
            Error::arg(
                "policy",
                "expected a JSON object with \"modules\" and/or \"ops\"",
            )
        })?;
        let mut p = PrecisionPolicy::default();
        for (key, val) in obj {
            let list = match key.as_str() {
                "modules" => &mut p.modules,
                "ops" => &mut p.ops,
                other => {
                    return Err(Error::arg(
                        "policy",
                        format!("unknown key {other:?}; a policy has \"modules\" and \"ops\""),
                    ))
                }
            };
            let m = val.as_object().ok_or_else(|| {
                Error::arg(
                    "policy",
                    format!("\"{key}\" must map names to dtypes, e.g. {{\"fc2\": \"f32\"}}"),
                )
            })?;
            for (name, d) in m {
                let d = d.as_str().ok_or_else(|| {
                    Error::arg(
                        "policy",
                        format!("{key}.{name}: the dtype must be a string"),
                    )
                })?;
                if name.trim().is_empty() {
                    return Err(Error::arg("policy", format!("\"{key}\" has an empty name")));
                }
                list.push((name.trim().to_string(), parse_dtype(name, d)?));
            }
        }
        Ok(p)
    }

    /// Reads a policy file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::arg("policy", format!("{}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| Error::arg("policy", format!("{}: {e}", path.display())))
    }

    /// The policy as JSON (the file format; checkpoints record it so).
    pub fn to_json(&self) -> String {
        let map = |v: &[(String, DType)]| {
            serde_json::Value::Object(
                v.iter()
                    .map(|(n, d)| (n.clone(), serde_json::Value::from(dtype_name(*d))))
                    .collect(),
            )
        };
        let mut o = serde_json::Map::new();
        o.insert("modules".into(), map(&self.modules));
        o.insert("ops".into(), map(&self.ops));
        serde_json::to_string_pretty(&serde_json::Value::Object(o)).expect("plain JSON")
    }

    /// The policy as one line of JSON (the checkpoint settings' form).
    pub fn to_json_compact(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.to_json()).expect("own JSON");
        v.to_string()
    }

    /// Writes the policy file atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::io::atomic_write(path, self.to_json().as_bytes())
    }

    /// Whether the policy pins nothing.
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty() && self.ops.is_empty()
    }

    /// Checks every name against `model`: an unknown module path or op is an error that
    /// names it and lists the nearest real ones.
    pub fn validate(&self, model: &dyn Module) -> Result<()> {
        let paths = module_paths(model);
        for (m, _) in &self.modules {
            if !paths.contains(m) {
                return Err(Error::arg(
                    "policy",
                    format!(
                        "module {m:?} is not a module of this model; nearest: {}",
                        nearest(m, &paths, 4).join(", ")
                    ),
                ));
            }
        }
        let ops = pinnable_ops();
        for (o, _) in &self.ops {
            if !ops.contains(o) {
                let why = if policy(o).is_some() {
                    "keeps its input dtype (pin the module that feeds it instead)"
                } else {
                    "is not an op"
                };
                return Err(Error::arg(
                    "policy",
                    format!(
                        "op {o:?} {why}; ops a policy can pin, nearest: {}",
                        nearest(o, &ops, 4).join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether parameter `name` (`layer3.1.bn2.weight`) lies in a module pinned to F32.
    fn keeps_f32(&self, name: &str) -> bool {
        let m = module_of(name);
        self.modules
            .iter()
            .filter(|(p, _)| crate::ops::scope::within(m, p))
            .max_by_key(|(p, _)| p.len())
            .is_some_and(|(_, d)| *d == DType::F32)
    }

    /// Casts `model` for `precision` as [`Precision::prepare_model`] does, except that the
    /// parameters of modules pinned to F32 stay F32 (F16/BF16-weight presets).
    pub fn prepare_model(&self, precision: Precision, model: &mut dyn Module) -> Result<()> {
        let w = precision.weight_dtype();
        if w == DType::F32 {
            return Ok(());
        }
        for slot in model.tensors_mut() {
            if !slot.tensor.dtype().is_float() {
                continue;
            }
            let target =
                if (precision.keep_norms_f32() && slot.is_norm) || self.keeps_f32(&slot.name) {
                    DType::F32
                } else {
                    w
                };
            let cast = slot.tensor.detach().to_dtype(target)?.contiguous()?;
            let fresh = crate::tensor::Tensor::from_storage(cast.storage(), cast.layout().clone());
            if slot.kind == Kind::Parameter {
                fresh.set_requires_grad(true)?;
            }
            *slot.tensor = fresh;
        }
        Ok(())
    }

    /// The pins for `precision`.
    pub fn pins(&self, precision: Precision) -> Pins {
        let lower = (precision.autocast_dtype().is_none()
            && precision.weight_dtype() != DType::F32)
            .then(|| precision.compute_dtype());
        Pins {
            modules: self.modules.clone(),
            ops: self.ops.clone(),
            lower,
        }
    }

    /// The forward pass's scope under `precision` with this policy: the preset's autocast
    /// with the pins, and `model`'s parameters named (so ops know their module). Open it
    /// where [`Precision::autocast`] would be opened, once the model is cast.
    pub fn scope(&self, precision: Precision, model: &dyn Module) -> PolicyScope {
        let names = bind_names(&model.named_parameters());
        let ac = autocast_pinned(precision.autocast_dtype(), Arc::new(self.pins(precision)));
        PolicyScope {
            _ac: ac,
            _names: names,
        }
    }
}

/// A forward pass under a precision policy (`PrecisionPolicy::scope`).
#[must_use = "the policy applies only while the scope is alive"]
pub struct PolicyScope {
    _ac: AutocastGuard,
    _names: NamesGuard,
}
