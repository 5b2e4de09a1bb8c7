//! The fused batch norm + residual add + ReLU (`Tensor::batch_norm_act`, ResNet's BN + ReLU
//! and BN + shortcut + ReLU): values and every gradient against the F64 composition of the
//! separate ops (itself checked by finite differences below and in tests/ops/norm.rs), per
//! dtype, on odd shapes and non-contiguous inputs, in training and eval; bit-identical to
//! the unfused composition in F32; the same bits on any thread count.

use crate::common;
use common::*;
use hemi::{DType, Generator, Tensor};

/// x, the residual (when used), weight, bias and the output gradient.
type Data<'a> = (
    &'a [f64],
    Option<&'a [f64]>,
    &'a [f64],
    &'a [f64],
    &'a [f64],
);

const SHAPES: [&[usize]; 3] = [&[4, 3, 5, 7], &[3, 5, 2, 3], &[2, 4, 1, 9]];

/// Runs `relu(bn(x) [+ r])` fused (in `dtype`) or composed, returning the output and the
/// gradients of x, w, b and r for the loss `sum(out * gw)`.
#[allow(clippy::too_many_arguments)]
fn run(
    fused: bool,
    dtype: DType,
    (xv, rv, wv, bv, gv): Data<'_>,
    shape: &[usize],
    strided: bool,
    training: bool,
    relu: bool,
) -> Vec<Vec<f64>> {
    let c = shape[1];
    let x = tensor(xv, shape, dtype, strided).requires_grad_();
    let r = rv.map(|rv| tensor(rv, shape, dtype, strided).requires_grad_());
    let w = Tensor::from_f64_vec(wv.to_vec(), &[c], DType::F32)
        .unwrap()
        .requires_grad_();
    let b = Tensor::from_f64_vec(bv.to_vec(), &[c], DType::F32)
        .unwrap()
        .requires_grad_();
    // Running statistics for eval (training updates copies nobody reads).
    let rm =
        Tensor::from_f64_vec((0..c).map(|i| 0.1 * i as f64).collect(), &[c], DType::F32).unwrap();
    let rvar = Tensor::from_f64_vec(
        (0..c).map(|i| 0.5 + 0.2 * i as f64).collect(),
        &[c],
        DType::F32,
    )
    .unwrap();
    let args = (Some(&rm), Some(&rvar), Some(&w), Some(&b));
    let out = if fused {
        x.batch_norm_act(
            args.0,
            args.1,
            args.2,
            args.3,
            training,
            0.1,
            1e-5,
            r.as_ref(),
            relu,
        )
        .unwrap()
    } else {
        let y = x
            .batch_norm(args.0, args.1, args.2, args.3, training, 0.1, 1e-5)
            .unwrap();
        let y = match &r {
            Some(r) => y.add(r).unwrap(),
            None => y,
        };
        if relu {
            y.relu().unwrap()
        } else {
            y
        }
    };
    assert_eq!(out.dtype(), dtype);
    let g = Tensor::from_f64_vec(gv.to_vec(), shape, dtype).unwrap();
    out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |t: &Tensor| t.grad().map(|g| g.to_vec_f64()).unwrap_or_default();
    let mut v = vec![out.to_vec_f64(), grad(&x), grad(&w), grad(&b)];
    if let Some(r) = &r {
        v.push(grad(r));
    }
    v
}

fn cases() -> Vec<(bool, bool, bool)> {
    // (training, residual, relu)
    let mut v = Vec::new();
    for training in [true, false] {
        for residual in [false, true] {
            for relu in [false, true] {
                if residual || relu {
                    v.push((training, residual, relu));
                }
            }
        }
    }
    v
}

fn fused_matches_f64_composition(dtype: DType) {
    let mut rng = Generator::new(21);
    for shape in SHAPES {
        for (training, residual, relu) in cases() {
            for strided in [false, true] {
                let n: usize = shape.iter().product();
                let c = shape[1];
                let xv = rand_values(n, -1.0, 1.0, dtype, &mut rng);
                let rv = rand_values(n, -1.0, 1.0, dtype, &mut rng);
                let wv = rand_values(c, 0.5, 1.5, DType::F32, &mut rng);
                let bv = rand_values(c, -0.5, 0.5, DType::F32, &mut rng);
                let gv = rand_values(n, -1.0, 1.0, dtype, &mut rng);
                let data = (
                    &xv[..],
                    residual.then_some(&rv[..]),
                    &wv[..],
                    &bv[..],
                    &gv[..],
                );
                let got = run(true, dtype, data, shape, strided, training, relu);
                let want = run(false, DType::F64, data, shape, false, training, relu);
                let what = |k: &str| {
                    format!(
                        "{k} {dtype} {shape:?} training={training} residual={residual} \
                         relu={relu} strided={strided}"
                    )
                };
                let names = ["out", "dx", "dweight", "dbias", "dresidual"];
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.len(), w.len(), "{}", what(names[i]));
                    // Output and dx: per-channel sums of ~100 O(1) values in F32, one
                    // rounding into the dtype; dweight/dbias are those sums (F32 results).
                    let tol = if i == 2 || i == 3 {
                        permissive(DType::F32)
                    } else {
                        balanced(dtype)
                    };
                    let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                    let scaled = |v: &[f64]| v.iter().map(|x| x / scale).collect::<Vec<_>>();
                    assert_close(&what(names[i]), &scaled(g), &scaled(w), tol);
                }
            }
        }
    }
}
dtype_tests!(
    batch_norm_act_matches_f64,
    super::fused_matches_f64_composition
);

