//! matmul and linear against a plain f64 reference, per dtype, on odd sizes, 1-D operands,
//! broadcast batch dims and strided (transposed, sliced) operands; their gradients by
//! finite differences; and the errors they return.

use crate::common;
use common::*;
use hemi::{DType, Generator, Tensor};

/// The reference product with `torch.matmul`'s shape rules, in f64. Returns the output
/// shape, the values, and for each output element Σ|a_p||b_p| over its K terms (the scale
/// of its rounding error).
fn reference(
    a: &[f64],
    a_shape: &[usize],
    b: &[f64],
    b_shape: &[usize],
) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
    // 1-D operands become a row / a column, whose added dim leaves the output shape.
    let a_mat: Vec<usize> = if a_shape.len() == 1 {
        vec![1, a_shape[0]]
    } else {
        a_shape.to_vec()
    };
    let b_mat: Vec<usize> = if b_shape.len() == 1 {
        vec![b_shape[0], 1]
    } else {
        b_shape.to_vec()
    };
    let (ra, rb) = (a_mat.len(), b_mat.len());
    let (m, k, n) = (a_mat[ra - 2], a_mat[ra - 1], b_mat[rb - 1]);
    assert_eq!(k, b_mat[rb - 2]);
    let (ab, bb) = (&a_mat[..ra - 2], &b_mat[..rb - 2]);
    let rank = ab.len().max(bb.len());
    let pad = |s: &[usize]| -> Vec<usize> {
        let mut p = vec![1; rank - s.len()];
        p.extend_from_slice(s);
        p
    };
    let (pa, pb) = (pad(ab), pad(bb));
    let batch: Vec<usize> = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
    let count: usize = batch.iter().product();
    // Flat batch index of an operand for output batch index `i` (size-1 dims repeat).
    let index = |own: &[usize], mut i: usize| -> usize {
        let (mut flat, mut scale) = (0, 1);
        for d in (0..rank).rev() {
            let coord = i % batch[d];
            i /= batch[d];
            if own[d] != 1 {
                flat += coord * scale;
            }
            scale *= own[d];
        }
        flat
    };
    let (mut out, mut mag) = (Vec::new(), Vec::new());
    for bi in 0..count {
        let (ia, ib) = (index(&pa, bi), index(&pb, bi));
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut abs) = (0.0, 0.0);
                for p in 0..k {
                    let x = a[ia * m * k + i * k + p] * b[ib * k * n + p * n + j];
                    s += x;
                    abs += x.abs();
                }
                out.push(s);
                mag.push(abs);
            }
        }
    }
    let mut shape = batch;
    if a_shape.len() > 1 {
        shape.push(m);
    }
    if b_shape.len() > 1 {
        shape.push(n);
    }
    (shape, out, mag)
}

/// Asserts a product computed in F32 and rounded once into `dtype` is within its error
/// bound. Each output is c = Σ_p a_p b_p over K terms with the inputs exact in the dtype.
/// Accumulating the K products in F32 (with or without FMA, in any order or blocking) errs
/// by at most γ_K·Σ|a_p||b_p| ≈ K·u_f32·Σ|a_p||b_p| (the standard bound for a dot product);
/// the one rounding into the dtype adds u_dtype·|c| (plus half the smallest subnormal where
/// c is that small). So |got - c| <= u_dtype·|c| + (1 + u_dtype)·K·u_f32·Σ|a||b| + tiny.
/// For values in [-1, 1] and K <= 130 the F32 term is below 1e-5·Σ|a||b|, so the F16/BF16
/// checks are dominated by the single output rounding: partial sums kept in half precision
/// (K·u_half·Σ|a||b|) or a second rounding of the result would typically exceed the bound.
#[track_caller]
fn assert_product_close(
    what: &str,
    got: &[f64],
    want: &[f64],
    mag: &[f64],
    k: usize,
    dtype: DType,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let ud = u(dtype);
    let uc = if dtype == DType::F64 {
        u(DType::F64)
    } else {
        u(DType::F32)
    };
    let tiny = dtype.finfo().unwrap().min_positive_subnormal / 2.0;
    let gamma = (k as f64 * uc) / (1.0 - k as f64 * uc);
    for i in 0..got.len() {
        let bound = ud * want[i].abs() + (1.0 + ud) * gamma * mag[i] + tiny;
        let err = (got[i] - want[i]).abs();
        assert!(
            err <= bound,
            "{what}: element {i}: got {}, want {} (|err| {err:.3e} > bound {bound:.3e}, K = {k})",
            got[i],
            want[i]
        );
    }
}

