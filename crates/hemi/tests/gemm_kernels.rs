//! The ops that multiply half-precision tensors through `cpu::gemm_half` (conv2d, the fused
//! conv block, matmul) on every GEMM kernel this CPU can run, forced one at a time: on a CPU
//! without AVX-512 BF16 the BF16-pair packing that `avx512bf16` reads is still exercised with
//! the views these ops pass (transposed weights, column matrices side by side), through
//! `portable-bf16-pairs`, which reads the same panels. Each result is checked against F64
//! with the F32 summation bound (`assert_sums_close`).
//!
//! The kernel choice is process-wide, so the tests of this binary take turns (`KERNEL_LOCK`).

mod common;
use common::block::block_matches_reference;
use common::*;
use hemi::cpu::gemm_half::{force_kernel, kernel_name, Kernel};
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};
use std::sync::Mutex;

static KERNEL_LOCK: Mutex<()> = Mutex::new(());

/// Runs `f(kernel)` with each kernel this CPU has that takes `dtype` × `dtype` forced.
fn on_each_kernel(dtype: DType, f: impl Fn(Kernel)) {
    let _turn = KERNEL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| k.is_available() && k.accepts(dtype, dtype))
        .collect();
    // Both portable kernels run everywhere; BF16 has at least the two portable formats.
    assert!(kernels.len() >= if dtype == DType::BF16 { 2 } else { 1 });
    for k in kernels {
        force_kernel(Some(k));
        assert_eq!(
            kernel_name(dtype, dtype),
            k.name(),
            "the forced kernel runs"
        );
        // Restores the automatic choice even when `f` panics.
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                force_kernel(None);
            }
        }
        let _reset = Reset;
        f(k);
    }
}

/// An F64 leaf holding `v` (or |v| with `abs`, for the sums of |terms| of the bounds).
fn f64_leaf(v: &[f64], shape: &[usize], abs: bool) -> Tensor {
    let t = Tensor::from_f64_vec(v.to_vec(), shape, DType::F64).unwrap();
    let t = if abs { t.abs().unwrap() } else { t };
    t.requires_grad_()
}

#[test]
fn conv_block_on_each_kernel() {
    for dtype in [DType::BF16, DType::F16] {
        on_each_kernel(dtype, |_| block_matches_reference(dtype));
    }
}

/// conv2d forward and backward (input, weight, bias) in `dtype` against F64, on shapes that
/// give every GEMM of the convolution odd sizes.
fn conv2d_matches_f64(dtype: DType, kernel: Kernel) {
    let o = Conv2dOptions::default();
    let cases = [
        ([3, 5, 9, 11], [7, 5, 3, 3], o.padding(1)),
        ([2, 6, 8, 7], [4, 3, 3, 2], o.groups(2).stride(2)),
        ([2, 9, 5, 6], [5, 9, 1, 1], o),
        ([1, 3, 12, 12], [8, 3, 3, 3], o.dilation(2)),
    ];
    let mut rng = Generator::new(71);
    for (ci, (xs, ws, opts)) in cases.into_iter().enumerate() {
        let what = format!("{} {dtype} {xs:?}*{ws:?}", kernel.name());
        let (x, xv) = rand_tensor(&xs, dtype, ci % 2 == 1, &mut rng);
        let (w, wv) = rand_tensor(&ws, dtype, false, &mut rng);
        let (b, bv) = rand_tensor(&[ws[0]], dtype, false, &mut rng);
        let (x, w, b) = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_());
        let y = x.conv2d(&w, Some(&b), opts).unwrap();
        assert_eq!(y.dtype(), dtype, "{what}");
        let gyv = rand_values(y.numel(), -1.0, 1.0, dtype, &mut rng);
        let gy = Tensor::from_f64_vec(gyv.clone(), y.shape(), dtype).unwrap();
        y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();

        // F64 reference and, on absolute values, the sums of |terms| for the bounds.
        let run = |abs: bool| {
            let (xr, wr, br) = (
                f64_leaf(&xv, &xs, abs),
                f64_leaf(&wv, &ws, abs),
                f64_leaf(&bv, &[ws[0]], abs),
            );
            let yr = xr.conv2d(&wr, Some(&br), opts).unwrap();
            let g = f64_leaf(&gyv, y.shape(), abs);
            yr.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64();
            [yr.to_vec_f64(), grad(&xr), grad(&wr), grad(&br)]
        };
        let (want, abs) = (run(false), run(true));
        let k = ws[1] * ws[2] * ws[3];
        let per_pixel = ws[0] / opts.groups * ws[2] * ws[3];
        let per_weight = xs[0] * y.shape()[2] * y.shape()[3];
        let got = [
            y.to_vec_f64(),
            x.grad().unwrap().to_vec_f64(),
            w.grad().unwrap().to_vec_f64(),
            b.grad().unwrap().to_vec_f64(),
        ];
        let parts = [
            ("y", k + 1, dtype),
            ("dx", per_pixel, dtype),
            ("dw", per_weight, dtype),
            ("db", per_weight, dtype),
        ];
        for (i, (name, terms, dt)) in parts.into_iter().enumerate() {
            assert_sums_close(
                &format!("{what} {name}"),
                &got[i],
                &want[i],
                &abs[i],
                terms,
                dt,
            );
        }
    }
}

#[test]
fn conv2d_on_each_kernel() {
    for dtype in [DType::BF16, DType::F16] {
        on_each_kernel(dtype, |k| conv2d_matches_f64(dtype, k));
    }
}

/// matmul of half tensors (one operand a transposed view) and its gradients against F64.
#[test]
fn matmul_on_each_kernel() {
    for dtype in [DType::BF16, DType::F16] {
        on_each_kernel(dtype, |kernel| {
            let mut rng = Generator::new(72);
            let (m, k, n) = (37, 70, 45);
            let (a, av) = rand_tensor(&[m, k], dtype, true, &mut rng);
            let (b, bv) = rand_tensor(&[k, n], dtype, false, &mut rng);
            let (a, b) = (a.requires_grad_(), b.requires_grad_());
            let y = a.matmul(&b).unwrap();
            let gv = rand_values(m * n, -1.0, 1.0, dtype, &mut rng);
            let g = Tensor::from_f64_vec(gv.clone(), &[m, n], dtype).unwrap();
            y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let run = |abs: bool| {
                let t = |v: &[f64], s: &[usize]| f64_leaf(v, s, abs);
                let (ar, br) = (t(&av, &[m, k]), t(&bv, &[k, n]));
                let yr = ar.matmul(&br).unwrap();
                yr.mul(&t(&gv, &[m, n]))
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64();
                [yr.to_vec_f64(), grad(&ar), grad(&br)]
            };
            let (want, abs) = (run(false), run(true));
            let got = [
                y.to_vec_f64(),
                a.grad().unwrap().to_vec_f64(),
                b.grad().unwrap().to_vec_f64(),
            ];
            for (i, (name, terms)) in [("y", k), ("da", n), ("db", m)].into_iter().enumerate() {
                let what = format!("{} {dtype} matmul {name}", kernel.name());
                assert_sums_close(&what, &got[i], &want[i], &abs[i], terms, dtype);
            }
        });
    }
}
