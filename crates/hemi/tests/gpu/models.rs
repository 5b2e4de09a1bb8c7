//! Training steps on the wgpu backend (`gpu:0`, lavapipe in CI) against the CPU: the
//! helpers and tolerance rule of `tests/models/naive.rs` (`tests/models/training_suite.rs`)
//! with `BACKEND` the GPU. Three steps each of CifarNet, ResNet-20 (16×16 images) and the
//! tiny BERT fixture under fp32, amp-fp16 and amp-bf16: the losses, the steps taken and
//! the ones the loss scaler skipped, the first logits and every weight and buffer after
//! the steps. Then the training loop on the GPU: the loader's uploads one batch ahead,
//! checkpoints that move between the GPU and the CPU, and (ignored by default: minutes on
//! lavapipe) the 200-step CifarNet amp-fp16 run.
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
/// (fp32 SGD, 3 steps) ends with the CPU run's weights and test accuracy.
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
}

#[test]
fn cifar_net_sgd_amp_bf16() {
    need_gpu!("cifar_net_sgd_amp_bf16");
    let batches = image_batches(4, 32, 10, 7);
    let opt = Opt::Sgd { lr: 0.05 };
    same_training(
        "CifarNet amp-bf16 SGD",
        cifar_net,
        Precision::AmpBf16,
        opt,
        &batches,
        CIFAR_NET,
    );
}

// ResNet-20 on two 16×16 images a batch (every stage and its stride, at a quarter of the
// pixels of CIFAR's 32×32, so that lavapipe takes seconds, not minutes). The tolerance's
// depth is CIFAR's, which holds for the smaller sums too.

#[test]
fn resnet20_sgd_fp32() {
    need_gpu!("resnet20_sgd_fp32");
    let batches = image_batches(2, 16, 10, 3);
    let opt = Opt::Sgd { lr: 0.05 };
    same_training(
        "ResNet-20 fp32 SGD",
        resnet,
        Precision::Fp32,
        opt,
        &batches,
        RESNET20,
    );
}

/// The first logits, the losses and the steps only: after three steps the weights are
/// beyond the rule, by 1.6 times its bound for conv1's (SGD: |err| 0.040, bound 0.025)
/// and by 1.1 times for a running variance of layer3 (Adam). Under amp-fp16 the first
/// layer's gradient comes back through 19 convolutions and their norms in F16, over a
/// batch of two; the rule's allowance for SGD assumes gradients of order 1. Not the GPU's
/// doing: the naive backend, on the CPU, ends the same three steps as far from the CPU
/// backend (conv1 |err| 0.039 against the bound 0.025; probed by running this body in
/// `tests/models/naive.rs`, 2026-12-07).
#[test]
fn resnet20_sgd_amp_fp16() {
    need_gpu!("resnet20_sgd_amp_fp16");
    let batches = image_batches(2, 16, 10, 8);
    let opt = Opt::Sgd { lr: 0.05 };
    same_losses(
        "ResNet-20 amp-fp16 SGD",
        resnet,
        Precision::AmpFp16,
        opt,
        &batches,
        RESNET20,
    );
}

#[test]
fn resnet20_sgd_amp_bf16() {
    need_gpu!("resnet20_sgd_amp_bf16");
    let batches = image_batches(2, 16, 10, 9);
    let opt = Opt::Sgd { lr: 0.05 };
    same_training(
        "ResNet-20 amp-bf16 SGD",
        resnet,
        Precision::AmpBf16,
        opt,
        &batches,
        RESNET20,
    );
}

/// BERT under amp-fp16: the tiny fixture (`tests/fixtures/bert/tiny/cls`, MiniLM's
/// `BertForSequenceClassification` layout and names at hidden size 32, two layers), so
/// that the steps need no download and take seconds on lavapipe.
#[test]
fn bert_adam_amp_fp16() {
    need_gpu!("bert_adam_amp_fp16");
    let batches = token_batches(2, 9, 6);
    let opt = Opt::Adam { lr: 1e-3 };
    same_training(
        "BERT amp-fp16 Adam",
        bert,
        Precision::AmpFp16,
        opt,
        &batches,
        BERT,
    );
}

/// A synthetic image loader: `n` samples of `split`, batches of 32, two workers.
fn synthetic_loader(split: hemi::data::Split, n: usize, shuffle: bool) -> hemi::data::DataLoader {
    synthetic_batches_of(split, n, shuffle, 32)
}

