//! Autograd semantics: accumulation across backward calls, zero_grad, detach, no_grad,
//! gradient dtypes, casts, and misuse errors.

use hemi::{autograd, no_grad, DType, Tensor};

fn param(v: Vec<f64>, dtype: DType) -> Tensor {
    let n = v.len();
    Tensor::from_f64_vec(v, &[n], dtype)
        .unwrap()
        .requires_grad_()
}

#[test]
fn grads_accumulate_across_backward_calls_until_zeroed() {
    let w = param(vec![1.0, 2.0, 3.0], DType::F32);
    let loss = |w: &Tensor| w.square().unwrap().sum_all().unwrap();
    loss(&w).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![2.0, 4.0, 6.0]);
    // Second backward adds (gradient accumulation, as PyTorch).
    loss(&w).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![4.0, 8.0, 12.0]);
    w.zero_grad();
    assert!(w.grad().is_none());
    loss(&w).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![2.0, 4.0, 6.0]);
}

#[test]
fn a_tensor_used_twice_gets_both_contributions() {
    // y = x * x + x  =>  dy/dx = 2x + 1
    let x = param(vec![0.5, -1.5], DType::F64);
    let y = x.mul(&x).unwrap().add(&x).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64(), vec![2.0, -2.0]);
}

#[test]
fn detach_and_no_grad_stop_the_graph() {
    let x = param(vec![1.0, 2.0], DType::F32);
    let d = x.detach();
    assert!(!d.requires_grad());
    assert!(d.same_storage(&x));
    {
        let _g = no_grad();
        let y = x.mul_scalar(3.0).unwrap();
        assert!(!y.requires_grad());
        assert!(y.sum_all().unwrap().backward().is_err());
    }
    // Recording is back on after the guard.
    assert!(x.mul_scalar(3.0).unwrap().requires_grad());
    // Only the non-detached path contributes.
    let y = x.mul(&x.detach()).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64(), vec![1.0, 2.0]);
}

#[test]
fn gradient_has_the_parameter_dtype_and_casts_flow_back() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let w = param(vec![0.25, -0.5, 1.0], dtype);
        // A cast up to F32, F32 maths, and the gradient cast back to the parameter's dtype.
        let y = w
            .to_dtype(DType::F32)
            .unwrap()
            .mul_scalar(4.0)
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(y.dtype(), DType::F32);
        y.backward().unwrap();
        let g = w.grad().unwrap();
        assert_eq!(g.dtype(), dtype);
        assert_eq!(g.to_vec_f64(), vec![4.0, 4.0, 4.0]);
    }
}

#[test]
fn autograd_grad_returns_gradients_without_touching_dot_grad() {
    let a = param(vec![1.0, 2.0], DType::F32);
    let b = param(vec![3.0, 4.0], DType::F32);
    let y = a.mul(&b).unwrap().sum_all().unwrap();
    let g = autograd::grad(&y, &[&a]).unwrap();
    assert_eq!(g[0].to_vec_f64(), vec![3.0, 4.0]);
    assert!(a.grad().is_none() && b.grad().is_none());
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let x = param(vec![1.0, 2.0], DType::F32);
    let y = x.mul_scalar(2.0).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("scalar"), "{e}");
    assert!(y.set_requires_grad(true).is_err(), "non-leaf");
    let i = Tensor::zeros(&[2], DType::I64).unwrap();
    assert!(i.set_requires_grad(true).is_err());
    let c = Tensor::ones(&[2], DType::F32).unwrap();
    assert!(
        c.sum_all().unwrap().backward().is_err(),
        "no parameter reaches it"
    );
}

#[test]
fn deep_chains_do_not_overflow_the_stack() {
    let x = param(vec![1.0], DType::F32);
    let mut y = x.clone();
    for _ in 0..20_000 {
        y = y.add_scalar(0.0).unwrap();
    }
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64(), vec![1.0]);
}

#[test]
fn set_data_updates_every_clone_in_place() {
    let w = param(vec![1.0, 2.0], DType::F32);
    let alias = w.clone();
    w.set_data(&Tensor::from_f64_vec(vec![5.0, 6.0], &[2], DType::F32).unwrap())
        .unwrap();
    assert_eq!(alias.to_vec_f64(), vec![5.0, 6.0]);
    assert!(w
        .set_data(&Tensor::zeros(&[3], DType::F32).unwrap())
        .is_err());
    assert!(w
        .set_data(&Tensor::zeros(&[2], DType::F16).unwrap())
        .is_err());
}

