//! GPU tests of the CUDA backend's primitives against f64 references computed on the CPU.
//!
//! Every test needs a device; without one it prints `SKIPPED (no CUDA device): <name>` (and
//! why) and returns, so a CPU-only run shows what was not checked. Built with
//! `cargo test -p hemi --features cuda --test cuda`; `bench/gpu_check.sh` runs the prebuilt
//! binary on the GPU machine. Tolerances come from the dtype's unit roundoff.

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use hemi::cuda::alloc::MemoryStats;
use hemi::cuda::gemm::MatView;
use hemi::cuda::kernels::{BinaryOp, ReduceOp, UnaryOp, DTYPES};
use hemi::cuda::{cuda_available, device_count, CudaDevice};
use hemi::{DType, Error};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// The shared device (one context and one module cache for the whole binary), or `None`
/// after printing the skip line with the reason.
fn device(test: &str) -> Option<Arc<CudaDevice>> {
    static DEV: OnceLock<std::result::Result<Arc<CudaDevice>, String>> = OnceLock::new();
    match DEV.get_or_init(|| CudaDevice::new(0).map_err(|e| e.to_string())) {
        Ok(d) => Some(d.clone()),
        Err(why) => {
            println!("SKIPPED (no CUDA device): {test}");
            println!("  reason: {why}");
            None
        }
    }
}

fn rng(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// `v` rounded to `dtype` (RNE), as f64.
fn round(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

/// Unit roundoff of the storage dtype.
fn u(dtype: DType) -> f64 {
    dtype.unit_roundoff()
}

fn uniform(r: &mut Xoshiro256PlusPlus, n: usize, lo: f64, hi: f64, dtype: DType) -> Vec<f32> {
    (0..n)
        .map(|_| round(r.random_range(lo..hi), dtype) as f32)
        .collect()
}

fn check_close(what: &str, got: &[f32], want: &[f64], tol: impl Fn(f64) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol(w);
        assert!(
            ok,
            "{what}: element {i}: got {g}, want {w} (tol {})",
            tol(w)
        );
    }
}

#[test]
fn probe_reports_the_device() {
    let Some(d) = device("probe_reports_the_device") else {
        assert!(!cuda_available());
        return;
    };
    assert!(cuda_available());
    let n = device_count().unwrap();
    assert!(n >= 1);
    let e = CudaDevice::new(n).unwrap_err();
    assert!(matches!(e, Error::Device { .. }));
    assert!(e.to_string().contains(&format!("cuda:{n}")), "{e}");
    println!("device: {} (cuda:{})", d.name().unwrap(), d.ordinal());
}

#[test]
fn nvrtc_compiles_every_generated_module() {
    let Some(d) = device("nvrtc_compiles_every_generated_module") else {
        return;
    };
    d.compile_all().unwrap();
}

#[test]
fn host_device_round_trip_is_exact() {
    let Some(d) = device("host_device_round_trip_is_exact") else {
        return;
    };
    let mut r = rng(1);
    for dtype in DTYPES {
        for n in [0usize, 1, 7, 4097, 1 << 20] {
            let bytes: Vec<u8> = (0..n * dtype.size_in_bytes()).map(|_| r.random()).collect();
            let s = d.upload_bytes(dtype, &bytes).unwrap();
            assert_eq!((s.len(), s.dtype()), (n, dtype));
            assert_eq!(d.download_bytes(&s).unwrap(), bytes, "{dtype:?} n={n}");
        }
    }
    let z = d.zeros(DType::BF16, 1000).unwrap();
    assert!(d.download_f32(&z).unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn casts_round_to_nearest_even() {
    let Some(d) = device("casts_round_to_nearest_even") else {
        return;
    };
    let mut r = rng(2);
    // Random magnitudes over the whole half range, plus ties, overflow, subnormals, NaN.
    let mut xs: Vec<f32> = (0..20_000)
        .map(|_| {
            let e: i32 = r.random_range(-30..20);
            let m: f32 = r.random_range(-2.0..2.0);
            m * 2f32.powi(e)
        })
        .collect();
    xs.extend([
        0.0,
        -0.0,
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-8),
        65504.0,
        65520.0,
        1e6,
        -1e6,
        5.96e-8,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3.0e38,
    ]);
    let src = d.upload_f32(&xs, DType::F32).unwrap();
    for to in [DType::F16, DType::BF16] {
        let y = d.cast(&src, to).unwrap();
        let got = d.download_f32(&y).unwrap();
        for (x, g) in xs.iter().zip(&got) {
            let want = round(*x as f64, to) as f32;
            assert!(
                (g.is_nan() && want.is_nan()) || g.to_bits() == want.to_bits(),
                "f32 {x:e} -> {to:?}: got {g:e}, want {want:e}"
            );
        }
        // Back to F32 is exact; and across half types goes through F32 (one rounding).
        let back = d.download_f32(&d.cast(&y, DType::F32).unwrap()).unwrap();
        assert!(back
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())));
        let other = if to == DType::F16 {
            DType::BF16
        } else {
            DType::F16
        };
        let across = d.download_f32(&d.cast(&y, other).unwrap()).unwrap();
        for (v, g) in got.iter().zip(&across) {
            let want = round(*v as f64, other) as f32;
            assert!(
                (g.is_nan() && want.is_nan()) || g.to_bits() == want.to_bits(),
                "{to:?} {v} -> {other:?}"
            );
        }
    }
}

