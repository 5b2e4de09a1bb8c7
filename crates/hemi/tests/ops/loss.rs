//! softmax, log_softmax and the losses (cross-entropy, NLL, MSE) against f64 references per
//! input dtype, their output dtypes (F32 for half inputs), stability for far-apart logits,
//! PyTorch's ignore_index and label-smoothing semantics, gradients by finite differences,
//! and the errors.

use crate::common;
use common::*;
use hemi::ops::loss::{cross_entropy, mse_loss, nll_loss, CrossEntropyOptions, Reduction};
use hemi::{DType, Error, Generator, Tensor};

const REDUCTIONS: [Reduction; 3] = [Reduction::Mean, Reduction::Sum, Reduction::None];

/// `[outer, len, inner]` around dim `d` of `shape`.
fn split(shape: &[usize], d: usize) -> (usize, usize, usize) {
    (
        shape[..d].iter().product(),
        shape[d],
        shape[d + 1..].iter().product(),
    )
}

/// f64 softmax (or log-softmax) along dim `d`.
fn softmax_ref(v: &[f64], shape: &[usize], d: usize, log: bool) -> Vec<f64> {
    let (outer, len, inner) = split(shape, d);
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * len + k) * inner + i;
            let m = (0..len).map(|k| v[at(k)]).fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = (0..len).map(|k| (v[at(k)] - m).exp()).sum();
            for k in 0..len {
                out[at(k)] = if log {
                    v[at(k)] - m - s.ln()
                } else {
                    (v[at(k)] - m).exp() / s
                };
            }
        }
    }
    out
}

/// f64 cross-entropy with PyTorch's semantics (class dim 1, or 0 for a 1-D input).
fn ce_ref(
    v: &[f64],
    shape: &[usize],
    target: &[i64],
    ignore: Option<i64>,
    eps: f64,
    reduction: Reduction,
) -> Vec<f64> {
    let d = if shape.len() == 1 { 0 } else { 1 };
    let lp = softmax_ref(v, shape, d, true);
    let (outer, classes, inner) = split(shape, d);
    let mut losses = vec![0.0; outer * inner];
    let mut count = 0.0;
    for o in 0..outer {
        for i in 0..inner {
            let t = target[o * inner + i];
            if Some(t) == ignore {
                continue;
            }
            count += 1.0;
            let at = |k: usize| (o * classes + k) * inner + i;
            let smooth: f64 = (0..classes).map(|k| -lp[at(k)]).sum::<f64>() / classes as f64;
            losses[o * inner + i] = (1.0 - eps) * -lp[at(t as usize)] + eps * smooth;
        }
    }
    reduce_ref(losses, count, reduction)
}

fn reduce_ref(losses: Vec<f64>, count: f64, reduction: Reduction) -> Vec<f64> {
    match reduction {
        Reduction::None => losses,
        Reduction::Sum => vec![losses.iter().sum()],
        Reduction::Mean => vec![losses.iter().sum::<f64>() / count],
    }
}

fn targets(n: usize, classes: usize, ignored: &[usize], rng: &mut Generator) -> Vec<i64> {
    (0..n)
        .map(|r| {
            if ignored.contains(&r) {
                -100
            } else {
                rng.below(classes as u64) as i64
            }
        })
        .collect()
}

fn labels(t: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(t.to_vec(), shape).unwrap()
}

// ----- softmax and log_softmax --------------------------------------------------------

/// Any dim, odd sizes, size-1 dims and non-contiguous views.
const SOFTMAX_CASES: [(&[usize], isize, bool); 8] = [
    (&[7, 13], -1, true),
    (&[7, 13], 0, true),
    (&[3, 4, 5], 0, true),
    (&[3, 4, 5], 1, false),
    (&[3, 4, 5], -1, true),
    (&[1, 6, 1], 1, false),
    (&[17], 0, true),
    (&[2, 1], 1, false),
];