/// `synthetic_loader` with batches of `batch`.
fn synthetic_batches_of(
    split: hemi::data::Split,
    n: usize,
    shuffle: bool,
    batch: usize,
) -> hemi::data::DataLoader {
    use hemi::data::{DataLoader, LoaderConfig, Synthetic, Transform};
    let data = std::sync::Arc::new(Synthetic::generate(3, split, n));
    let cfg = LoaderConfig {
        batch_size: batch,
        shuffle,
        seed: 5,
        workers: 2,
        transform: Transform::to_tensor_normalize_half(),
        ..Default::default()
    };
    DataLoader::new(data, cfg).unwrap()
}

#[track_caller]
fn same_bits(what: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let at = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(at.is_none(), "{what}: element {at:?} differs");
}

/// The loader's background uploads (`Epoch::to_device`: batch k + 1 goes up while step k
/// runs) give the batches of uploading each in turn, bit for bit and in order, on the GPU;
/// three fp32 SGD steps of an MLP fed by either end with the same weights, bit for bit; an
/// epoch dropped after its first batch stops its upload thread (else the test hangs).
#[test]
fn uploads_ahead_match_synchronous_uploads() {
    use hemi::data::{Batch, Split};
    use hemi::models::Mlp;

    need_gpu!("uploads_ahead_match_synchronous_uploads");
    let loader = synthetic_loader(Split::Train, 96, true);
    let ahead: Vec<Batch> = loader
        .epoch(1)
        .to_device(BACKEND)
        .collect::<Result<_>>()
        .unwrap();
    let inline: Vec<Batch> = loader
        .epoch(1)
        .map(|b| b.unwrap().to_device(BACKEND).unwrap())
        .collect();
    assert_eq!((ahead.len(), inline.len()), (3, 3));
    for (k, (a, s)) in ahead.iter().zip(&inline).enumerate() {
        assert_eq!(a.indices, s.indices, "batch {k}: samples");
        let (xa, xs) = (a.images().unwrap(), s.images().unwrap());
        assert_eq!((xa.device(), a.labels.device()), (BACKEND, BACKEND));
        assert_eq!(xa.shape(), xs.shape());
        same_bits(
            &format!("batch {k} images"),
            &xa.to_vec_f64(),
            &xs.to_vec_f64(),
        );
        same_bits(
            &format!("batch {k} labels"),
            &a.labels.to_vec_f64(),
            &s.labels.to_vec_f64(),
        );
    }
    let mut early = loader.epoch(2).to_device(BACKEND);
    assert_eq!(early.next().unwrap().unwrap().len(), 32);
    drop(early);

    let steps = |batches: Vec<Batch>| -> Named<Vec<f64>> {
        let mut m = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap();
        m.to_device(BACKEND).unwrap();
        let mut opt = (Opt::Sgd { lr: 0.05 }).build()(m.parameters()).unwrap();
        for b in &batches {
            opt.zero_grad();
            let out = m.forward(b.images().unwrap()).unwrap();
            let loss = cross_entropy(&out, &b.labels, CrossEntropyOptions::default()).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        m.state_dict()
            .into_iter()
            .map(|(n, t)| (n, t.to_vec_f64()))
            .collect()
    };
    for ((name, a), (_, s)) in steps(ahead).iter().zip(&steps(inline)) {
        same_bits(&format!("{name} after 3 steps"), a, s);
    }
}

/// Checkpoints move between the GPU and the CPU. An MLP trains two epochs (3 steps each)
/// under amp-fp16 with Adam through `hemi::train::train`, uninterrupted on each device and
/// stopped after epoch 1 on each. The checkpoint holds the stopped model's values bit for
/// bit and loads onto the other device bit for bit (the tensors stay there). A run
/// stopped on the GPU and resumed on the GPU ends bit-identical to the uninterrupted GPU
/// run (the CPU's counterpart is `tests/models/train.rs`); resumed on the CPU it ends
/// within the tolerance rule of the uninterrupted CPU run, with the same steps and loss
/// scale; a run stopped on the CPU and resumed on the GPU likewise of the GPU run.
#[test]
fn checkpoints_resume_on_either_device() {
    use hemi::data::Split;
    use hemi::models::Mlp;
    use hemi::train::{load_checkpoint, train, OptimizerKind, RunInfo, Summary, TrainConfig};

    need_gpu!("checkpoints_resume_on_either_device");
    let (tr, te) = (
        synthetic_loader(Split::Train, 96, true),
        synthetic_loader(Split::Test, 40, false),
    );
    let info = RunInfo {
        model: "mlp".into(),
        dataset: "synthetic".into(),
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        precision: "amp-fp16".into(),
        ..Default::default()
    };
    let cfg = TrainConfig {
        epochs: 2,
        optimizer: OptimizerKind::Adam,
        lr: 1e-3,
        precision: Precision::AmpFp16,
        ..Default::default()
    };
    let dir = |what: &str| {
        let d = std::env::temp_dir().join(format!("hemi-gpu-ckpt-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    };
    // A fresh model (another seed: the checkpoint must restore everything) on `device`.
    let fresh = |device, seed| {
        let mut m = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(seed)).unwrap();
        m.to_device(device).unwrap();
        m
    };
    let state = |m: &Mlp, device| -> Named<Vec<f64>> {
        m.state_dict()
            .into_iter()
            .map(|(name, t)| {
                assert_eq!(t.device(), device, "{name} left {device}");
                (name, t.to_vec_f64())
            })
            .collect()
    };
    let run = |device, cfg: &TrainConfig, seed| -> (Summary, Named<Vec<f64>>) {
        let mut m = fresh(device, seed);
        let s = train(&mut m, &tr, &te, cfg, &info, &mut |_| {})
            .unwrap_or_else(|e| panic!("on {device}: {e}"));
        let st = state(&m, device);
        (s, st)
    };
    let stop = |root: &std::path::Path| TrainConfig {
        checkpoint_dir: Some(root.to_path_buf()),
        stop_after: Some(1),
        ..cfg.clone()
    };
    let resume = |root: &std::path::Path| TrainConfig {
        checkpoint_dir: Some(root.to_path_buf()),
        resume: true,
        ..cfg.clone()
    };

    let (whole_cpu, w_cpu) = run(Device::Cpu, &cfg, 1);
    let (whole_gpu, w_gpu) = run(BACKEND, &cfg, 1);
    assert_eq!(whole_cpu.steps, 6);

    // Each resumed run writes its epoch 2 into its directory: one stopped run per resume.
    let (on_gpu, on_gpu_2, on_cpu) = (dir("gpu"), dir("gpu2"), dir("cpu"));
    let (_, stopped_gpu) = run(BACKEND, &stop(&on_gpu), 1);
    let (_, stopped_gpu_2) = run(BACKEND, &stop(&on_gpu_2), 1);
    for ((name, a), (_, b)) in stopped_gpu.iter().zip(&stopped_gpu_2) {
        same_bits(&format!("{name} after epoch 1 on {BACKEND}, twice"), a, b);
    }
    run(Device::Cpu, &stop(&on_cpu), 1);

    // The GPU's checkpoint holds its values exactly, and loads exactly onto either device.
    let ck = load_checkpoint(&on_gpu).unwrap();
    assert_eq!(ck.epochs_done, 1);
    let saved: Named<Vec<f64>> = ck
        .model
        .iter()
        .map(|(n, t)| (n.clone(), t.to_vec_f64()))
        .collect();
    for (name, v) in &stopped_gpu {
        let (_, s) = saved.iter().find(|(n, _)| n == name).unwrap();
        same_bits(&format!("{name} as saved from {BACKEND}"), v, s);
    }
    for device in [Device::Cpu, BACKEND] {
        let mut m = fresh(device, 7);
        m.load_state_dict(&ck.model).unwrap();
        for ((name, v), (_, l)) in stopped_gpu.iter().zip(&state(&m, device)) {
            same_bits(&format!("{name} loaded on {device}"), v, l);
        }
    }

    // GPU -> GPU: bit-identical to the uninterrupted GPU run.
    let (s, w) = run(BACKEND, &resume(&on_gpu), 99);
    assert_eq!((s.epochs_run, s.last_epoch), (1, 2));
    for ((name, a), (_, b)) in w_gpu.iter().zip(&w) {
        same_bits(&format!("{name} resumed on {BACKEND}"), a, b);
    }
    assert_eq!(s.final_scale, whole_gpu.final_scale);

    // GPU -> CPU and CPU -> GPU: the other device's rounding for the second epoch.
    let depth = Depth {
        layers: 2,
        terms: 3 * 32 * 32,
    };
    let opt = Opt::Adam { lr: 1e-3 };
    for (root, device, whole, w_whole) in [
        (&on_gpu_2, Device::Cpu, &whole_cpu, &w_cpu),
        (&on_cpu, BACKEND, &whole_gpu, &w_gpu),
    ] {
        let (s, w) = run(device, &resume(root), 99);
        assert_eq!(s.last_epoch, 2);
        assert_eq!(
            (s.skipped_steps, s.final_scale),
            (whole.skipped_steps, whole.final_scale),
            "resumed on {device}: skipped steps and scale"
        );
        for ((name, a), (_, b)) in w_whole.iter().zip(&w) {
            let k = whole.steps as usize;
            agree(
                &format!("{name} resumed on {device}"),
                a,
                b,
                tolerance(DType::F16, depth, k),
                opt.slack(k, DType::F16, depth),
            );
        }
    }
    for d in [on_gpu, on_gpu_2, on_cpu] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The target: 200 steps of CifarNet under amp-fp16 on the GPU and on the CPU take
/// the same steps (the loss scaler skips the same ones: it starts at 2^20 and grows every
/// 25 steps, so it overflows and backs off again and again) and end with losses within 1 %
/// of each other. One epoch of 1,600 synthetic images (`hemi data`'s colour-coded classes,
/// which CifarNet learns) in batches of 8, SGD with momentum.
/// Minutes on lavapipe: run with `--ignored` (bench/gpu_check.sh runs it on a real GPU).
///
/// Not met yet (2026-12-07, lavapipe, 1,018 s for the GPU's 200 steps on a loaded 2-core
/// machine; the CPU's take 3.6 s): both skip steps 0, 1, 20, 51, 80, 108, 120, 145 and 196,
/// the CPU also step 199; the final losses are 1.319 (CPU) and 0.820 (GPU), the means of
/// the last 20 0.806 and 0.743. The trajectories part within 200 steps of F16 training;
/// whether by rounding alone is open (see `resnet20_sgd_amp_fp16`).
#[test]
#[ignore = "minutes on lavapipe; run with --ignored"]
fn cifar_net_200_steps_amp_fp16() {
    use hemi::data::Split;

    need_gpu!("cifar_net_200_steps_amp_fp16");
    let batches: Vec<Batch> = synthetic_batches_of(Split::Train, 200 * 8, true, 8)
        .epoch(0)
        .map(|b| {
            let b = b.unwrap();
            (b.images().unwrap().clone(), b.labels.clone())
        })
        .collect();
    assert_eq!(batches.len(), 200);
    let scaler = GradScalerConfig {
        init_scale: (1u64 << 20) as f64,
        growth_interval: 25,
        ..Default::default()
    };
    let opt = Opt::Sgd { lr: 0.01 };
    let run = |device| {
        let t0 = std::time::Instant::now();
        let r = train_scaled(
            cifar_net().unwrap(),
            device,
            Precision::AmpFp16,
            opt,
            &batches,
            scaler.clone(),
        )
        .unwrap_or_else(|e| panic!("on {device}: {e}"));
        let tail: f64 = r.losses[180..].iter().sum::<f64>() / 20.0;
        eprintln!(
            "{device}: {:.1} s, loss {:.4} first, {:.4} last, {tail:.4} mean of the last 20; \
             skipped {:?}",
            t0.elapsed().as_secs_f64(),
            r.losses[0],
            r.losses[199],
            r.skipped
        );
        r
    };
    let (cpu, gpu) = (run(Device::Cpu), run(BACKEND));
    assert!(
        !cpu.skipped.is_empty(),
        "the scaler skipped no step: no test of them"
    );
    assert_eq!(cpu.skipped, gpu.skipped, "the steps the scaler skipped");
    let (c, g) = (cpu.losses[199], gpu.losses[199]);
    assert!(
        c < 0.8 * cpu.losses[0],
        "the loss did not fall: {:?}",
        cpu.losses
    );
    assert!(
        (g - c).abs() <= 0.01 * c.abs(),
        "final loss: cpu {c}, {BACKEND} {g} (more than 1 % apart)"
    );
}

/// The autocast suite (`tests/ops/autocast_suite.rs`) with every input on the GPU: each op
/// of the policy table gives its dtype there, parameter casts are cached, gradients reach
/// the F32 parameters, backward is not autocast, CifarNet keeps BF16 activations.
mod autocast {
    use hemi::Device;

    const DEVICE: Device = super::BACKEND;

    macro_rules! on_device {
        ($name:expr) => {
            need_gpu!($name)
        };
    }

    include!("../ops/autocast_suite.rs");
}

/// The GradScaler suite (`tests/models/amp_scaler_suite.rs`) with the parameters, inputs and
/// injected inf/NaN gradients on the GPU: 300 steps of the scale against PyTorch's rule with
/// the skipped steps leaving the optimizer untouched, several optimizers sharing a scaler,
/// gradient accumulation, an F16 loss scaled in F32.
#[allow(dead_code)]
mod scaler {
    use hemi::Device;

    const DEVICE: Device = super::BACKEND;

    /// The default composition's SGD rounds `lr · d` before adding it.
    const SGD_FUSED: bool = false;

    macro_rules! on_device {
        ($name:expr) => {
            need_gpu!($name)
        };
    }

    include!("../models/amp_scaler_suite.rs");
}
