//! The precision doctor: named overflow (a replay with per-op checks names the first
//! non-finite op in forward order, else the first non-finite gradient in backward order),
//! the replay being bit-identical to the step it replays, and precision policies.

use hemi::amp::{Precision, PrecisionPolicy};
use hemi::data::{Batch, Inputs};
use hemi::nn::{Dropout, Flatten, Linear, Module, Relu, Sequential};
use hemi::rng::Generator;
use hemi::train::doctor::{generator_states, replay_step, Replay};
use hemi::train::task::{Classification, Task};
use hemi::{DType, Tensor};

/// Flatten, fc (4 → 8), ReLU, fc (8 → 8), dropout, fc (8 → 3); `big` multiplies the
/// middle layer's weights (at 1e5 its F16 output overflows: inputs of magnitude ~10).
fn net(big: f32, dropout: f64) -> Sequential {
    let mut rng = Generator::new(7);
    let fc2 = Linear::new(8, 8, true, &mut rng).unwrap();
    let w = fc2
        .weight
        .to_vec_f32()
        .iter()
        .map(|v| v * big)
        .collect::<Vec<_>>();
    fc2.weight
        .set_data(&Tensor::from_vec(w, &[8, 8]).unwrap())
        .unwrap();
    Sequential::new()
        .add(Flatten)
        .add(Linear::new(4, 8, true, &mut rng).unwrap())
        .add(Relu)
        .add(fc2)
        .add(Dropout::new(dropout, 11).unwrap())
        .add(Linear::new(8, 3, true, &mut rng).unwrap())
}

fn batch(magnitude: f32) -> Batch {
    let x: Vec<f32> = (0..6 * 4)
        .map(|i| magnitude * (((i * 37) % 11) as f32 / 11.0 - 0.3))
        .collect();
    Batch {
        inputs: Inputs::Images(Tensor::from_vec(x, &[6, 1, 1, 4]).unwrap()),
        labels: Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2], &[6]).unwrap(),
        indices: (0..6).collect(),
    }
}

fn replay(
    model: &mut dyn Module,
    b: &Batch,
    p: Precision,
    scale: f64,
) -> hemi::train::doctor::StepReplay {
    replay_step(
        model,
        &Replay {
            task: &Classification,
            batch: b,
            precision: p,
            policy: None,
            label_smoothing: 0.0,
            scale,
            generators: None,
        },
    )
    .unwrap()
}

/// A module whose F16 activations exceed 65504 is named exactly, in forward order.
#[test]
fn a_forward_overflow_is_named_by_op_and_module() {
    let mut m = net(1e5, 0.0);
    let r = replay(&mut m, &batch(10.0), Precision::AmpFp16, 1.0);
    let f = r.report.forward.expect("the forward overflows");
    assert_eq!(f.op, "linear");
    assert_eq!(f.module, "3", "the Sequential's fc2 is layer 3");
    assert_eq!(f.dtype, DType::F16);
    assert!(f.nonfinite > 0);
    // Its inputs were finite and of the magnitude the batch gives (the culprit is the op,
    // not an earlier one).
    assert!(f.input_max_abs.is_finite() && f.input_max_abs > 1.0);
    // The same model in FP32 is finite everywhere.
    let r32 = replay(&mut m, &batch(10.0), Precision::Fp32, 1.0);
    assert!(r32.report.forward.is_none() && r32.report.backward.is_none());
    assert!(r32.report.forward_ops > 5);
}

/// A finite forward whose scaled gradients overflow F16 is named by the gradient.
#[test]
fn a_backward_only_overflow_is_named_by_its_gradient() {
    let mut m = net(1.0, 0.0);
    let b = batch(1.0);
    // At scale 2^10 every gradient is finite; at 2^40 the backward overflows F16 (the
    // scaled loss itself is finite in F32).
    let ok = replay(&mut m, &b, Precision::AmpFp16, 1024.0);
    assert!(ok.report.forward.is_none() && ok.report.backward.is_none());
    let r = replay(&mut m, &b, Precision::AmpFp16, 2f64.powi(40));
    assert!(r.report.forward.is_none(), "{:?}", r.report.forward);
    let g = r.report.backward.clone().expect("the backward overflows");
    assert_eq!(g.dtype, DType::F16);
    assert!(g.op.is_some());
    // The first non-finite gradient comes before any parameter's: the node is named.
    assert!(g.index < r.report.backward_nodes);
    let msg = hemi::train::doctor::describe(&r.report, Some(2f64.powi(40)));
    assert!(
        msg.contains("backward") && msg.contains("loss scale"),
        "{msg}"
    );
}