fn softmax_forward(dtype: DType) {
    let mut rng = Generator::new(21);
    for (shape, dim, strided) in SOFTMAX_CASES {
        let v = rand_values(shape.iter().product(), -6.0, 6.0, dtype, &mut rng);
        let t = tensor(&v, shape, dtype, strided);
        let d = if dim < 0 {
            dim + shape.len() as isize
        } else {
            dim
        } as usize;
        for log in [false, true] {
            let out = if log {
                t.log_softmax(dim)
            } else {
                t.softmax(dim)
            }
            .unwrap();
            // An FP32 op: F32 out whatever the input, computed in F32 from exact inputs, so
            // the tolerance is F32's (a half intermediate would miss it by ~100x).
            assert_eq!(out.dtype(), DType::F32);
            assert_eq!(out.shape(), shape);
            assert_close(
                &format!(
                    "{} {dtype} {shape:?} dim {dim}",
                    if log { "log_softmax" } else { "softmax" }
                ),
                &out.to_vec_f64(),
                &softmax_ref(&v, shape, d, log),
                balanced(DType::F32),
            );
        }
    }
}
dtype_tests!(softmax_and_log_softmax_match_f64, super::softmax_forward);

fn far_apart_logits_stay_finite(dtype: DType) {
    // Logits 1e4 apart: exp(1e4) overflows every float type, so only a max-subtracted
    // softmax gets these right.
    let v = round_to(
        &[
            0.0, 1e4, -1e4, 5e3, 1e4, 1e4, -1e4, 0.0, -1e4, -1e4, -1e4, -1e4,
        ],
        dtype,
    );
    let shape = [3, 4];
    let x = tensor(&v, &shape, dtype, false).requires_grad_();
    let tol = balanced(DType::F32);
    let sm = x.softmax(1).unwrap().to_vec_f64();
    assert_close("softmax 1e4", &sm, &softmax_ref(&v, &shape, 1, false), tol);
    let lsm = x.log_softmax(-1).unwrap().to_vec_f64();
    assert!(lsm.iter().all(|x| x.is_finite()), "{lsm:?}");
    assert_close(
        "log_softmax 1e4",
        &lsm,
        &softmax_ref(&v, &shape, 1, true),
        tol,
    );
    let t = [2i64, 3, 0];
    for eps in [0.0, 0.1] {
        let opts = CrossEntropyOptions {
            label_smoothing: eps,
            ..Default::default()
        };
        let loss = cross_entropy(&x, &labels(&t, &[3]), opts).unwrap();
        let want = ce_ref(&v, &shape, &t, None, eps, Reduction::Mean);
        assert_close("cross_entropy 1e4", &loss.to_vec_f64(), &want, tol);
        x.zero_grad();
        loss.backward().unwrap();
        let g = x.grad().unwrap().to_vec_f64();
        assert!(g.iter().all(|g| g.is_finite()), "{g:?}");
    }
}
dtype_tests!(
    logits_1e4_apart_stay_finite,
    super::far_apart_logits_stay_finite
);

