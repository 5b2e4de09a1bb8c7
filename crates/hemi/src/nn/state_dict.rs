//! Comparing a state dict with a model's tensors by name and shape, for strict loading.

use std::collections::HashMap;

use super::Module;
use crate::tensor::Tensor;

/// How a `state_dict` differs from a model's tensors, by name: what PyTorch's
/// `load_state_dict(strict=True)` refuses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateDictMismatch {
    /// The model's names the dict lacks, in the model's order.
    pub missing: Vec<String>,
    /// The dict's names the model lacks, in the dict's order.
    pub unexpected: Vec<String>,
    /// Names the dict holds more than once.
    pub duplicated: Vec<String>,
    /// (name, the dict's shape, the model's shape) where they differ.
    pub shapes: Vec<(String, Vec<usize>, Vec<usize>)>,
}

impl StateDictMismatch {
    /// True when the dict matches the model exactly (strict loading would succeed).
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.duplicated.is_empty()
            && self.shapes.is_empty()
    }
}

impl std::fmt::Display for StateDictMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        let list = |what: &str, names: &[String]| {
            format!("{} {what} key(s): {}", names.len(), names.join(", "))
        };
        if !self.missing.is_empty() {
            parts.push(list("missing", &self.missing));
        }
        if !self.unexpected.is_empty() {
            parts.push(list("unexpected", &self.unexpected));
        }
        if !self.duplicated.is_empty() {
            parts.push(list("duplicated", &self.duplicated));
        }
        if !self.shapes.is_empty() {
            let s: Vec<String> = self
                .shapes
                .iter()
                .map(|(n, got, want)| format!("{n}: checkpoint {got:?}, model {want:?}"))
                .collect();
            parts.push(format!("{} shape mismatch(es): {}", s.len(), s.join("; ")));
        }
        write!(f, "{}", parts.join("; "))
    }
}

/// Every way `state` differs from `model`'s tensors by name and shape (empty: a strict
/// load accepts it). Values and dtypes are not compared: loading casts, as PyTorch's does.
pub fn state_dict_mismatch<M: Module + ?Sized>(
    model: &M,
    state: &[(String, Tensor)],
) -> StateDictMismatch {
    let ours: HashMap<String, Vec<usize>> = model
        .tensors()
        .into_iter()
        .map(|(n, t, _, _)| (n, t.shape().to_vec()))
        .collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut m = StateDictMismatch::default();
    for (name, t) in state {
        let count = seen.entry(name.as_str()).or_insert(0);
        *count += 1;
        if *count == 2 {
            m.duplicated.push(name.clone());
        }
        if *count > 1 {
            continue;
        }
        match ours.get(name) {
            None => m.unexpected.push(name.clone()),
            Some(shape) if shape.as_slice() != t.shape() => {
                m.shapes
                    .push((name.clone(), t.shape().to_vec(), shape.clone()))
            }
            Some(_) => {}
        }
    }
    m.missing = model
        .tensors()
        .into_iter()
        .filter(|(n, ..)| !seen.contains_key(n.as_str()))
        .map(|(n, ..)| n)
        .collect();
    m
}
