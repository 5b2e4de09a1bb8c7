// The autocast tests that run ops, as functions of the device `DEVICE`, which the file that
// includes this one (`include!`) defines, with a macro `on_device!(test_name)` that each
// test calls first (nothing on the CPU; `need_gpu!` on the GPU): `autocast.rs` (the CPU)
// and `../gpu/models.rs` (the wgpu backend). Every input is made on `DEVICE`; the policy
// is decided above the backend, so the same dtypes come out on every device.

use crate::common::*;
use hemi::amp::{autocast, autocast_dtype, cached_casts, CastPolicy, POLICY};
use hemi::nn::{Linear, Module};
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::loss::{cross_entropy, mse_loss, nll_loss, CrossEntropyOptions, Reduction};
use hemi::ops::norm::BatchNormParams;
use hemi::{DType, Generator, Result, Tensor};

/// A training batch norm with these parameters and no running statistics.
fn training_norm<'a>(gamma: &'a Tensor, beta: &'a Tensor) -> BatchNormParams<'a> {
    BatchNormParams {
        running_mean: None,
        running_var: None,
        weight: Some(gamma),
        bias: Some(beta),
        training: true,
        momentum: 0.1,
        eps: 1e-5,
    }
}

/// Calls op `name` with float inputs of dtype `a` (first input) and `b` (the others), and
/// integer inputs where the op needs them, all on `DEVICE`.
fn call(name: &str, a: DType, b: DType) -> Result<Tensor> {
    let mut rng = Generator::new(7);
    let t = |shape: &[usize], d: DType, rng: &mut Generator| -> Tensor {
        Tensor::randn(shape, 0.0, 1.0, d, rng)
            .unwrap()
            .to_device(DEVICE)
            .unwrap()
    };
    let x = t(&[2, 3, 5, 5], a, &mut rng);
    let m = t(&[4, 6], a, &mut rng);
    let m2 = t(&[6, 3], b, &mut rng);
    let v = t(&[4, 6], b, &mut rng);
    let labels =
        Tensor::from_f32_vec(vec![0.0, 2.0, 1.0, 5.0], &[4], DType::I64)?.to_device(DEVICE)?;
    let pos = m.abs()?.add_scalar(0.5)?;
    match name {
        "matmul" => m.matmul(&m2),
        "linear" => m.linear(&t(&[3, 6], b, &mut rng), Some(&t(&[3], b, &mut rng))),
        "conv2d" => x.conv2d(
            &t(&[4, 3, 3, 3], b, &mut rng),
            Some(&t(&[4], b, &mut rng)),
            Conv2dOptions::default().padding(1),
        ),
        "conv2d_relu_max_pool2" => x.conv2d_relu_max_pool2(
            &t(&[4, 3, 3, 3], b, &mut rng),
            Some(&t(&[4], b, &mut rng)),
            Conv2dOptions::default().padding(1),
        ),
        "batch_norm_relu_conv2d" => {
            let (gamma, beta) = (t(&[3], b, &mut rng), t(&[3], b, &mut rng));
            let bn = training_norm(&gamma, &beta);
            // A weight that wants a gradient: the fused path, not the no-graph composition.
            x.batch_norm_relu_conv2d(
                &bn,
                &t(&[4, 3, 3, 3], b, &mut rng).requires_grad_(),
                Some(&t(&[4], b, &mut rng)),
                Conv2dOptions::default().padding(1),
            )
        }
        "conv2d_batch_norm"
        | "conv2d_batch_norm_relu_max_pool2d"
        | "conv2d_batch_norm_add_relu" => {
            let (gamma, beta) = (t(&[4], b, &mut rng), t(&[4], b, &mut rng));
            let bn = training_norm(&gamma, &beta);
            // A weight that wants a gradient: the fused path.
            let w = t(&[4, 3, 3, 3], b, &mut rng).requires_grad_();
            let opts = Conv2dOptions::default().padding(1);
            if name == "conv2d_batch_norm" {
                x.conv2d_batch_norm(&w, None, opts, &bn)
            } else if name == "conv2d_batch_norm_add_relu" {
                // The residual in the dtype the convolution computes in.
                let r = x.conv2d(&w, None, opts)?.detach().requires_grad_();
                x.conv2d_batch_norm_add_relu(&w, None, opts, &bn, &r)
            } else {
                x.conv2d_batch_norm_relu_max_pool2d(&w, None, opts, &bn, (3, 3), (2, 2), (1, 1))
            }
        }
        "scaled_dot_product_attention" => {
            m.scaled_dot_product_attention(&v, &v, None, 0.0, None, None)
        }
        "exp" => m.exp(),
        "log" => pos.log(),
        "pow_scalar" => m.pow_scalar(3.0),
        "square" => m.square(),
        "gelu" => m.gelu(),
        "gelu_tanh" => m.gelu_tanh(),
        "softmax" => m.softmax(-1),
        "log_softmax" => m.log_softmax(-1),
        "cross_entropy" => cross_entropy(&m, &labels, CrossEntropyOptions::default()),
        "nll_loss" => nll_loss(&m.log_softmax(-1)?, &labels, Reduction::Mean, None),
        "mse_loss" => mse_loss(&m, &v, Reduction::Mean),
        "layer_norm" => m.layer_norm(
            &[6],
            Some(&t(&[6], b, &mut rng)),
            Some(&t(&[6], b, &mut rng)),
            1e-5,
        ),
        "sum" => m.sum(&[1], false),
        "sum_all" => m.sum_all(),
        "sum_to_shape" => m.sum_to_shape(&[1, 6]),
        "mean" => m.mean(&[0], true),
        "mean_all" => m.mean_all(),
        "var" => m.var(&[1], 1, false),
        "batch_norm" => x.batch_norm(
            None,
            None,
            Some(&t(&[3], b, &mut rng)),
            Some(&t(&[3], b, &mut rng)),
            true,
            0.1,
            1e-5,
        ),
        "batch_norm_act" => x.batch_norm_act(
            None,
            None,
            Some(&t(&[3], b, &mut rng)),
            Some(&t(&[3], b, &mut rng)),
            true,
            0.1,
            1e-5,
            Some(&t(&[2, 3, 5, 5], a, &mut rng)),
            true,
        ),
        "add" => m.add(&v),
        "sub" => m.sub(&v),
        "mul" => m.mul(&v),
        "div" => m.div(&v.abs()?.add_scalar(1.0)?),
        "maximum" => m.maximum(&v),
        "minimum" => m.minimum(&v),
        "where_cond" => Tensor::where_cond(&m.relu()?, &m, &v),
        "cat" => Tensor::cat(&[&m, &v], 0),
        "stack" => Tensor::stack(&[&m, &v], 1),
        "neg" => m.neg(),
        "abs" => m.abs(),
        "sqrt" => pos.sqrt(),
        "relu" => m.relu(),
        "clamp" => m.clamp(-0.5, 0.5),
        "sigmoid" => m.sigmoid(),
        "tanh" => m.tanh(),
        "add_scalar" => m.add_scalar(1.5),
        "mul_scalar" => m.mul_scalar(1.5),
        "div_scalar" => m.div_scalar(1.5),
        "masked_fill" => m.masked_fill(&m.relu()?, 0.0),
        "dropout" => m.dropout(0.5, true, &mut rng),
        "max" => m.max(&[1], false),
        "min" => m.min(&[1], false),
        "max_dim" => Ok(m.max_dim(1, false)?.0),
        "min_dim" => Ok(m.min_dim(1, false)?.0),
        "argmax" => m.argmax(1, false),
        "argmin" => m.argmin(1, false),
        "max_pool2d" => x.max_pool2d((2, 2), (2, 2), (0, 0)),
        "max_pool2d_with_indices" => Ok(x.max_pool2d_with_indices((2, 2), (2, 2), (0, 0))?.0),
        "avg_pool2d" => x.avg_pool2d((2, 2), (2, 2), (0, 0), true),
        "adaptive_avg_pool2d" => x.adaptive_avg_pool2d((2, 2)),
        "embedding" => Tensor::embedding(&m, &labels.narrow(0, 0, 3)?),
        "index_select" => m.index_select(0, &labels.narrow(0, 0, 3)?),
        "reshape" => m.reshape(&[6, 4]),
        "flatten" => x.flatten(1, -1),
        "permute" => x.permute(&[0, 2, 3, 1]),
        "transpose" => m.transpose(0, 1),
        "t" => m.t(),
        "narrow" => m.narrow(1, 1, 3),
        "broadcast_to" => m.broadcast_to(&[2, 4, 6]),
        "squeeze" => m.unsqueeze(0)?.squeeze(0),
        "unsqueeze" => m.unsqueeze(1),
        "contiguous" => m.t()?.contiguous(),
        "to_dtype" => m.to_dtype(a),
        "to_device" => m.to_device(DEVICE),
        other => panic!("the test has no call for op {other:?}: add one"),
    }
}

