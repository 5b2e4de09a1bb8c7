//! The `Optimizer` trait, the saved form of an optimizer's state (`OptimizerState`), and the
//! helpers every optimizer shares: parameter checks, reading a gradient as F32, writing an
//! F32 update back into the parameter's own dtype.
//!
//! Why the state is F32 whatever the parameter dtype (DESIGN.md, precision contract 5):
//! a momentum buffer or second moment held in F16 loses the small increments that make it
//! useful (an F16 `exp_avg_sq` underflows at 6e-8), so every optimizer keeps its buffers in
//! F32, reads F16/BF16 parameters and gradients as F32, does the whole update in F32 and
//! rounds once when it writes the parameter back.

use std::collections::HashSet;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// An optimizer over a fixed list of parameters (PyTorch's `torch.optim.Optimizer` with one
/// parameter group).
///
/// Parameters whose `.grad()` is `None` are skipped by `step` (their state does not advance),
/// as PyTorch does. The update replaces each parameter's data in place (`set_data`): it is
/// not recorded by autograd and every clone of the parameter handle sees it.
pub trait Optimizer {
    /// One update of every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// Clears every parameter's gradient (PyTorch's `zero_grad(set_to_none=True)`).
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }

    /// The learning rate the next `step` uses.
    fn lr(&self) -> f64;

    /// Sets the learning rate (schedulers call this).
    fn set_lr(&mut self, lr: f64);

    /// The parameters this optimizer updates, in the order given at construction (a loss
    /// scaler reaches the gradients through these).
    fn params(&self) -> &[Tensor];

    /// A copy of the state: hyper-parameters, step counts and F32 buffers.
    fn state_dict(&self) -> OptimizerState;

    /// The bytes of the state's buffers (those `state_dict` would copy), without copying
    /// them (memory accounting).
    fn state_bytes(&self) -> usize {
        self.state_dict()
            .buffers
            .iter()
            .map(|b| b.data.len() * 4)
            .sum()
    }

    /// Restores a state saved by `state_dict` of the same kind of optimizer over parameters
    /// of the same count and shapes; the hyper-parameters come from the state, as in
    /// PyTorch. On error nothing changes.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;

    /// Which parameters weight decay applies to, one flag per parameter in `params()` order
    /// (all by default). The common use leaves biases and normalisation weights undecayed
    /// (`no_decay_mask`), as PyTorch users do with two parameter groups. An error when the
    /// length differs from the parameter count, or where the optimizer has no weight decay.
    fn set_weight_decay_mask(&mut self, decay: &[bool]) -> Result<()> {
        let _ = decay;
        Err(Error::arg(
            "Optimizer::set_weight_decay_mask",
            "this optimizer has no per-parameter weight decay",
        ))
    }
}

/// The usual "no weight decay on biases and normalisation weights" mask: `true` (decay) for
/// parameters of rank 2 or more (conv and linear weights, embeddings), `false` for vectors
/// and scalars (biases, BatchNorm/LayerNorm weights and biases).
pub fn no_decay_mask(params: &[Tensor]) -> Vec<bool> {
    params.iter().map(|p| p.rank() >= 2).collect()
}

/// Checks a weight-decay mask's length against the parameter count.
pub(crate) fn check_decay_mask(op: &'static str, decay: &[bool], params: usize) -> Result<()> {
    if decay.len() != params {
        return Err(Error::arg(
            op,
            format!(
                "the weight-decay mask has {} flags for {params} parameters",
                decay.len()
            ),
        ));
    }
    Ok(())
}

/// One named F32 buffer of optimizer state (e.g. `"3.exp_avg"`: parameter 3's first moment),
/// row-major with the parameter's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct StateBuffer {
    /// The buffer's name, `"{param index}.{key}"`.
    pub name: String,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// The values, row-major, in F32.
    pub data: Vec<f32>,
}