/// Runs `a.matmul(b)` on random operands of the given shapes (each strided or not) and
/// checks shape, dtype and values against the reference.
fn check_matmul(
    dtype: DType,
    sa: &[usize],
    sb: &[usize],
    strided: (bool, bool),
    rng: &mut Generator,
) {
    let (ta, va) = rand_tensor(sa, dtype, strided.0, rng);
    let (tb, vb) = rand_tensor(sb, dtype, strided.1, rng);
    let (shape, want, mag) = reference(&va, sa, &vb, sb);
    let out = ta.matmul(&tb).unwrap();
    let what = format!("{dtype} {sa:?} x {sb:?} strided {strided:?}");
    assert_eq!(out.shape(), &shape[..], "{what}: shape");
    assert_eq!(out.dtype(), dtype, "{what}: dtype");
    assert_product_close(
        &what,
        &out.to_vec_f64(),
        &want,
        &mag,
        sa[sa.len() - 1],
        dtype,
    );
}

fn matmul_2d(dtype: DType) {
    let mut rng = Generator::new(10);
    for (m, k, n) in [
        (1, 1, 1),
        (1, 7, 1),
        (7, 1, 5),
        (7, 33, 5),
        (33, 65, 17),
        (65, 7, 33),
        (65, 65, 65), // large enough for gemm to go multi-threaded
        (3, 130, 2),
    ] {
        for strided in [(false, false), (true, false), (false, true), (true, true)] {
            check_matmul(dtype, &[m, k], &[k, n], strided, &mut rng);
        }
    }
}
dtype_tests!(matmul_2d_matches_f64, super::matmul_2d);

fn matmul_vectors(dtype: DType) {
    let mut rng = Generator::new(11);
    for (sa, sb) in [
        (vec![1], vec![1]),
        (vec![33], vec![33]),       // dot
        (vec![7, 33], vec![33]),    // matrix-vector
        (vec![33], vec![33, 5]),    // vector-matrix
        (vec![7], vec![3, 7, 5]),   // vector against a batch
        (vec![2, 5, 7], vec![7]),   // batch against a vector
        (vec![1, 7], vec![7, 1]),   // outer dims of size 1
        (vec![65], vec![2, 65, 1]), // batch of column vectors
    ] {
        for strided in [(false, false), (true, true)] {
            check_matmul(dtype, &sa, &sb, strided, &mut rng);
        }
    }
    // A dot product is a zero-dim tensor.
    let (a, _) = rand_tensor(&[5], dtype, false, &mut rng);
    assert_eq!(a.matmul(&a).unwrap().shape(), &[] as &[usize]);
}
dtype_tests!(matmul_vectors_match_f64, super::matmul_vectors);

fn matmul_batched(dtype: DType) {
    let mut rng = Generator::new(12);
    for (sa, sb) in [
        (vec![2, 7, 5], vec![2, 5, 3]),       // same batch
        (vec![3, 1, 7, 5], vec![2, 5, 3]),    // both broadcast: [3, 2]
        (vec![1, 7, 5], vec![4, 5, 3]),       // size-1 batch dim
        (vec![7, 5], vec![4, 5, 3]),          // 2-D lhs against a batch
        (vec![2, 3, 7, 5], vec![5, 3]),       // batch against one matrix (one tall gemm)
        (vec![2, 3, 7, 5], vec![1, 1, 5, 3]), // ... with size-1 batch dims
        (vec![40, 5, 7], vec![40, 7, 3]),     // many small matrices (parallel over batch)
        (vec![2, 33, 65], vec![2, 65, 33]),   // larger matrices, gemm parallel
        (vec![2, 0, 5], vec![2, 5, 3]),       // empty
        (vec![2, 7, 0], vec![1, 0, 3]),       // K = 0: zeros
    ] {
        for strided in [(false, false), (true, false), (false, true), (true, true)] {
            check_matmul(dtype, &sa, &sb, strided, &mut rng);
        }
    }
}
dtype_tests!(matmul_batched_matches_f64, super::matmul_batched);

