//! A few training steps of CifarNet, ResNet-20 and a small BERT on the CPU and on the naive
//! backend (`Device::Naive`, which writes only the basic primitives and takes everything
//! else from the default compositions): each model is built once on the CPU from a seed,
//! a copy is moved to the naive device (`Module::to_device`), both take the same batches
//! with the same optimizer, and their losses, first logits and final weights (the whole
//! state dict, running statistics included) are compared.
//!
//! **Tolerance rule.** The ops suite's rule (`tests/ops/naive.rs`) for a chain: a value that
//! passed through `L` layers, each rounding into the dtype `d` and each summing at most `n`
//! terms in the compute type, after `k` optimizer steps, agrees within
//!
//! ```text
//! 4 · (k + 1) · (L · ε_d + n · ε_c) · max |cpu|
//! ```
//!
//! (`ε` the dtypes' epsilons, the compute type F32; the scale the tensor's largest value).
//! Adam moves a weight whose gradient sits at the rounding noise by up to its learning rate
//! in either direction, so its weights get `2 · k · lr` more.
//!
//! SGD's weights get `k · lr` times the rule's factor for the gradients' compute dtype (under
//! amp-bf16 the gradients are BF16's).
//!
//! The training steps run the default compositions of the pools, the class losses,
//! attention and the optimizer updates on the naive backend: a backend with the 24 basic
//! primitives trains CifarNet, ResNet-20 and BERT.

/// The backend the training steps compare with the CPU.
const BACKEND: Device = Device::Naive;

include!("training_suite.rs");

#[test]
fn cifar_net_sgd_fp32() {
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
fn resnet20_sgd_fp32() {
    let batches = image_batches(2, 32, 10, 3);
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

#[test]
fn bert_adam_fp32() {
    let batches = token_batches(2, 9, 4);
    let opt = Opt::Adam { lr: 1e-3 };
    same_training("BERT fp32 Adam", bert, Precision::Fp32, opt, &batches, BERT);
}

#[test]
fn bert_sgd_amp_bf16() {
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

#[test]
fn cifar_net_logits_and_gradients() {
    let x = &image_batches(3, 32, 10, 6)[0].0;
    let build = || CifarNet::cifar10(&mut Generator::new(31));
    same_body(
        "CifarNet fp32",
        build,
        Precision::Fp32,
        x,
        CIFAR_NET,
        |m, x| m.forward(x),
    );
    // In half precision the CPU's fused conv + ReLU + pool block picks each window's
    // maximum from the F32 sums, the composition from the values rounded into F16, where
    // about one window in two hundred ties: the same forward values, but such a window's
    // gradient goes to another pixel, which moved the conv weights' gradients by 6 % of
    // their scale (CPU fused against CPU unfused as much as against naive). So the half
    // precision comparison runs the unfused block on both devices.
    fn unfused(m: &CifarNet, x: &Tensor) -> Result<Tensor> {
        let block = |t: Tensor| t.relu()?.max_pool2d((2, 2), (2, 2), (0, 0));
        let x = block(m.conv1.forward(x)?)?;
        let x = block(m.conv2.forward(&x)?)?.flatten(1, -1)?;
        m.fc2.forward(&m.fc1.forward_relu(&x)?)
    }
    same_body(
        "CifarNet amp-fp16",
        build,
        Precision::AmpFp16,
        x,
        CIFAR_NET,
        unfused,
    );
}

#[test]
fn resnet20_features_and_gradients() {
    // The body before the global average pool: stem and
    // the three stages, batch norms in training.
    fn body(r: &ResNet, x: &Tensor) -> Result<Tensor> {
        let mut x = r.bn1.forward_act(&r.conv1.forward(x)?, None, true)?;
        for block in r.layers.iter().flatten() {
            x = block.forward(&x)?;
        }
        Ok(x)
    }
    let x = &image_batches(2, 16, 10, 7)[0].0;
    for precision in [Precision::Fp32, Precision::AmpBf16] {
        same_body(
            &format!("ResNet-20 {precision}"),
            || resnet20(10, &mut Generator::new(32)),
            precision,
            x,
            RESNET20,
            body,
        );
    }
}

/// Training steps through tensor ops alone (no loss or optimizer primitive): CifarNet with an MSE loss against one-hot
/// targets and plain SGD written with tensor ops (`p - lr · g` through `set_data`).
#[test]
fn cifar_net_mse_plain_sgd_fp32() {
    fn steps(device: Device, batches: &[Batch]) -> Result<(Vec<f64>, Named<Vec<f64>>)> {
        let mut model = CifarNet::cifar10(&mut Generator::new(31))?;
        model.to_device(device)?;
        let mut losses = Vec::new();
        for (x, y) in batches {
            let labels = y.to_vec_i64();
            let mut onehot = vec![0.0; labels.len() * 10];
            for (i, &l) in labels.iter().enumerate() {
                onehot[i * 10 + l as usize] = 1.0;
            }
            let target = Tensor::from_f64_vec(onehot, &[labels.len(), 10], DType::F32)?;
            let out = model.forward(&x.to_device(device)?)?;
            let loss = mse_loss(&out, &target.to_device(device)?, Reduction::Mean)?;
            losses.push(loss.to_scalar()?);
            loss.backward()?;
            let _g = no_grad();
            for p in model.parameters() {
                let g = p.grad().expect("every parameter gets a gradient");
                p.set_data(&p.sub(&g.mul_scalar(0.05)?)?)?;
                p.zero_grad();
            }
        }
        let state = model
            .state_dict()
            .into_iter()
            .map(|(name, t)| {
                assert_eq!(t.device(), device, "{name} left {device}");
                (name, t.to_vec_f64())
            })
            .collect();
        Ok((losses, state))
    }
    let batches = image_batches(3, 32, 10, 8);
    let (lc, sc) = steps(Device::Cpu, &batches).unwrap();
    let (ln, sn) = steps(BACKEND, &batches).unwrap();
    for (k, (c, n)) in lc.iter().zip(&ln).enumerate() {
        let tol = tolerance(DType::F32, CIFAR_NET, k);
        agree(&format!("loss {k}"), &[*c], &[*n], tol, 0.0);
    }
    for ((name, c), (_, n)) in sc.iter().zip(&sn) {
        let tol = tolerance(DType::F32, CIFAR_NET, STEPS);
        agree(&format!("{name} after {STEPS} steps"), c, n, tol, 0.0);
    }
}
