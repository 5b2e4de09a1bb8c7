//! max/min (over dims and along one dim with indices), argmax/argmin and var against f64
//! references, per dtype, and their gradients by finite differences.

use crate::common;
use common::*;
use hemi::{DType, Error, Generator, Tensor};

/// Row-major multi-index of `flat` in `shape`.
fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

/// The values of `v` (row-major, `shape`) grouped by output position of a reduction over
/// `dims` (all when empty): one group per output element, in output order.
fn groups(v: &[f64], shape: &[usize], dims: &[usize]) -> Vec<Vec<f64>> {
    let dims: Vec<usize> = if dims.is_empty() {
        (0..shape.len()).collect()
    } else {
        dims.to_vec()
    };
    let out_shape: Vec<usize> = (0..shape.len())
        .map(|d| if dims.contains(&d) { 1 } else { shape[d] })
        .collect();
    let mut out = vec![Vec::new(); out_shape.iter().product()];
    for (i, &x) in v.iter().enumerate() {
        let idx = unravel(shape, i);
        let o = idx.iter().enumerate().fold(0, |acc, (d, &k)| {
            acc * out_shape[d] + if dims.contains(&d) { 0 } else { k }
        });
        out[o].push(x);
    }
    out
}

fn reduced(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    (0..shape.len())
        .filter_map(|d| {
            if dims.is_empty() || dims.contains(&d) {
                keepdim.then_some(1)
            } else {
                Some(shape[d])
            }
        })
        .collect()
}

/// Shapes, dims and whether the input is a non-contiguous view.
const CASES: [(&[usize], &[usize], bool); 7] = [
    (&[7, 13], &[1], true),
    (&[7, 13], &[0], true),
    (&[7, 13], &[], false),
    (&[3, 1, 5], &[0, 2], true),
    (&[3, 1, 5], &[1], false),
    (&[17], &[0], true),
    (&[2, 3, 4], &[2, 0], false),
];

fn max_min_forward(dtype: DType) {
    let mut rng = Generator::new(11);
    for (shape, dims, strided) in CASES {
        let (t, v) = rand_tensor(shape, dtype, strided, &mut rng);
        let idims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
        for keepdim in [false, true] {
            let g = groups(&v, shape, dims);
            let max = t.max(&idims, keepdim).unwrap();
            let min = t.min(&idims, keepdim).unwrap();
            for (name, out) in [("max", &max), ("min", &min)] {
                assert_eq!(out.dtype(), dtype, "{name}");
                assert_eq!(
                    out.shape(),
                    reduced(shape, dims, keepdim),
                    "{name} {shape:?}"
                );
            }
            // The max is one of the inputs: exact.
            let want_max: Vec<f64> = g
                .iter()
                .map(|g| g.iter().copied().fold(f64::MIN, f64::max))
                .collect();
            let want_min: Vec<f64> = g
                .iter()
                .map(|g| g.iter().copied().fold(f64::MAX, f64::min))
                .collect();
            assert_eq!(max.to_vec_f64(), want_max, "max {shape:?} {dims:?}");
            assert_eq!(min.to_vec_f64(), want_min, "min {shape:?} {dims:?}");
        }
    }
}
dtype_tests!(max_min_match_f64, super::max_min_forward);

