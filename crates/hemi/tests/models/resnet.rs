//! The ResNet family: torchvision's parameter counts and state_dict names, forward shapes
//! in F32 and under BF16 autocast, gradients for every parameter, a short training run, and
//! the option-A shortcut of the CIFAR networks.

use hemi::amp::autocast;
use hemi::models::{
    resnet, resnet18, resnet20, resnet34, resnet50, CifarShortcut, ResNet, ResNetConfig, Shortcut,
    RESNET_ARCHS,
};
use hemi::nn::{Kind, Module};
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::optim::{Optimizer, Sgd, SgdConfig};
use hemi::{DType, Generator, Tensor};

#[test]
fn imagenet_parameter_counts_match_torchvision() {
    // sum(p.numel() for p in torchvision.models.resnetXX().parameters()).
    let mut rng = Generator::new(0);
    let r18 = resnet18(1000, &mut rng).unwrap();
    assert_eq!(r18.num_parameters(), 11_689_512);
    drop(r18);
    let r34 = resnet34(1000, &mut rng).unwrap();
    assert_eq!(r34.num_parameters(), 21_797_672);
    drop(r34);
    let r50 = resnet50(1000, &mut rng).unwrap();
    assert_eq!(r50.num_parameters(), 25_557_032);
    // torchvision's state_dict sizes: 122, 218 and 320 entries.
    assert_eq!(r50.state_dict().len(), 320);
    assert_eq!(r50.named_parameters().len(), 161);
}

#[test]
fn cifar_parameter_counts() {
    // resnet20, option A, 10 classes, by hand:
    //   stem conv 3·16·9 = 432, bn 2·16 = 32                               →     464
    //   stage 1: 3 blocks × (2 convs 16·16·9 = 2304 + 2 bn 32)  = 3·4672   →  14,016
    //   stage 2: 16·32·9 + 32·32·9 + 2·64 = 13,952; + 2 × (2·9216 + 128)   →  51,072
    //   stage 3: 32·64·9 + 64·64·9 + 2·128 = 55,552; + 2 × (2·36864 + 256) → 203,520
    //   fc 64·10 + 10                                                      →     650
    //   total 269,722 (the "0.27M" of He et al. Table 6).
    // The 272,474 sometimes quoted is the option-B network: its two projections add
    // 16·32 + 2·32 = 576 and 32·64 + 2·64 = 2,176 parameters (2,752 in all).
    let mut rng = Generator::new(0);
    let a = resnet20(10, &mut rng).unwrap();
    assert_eq!(a.num_parameters(), 269_722);
    let b = ResNet::cifar(3, 10, CifarShortcut::B, false, &mut rng).unwrap();
    assert_eq!(b.num_parameters(), 272_474);
    // resnet32 / resnet56 add 2 and 6 identity blocks per stage, each one block in every
    // stage costs 4,672 + 18,560 + 73,984 = 97,216: 464,154 and 853,018 ("0.46M", "0.85M").
    let r32 = resnet("resnet32", 10, &mut rng).unwrap();
    assert_eq!(r32.num_parameters(), 269_722 + 2 * 97_216);
    let r56 = resnet("resnet56", 10, &mut rng).unwrap();
    assert_eq!(r56.num_parameters(), 269_722 + 6 * 97_216);
    // No BN buffers or parameters in option-A shortcuts.
    assert!(a
        .state_dict()
        .iter()
        .all(|(n, _)| !n.contains("downsample")));
}

