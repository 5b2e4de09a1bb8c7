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
use crate::amp::{AmpOptimizer, Precision};
use crate::data::Batch;
use crate::error::Result;
use crate::nn::{Kind, Module};
use crate::ops::check::{self, BackwardCulprit, CheckReport, ForwardCulprit};
use crate::rng::Generator;
use crate::tensor::Tensor;
use crate::train::task::Task;
use crate::train::{build_optimizer, TrainConfig};

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
    checked_step(model, r, None)
}

/// `replay_step` that also keeps the doctor's per-module records (`ops::check::begin`
/// with `record`, gradient values counted at `factor` times their value).
pub fn record_step(model: &mut dyn Module, r: &Replay<'_>, factor: f64) -> Result<StepReplay> {
    checked_step(model, r, Some(factor))
}

fn checked_step(model: &mut dyn Module, r: &Replay<'_>, record: Option<f64>) -> Result<StepReplay> {
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
    let result = replay_inner(&*model, r, record);
    set_generators(&model.generators(), &after);
    for slot in model.tensors_mut() {
        if let Some((_, b)) = buffers.iter().find(|(n, _)| *n == slot.name) {
            slot.tensor.set_data(b)?;
        }
    }
    result
}

fn replay_inner(model: &dyn Module, r: &Replay<'_>, record: Option<f64>) -> Result<StepReplay> {
    let named = model.named_parameters();
    let _names = check::bind_names(&named);
    let checks = check::begin(record.is_some(), record.unwrap_or(1.0));
    let loss = {
        let _scope = crate::train::forward_scope(r.precision, r.policy, model);
        r.task
            .forward(model, r.batch, r.precision, r.label_smoothing, false)?
            .loss
    };
    checks.end_forward();
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

// ----- the doctor: a preset against FP32, module by module ------------------------------

/// How far one module of a preset strays from the reference (means over the steps).
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleDiagnosis {
    /// The module (an op site: `layer3.1.conv2`, `layer1.0.bn1+layer1.0.conv2` for a fused
    /// op over two layers, a scope such as `bert.encoder.layer.0.attention.self`, or empty
    /// for the model's top level).
    pub module: String,
    /// ‖y − y_ref‖ / ‖y_ref‖ of the module's output (its last op's result), NaN when
    /// either is not finite.
    pub act_rel_err: f64,
    /// Cosine similarity of the module's parameter gradients (unscaled) with the
    /// reference's (NaN without parameters).
    pub grad_cosine: f64,
    /// ‖g − g_ref‖ / ‖g_ref‖ of the same gradients (NaN without parameters).
    pub grad_rel_err: f64,
    /// Share of the reference's gradient values in the module's backward that F16 flushes
    /// to zero at the run's loss scale.
    pub f16_flushed: f64,
    /// Share of them that overflow F16 at the run's loss scale.
    pub f16_overflow: f64,
    /// The largest loss scale at which none of them overflows F16 (65504 / max |g|).
    pub max_safe_scale: f64,
    /// The module's parameters (scalars).
    pub params: usize,
    /// Share of the module's weights with a nonzero gradient that the optimizer step left
    /// unchanged: updates too small for the weights' dtype to hold (the half-weight presets'
    /// drift; zero with F32 weights unless the update itself underflows).
    pub update_lost: f64,
}

/// What `diagnose` found.
#[derive(Clone, Debug)]
pub struct Diagnosis {
    /// The preset diagnosed.
    pub precision: Precision,
    /// The reference's dtype (F32, or F64 for checking the doctor itself).
    pub reference: crate::DType,
    /// Steps run.
    pub steps: usize,
    /// The loss scale of the first step (1.0 where the preset does not scale).
    pub scale: f64,
    /// Per module, in forward order.
    pub modules: Vec<ModuleDiagnosis>,
    /// The preset's training loss at each step.
    pub loss_preset: Vec<f64>,
    /// The FP32 run's training loss at each step (same initial weights and batches; FP32
    /// also when `reference` is F64).
    pub loss_reference: Vec<f64>,
    /// Mean |loss − loss_ref| at the same weights (the forward's own error).
    pub loss_same_weights: f64,
    /// Steps the preset skipped.
    pub skipped: u64,
    /// The first skipped step's named overflow, if any.
    pub overflow: Option<String>,
}

impl Diagnosis {
    /// Mean loss over the last quarter of the steps (at least one), preset minus reference.
    pub fn loss_difference(&self) -> f64 {
        tail_mean(&self.loss_preset) - tail_mean(&self.loss_reference)
    }

    /// Modules ordered by how much precision each loses *itself*: the rise of the
    /// activation error over the module before it (an error made upstream is not its
    /// fault), the gradient error, the gradient overflow and flushed shares, and the share
    /// of its weight updates lost to the weights' dtype. Modules that cannot be pinned
    /// (the model's top level) are left out.
    pub fn ranking(&self) -> Vec<&ModuleDiagnosis> {
        let mut prev = 0.0f64;
        let mut v: Vec<(f64, &ModuleDiagnosis)> = Vec::new();
        for m in &self.modules {
            let e = if m.act_rel_err.is_finite() {
                m.act_rel_err
            } else {
                f64::INFINITY
            };
            let g = if m.grad_rel_err.is_finite() {
                m.grad_rel_err
            } else {
                0.0
            };
            let rise = (e - prev).max(0.0);
            if e.is_finite() {
                prev = prev.max(e);
            }
            let score = rise + 0.1 * g + m.f16_overflow * 10.0 + m.f16_flushed + m.update_lost;
            if !m.module.is_empty() {
                v.push((score, m));
            }
        }
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
        v.into_iter().map(|(_, m)| m).collect()
    }

    /// The report as a text table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "precision doctor: {} against {} over {} step{}, loss scale {}\n",
            self.precision,
            if self.reference == crate::DType::F64 {
                "f64"
            } else {
                "fp32"
            },
            self.steps,
            if self.steps == 1 { "" } else { "s" },
            self.scale
        );
        let w = self
            .modules
            .iter()
            .map(|m| {
                if m.module.is_empty() {
                    11
                } else {
                    m.module.len()
                }
            })
            .max()
            .unwrap_or(6)
            .clamp(6, 60);
        s += &format!(
            "{:<w$}  {:>10}  {:>9}  {:>10}  {:>9}  {:>9}  {:>10}  {:>9}\n",
            "module",
            "act err",
            "grad cos",
            "grad err",
            "f16 flush",
            "f16 ovfl",
            "max scale",
            "upd lost"
        );
        let f = |v: f64, p: usize| {
            if v.is_nan() {
                "-".to_string()
            } else {
                format!("{v:.p$e}")
            }
        };
        for m in &self.modules {
            let name = if m.module.is_empty() {
                "(top level)"
            } else {
                &m.module
            };
            s += &format!(
                "{:<w$}  {:>10}  {:>9}  {:>10}  {:>8.3}%  {:>8.3}%  {:>10}  {:>8.3}%\n",
                name,
                f(m.act_rel_err, 2),
                if m.grad_cosine.is_nan() {
                    "-".into()
                } else {
                    format!("{:.6}", m.grad_cosine)
                },
                f(m.grad_rel_err, 2),
                100.0 * m.f16_flushed,
                100.0 * m.f16_overflow,
                f(m.max_safe_scale, 1),
                100.0 * m.update_lost,
            );
        }
        s += &format!(
            "loss: preset {:.5}, reference {:.5} (last quarter of the steps; difference {:+.5}); \
             at the same weights |difference| {:.3e}; {} skipped step{}\n",
            tail_mean(&self.loss_preset),
            tail_mean(&self.loss_reference),
            self.loss_difference(),
            self.loss_same_weights,
            self.skipped,
            if self.skipped == 1 { "" } else { "s" }
        );
        if let Some(o) = &self.overflow {
            s += &format!("first overflow: {o}\n");
        }
        s
    }

    /// The report as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let num = |v: f64| {
            if v.is_finite() {
                serde_json::Value::from(v)
            } else {
                serde_json::Value::Null
            }
        };
        let modules: Vec<serde_json::Value> = self
            .modules
            .iter()
            .map(|m| {
                serde_json::json!({
                    "module": m.module, "act_rel_err": num(m.act_rel_err),
                    "grad_cosine": num(m.grad_cosine), "grad_rel_err": num(m.grad_rel_err),
                    "f16_flushed": m.f16_flushed, "f16_overflow": m.f16_overflow,
                    "max_safe_scale": num(m.max_safe_scale), "params": m.params,
                    "update_lost": m.update_lost,
                })
            })
            .collect();
        serde_json::json!({
            "kind": "doctor", "precision": self.precision.name(),
            "reference": self.reference.to_string(), "steps": self.steps, "scale": self.scale,
            "modules": modules,
            "loss_preset": self.loss_preset.iter().map(|&v| num(v)).collect::<Vec<_>>(),
            "loss_reference": self.loss_reference.iter().map(|&v| num(v)).collect::<Vec<_>>(),
            "loss_difference": num(self.loss_difference()),
            "loss_same_weights": num(self.loss_same_weights),
            "skipped": self.skipped, "overflow": self.overflow,
        })
    }
}