fn max_dim_forward(dtype: DType) {
    let mut rng = Generator::new(12);
    for (shape, dim, strided) in [
        (&[7usize, 13][..], 1isize, true),
        (&[7, 13], 0, true),
        (&[3, 5, 4], 1, true),
        (&[3, 5, 4], -3, false),
        (&[1, 6, 1], 1, false),
        (&[17], -1, true),
    ] {
        let (t, v) = rand_tensor(shape, dtype, strided, &mut rng);
        let d = if dim < 0 {
            dim + shape.len() as isize
        } else {
            dim
        } as usize;
        let g = groups(&v, shape, &[d]);
        // Reference: first index of the largest (smallest) value.
        let first = |g: &Vec<f64>, better: fn(f64, f64) -> bool| {
            let mut at = 0;
            for (k, &x) in g.iter().enumerate() {
                if better(x, g[at]) {
                    at = k;
                }
            }
            at
        };
        for keepdim in [false, true] {
            let (mv, mi) = t.max_dim(dim, keepdim).unwrap();
            let (nv, ni) = t.min_dim(dim, keepdim).unwrap();
            let shape_out = reduced(shape, &[d], keepdim);
            for out in [&mv, &mi, &nv, &ni] {
                assert_eq!(out.shape(), shape_out);
            }
            assert_eq!(mv.dtype(), dtype);
            assert_eq!(mi.dtype(), DType::I64);
            let want_i: Vec<i64> = g.iter().map(|g| first(g, |a, b| a > b) as i64).collect();
            let want_j: Vec<i64> = g.iter().map(|g| first(g, |a, b| a < b) as i64).collect();
            assert_eq!(mi.to_vec::<i64>().unwrap(), want_i, "{shape:?} dim {dim}");
            assert_eq!(ni.to_vec::<i64>().unwrap(), want_j, "{shape:?} dim {dim}");
            let want_v: Vec<f64> = g.iter().zip(&want_i).map(|(g, &i)| g[i as usize]).collect();
            assert_eq!(mv.to_vec_f64(), want_v);
            let want_v: Vec<f64> = g.iter().zip(&want_j).map(|(g, &i)| g[i as usize]).collect();
            assert_eq!(nv.to_vec_f64(), want_v);
            assert_eq!(
                t.argmax(dim, keepdim).unwrap().to_vec::<i64>().unwrap(),
                want_i
            );
            assert_eq!(
                t.argmin(dim, keepdim).unwrap().to_vec::<i64>().unwrap(),
                want_j
            );
        }
    }
}
dtype_tests!(max_dim_and_argmax_match_f64, super::max_dim_forward);

#[test]
fn ties_take_the_first_index_and_split_the_amax_gradient() {
    let x = Tensor::from_f64_vec(
        vec![1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, -1.0],
        &[2, 4],
        DType::F32,
    )
    .unwrap()
    .requires_grad_();
    let (v, i) = x.max_dim(1, false).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 0]);
    assert_eq!(v.to_vec_f64(), vec![3.0, 2.0]);
    v.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec_f64(),
        vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        "max_dim: the whole gradient to the first index"
    );
    x.zero_grad();
    x.max(&[1], false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec_f64(),
        [0.0, 0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]
            .iter()
            .map(|&g| g as f32 as f64)
            .collect::<Vec<_>>(),
        "max: the gradient split evenly among ties, as amax"
    );
    x.zero_grad();
    x.min(&[], false).unwrap().backward().unwrap();
    let mut want = vec![0.0; 8];
    want[7] = 1.0;
    assert_eq!(x.grad().unwrap().to_vec_f64(), want);
    assert_eq!(
        x.argmin(0, true).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 1, 1, 1]
    );
}

#[test]
fn nan_propagates_through_max_and_min() {
    let nan = f64::NAN;
    let x = Tensor::from_f64_vec(
        vec![1.0, nan, 5.0, nan, 2.0, 3.0, -1.0, 0.0],
        &[2, 4],
        DType::F16,
    )
    .unwrap();
    let m = x.max(&[1], false).unwrap().to_vec_f64();
    assert!(m[0].is_nan() && m[1] == 3.0, "{m:?}");
    let m = x.min(&[1], false).unwrap().to_vec_f64();
    assert!(m[0].is_nan() && m[1] == -1.0, "{m:?}");
    assert!(x.max(&[], false).unwrap().to_scalar().unwrap().is_nan());
    let (v, i) = x.max_dim(1, false).unwrap();
    assert!(v.to_vec_f64()[0].is_nan());
    assert_eq!(
        i.to_vec::<i64>().unwrap(),
        vec![1, 1],
        "first NaN, as torch.max"
    );
    assert_eq!(
        x.argmin(1, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 2]
    );
    // Down dim 0: columns (1, 2), (NaN, 3), (5, -1), (NaN, 0).
    assert_eq!(
        x.argmax(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 0, 0, 0]
    );
}

