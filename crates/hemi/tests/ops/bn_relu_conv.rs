//! The fused ResNet ops that compute an activation again in the backward instead of keeping
//! it: BN + ReLU + convolution (`Tensor::batch_norm_relu_conv2d`, a block's inner layers),
//! convolution + BN (`Tensor::conv2d_batch_norm`, the projection shortcut) and convolution +
//! BN + ReLU + max-pool (`Tensor::conv2d_batch_norm_relu_max_pool2d`, the ImageNet stem), and
//! convolution + BN + residual + ReLU (`Tensor::conv2d_batch_norm_add_relu`, a bottleneck's
//! end).
//! Each gives the same output, running statistics and gradients as its composition, bit for
//! bit, in F32, F16 and BF16, under autocast, on odd shapes, strides and non-contiguous
//! inputs; and close to the F64 composition. Also the graph's own part: an activation that
//! no backward saved is freed after the forward.

use crate::common;
use common::*;
use hemi::amp::autocast;
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::norm::BatchNormParams;
use hemi::{DType, Generator, Tensor};

/// One geometry: input shape, conv weight shape, stride, padding, with a conv bias.
struct Case {
    x: [usize; 4],
    w: [usize; 4],
    stride: usize,
    padding: usize,
    bias: bool,
}

const CASES: [Case; 4] = [
    Case {
        x: [3, 5, 7, 6],
        w: [4, 5, 3, 3],
        stride: 1,
        padding: 1,
        bias: false,
    },
    Case {
        x: [2, 3, 9, 5],
        w: [6, 3, 1, 1],
        stride: 2,
        padding: 0,
        bias: true,
    },
    Case {
        x: [4, 6, 5, 5],
        w: [3, 6, 3, 3],
        stride: 2,
        padding: 1,
        bias: true,
    },
    Case {
        x: [2, 7, 3, 11],
        w: [5, 7, 1, 1],
        stride: 1,
        padding: 0,
        bias: false,
    },
];

/// Which fused op (and its composition) a run takes.
#[derive(Clone, Copy, Debug)]
enum Op {
    BnReluConv,
    ConvBn,
    ConvBnReluPool,
    ConvBnAddRelu,
}

const OPS: [Op; 4] = [
    Op::BnReluConv,
    Op::ConvBn,
    Op::ConvBnReluPool,
    Op::ConvBnAddRelu,
];

/// What one run gives: output, then the gradients of x, BN weight, BN bias, conv weight,
/// conv bias (empty when absent), then the running mean and variance after the step.
#[allow(clippy::too_many_arguments)]
fn run(
    op: Op,
    fused: bool,
    case: &Case,
    x_dtype: DType,
    param_dtype: DType,
    ac: Option<DType>,
    strided: bool,
    seed: u64,
) -> Vec<Vec<f64>> {
    let mut rng = Generator::new(seed);
    // The norm's channels: the input's before the conv, the conv's outputs after it.
    let c = match op {
        Op::BnReluConv => case.x[1],
        Op::ConvBn | Op::ConvBnReluPool | Op::ConvBnAddRelu => case.w[0],
    };
    let n: usize = case.x.iter().product();
    let x = tensor(
        &rand_values(n, -1.5, 1.5, x_dtype, &mut rng),
        &case.x,
        x_dtype,
        strided,
    )
    .requires_grad_();
    let param = |len: usize, lo: f64, hi: f64, shape: &[usize], rng: &mut Generator| {
        Tensor::from_f64_vec(
            rand_values(len, lo, hi, param_dtype, rng),
            shape,
            param_dtype,
        )
        .unwrap()
        .requires_grad_()
    };
    let gamma = param(c, 0.5, 1.5, &[c], &mut rng);
    let beta = param(c, -0.5, 0.5, &[c], &mut rng);
    let wl: usize = case.w.iter().product();
    let w = param(wl, -0.5, 0.5, &case.w, &mut rng);
    let b = case
        .bias
        .then(|| param(case.w[0], -0.5, 0.5, &[case.w[0]], &mut rng));
    let rm = Tensor::from_f64_vec(vec![0.1; c], &[c], DType::F32).unwrap();
    let rv = Tensor::from_f64_vec(vec![0.9; c], &[c], DType::F32).unwrap();
    let opts = Conv2dOptions::default()
        .stride(case.stride)
        .padding(case.padding);
    let bn = BatchNormParams {
        running_mean: Some(&rm),
        running_var: Some(&rv),
        weight: Some(&gamma),
        bias: Some(&beta),
        training: true,
        momentum: 0.1,
        eps: 1e-5,
    };
    let norm_res = |t: &Tensor, residual: Option<&Tensor>, relu: bool| {
        t.batch_norm_act(
            Some(&rm),
            Some(&rv),
            Some(&gamma),
            Some(&beta),
            true,
            0.1,
            1e-5,
            residual,
            relu,
        )
        .unwrap()
    };
    let norm = |t: &Tensor, relu: bool| norm_res(t, None, relu);
    let window = ((3, 3), (2, 2), (1, 1));
    // The residual of `ConvBnAddRelu`: the conv output's shape, in the dtype the conv
    // computes in (a previous block's output), wanting a gradient.
    let conv_out = |i: usize| (case.x[i] + 2 * case.padding - case.w[i]) / case.stride + 1;
    let res_shape = [case.x[0], case.w[0], conv_out(2), conv_out(3)];
    let res_dtype = ac.unwrap_or(x_dtype);
    let res_n: usize = res_shape.iter().product();
    let res = Tensor::from_f64_vec(
        rand_values(res_n, -1.0, 1.0, res_dtype, &mut rng),
        &res_shape,
        res_dtype,
    )
    .unwrap()
    .requires_grad_();
    let out = {
        let _ac = ac.map(autocast);
        let b = b.as_ref();
        match (op, fused) {
            (Op::BnReluConv, true) => x.batch_norm_relu_conv2d(&bn, &w, b, opts).unwrap(),
            (Op::BnReluConv, false) => norm(&x, true).conv2d(&w, b, opts).unwrap(),
            (Op::ConvBn, true) => x.conv2d_batch_norm(&w, b, opts, &bn).unwrap(),
            (Op::ConvBn, false) => norm(&x.conv2d(&w, b, opts).unwrap(), false),
            (Op::ConvBnReluPool, true) => x
                .conv2d_batch_norm_relu_max_pool2d(&w, b, opts, &bn, window.0, window.1, window.2)
                .unwrap(),
            (Op::ConvBnReluPool, false) => norm(&x.conv2d(&w, b, opts).unwrap(), true)
                .max_pool2d(window.0, window.1, window.2)
                .unwrap(),
            (Op::ConvBnAddRelu, true) => x
                .conv2d_batch_norm_add_relu(&w, b, opts, &bn, &res)
                .unwrap(),
            (Op::ConvBnAddRelu, false) => {
                norm_res(&x.conv2d(&w, b, opts).unwrap(), Some(&res), true)
            }
        }
    };
    let out_n: usize = out.shape().iter().product();
    let g = Tensor::from_f64_vec(
        rand_values(out_n, -1.0, 1.0, out.dtype(), &mut rng),
        out.shape(),
        out.dtype(),
    )
    .unwrap();
    out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |t: &Tensor| t.grad().expect("a gradient").to_vec_f64();
    vec![
        out.to_vec_f64(),
        grad(&x),
        grad(&gamma),
        grad(&beta),
        grad(&w),
        b.as_ref().map(grad).unwrap_or_default(),
        rm.to_vec_f64(),
        rv.to_vec_f64(),
        match op {
            Op::ConvBnAddRelu => grad(&res),
            _ => Vec::new(),
        },
    ]
}