/// Mean of the last quarter of `v` (at least one value; NaN when empty).
pub fn tail_mean(v: &[f64]) -> f64 {
    let k = (v.len() / 4).max(1);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() - k..].iter().sum::<f64>() / k as f64
}

/// Sums for one module over the steps.
#[derive(Default, Clone)]
struct Acc {
    act: f64,
    act_n: usize,
    act_bad: bool,
    dot: f64,
    gg: f64,
    rr: f64,
    diff: f64,
    grad_n: usize,
    grad_bad: bool,
    count: u64,
    flushed: u64,
    overflow: u64,
    max_abs: f64,
    params: usize,
}

fn rel(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() != b.len() {
        return None;
    }
    let (mut d, mut n) = (0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        d += (x - y) * (x - y);
        n += y * y;
    }
    Some(if n > 0.0 { (d / n).sqrt() } else { d.sqrt() })
}

/// One training step of `model` (forward, scaled backward, optimizer step); its loss.
fn train_step(
    model: &dyn Module,
    opt: &mut AmpOptimizer,
    batch: &Batch,
    cfg: &TrainConfig,
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
) -> Result<f64> {
    opt.zero_grad();
    let loss = {
        let _scope = crate::train::forward_scope(precision, policy, model);
        cfg.task
            .forward(model, batch, precision, cfg.label_smoothing, false)?
            .loss
    };
    let lv = loss.to_scalar()?;
    opt.backward(&loss)?;
    opt.step()?;
    Ok(lv)
}

