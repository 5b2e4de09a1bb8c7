//! The ops that multiply half-precision tensors through `cpu::gemm::blocked` (conv2d, the fused
//! conv block, matmul) on every GEMM kernel this CPU can run, forced one at a time: on a CPU
//! without AVX-512 BF16 the BF16-pair packing that `avx512bf16` reads is still exercised with
//! the views these ops pass (transposed weights, column matrices side by side), through
//! `portable-bf16-pairs`, which reads the same panels. Each result is checked against F64
//! with the F32 summation bound (`assert_sums_close`).
//!
//! F32 products take the same route where `select::f32_kernel` names a kernel (a forced
//! F32-panel kernel, or `avx512f` on CPUs with AVX-512 F), so the F32 ops run on every
//! F32-panel kernel too. Below them, the F32-panel kernels straight through `gemm_with`
//! against F64 on odd sizes and strided views, `avx512f` against its plain-Rust twin
//! `portable-wide` bit for bit, and the route `cpu::gemm::product` takes for F32.
//!
//! The kernel choice is process-wide, so the tests that force one run each in a process of
//! its own (`alone`); no test of this binary forces one in its main process.

use crate::alone::alone;
use crate::common::block::block_matches_reference;
use crate::common::*;
use hemi::cpu::gemm::blocked::{gemm, gemm_with};
use hemi::cpu::gemm::select::{f32_kernel, force_kernel, kernel_for, kernel_name, Kernel};
use hemi::cpu::gemm::{matmul_into, product, MatRef};
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};

/// Runs `f(kernel)` with each kernel this CPU has that takes `dtype` × `dtype` forced.
fn on_each_kernel(dtype: DType, f: impl Fn(Kernel)) {
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
        if dtype == DType::F32 {
            assert_eq!(f32_kernel(9, 9, 9), Some(k), "F32 products take it too");
        }
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
    alone(|| {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            on_each_kernel(dtype, |_| block_matches_reference(dtype));
        }
    });
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
    alone(|| {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            on_each_kernel(dtype, |k| conv2d_matches_f64(dtype, k));
        }
    });
}

/// matmul of half tensors (one operand a transposed view) and its gradients against F64.
#[test]
fn matmul_on_each_kernel() {
    alone(|| {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
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
    });
}

// ----- the F32-panel kernels straight through `gemm_with` ------------------------------------

/// A random `rows x cols` F32 matrix in a buffer of its own, and its view: row-major,
/// transposed (column-major), or with padded rows and every other column (neither stride
/// 1). Buffer elements outside the view are NaN, so a read past the view shows.
fn f32_view(
    rows: usize,
    cols: usize,
    layout: usize,
    rng: &mut Generator,
) -> (Vec<f32>, [isize; 2]) {
    let (len, rs, cs) = match layout % 3 {
        0 => (rows * cols, cols, 1),
        1 => (rows * cols, 1, rows),
        _ => (rows * (2 * cols + 3), 2 * cols + 3, 2),
    };
    let mut buf = vec![f32::NAN; len.max(1)];
    for i in 0..rows {
        for j in 0..cols {
            buf[i * rs + j * cs] = rng.uniform(-1.0, 1.0) as f32;
        }
    }
    (buf, [rs as isize, cs as isize])
}

fn view(buf: &[f32], rows: usize, cols: usize, [rs, cs]: [isize; 2]) -> MatRef<'_, f32> {
    MatRef {
        data: buf,
        rows,
        cols,
        rs,
        cs,
    }
}

/// `like`'s view on another buffer of the same length.
fn same_view<'a, T>(data: &'a [T], like: &MatRef<'_, f32>) -> MatRef<'a, T> {
    assert_eq!(data.len(), like.data.len());
    MatRef {
        data,
        rows: like.rows,
        cols: like.cols,
        rs: like.rs,
        cs: like.cs,
    }
}