#[test]
fn resnet18_state_dict_names_and_buffers() {
    let mut rng = Generator::new(1);
    let net = resnet18(1000, &mut rng).unwrap();
    let sd = net.state_dict();
    let names: Vec<&str> = sd.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names[..14],
        [
            "conv1.weight",
            "bn1.weight",
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
            "bn1.num_batches_tracked",
            "layer1.0.conv1.weight",
            "layer1.0.bn1.weight",
            "layer1.0.bn1.bias",
            "layer1.0.bn1.running_mean",
            "layer1.0.bn1.running_var",
            "layer1.0.bn1.num_batches_tracked",
            "layer1.0.conv2.weight",
            "layer1.0.bn2.weight",
        ]
    );
    // layer2.0: conv1, bn1 (5), conv2, bn2 (5), then the downsample.
    let start = names
        .iter()
        .position(|n| *n == "layer2.0.conv1.weight")
        .unwrap();
    assert_eq!(
        names[start + 12..start + 18],
        [
            "layer2.0.downsample.0.weight",
            "layer2.0.downsample.1.weight",
            "layer2.0.downsample.1.bias",
            "layer2.0.downsample.1.running_mean",
            "layer2.0.downsample.1.running_var",
            "layer2.0.downsample.1.num_batches_tracked",
        ]
    );
    assert_eq!(names[start + 18], "layer2.1.conv1.weight");
    assert!(!names.iter().any(|n| n.starts_with("layer1.0.downsample")));
    assert_eq!(names[names.len() - 2..], ["fc.weight", "fc.bias"]);
    assert_eq!(names.len(), 122);
    assert_eq!(net.named_parameters().len(), 62);

    let get = |name: &str| &sd.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(get("conv1.weight").shape(), [64, 3, 7, 7]);
    assert_eq!(get("layer2.0.downsample.0.weight").shape(), [128, 64, 1, 1]);
    assert_eq!(get("fc.weight").shape(), [1000, 512]);
    let nbt = get("layer3.0.downsample.1.num_batches_tracked");
    assert_eq!(nbt.dtype(), DType::I64);
    assert_eq!(nbt.shape(), [] as [usize; 0]);
    assert_eq!(get("bn1.running_var").to_vec_f64(), vec![1.0; 64]);
    // Buffers are buffers, not parameters.
    for (name, _, kind, _) in net.tensors() {
        let buffer = name.ends_with("running_mean")
            || name.ends_with("running_var")
            || name.ends_with("num_batches_tracked");
        assert_eq!(kind == Kind::Buffer, buffer, "{name}");
    }
    // No conv has a bias.
    assert!(!names
        .iter()
        .any(|n| n.contains("conv") && n.ends_with("bias")));
}

#[test]
fn resnet50_bottleneck_layout() {
    // Names and shapes of the first Bottleneck (stride on the 3×3 conv in stage 2: v1.5).
    let mut rng = Generator::new(2);
    let net = resnet50(10, &mut rng).unwrap();
    let sd = net.state_dict();
    let shape = |name: &str| {
        sd.iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .shape()
            .to_vec()
    };
    assert_eq!(shape("layer1.0.conv1.weight"), [64, 64, 1, 1]);
    assert_eq!(shape("layer1.0.conv3.weight"), [256, 64, 1, 1]);
    assert_eq!(shape("layer1.0.downsample.0.weight"), [256, 64, 1, 1]);
    assert_eq!(shape("layer4.2.bn3.weight"), [2048]);
    assert_eq!(shape("fc.weight"), [10, 2048]);
    assert_eq!(net.layers[1][0].layers[0].0.opts.stride, (1, 1));
    assert_eq!(net.layers[1][0].layers[1].0.opts.stride, (2, 2));
    match &net.layers[1][0].shortcut {
        Shortcut::Projection { conv, .. } => assert_eq!(conv.opts.stride, (2, 2)),
        _ => panic!("layer2.0 needs a projection"),
    }
}