fn domain(op: UnaryOp) -> (f64, f64) {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt => (0.05, 8.0),
        UnaryOp::Exp => (-8.0, 8.0),
        _ => (-6.0, 6.0),
    }
}

#[test]
fn unary_maps_match_f64_on_strided_views() {
    let Some(d) = device("unary_maps_match_f64_on_strided_views") else {
        return;
    };
    let mut r = rng(3);
    let (rows, cols) = (37, 53);
    for dtype in DTYPES {
        for op in UnaryOp::ALL {
            let (lo, hi) = domain(op);
            let xs = uniform(&mut r, rows * cols, lo, hi, dtype);
            let x = d.upload_f32(&xs, dtype).unwrap();
            // The transposed view: [cols, rows] with strides [1, cols].
            let y = d.unary(op, &x, &[cols, rows], &[1, cols as isize]).unwrap();
            let got = d.download_f32(&y).unwrap();
            let want: Vec<f64> = (0..cols * rows)
                .map(|i| {
                    let (c, rr) = (i / rows, i % rows);
                    round(op.reference(xs[rr * cols + c] as f64), dtype)
                })
                .collect();
            // Rounded once to the dtype, after an F32 computation with a few-ulp libm error.
            check_close(&format!("{op:?} {dtype:?}"), &got, &want, |w| {
                (u(dtype) * 2.0 + 8.0 * f32::EPSILON as f64) * w.abs() + 1e-6
            });
        }
    }
}

#[test]
fn binary_maps_broadcast() {
    let Some(d) = device("binary_maps_broadcast") else {
        return;
    };
    let mut r = rng(4);
    let (p, q, s) = (3, 5, 7);
    for dtype in DTYPES {
        for op in BinaryOp::ALL {
            let av = uniform(&mut r, p * q * s, -4.0, 4.0, dtype);
            let mut bv = uniform(&mut r, q, -4.0, 4.0, dtype);
            if op == BinaryOp::Div {
                bv.iter_mut()
                    .for_each(|v| *v = if v.abs() < 0.25 { 0.5 } else { *v });
            }
            let a = d.upload_f32(&av, dtype).unwrap();
            let b = d.upload_f32(&bv, dtype).unwrap();
            // a: [p, q, s]; b: [q, 1] broadcast over p and s.
            let (shape, y) = d
                .binary(
                    op,
                    (&a, &[p, q, s], &[(q * s) as isize, s as isize, 1]),
                    (&b, &[q, 1], &[1, 1]),
                )
                .unwrap();
            assert_eq!(shape, vec![p, q, s]);
            let got = d.download_f32(&y).unwrap();
            let want: Vec<f64> = (0..p * q * s)
                .map(|i| round(op.reference(av[i] as f64, bv[(i / s) % q] as f64), dtype))
                .collect();
            check_close(&format!("{op:?} {dtype:?}"), &got, &want, |w| {
                u(dtype) * 2.0 * w.abs() + 1e-7
            });
        }
    }
    // Mismatched shapes and out-of-bounds views are errors, not launches.
    let a = d.upload_f32(&[1.0; 6], DType::F32).unwrap();
    assert!(d
        .binary(BinaryOp::Add, (&a, &[2, 3], &[3, 1]), (&a, &[4], &[1]))
        .is_err());
    assert!(d.unary(UnaryOp::Neg, &a, &[3, 3], &[3, 1]).is_err());
}

const ROW_SHAPES: [(usize, usize); 6] = [
    (1, 1),
    (64, 37),
    (10, 1024),
    (9, 1025),
    (3, 5000),
    (2000, 3),
];