#[test]
fn every_op_follows_its_policy_under_f16_and_bf16() {
    on_device!("every_op_follows_its_policy_under_f16_and_bf16");
    for ac in [DType::F16, DType::BF16] {
        for &(name, pol) in POLICY {
            for (a, b) in [
                (DType::F32, DType::F32),
                (ac, ac),
                (ac, DType::F32),
                (DType::F32, ac),
            ] {
                let out = call(name, a, b).unwrap();
                assert_eq!(out.device(), DEVICE, "{name}'s output");
                let outside = out.dtype();
                let inside = {
                    let _g = autocast(ac);
                    call(name, a, b).unwrap().dtype()
                };
                let want = match pol {
                    CastPolicy::LowerPrecision => ac,
                    CastPolicy::Fp32 => DType::F32,
                    CastPolicy::Fp32Statistics | CastPolicy::Promote | CastPolicy::PassThrough => {
                        outside
                    }
                };
                assert_eq!(
                    inside, want,
                    "{name} ({pol:?}) under autocast({ac}) with inputs {a}/{b}: outside it gave {outside}"
                );
            }
        }
    }
}

#[test]
fn promote_and_statistics_ops_keep_their_rules_under_autocast() {
    on_device!("promote_and_statistics_ops_keep_their_rules_under_autocast");
    let _g = autocast(DType::F16);
    use DType::{BF16, F16, F32};
    for (op, a, b, want) in [
        // Promote: F16 with F32 gives F32.
        ("add", F16, F32, F32),
        ("cat", F16, F16, F16),
        // batch_norm keeps the activations' dtype with F32 parameters.
        ("batch_norm", F16, F32, F16),
        // Pass through.
        ("relu", F32, F32, F32),
        ("max_pool2d", BF16, F32, BF16),
    ] {
        assert_eq!(call(op, a, b).unwrap().dtype(), want, "{op}({a}, {b})");
    }
}