/// Rows as wide as BERT's vocabulary (the row maximum runs in eight lanes, `exp` is the
/// polynomial one), odd widths whose tails the lanes miss, and the max's special cases: a
/// NaN anywhere makes its row NaN, zeros of both signs give a uniform row, -inf everywhere NaN.
#[test]
fn wide_rows_nans_and_signed_zeros() {
    let mut rng = Generator::new(23);
    for shape in [[3usize, 30522], [2, 1037], [4, 9], [5, 7]] {
        let v = rand_values(shape.iter().product(), -12.0, 12.0, DType::F32, &mut rng);
        let t = tensor(&v, &shape, DType::F32, false);
        for log in [false, true] {
            let out = if log { t.log_softmax(1) } else { t.softmax(1) }.unwrap();
            assert_close(
                &format!("log {log} {shape:?}"),
                &out.to_vec_f64(),
                &softmax_ref(&v, &shape, 1, log),
                balanced(DType::F32),
            );
        }
        // One NaN per row, at a lane position, in the tail, first and last.
        let w = shape[1];
        for at in [0, 5, w / 2, w - 1] {
            let mut nv = v.clone();
            nv[at] = f64::NAN;
            let t = tensor(&nv, &shape, DType::F32, false);
            let out = t.log_softmax(1).unwrap().to_vec_f64();
            assert!(out[..w].iter().all(|x| x.is_nan()), "NaN at {at} of {w}");
            assert!(
                out[w..].iter().all(|x| !x.is_nan()),
                "NaN leaked from row 0"
            );
        }
    }
    let z = [-0.0, 0.0, -0.0, 0.0, 0.0, -0.0, 0.0, -0.0, -0.0, 0.0, -0.0];
    let t = tensor(&z, &[1, z.len()], DType::F32, false);
    let out = t.log_softmax(1).unwrap().to_vec_f64();
    let want = -(z.len() as f64).ln();
    assert!(out.iter().all(|&x| (x - want).abs() < 1e-6), "{out:?}");
    let inf = [f64::NEG_INFINITY; 13];
    let out = tensor(&inf, &[1, 13], DType::F32, false)
        .softmax(1)
        .unwrap()
        .to_vec_f64();
    assert!(
        out.iter().all(|x| x.is_nan()),
        "all -inf: {out:?} (PyTorch: NaN)"
    );
}

#[test]
fn softmax_and_log_softmax_gradients() {
    let mut rng = Generator::new(22);
    let x = grad_input(&[3, 4, 5], &mut rng);
    for dim in [0, 1, -1] {
        gradcheck(
            &format!("softmax dim {dim}"),
            std::slice::from_ref(&x),
            |t| t[0].softmax(dim),
        );
        gradcheck(
            &format!("log_softmax dim {dim}"),
            std::slice::from_ref(&x),
            |t| t[0].log_softmax(dim),
        );
    }
    gradcheck("softmax of a view", std::slice::from_ref(&x), |t| {
        t[0].transpose(0, 2)?.softmax(1)
    });
    gradcheck("log_softmax of a view", &[x], |t| {
        t[0].permute(&[1, 2, 0])?.log_softmax(-1)
    });
    gradcheck("softmax 1-D", &[grad_input(&[6], &mut rng)], |t| {
        t[0].softmax(0)
    });
}

// ----- cross-entropy ------------------------------------------------------------------

/// (logits shape, positions whose target is ignored, non-contiguous logits).
const CE_CASES: [(&[usize], &[usize], bool); 6] = [
    (&[9, 7], &[2, 5], false),
    (&[9, 7], &[], true),
    (&[3, 5, 4], &[1, 6], true),
    (&[2, 3, 2, 3], &[0], false),
    (&[1, 2], &[], false),
    (&[6], &[], true),
];

fn cross_entropy_forward(dtype: DType) {
    let mut rng = Generator::new(23);
    for (shape, ignored, strided) in CE_CASES {
        let v = rand_values(shape.iter().product(), -4.0, 4.0, dtype, &mut rng);
        let logits = tensor(&v, shape, dtype, strided);
        let tshape: Vec<usize> = if shape.len() == 1 {
            vec![]
        } else {
            [&shape[..1], &shape[2..]].concat()
        };
        let classes = shape[if shape.len() == 1 { 0 } else { 1 }];
        let t = targets(tshape.iter().product(), classes, ignored, &mut rng);
        for eps in [0.0, 0.1, 1.0] {
            for reduction in REDUCTIONS {
                let opts = CrossEntropyOptions {
                    reduction,
                    label_smoothing: eps,
                    ..Default::default()
                };
                let out = cross_entropy(&logits, &labels(&t, &tshape), opts).unwrap();
                assert_eq!(out.dtype(), DType::F32, "cross_entropy of {dtype} logits");
                let want_shape: &[usize] = if reduction == Reduction::None {
                    &tshape
                } else {
                    &[]
                };
                assert_eq!(out.shape(), want_shape);
                assert_close(
                    &format!("cross_entropy {dtype} {shape:?} eps {eps} {reduction:?}"),
                    &out.to_vec_f64(),
                    &ce_ref(&v, shape, &t, Some(-100), eps, reduction),
                    balanced(DType::F32),
                );
            }
        }
    }
}
dtype_tests!(cross_entropy_matches_f64, super::cross_entropy_forward);

