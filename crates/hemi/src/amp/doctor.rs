//! The precision doctor: which op made a half-precision step overflow, and how far each
//! module of a preset strays from FP32.
//!
//! **Named overflow.** Healthy steps run without checks. When a step is skipped (inf/NaN
//! in the scaled gradients) or an unscaled run's loss is not finite, the training loop
//! replays the step ([`replay_step`]): the same batch, the same weights (a skipped step
//! did not change them), the same loss scale and dropout masks, with the per-op checks of
//! `ops::check` on. hemi's runs are bit-reproducible, so the replay computes the step's
//! values again, bit for bit, and names the first op in forward order whose result was not
//! finite or, when the forward was finite, the first non-finite gradient in backward order.
//! The replay restores the dropout generators and batch-norm statistics it used, so the
//! run continues as if it had not happened.

use std::sync::Mutex;

use crate::amp::policy::PrecisionPolicy;
use crate::amp::scaler::scale_loss;
use crate::amp::Precision;
use crate::data::Batch;
use crate::error::Result;
use crate::nn::{Kind, Module};
use crate::ops::check::{self, BackwardCulprit, CheckReport, ForwardCulprit};
use crate::rng::Generator;
use crate::tensor::Tensor;
use crate::train::task::Task;

/// The dropout generators' states of `model` (to replay a step's masks later).
pub fn generator_states(model: &dyn Module) -> Vec<Generator> {
    model
        .generators()
        .into_iter()
        .map(|g| g.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .collect()
}

fn set_generators(gens: &[&Mutex<Generator>], states: &[Generator]) {
    for (g, s) in gens.iter().zip(states) {
        *g.lock().unwrap_or_else(|e| e.into_inner()) = s.clone();
    }
}

/// One step to replay with checks on.
pub struct Replay<'a> {
    /// The task whose loss the step minimised.
    pub task: &'a dyn Task,
    /// The step's batch (micro-batch).
    pub batch: &'a Batch,
    /// The run's preset.
    pub precision: Precision,
    /// The run's precision policy, if any.
    pub policy: Option<&'a PrecisionPolicy>,
    /// The run's label smoothing.
    pub label_smoothing: f64,
    /// The loss scale the step used (ignored where the preset does not scale).
    pub scale: f64,
    /// The dropout generators as they were before the step (`generator_states`); `None`
    /// draws from where they are now.
    pub generators: Option<&'a [Generator]>,
}

/// What a replayed step computed and what its checks found.
pub struct StepReplay {
    /// The step's loss (unscaled).
    pub loss: f64,
    /// Each parameter's gradient as the step's backward produced it (scaled), in
    /// `named_parameters` order.
    pub grads: Vec<(String, Tensor)>,
    /// The checks' findings.
    pub report: CheckReport,
}

/// Replays one step of `model` with per-op checks on (module doc). Leaves the model's
/// parameters, their gradients, its batch-norm statistics and its dropout generators as
/// they were.
pub fn replay_step(model: &mut dyn Module, r: &Replay<'_>) -> Result<StepReplay> {
    // What the replay must put back: the generators as they are now, the buffers (a
    // training-mode forward updates batch-norm statistics).
    let after = generator_states(model);
    let buffers: Vec<(String, Tensor)> = model
        .tensors()
        .into_iter()
        .filter(|t| t.2 == Kind::Buffer)
        .map(|(n, t, _, _)| (n, t.detach()))
        .collect();
    if let Some(before) = r.generators {
        set_generators(&model.generators(), before);
    }
    let result = replay_inner(&*model, r);
    set_generators(&model.generators(), &after);
    for slot in model.tensors_mut() {
        if let Some((_, b)) = buffers.iter().find(|(n, _)| *n == slot.name) {
            slot.tensor.set_data(b)?;
        }
    }
    result
}

fn replay_inner(model: &dyn Module, r: &Replay<'_>) -> Result<StepReplay> {
    let named = model.named_parameters();
    let _names = check::bind_names(&named);
    let checks = check::begin(false, 1.0);
    let loss = {
        let _scope = match r.policy {
            Some(p) => Ok(p.scope(r.precision, model)),
            None => Err(r.precision.autocast()),
        };
        r.task
            .forward(model, r.batch, r.precision, r.label_smoothing, false)?
            .loss
    };
    let scaled = if r.precision.loss_scaling() {
        scale_loss(&loss, r.scale)?
    } else {
        loss.clone()
    };
    let params: Vec<&Tensor> = named.iter().map(|(_, t)| t).collect();
    let grads = crate::autograd::grad(&scaled, &params)?;
    let report = checks.finish();
    Ok(StepReplay {
        loss: loss.to_scalar()?,
        grads: named.iter().map(|(n, _)| n.clone()).zip(grads).collect(),
        report,
    })
}

/// A finding of a replay in one line: where the overflow started.
pub fn describe(report: &CheckReport, scale: Option<f64>) -> String {
    let at = |m: &str| {
        if m.is_empty() {
            "the model's top level".to_string()
        } else {
            m.to_string()
        }
    };
    let scale = scale.map_or(String::new(), |s| format!(" at loss scale {s}"));
    match (&report.forward, &report.backward) {
        (Some(f), _) => describe_forward(f, &at(&f.module)),
        (None, Some(b)) => describe_backward(b, &at(&b.module), &scale),
        (None, None) => format!(
            "the replay found every op result and gradient finite ({} ops, {} backward \
             nodes){scale}: the overflow did not reproduce",
            report.forward_ops, report.backward_nodes
        ),
    }
}

fn describe_forward(f: &ForwardCulprit, at: &str) -> String {
    let what = if f.nan == f.nonfinite {
        "NaN"
    } else if f.nan == 0 {
        "inf"
    } else {
        "inf/NaN"
    };
    format!(
        "forward: `{}` in {at} gave {} {what} value{} in {} (op {} of the forward; its \
         inputs' largest magnitude {:.4e})",
        f.op,
        f.nonfinite,
        if f.nonfinite == 1 { "" } else { "s" },
        f.dtype,
        f.index + 1,
        f.input_max_abs
    )
}

fn describe_backward(b: &BackwardCulprit, at: &str, scale: &str) -> String {
    match (&b.param, b.op) {
        (Some(p), _) => format!(
            "backward (the forward was finite): the gradient of parameter {p} ({}) was not \
             finite{scale}",
            b.dtype
        ),
        (None, Some(op)) => format!(
            "backward (the forward was finite): the backward of `{op}` in {at} gave a \
             non-finite gradient in {} (node {} of the backward){scale}",
            b.dtype,
            b.index + 1
        ),
        (None, None) => format!("backward: a non-finite gradient in {at}{scale}"),
    }
}
