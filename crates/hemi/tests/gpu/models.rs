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