fn cross_entropy_backward(dtype: DType) {
    // The fused backward (softmax - smoothed one-hot) · scale, rounded once into the
    // logits' dtype.
    let mut rng = Generator::new(24);
    let shape = [5usize, 6, 3];
    let v = rand_values(90, -3.0, 3.0, dtype, &mut rng);
    let x = tensor(&v, &shape, dtype, true).requires_grad_();
    let t = targets(15, 6, &[4, 11], &mut rng);
    let eps = 0.2;
    let opts = CrossEntropyOptions {
        label_smoothing: eps,
        ..Default::default()
    };
    cross_entropy(&x, &labels(&t, &[5, 3]), opts)
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), dtype, "a gradient has its tensor's dtype");
    let p = softmax_ref(&v, &shape, 1, false);
    let mut want = vec![0.0; 90];
    for o in 0..5 {
        for i in 0..3 {
            let tt = t[o * 3 + i];
            if tt == -100 {
                continue;
            }
            for k in 0..6 {
                let q = (1.0 - eps) * (k as i64 == tt) as i32 as f64 + eps / 6.0;
                want[(o * 6 + k) * 3 + i] = (p[(o * 6 + k) * 3 + i] - q) / 13.0;
            }
        }
    }
    assert_close("cross_entropy grad", &g.to_vec_f64(), &want, strict(dtype));
}
dtype_tests!(cross_entropy_fused_backward, super::cross_entropy_backward);

#[test]
fn uniform_logits_give_ln_c() {
    for (classes, dtype) in [(10usize, DType::F16), (7, DType::BF16), (1000, DType::F32)] {
        let logits = Tensor::full(&[4, classes], 3.0, dtype).unwrap();
        let t = labels(&[0, 1, (classes - 1) as i64, 2], &[4]);
        for eps in [0.0, 0.3] {
            for reduction in REDUCTIONS {
                let opts = CrossEntropyOptions {
                    reduction,
                    label_smoothing: eps,
                    ..Default::default()
                };
                let out = cross_entropy(&logits, &t, opts).unwrap().to_vec_f64();
                let ln_c = (classes as f64).ln();
                let want = match reduction {
                    Reduction::Sum => vec![4.0 * ln_c],
                    Reduction::Mean => vec![ln_c],
                    Reduction::None => vec![ln_c; 4],
                };
                assert_close(&format!("ln {classes}"), &out, &want, strict(DType::F32));
            }
        }
    }
}