#[test]
fn row_reductions_accumulate_in_f32() {
    let Some(d) = device("row_reductions_accumulate_in_f32") else {
        return;
    };
    let mut r = rng(5);
    for dtype in DTYPES {
        for (rows, cols) in ROW_SHAPES {
            let xs = uniform(&mut r, rows * cols, -2.0, 2.0, dtype);
            let x = d.upload_f32(&xs, dtype).unwrap();
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let y = d.reduce_rows(op, &x, rows, cols).unwrap();
                let got = d.download_f32(&y).unwrap();
                let mut abs_sums = Vec::new();
                let want: Vec<f64> = xs
                    .chunks(cols)
                    .map(|row| {
                        abs_sums.push(row.iter().map(|v| v.abs() as f64).sum::<f64>());
                        let v = match op {
                            ReduceOp::Sum => row.iter().map(|&v| v as f64).sum(),
                            ReduceOp::Max => {
                                row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64))
                            }
                        };
                        round(v, dtype)
                    })
                    .collect();
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    // F32 accumulation error bound, then one rounding to the dtype.
                    let tol =
                        u(dtype) * w.abs() + cols as f64 * f32::EPSILON as f64 * abs_sums[i] * 1.01;
                    let tol = if op == ReduceOp::Max { 0.0 } else { tol };
                    assert!(
                        (g as f64 - w).abs() <= tol,
                        "{op:?} {dtype:?} {rows}x{cols} row {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
    // A NaN propagates through max, as torch.max.
    let x = d.upload_f32(&[1.0, f32::NAN, 3.0], DType::F32).unwrap();
    assert!(d
        .download_f32(&d.reduce_rows(ReduceOp::Max, &x, 1, 3).unwrap())
        .unwrap()[0]
        .is_nan());
}

#[test]
fn softmax_rows_match_f64() {
    let Some(d) = device("softmax_rows_match_f64") else {
        return;
    };
    let mut r = rng(6);
    for dtype in DTYPES {
        for (rows, cols) in ROW_SHAPES {
            let xs = uniform(&mut r, rows * cols, -10.0, 10.0, dtype);
            let x = d.upload_f32(&xs, dtype).unwrap();
            let got = d
                .download_f32(&d.softmax_rows(&x, rows, cols).unwrap())
                .unwrap();
            let want: Vec<f64> = xs
                .chunks(cols)
                .flat_map(|row| {
                    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                    let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
                    let s: f64 = e.iter().sum();
                    e.into_iter().map(move |v| round(v / s, dtype))
                })
                .collect();
            // Tiny probabilities land in F16's subnormals, where one ulp is absolute.
            let ulp0 = dtype.finfo().unwrap().min_positive_subnormal;
            check_close(
                &format!("softmax {dtype:?} {rows}x{cols}"),
                &got,
                &want,
                |w| {
                    u(dtype) * 2.0 * w.abs()
                        + (cols as f64 + 8.0) * f32::EPSILON as f64 * w.abs()
                        + ulp0
                },
            );
            for row in got.chunks(cols) {
                let s: f64 = row.iter().map(|&v| v as f64).sum();
                assert!(
                    (s - 1.0).abs() <= cols as f64 * u(dtype) + 1e-5,
                    "row sum {s}"
                );
            }
        }
    }
}

#[test]
fn fused_unscale_multiplies_in_f32_and_flags_non_finite() {
    let Some(d) = device("fused_unscale_multiplies_in_f32_and_flags_non_finite") else {
        return;
    };
    let mut r = rng(7);
    let inv = 1.0f32 / 1024.0;
    let inv_scale = d.upload_f32(&[inv], DType::F32).unwrap();
    let sizes = [
        (DType::F16, 1),
        (DType::F16, 70_000),
        (DType::BF16, 333),
        (DType::F32, 5000),
        (DType::BF16, 0),
    ];
    let hosts: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&(dt, n)| uniform(&mut r, n, -60000.0, 60000.0, dt))
        .collect();
    let grads: Vec<_> = sizes
        .iter()
        .zip(&hosts)
        .map(|(&(dt, _), h)| d.upload_f32(h, dt).unwrap())
        .collect();
    let found = d.zeros(DType::F32, 1).unwrap();
    let refs: Vec<_> = grads.iter().collect();
    d.unscale_and_check_finite(&refs, &inv_scale, &found)
        .unwrap();
    assert_eq!(
        d.download_f32(&found).unwrap(),
        vec![0.0],
        "all finite: flag stays 0"
    );
    for ((g, h), &(dt, _)) in grads.iter().zip(&hosts).zip(&sizes) {
        let got = d.download_f32(g).unwrap();
        for (x, y) in h.iter().zip(&got) {
            let want = round((*x * inv) as f64, dt) as f32;
            assert_eq!(y.to_bits(), want.to_bits(), "{dt:?}: {x} * inv");
        }
    }
    // One inf in one tensor (and a NaN in another run) sets the flag.
    for bad in [f32::INFINITY, f32::NAN] {
        let mut h = hosts[2].clone();
        h[200] = bad;
        let g = d.upload_f32(&h, DType::BF16).unwrap();
        let found = d.zeros(DType::F32, 1).unwrap();
        d.unscale_and_check_finite(&[&grads[1], &g], &inv_scale, &found)
            .unwrap();
        assert_eq!(d.download_f32(&found).unwrap(), vec![1.0], "{bad}");
    }
    let wrong = d.zeros(DType::F16, 1).unwrap();
    assert!(d.unscale_and_check_finite(&refs, &wrong, &found).is_err());
}