/// The check: inside a scope a linear layer's output is F16 (or BF16) and a
/// softmax's F32; outside, F32; the gradients reach the F32 parameters as F32 and agree
/// with the F32 computation within the half dtype's tolerance.
#[test]
fn linear_is_half_softmax_is_f32_and_gradients_reach_f32_parameters() {
    on_device!("linear_is_half_softmax_is_f32_and_gradients_reach_f32_parameters");
    for ac in [DType::F16, DType::BF16] {
        let mut rng = Generator::new(3);
        let mut lin = Linear::new(37, 19, true, &mut rng).unwrap();
        lin.to_device(DEVICE).unwrap();
        let (x, xv) = rand_tensor(&[5, 37], DType::F32, true, &mut rng);
        let x = x.to_device(DEVICE).unwrap();
        let loss_of = |y: &Tensor| y.softmax(-1).unwrap().square().unwrap().sum_all().unwrap();

        // F32 reference gradients.
        let y32 = lin.forward(&x).unwrap();
        assert_eq!(y32.dtype(), DType::F32);
        loss_of(&y32).backward().unwrap();
        let want: Vec<Vec<f64>> = lin
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f64())
            .collect();
        lin.zero_grad();

        let loss = {
            let _g = autocast(ac);
            let y = lin.forward(&x).unwrap();
            assert_eq!(y.dtype(), ac, "linear under autocast({ac})");
            let s = y.softmax(-1).unwrap();
            assert_eq!(s.dtype(), DType::F32, "softmax under autocast({ac})");
            loss_of(&y)
        };
        assert_eq!(autocast_dtype(), None);
        assert_eq!(
            lin.forward(&x).unwrap().dtype(),
            DType::F32,
            "outside the scope"
        );
        loss.backward().unwrap();
        for (p, w) in lin.parameters().iter().zip(&want) {
            let g = p.grad().unwrap();
            assert_eq!(g.dtype(), DType::F32, "gradient of an F32 parameter");
            assert_eq!(g.device(), DEVICE);
            // The forward and backward GEMMs run on inputs rounded to `ac`: a chain through
            // half intermediates, bounded relative to the gradient's scale.
            let scale = w.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
            let got = g.to_vec_f64();
            for (i, (&gv, &wv)) in got.iter().zip(w).enumerate() {
                let tol = 40.0 * ac.finfo().unwrap().epsilon * scale;
                assert!(
                    (gv - wv).abs() <= tol,
                    "autocast({ac}) gradient [{i}] {gv} vs F32 {wv} (tol {tol})"
                );
            }
        }
        // Not a vacuous comparison: the input values were not all exactly representable.
        assert!(xv
            .iter()
            .any(|&v| (v as f32) != half::f16::from_f64(v).to_f32()));
    }
}