#[test]
fn ignore_index_semantics() {
    let mut rng = Generator::new(25);
    let v: Vec<f64> = (0..20).map(|_| rng.uniform(-2.0, 2.0)).collect();
    let logits = Tensor::from_f64_vec(v.clone(), &[4, 5], DType::F32).unwrap();
    let v = round_to(&v, DType::F32);
    // A custom ignore index inside the class range: those targets are skipped, and the
    // mean divides by the 2 others.
    let t = [3i64, 1, 3, 0];
    let opts = CrossEntropyOptions {
        ignore_index: Some(3),
        ..Default::default()
    };
    let got = cross_entropy(&logits, &labels(&t, &[4]), opts).unwrap();
    let want = ce_ref(&v, &[4, 5], &t, Some(3), 0.0, Reduction::Mean);
    assert_close("ignore 3", &got.to_vec_f64(), &want, balanced(DType::F32));
    let none = cross_entropy(
        &logits,
        &labels(&t, &[4]),
        CrossEntropyOptions {
            reduction: Reduction::None,
            ..opts
        },
    )
    .unwrap()
    .to_vec_f64();
    assert_eq!((none[0], none[2]), (0.0, 0.0));
    assert!(none[1] > 0.0 && none[3] > 0.0);
    // With no ignore index every target must be a class: -100 is out of range.
    let t = labels(&[1, -100, 0, 2], &[4]);
    let e = cross_entropy(
        &logits,
        &t,
        CrossEntropyOptions {
            ignore_index: None,
            ..Default::default()
        },
    );
    assert!(
        matches!(
            e,
            Err(Error::Index {
                op: "cross_entropy",
                index: -100,
                size: 5
            })
        ),
        "{e:?}"
    );

    // Every target ignored: mean is NaN (0/0, as PyTorch), sum 0, none all zeros, and the
    // gradient is zero, not NaN.
    let x = logits.detach().requires_grad_();
    let all = labels(&[-100; 4], &[4]);
    for eps in [0.0, 0.1] {
        let opts = |reduction| CrossEntropyOptions {
            reduction,
            label_smoothing: eps,
            ..Default::default()
        };
        let mean = cross_entropy(&x, &all, opts(Reduction::Mean)).unwrap();
        assert!(mean.to_scalar().unwrap().is_nan());
        assert_eq!(
            cross_entropy(&x, &all, opts(Reduction::Sum))
                .unwrap()
                .to_scalar()
                .unwrap(),
            0.0
        );
        assert_eq!(
            cross_entropy(&x, &all, opts(Reduction::None))
                .unwrap()
                .to_vec_f64(),
            vec![0.0; 4]
        );
        x.zero_grad();
        mean.backward().unwrap();
        assert_eq!(x.grad().unwrap().to_vec_f64(), vec![0.0; 20]);
    }
}

#[test]
fn label_smoothing_known_value() {
    // Two classes, logits (0, ln 3): p = (1/4, 3/4). Target 1, ε = 0.5:
    // 0.5·(-ln 3/4) + 0.5·(ln 4 + ln 4/3)/2.
    let logits = Tensor::from_f64_vec(vec![0.0, 3f64.ln()], &[1, 2], DType::F64).unwrap();
    let opts = CrossEntropyOptions {
        label_smoothing: 0.5,
        ..Default::default()
    };
    let got = cross_entropy(&logits, &labels(&[1], &[1]), opts)
        .unwrap()
        .to_scalar()
        .unwrap();
    let want = 0.5 * -(0.75f64.ln()) + 0.5 * (4f64.ln() + (4.0f64 / 3.0).ln()) / 2.0;
    assert!((got - want).abs() < 1e-14, "{got} vs {want}");
}

#[test]
fn cross_entropy_gradients() {
    let mut rng = Generator::new(26);
    let x = grad_input(&[5, 4], &mut rng);
    let t2 = labels(&[0, 3, -100, 1, 2], &[5]);
    let x3 = grad_input(&[2, 4, 3], &mut rng);
    let t3 = labels(&[0, -100, 3, 2, 1, 1], &[2, 3]);
    let t3_ones = labels(&[0, 1, 3, 2, 1, 1], &[2, 3]);
    for eps in [0.0, 0.2] {
        for reduction in REDUCTIONS {
            let opts = CrossEntropyOptions {
                reduction,
                label_smoothing: eps,
                ..Default::default()
            };
            let what = format!("cross_entropy eps {eps} {reduction:?}");
            gradcheck(&what, std::slice::from_ref(&x), |l| {
                cross_entropy(&l[0], &t2, opts)
            });
            gradcheck(&format!("3-D {what}"), std::slice::from_ref(&x3), |l| {
                cross_entropy(&l[0], &t3, opts)
            });
            let custom = CrossEntropyOptions {
                ignore_index: Some(1),
                ..opts
            };
            gradcheck(
                &format!("ignore 1 {what}"),
                std::slice::from_ref(&x3),
                |l| {
                    cross_entropy(
                        &l[0].transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
                        &t3_ones,
                        custom,
                    )
                },
            );
        }
    }
    // Through a graph: logits computed from a weight.
    let w = grad_input(&[4, 4], &mut rng);
    gradcheck("cross_entropy after a product", &[x, w], |l| {
        cross_entropy(
            &l[0].mul(&l[1].narrow(0, 0, 1)?)?,
            &t2,
            CrossEntropyOptions::default(),
        )
    });
}

