//! The fused block `conv2d_relu_max_pool2` against the three ops it replaces, computed in
//! F64 (whose conv2d, relu and max_pool2d are each tested against plain references in
//! conv.rs, elementwise.rs and pool.rs): values and all three gradients, per dtype, on odd
//! shapes, strides, padding, groups and non-contiguous inputs; the NaN and tie rules; the
//! unfused fallbacks; and autocast.

use crate::common;
use common::block::*;
use common::*;
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};

dtype_tests!(
    block_matches_f64_composition,
    super::block_matches_reference
);

/// The fused op equals the three ops in the same dtype: the same GEMMs run on the same
/// numbers, so the output is identical; F32 gradients agree within accumulation order.
fn block_equals_unfused(dtype: DType) {
    let mut rng = Generator::new(32);
    for case in cases() {
        let (xs, ws, opts, has_bias) = case;
        let (x, _) = rand_tensor(&xs, dtype, false, &mut rng);
        let (w, _) = rand_tensor(&ws, dtype, false, &mut rng);
        let b = has_bias.then(|| rand_tensor(&[ws[0]], dtype, false, &mut rng).0);
        let run = |fused: bool| {
            let (x, w) = (x.detach().requires_grad_(), w.detach().requires_grad_());
            let b = b.as_ref().map(|b| b.detach().requires_grad_());
            let y = if fused {
                x.conv2d_relu_max_pool2(&w, b.as_ref(), opts).unwrap()
            } else {
                x.conv2d(&w, b.as_ref(), opts)
                    .unwrap()
                    .relu()
                    .unwrap()
                    .max_pool2d((2, 2), (2, 2), (0, 0))
                    .unwrap()
            };
            y.sum_all().unwrap().backward().unwrap();
            let grads: Vec<Vec<f64>> = [Some(&x), Some(&w), b.as_ref()]
                .into_iter()
                .flatten()
                .map(|t| t.grad().unwrap().to_vec_f64())
                .collect();
            (y.to_vec_f64(), grads)
        };
        let ((yf, gf), (yu, gu)) = (run(true), run(false));
        assert_eq!(yf, yu, "{dtype} {case:?}: outputs");
        // In F16/BF16 the unfused pool sees the rounded convolution output, where distinct
        // F32 values can tie and the first wins; the fused pool picks the F32 maximum
        // (as the F64 reference does, checked above), so gradients may take another
        // route there. In F32 both pools see the same values.
        if dtype != DType::F32 {
            continue;
        }
        for (i, (a, b)) in gf.iter().zip(&gu).enumerate() {
            assert_close(
                &format!("{dtype} {case:?} grad {i}"),
                a,
                b,
                permissive(dtype),
            );
        }
    }
}
dtype_tests!(block_equals_unfused_ops, super::block_equals_unfused);

/// A tie goes to the first window element, a NaN propagates and passes no gradient, a
/// non-positive maximum gives 0 and no gradient — the rules of relu then max_pool2d.
#[test]
fn block_nan_tie_and_relu_rules() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // A 1×1 identity convolution: the block pools the input itself.
        let v = vec![
            1.0,
            3.0,
            f64::NAN,
            -1.0,
            -3.0,
            -4.0, //
            3.0,
            2.0,
            f64::NAN,
            7.0,
            -2.0,
            -0.5,
        ];
        let x = Tensor::from_f64_vec(v, &[1, 1, 2, 6], dtype)
            .unwrap()
            .requires_grad_();
        let w = Tensor::from_f64_vec(vec![1.0], &[1, 1, 1, 1], dtype)
            .unwrap()
            .requires_grad_();
        let y = x
            .conv2d_relu_max_pool2(&w, None, Conv2dOptions::default())
            .unwrap();
        let yv = y.to_vec_f64();
        assert!(yv[0] == 3.0 && yv[1].is_nan() && yv[2] == 0.0, "{yv:?}");
        let gy = Tensor::from_f64_vec(vec![1.0, 1.0, 1.0], &[1, 1, 1, 3], dtype).unwrap();
        y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = x.grad().unwrap().to_vec_f64();
        let mut want = vec![0.0; 12];
        want[1] = 1.0; // the first 3 (row 0) wins the tie with row 1's 3
        assert_eq!(dx, want, "{dtype}");
    }
}

/// Mixed dtypes, F64 and too-small outputs run (or fail) as the three ops do.
#[test]
fn block_falls_back_to_the_ops() {
    let mut rng = Generator::new(33);
    let o = Conv2dOptions::default();
    let (x, _) = rand_tensor(&[2, 3, 8, 8], DType::F16, false, &mut rng);
    let (w, _) = rand_tensor(&[4, 3, 3, 3], DType::F32, false, &mut rng);
    let fused = x.conv2d_relu_max_pool2(&w, None, o).unwrap();
    let ops = x
        .conv2d(&w, None, o)
        .unwrap()
        .relu()
        .unwrap()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap();
    assert_eq!(fused.dtype(), DType::F32);
    assert_eq!(fused.to_vec_f64(), ops.to_vec_f64());
    let x64 = x.to_dtype(DType::F64).unwrap();
    let w64 = w.to_dtype(DType::F64).unwrap();
    assert_eq!(
        x64.conv2d_relu_max_pool2(&w64, None, o).unwrap().dtype(),
        DType::F64
    );
    // A 3×3 input and kernel give a 1×1 output: nothing to pool, the pool's error.
    let tiny = Tensor::zeros(&[1, 3, 3, 3], DType::F32).unwrap();
    let w32 = w.to_dtype(DType::F32).unwrap();
    let err = tiny.conv2d_relu_max_pool2(&w32, None, o).unwrap_err();
    assert!(err.to_string().contains("max_pool2d"), "{err}");
    // Shape errors name the convolution.
    let bad = Tensor::zeros(&[1, 2, 8, 8], DType::F32).unwrap();
    let err = bad.conv2d_relu_max_pool2(&w32, None, o).unwrap_err();
    assert!(err.to_string().contains("conv2d"), "{err}");
}

/// Under autocast(BF16) F32 parameters are cast and the block runs in BF16, with F32
/// gradients for the F32 parameters.
#[test]
fn block_under_autocast() {
    let mut rng = Generator::new(34);
    let (x, _) = rand_tensor(&[2, 3, 10, 10], DType::F32, false, &mut rng);
    let (w, _) = rand_tensor(&[5, 3, 3, 3], DType::F32, false, &mut rng);
    let w = w.requires_grad_();
    let y = {
        let _ac = hemi::amp::autocast(DType::BF16);
        x.conv2d_relu_max_pool2(&w, None, Conv2dOptions::default())
            .unwrap()
    };
    assert_eq!(y.dtype(), DType::BF16);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}
