//! Precision presets end to end: names, the underflow that loss scaling exists for, the
//! training loop under each preset, and resume restoring the loss scale.

use std::sync::Arc;

use hemi::amp::{AmpOptimizer, GradScalerConfig, Precision};
use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
use hemi::models::Mlp;
use hemi::nn::{Linear, Module};
use hemi::optim::{Optimizer, Sgd, SgdConfig};
use hemi::train::{load_checkpoint, train, Event, OptimizerKind, RunInfo, TrainConfig};
use hemi::{DType, Generator, Result, Tensor};

#[test]
fn names_and_aliases_parse_and_unknown_names_are_errors() {
    for p in Precision::ALL {
        assert_eq!(Precision::parse(p.name()).unwrap(), p);
    }
    assert_eq!(
        Precision::parse("mixed_float16").unwrap(),
        Precision::AmpFp16
    );
    assert_eq!(
        Precision::parse("mixed_bfloat16").unwrap(),
        Precision::AmpBf16
    );
    assert_eq!(Precision::parse("float32").unwrap(), Precision::Fp32);
    let e = Precision::parse("fp8").unwrap_err().to_string();
    assert!(e.contains("fp8") && e.contains("amp-fp16"), "{e}");
    // The table of DESIGN.md.
    use Precision::*;
    let rows = [
        (Fp32, DType::F32, DType::F32, false),
        (AmpFp16, DType::F32, DType::F16, true),
        (AmpBf16, DType::F32, DType::BF16, false),
        (Fp16Master, DType::F16, DType::F16, true),
        (PureFp16, DType::F16, DType::F16, false),
        (PureBf16, DType::BF16, DType::BF16, false),
    ];
    for (p, w, c, scaled) in rows {
        assert_eq!(
            (p.weight_dtype(), p.compute_dtype(), p.loss_scaling()),
            (w, c, scaled),
            "{p}"
        );
    }
}

fn sgd(lr: f64) -> impl FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>> {
    move |p| {
        Ok(Box::new(Sgd::new(
            p,
            SgdConfig {
                lr,
                ..Default::default()
            },
        )?) as Box<dyn Optimizer>)
    }
}

/// The underflow check: true gradients around 1e-8 (below F16's smallest subnormal
/// 6e-8, so they round to zero in F16) are lost in pure-fp16 and recovered by loss
/// scaling under amp-fp16 and fp16-master, within F16 tolerance of the F32 gradients.
#[test]
fn tiny_gradients_vanish_in_pure_fp16_and_survive_loss_scaling() {
    const TINY: f64 = 1e-8;
    let mut rng = Generator::new(4);
    let x = Tensor::rand(&[6, 9], 0.5, 1.0, DType::F32, &mut rng).unwrap();
    let base = Linear::new(9, 3, false, &mut rng).unwrap();
    // F32 reference: d(sum(TINY * x Wᵀ))/dW = TINY * Σ_rows x, about 4e-8.
    let grads_of = |p: Precision, scale: f64| -> Vec<f64> {
        let mut m = Linear::new(9, 3, false, &mut Generator::new(0)).unwrap();
        m.load_state_dict(&base.state_dict()).unwrap();
        p.prepare_model(&mut m).unwrap();
        let cfg = GradScalerConfig {
            init_scale: scale,
            ..Default::default()
        };
        let mut opt = AmpOptimizer::new(p, m.parameters(), cfg, 0, sgd(0.0)).unwrap();
        let loss = {
            let _ac = p.autocast();
            m.forward(&p.input(&x).unwrap())
                .unwrap()
                .mul_scalar(TINY)
                .unwrap()
                .sum_all()
                .unwrap()
        };
        opt.backward(&loss).unwrap();
        opt.unscale().unwrap();
        assert!(opt.step().unwrap(), "{p}: the step must not be skipped");
        let g = opt.grad_tensors()[0].grad().unwrap();
        g.to_vec_f64()
    };
    let col_sums: Vec<f64> = {
        let v = x.to_vec_f64();
        (0..9).map(|j| (0..6).map(|i| v[i * 9 + j]).sum()).collect()
    };
    let want: Vec<f64> = (0..3)
        .flat_map(|_| col_sums.iter().map(|s| s * TINY))
        .collect();

    let pure = grads_of(Precision::PureFp16, 1.0);
    assert!(
        pure.iter().all(|&g| g == 0.0),
        "pure-fp16 keeps no gradient this small: {pure:?}"
    );
    let f32_grads = grads_of(Precision::Fp32, 1.0);
    for (p, scale) in [
        (Precision::AmpFp16, 32768.0),
        (Precision::Fp16Master, 32768.0),
    ] {
        let got = grads_of(p, scale);
        for (i, ((&g, &w), &r)) in got.iter().zip(&want).zip(&f32_grads).enumerate() {
            // Scaled by 2^15 the gradient is ~1e-3, a normal F16 number; the F16 products
            // and the F16 rounding of the input each cost a few units of F16's roundoff.
            let tol = 4.0 * 2f64.powi(-11) * w.abs();
            assert!(
                (g - w).abs() <= tol && (g - r).abs() <= tol,
                "{p} gradient [{i}]: {g:e} vs exact {w:e}, F32 {r:e}"
            );
        }
    }
}