/// An optimizer's state as plain data, so that a checkpoint can store the buffers as
/// safetensors and the scalars as JSON.
///
/// Names follow PyTorch's optimizer state_dict: a scalar or buffer belonging to parameter
/// `i` is named `"{i}.{key}"` (`"0.momentum_buffer"`, `"2.step"`, `"2.exp_avg_sq"`); the
/// hyper-parameters (`"lr"`, `"momentum"`, `"beta1"`...) and `"num_params"` have plain names.
/// Booleans are stored as 0.0 / 1.0 and step counts as exact integers in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    /// `"sgd"`, `"adam"` or `"adamw"`: loading into another kind is an error.
    pub optimizer: String,
    /// Hyper-parameters and per-parameter counters by name (`"lr"`, `"0.step"`), in f64.
    pub scalars: Vec<(String, f64)>,
    /// The F32 state buffers (momentum, moments) by name.
    pub buffers: Vec<StateBuffer>,
}

impl OptimizerState {
    /// The scalar named `name`, if present.
    pub fn scalar(&self, name: &str) -> Option<f64> {
        self.scalars
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, v)| v)
    }

    /// The buffer named `name`, if present.
    pub fn buffer(&self, name: &str) -> Option<&StateBuffer> {
        self.buffers.iter().find(|b| b.name == name)
    }
}

// ----- shared helpers ---------------------------------------------------------------------

/// Checks the parameters an optimizer is built over: leaves (an update of a computed tensor
/// would be lost), F32/F16/BF16 (the state and maths are F32, which would silently round
/// F64 parameters), whole contiguous tensors (`set_data` replaces a whole buffer), each
/// given once (a duplicate would be updated twice per step).
pub(crate) fn check_params(op: &'static str, params: &[Tensor]) -> Result<()> {
    let mut seen = HashSet::new();
    for (i, p) in params.iter().enumerate() {
        if !p.is_leaf() {
            return Err(Error::arg(
                op,
                format!("parameter {i} {p:?} is not a leaf tensor; optimize leaves only"),
            ));
        }
        if !matches!(p.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::dtype(
                op,
                p.dtype(),
                format!("parameter {i}: optimizers keep F32 state and update F32, F16 or BF16 parameters"),
            ));
        }
        let whole =
            p.layout().contiguous_range() == Some(0..p.numel()) && p.storage().len() == p.numel();
        if !whole {
            return Err(Error::arg(
                op,
                format!(
                    "parameter {i} {p:?} is a view; parameters must own a whole contiguous buffer"
                ),
            ));
        }
        if !seen.insert(p.id()) {
            return Err(Error::arg(
                op,
                format!("parameter {i} appears more than once"),
            ));
        }
    }
    Ok(())
}

/// Checks every parameter's gradient (shape, float dtype) before a step updates anything, so
/// that a bad gradient fails the step without half the parameters updated.
pub(crate) fn check_grads(op: &'static str, params: &[Tensor]) -> Result<()> {
    for (i, p) in params.iter().enumerate() {
        let Some(g) = p.grad() else { continue };
        if g.shape() != p.shape() {
            return Err(Error::shape(
                op,
                format!(
                    "parameter {i} has shape {:?} but its gradient {:?}",
                    p.shape(),
                    g.shape()
                ),
            ));
        }
        if !g.dtype().is_float() {
            return Err(Error::dtype(
                op,
                g.dtype(),
                format!("gradient of parameter {i} is not a float tensor"),
            ));
        }
    }
    Ok(())
}

/// A zeroed F32 state buffer shaped and placed like parameter `p`.
pub(crate) fn state_zeros(p: &Tensor) -> Result<Tensor> {
    Tensor::zeros(p.shape(), DType::F32)?.to_device(p.device())
}

/// Reads a state: checks its kind and parameter count, and hands out its entries by name so
/// that the loader can tell which ones it did not consume (an unknown entry is an error: it
/// means the state came from a differently configured optimizer).
pub(crate) struct StateReader<'a> {
    op: &'static str,
    state: &'a OptimizerState,
    used_scalars: Vec<bool>,
    used_buffers: Vec<bool>,
}

