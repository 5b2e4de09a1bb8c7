//! Training steps on the wgpu backend (`gpu:0`, lavapipe in CI) against the CPU: the
//! helpers and tolerance rule of `tests/models/naive.rs` (`tests/models/training_suite.rs`)
//! with `BACKEND` the GPU. Three steps each of CifarNet fp32 SGD and amp-fp16 Adam (the
//! loss scaler's skipped steps included) and of the tiny BERT fixture fp32 Adam and
//! amp-bf16 SGD: the losses, the steps taken, the first logits and every weight and buffer
//! after the steps. The model families' other tests (ResNet-20) stay on the naive backend:
//! on lavapipe they would take minutes.
//!
//! Without an adapter each test prints `SKIPPED (no GPU adapter)` and returns, unless
//! `HEMI_REQUIRE_GPU=1`.

/// The backend the training steps compare with the CPU.
const BACKEND: Device = Device::Gpu(0);

include!("../models/training_suite.rs");

#[test]
fn cifar_net_sgd_fp32() {
    need_gpu!("cifar_net_sgd_fp32");
    let batches = image_batches(4, 32, 10, 1);
    let opt = Opt::Sgd { lr: 0.05 };
    same_training(
        "CifarNet fp32 SGD",
        cifar_net,
        Precision::Fp32,
        opt,
        &batches,
        CIFAR_NET,
    );
}

#[test]
fn cifar_net_adam_amp_fp16() {
    need_gpu!("cifar_net_adam_amp_fp16");
    let batches = image_batches(4, 32, 10, 2);
    let opt = Opt::Adam { lr: 1e-3 };
    same_training(
        "CifarNet amp-fp16 Adam",
        cifar_net,
        Precision::AmpFp16,
        opt,
        &batches,
        CIFAR_NET,
    );
}

#[test]
fn cifar_net_logits_and_gradients() {
    need_gpu!("cifar_net_logits_and_gradients");
    let x = &image_batches(3, 32, 10, 6)[0].0;
    same_body(
        "CifarNet fp32",
        || CifarNet::cifar10(&mut Generator::new(31)),
        Precision::Fp32,
        x,
        CIFAR_NET,
        |m, x| m.forward(x),
    );
}

#[test]
fn bert_adam_fp32() {
    need_gpu!("bert_adam_fp32");
    let batches = token_batches(2, 9, 4);
    let opt = Opt::Adam { lr: 1e-3 };
    same_training("BERT fp32 Adam", bert, Precision::Fp32, opt, &batches, BERT);
}

#[test]
fn bert_sgd_amp_bf16() {
    need_gpu!("bert_sgd_amp_bf16");
    let batches = token_batches(2, 9, 5);
    let opt = Opt::Sgd { lr: 0.05 };
    same_training(
        "BERT amp-bf16 SGD",
        bert,
        Precision::AmpBf16,
        opt,
        &batches,
        BERT,
    );
}

/// The library's training loop (`hemi::train::train`, what `hemi train --device gpu` runs)
/// with the model moved to the GPU: each batch is uploaded there, and one epoch of an MLP
/// (fp32 SGD, 3 steps) ends with the CPU run's weights and test accuracy. Resuming on the
/// GPU is an error naming the device, not a crash.
#[test]
fn train_loop_runs_a_gpu_model() {
    use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
    use hemi::models::Mlp;
    use hemi::train::{train, OptimizerKind, RunInfo, TrainConfig};
    use std::sync::Arc;

    need_gpu!("train_loop_runs_a_gpu_model");
    let loader = |split, n, shuffle| {
        let data = Arc::new(Synthetic::generate(3, split, n));
        let cfg = LoaderConfig {
            batch_size: 32,
            shuffle,
            seed: 5,
            workers: 0,
            transform: Transform::to_tensor_normalize_half(),
            ..Default::default()
        };
        DataLoader::new(data, cfg).unwrap()
    };
    let (tr, te) = (
        loader(Split::Train, 96, true),
        loader(Split::Test, 40, false),
    );
    let info = RunInfo {
        model: "mlp".into(),
        dataset: "synthetic".into(),
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        precision: "fp32".into(),
        ..Default::default()
    };
    let cfg = TrainConfig {
        epochs: 1,
        optimizer: OptimizerKind::Sgd,
        lr: 0.05,
        precision: Precision::Fp32,
        ..Default::default()
    };
    let run = |device| {
        let mut m = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap();
        m.to_device(device).unwrap();
        let s = train(&mut m, &tr, &te, &cfg, &info, &mut |_| {})
            .unwrap_or_else(|e| panic!("on {device}: {e}"));
        let state: Named<Vec<f64>> = m
            .state_dict()
            .into_iter()
            .map(|(name, t)| {
                assert_eq!(t.device(), device, "{name} left {device}");
                (name, t.to_vec_f64())
            })
            .collect();
        (s, state)
    };
    let ((sc, wc), (sg, wg)) = (run(Device::Cpu), run(BACKEND));
    assert_eq!((sc.steps, sc.test_accuracy), (sg.steps, sg.test_accuracy));
    let depth = Depth {
        layers: 2,
        terms: 3 * 32 * 32,
    };
    let opt = Opt::Sgd { lr: 0.05 };
    for ((name, c), (_, g)) in wc.iter().zip(&wg) {
        let tol = tolerance(DType::F32, depth, sc.steps as usize);
        let slack = opt.slack(sc.steps as usize, DType::F32, depth);
        agree(&format!("mlp {name} after an epoch"), c, g, tol, slack);
    }
    // Resuming on the GPU would load the optimizer's state on the CPU: refused.
    let mut m = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap();
    m.to_device(BACKEND).unwrap();
    let dir = std::env::temp_dir().join(format!("hemi-gpu-resume-{}", std::process::id()));
    let resume = TrainConfig {
        resume: true,
        checkpoint_dir: Some(dir.clone()),
        ..cfg.clone()
    };
    std::fs::create_dir_all(&dir).unwrap();
    let e = train(&mut m, &tr, &te, &resume, &info, &mut |_| {})
        .unwrap_err()
        .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(e.contains("gpu:0") && e.contains("resum"), "{e}");
}