#[test]
fn cublas_gemm_with_half_inputs_and_f32_accumulation() {
    let Some(d) = device("cublas_gemm_with_half_inputs_and_f32_accumulation") else {
        return;
    };
    let mut r = rng(8);
    for in_dt in [DType::F16, DType::BF16] {
        for out_dt in [in_dt, DType::F32] {
            for &(batch, m, k, n, ta, tb) in &[
                (1, 33, 65, 17, false, false),
                (3, 31, 129, 19, true, false),
                (2, 8, 300, 9, false, true),
                (4, 1, 77, 40, true, true),
            ] {
                let av = uniform(&mut r, batch * m * k, -1.0, 1.0, in_dt);
                let bv = uniform(&mut r, batch * k * n, -1.0, 1.0, in_dt);
                let a = d.upload_f32(&av, in_dt).unwrap();
                let b = d.upload_f32(&bv, in_dt).unwrap();
                // A stored as [batch, m, k] or, transposed, as [batch, k, m] viewed as m x k.
                let a_view = if ta {
                    MatView {
                        batch_stride: (m * k) as i64,
                        ..MatView::contiguous(k, m).t()
                    }
                } else {
                    MatView::contiguous(m, k)
                };
                let b_view = if tb {
                    MatView {
                        batch_stride: (k * n) as i64,
                        ..MatView::contiguous(n, k).t()
                    }
                } else {
                    MatView::contiguous(k, n)
                };
                let a_at = |p: usize, i: usize, l: usize| if ta { av[p * m * k + l * m + i] } else { av[p * m * k + i * k + l] } as f64;
                let b_at = |p: usize, l: usize, j: usize| if tb { bv[p * k * n + j * k + l] } else { bv[p * k * n + l * n + j] } as f64;
                let c = d.zeros(out_dt, batch * m * n).unwrap();
                d.gemm(
                    (&a, a_view),
                    (&b, b_view),
                    (&c, MatView::contiguous(m, n)),
                    batch,
                )
                .unwrap();
                let got = d.download_f32(&c).unwrap();
                for p in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let (mut want, mut absd) = (0.0, 0.0);
                            for l in 0..k {
                                want += a_at(p, i, l) * b_at(p, l, j);
                                absd += (a_at(p, i, l) * b_at(p, l, j)).abs();
                            }
                            let want = round(want, out_dt);
                            let g = got[p * m * n + i * n + j] as f64;
                            let tol =
                                u(out_dt) * want.abs() + k as f64 * f32::EPSILON as f64 * absd;
                            assert!((g - want).abs() <= tol, "{in_dt:?}->{out_dt:?} b{batch} {m}x{k}x{n} t{ta}{tb} [{p},{i},{j}]: {g} vs {want}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn allocator_reuses_memory_across_training_steps() {
    if device("allocator_reuses_memory_across_training_steps").is_none() {
        return;
    }
    // Its own device object: a private allocator, untouched by tests running in parallel.
    let d = CudaDevice::new(0).unwrap();
    let step = || {
        let acts: Vec<_> = [3 << 20, 600_000, 150_000, 4_000]
            .iter()
            .map(|&n| d.zeros(DType::F16, n).unwrap())
            .collect();
        let g: Vec<_> = acts
            .iter()
            .map(|a| d.zeros(DType::F32, a.len() / 2 + 1).unwrap())
            .collect();
        drop(acts);
        drop(g);
    };
    step();
    d.synchronize().unwrap();
    let first: MemoryStats = d.memory_stats();
    for _ in 0..10 {
        step();
    }
    d.synchronize().unwrap();
    let s = d.memory_stats();
    assert_eq!(
        s.raw_mallocs, first.raw_mallocs,
        "steps 2..11 called cuMemAlloc: {s}"
    );
    assert_eq!(s.peak_reserved, first.peak_reserved);
    println!("allocator after 11 steps: {s}");
}
mod unit;