impl<'a> StateReader<'a> {
    pub(crate) fn new(
        op: &'static str,
        state: &'a OptimizerState,
        kind: &str,
        num_params: usize,
    ) -> Result<Self> {
        if state.optimizer != kind {
            return Err(Error::arg(
                op,
                format!(
                    "state of a {:?} optimizer loaded into {kind:?}",
                    state.optimizer
                ),
            ));
        }
        let mut r = StateReader {
            op,
            state,
            used_scalars: vec![false; state.scalars.len()],
            used_buffers: vec![false; state.buffers.len()],
        };
        let n = r.scalar("num_params")?;
        if n != num_params as f64 {
            return Err(Error::arg(
                op,
                format!("state holds {n} parameters, the optimizer has {num_params}"),
            ));
        }
        Ok(r)
    }

    fn find_scalar(&mut self, name: &str) -> Option<f64> {
        let i = self.state.scalars.iter().position(|(n, _)| n == name)?;
        self.used_scalars[i] = true;
        Some(self.state.scalars[i].1)
    }

    /// A required scalar.
    pub(crate) fn scalar(&mut self, name: &str) -> Result<f64> {
        self.find_scalar(name)
            .ok_or_else(|| Error::arg(self.op, format!("state has no scalar {name:?}")))
    }

    /// A required 0/1 flag.
    pub(crate) fn flag(&mut self, name: &str) -> Result<bool> {
        match self.scalar(name)? {
            0.0 => Ok(false),
            1.0 => Ok(true),
            v => Err(Error::arg(
                self.op,
                format!("state flag {name:?} is {v}, expected 0 or 1"),
            )),
        }
    }

    /// Parameter `i`'s step count, if the state has one.
    pub(crate) fn step_count(&mut self, i: usize) -> Result<Option<u64>> {
        let name = format!("{i}.step");
        match self.find_scalar(&name) {
            None => Ok(None),
            Some(v) if v >= 1.0 && v.fract() == 0.0 && v <= 2f64.powi(53) => Ok(Some(v as u64)),
            Some(v) => Err(Error::arg(
                self.op,
                format!("state {name:?} is {v}, expected a positive integer"),
            )),
        }
    }

    /// Parameter `i`'s buffer `key`, if present, checked against the parameter's shape.
    /// The F32 buffer `"{i}.{key}"` as a tensor shaped and placed like parameter `p`.
    pub(crate) fn buffer(&mut self, i: usize, key: &str, p: &Tensor) -> Result<Option<Tensor>> {
        let name = format!("{i}.{key}");
        let Some(j) = self.state.buffers.iter().position(|b| b.name == name) else {
            return Ok(None);
        };
        self.used_buffers[j] = true;
        let b = &self.state.buffers[j];
        if b.shape != p.shape() || b.data.len() != p.numel() {
            return Err(Error::shape(
                self.op,
                format!(
                    "state buffer {name:?} has shape {:?} ({} values), parameter {i} has shape {:?}",
                    b.shape,
                    b.data.len(),
                    p.shape()
                ),
            ));
        }
        let t = Tensor::from_f32_vec(b.data.clone(), p.shape(), DType::F32)?;
        Ok(Some(t.to_device(p.device())?))
    }

    /// Errors when the state holds entries the loader did not ask for.
    pub(crate) fn finish(self) -> Result<()> {
        let unused: Vec<&str> = (self.state.scalars.iter().map(|(n, _)| n.as_str()))
            .zip(&self.used_scalars)
            .chain(
                self.state
                    .buffers
                    .iter()
                    .map(|b| b.name.as_str())
                    .zip(&self.used_buffers),
            )
            .filter(|(_, &used)| !used)
            .map(|(n, _)| n)
            .collect();
        if unused.is_empty() {
            Ok(())
        } else {
            Err(Error::arg(
                self.op,
                format!("state has entries this optimizer does not use: {unused:?}"),
            ))
        }
    }
}

/// Checks a hyper-parameter is finite and >= 0 (PyTorch's "Invalid learning rate" family).
pub(crate) fn check_nonneg(op: &'static str, name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::arg(
            op,
            format!("invalid {name}: {v} (need a finite value >= 0)"),
        ))
    }
}