#[test]
fn f32_parameters_under_a_half_preset_are_a_clear_error() {
    let m = Linear::new(4, 2, true, &mut Generator::new(1)).unwrap();
    let e = AmpOptimizer::new(
        Precision::Fp16Master,
        m.parameters(),
        GradScalerConfig::default(),
        0,
        sgd(0.1),
    )
    .err()
    .expect("F32 weights under fp16-master")
    .to_string();
    assert!(e.contains("prepare_model"), "{e}");
}

fn loaders() -> (DataLoader, DataLoader) {
    let tr = Arc::new(Synthetic::generate(3, Split::Train, 256));
    let te = Arc::new(Synthetic::generate(3, Split::Test, 64));
    let cfg = |shuffle| LoaderConfig {
        batch_size: 32,
        shuffle,
        seed: 5,
        workers: 1,
        transform: Transform::to_tensor_normalize_half(),
        ..Default::default()
    };
    (
        DataLoader::new(tr, cfg(true)).unwrap(),
        DataLoader::new(te, cfg(false)).unwrap(),
    )
}

fn info() -> RunInfo {
    RunInfo {
        model: "mlp".into(),
        dataset: "synthetic".into(),
        data_dir: None,
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        precision: String::new(),
        ..Default::default()
    }
}

fn model() -> Mlp {
    Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hemi-amp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every preset trains: the loss falls over three epochs and the model keeps the preset's
/// weight dtype; the summary reports steps, skips and the scale.
#[test]
fn every_preset_trains_and_reports() {
    let (tr, te) = loaders();
    for p in Precision::ALL {
        let cfg = TrainConfig {
            epochs: 3,
            optimizer: OptimizerKind::Sgd,
            lr: 0.05,
            log_every: 4,
            precision: p,
            grad_stats: true,
            tensors_every: 5,
            ..Default::default()
        };
        let mut m = model();
        let mut losses = Vec::new();
        let mut scales = Vec::new();
        let mut epoch_stats = Vec::new();
        let mut tensor_steps = Vec::new();
        let mut global_steps = Vec::new();
        let s = train(&mut m, &tr, &te, &cfg, &info(), &mut |e| match e {
            Event::Epoch { train_loss, .. } => losses.push(*train_loss),
            Event::Batch {
                scale, global_step, ..
            } => {
                scales.push(*scale);
                global_steps.push(*global_step);
            }
            Event::GradStats { stats, .. } => epoch_stats.push(stats.clone()),
            Event::Tensors {
                global_step,
                tensors,
            } => {
                let names: Vec<&str> = tensors.iter().map(|(n, _, _)| n.as_str()).collect();
                assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
                // Unscaled gradients: a scale of 2^16 left in would make them huge.
                for (n, prm, g) in tensors {
                    let g = g.as_ref().expect("every parameter has a gradient");
                    assert_eq!(g.numel(), prm.numel(), "{n}");
                    let max = g.to_vec_f64().iter().fold(0f64, |a, x| a.max(x.abs()));
                    assert!(max < 100.0, "{p}: {n} gradient max {max}: still scaled?");
                }
                tensor_steps.push(*global_step)
            }
            _ => {}
        })
        .unwrap();
        assert_eq!(global_steps, (1..=24).collect::<Vec<u64>>(), "{p}");
        assert_eq!(tensor_steps, [5, 10, 15, 20], "{p}");
        assert!(losses[2] < losses[0], "{p}: loss falls {losses:?}");
        assert_eq!(m.parameters()[0].dtype(), p.weight_dtype(), "{p}");
        assert_eq!(s.precision, p);
        assert_eq!(s.steps, 3 * 8, "{p}: 256 images in batches of 32, 3 epochs");
        assert!(s.skipped_steps < s.steps, "{p}");
        assert_eq!(s.final_scale, *scales.last().unwrap(), "{p}");
        if !p.loss_scaling() {
            assert!(scales.iter().all(|&x| x == 1.0), "{p}: no scale");
            assert_eq!(s.skipped_steps, 0, "{p}");
        }
        // Grad stats: every gradient value of every step counted once.
        let numel: u64 = m.parameters().iter().map(|t| t.numel() as u64).sum();
        let counted: u64 = s.grad_stats.iter().map(|g| g.values).sum();
        assert_eq!(counted, numel * s.steps, "{p}: grad-stats counts");
        // The per-epoch histograms add up to the run's, and each counts every value once;
        // the F16 underflow count is the histogram's mass below 2^-24.
        assert_eq!(epoch_stats.len(), 3, "{p}");
        for (i, g) in s.grad_stats.iter().enumerate() {
            let mut sum = hemi::train::Log2Histogram::default();
            for ep in &epoch_stats {
                assert_eq!(ep[i].log2.total(), ep[i].values, "{p}: {}", g.name);
                sum.merge(&ep[i].log2);
            }
            assert_eq!(sum, g.log2, "{p}: {}", g.name);
            assert_eq!(g.log2.total(), g.values, "{p}: {}", g.name);
            let below = g.log2.count_between(hemi::train::Log2Histogram::E_MIN, -25);
            assert_eq!(below, g.underflow, "{p}: {}", g.name);
        }
    }
}

/// A loss-scaled run stopped after epoch 1 and resumed continues with the scale it had
/// (not the initial one) and ends bit-identical to an uninterrupted run, for the GradScaler
/// (amp-fp16) and the master-weight optimizer (fp16-master).
#[test]
fn resume_restores_the_loss_scale_and_master_weights() {
    let (tr, te) = loaders();
    for p in [Precision::AmpFp16, Precision::Fp16Master] {
        // An initial scale that overflows, so that the scale moves during epoch 1.
        let cfg = TrainConfig {
            epochs: 2,
            lr: 0.05,
            log_every: 4,
            precision: p,
            scaler: GradScalerConfig {
                init_scale: 2f64.powi(40),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut whole = model();
        let mut whole_scales = Vec::new();
        train(&mut whole, &tr, &te, &cfg, &info(), &mut |e| {
            if let Event::Batch { scale, .. } = e {
                whole_scales.push(*scale)
            }
        })
        .unwrap();

        let dir = tmp(p.name());
        let stop = TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            stop_after: Some(1),
            ..cfg.clone()
        };
        train(&mut model(), &tr, &te, &stop, &info(), &mut |_| {}).unwrap();
        let ck = load_checkpoint(&dir).unwrap();
        assert_eq!(ck.info.precision, p.name());

        let mut resumed = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(9)).unwrap();
        let resume = TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            resume: true,
            ..cfg.clone()
        };
        let mut scales = Vec::new();
        let s = train(&mut resumed, &tr, &te, &resume, &info(), &mut |e| {
            if let Event::Batch { scale, .. } = e {
                scales.push(*scale)
            }
        })
        .unwrap();
        assert!(
            whole_scales[7] < 2f64.powi(40),
            "{p}: the scale backed off in epoch 1: {whole_scales:?}"
        );
        assert_eq!(
            scales,
            whole_scales[8..],
            "{p}: the resumed run's scales continue the uninterrupted run's"
        );
        assert_eq!(s.epochs_run, 1);
        for ((n, a), (_, b)) in whole.state_dict().iter().zip(resumed.state_dict().iter()) {
            let (a, b) = (a.to_vec_f32(), b.to_vec_f32());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{p}: {n} differs after resume"
            );
        }
        // Resuming under another precision is refused with a message.
        let other = TrainConfig {
            precision: Precision::Fp32,
            ..resume.clone()
        };
        let e = train(&mut model(), &tr, &te, &other, &info(), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(p.name()) && e.contains("fp32"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