/// Sizes that are no multiple of any tile (6×16, 8×32, 14×32), k past every KC (256, 512)
/// with uneven blocks, m past MC, n past one B panel, and a transposed / strided operand.
const F32_CASES: [(usize, usize, usize); 6] = [
    (1, 1, 1),
    (13, 7, 45),
    (9, 531, 33),
    (37, 300, 70),
    (270, 19, 29),
    (17, 1029, 2),
];

/// `dst (= 0.25 | += into 0.25) + a·b` on `kernel`, checked against F64:
/// |err| <= 2·(k + 2)·u·Σ|terms| with u = 2^-24 (F32 sums in any order with or without FMA
/// err by at most γ_{k+1}·Σ|terms|, Higham §3.1; the start value adds one more term).
#[test]
fn f32_panel_kernels_match_f64_on_views() {
    let mut rng = Generator::new(73);
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| k.is_available() && k.accepts(DType::F32, DType::F32))
        .collect();
    for kernel in kernels {
        for (ci, &(m, k, n)) in F32_CASES.iter().enumerate() {
            for accumulate in [false, true] {
                let (abuf, asd) = f32_view(m, k, ci, &mut rng);
                let (bbuf, bsd) = f32_view(k, n, ci + 1 + usize::from(accumulate), &mut rng);
                let (a, b) = (view(&abuf, m, k, asd), view(&bbuf, k, n, bsd));
                let mut dst = vec![0.25f32; m * n];
                gemm_with(kernel, &mut dst, a, b, accumulate, true);
                let at = |v: &MatRef<'_, f32>, i: usize, j: usize| {
                    f64::from(v.data[(i as isize * v.rs + j as isize * v.cs) as usize])
                };
                for i in 0..m {
                    for j in 0..n {
                        let start = if accumulate { 0.25 } else { 0.0 };
                        let (mut want, mut abs) = (start, start);
                        for p in 0..k {
                            let t = at(&a, i, p) * at(&b, p, j);
                            want += t;
                            abs += t.abs();
                        }
                        let tol = 2.0 * (k as f64 + 2.0) * f64::powi(2.0, -24) * abs;
                        let got = f64::from(dst[i * n + j]);
                        assert!(
                            (got - want).abs() <= tol,
                            "{} {m}x{k}x{n} acc {accumulate}: ({i}, {j}) got {got}, want \
                             {want} (tol {tol:e})",
                            kernel.name()
                        );
                    }
                }
            }
        }
    }
}

/// `avx512f` and `portable-wide` share the packing and sum every element in the same order
/// with one rounding per multiply-add, so they agree to the bit; also on F16 / BF16 operands
/// (converted exactly while packing). Skipped where the CPU lacks AVX-512 F.
#[test]
fn avx512f_equals_its_portable_twin_bit_for_bit() {
    if !Kernel::Avx512F32.is_available() {
        println!("no AVX-512 F here: avx512f not run");
        return;
    }
    let mut rng = Generator::new(74);
    for (ci, &(m, k, n)) in F32_CASES.iter().enumerate() {
        for accumulate in [false, true] {
            let (abuf, asd) = f32_view(m, k, ci + 2, &mut rng);
            let (bbuf, bsd) = f32_view(k, n, ci, &mut rng);
            let (a, b) = (view(&abuf, m, k, asd), view(&bbuf, k, n, bsd));
            let run = |kernel| {
                let mut dst: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.125).collect();
                gemm_with(kernel, &mut dst, a, b, accumulate, true);
                dst
            };
            let (fast, twin) = (run(Kernel::Avx512F32), run(Kernel::PortableF32Wide));
            for (i, (x, y)) in fast.iter().zip(&twin).enumerate() {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "{m}x{k}x{n} acc {accumulate}: element {i}: {x} vs {y}"
                );
            }
            // Half operands: the A buffer as F16 and the B buffer as BF16, same views.
            let ah: Vec<half::f16> = abuf.iter().map(|&x| half::f16::from_f32(x)).collect();
            let bb: Vec<half::bf16> = bbuf.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let (ah, bb) = (same_view(&ah, &a), same_view(&bb, &b));
            let run = |kernel| {
                let mut dst = vec![0.5f32; m * n];
                gemm_with(kernel, &mut dst, ah, bb, accumulate, true);
                dst
            };
            let (fast, twin) = (run(Kernel::Avx512F32), run(Kernel::PortableF32Wide));
            assert!(
                fast.iter()
                    .zip(&twin)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{k}x{n} acc {accumulate}: F16 x BF16 differ"
            );
        }
    }
}