// ----- NLL ------------------------------------------------------------------------------

fn nll_forward(dtype: DType) {
    let mut rng = Generator::new(27);
    for (shape, ignored, strided) in CE_CASES {
        let v = rand_values(shape.iter().product(), -5.0, 0.0, dtype, &mut rng);
        let lp = tensor(&v, shape, dtype, strided);
        let d = if shape.len() == 1 { 0 } else { 1 };
        let tshape: Vec<usize> = if d == 0 {
            vec![]
        } else {
            [&shape[..1], &shape[2..]].concat()
        };
        let (outer, classes, inner) = split(shape, d);
        let t = targets(tshape.iter().product(), classes, ignored, &mut rng);
        for reduction in REDUCTIONS {
            let out = nll_loss(&lp, &labels(&t, &tshape), reduction, Some(-100)).unwrap();
            assert_eq!(out.dtype(), DType::F32);
            let mut losses = vec![0.0; outer * inner];
            let mut count = 0.0;
            for (r, &tt) in t.iter().enumerate() {
                if tt != -100 {
                    let (o, i) = (r / inner, r % inner);
                    losses[r] = -v[(o * classes + tt as usize) * inner + i];
                    count += 1.0;
                }
            }
            assert_close(
                &format!("nll_loss {dtype} {shape:?} {reduction:?}"),
                &out.to_vec_f64(),
                &reduce_ref(losses, count, reduction),
                balanced(DType::F32),
            );
        }
    }
}
dtype_tests!(nll_loss_matches_f64, super::nll_forward);

#[test]
fn nll_loss_gradients_and_agreement_with_cross_entropy() {
    let mut rng = Generator::new(28);
    let x = grad_input(&[5, 4], &mut rng);
    let t = labels(&[0, 3, -100, 1, 2], &[5]);
    for reduction in REDUCTIONS {
        gradcheck(
            &format!("nll {reduction:?}"),
            std::slice::from_ref(&x),
            |l| nll_loss(&l[0], &t, reduction, Some(-100)),
        );
        gradcheck(
            &format!("nll of log_softmax {reduction:?}"),
            std::slice::from_ref(&x),
            |l| nll_loss(&l[0].log_softmax(1)?, &t, reduction, Some(-100)),
        );
    }
    let x3 = grad_input(&[2, 4, 3], &mut rng);
    let t3 = labels(&[0, 2, 3, 2, 1, 1], &[2, 3]);
    gradcheck("nll 3-D ignore 2", &[x3], |l| {
        nll_loss(&l[0], &t3, Reduction::Mean, Some(2))
    });
    // cross_entropy = nll_loss ∘ log_softmax.
    let logits = Tensor::from_f64_vec(x.0, &[5, 4], DType::F32).unwrap();
    let a = cross_entropy(&logits, &t, CrossEntropyOptions::default()).unwrap();
    let b = nll_loss(
        &logits.log_softmax(1).unwrap(),
        &t,
        Reduction::Mean,
        Some(-100),
    )
    .unwrap();
    assert_close(
        "ce vs nll",
        &a.to_vec_f64(),
        &b.to_vec_f64(),
        strict(DType::F32),
    );
}

// ----- MSE ------------------------------------------------------------------------------