const NAMES: [&str; 9] = [
    "output",
    "dx",
    "dgamma",
    "dbeta",
    "dweight",
    "dbias",
    "running_mean",
    "running_var",
    "dresidual",
];

fn assert_bits(what: &str, fused: &[Vec<f64>], composed: &[Vec<f64>]) {
    for ((f, c), name) in fused.iter().zip(composed).zip(NAMES) {
        assert_eq!(f.len(), c.len(), "{what}: {name} lengths");
        for (i, (a, b)) in f.iter().zip(c).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "{what}: {name}[{i}] fused {a} vs composed {b}"
            );
        }
    }
}

#[test]
fn fused_is_bit_identical_to_the_composition() {
    for op in OPS {
        for (k, case) in CASES.iter().enumerate() {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for strided in [false, true] {
                    let seed = 100 + k as u64;
                    let what = format!("{op:?} case {k}, {dtype}, strided {strided}");
                    let f = run(op, true, case, dtype, dtype, None, strided, seed);
                    let c = run(op, false, case, dtype, dtype, None, strided, seed);
                    assert_bits(&what, &f, &c);
                }
            }
        }
    }
}

/// Mixed precision as a ResNet runs it: a half activation, F32 parameters, autocast
/// casting the conv weight (its F32 gradient comes back through the cast).
#[test]
fn fused_under_autocast_is_bit_identical_to_the_composition() {
    for op in OPS {
        for (k, case) in CASES.iter().enumerate() {
            for ac in [DType::BF16, DType::F16] {
                // A half input (a previous conv's output) and an F32 one (an image; before a
                // norm, one the conv would cast, which runs the composition).
                for x_dtype in [ac, DType::F32] {
                    let seed = 200 + k as u64;
                    let what = format!("{op:?} case {k}, autocast {ac}, input {x_dtype}");
                    let f = run(op, true, case, x_dtype, DType::F32, Some(ac), false, seed);
                    let c = run(op, false, case, x_dtype, DType::F32, Some(ac), false, seed);
                    assert_bits(&what, &f, &c);
                }
            }
        }
    }
}