/// `cpu::gemm::product` on F32 operands runs the kernel `f32_kernel` names (bit for bit its
/// `gemm_with`), else the `gemm` crate (bit for bit `matmul_into`); F64 always the latter.
#[test]
fn f32_products_take_the_route_f32_kernel_names() {
    let mut rng = Generator::new(75);
    // Small and skinny products stay on the gemm crate, larger ones go to avx512f where the
    // CPU has it (the last two; the message names the route).
    let shapes = F32_CASES[1..]
        .iter()
        .chain(&[(67, 300, 250), (129, 40, 1000)]);
    for &(m, k, n) in shapes {
        let (abuf, asd) = f32_view(m, k, 1, &mut rng);
        let (bbuf, bsd) = f32_view(k, n, 0, &mut rng);
        let (a, b) = (view(&abuf, m, k, asd), view(&bbuf, k, n, bsd));
        let mut got = vec![0f32; m * n];
        product(&mut got, a, b, false, true);
        let mut want = vec![0f32; m * n];
        match f32_kernel(m, k, n) {
            Some(kernel) => gemm_with(kernel, &mut want, a, b, false, true),
            None => matmul_into(&mut want, a, b, false),
        }
        let route = f32_kernel(m, k, n).map_or("gemm crate", |k| k.name());
        println!("{m}x{k}x{n}: {route}");
        assert!(
            got.iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{m}x{k}x{n}: product differs from {route}"
        );
        let (a64, b64): (Vec<f64>, Vec<f64>) = (
            abuf.iter().map(|&x| f64::from(x)).collect(),
            bbuf.iter().map(|&x| f64::from(x)).collect(),
        );
        let (a64, b64) = (same_view(&a64, &a), same_view(&b64, &b));
        let (mut got, mut want) = (vec![0f64; m * n], vec![0f64; m * n]);
        product(&mut got, a64, b64, false, true);
        matmul_into(&mut want, a64, b64, false);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{m}x{k}x{n}: F64 product left the gemm crate"
        );
    }
}

/// Where the CPU has AVX-512 F, `avx512f` takes the products it was measured faster on
/// (squares, ResNet-20's per-image convolution products forward, input and weight
/// gradient, and their batched forms) and leaves those it loses on to the gemm crate
/// (matrix-vector, a 10-class classifier's, tiny ones). Elsewhere nothing changes route.
#[test]
fn f32_route_follows_the_measurements() {
    let fast = Kernel::Avx512F32
        .is_available()
        .then_some(Kernel::Avx512F32);
    let wins = [
        (256, 256, 256),
        (2048, 2048, 2048),
        (16, 27, 1024),
        (16, 144, 1024),
        (32, 288, 256),
        (64, 576, 64),
        (144, 16, 1024),
        (576, 64, 64),
        (16, 1024, 27),
        (16, 1024, 144),
        (64, 64, 576),
        (16, 144, 131072),
        (16, 131072, 144),
    ];
    for (m, k, n) in wins {
        assert_eq!(f32_kernel(m, k, n), fast, "{m}x{k}x{n}");
    }
    let losses = [
        (1, 1024, 1024),
        (1024, 1024, 1),
        (128, 64, 10),
        (512, 256, 16),
        (16, 256, 48),
        (32, 32, 32),
    ];
    for (m, k, n) in losses {
        assert_eq!(f32_kernel(m, k, n), None, "{m}x{k}x{n}");
    }
}