#[test]
fn max_and_var_gradients() {
    let mut rng = Generator::new(13);
    // Distinct values (no ties): a random draw in f64 has none.
    let x = grad_input(&[3, 4, 5], &mut rng);
    gradcheck("max dim 1", std::slice::from_ref(&x), |t| {
        t[0].max(&[1], false)
    });
    gradcheck("max dims 0,2 keepdim", std::slice::from_ref(&x), |t| {
        t[0].max(&[0, 2], true)
    });
    gradcheck("max all", std::slice::from_ref(&x), |t| {
        t[0].max(&[], false)
    });
    gradcheck("min dim -1", std::slice::from_ref(&x), |t| {
        t[0].min(&[-1], false)
    });
    gradcheck("max_dim 0", std::slice::from_ref(&x), |t| {
        Ok(t[0].max_dim(0, false)?.0)
    });
    gradcheck("min_dim 2 keepdim", std::slice::from_ref(&x), |t| {
        Ok(t[0].min_dim(2, true)?.0)
    });
    gradcheck("max_dim of a view", std::slice::from_ref(&x), |t| {
        Ok(t[0].transpose(0, 2)?.max_dim(1, false)?.0)
    });
    gradcheck("var dim 1", std::slice::from_ref(&x), |t| {
        t[0].var(&[1], 1, false)
    });
    gradcheck("var dims 0,2 c0 keepdim", std::slice::from_ref(&x), |t| {
        t[0].var(&[0, 2], 0, true)
    });
    gradcheck("var all c2", std::slice::from_ref(&x), |t| {
        t[0].var(&[], 2, false)
    });
    gradcheck("var of a view", &[x], |t| {
        t[0].permute(&[2, 0, 1])?.var(&[-1], 1, false)
    });
}

/// f64 reference variance (two-pass in f64 on the exact stored values).
fn var_ref(g: &[f64], correction: usize) -> f64 {
    let n = g.len() as f64;
    let mean = g.iter().sum::<f64>() / n;
    g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - correction as f64).max(0.0)
}

fn var_forward(dtype: DType) {
    let mut rng = Generator::new(14);
    for (shape, dims, strided) in CASES {
        let (t, v) = rand_tensor(shape, dtype, strided, &mut rng);
        let idims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
        let g = groups(&v, shape, dims);
        for correction in [0usize, 1, 2] {
            if g[0].len() <= correction {
                continue;
            }
            let out = t.var(&idims, correction, false).unwrap();
            assert_eq!(out.dtype(), dtype);
            assert_eq!(out.shape(), reduced(shape, dims, false));
            let want: Vec<f64> = g.iter().map(|g| var_ref(g, correction)).collect();
            assert_close(
                &format!("var {shape:?} {dims:?} c{correction}"),
                &out.to_vec_f64(),
                &want,
                balanced(dtype),
            );
            assert_eq!(
                t.var(&idims, correction, true).unwrap().shape(),
                reduced(shape, dims, true)
            );
        }
    }
}
dtype_tests!(var_matches_f64, super::var_forward);

/// 1000 + noise a few ulps of 1000 wide: a one-pass E[x²] - E[x]² in F32 loses every digit
/// (1000² · 2^-24 ≈ 0.06, far above the variance); the shifted two-pass algorithm keeps the
/// result to a few ulps of the compute type.
fn var_large_mean(dtype: DType) {
    let mut rng = Generator::new(15);
    let n = 4099;
    let ulp_1000 = 1000.0 * dtype.finfo().unwrap().epsilon / 2.0;
    let v = round_to(
        &(0..n)
            .map(|_| 1000.0 + rng.uniform(-32.0, 32.0) * ulp_1000)
            .collect::<Vec<_>>(),
        dtype,
    );
    let want = var_ref(&v, 1);
    let t = tensor(&v, &[n], dtype, true);
    let got = t.var(&[0], 1, false).unwrap().to_vec_f64();
    // The deviations from the computed mean are exact (Sterbenz); what remains is the
    // rounding of n squares and their 8-lane sum in F32, about (n/8)·u32 at worst, and the
    // final rounding into `dtype`.
    let tol = Tol {
        rtol: 2.0 * u(dtype) + (n as f64 / 8.0) * u(DType::F32),
        atol: 0.0,
    };
    assert_close(
        &format!("var of 1000 + noise in {dtype}"),
        &got,
        &[want],
        tol,
    );
    // The same through a reduction over two dims of a view.
    let t2 = tensor(&v[..4096], &[64, 64], dtype, true);
    let got = t2.var(&[0, 1], 1, false).unwrap().to_vec_f64();
    assert_close("var [64, 64]", &got, &[var_ref(&v[..4096], 1)], tol);
}
dtype_tests!(var_is_stable_for_a_large_mean, super::var_large_mean);

