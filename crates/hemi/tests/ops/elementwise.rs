//! Elementwise ops, views and sum/mean against f64 references, per dtype, and their
//! gradients by finite differences.

use crate::common;
use common::*;
use hemi::{DType, Generator, Tensor};

fn erf(x: f64) -> f64 {
    libm::erf(x)
}

type UnaryCase = (
    &'static str,
    fn(&Tensor) -> hemi::Result<Tensor>,
    fn(f64) -> f64,
    f64,
    f64,
);

fn unary_cases() -> Vec<UnaryCase> {
    vec![
        ("neg", |t| t.neg(), |x| -x, -3.0, 3.0),
        ("exp", |t| t.exp(), f64::exp, -3.0, 3.0),
        ("log", |t| t.log(), f64::ln, 0.05, 4.0),
        ("sqrt", |t| t.sqrt(), f64::sqrt, 0.05, 4.0),
        ("abs", |t| t.abs(), f64::abs, -3.0, 3.0),
        ("relu", |t| t.relu(), |x| x.max(0.0), -3.0, 3.0),
        (
            "gelu",
            |t| t.gelu(),
            |x| 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
            -4.0,
            4.0,
        ),
        (
            "gelu_tanh",
            |t| t.gelu_tanh(),
            |x| {
                0.5 * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
            },
            -4.0,
            4.0,
        ),
        (
            "sigmoid",
            |t| t.sigmoid(),
            |x| 1.0 / (1.0 + (-x).exp()),
            -8.0,
            8.0,
        ),
        ("tanh", |t| t.tanh(), f64::tanh, -3.0, 3.0),
        ("add_scalar", |t| t.add_scalar(1.5), |x| x + 1.5, -3.0, 3.0),
        (
            "mul_scalar",
            |t| t.mul_scalar(-2.5),
            |x| x * -2.5,
            -3.0,
            3.0,
        ),
        (
            "pow_scalar",
            |t| t.pow_scalar(3.0),
            |x| x.powi(3),
            -2.0,
            2.0,
        ),
        (
            "pow_frac",
            |t| t.pow_scalar(1.5),
            |x| x.powf(1.5),
            0.05,
            3.0,
        ),
        ("square", |t| t.square(), |x| x * x, -3.0, 3.0),
        (
            "clamp",
            |t| t.clamp(-0.75, 1.25),
            |x| x.clamp(-0.75, 1.25),
            -3.0,
            3.0,
        ),
    ]
}

fn unary_forward(dtype: DType) {
    let mut rng = Generator::new(1);
    for (name, op, reference, lo, hi) in unary_cases() {
        for (shape, strided) in [
            (vec![7usize, 13], true),
            (vec![1, 5, 1], false),
            (vec![17], true),
            (vec![], false),
        ] {
            let n = shape.iter().product();
            let v = rand_values(n, lo, hi, dtype, &mut rng);
            let t = tensor(&v, &shape, dtype, strided);
            let out = op(&t).unwrap();
            assert_eq!(out.dtype(), dtype, "{name}");
            assert_eq!(out.shape(), &shape[..], "{name}");
            let want: Vec<f64> = v.iter().map(|&x| reference(x)).collect();
            assert_close(
                &format!("{name} {dtype} {shape:?}"),
                &out.to_vec_f64(),
                &want,
                strict(dtype),
            );
        }
    }
}
dtype_tests!(unary_forward_matches_f64, super::unary_forward);

#[test]
fn unary_gradients() {
    let mut rng = Generator::new(2);
    for (name, op, _, lo, hi) in unary_cases() {
        if name == "relu" || name == "abs" || name == "clamp" {
            continue; // kinks: checked below away from them
        }
        let n = 11;
        let v: Vec<f64> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
        gradcheck(name, &[(v, vec![n])], |x| op(&x[0]));
    }
    // relu and abs away from their kink.
    let v: Vec<f64> = (0..12)
        .map(|i| {
            if i % 2 == 0 {
                0.3 + i as f64 * 0.1
            } else {
                -0.2 - i as f64 * 0.1
            }
        })
        .collect();
    gradcheck("relu", &[(v.clone(), vec![3, 4])], |x| x[0].relu());
    gradcheck("abs", &[(v.clone(), vec![3, 4])], |x| x[0].abs());
    // clamp: inside, below and above the bounds (0.3..1.4 and -0.3..-1.4 straddle them).
    gradcheck("clamp", &[(v, vec![3, 4])], |x| x[0].clamp(-0.75, 1.25));
}