/// Trains `make()` for `batches.len()` steps under `cfg`'s precision and policy; the
/// losses and the steps skipped.
pub fn train_losses(
    make: &dyn Fn() -> Result<Box<dyn Module>>,
    batches: &[Batch],
    cfg: &TrainConfig,
    precision: Precision,
    policy: Option<&PrecisionPolicy>,
) -> Result<(Vec<f64>, u64)> {
    let mut m = make()?;
    match policy {
        Some(p) => p.prepare_model(precision, &mut *m)?,
        None => precision.prepare_model(&mut *m)?,
    }
    m.set_training(true);
    let mut losses = Vec::with_capacity(batches.len());
    let mut opt = AmpOptimizer::new(
        precision,
        m.parameters(),
        cfg.scaler.clone(),
        cfg.seed,
        |p| build_optimizer(cfg, p),
    )?;
    for b in batches {
        losses.push(train_step(&*m, &mut opt, b, cfg, precision, policy)?);
    }
    Ok((losses, opt.skipped_steps()))
}

/// The precision doctor: trains `make()` for one step per batch under `cfg.precision` (with
/// `cfg.policy`), and at each step compares the preset's forward and backward, module by
/// module, with `reference` (F32, or F64) at the same weights and batch; a second copy
/// trains in the reference precision from the same initial weights for the loss
/// comparison. `make` must build the same initial model every time (same seed).
pub fn diagnose(
    make: &dyn Fn() -> Result<Box<dyn Module>>,
    batches: &[Batch],
    cfg: &TrainConfig,
    reference: crate::DType,
) -> Result<Diagnosis> {
    let precision = cfg.precision;
    let policy = cfg.policy.as_ref().filter(|p| !p.is_empty());
    let mut mp = make()?;
    if let Some(p) = policy {
        p.validate(&*mp)?;
    }
    match policy {
        Some(p) => p.prepare_model(precision, &mut *mp)?,
        None => precision.prepare_model(&mut *mp)?,
    }
    mp.set_training(true);
    let mut mref = make()?;
    mref.to_dtype(reference, false)?;
    mref.set_training(true);
    let mut opt = AmpOptimizer::new(
        precision,
        mp.parameters(),
        cfg.scaler.clone(),
        cfg.seed,
        |p| build_optimizer(cfg, p),
    )?;
    let param_modules: Vec<(String, usize)> = mp
        .named_parameters()
        .iter()
        .map(|(n, t)| (check::module_of(n).to_string(), t.numel()))
        .collect();
    let mut order: Vec<String> = Vec::new();
    let mut acc: std::collections::HashMap<String, Acc> = Default::default();
    let (mut loss_preset, mut same) = (Vec::new(), 0.0);
    let mut first_scale = None;
    let mut overflow = None;
    // Per parameter module: (weights left unchanged though their gradient was not zero,
    // weights with a nonzero gradient).
    let mut lost: std::collections::HashMap<String, (u64, u64)> = Default::default();
    for b in batches {
        let scale = if precision.loss_scaling() {
            opt.scale()
        } else {
            1.0
        };
        first_scale.get_or_insert(scale);
        mref.load_state_dict(&mp.state_dict())?;
        let gens = generator_states(&*mp);
        set_generators(&mref.generators(), &gens);
        let replay = |policy, precision, scale| Replay {
            task: cfg.task.as_ref(),
            batch: b,
            precision,
            policy,
            label_smoothing: cfg.label_smoothing,
            scale,
            generators: Some(&gens),
        };
        let rp = record_step(&mut *mp, &replay(policy, precision, scale), 1.0)?;
        let rr = record_step(&mut *mref, &replay(None, Precision::Fp32, 1.0), scale)?;
        same += (rp.loss - rr.loss).abs();
        compare(&rp, &rr, scale, &param_modules, &mut order, &mut acc)?;
        let skipped = opt.skipped_steps();
        let before: Vec<Vec<f32>> = mp.parameters().iter().map(|t| t.to_vec_f32()).collect();
        loss_preset.push(train_step(&*mp, &mut opt, b, cfg, precision, policy)?);
        if opt.skipped_steps() == skipped {
            for (i, t) in mp.parameters().iter().enumerate() {
                let Some(g) = t.grad() else { continue };
                let (g, after) = (g.to_vec_f32(), t.to_vec_f32());
                let e = lost
                    .entry(param_modules[i].0.clone())
                    .or_insert((0u64, 0u64));
                for ((g, a), b) in g.iter().zip(&after).zip(&before[i]) {
                    if *g != 0.0 {
                        e.1 += 1;
                        e.0 += u64::from(a.to_bits() == b.to_bits());
                    }
                }
            }
        }
        if opt.skipped_steps() > skipped && overflow.is_none() {
            let r = replay_step(&mut *mp, &replay(policy, precision, scale))?;
            overflow = Some(describe(&r.report, Some(scale)));
        }
    }
    // The loss trajectory's reference trains in FP32 (optimizers update F32 state; an f64
    // reference is for the per-step comparisons).
    let (loss_reference, _) = train_losses(make, batches, cfg, Precision::Fp32, None)?;
    let n = batches.len().max(1) as f64;
    let modules = order
        .iter()
        .map(|m| {
            let a = &acc[m];
            let grads = a.grad_n > 0;
            ModuleDiagnosis {
                module: m.clone(),
                act_rel_err: if a.act_bad || a.act_n == 0 {
                    f64::NAN
                } else {
                    a.act / a.act_n as f64
                },
                grad_cosine: if !grads || a.grad_bad {
                    f64::NAN
                } else {
                    a.dot / (a.gg.sqrt() * a.rr.sqrt()).max(f64::MIN_POSITIVE)
                },
                grad_rel_err: if !grads || a.grad_bad {
                    f64::NAN
                } else if a.rr > 0.0 {
                    (a.diff / a.rr).sqrt()
                } else {
                    a.diff.sqrt()
                },
                f16_flushed: if a.count > 0 {
                    a.flushed as f64 / a.count as f64
                } else {
                    0.0
                },
                f16_overflow: if a.count > 0 {
                    a.overflow as f64 / a.count as f64
                } else {
                    0.0
                },
                max_safe_scale: if a.max_abs > 0.0 {
                    65504.0 / a.max_abs
                } else {
                    f64::INFINITY
                },
                params: a.params,
                update_lost: {
                    let (u, n) = m
                        .split('+')
                        .filter_map(|x| lost.get(x))
                        .fold((0, 0), |(u, n), &(a, b)| (u + a, n + b));
                    if n > 0 {
                        u as f64 / n as f64
                    } else {
                        0.0
                    }
                },
            }
        })
        .collect();
    Ok(Diagnosis {
        precision,
        reference,
        steps: batches.len(),
        scale: first_scale.unwrap_or(1.0),
        modules,
        loss_preset,
        loss_reference,
        loss_same_weights: same / n,
        skipped: opt.skipped_steps(),
        overflow,
    })
}