fn mse_forward(dtype: DType) {
    let mut rng = Generator::new(29);
    for (shape, strided) in [
        (&[7usize, 13][..], true),
        (&[1, 5, 1], false),
        (&[17], true),
        (&[], false),
    ] {
        let (a, va) = rand_tensor(shape, dtype, strided, &mut rng);
        let (b, vb) = rand_tensor(shape, dtype, false, &mut rng);
        let sq: Vec<f64> = va.iter().zip(&vb).map(|(x, y)| (x - y) * (x - y)).collect();
        for reduction in REDUCTIONS {
            let out = mse_loss(&a, &b, reduction).unwrap();
            assert_eq!(out.dtype(), DType::F32);
            assert_close(
                &format!("mse {dtype} {shape:?} {reduction:?}"),
                &out.to_vec_f64(),
                &reduce_ref(sq.clone(), sq.len() as f64, reduction),
                balanced(DType::F32),
            );
        }
    }
}
dtype_tests!(mse_loss_matches_f64, super::mse_forward);

#[test]
fn mse_gradients() {
    let mut rng = Generator::new(30);
    for reduction in REDUCTIONS {
        gradcheck(
            &format!("mse {reduction:?}"),
            &[grad_input(&[3, 5], &mut rng), grad_input(&[3, 5], &mut rng)],
            |x| mse_loss(&x[0], &x[1].t()?.contiguous()?.t()?, reduction),
        );
    }
}

// ----- dtypes, parallel paths and errors ----------------------------------------------

#[test]
fn output_dtypes_are_fp32_ops() {
    let t = labels(&[1, 0], &[2]);
    for (input, want) in [
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F32, DType::F32),
        (DType::F64, DType::F64),
    ] {
        let x = Tensor::ones(&[2, 3], input).unwrap().requires_grad_();
        assert_eq!(x.softmax(1).unwrap().dtype(), want);
        assert_eq!(x.log_softmax(0).unwrap().dtype(), want);
        let ce = cross_entropy(&x, &t, CrossEntropyOptions::default()).unwrap();
        assert_eq!(ce.dtype(), want);
        assert_eq!(
            nll_loss(&x, &t, Reduction::Sum, None).unwrap().dtype(),
            want
        );
        assert_eq!(mse_loss(&x, &x, Reduction::Mean).unwrap().dtype(), want);
        ce.backward().unwrap();
        assert_eq!(x.grad().unwrap().dtype(), input);
    }
    // Mixed dtypes promote first: F16 with BF16 is F32, with F64 is F64.
    let h = Tensor::ones(&[2], DType::F16).unwrap();
    let b = Tensor::ones(&[2], DType::BF16).unwrap();
    let d = Tensor::ones(&[2], DType::F64).unwrap();
    assert_eq!(
        mse_loss(&h, &b, Reduction::Sum).unwrap().dtype(),
        DType::F32
    );
    assert_eq!(
        mse_loss(&h, &d, Reduction::Sum).unwrap().dtype(),
        DType::F64
    );
}

#[test]
fn large_inputs_take_the_parallel_path() {
    // Above the parallel threshold along the last dim and along dim 0 (gathered rows).
    let mut rng = Generator::new(31);
    let shape = [301usize, 129];
    let v = rand_values(301 * 129, -5.0, 5.0, DType::BF16, &mut rng);
    let x = tensor(&v, &shape, DType::BF16, true);
    for dim in [0usize, 1] {
        let got = x.log_softmax(dim as isize).unwrap().to_vec_f64();
        assert_close(
            "big log_softmax",
            &got,
            &softmax_ref(&v, &shape, dim, true),
            balanced(DType::F32),
        );
    }
    let t = targets(301, 129, &[7], &mut rng);
    let opts = CrossEntropyOptions {
        label_smoothing: 0.05,
        ..Default::default()
    };
    let got = cross_entropy(&x, &labels(&t, &[301]), opts)
        .unwrap()
        .to_vec_f64();
    assert_close(
        "big cross_entropy",
        &got,
        &ce_ref(&v, &shape, &t, Some(-100), 0.05, Reduction::Mean),
        balanced(DType::F32),
    );
}