/// Views with unusual strides: a row-sliced batch (mergeable rows with padding), a batch
/// dim broadcast with stride 0, a permuted batch, and a slice of a large buffer.
fn matmul_views(dtype: DType) {
    let mut rng = Generator::new(13);
    let check = |what: &str, a: &Tensor, b: &Tensor| {
        let (va, vb) = (a.to_vec_f64(), b.to_vec_f64());
        let (shape, want, mag) = reference(&va, a.shape(), &vb, b.shape());
        let out = a.matmul(b).unwrap();
        assert_eq!(out.shape(), &shape[..], "{what}");
        let k = a.shape()[a.rank() - 1];
        assert_product_close(what, &out.to_vec_f64(), &want, &mag, k, dtype);
    };
    // [2, 7, 9] narrowed to [2, 7, 5]: rows merge with row stride 9.
    let (wide, _) = rand_tensor(&[2, 7, 9], dtype, false, &mut rng);
    let a = wide.narrow(2, 2, 5).unwrap();
    let (b, _) = rand_tensor(&[5, 3], dtype, true, &mut rng);
    check("narrowed batch x matrix", &a, &b);
    // A matrix broadcast over a batch (stride 0), times a batch.
    let (m, _) = rand_tensor(&[7, 5], dtype, false, &mut rng);
    let a = m.broadcast_to(&[3, 7, 5]).unwrap();
    let (b, _) = rand_tensor(&[3, 5, 4], dtype, false, &mut rng);
    check("broadcast view x batch", &a, &b);
    // A row broadcast into a matrix (stride 0 inside the matrix).
    let (r, _) = rand_tensor(&[1, 5], dtype, false, &mut rng);
    let a = r.broadcast_to(&[6, 5]).unwrap();
    check("broadcast rows x batch", &a, &b);
    // Batch dims permuted: [4, 3, 7, 5] -> [3, 4, 7, 5].
    let (p, _) = rand_tensor(&[4, 3, 7, 5], dtype, false, &mut rng);
    let a = p.permute(&[1, 0, 2, 3]).unwrap();
    let (b, _) = rand_tensor(&[3, 1, 5, 2], dtype, true, &mut rng);
    check("permuted batch", &a, &b);
    // A thin column slice of a large matrix (gathered before conversion).
    let (big, _) = rand_tensor(&[64, 64], dtype, false, &mut rng);
    let a = big.narrow(1, 3, 2).unwrap().t().unwrap(); // [2, 64], strided
    let b = big.narrow(1, 10, 3).unwrap(); // [64, 3]
    check("thin slices of a large buffer", &a, &b);
}
dtype_tests!(matmul_strided_views_match_f64, super::matmul_views);

/// A transposed view and its contiguous copy hold the same values, so the products agree.
fn transposed_equals_contiguous(dtype: DType) {
    let mut rng = Generator::new(14);
    for (m, k, n) in [(7, 33, 5), (65, 17, 66), (1, 9, 1)] {
        let (at, _) = rand_tensor(&[k, m], dtype, false, &mut rng);
        let (bt, _) = rand_tensor(&[2, n, k], dtype, false, &mut rng);
        let (a, b) = (at.t().unwrap(), bt.transpose(-1, -2).unwrap());
        assert!(!a.is_contiguous() || m == 1);
        let (ac, bc) = (a.contiguous().unwrap(), b.contiguous().unwrap());
        let got = a.matmul(&b).unwrap().to_vec_f64();
        let want = ac.matmul(&bc).unwrap().to_vec_f64();
        let (_, exact, mag) = reference(&ac.to_vec_f64(), ac.shape(), &bc.to_vec_f64(), bc.shape());
        // Both are within the product bound of the exact result...
        assert_product_close("transposed", &got, &exact, &mag, k, dtype);
        // ...and, gemm packing both layouts the same way, equal to each other up to the
        // order-of-summation slack of that bound.
        assert_product_close("transposed vs contiguous", &got, &want, &mag, 2 * k, dtype);
    }
}
dtype_tests!(
    transposed_operand_equals_contiguous_copy,
    super::transposed_equals_contiguous
);

