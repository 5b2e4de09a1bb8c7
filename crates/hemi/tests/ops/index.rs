//! Embedding, index_select, cat and stack against plain references per dtype, their
//! gradients by finite differences (repeated indices accumulate), dtype promotion, and
//! error cases naming the op and the shapes.

use crate::common;
use common::*;
use hemi::ops::index::embedding;
use hemi::{DType, Error, Generator, Tensor};

fn ids(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

// ----- embedding ----------------------------------------------------------------------------

fn embedding_forward(dtype: DType) {
    let mut rng = Generator::new(41);
    let (v, d) = (7usize, 5usize);
    for strided in [false, true] {
        let (w, wv) = rand_tensor(&[v, d], dtype, strided, &mut rng);
        for (idv, shape) in [
            (vec![3i64, 0, 6, 3, 1, 1], vec![2usize, 3]),
            (vec![4], vec![1]),
            (vec![2], vec![]),
            (vec![], vec![0]),
        ] {
            let out = embedding(&w, &ids(&idv, &shape)).unwrap();
            let mut want_shape = shape.clone();
            want_shape.push(d);
            assert_eq!(out.shape(), &want_shape[..]);
            assert_eq!(out.dtype(), dtype);
            let want: Vec<f64> = idv
                .iter()
                .flat_map(|&i| wv[i as usize * d..][..d].to_vec())
                .collect();
            // A lookup copies: exact.
            assert_eq!(out.to_vec_f64(), want, "embedding {dtype} ids {shape:?}");
        }
    }
}
dtype_tests!(embedding_copies_rows, super::embedding_forward);

fn embedding_backward_accumulates(dtype: DType) {
    // 300 copies of one id with gradient 1 + 2^-10 each: an F16 accumulator would lose the
    // small parts (F16 spacing at 256 is 0.25); the F32 one rounds the total once.
    let w = Tensor::zeros(&[3, 2], dtype).unwrap().requires_grad_();
    let n = 300;
    let out = Tensor::embedding(&w, &ids(&vec![1; n], &[n])).unwrap();
    let g = Tensor::full(&[n, 2], 1.0 + 1.0 / 1024.0, dtype).unwrap();
    let gv = g.to_vec_f64()[0];
    out.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = w.grad().unwrap();
    assert_eq!(grad.dtype(), dtype);
    let want = [0.0, 0.0, n as f64 * gv, n as f64 * gv, 0.0, 0.0];
    assert_close("embedding grad", &grad.to_vec_f64(), &want, strict(dtype));
}
dtype_tests!(
    embedding_grad_sums_in_f32,
    super::embedding_backward_accumulates
);

// ----- index_select -------------------------------------------------------------------------

fn index_select_forward(dtype: DType) {
    let mut rng = Generator::new(42);
    let shape = [4usize, 5, 3];
    for strided in [false, true] {
        let (x, xv) = rand_tensor(&shape, dtype, strided, &mut rng);
        let at = |i: usize, j: usize, k: usize| xv[(i * 5 + j) * 3 + k];
        for (dim, idx) in [
            (0isize, vec![3i64, 0, 3]),
            (1, vec![4, 4, 1, 0, 2, 2, 3]),
            (-1, vec![2, 0]),
            (1, vec![]),
        ] {
            let out = x.index_select(dim, &ids(&idx, &[idx.len()])).unwrap();
            let d = dim.rem_euclid(3) as usize;
            let mut out_shape = shape.to_vec();
            out_shape[d] = idx.len();
            assert_eq!(out.shape(), &out_shape[..]);
            let mut want = Vec::new();
            for i in 0..out_shape[0] {
                for j in 0..out_shape[1] {
                    for k in 0..out_shape[2] {
                        let mut p = [i, j, k];
                        p[d] = idx[p[d]] as usize;
                        want.push(at(p[0], p[1], p[2]));
                    }
                }
            }
            assert_eq!(out.to_vec_f64(), want, "index_select dim {dim} {idx:?}");
        }
    }
}
dtype_tests!(index_select_matches_reference, super::index_select_forward);

// ----- cat and stack ------------------------------------------------------------------------

fn cat_forward(dtype: DType) {
    let mut rng = Generator::new(43);
    // Along each dim of [2, 3, 4]-like shapes, with odd lengths and a zero-length part.
    for dim in [0isize, 1, -1] {
        let d = dim.rem_euclid(3) as usize;
        let lens = [3usize, 1, 0, 2];
        let mut parts = Vec::new();
        for (n, &len) in lens.iter().enumerate() {
            let mut s = vec![2usize, 3, 4];
            s[d] = len;
            parts.push(rand_tensor(&s, dtype, n % 2 == 1, &mut rng));
        }
        let refs: Vec<&Tensor> = parts.iter().map(|(t, _)| t).collect();
        let out = Tensor::cat(&refs, dim).unwrap();
        let mut out_shape = [2usize, 3, 4];
        out_shape[d] = lens.iter().sum();
        assert_eq!(out.shape(), &out_shape[..]);
        assert_eq!(out.dtype(), dtype);
        // Reference: element [i, j, k] comes from the part whose range covers p[d].
        let mut want = Vec::new();
        for i in 0..out_shape[0] {
            for j in 0..out_shape[1] {
                for k in 0..out_shape[2] {
                    let mut p = [i, j, k];
                    let mut part = 0;
                    while p[d] >= lens[part] {
                        p[d] -= lens[part];
                        part += 1;
                    }
                    let mut s = [2usize, 3, 4];
                    s[d] = lens[part];
                    want.push(parts[part].1[(p[0] * s[1] + p[1]) * s[2] + p[2]]);
                }
            }
        }
        assert_eq!(out.to_vec_f64(), want, "cat dim {dim}");
    }
}
dtype_tests!(cat_matches_reference, super::cat_forward);

fn stack_forward(dtype: DType) {
    let mut rng = Generator::new(44);
    let parts: Vec<(Tensor, Vec<f64>)> = (0..3)
        .map(|n| rand_tensor(&[2, 5], dtype, n == 1, &mut rng))
        .collect();
    let refs: Vec<&Tensor> = parts.iter().map(|(t, _)| t).collect();
    for (dim, shape) in [(0isize, [3usize, 2, 5]), (1, [2, 3, 5]), (-1, [2, 5, 3])] {
        let out = Tensor::stack(&refs, dim).unwrap();
        assert_eq!(out.shape(), &shape);
        let mut want = Vec::new();
        for a in 0..shape[0] {
            for b in 0..shape[1] {
                for c in 0..shape[2] {
                    // (part, i, j) from the output position by where the new dim sits.
                    let (p, i, j) = match dim {
                        0 => (a, b, c),
                        1 => (b, a, c),
                        _ => (c, a, b),
                    };
                    want.push(parts[p].1[i * 5 + j]);
                }
            }
        }
        assert_eq!(out.to_vec_f64(), want, "stack dim {dim}");
    }
}
dtype_tests!(stack_matches_reference, super::stack_forward);

#[test]
fn cat_promotes_mixed_dtypes() {
    let h = Tensor::from_f64_vec(vec![0.1, 0.2], &[2], DType::F16).unwrap();
    let b = Tensor::from_f64_vec(vec![0.3], &[1], DType::BF16).unwrap();
    let f = Tensor::from_f64_vec(vec![0.4], &[1], DType::F32).unwrap();
    let out = Tensor::cat(&[&h, &b], 0).unwrap();
    assert_eq!(out.dtype(), DType::F32);
    // The half values widen exactly.
    let want: Vec<f64> = h.to_vec_f64().into_iter().chain(b.to_vec_f64()).collect();
    assert_eq!(out.to_vec_f64(), want);
    assert_eq!(Tensor::cat(&[&h, &h], 0).unwrap().dtype(), DType::F16);
    assert_eq!(Tensor::cat(&[&h, &f], 0).unwrap().dtype(), DType::F32);
    // Integers copy exactly (no detour through F32) and promote to a float when mixed.
    let big = (1i64 << 40) + 1;
    let i = ids(&[big, -3], &[2]);
    let out = Tensor::cat(&[&i, &i], 0).unwrap();
    assert_eq!(out.dtype(), DType::I64);
    assert_eq!(out.to_vec_i64(), vec![big, -3, big, -3]);
    assert_eq!(Tensor::cat(&[&i, &f], 0).unwrap().dtype(), DType::F32);
    // Gradients come back in each input's dtype.
    let hp = h.clone().requires_grad_();
    let fp = f.clone().requires_grad_();
    let out = Tensor::cat(&[&hp, &fp], 0).unwrap();
    let w = Tensor::from_f64_vec(vec![1.0, 2.0, 3.0], &[3], DType::F32).unwrap();
    out.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(hp.grad().unwrap().dtype(), DType::F16);
    assert_eq!(hp.grad().unwrap().to_vec_f64(), vec![1.0, 2.0]);
    assert_eq!(fp.grad().unwrap().to_vec_f64(), vec![3.0]);
}

// ----- gradients ----------------------------------------------------------------------------

#[test]
fn index_gradients() {
    let mut rng = Generator::new(45);
    // Repeated ids accumulate into one row; unused rows get zero.
    let id = ids(&[2, 0, 2, 4, 2, 0], &[2, 3]);
    gradcheck("embedding", &[grad_input(&[6, 3], &mut rng)], |t| {
        Tensor::embedding(&t[0], &id)
    });
    let x = grad_input(&[3, 4, 2], &mut rng);
    for (dim, idx) in [
        (0isize, vec![1i64, 1, 0]),
        (1, vec![3, 0, 3, 3]),
        (-1, vec![1, 1]),
    ] {
        let it = ids(&idx, &[idx.len()]);
        gradcheck(
            &format!("index_select dim {dim}"),
            std::slice::from_ref(&x),
            |t| t[0].index_select(dim, &it),
        );
    }
    let a = grad_input(&[2, 3], &mut rng);
    let b = grad_input(&[2, 1], &mut rng);
    let c = grad_input(&[2, 4], &mut rng);
    gradcheck("cat dim 1", &[a.clone(), b, c], |t| {
        Tensor::cat(&[&t[0], &t[1], &t[2]], -1)
    });
    gradcheck(
        "cat dim 0 (one input twice)",
        &[a.clone(), grad_input(&[1, 3], &mut rng)],
        |t| Tensor::cat(&[&t[0], &t[1], &t[0]], 0),
    );
    let d = grad_input(&[2, 3], &mut rng);
    for dim in [0isize, 1, 2, -1] {
        gradcheck(&format!("stack dim {dim}"), &[a.clone(), d.clone()], |t| {
            Tensor::stack(&[&t[0], &t[1]], dim)
        });
    }
}

// ----- errors -------------------------------------------------------------------------------

#[test]
fn index_errors() {
    let w = Tensor::zeros(&[5, 3], DType::F32).unwrap();
    // Out-of-range and negative ids are Error::Index naming the op, the id and the size.
    let e = embedding(&w, &ids(&[1, 5], &[2])).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Index {
                op: "embedding",
                index: 5,
                size: 5
            }
        ),
        "{e}"
    );
    assert!(matches!(
        embedding(&w, &ids(&[-1], &[1])),
        Err(Error::Index { index: -1, .. })
    ));
    let fids = Tensor::zeros(&[2], DType::F32).unwrap();
    assert!(matches!(embedding(&w, &fids), Err(Error::DType { .. })));
    let msg = embedding(&Tensor::zeros(&[5], DType::F32).unwrap(), &ids(&[0], &[1]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("embedding") && msg.contains("[5]"), "{msg}");

    let x = Tensor::zeros(&[4, 3], DType::F32).unwrap();
    assert!(matches!(
        x.index_select(1, &ids(&[0, 3], &[2])),
        Err(Error::Index {
            op: "index_select",
            index: 3,
            size: 3
        })
    ));
    let msg = x
        .index_select(0, &ids(&[0, 1], &[1, 2]))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("index_select") && msg.contains("[1, 2]"),
        "{msg}"
    );
    assert!(matches!(
        x.index_select(2, &ids(&[0], &[1])),
        Err(Error::Dim { .. })
    ));

    let y = Tensor::zeros(&[4, 2], DType::F32).unwrap();
    let msg = Tensor::cat(&[&x, &y], 0).unwrap_err().to_string();
    assert!(
        msg.contains("cat") && msg.contains("[4, 3]") && msg.contains("[4, 2]"),
        "{msg}"
    );
    assert!(Tensor::cat(&[&x, &y], 1).is_ok());
    assert!(Tensor::cat(&[], 0).is_err());
    assert!(Tensor::cat(&[&x, &x], 2).is_err());
    let s = Tensor::scalar(1.0, DType::F32);
    assert!(Tensor::cat(&[&s, &s], 0).is_err());
    let r3 = Tensor::zeros(&[4, 3, 1], DType::F32).unwrap();
    assert!(Tensor::cat(&[&x, &r3], 0).is_err());

    let msg = Tensor::stack(&[&x, &y], 0).unwrap_err().to_string();
    assert!(
        msg.contains("stack") && msg.contains("[4, 3]") && msg.contains("[4, 2]"),
        "{msg}"
    );
    assert!(Tensor::stack(&[], 0).is_err());
    assert!(Tensor::stack(&[&x, &x], 3).is_err());
    assert_eq!(Tensor::stack(&[&s, &s], 0).unwrap().shape(), &[2]);
}