/// The F32 fused op against the F64 composition (itself checked by finite differences in
/// tests/ops/bn_act.rs and tests/ops/conv.rs).
#[test]
fn fused_f32_matches_the_f64_composition() {
    for (op, (k, case)) in OPS
        .iter()
        .flat_map(|&op| CASES.iter().enumerate().map(move |c| (op, c)))
    {
        let seed = 300 + k as u64;
        let f = run(op, true, case, DType::F32, DType::F32, None, false, seed);
        let r = run(op, false, case, DType::F64, DType::F64, None, false, seed);
        // Batch norm over up to a few hundred values and products over up to 63 terms;
        // the gradients go through both.
        for ((got, want), name) in f.iter().zip(&r).zip(NAMES) {
            let tol = if name == "output" || name.starts_with("running") {
                balanced(DType::F32)
            } else {
                permissive(DType::F32)
            };
            assert_close(&format!("{op:?} case {k}: {name}"), got, want, tol);
        }
    }
}

/// Eval mode and no-grad run the composition: the same values.
#[test]
fn eval_and_no_grad_give_the_composition() {
    let case = &CASES[0];
    let mut rng = Generator::new(9);
    let c = case.x[1];
    let n: usize = case.x.iter().product();
    let x = Tensor::from_f64_vec(
        rand_values(n, -1.0, 1.0, DType::F32, &mut rng),
        &case.x,
        DType::F32,
    )
    .unwrap();
    let wl: usize = case.w.iter().product();
    let w = Tensor::from_f64_vec(
        rand_values(wl, -0.5, 0.5, DType::F32, &mut rng),
        &case.w,
        DType::F32,
    )
    .unwrap();
    let rm = Tensor::from_f64_vec(vec![0.2; c], &[c], DType::F32).unwrap();
    let rv = Tensor::from_f64_vec(vec![0.7; c], &[c], DType::F32).unwrap();
    let opts = Conv2dOptions::default().padding(1);
    for training in [false, true] {
        let bn = BatchNormParams {
            running_mean: Some(&rm),
            running_var: Some(&rv),
            weight: None,
            bias: None,
            training,
            momentum: 0.1,
            eps: 1e-5,
        };
        let _ng = hemi::no_grad();
        let f = x.batch_norm_relu_conv2d(&bn, &w, None, opts).unwrap();
        let c = x
            .batch_norm_act(
                Some(&rm),
                Some(&rv),
                None,
                None,
                training,
                0.1,
                1e-5,
                None,
                true,
            )
            .unwrap()
            .conv2d(&w, None, opts)
            .unwrap();
        assert_eq!(f.to_vec_f64(), c.to_vec_f64(), "training {training}");
    }
}

/// Bad shapes are errors that name the op, and the running statistics are left alone.
#[test]
fn a_bad_weight_is_an_error_before_any_update() {
    let x = Tensor::zeros(&[2, 3, 4, 4], DType::F32)
        .unwrap()
        .requires_grad_();
    let w = Tensor::zeros(&[4, 5, 3, 3], DType::F32)
        .unwrap()
        .requires_grad_();
    let rm = Tensor::from_f64_vec(vec![0.5; 3], &[3], DType::F32).unwrap();
    let rv = Tensor::from_f64_vec(vec![0.5; 3], &[3], DType::F32).unwrap();
    let bn = BatchNormParams {
        running_mean: Some(&rm),
        running_var: Some(&rv),
        weight: None,
        bias: None,
        training: true,
        momentum: 0.1,
        eps: 1e-5,
    };
    let e = x
        .batch_norm_relu_conv2d(&bn, &w, None, Conv2dOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("conv2d"), "{e}");
    assert_eq!(rm.to_vec_f64(), vec![0.5; 3]);
}

/// The graph keeps an op's result only where a backward saved it: a sum that only a
/// max-pool read is freed once the forward is done, and the gradients stay right.
#[test]
fn the_graph_frees_what_no_backward_saved() {
    let mut rng = Generator::new(3);
    let a = Tensor::randn(&[2, 3, 6, 6], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .requires_grad_();
    let b = Tensor::randn(&[2, 3, 6, 6], 0.0, 1.0, DType::F32, &mut rng)
        .unwrap()
        .requires_grad_();
    let s = a.add(&b).unwrap();
    let kept = std::sync::Arc::downgrade(&s.storage());
    let y = s.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap();
    drop(s);
    assert!(
        kept.upgrade().is_none(),
        "the max-pool's input outlived the forward"
    );
    y.sum_all().unwrap().backward().unwrap();
    // Each window's gradient goes to its largest a + b, to both addends.
    let (av, bv) = (a.to_vec_f64(), b.to_vec_f64());
    let ga = a.grad().unwrap().to_vec_f64();
    assert_eq!(ga, b.grad().unwrap().to_vec_f64());
    let sum: Vec<f64> = av.iter().zip(&bv).map(|(x, y)| x + y).collect();
    for plane in 0..6 {
        for (wi, wj) in (0..3).flat_map(|i| (0..3).map(move |j| (i, j))) {
            let idx = |di: usize, dj: usize| plane * 36 + (2 * wi + di) * 6 + 2 * wj + dj;
            let cells = [idx(0, 0), idx(0, 1), idx(1, 0), idx(1, 1)];
            let best = *cells
                .iter()
                .max_by(|&&p, &&q| sum[p].partial_cmp(&sum[q]).unwrap())
                .unwrap();
            for p in cells {
                assert_eq!(ga[p], if p == best { 1.0 } else { 0.0 }, "plane {plane}");
            }
        }
    }
}