fn linear_forward(dtype: DType) {
    let mut rng = Generator::new(15);
    for (x_shape, out_f, strided) in [
        (vec![7usize, 33], 5usize, true),
        (vec![2, 3, 33], 17, false),
        (vec![33], 4, false),
        (vec![1, 65], 1, true),
        (vec![4, 65], 66, false),
    ] {
        let in_f = x_shape[x_shape.len() - 1];
        let (x, vx) = rand_tensor(&x_shape, dtype, strided, &mut rng);
        let (w, vw) = rand_tensor(&[out_f, in_f], dtype, strided, &mut rng);
        let (b, vb) = rand_tensor(&[out_f], dtype, strided, &mut rng);
        // x · Wᵀ: the reference multiplies by the transposed values.
        let mut wt = vec![0.0; in_f * out_f];
        for o in 0..out_f {
            for i in 0..in_f {
                wt[i * out_f + o] = vw[o * in_f + i];
            }
        }
        let (shape, want, mag) = reference(&vx, &x_shape, &wt, &[in_f, out_f]);
        let what = format!("linear {dtype} {x_shape:?} -> {out_f}");
        let got = x.linear(&w, None).unwrap();
        assert_eq!(got.shape(), &shape[..], "{what}");
        assert_eq!(got.dtype(), dtype, "{what}");
        assert_product_close(&what, &got.to_vec_f64(), &want, &mag, in_f, dtype);
        // With a bias: one more term in each sum, added before the single rounding.
        let want_b: Vec<f64> = want
            .iter()
            .enumerate()
            .map(|(i, &c)| c + vb[i % out_f])
            .collect();
        let mag_b: Vec<f64> = mag
            .iter()
            .enumerate()
            .map(|(i, &s)| s + vb[i % out_f].abs())
            .collect();
        let got = x.linear(&w, Some(&b)).unwrap();
        assert_eq!(got.shape(), &shape[..], "{what}");
        assert_product_close(
            &format!("{what} + bias"),
            &got.to_vec_f64(),
            &want_b,
            &mag_b,
            in_f + 1,
            dtype,
        );
    }
}
dtype_tests!(linear_matches_f64, super::linear_forward);

/// Gradients of half-precision leaves come back in their dtype, computed through the same
/// product bound: for loss = Σ (A·B), dA = 1·Bᵀ holds the row sums of B.
fn half_gradients(dtype: DType) {
    let mut rng = Generator::new(16);
    let (k, n) = (33, 17);
    let (a, _) = rand_tensor(&[5, k], dtype, false, &mut rng);
    let (b, vb) = rand_tensor(&[k, n], dtype, true, &mut rng);
    let a = a.requires_grad_();
    a.matmul(&b).unwrap().sum_all().unwrap().backward().unwrap();
    let ga = a.grad().unwrap();
    assert_eq!(ga.dtype(), dtype);
    assert_eq!(ga.shape(), &[5, k]);
    let ones = vec![1.0; 5 * n];
    let vbt: Vec<f64> = (0..n * k).map(|i| vb[(i % k) * n + i / k]).collect();
    let (_, want, mag) = reference(&ones, &[5, n], &vbt, &[n, k]);
    assert_product_close("dA", &ga.to_vec_f64(), &want, &mag, n, dtype);
    assert!(b.grad().is_none(), "B does not require grad");
}
dtype_tests!(half_gradients_keep_dtype, super::half_gradients);

#[test]
fn mixed_dtypes_promote() {
    let mut rng = Generator::new(17);
    for (da, db, want) in [
        (DType::F16, DType::F32, DType::F32),
        (DType::BF16, DType::F16, DType::F32),
        (DType::F32, DType::F64, DType::F64),
        (DType::BF16, DType::BF16, DType::BF16),
    ] {
        let (a, va) = rand_tensor(&[3, 9], da, true, &mut rng);
        let (b, vb) = rand_tensor(&[9, 4], db, false, &mut rng);
        let out = a.matmul(&b).unwrap();
        assert_eq!(out.dtype(), want, "{da} x {db}");
        let (_, exact, mag) = reference(&va, &[3, 9], &vb, &[9, 4]);
        assert_product_close(
            &format!("{da} x {db}"),
            &out.to_vec_f64(),
            &exact,
            &mag,
            9,
            want,
        );
        let (w, _) = rand_tensor(&[4, 9], db, false, &mut rng);
        assert_eq!(a.linear(&w, None).unwrap().dtype(), want);
    }
}