#[test]
fn clamp_keeps_nan_passes_bounds_and_checks_its_arguments() {
    let x = Tensor::from_vec(vec![f32::NAN, -2.0, -1.0, 0.5, 1.0, 3.0], &[6]).unwrap();
    let y = x.clamp(-1.0, 1.0).unwrap().to_vec_f32();
    assert!(y[0].is_nan());
    assert_eq!(&y[1..], &[-1.0, -1.0, 0.5, 1.0, 1.0]);
    // The gradient passes where lo <= x <= hi, bounds included (as torch.clamp).
    let p = Tensor::from_vec(vec![-2.0f32, -1.0, 0.5, 1.0, 3.0], &[5])
        .unwrap()
        .requires_grad_();
    p.clamp(-1.0, 1.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        p.grad().unwrap().to_vec_f32(),
        vec![0.0, 1.0, 1.0, 1.0, 0.0]
    );
    for (lo, hi) in [(1.0, -1.0), (f64::NAN, 1.0), (0.0, f64::NAN)] {
        let e = x.clamp(lo, hi).unwrap_err().to_string();
        assert!(e.contains("clamp"), "{e}");
    }
}

type BinaryCase = (
    &'static str,
    fn(&Tensor, &Tensor) -> hemi::Result<Tensor>,
    fn(f64, f64) -> f64,
);

fn binary_cases() -> Vec<BinaryCase> {
    vec![
        ("add", |a, b| a.add(b), |x, y| x + y),
        ("sub", |a, b| a.sub(b), |x, y| x - y),
        ("mul", |a, b| a.mul(b), |x, y| x * y),
        ("div", |a, b| a.div(b), |x, y| x / y),
        ("maximum", |a, b| a.maximum(b), f64::max),
        ("minimum", |a, b| a.minimum(b), f64::min),
    ]
}

/// Index into a broadcast operand from an output multi-index.
fn bcast_index(out_shape: &[usize], in_shape: &[usize], flat: usize) -> usize {
    let mut rem = flat;
    let mut idx = vec![0; out_shape.len()];
    for d in (0..out_shape.len()).rev() {
        idx[d] = rem % out_shape[d];
        rem /= out_shape[d];
    }
    let lead = out_shape.len() - in_shape.len();
    let mut off = 0;
    for d in 0..in_shape.len() {
        let i = if in_shape[d] == 1 { 0 } else { idx[lead + d] };
        off = off * in_shape[d] + i;
    }
    off
}

const BCAST_SHAPES: [(&[usize], &[usize], &[usize]); 5] = [
    (&[5, 7], &[5, 7], &[5, 7]),
    (&[3, 1, 6], &[4, 1], &[3, 4, 6]),
    (&[9], &[2, 9], &[2, 9]),
    (&[], &[3, 2], &[3, 2]),
    (&[1, 1], &[1], &[1, 1]),
];

fn binary_forward(dtype: DType) {
    let mut rng = Generator::new(3);
    for (name, op, reference) in binary_cases() {
        for (sa, sb, so) in BCAST_SHAPES {
            for strided in [false, true] {
                let va = rand_values(sa.iter().product(), -2.0, 2.0, dtype, &mut rng);
                let mut vb = rand_values(sb.iter().product(), -2.0, 2.0, dtype, &mut rng);
                if name == "div" {
                    vb.iter_mut()
                        .for_each(|x| *x = if x.abs() < 0.25 { 0.5 } else { *x });
                }
                let a = tensor(&va, sa, dtype, strided);
                let b = tensor(&vb, sb, dtype, strided);
                let out = op(&a, &b).unwrap();
                assert_eq!(out.shape(), so, "{name}");
                assert_eq!(out.dtype(), dtype);
                let n: usize = so.iter().product();
                let want: Vec<f64> = (0..n)
                    .map(|i| reference(va[bcast_index(so, sa, i)], vb[bcast_index(so, sb, i)]))
                    .collect();
                assert_close(
                    &format!("{name} {sa:?} {sb:?}"),
                    &out.to_vec_f64(),
                    &want,
                    strict(dtype),
                );
            }
        }
    }
}
dtype_tests!(binary_forward_matches_f64, super::binary_forward);