/// The replay computes the step's loss and gradients again, bit for bit (dropout masks
/// included), and leaves the generators where the step left them.
#[test]
fn the_replay_is_bit_identical_to_the_step_it_replays() {
    for p in [Precision::AmpFp16, Precision::Fp32, Precision::AmpBf16] {
        let mut m = net(1.0, 0.3);
        let b = batch(3.0);
        let scale = 256.0;
        let before = generator_states(&m);
        // The step as the training loop takes it.
        let loss = {
            let _ac = p.autocast();
            Classification.forward(&m, &b, p, 0.0, false).unwrap().loss
        };
        let scaled = if p.loss_scaling() {
            loss.to_dtype(DType::F32)
                .unwrap()
                .mul_scalar(scale)
                .unwrap()
        } else {
            loss.clone()
        };
        scaled.backward().unwrap();
        let grads: Vec<Vec<u32>> = m
            .parameters()
            .iter()
            .map(|t| {
                t.grad()
                    .unwrap()
                    .to_vec_f32()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        let after = generator_states(&m);
        let r = replay_step(
            &mut m,
            &Replay {
                task: &Classification,
                batch: &b,
                precision: p,
                policy: None,
                label_smoothing: 0.0,
                scale,
                generators: Some(&before),
            },
        )
        .unwrap();
        assert_eq!(
            r.loss.to_bits(),
            loss.to_scalar().unwrap().to_bits(),
            "{p:?}"
        );
        for (i, (_, g)) in r.grads.iter().enumerate() {
            let bits: Vec<u32> = g.to_vec_f32().iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, grads[i], "{p:?}: gradient {i}");
        }
        // The run continues as if the replay had not happened.
        let now = generator_states(&m);
        for (a, b) in now.iter().zip(&after) {
            assert_eq!(a.clone().next_u64(), b.clone().next_u64());
        }
        // The parameters' accumulated gradients are untouched.
        for (i, t) in m.parameters().iter().enumerate() {
            let bits: Vec<u32> = t
                .grad()
                .unwrap()
                .to_vec_f32()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(bits, grads[i]);
        }
    }
}

/// Modules pinned to F32 compute in F32 under amp-fp16 and under pure-fp16 (where their
/// weights stay F32 too): pinning the layer the doctor named and the one its output feeds
/// removes the overflow; an unpinned layer after a pinned one computes in F16 again.
#[test]
fn a_policy_pins_a_module_to_f32_and_cures_its_overflow() {
    let policy = PrecisionPolicy::from_json(r#"{"modules": {"3": "f32", "5": "f32"}}"#).unwrap();
    let first = PrecisionPolicy::from_json(r#"{"modules": {"1": "f32"}}"#).unwrap();
    for p in [
        Precision::AmpFp16,
        Precision::PureFp16,
        Precision::Fp16Master,
    ] {
        let mut m = net(1e5, 0.0);
        policy.validate(&m).unwrap();
        policy.prepare_model(p, &mut m).unwrap();
        let dtypes: Vec<DType> = m.parameters().iter().map(|t| t.dtype()).collect();
        if p != Precision::AmpFp16 {
            // fc1 (2), fc2 and fc3 pinned (2 + 2).
            assert_eq!(
                dtypes,
                [
                    DType::F16,
                    DType::F16,
                    DType::F32,
                    DType::F32,
                    DType::F32,
                    DType::F32
                ]
            );
        }
        let r = replay_step(
            &mut m,
            &Replay {
                task: &Classification,
                batch: &batch(10.0),
                precision: p,
                policy: Some(&policy),
                label_smoothing: 0.0,
                scale: 1.0,
                generators: None,
            },
        )
        .unwrap();
        assert!(r.report.forward.is_none(), "{p:?}: {:?}", r.report.forward);
        let y = {
            let _s = policy.scope(p, &m);
            m.forward(&p.input(batch(10.0).images().unwrap()).unwrap())
                .unwrap()
        };
        assert_eq!(y.dtype(), DType::F32, "{p:?}");
        assert!(y.to_vec_f32().iter().all(|v| v.is_finite()));
        // fc1 pinned: the layers after it go back to the preset's dtype.
        let mut m = net(1.0, 0.0);
        first.prepare_model(p, &mut m).unwrap();
        let y = {
            let _s = first.scope(p, &m);
            m.forward(&p.input(batch(1.0).images().unwrap()).unwrap())
                .unwrap()
        };
        assert_eq!(y.dtype(), DType::F16, "{p:?}");
        // Without the policy the same model overflows.
        let mut plain = net(1e5, 0.0);
        p.prepare_model(&mut plain).unwrap();
        let r = replay(&mut plain, &batch(10.0), p, 1.0);
        assert!(r.report.forward.is_some(), "{p:?}");
    }
}

/// Unknown names are errors naming them and the nearest real ones; op pins work.
#[test]
fn policy_files_are_checked_against_the_model() {
    let m = net(1.0, 0.0);
    let e = PrecisionPolicy::from_json(r#"{"modules": {"33": "f32"}}"#)
        .unwrap()
        .validate(&m)
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"33\"") && e.contains("nearest: 3"), "{e}");
    let e = PrecisionPolicy::from_json(r#"{"ops": {"softmx": "f32"}}"#)
        .unwrap()
        .validate(&m)
        .unwrap_err()
        .to_string();
    assert!(e.contains("softmx") && e.contains("softmax"), "{e}");
    let e = PrecisionPolicy::from_json(r#"{"ops": {"relu": "f32"}}"#)
        .unwrap()
        .validate(&m)
        .unwrap_err()
        .to_string();
    assert!(e.contains("keeps its input dtype"), "{e}");
    for bad in [
        r#"{"modules": {"3": "f8"}}"#,
        r#"{"layers": {}}"#,
        "[1]",
        "{",
    ] {
        assert!(PrecisionPolicy::from_json(bad).is_err(), "{bad}");
    }
    // An op pin: linear in F32 everywhere under amp-fp16.
    let p = PrecisionPolicy::from_json(r#"{"ops": {"linear": "f32"}}"#).unwrap();
    p.validate(&m).unwrap();
    let y = {
        let _s = p.scope(Precision::AmpFp16, &m);
        m.forward(batch(1.0).images().unwrap()).unwrap()
    };
    assert_eq!(y.dtype(), DType::F32);
    // The round trip through the file format.
    let q = PrecisionPolicy::from_json(&p.to_json()).unwrap();
    assert_eq!(p, q);
}

fn small() -> hemi::Result<Box<dyn Module>> {
    let mut rng = Generator::new(3);
    Ok(Box::new(
        Sequential::new()
            .add(Flatten)
            .add(Linear::new(4, 8, true, &mut rng)?)
            .add(Relu)
            .add(Linear::new(8, 3, true, &mut rng)?),
    ))
}

fn cfg(p: Precision) -> hemi::train::TrainConfig {
    hemi::train::TrainConfig {
        precision: p,
        lr: 0.05,
        ..Default::default()
    }
}

fn module<'a>(
    d: &'a hemi::train::doctor::Diagnosis,
    m: &str,
) -> &'a hemi::train::doctor::ModuleDiagnosis {
    d.modules
        .iter()
        .find(|x| x.module == m)
        .unwrap_or_else(|| panic!("no module {m}: {:?}", d.modules))
}

/// A model whose every module computes in F32, against F32: every error is exactly zero.
#[test]
fn the_doctor_reports_zeros_when_the_preset_is_the_reference() {
    let batches = vec![batch(2.0), batch(1.0), batch(3.0)];
    let d =
        hemi::train::doctor::diagnose(&small, &batches, &cfg(Precision::Fp32), DType::F32).unwrap();
    assert!(d.modules.len() >= 3, "{:?}", d.modules);
    for m in &d.modules {
        assert_eq!(m.act_rel_err, 0.0, "{}", m.module);
        if m.params > 0 {
            assert_eq!(m.grad_rel_err, 0.0, "{}", m.module);
            assert!((m.grad_cosine - 1.0).abs() < 1e-12, "{}", m.module);
        }
    }
    assert_eq!(d.loss_same_weights, 0.0);
    assert_eq!(d.loss_difference(), 0.0);
    assert_eq!(d.loss_preset, d.loss_reference);
}

/// The errors the doctor reports for F32 and amp-fp16 against an f64 reference are the ones
/// computed here directly, and within what the dtypes allow.
#[test]
fn the_doctors_errors_match_an_f64_computation() {
    let b = batch(2.0);
    let rel = |a: &[f64], r: &[f64]| {
        let d: f64 = a.iter().zip(r).map(|(x, y)| (x - y) * (x - y)).sum();
        let n: f64 = r.iter().map(|y| y * y).sum();
        (d / n).sqrt()
    };
    // The first layer's output and the last layer's gradients, by hand.
    let x = b.images().unwrap().flatten(1, -1).unwrap();
    let grads = |m: &dyn Module, p: Precision| -> Vec<f64> {
        let loss = {
            let _ac = p.autocast();
            Classification.forward(m, &b, p, 0.0, false).unwrap().loss
        };
        loss.backward().unwrap();
        let ps = m.parameters();
        let mut v = ps[2].grad().unwrap().to_vec_f64();
        v.extend(ps[3].grad().unwrap().to_vec_f64());
        v
    };
    let m64 = {
        let mut m = small().unwrap();
        m.to_dtype(DType::F64, false).unwrap();
        m
    };
    let p64 = m64.parameters();
    let y64 = x
        .to_dtype(DType::F64)
        .unwrap()
        .linear(&p64[0], Some(&p64[1]))
        .unwrap()
        .to_vec_f64();
    let g64 = grads(&*m64, Precision::Fp32);
    for (p, act_hi, grad_hi) in [
        // F32: rounding of 4-term sums and of the loss's exp/log: a few F32 ulps.
        (Precision::Fp32, 1e-6, 1e-5),
        // F16 inputs, weights and outputs: a few F16 ulps (2^-11 = 4.9e-4).
        (Precision::AmpFp16, 3.0 * 4.9e-4, 3e-2),
    ] {
        let d =
            hemi::train::doctor::diagnose(&small, std::slice::from_ref(&b), &cfg(p), DType::F64)
                .unwrap();
        let m32 = small().unwrap();
        let w = m32.parameters();
        let y = {
            let _ac = p.autocast();
            x.linear(&w[0], Some(&w[1])).unwrap().to_vec_f64()
        };
        let want = rel(&y, &y64);
        let got = module(&d, "1").act_rel_err;
        assert!(want > 0.0 && want < act_hi, "{p:?}: {want}");
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "{p:?}: doctor {got}, by hand {want}"
        );
        let want = rel(&grads(&*m32, p), &g64);
        let got = module(&d, "3").grad_rel_err;
        assert!(want > 0.0 && want < grad_hi, "{p:?}: {want}");
        assert!(
            (got - want).abs() <= 1e-6 * want,
            "{p:?}: doctor {got}, by hand {want}"
        );
    }
}

/// Every preset trains with a policy that keeps a module's weights in F32 (the optimizers
/// take the pinned F32 parameters beside the half ones), and the pinned module's weights
/// stay F32 through the steps.
#[test]
fn every_preset_trains_with_pinned_f32_modules() {
    let policy = PrecisionPolicy::from_json(r#"{"modules": {"3": "f32"}}"#).unwrap();
    let batches = vec![batch(1.0), batch(2.0), batch(1.5)];
    for p in hemi::amp::Precision::ALL {
        let mut c = cfg(p);
        c.policy = Some(policy.clone());
        let (losses, _) =
            hemi::train::doctor::train_losses(&small_pinnable, &batches, &c, p, Some(&policy))
                .unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert!(losses.iter().all(|l| l.is_finite()), "{p:?}: {losses:?}");
        assert!(losses[2] != losses[0], "{p:?}: the weights moved");
    }
}

fn small_pinnable() -> hemi::Result<Box<dyn Module>> {
    Ok(Box::new(net(1.0, 0.0)))
}

mod auto_promote {
    use std::sync::Arc;

    use hemi::amp::Precision;
    use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
    use hemi::models::Mlp;
    use hemi::nn::Module;
    use hemi::train::{load_checkpoint, train, Event, RunInfo, TrainConfig};
    use hemi::{Generator, Tensor};

    fn loaders() -> (DataLoader, DataLoader) {
        let tr = Arc::new(Synthetic::generate(3, Split::Train, 256));
        let te = Arc::new(Synthetic::generate(3, Split::Test, 64));
        let cfg = |shuffle| LoaderConfig {
            batch_size: 32,
            shuffle,
            seed: 5,
            transform: Transform::to_tensor_normalize_half(),
            ..Default::default()
        };
        (
            DataLoader::new(tr, cfg(true)).unwrap(),
            DataLoader::new(te, cfg(false)).unwrap(),
        )
    }

    /// An MLP whose first layer's F16 outputs overflow: weights 1e5 times PyTorch's init.
    fn model() -> Mlp {
        let m = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap();
        let w = m
            .fc1
            .weight
            .to_vec_f32()
            .iter()
            .map(|v| v * 1e5)
            .collect::<Vec<_>>();
        m.fc1
            .weight
            .set_data(&Tensor::from_vec(w, m.fc1.weight.shape()).unwrap())
            .unwrap();
        m
    }

    fn info() -> RunInfo {
        RunInfo {
            model: "mlp".into(),
            dataset: "synthetic".into(),
            input_shape: [3, 32, 32],
            classes: 10,
            seed: 1,
            precision: "amp-fp16".into(),
            ..Default::default()
        }
    }

    /// The replays name fc1, `--auto-promote 2` pins it to F32 after its second overflow, the
    /// run stops skipping, the checkpoint records the promotion and a resumed run ends
    /// bit-identical to an uninterrupted one.
    #[test]
    fn a_module_that_keeps_overflowing_is_promoted_and_the_run_resumes_identically() {
        let (tr, te) = loaders();
        let dir = std::env::temp_dir().join(format!("hemi-promote-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = TrainConfig {
            epochs: 3,
            lr: 0.01,
            precision: Precision::AmpFp16,
            auto_promote: Some(2),
            ..Default::default()
        };
        let mut whole = model();
        let (mut named, mut promoted, mut skips_after) = (Vec::new(), Vec::new(), 0u64);
        let mut last_skipped = 0;
        let s = train(&mut whole, &tr, &te, &cfg, &info(), &mut |e| match e {
            Event::Overflow {
                forward,
                backward,
                global_step,
                ..
            } => named.push((
                global_step.to_owned(),
                forward.as_ref().map(|f| f.module.clone()),
                backward.as_ref().map(|b| b.module.clone()),
            )),
            Event::Promoted { modules, .. } => promoted.extend(modules.iter().cloned()),
            Event::Batch { skipped, .. } => {
                if !promoted.is_empty() && *skipped > last_skipped {
                    skips_after += 1;
                }
                last_skipped = *skipped;
            }
            _ => {}
        })
        .unwrap();
        assert!(named.len() >= 2, "{named:?}");
        assert_eq!(named[0].1.as_deref(), Some("fc1"), "{named:?}");
        assert_eq!(
            promoted.first().map(String::as_str),
            Some("fc1"),
            "{promoted:?}"
        );
        // The skips stop once the culprits are F32 (fc1, then at most fc2, which its
        // large F32 outputs feed).
        assert!(
            s.skipped_steps <= 8,
            "{} skipped: {named:?}",
            s.skipped_steps
        );
        assert!(
            skips_after <= 4,
            "{skips_after} skips after the first promotion: {named:?}, {promoted:?}"
        );
        // The last epoch (steps 17..24) trains without a skip.
        assert!(
            named.iter().all(|n| n.0 <= 16),
            "skips in the last epoch: {named:?}"
        );
        assert!(s.test_accuracy.is_finite());

        // Interrupted after epoch 1 and resumed: the checkpoint carries the promotion.
        let stop = TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            stop_after: Some(1),
            ..cfg.clone()
        };
        let mut first = model();
        train(&mut first, &tr, &te, &stop, &info(), &mut |_| {}).unwrap();
        let ck = load_checkpoint(&dir).unwrap();
        let rec = ck
            .info
            .settings
            .get("promoted")
            .cloned()
            .unwrap_or_default();
        assert!(
            rec.contains("fc1"),
            "checkpoint settings: {:?}",
            ck.info.settings
        );
        let resume = TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            resume: true,
            ..cfg.clone()
        };
        let mut resumed = model();
        train(&mut resumed, &tr, &te, &resume, &info(), &mut |_| {}).unwrap();
        for ((n, a), (_, b)) in whole.state_dict().iter().zip(resumed.state_dict().iter()) {
            let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{n} differs after resume"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