/// Products with F16 (or mixed F16/BF16/F32) operands run on `avx512f` where the CPU has it
/// and the shape suits its tiles, else on `select_kernel`'s choice (`avx2-fma` or
/// `portable`); BF16 × BF16 keeps its own kernel where it multiplies pairs, else widens as
/// F16 does (`Bf16Route`). `gemm` follows `kernel_for` bit for bit.
#[test]
fn half_products_take_the_wide_kernel_where_it_suits() {
    let wide = Kernel::Avx512F32.is_available();
    let narrow = kernel_name(DType::F16, DType::F16);
    for (a, b) in [
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F16),
    ] {
        let big = kernel_for(a, b, 64, 576, 1024);
        assert_eq!(
            big.name(),
            if wide { "avx512f" } else { narrow },
            "{a:?} x {b:?}"
        );
        assert_eq!(kernel_for(a, b, 32, 32, 32).name(), narrow, "{a:?} x {b:?}");
    }
    // BF16 pairs (`avx512bf16`, AMX) keep their kernel; widened BF16 goes wide as F16 does.
    let bf16 = kernel_name(DType::BF16, DType::BF16);
    let widened = bf16 == narrow;
    assert_eq!(
        kernel_for(DType::BF16, DType::BF16, 64, 576, 1024).name(),
        if widened && wide { "avx512f" } else { bf16 }
    );
    let mut rng = Generator::new(76);
    for (m, k, n) in [(64, 300, 1000), (33, 40, 17)] {
        let av = rand_values(m * k, -1.0, 1.0, DType::F16, &mut rng);
        let bv = rand_values(k * n, -1.0, 1.0, DType::F16, &mut rng);
        let ah: Vec<half::f16> = av.iter().map(|&x| half::f16::from_f64(x)).collect();
        let bh: Vec<half::f16> = bv.iter().map(|&x| half::f16::from_f64(x)).collect();
        let a = MatRef::row_major(&ah, m, k);
        let b = MatRef::row_major(&bh, k, n);
        let (mut got, mut want) = (vec![0f32; m * n], vec![0f32; m * n]);
        gemm(&mut got, a, b, false, true);
        let kernel = kernel_for(DType::F16, DType::F16, m, k, n);
        gemm_with(kernel, &mut want, a, b, false, true);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{m}x{k}x{n}: gemm differs from {}",
            kernel.name()
        );
    }
}

/// `amx-bf16` and `portable-amx` read the same panels. On small integers every partial sum
/// is exact in F32 (|sum| < 2^24), so whatever order the hardware adds in, the two agree to
/// the bit, and a misplaced, dropped or doubled element of any panel shows; on random values
/// they agree within the F32 summation bound (each is checked against F64 in
/// `tests/kernels/gemm_half.rs`). Every layout, k past a block (512) and odd, edge tiles (m, n no
/// multiples of 32), accumulating or not. Skipped where the CPU or the OS gives no AMX.
#[test]
fn amx_agrees_with_its_portable_twin() {
    if !Kernel::AmxBf16.is_available() {
        println!("no usable AMX here: amx-bf16 not run");
        return;
    }
    let mut rng = Generator::new(76);
    let cases = [
        (1, 1, 1),
        (33, 31, 47),
        (64, 64, 64),
        (70, 1100, 40),
        (300, 97, 65),
        (5, 2049, 3),
    ];
    for (ci, &(m, k, n)) in cases.iter().enumerate() {
        for accumulate in [false, true] {
            for integers in [true, false] {
                let (mut abuf, asd) = f32_view(m, k, ci, &mut rng);
                let (mut bbuf, bsd) = f32_view(k, n, ci + 1 + usize::from(accumulate), &mut rng);
                if integers {
                    for x in abuf.iter_mut().chain(bbuf.iter_mut()) {
                        *x = (*x * 8.0).round();
                    }
                }
                let ab: Vec<half::bf16> = abuf.iter().map(|&x| half::bf16::from_f32(x)).collect();
                let bb: Vec<half::bf16> = bbuf.iter().map(|&x| half::bf16::from_f32(x)).collect();
                let (a, b) = (view(&abuf, m, k, asd), view(&bbuf, k, n, bsd));
                let (ab, bb) = (same_view(&ab, &a), same_view(&bb, &b));
                let run = |kernel| {
                    let mut dst: Vec<f32> = (0..m * n).map(|i| (i % 64) as f32).collect();
                    gemm_with(kernel, &mut dst, ab, bb, accumulate, true);
                    dst
                };
                let (fast, twin) = (run(Kernel::AmxBf16), run(Kernel::PortableAmx));
                for (idx, (x, y)) in fast.iter().zip(&twin).enumerate() {
                    let (i, j) = (idx / n, idx % n);
                    let mut abs = if accumulate { (idx % 64) as f64 } else { 0.0 };
                    for p in 0..k {
                        let at = |v: &MatRef<'_, half::bf16>, r: usize, c: usize| {
                            f64::from(v.data[(r as isize * v.rs + c as isize * v.cs) as usize])
                        };
                        abs += (at(&ab, i, p) * at(&bb, p, j)).abs();
                    }
                    let tol = if integers {
                        0.0
                    } else {
                        4.0 * (k as f64 + 2.0) * f64::powi(2.0, -24) * abs
                    };
                    assert!(
                        (f64::from(*x) - f64::from(*y)).abs() <= tol,
                        "{m}x{k}x{n} acc {accumulate} integers {integers} layouts {asd:?} \
                         {bsd:?}: ({i}, {j}): {x} vs {y}"
                    );
                }
            }
        }
    }
}