#[test]
fn backward_frees_the_graph_and_retain_graph_keeps_it() {
    let w = param(vec![1.0, -2.0, 3.0], DType::F32);
    // An intermediate the graph saves (mul keeps both operands for its backward).
    let h = w.mul(&w).unwrap();
    let loss = h.mul(&h).unwrap().sum_all().unwrap();
    let saved = h.storage();
    drop(h);
    let before = std::sync::Arc::strong_count(&saved);
    assert!(before > 1, "the graph holds h");
    loss.backward_retain_graph().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![4.0, -32.0, 108.0]);
    // Kept: the graph still holds h's storage, and a second backward adds again.
    assert_eq!(std::sync::Arc::strong_count(&saved), before);
    loss.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![8.0, -64.0, 216.0]);
    // Freed: only this test's handle is left, and another backward is a clear error.
    assert_eq!(std::sync::Arc::strong_count(&saved), 1);
    let e = loss.backward().unwrap_err().to_string();
    assert!(e.contains("second time") && e.contains("`sum`"), "{e}");
    // The gradient of the failed call was not added.
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![8.0, -64.0, 216.0]);
}

/// `backward_with_retain_graph` takes an output gradient and keeps the graph, as
/// `torch.autograd.backward(y, g, retain_graph=True)`: a second call adds the same
/// gradient again; `backward_with` then frees it.
#[test]
fn backward_with_a_given_gradient_can_retain_the_graph() {
    let w = param(vec![1.0, -2.0, 3.0], DType::F32);
    let y = w.mul(&w).unwrap();
    let g = Tensor::from_f64_vec(vec![1.0, 0.5, -1.0], &[3], DType::F32).unwrap();
    autograd::backward_with_retain_graph(&y, g.clone()).unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![2.0, -2.0, -6.0]);
    autograd::backward_with(&y, g.clone()).unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![4.0, -4.0, -12.0]);
    let e = autograd::backward_with(&y, g).unwrap_err().to_string();
    assert!(e.contains("second time"), "{e}");
}

/// The sweep adds gradients in place only into buffers nobody else holds: a backward that
/// hands the same gradient to two inputs, a `.grad` the caller kept from an earlier
/// backward, and a gradient `autograd::grad` captured all keep their values; the sums are
/// those of the out-of-place adds, in every float dtype.
#[test]
fn in_place_gradient_sums_never_touch_a_shared_buffer() {
    // z = x + x: add's backward gives the one gradient to both inputs.
    let x = param(vec![1.0, -2.0, 3.0], DType::F32);
    x.add(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec_f64(), vec![2.0; 3]);

    // A `.grad` handle kept across a second backward sees the old values.
    let w = param(vec![1.0, 2.0], DType::F32);
    let loss = |w: &Tensor| w.square().unwrap().sum_all().unwrap();
    loss(&w).backward().unwrap();
    let kept = w.grad().unwrap();
    loss(&w).backward().unwrap();
    assert_eq!(kept.to_vec_f64(), vec![2.0, 4.0]);
    assert_eq!(w.grad().unwrap().to_vec_f64(), vec![4.0, 8.0]);

    // Three contributions to one tensor (h), whose gradient `grad` also returns.
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let n = 1037;
        let x = Tensor::from_f64_vec(
            (0..n).map(|i| (i as f64 * 0.37).sin()).collect(),
            &[n],
            dtype,
        )
        .unwrap()
        .requires_grad_();
        let h = x.mul(&x).unwrap();
        let y = h
            .add(&h.mul(&h).unwrap())
            .unwrap()
            .add(&h.exp().unwrap())
            .unwrap();
        let y = y.sum_all().unwrap();
        let g = autograd::grad(&y, &[&h, &x]).unwrap();
        let (gh, gx) = (g[0].to_vec_f64(), g[1].to_vec_f64());
        let (xs, hs) = (x.to_vec_f64(), h.to_vec_f64());
        let eps = match dtype {
            DType::F64 => 1e-15,
            DType::F32 => 1e-6,
            DType::F16 => 1e-3,
            _ => 8e-3,
        };
        for i in 0..n {
            let hv = hs[i];
            let want_h = 1.0 + 2.0 * hv + hv.exp();
            assert!(
                (gh[i] - want_h).abs() <= 8.0 * eps * want_h.abs(),
                "{dtype} dh[{i}]"
            );
            let want_x = 2.0 * xs[i] * gh[i];
            assert!(
                (gx[i] - want_x).abs() <= 4.0 * eps * want_x.abs().max(eps),
                "{dtype} dx[{i}]"
            );
        }
    }
}