#[test]
fn init_follows_torchvision() {
    let mut rng = Generator::new(3);
    let net = ResNetConfig {
        arch: "resnet20".into(),
        num_classes: 10,
        zero_init_residual: true,
    }
    .build(&mut rng)
    .unwrap();
    let sd = net.state_dict();
    let get = |name: &str| sd.iter().find(|(n, _)| n == name).unwrap().1.to_vec_f64();
    // Kaiming normal, fan_out = 64·3·3: std √(2/576) ≈ 0.0589.
    let w = get("layer3.1.conv1.weight");
    let std = (w.iter().map(|v| v * v).sum::<f64>() / w.len() as f64).sqrt();
    let want = (2.0f64 / 576.0).sqrt();
    assert!((std / want - 1.0).abs() < 0.03, "std {std}, want {want}");
    // zero_init_residual: the last BN of each block starts at 0, the others at 1.
    assert!(get("layer3.1.bn2.weight").iter().all(|&v| v == 0.0));
    assert!(get("layer3.1.bn1.weight").iter().all(|&v| v == 1.0));
    assert!(get("bn1.weight").iter().all(|&v| v == 1.0));
    let plain = resnet20(10, &mut rng).unwrap();
    assert!(plain.layers[2][1].layers[1]
        .1
        .weight
        .to_vec_f64()
        .iter()
        .all(|&v| v == 1.0));
}

#[test]
fn unknown_names_are_errors() {
    let mut rng = Generator::new(4);
    let err = resnet("resnet19", 10, &mut rng)
        .err()
        .expect("unknown name");
    let msg = err.to_string();
    assert!(msg.contains("resnet19"), "{msg}");
    for known in RESNET_ARCHS {
        assert!(msg.contains(known), "{msg} should list {known}");
    }
    assert!(resnet("resnet20", 0, &mut rng).is_err());
    // Wrong input rank or channels: errors, not panics.
    let net = resnet20(10, &mut rng).unwrap();
    let x = Tensor::zeros(&[3, 32, 32], DType::F32).unwrap();
    assert!(net.forward(&x).is_err());
    let x = Tensor::zeros(&[1, 4, 32, 32], DType::F32).unwrap();
    assert!(net.forward(&x).is_err());
}

/// Every parameter has a finite gradient of its own shape.
fn check_grads(net: &ResNet) {
    for (name, p) in net.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
        assert_eq!(g.shape(), p.shape(), "{name}");
        assert!(g.to_vec_f64().iter().all(|v| v.is_finite()), "{name}");
    }
}