/// The BF16-pair kernels run 8-row tiles where that pads m less than 14 rows do (16, 32, 64:
/// convolutions' channel counts) and 14-row tiles elsewhere (9, 14, 67); every element sums
/// its pair steps in the same order either way, so `avx512bf16` equals its portable twin to
/// the bit on both heights and on partial tiles (normal random values: no subnormal sums for
/// `vdpbf16ps` to flush), and both match F64 within the F32 summation bound.
#[test]
fn bf16_pair_tiles_of_both_heights_agree_with_the_twin_and_f64() {
    let mut rng = Generator::new(77);
    for (m, k, n) in [
        (16, 144, 1024),
        (32, 37, 70),
        (64, 577, 33),
        (9, 40, 65),
        (14, 300, 31),
        (67, 9, 32),
    ] {
        let av = rand_values(m * k, -1.0, 1.0, DType::BF16, &mut rng);
        let bv = rand_values(k * n, -1.0, 1.0, DType::BF16, &mut rng);
        let ah: Vec<half::bf16> = av.iter().map(|&x| half::bf16::from_f64(x)).collect();
        let bh: Vec<half::bf16> = bv.iter().map(|&x| half::bf16::from_f64(x)).collect();
        let (a, b) = (MatRef::row_major(&ah, m, k), MatRef::row_major(&bh, k, n));
        let mut twin = vec![0f32; m * n];
        gemm_with(Kernel::PortableBf16Pairs, &mut twin, a, b, false, false);
        for i in 0..m {
            for j in 0..n {
                let (mut want, mut abs) = (0f64, 0f64);
                for p in 0..k {
                    let t = ah[i * k + p].to_f64() * bh[p * n + j].to_f64();
                    want += t;
                    abs += t.abs();
                }
                let tol = 2.0 * (k as f64 + 1.0) * f64::powi(2.0, -24) * abs;
                let got = f64::from(twin[i * n + j]);
                assert!(
                    (got - want).abs() <= tol,
                    "{m}x{k}x{n} ({i}, {j}): {got} vs {want}"
                );
            }
        }
        if Kernel::Avx512Bf16.is_available() {
            let mut simd = vec![0f32; m * n];
            gemm_with(Kernel::Avx512Bf16, &mut simd, a, b, false, true);
            let same = simd
                .iter()
                .zip(&twin)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{m}x{k}x{n}: avx512bf16 differs from portable-bf16-pairs"
            );
        }
    }
}