#[test]
fn var_with_too_few_elements_is_inf_or_nan_as_pytorch() {
    let x = Tensor::from_f64_vec(vec![1.0, 2.0], &[2], DType::F32).unwrap();
    assert_eq!(
        x.var(&[0], 2, false).unwrap().to_scalar().unwrap(),
        f64::INFINITY
    );
    let one = Tensor::from_f64_vec(vec![4.0], &[1], DType::F32).unwrap();
    assert!(one
        .var(&[0], 1, false)
        .unwrap()
        .to_scalar()
        .unwrap()
        .is_nan());
    assert_eq!(one.var(&[0], 0, false).unwrap().to_scalar().unwrap(), 0.0);
    // Known value: var of 1..=5 with correction 1 is 2.5.
    let x = Tensor::arange(1.0, 6.0, 1.0, DType::BF16).unwrap();
    assert_eq!(x.var(&[], 1, false).unwrap().to_scalar().unwrap(), 2.5);
}

#[test]
fn errors_name_the_op() {
    let x = Tensor::zeros(&[2, 3], DType::F32).unwrap();
    let i = Tensor::zeros(&[2, 3], DType::I64).unwrap();
    for (what, e) in [
        ("max dim", x.max(&[2], false).unwrap_err()),
        ("max dup", x.max(&[1, -1], false).unwrap_err()),
        ("max_dim", x.max_dim(-3, false).unwrap_err()),
        ("argmax", x.argmax(5, false).unwrap_err()),
        ("var", x.var(&[3], 1, false).unwrap_err()),
        ("max int", i.max(&[], false).unwrap_err()),
        ("var int", i.var(&[], 1, false).unwrap_err()),
        ("argmax int", i.argmax(0, false).unwrap_err()),
    ] {
        let op = what.split(' ').next().unwrap();
        assert!(e.to_string().contains(op), "{what}: {e}");
    }
    assert!(matches!(
        i.var(&[], 1, false),
        Err(Error::DType { op: "var", .. })
    ));
    assert!(matches!(
        x.max_dim(2, false),
        Err(Error::Dim {
            op: "max_dim",
            dim: 2,
            rank: 2
        })
    ));
    let empty = Tensor::zeros(&[3, 0], DType::F32).unwrap();
    let e = empty.max(&[1], false).unwrap_err().to_string();
    assert!(e.contains("max") && e.contains("[3, 0]"), "{e}");
    assert!(empty.argmax(1, false).is_err());
    // Reducing the non-empty dim of an empty tensor is fine (an empty result).
    assert_eq!(empty.max(&[0], false).unwrap().shape(), &[0]);
}

#[test]
fn scalar_tensors_reduce_to_themselves() {
    let s = Tensor::scalar(2.5, DType::F16);
    assert_eq!(s.max(&[], false).unwrap().to_scalar().unwrap(), 2.5);
    let (v, i) = s.max_dim(0, false).unwrap();
    assert_eq!(v.shape(), &[] as &[usize]);
    assert_eq!(v.to_scalar().unwrap(), 2.5);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0]);
    assert_eq!(s.argmax(-1, true).unwrap().shape(), &[] as &[usize]);
}