/// In F32 the fused op computes what the three ops compute, in the same order.
#[test]
fn fused_is_bit_identical_to_composition_in_f32() {
    let mut rng = Generator::new(22);
    for shape in SHAPES {
        for (training, residual, relu) in cases() {
            let n: usize = shape.iter().product();
            let c = shape[1];
            let xv = rand_values(n, -1.0, 1.0, DType::F32, &mut rng);
            let rv = rand_values(n, -1.0, 1.0, DType::F32, &mut rng);
            let wv = rand_values(c, 0.5, 1.5, DType::F32, &mut rng);
            let bv = rand_values(c, -0.5, 0.5, DType::F32, &mut rng);
            let gv = rand_values(n, -1.0, 1.0, DType::F32, &mut rng);
            let data = (
                &xv[..],
                residual.then_some(&rv[..]),
                &wv[..],
                &bv[..],
                &gv[..],
            );
            let fused = run(true, DType::F32, data, shape, true, training, relu);
            let plain = run(false, DType::F32, data, shape, false, training, relu);
            assert_eq!(fused, plain, "{shape:?} {training} {residual} {relu}");
        }
    }
}

/// The composition `batch_norm_act` falls back to (F64) against finite differences.
#[test]
fn batch_norm_act_gradients() {
    let mut rng = Generator::new(23);
    let shape = [3usize, 2, 3, 2];
    // Values away from the ReLU's kink: shift the residual so few outputs sit near 0.
    let x = grad_input(&shape, &mut rng);
    let r = grad_input(&shape, &mut rng);
    let w = grad_input(&[2], &mut rng);
    let b = grad_input(&[2], &mut rng);
    gradcheck("batch_norm_act train", &[x, w, b, r], |t| {
        t[0].batch_norm_act(
            None,
            None,
            Some(&t[1]),
            Some(&t[2]),
            true,
            0.1,
            1e-5,
            Some(&t[3]),
            true,
        )
    });
}

/// A half residual with an F32 input (or any mix) runs the composition.
#[test]
fn mixed_dtypes_fall_back_to_composition() {
    let mut rng = Generator::new(24);
    let shape = [2usize, 3, 2, 2];
    let (x, _) = rand_tensor(&shape, DType::F32, false, &mut rng);
    let (r, _) = rand_tensor(&shape, DType::BF16, false, &mut rng);
    let fused = x
        .batch_norm_act(None, None, None, None, true, 0.1, 1e-5, Some(&r), true)
        .unwrap();
    let plain = x
        .batch_norm(None, None, None, None, true, 0.1, 1e-5)
        .unwrap()
        .add(&r)
        .unwrap()
        .relu()
        .unwrap();
    assert_eq!(fused.dtype(), DType::F32);
    assert_eq!(fused.to_vec_f64(), plain.to_vec_f64());
}

/// Same bits on 1, 2 and 3 threads (per-channel sums run in image order on one thread).
#[test]
fn batch_norm_act_is_thread_count_independent() {
    let shape = [33usize, 17, 9, 11];
    let mut results = Vec::new();
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let r = pool.install(|| {
            let mut rng = Generator::new(25);
            let mut v = Vec::new();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let (x, _) = rand_tensor(&shape, dtype, false, &mut rng);
                let (res, _) = rand_tensor(&shape, dtype, false, &mut rng);
                let (g, _) = rand_tensor(&shape, dtype, false, &mut rng);
                let x = x.requires_grad_();
                let res = res.requires_grad_();
                let w = Tensor::ones(&[17], DType::F32).unwrap().requires_grad_();
                let out = x
                    .batch_norm_act(
                        None,
                        None,
                        Some(&w),
                        None,
                        true,
                        0.1,
                        1e-5,
                        Some(&res),
                        true,
                    )
                    .unwrap();
                out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
                for t in [
                    out,
                    x.grad().unwrap(),
                    w.grad().unwrap(),
                    res.grad().unwrap(),
                ] {
                    v.push(
                        t.to_vec_f32()
                            .iter()
                            .map(|x| x.to_bits())
                            .collect::<Vec<_>>(),
                    );
                }
            }
            v
        });
        results.push(r);
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}