#[test]
fn errors_name_the_op_and_shapes() {
    let x = Tensor::zeros(&[3, 5], DType::F16).unwrap();
    let ok = labels(&[0, 4, -100], &[3]);
    let ce = |t: &Tensor| cross_entropy(&x, t, CrossEntropyOptions::default());

    let e = ce(&Tensor::zeros(&[3], DType::F32).unwrap()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DType {
                op: "cross_entropy",
                dtype: DType::F32,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("[3, 5]"), "{e}");
    let e = ce(&labels(&[0, 1, 2, 3], &[4])).unwrap_err().to_string();
    assert!(
        e.contains("cross_entropy") && e.contains("[3, 5]") && e.contains("[4]"),
        "{e}"
    );
    let e = ce(&labels(&[0, 1, 2], &[3, 1])).unwrap_err().to_string();
    assert!(e.contains("[3, 1]"), "{e}");
    assert!(matches!(
        ce(&labels(&[0, 5, 1], &[3])),
        Err(Error::Index {
            op: "cross_entropy",
            index: 5,
            size: 5
        })
    ));
    assert!(matches!(
        ce(&labels(&[0, -1, 1], &[3])),
        Err(Error::Index { index: -1, .. })
    ));
    assert!(ce(&ok).is_ok());
    for eps in [-0.1, 1.5, f64::NAN] {
        let opts = CrossEntropyOptions {
            label_smoothing: eps,
            ..Default::default()
        };
        assert!(
            matches!(
                cross_entropy(&x, &ok, opts),
                Err(Error::Arg {
                    op: "cross_entropy",
                    ..
                })
            ),
            "{eps}"
        );
    }
    let ints = Tensor::zeros(&[3, 5], DType::I64).unwrap();
    assert!(matches!(
        cross_entropy(&ints, &ok, CrossEntropyOptions::default()),
        Err(Error::DType {
            op: "cross_entropy",
            dtype: DType::I64,
            ..
        })
    ));
    let e = cross_entropy(
        &Tensor::scalar(1.0, DType::F32),
        &labels(&[0], &[]),
        CrossEntropyOptions::default(),
    );
    assert!(matches!(
        e,
        Err(Error::Shape {
            op: "cross_entropy",
            ..
        })
    ));
    let no_classes = Tensor::zeros(&[2, 0], DType::F32).unwrap();
    assert!(cross_entropy(
        &no_classes,
        &labels(&[0, 0], &[2]),
        CrossEntropyOptions::default()
    )
    .is_err());
    // 3-D: the target drops the class dim.
    let x3 = Tensor::zeros(&[2, 4, 3], DType::BF16).unwrap();
    let e = cross_entropy(
        &x3,
        &labels(&[0; 8], &[2, 4]),
        CrossEntropyOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("[2, 4, 3]") && e.contains("[2, 3]") && e.contains("[2, 4]"),
        "{e}"
    );

    assert!(matches!(
        nll_loss(&x, &labels(&[0, 7, 1], &[3]), Reduction::Mean, Some(-100)),
        Err(Error::Index {
            op: "nll_loss",
            index: 7,
            size: 5
        })
    ));
    let e = mse_loss(
        &x,
        &Tensor::zeros(&[5], DType::F16).unwrap(),
        Reduction::Mean,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("mse_loss") && e.contains("[3, 5]") && e.contains("[5]"),
        "{e}"
    );
    assert!(matches!(
        mse_loss(&ints, &x, Reduction::Sum),
        Err(Error::DType { op: "mse_loss", .. })
    ));
    assert!(matches!(
        x.softmax(2),
        Err(Error::Dim {
            op: "softmax",
            dim: 2,
            rank: 2
        })
    ));
    assert!(matches!(
        x.log_softmax(-3),
        Err(Error::Dim {
            op: "log_softmax",
            ..
        })
    ));
    assert!(matches!(
        ints.softmax(0),
        Err(Error::DType { op: "softmax", .. })
    ));
}