#[test]
fn parameter_casts_are_cached_for_the_outermost_scope_and_gradients_accumulate() {
    on_device!("parameter_casts_are_cached_for_the_outermost_scope_and_gradients_accumulate");
    let mut rng = Generator::new(11);
    let w = Tensor::randn(&[8, 8], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .to_device(DEVICE)
        .unwrap()
        .requires_grad_();
    let x = Tensor::randn(&[3, 8], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .to_device(DEVICE)
        .unwrap();
    // Reference: the same weight used twice, in F32.
    x.linear(&w, None)
        .unwrap()
        .linear(&w, None)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want = w.grad().unwrap().to_vec_f64();
    w.zero_grad();
    let loss = {
        let _outer = autocast(DType::F16);
        let h = x.linear(&w, None).unwrap();
        assert_eq!(cached_casts(), 1);
        let y = {
            let _inner = autocast(DType::F16);
            h.linear(&w, None).unwrap()
        };
        // The inner scope closing keeps the outer scope's cache.
        assert_eq!(cached_casts(), 1, "one cast of w, reused");
        y.sum_all().unwrap()
    };
    assert_eq!(cached_casts(), 0, "the cache dies with the outermost scope");
    loss.backward().unwrap();
    let g = w.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    let got = g.to_vec_f64();
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    for (gv, wv) in got.iter().zip(&want) {
        assert!(
            (gv - wv).abs() <= 30.0 * DType::F16.finfo().unwrap().epsilon * scale,
            "{gv} vs {wv}: both uses of the cached cast must contribute"
        );
    }

    // Under no_grad nothing is cached (a cast without backward must not be reused later).
    {
        let _ng = hemi::no_grad();
        let _g = autocast(DType::F16);
        x.linear(&w, None).unwrap();
        assert_eq!(cached_casts(), 0);
    }
    // Non-parameters are not cached either.
    {
        let _g = autocast(DType::F16);
        x.matmul(&x.t().unwrap()).unwrap();
        assert_eq!(cached_casts(), 0);
    }
}

/// Backward inside an open scope computes exactly what it computes outside: the backward
/// GEMMs of an F32 graph are not autocast.
#[test]
fn backward_is_not_autocast() {
    on_device!("backward_is_not_autocast");
    let mut rng = Generator::new(5);
    let leaf = |shape: &[usize], rng: &mut Generator| {
        Tensor::randn(shape, 0.0, 1.0, DType::F32, rng)
            .unwrap()
            .to_device(DEVICE)
            .unwrap()
            .requires_grad_()
    };
    let (a, b) = (leaf(&[9, 13], &mut rng), leaf(&[13, 7], &mut rng));
    let run = |inside: bool| {
        a.zero_grad();
        b.zero_grad();
        let loss = a.matmul(&b).unwrap().exp().unwrap().mean_all().unwrap();
        let _g = inside.then(|| autocast(DType::F16));
        loss.backward().unwrap();
        (
            a.grad().unwrap().to_vec_f32(),
            b.grad().unwrap().to_vec_f32(),
        )
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn a_model_under_autocast_keeps_half_activations_and_an_f32_loss() {
    on_device!("a_model_under_autocast_keeps_half_activations_and_an_f32_loss");
    let mut rng = Generator::new(2);
    let mut net = hemi::models::CifarNet::new(3, 32, 32, 10, &mut rng).unwrap();
    net.to_device(DEVICE).unwrap();
    let x = Tensor::randn(&[2, 3, 32, 32], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .to_device(DEVICE)
        .unwrap();
    let labels = Tensor::from_f32_vec(vec![1.0, 7.0], &[2], DType::I64)
        .unwrap()
        .to_device(DEVICE)
        .unwrap();
    let _g = autocast(DType::BF16);
    let logits = net.forward(&x).unwrap();
    assert_eq!((logits.dtype(), logits.device()), (DType::BF16, DEVICE));
    let loss = cross_entropy(&logits, &labels, CrossEntropyOptions::default()).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    assert!(loss.to_scalar().unwrap().is_finite());
}