/// Adds one step's comparison of the preset's records `p` with the reference's `r`.
fn compare(
    p: &StepReplay,
    r: &StepReplay,
    scale: f64,
    param_modules: &[(String, usize)],
    order: &mut Vec<String>,
    acc: &mut std::collections::HashMap<String, Acc>,
) -> Result<()> {
    let pmods: std::collections::HashMap<&str, &check::ModuleRecord> = p
        .report
        .modules
        .iter()
        .map(|(m, rec)| (m.as_str(), rec))
        .collect();
    for (site, rec) in &r.report.modules {
        if !order.contains(site) {
            order.push(site.clone());
        }
        let a = acc.entry(site.clone()).or_default();
        // Activations.
        if let (Some(yr), Some(yp)) = (
            rec.output.as_ref(),
            pmods.get(site.as_str()).and_then(|x| x.output.as_ref()),
        ) {
            let (vr, vp) = (yr.to_vec_f64(), yp.to_vec_f64());
            match rel(&vp, &vr) {
                Some(e) if e.is_finite() => {
                    a.act += e;
                    a.act_n += 1;
                }
                Some(_) => a.act_bad = true,
                None => {}
            }
        }
        // Gradient values against F16's range (the reference's, times the scale).
        a.count += rec.grad_count;
        a.flushed += rec.grad_underflow;
        a.overflow += rec.grad_overflow;
        a.max_abs = a.max_abs.max(rec.grad_max_abs);
        // Parameter gradients of the module(s) the site covers.
        let mods: Vec<&str> = site.split('+').collect();
        let mut gp: Vec<f64> = Vec::new();
        let mut gr: Vec<f64> = Vec::new();
        let mut params = 0;
        for (i, (m, n)) in param_modules.iter().enumerate() {
            if !mods.contains(&m.as_str()) || site.is_empty() {
                continue;
            }
            params += n;
            gp.extend(p.grads[i].1.to_vec_f64().iter().map(|v| v / scale));
            gr.extend(r.grads[i].1.to_vec_f64());
        }
        a.params = params;
        if !gr.is_empty() {
            a.grad_n += 1;
            if gp.iter().any(|v| !v.is_finite()) {
                a.grad_bad = true;
            }
            for (x, y) in gp.iter().zip(&gr) {
                a.dot += x * y;
                a.gg += x * x;
                a.rr += y * y;
                a.diff += (x - y) * (x - y);
            }
        }
    }
    Ok(())
}