#[test]
fn matmul_gradients() {
    let mut rng = Generator::new(18);
    let g = |s: &[usize], rng: &mut Generator| grad_input(s, rng);
    let cases: Vec<(&str, Vec<usize>, Vec<usize>)> = vec![
        ("2-D", vec![3, 4], vec![4, 5]),
        ("batched", vec![2, 3, 4], vec![2, 4, 5]),
        ("batched + broadcast", vec![2, 1, 3, 4], vec![3, 4, 2]),
        ("batch x matrix", vec![2, 3, 4], vec![4, 5]),
        ("matrix x batch", vec![3, 4], vec![2, 4, 5]),
        ("dot", vec![4], vec![4]),
        ("matrix-vector", vec![3, 4], vec![4]),
        ("vector-matrix", vec![4], vec![4, 5]),
        ("vector-batch", vec![4], vec![2, 4, 3]),
    ];
    for (name, sa, sb) in cases {
        gradcheck(name, &[g(&sa, &mut rng), g(&sb, &mut rng)], |x| {
            x[0].matmul(&x[1])
        });
    }
    // Transposed operands and a row-sliced batch (views through the backward too).
    gradcheck(
        "transposed",
        &[g(&[4, 3], &mut rng), g(&[5, 4], &mut rng)],
        |x| x[0].t()?.matmul(&x[1].t()?),
    );
    gradcheck(
        "sliced batch x matrix",
        &[g(&[2, 3, 6], &mut rng), g(&[4, 5], &mut rng)],
        |x| x[0].narrow(2, 1, 4)?.matmul(&x[1]),
    );
    gradcheck(
        "transposed batch x matrix",
        &[g(&[2, 4, 3], &mut rng), g(&[4, 5], &mut rng)],
        |x| x[0].transpose(-1, -2)?.matmul(&x[1]),
    );
    // The same tensor on both sides: gradients add.
    gradcheck("a · aᵀ", &[g(&[3, 4], &mut rng)], |x| {
        x[0].matmul(&x[0].t()?)
    });
}

#[test]
fn linear_gradients() {
    let mut rng = Generator::new(19);
    let g = |s: &[usize], rng: &mut Generator| grad_input(s, rng);
    for x_shape in [vec![3, 4], vec![2, 3, 4], vec![4]] {
        let inputs = [
            g(&x_shape, &mut rng),
            g(&[5, 4], &mut rng),
            g(&[5], &mut rng),
        ];
        gradcheck(&format!("linear {x_shape:?} + bias"), &inputs, |x| {
            x[0].linear(&x[1], Some(&x[2]))
        });
        gradcheck(&format!("linear {x_shape:?}"), &inputs[..2], |x| {
            x[0].linear(&x[1], None)
        });
    }
    gradcheck(
        "linear, transposed input",
        &[g(&[4, 3], &mut rng), g(&[5, 4], &mut rng)],
        |x| x[0].t()?.linear(&x[1], None),
    );
}

#[test]
fn errors_name_the_op_and_shapes() {
    let t = |s: &[usize]| Tensor::zeros(s, DType::F32).unwrap();
    let msg = |r: hemi::Result<Tensor>| r.unwrap_err().to_string();
    let e = msg(t(&[2, 3]).matmul(&t(&[4, 5])));
    assert!(e.contains("matmul") && e.contains("[2, 3] x [4, 5]"), "{e}");
    let e = msg(t(&[3]).matmul(&t(&[4])));
    assert!(e.contains("matmul") && e.contains("[3] x [4]"), "{e}");
    let e = msg(t(&[2, 3, 4]).matmul(&t(&[3, 4, 5])));
    assert!(
        e.contains("[2, 3, 4] x [3, 4, 5]") && e.contains("batch"),
        "{e}"
    );
    let e = msg(t(&[]).matmul(&t(&[3])));
    assert!(e.contains("matmul") && e.contains("[] x [3]"), "{e}");
    let ints = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2]).unwrap();
    let e = msg(ints.matmul(&t(&[2, 2])));
    assert!(e.contains("matmul") && e.contains("I64"), "{e}");
    let e = msg(t(&[2, 2]).matmul(&ints));
    assert!(e.contains("matmul") && e.contains("I64"), "{e}");

    let e = msg(t(&[2, 3]).linear(&t(&[5, 4]), None));
    assert!(
        e.contains("linear") && e.contains("[2, 3]") && e.contains("[5, 4]"),
        "{e}"
    );
    let e = msg(t(&[2, 4]).linear(&t(&[4]), None));
    assert!(e.contains("linear") && e.contains("weight [4]"), "{e}");
    let e = msg(t(&[2, 4]).linear(&t(&[5, 4]), Some(&t(&[4]))));
    assert!(e.contains("linear") && e.contains("bias [4]"), "{e}");
    let e = msg(t(&[]).linear(&t(&[5, 4]), None));
    assert!(e.contains("linear"), "{e}");
    let e = msg(ints.linear(&t(&[5, 2]), None));
    assert!(e.contains("linear") && e.contains("I64"), "{e}");
}