#[test]
fn resnet18_forward_backward() {
    let mut rng = Generator::new(5);
    let net = resnet18(1000, &mut rng).unwrap();
    let x = Tensor::randn(&[2, 3, 64, 64], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let y = net.forward(&x).unwrap();
    assert_eq!(y.shape(), [2, 1000]);
    assert_eq!(y.dtype(), DType::F32);
    let labels = Tensor::from_vec(vec![3i64, 997], &[2]).unwrap();
    let loss = cross_entropy(&y, &labels, CrossEntropyOptions::default()).unwrap();
    assert!(loss.to_scalar().unwrap().is_finite());
    loss.backward().unwrap();
    check_grads(&net);
    // One training-mode forward updated the running statistics and the counter.
    let sd = net.state_dict();
    let get = |name: &str| &sd.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(get("layer4.1.bn2.num_batches_tracked").to_vec_i64(), [1]);
    assert!(get("bn1.running_mean")
        .to_vec_f64()
        .iter()
        .any(|&v| v != 0.0));
}

#[test]
fn resnet20_forward_f32_and_bf16_autocast() {
    let mut rng = Generator::new(6);
    let net = resnet20(10, &mut rng).unwrap();
    let x = Tensor::randn(&[4, 3, 32, 32], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let y32 = net.forward(&x).unwrap();
    assert_eq!(y32.shape(), [4, 10]);
    let y16 = {
        let _ac = autocast(DType::BF16);
        net.forward(&x).unwrap()
    };
    assert_eq!(y16.shape(), [4, 10]);
    assert_eq!(y16.dtype(), DType::BF16);
    let (a, b) = (y32.to_vec_f64(), y16.to_vec_f64());
    assert!(b.iter().all(|v| v.is_finite()));
    // BF16 keeps ~3 significant digits; a 20-layer net drifts a little more.
    let scale = a.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3);
    let err = a
        .iter()
        .zip(&b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
    assert!(
        err < 0.1 * scale,
        "bf16 logits differ by {err} (scale {scale})"
    );
    // Backward from the autocast logits reaches every F32 parameter.
    let labels = Tensor::from_vec(vec![0i64, 1, 2, 3], &[4]).unwrap();
    let loss = cross_entropy(&y16, &labels, CrossEntropyOptions::default()).unwrap();
    loss.backward().unwrap();
    check_grads(&net);
    for p in net.parameters() {
        assert_eq!(p.grad().unwrap().dtype(), DType::F32);
    }
}

#[test]
fn state_dict_round_trip_in_eval() {
    let mut rng = Generator::new(7);
    let mut a = resnet20(10, &mut rng).unwrap();
    let x = Tensor::randn(&[2, 3, 16, 16], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    a.forward(&x).unwrap(); // move the running statistics off their defaults
    a.set_training(false);
    let mut b = resnet20(10, &mut rng).unwrap();
    b.set_training(false);
    let before = b.forward(&x).unwrap().to_vec_f64();
    b.load_state_dict(&a.state_dict()).unwrap();
    let (ya, yb) = (
        a.forward(&x).unwrap().to_vec_f64(),
        b.forward(&x).unwrap().to_vec_f64(),
    );
    assert_eq!(ya, yb);
    assert_ne!(before, yb);
    // Eval mode leaves the counters alone.
    let n = |m: &ResNet| {
        m.state_dict()
            .into_iter()
            .find(|(n, _)| n == "bn1.num_batches_tracked")
            .unwrap()
            .1
            .to_vec_i64()[0]
    };
    assert_eq!(n(&a), 1);
    assert_eq!(n(&b), 1);
}

#[test]
fn resnet20_learns_a_fixed_batch() {
    let mut rng = Generator::new(8);
    let net = resnet20(10, &mut rng).unwrap();
    let x = Tensor::randn(&[8, 3, 32, 32], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let y = Tensor::from_vec(vec![0i64, 1, 2, 3, 4, 5, 6, 7], &[8]).unwrap();
    let mut opt = Sgd::new(
        net.parameters(),
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..SgdConfig::default()
        },
    )
    .unwrap();
    let mut losses = Vec::new();
    for _ in 0..20 {
        opt.zero_grad();
        let loss = cross_entropy(
            &net.forward(&x).unwrap(),
            &y,
            CrossEntropyOptions::default(),
        )
        .unwrap();
        losses.push(loss.to_scalar().unwrap());
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(first > 1.0, "starts near ln 10: {losses:?}");
    assert!(last < 0.5 * first, "loss {first} -> {last}: {losses:?}");
}

#[test]
fn option_a_shortcut_subsamples_and_pads_with_zeros() {
    let mut rng = Generator::new(9);
    let net = resnet20(10, &mut rng).unwrap();
    let block = &net.layers[2][0]; // 32 → 64 channels, stride 2
    match block.shortcut {
        Shortcut::Pad {
            stride,
            extra_channels,
        } => assert_eq!((stride, extra_channels), (2, 32)),
        _ => panic!("layer3.0 needs an option-A shortcut"),
    }
    assert!(matches!(net.layers[2][1].shortcut, Shortcut::Identity));
    for (h, w) in [(8usize, 8usize), (7, 5)] {
        let (n, c) = (2, 32);
        let x = Tensor::randn(&[n, c, h, w], 0.0, 1.0, DType::F32, &mut rng).unwrap();
        let s = block.shortcut_forward(&x).unwrap();
        let (ho, wo) = (h.div_ceil(2), w.div_ceil(2));
        assert_eq!(s.shape(), [n, 64, ho, wo]);
        // The residual branch has the same shape, so the block adds them.
        assert_eq!(block.forward(&x).unwrap().shape(), [n, 64, ho, wo]);
        let (xv, sv) = (x.to_vec_f64(), s.to_vec_f64());
        for b in 0..n {
            for ch in 0..64 {
                for i in 0..ho {
                    for j in 0..wo {
                        let got = sv[((b * 64 + ch) * ho + i) * wo + j];
                        // 16 zero channels, the input's 32, then 16 more.
                        let want = if (16..16 + c).contains(&ch) {
                            xv[((b * c + ch - 16) * h + 2 * i) * w + 2 * j]
                        } else {
                            0.0
                        };
                        assert_eq!(got, want, "[{b}, {ch}, {i}, {j}] of {h}x{w}");
                    }
                }
            }
        }
        // Its gradient is the subsampling's adjoint: 1 at the kept pixels, 0 elsewhere.
        let xg = x.detach().requires_grad_();
        block
            .shortcut_forward(&xg)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = xg.grad().unwrap().to_vec_f64();
        for (k, gv) in g.iter().enumerate() {
            let (i, j) = ((k / w) % h, k % w);
            let want = if i % 2 == 0 && j % 2 == 0 { 1.0 } else { 0.0 };
            assert_eq!(*gv, want, "grad at {k}");
        }
    }
}

/// A ResNet-50 first-stage bottleneck ends in the fused conv + BN + shortcut + ReLU that
/// computes its 64 → 256 convolution again in the backward: its output, every parameter's
/// gradient and the input's gradient equal the layer-by-layer run's, bit for bit, with a
/// projection and with an identity shortcut, in F32 and under BF16 autocast.
#[test]
fn recomputing_bottleneck_equals_its_layers() {
    let mut rng = Generator::new(11);
    let net = resnet50(10, &mut rng).unwrap();
    for (j, in_ch) in [(0, 64), (1, 256)] {
        let block = &net.layers[0][j];
        for ac in [None, Some(DType::BF16)] {
            // Under autocast a block's input is the previous block's half output.
            let x_dtype = ac.unwrap_or(DType::F32);
            let x0 = Tensor::randn(&[2, in_ch, 5, 7], 0.0, 1.0, x_dtype, &mut rng).unwrap();
            let g = Tensor::randn(&[2, 256, 5, 7], 0.0, 1.0, DType::F32, &mut rng).unwrap();
            let run = |fused: bool| -> Vec<Vec<f64>> {
                let x = x0.detach().requires_grad_();
                for (_, p, _, _) in block.tensors() {
                    p.zero_grad();
                }
                let out = {
                    let _ac = ac.map(autocast);
                    if fused {
                        let out = block.forward(&x).unwrap();
                        // The recomputing op ran (its node keeps the generic name).
                        assert_eq!(out.grad_fn_name(), Some("conv2d_batch_norm"));
                        out
                    } else {
                        let mut y = x.clone();
                        let n = block.layers.len();
                        for (i, (conv, bn)) in block.layers.iter().enumerate() {
                            let z = conv.forward(&y).unwrap();
                            y = if i + 1 < n {
                                bn.forward_act(&z, None, true).unwrap()
                            } else {
                                let s = match &block.shortcut {
                                    Shortcut::Projection { conv, bn } => {
                                        bn.forward(&conv.forward(&x).unwrap()).unwrap()
                                    }
                                    _ => x.clone(),
                                };
                                bn.forward_act(&z, Some(&s), true).unwrap()
                            };
                        }
                        y
                    }
                };
                out.to_dtype(DType::F32)
                    .unwrap()
                    .mul(&g)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let mut v = vec![out.to_vec_f64(), x.grad().unwrap().to_vec_f64()];
                for (_, p, kind, _) in block.tensors() {
                    if kind == Kind::Parameter {
                        v.push(p.grad().unwrap().to_vec_f64());
                    }
                }
                v
            };
            let (f, c) = (run(true), run(false));
            assert_eq!(f.len(), c.len());
            for (k, (a, b)) in f.iter().zip(&c).enumerate() {
                assert_eq!(a.len(), b.len());
                let diff = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits());
                let (n, max) = diff.fold((0, 0f64), |(n, m), (x, y)| (n + 1, m.max((x - y).abs())));
                assert_eq!(
                    n, 0,
                    "block {j}, autocast {ac:?}, tensor {k}: {n} differ, by up to {max:e}"
                );
            }
        }
    }
}