#[test]
fn binary_gradients_with_broadcasting() {
    let mut rng = Generator::new(4);
    for (name, op, _) in binary_cases() {
        for (sa, sb, _) in BCAST_SHAPES {
            let a = grad_input(sa, &mut rng);
            let mut b = grad_input(sb, &mut rng);
            if name == "div" {
                b.0.iter_mut()
                    .for_each(|x| *x = x.signum() * (x.abs() + 0.5));
            }
            gradcheck(&format!("{name} {sa:?} {sb:?}"), &[a, b], |x| {
                op(&x[0], &x[1])
            });
        }
    }
}

#[test]
fn mixed_dtypes_promote_to_the_wider() {
    let a = Tensor::ones(&[2], DType::F16).unwrap();
    let b = Tensor::ones(&[2], DType::F32).unwrap();
    let c = Tensor::ones(&[2], DType::BF16).unwrap();
    assert_eq!(a.add(&b).unwrap().dtype(), DType::F32);
    assert_eq!(a.mul(&c).unwrap().dtype(), DType::F32);
    assert_eq!(c.mul(&c).unwrap().dtype(), DType::BF16);
    // Gradients come back in each input's own dtype.
    let p16 = Tensor::ones(&[2], DType::F16).unwrap().requires_grad_();
    let p32 = Tensor::ones(&[2], DType::F32).unwrap().requires_grad_();
    p16.mul(&p32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(p16.grad().unwrap().dtype(), DType::F16);
    assert_eq!(p32.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn shape_errors_name_the_op_and_shapes() {
    let a = Tensor::zeros(&[2, 3], DType::F32).unwrap();
    let b = Tensor::zeros(&[4], DType::F32).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4]"),
        "{e}"
    );
    assert!(a.reshape(&[4]).unwrap_err().to_string().contains("reshape"));
    assert!(a.narrow(1, 2, 2).is_err());
    assert!(a.permute(&[0, 0]).is_err());
    assert!(a.sum(&[5], false).is_err());
    let i = Tensor::zeros(&[2], DType::I64).unwrap();
    assert!(i.exp().is_err());
}

fn where_and_masked_fill(dtype: DType) {
    let mut rng = Generator::new(5);
    let (a, va) = rand_tensor(&[4, 5], dtype, true, &mut rng);
    let (b, vb) = rand_tensor(&[5], dtype, false, &mut rng);
    let cond_v: Vec<f64> = (0..20).map(|i| ((i * 7) % 3 == 0) as i32 as f64).collect();
    let cond = Tensor::from_f64_vec(cond_v.clone(), &[4, 5], DType::I64).unwrap();
    let out = Tensor::where_cond(&cond, &a, &b).unwrap();
    let want: Vec<f64> = (0..20)
        .map(|i| if cond_v[i] != 0.0 { va[i] } else { vb[i % 5] })
        .collect();
    assert_close("where", &out.to_vec_f64(), &want, strict(dtype));
    let filled = a.masked_fill(&cond, -9.0).unwrap();
    let want: Vec<f64> = (0..20)
        .map(|i| if cond_v[i] != 0.0 { -9.0 } else { va[i] })
        .collect();
    assert_close("masked_fill", &filled.to_vec_f64(), &want, strict(dtype));
}
dtype_tests!(where_selects, super::where_and_masked_fill);

#[test]
fn where_gradient() {
    let mut rng = Generator::new(6);
    let cond = Tensor::from_f64_vec(
        (0..12).map(|i| (i % 3 == 0) as i32 as f64).collect(),
        &[3, 4],
        DType::F64,
    )
    .unwrap();
    gradcheck(
        "where",
        &[grad_input(&[3, 4], &mut rng), grad_input(&[4], &mut rng)],
        |x| Tensor::where_cond(&cond, &x[0], &x[1]),
    );
}

fn sum_mean_forward(dtype: DType) {
    let mut rng = Generator::new(7);
    let shape = [3usize, 5, 7];
    let (t, v) = rand_tensor(&shape, dtype, true, &mut rng);
    let idx = |i: usize, j: usize, k: usize| v[(i * 5 + j) * 7 + k];
    // sum over dim 1, keepdim
    let s = t.sum(&[1], true).unwrap();
    assert_eq!(s.shape(), &[3, 1, 7]);
    let want: Vec<f64> = (0..3)
        .flat_map(|i| (0..7).map(move |k| (i, k)))
        .map(|(i, k)| (0..5).map(|j| idx(i, j, k)).sum())
        .collect();
    assert_close("sum dim1", &s.to_vec_f64(), &want, balanced(dtype));
    // mean over dims (0, 2)
    let m = t.mean(&[0, -1], false).unwrap();
    assert_eq!(m.shape(), &[5]);
    let want: Vec<f64> = (0..5)
        .map(|j| {
            (0..3)
                .flat_map(|i| (0..7).map(move |k| (i, k)))
                .map(|(i, k)| idx(i, j, k))
                .sum::<f64>()
                / 21.0
        })
        .collect();
    assert_close("mean dims 0,2", &m.to_vec_f64(), &want, balanced(dtype));
    // all
    let a = t.sum_all().unwrap();
    assert_eq!(a.shape(), &[] as &[usize]);
    assert_close(
        "sum all",
        &a.to_vec_f64(),
        &[v.iter().sum()],
        balanced(dtype),
    );
}
dtype_tests!(sum_mean_match_f64, super::sum_mean_forward);

/// Sums over leading dims (a bias gradient, the backward of a broadcast) read the input in
/// place, column blocks of rows, instead of gathering its transpose: checked against F64
/// with the F32 summation bound on odd sizes past the column block (256) and the row block
/// (64), on the thread pool's path (≥ 2^15 elements), with a size-1 dim among the reduced
/// ones, on a view whose kept dim is strided (not this path), and for mean.
fn leading_dim_sums(dtype: DType) {
    let mut rng = Generator::new(17);
    for (shape, dims, strided) in [
        (vec![131usize, 300], vec![0isize], false),
        (vec![3, 1, 45, 261], vec![0, 1, 2], false),
        (vec![7, 1030, 5], vec![0], false),
        (vec![129, 77], vec![0], true),
    ] {
        let (t, v) = rand_tensor(&shape, dtype, strided, &mut rng);
        let dims_u: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        let outer: usize = shape[dims.len()..].iter().product();
        let inner = v.len() / outer;
        let (mut want, mut abs) = (vec![0.0; outer], vec![0.0; outer]);
        for (i, x) in v.iter().enumerate() {
            want[i % outer] += x;
            abs[i % outer] += x.abs();
        }
        assert!(dims_u.iter().enumerate().all(|(i, &d)| i == d));
        let s = t.sum(&dims, false).unwrap();
        assert_eq!(s.shape(), &shape[dims.len()..]);
        assert_sums_close("sum leading", &s.to_vec_f64(), &want, &abs, inner, dtype);
        let m = t.mean(&dims, false).unwrap();
        let mean: Vec<f64> = want.iter().map(|w| w / inner as f64).collect();
        let mean_abs: Vec<f64> = abs.iter().map(|a| a / inner as f64).collect();
        assert_sums_close(
            "mean leading",
            &m.to_vec_f64(),
            &mean,
            &mean_abs,
            inner + 1,
            dtype,
        );
    }
}
dtype_tests!(leading_dim_sums_match_f64, super::leading_dim_sums);

#[test]
fn long_f16_sum_accumulates_in_f32() {
    // 4096 copies of 1.0 + 2^-11: an F16 accumulator would stall at 2048.
    let t = Tensor::full(&[4096], 1.0, DType::F16).unwrap();
    assert_eq!(t.sum_all().unwrap().to_scalar().unwrap(), 4096.0);
}

#[test]
fn reduction_and_view_gradients() {
    let mut rng = Generator::new(8);
    let x = grad_input(&[3, 4, 5], &mut rng);
    gradcheck("sum dim", std::slice::from_ref(&x), |t| {
        t[0].sum(&[1], false)
    });
    gradcheck("mean keepdim", std::slice::from_ref(&x), |t| {
        t[0].mean(&[0, 2], true)
    });
    gradcheck("sum all", std::slice::from_ref(&x), |t| t[0].sum_all());
    gradcheck("permute", std::slice::from_ref(&x), |t| {
        t[0].permute(&[2, 0, 1])
    });
    gradcheck("transpose+reshape", std::slice::from_ref(&x), |t| {
        t[0].transpose(0, 2)?.reshape(&[20, 3])
    });
    gradcheck("narrow", std::slice::from_ref(&x), |t| t[0].narrow(2, 1, 3));
    gradcheck("broadcast", &[grad_input(&[3, 1], &mut rng)], |t| {
        t[0].broadcast_to(&[2, 3, 4])
    });
    gradcheck("squeeze/unsqueeze", &[grad_input(&[3, 1], &mut rng)], |t| {
        t[0].squeeze(1)?.unsqueeze(0)
    });
    gradcheck("flatten", &[x], |t| t[0].flatten(1, 2));
}

#[test]
fn views_share_storage_and_read_right() {
    let t = Tensor::arange(0.0, 24.0, 1.0, DType::F32)
        .unwrap()
        .reshape(&[2, 3, 4])
        .unwrap();
    let p = t.permute(&[2, 0, 1]).unwrap();
    assert!(p.same_storage(&t));
    assert!(!p.is_contiguous());
    assert_eq!(p.shape(), &[4, 2, 3]);
    // p[i, j, k] = t[j, k, i]
    let pv = p.to_vec_f64();
    assert_eq!(pv[0..6], [0.0, 4.0, 8.0, 12.0, 16.0, 20.0]);
    let n = t.narrow(2, 1, 2).unwrap();
    assert_eq!(
        n.to_vec_f64(),
        vec![1., 2., 5., 6., 9., 10., 13., 14., 17., 18., 21., 22.]
    );
    let c = p.contiguous().unwrap();
    assert!(c.is_contiguous());
    assert_eq!(c.to_vec_f64(), pv);
    let b = Tensor::arange(0.0, 3.0, 1.0, DType::BF16)
        .unwrap()
        .unsqueeze(1)
        .unwrap()
        .broadcast_to(&[3, 2])
        .unwrap();
    assert_eq!(b.to_vec_f64(), vec![0., 0., 1., 1., 2., 2.]);
}

/// `binary_assign` (the backward's in-place sum of gradients) writes the bits `binary`
/// returns, for every float dtype, lengths across the chunk size, and a strided right-hand
/// side (which takes the fallback).
#[test]
fn binary_assign_writes_the_bits_binary_returns() {
    use hemi::backend::map::BinaryOp;
    let mut rng = Generator::new(7);
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for n in [1, 37, 8191, 8192 * 2 + 5] {
            let a = Tensor::randn(&[n], 0.0, 3.0, dtype, &mut rng).unwrap();
            let b = Tensor::randn(&[n], 0.0, 3.0, dtype, &mut rng).unwrap();
            for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub] {
                let want = a
                    .storage()
                    .binary(a.layout(), &b.storage(), b.layout(), op, dtype)
                    .unwrap();
                let mut got = (*a.storage()).clone();
                got.binary_assign(a.layout(), &b.storage(), b.layout(), op)
                    .unwrap();
                let (w, g) = (
                    Tensor::from_storage(want.into(), a.layout().clone()),
                    Tensor::from_storage(got.into(), a.layout().clone()),
                );
                assert_eq!(g.dtype(), dtype);
                let bits = |t: &Tensor| {
                    t.to_vec_f64()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&g), bits(&w), "{dtype} n={n} {op:?}");
            }
        }
        // A transposed right-hand side.
        let a = Tensor::randn(&[13, 29], 0.0, 1.0, dtype, &mut rng).unwrap();
        let b = Tensor::randn(&[29, 13], 0.0, 1.0, dtype, &mut rng)
            .unwrap()
            .t()
            .unwrap();
        let want = a.add(&b).unwrap();
        let mut got = (*a.storage()).clone();
        got.binary_assign(a.layout(), &b.storage(), b.layout(), BinaryOp::Add)
            .unwrap();
        let got = Tensor::from_storage(got.into(), a.layout().clone());
        assert_eq!(got.to_vec_f64(), want.to_vec_f64(), "{dtype} strided");
    }
}
