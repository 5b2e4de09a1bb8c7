//! hemi's own GEMM (`cpu::gemm::blocked`) against a plain f64 product of the exactly represented
//! inputs, for every kernel this CPU can run (the portable kernels of both packed formats
//! always run), every operand dtype pair a kernel takes, odd sizes around the blocking
//! parameters, transposed and strided views, and accumulate on and off.

use half::{bf16, f16};
use hemi::cpu::conv::im2col::im2col;
use hemi::cpu::conv::{conv_out_size, Conv2dGeom};
use hemi::cpu::gemm::blocked::{
    gemm, gemm_packed, gemm_round, gemm_unfold, gemm_unfold_packed, gemm_unfold_pairs,
    gemm_unfold_pairs_packed, gemm_with, rounds_in_tiles,
};
use hemi::cpu::gemm::pack::PackedA;
use hemi::cpu::gemm::select::{kernel_name, select_kernel, Bf16Route, Kernel};
use hemi::cpu::gemm::unfold::Unfold;
use hemi::cpu::gemm::{matmul_into, matmul_reference, MatRef};
use hemi::dtype::WithDType;
use hemi::{DType, Generator};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// An operand's buffer in the dtype under test.
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// How a test matrix sits in its buffer.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Row-major, contiguous.
    RowMajor,
    /// The transpose of a row-major buffer (`.t()`): column-major, rs = 1.
    Transposed,
    /// Row-major with padded rows: rs = cols + 3, cs = 1.
    Padded,
    /// Neither stride 1: rs = 2·cols + 1, cs = 2.
    Strided,
}

const LAYOUTS: [Layout; 4] = [
    Layout::RowMajor,
    Layout::Transposed,
    Layout::Padded,
    Layout::Strided,
];

/// A random matrix: its buffer, its view, and the exact value of every buffer element.
/// Buffer elements outside the view are NaN, so a kernel that reads past the view fails.
struct Mat {
    store: Store,
    exact: Vec<f64>,
    layout: Layout,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

impl Mat {
    fn random(rows: usize, cols: usize, dtype: DType, layout: Layout, rng: &mut Generator) -> Mat {
        let (len, rs, cs) = match layout {
            Layout::RowMajor => (rows * cols, cols, 1),
            Layout::Transposed => (rows * cols, 1, rows),
            Layout::Padded => (rows * (cols + 3), cols + 3, 1),
            Layout::Strided => (rows * (2 * cols + 1), 2 * cols + 1, 2),
        };
        let mut exact = vec![f64::NAN; len.max(1)];
        for i in 0..rows {
            for j in 0..cols {
                exact[i * rs + j * cs] = rng.uniform(-1.0, 1.0);
            }
        }
        // Round into the dtype; keep the rounded values as the exact inputs.
        let store = match dtype {
            DType::F32 => Store::F32(exact.iter().map(|&x| x as f32).collect()),
            DType::F16 => Store::F16(exact.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => Store::BF16(exact.iter().map(|&x| bf16::from_f64(x)).collect()),
            _ => unreachable!(),
        };
        let exact = match &store {
            Store::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Store::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Store::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
        };
        Mat {
            store,
            exact,
            layout,
            rows,
            cols,
            rs: rs as isize,
            cs: cs as isize,
        }
    }

    /// The view of `data` (this operand's stored values) with this operand's layout.
    fn view<'a, T>(&self, data: &'a [T]) -> MatRef<'a, T> {
        match self.layout {
            // Through the API's own transpose.
            Layout::Transposed => MatRef::row_major(data, self.cols, self.rows).t(),
            _ => MatRef {
                data,
                rows: self.rows,
                cols: self.cols,
                rs: self.rs,
                cs: self.cs,
            },
        }
    }

    /// `gemm_with` on `self` · `b`, each operand as stored.
    fn gemm_with(&self, b: &Self, kernel: Kernel, dst: &mut [f32], acc: bool, par: bool) {
        match &self.store {
            Store::F32(v) => b.gemm_rhs(self.view(v), kernel, dst, acc, par),
            Store::F16(v) => b.gemm_rhs(self.view(v), kernel, dst, acc, par),
            Store::BF16(v) => b.gemm_rhs(self.view(v), kernel, dst, acc, par),
        }
    }

    fn gemm_rhs<A: WithDType>(
        &self,
        a: MatRef<'_, A>,
        kernel: Kernel,
        dst: &mut [f32],
        acc: bool,
        par: bool,
    ) {
        match &self.store {
            Store::F32(v) => gemm_with(kernel, dst, a, self.view(v), acc, par),
            Store::F16(v) => gemm_with(kernel, dst, a, self.view(v), acc, par),
            Store::BF16(v) => gemm_with(kernel, dst, a, self.view(v), acc, par),
        }
    }

    /// `gemm_packed` on `self` packed for `kernel` (`PackedA`) · `b` as stored.
    fn gemm_packed(&self, b: &Self, kernel: Kernel, dst: &mut [f32], acc: bool, par: bool) {
        let packed = match &self.store {
            Store::F32(v) => PackedA::new(kernel, self.view(v)),
            Store::F16(v) => PackedA::new(kernel, self.view(v)),
            Store::BF16(v) => PackedA::new(kernel, self.view(v)),
        };
        assert_eq!(packed.shape(), (self.rows, self.cols));
        assert_eq!(packed.kernel(), kernel);
        match &b.store {
            Store::F32(v) => gemm_packed(dst, &packed, b.view(v), acc, par),
            Store::F16(v) => gemm_packed(dst, &packed, b.view(v), acc, par),
            Store::BF16(v) => gemm_packed(dst, &packed, b.view(v), acc, par),
        }
    }

    fn exact_view(&self) -> MatRef<'_, f64> {
        MatRef {
            data: &self.exact,
            rows: self.rows,
            cols: self.cols,
            rs: self.rs,
            cs: self.cs,
        }
    }
}

/// One product case.
#[derive(Clone, Copy, Debug)]
struct Case {
    m: usize,
    k: usize,
    n: usize,
    a_dtype: DType,
    b_dtype: DType,
    a_layout: Layout,
    b_layout: Layout,
    accumulate: bool,
    parallel: bool,
}

/// Runs one case with `kernel` and checks every element; returns the result for callers
/// that compare runs.
fn check(kernel: Kernel, case: Case, rng: &mut Generator) -> Vec<f32> {
    let Case { m, k, n, .. } = case;
    let a = Mat::random(m, k, case.a_dtype, case.a_layout, rng);
    let b = Mat::random(k, n, case.b_dtype, case.b_layout, rng);
    // Accumulate onto random values; otherwise start from NaN, which must be overwritten.
    let c0: Vec<f32> = (0..m * n)
        .map(|_| {
            if case.accumulate {
                rng.uniform(-1.0, 1.0) as f32
            } else {
                f32::NAN
            }
        })
        .collect();
    let mut got = c0.clone();
    a.gemm_with(&b, kernel, &mut got, case.accumulate, case.parallel);

    let want = matmul_reference(a.exact_view(), b.exact_view());
    // Σ_p |a_ip|·|b_pj|: the same product on absolute values (NaN gaps stay outside views).
    let abs = |v: &[f64]| -> Vec<f64> { v.iter().map(|x| x.abs()).collect() };
    let (a_abs, b_abs) = (abs(&a.exact), abs(&b.exact));
    let abs_sum = matmul_reference(
        MatRef {
            data: &a_abs,
            ..a.exact_view()
        },
        MatRef {
            data: &b_abs,
            ..b.exact_view()
        },
    );
    for i in 0..m {
        for j in 0..n {
            let idx = i * n + j;
            let (start, start_abs) = if case.accumulate {
                (f64::from(c0[idx]), f64::from(c0[idx]).abs())
            } else {
                (0.0, 0.0)
            };
            let w = start + want[idx];
            // Tolerance: the inputs are exact in f64, so the only errors are the kernel's F32
            // roundings. Each of the k + 1 terms (k products and the start value) is added to
            // an F32 sum once; a product is rounded at most once more (exact with FMA and for
            // BF16×BF16). Recursive summation in any order and grouping (k blocks, pairs) has
            // |error| <= γ_{k+1} · Σ|terms|, γ_n = n·u / (1 − n·u), u = 2^-24 (Higham,
            // "Accuracy and Stability of Numerical Algorithms", §3.1 and §4.2); the product
            // roundings add u per term. So 2·(k+2)·u·Σ|terms| bounds it with room to spare,
            // while a dropped or doubled term, or one from a wrong row, is far larger.
            let tol = 2.0 * (k as f64 + 2.0) * f64::powi(2.0, -24) * (abs_sum[idx] + start_abs);
            let g = f64::from(got[idx]);
            assert!(
                (g - w).abs() <= tol + 1e-30,
                "{} {case:?}: ({i}, {j}) got {g}, want {w} (tol {tol:e})",
                kernel.name()
            );
        }
    }
    got
}

/// The kernels this CPU can run, printed so a test log shows which ran.
fn kernels() -> Vec<Kernel> {
    let ks: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect();
    let names: Vec<&str> = ks.iter().map(|k| k.name()).collect();
    println!("gemm_half kernels run: {names:?}");
    ks
}

/// The dtype pairs a kernel takes: all nine for the F32-panel kernels, BF16×BF16 for the
/// pair kernels.
fn dtype_pairs(kernel: Kernel) -> Vec<(DType, DType)> {
    let mut pairs = Vec::new();
    for a in DTYPES {
        for b in DTYPES {
            if kernel.accepts(a, b) {
                pairs.push((a, b));
            }
        }
    }
    pairs
}

#[test]
fn small_shapes_every_layout() {
    let mut rng = Generator::new(1);
    let shapes = [
        (1, 1, 1),
        (1, 7, 1),
        (3, 3, 3),
        (3, 1, 17),
        (17, 2, 3),
        (7, 5, 33),
    ];
    for kernel in kernels() {
        for (a_dtype, b_dtype) in dtype_pairs(kernel) {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                for a_layout in LAYOUTS {
                    for b_layout in LAYOUTS {
                        let case = Case {
                            m,
                            k,
                            n,
                            a_dtype,
                            b_dtype,
                            a_layout,
                            b_layout,
                            accumulate: s % 2 == 1,
                            parallel: false,
                        };
                        check(kernel, case, &mut rng);
                    }
                }
            }
        }
    }
}

#[test]
fn odd_sizes_across_block_edges() {
    // KC is 512 (F32 panels) or 384 (pairs), MC 144 or 336, NC 2048; MR×NR is 6×16 or 14×32.
    // Sizes straddle each: partial tiles, odd k, k > KC (balanced k blocks), m > MC, n > NC.
    let shapes = [
        (17, 33, 67),
        (67, 17, 3),
        (130, 67, 33),
        (33, 130, 17),
        (3, 600, 5),
        (29, 257, 31),
        (150, 513, 40),
        (340, 31, 37),
        (5, 9, 2100),
        (9, 1030, 7),
    ];
    let mut rng = Generator::new(2);
    for kernel in kernels() {
        for (d, (a_dtype, b_dtype)) in dtype_pairs(kernel).into_iter().enumerate() {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                let case = Case {
                    m,
                    k,
                    n,
                    a_dtype,
                    b_dtype,
                    a_layout: LAYOUTS[(s + d) % 4],
                    b_layout: LAYOUTS[(s / 2 + d) % 4],
                    accumulate: (s + d) % 2 == 0,
                    parallel: false,
                };
                check(kernel, case, &mut rng);
            }
        }
    }
}

/// A packed once (`PackedA`) and reused gives the bits of packing it in every product, which
/// `check` holds to F64: every kernel and dtype pair, all four layouts of A, partial tiles,
/// several k blocks (k > KC), m > MC, accumulate on and off, split among threads or not
/// (rows split into tasks read panels from the middle of the packed blocks).
#[test]
fn packed_a_gives_the_bits_of_packing_per_product() {
    let shapes = [
        (1, 1, 1),
        (17, 33, 67),
        (67, 1100, 70),
        (150, 513, 40),
        (340, 31, 37),
        (64, 576, 64),
        (16, 144, 1024),
    ];
    let mut rng = Generator::new(5);
    let mut ran = 0;
    for kernel in kernels() {
        for (d, (a_dtype, b_dtype)) in dtype_pairs(kernel).into_iter().enumerate() {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                let case = Case {
                    m,
                    k,
                    n,
                    a_dtype,
                    b_dtype,
                    a_layout: LAYOUTS[(s + d) % 4],
                    b_layout: LAYOUTS[(s / 2 + d) % 4],
                    accumulate: (s + d) % 2 == 0,
                    parallel: s % 3 != 1,
                };
                // The same random operands as `check` draws: replay its generator.
                let mut replay = rng.clone();
                let want = check(kernel, case, &mut rng);
                let a = Mat::random(m, k, a_dtype, case.a_layout, &mut replay);
                let b = Mat::random(k, n, b_dtype, case.b_layout, &mut replay);
                let mut got: Vec<f32> = (0..m * n)
                    .map(|_| {
                        if case.accumulate {
                            replay.uniform(-1.0, 1.0) as f32
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                a.gemm_packed(&b, kernel, &mut got, case.accumulate, case.parallel);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got), bits(&want), "{} {case:?}", kernel.name());
                ran += 1;
            }
        }
    }
    assert!(ran >= 2 * 9 * shapes.len(), "only {ran} products compared");
}

#[test]
fn accumulate_on_and_off_for_every_dtype_pair() {
    let mut rng = Generator::new(3);
    let kernel = select_kernel(DType::F32, DType::F32);
    for a_dtype in DTYPES {
        for b_dtype in DTYPES {
            for accumulate in [false, true] {
                let case = Case {
                    m: 19,
                    k: 301,
                    n: 35,
                    a_dtype,
                    b_dtype,
                    a_layout: Layout::RowMajor,
                    b_layout: Layout::Transposed,
                    accumulate,
                    parallel: false,
                };
                check(kernel, case, &mut rng);
                // And through the dispatcher, which may pick another kernel for BF16×BF16.
                check(select_kernel(a_dtype, b_dtype), case, &mut rng);
            }
        }
    }
}

/// Large enough for several blocks per task on several threads; the result must also be
/// bit-identical to the serial one (an element's sum order depends on the kernel and k only).
#[test]
fn large_parallel_matches_serial() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let mut rng = Generator::new(4);
    for kernel in kernels() {
        let (a_dtype, b_dtype) = if kernel.accepts(DType::F16, DType::BF16) {
            (DType::F16, DType::BF16)
        } else {
            (DType::BF16, DType::BF16)
        };
        let case = Case {
            m: 300,
            k: 513,
            n: 257,
            a_dtype,
            b_dtype,
            a_layout: Layout::RowMajor,
            b_layout: Layout::RowMajor,
            accumulate: false,
            parallel: true,
        };
        let mut seeded = rng.fork();
        let par = pool.install(|| check(kernel, case, &mut seeded.clone()));
        let ser = check(
            kernel,
            Case {
                parallel: false,
                ..case
            },
            &mut seeded,
        );
        assert!(
            par.iter()
                .zip(&ser)
                .all(|(p, s)| p.to_bits() == s.to_bits()),
            "{}: parallel and serial results differ",
            kernel.name()
        );
    }
    // The dispatcher on F32 x F32 and BF16 x BF16 (transposed rhs, as `linear` uses it).
    for dtype in [DType::F32, DType::BF16] {
        let case = Case {
            m: 300,
            k: 513,
            n: 257,
            a_dtype: dtype,
            b_dtype: dtype,
            a_layout: Layout::RowMajor,
            b_layout: Layout::Transposed,
            accumulate: true,
            parallel: true,
        };
        pool.install(|| check(select_kernel(dtype, dtype), case, &mut rng));
    }
}

#[test]
fn empty_and_zero_k() {
    let a = [1.0f32; 6];
    // k = 0: the product is zero; overwrite clears dst, accumulate leaves it.
    let mut dst = vec![5.0f32; 4];
    let (a0, b0) = (
        MatRef::row_major(&a[..0], 2, 0),
        MatRef::row_major(&a[..0], 0, 2),
    );
    gemm(&mut dst, a0, b0, true, true);
    assert_eq!(dst, [5.0; 4]);
    gemm(&mut dst, a0, b0, false, true);
    assert_eq!(dst, [0.0; 4]);
    // m = 0 or n = 0: nothing to write.
    let mut none: Vec<f32> = vec![];
    gemm(
        &mut none,
        MatRef::row_major(&a[..0], 0, 3),
        MatRef::row_major(&a[..], 3, 2),
        false,
        true,
    );
    gemm(
        &mut none,
        MatRef::row_major(&a[..], 2, 3),
        MatRef::row_major(&a[..0], 3, 0),
        false,
        true,
    );
}

#[test]
#[should_panic(expected = "out of bounds")]
fn view_out_of_bounds_panics() {
    let a = [1.0f32; 6];
    let mut dst = [0.0f32; 4];
    let bad = MatRef {
        data: &a[..],
        rows: 2,
        cols: 3,
        rs: 4,
        cs: 1,
    };
    gemm(&mut dst, bad, MatRef::row_major(&a[..], 3, 2), false, false);
}

#[test]
#[should_panic(expected = "does not take")]
fn pair_kernel_rejects_f32_operands() {
    let a = [1.0f32; 4];
    let mut dst = [0.0f32; 4];
    let m = MatRef::row_major(&a[..], 2, 2);
    gemm_with(Kernel::PortableBf16Pairs, &mut dst, m, m, false, false);
}

#[test]
fn dispatcher_picks_the_best_kernel_for_the_cpu() {
    #[cfg(target_arch = "x86_64")]
    let (bf16_dot, avx2) = {
        // What the kernels may use: the CPU capped by the CPU configuration
        // (`HEMI_CPU_LEVEL=avx2` runs this file as an AVX2 CPU would).
        use hemi::cpu::features::{has, Feature::*};
        (
            has(Avx512f) && has(Avx512bw) && has(Avx512bf16),
            has(Avx2) && has(Fma) && has(F16c),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (bf16_dot, avx2) = (false, false);
    let f32_kernel = if avx2 { "avx2-fma" } else { "portable" };
    let amx = Kernel::AmxBf16.is_available();
    let bf16_kernel = if amx {
        "amx-bf16"
    } else if bf16_dot && Bf16Route::current() == Bf16Route::Pairs {
        "avx512bf16"
    } else {
        f32_kernel
    };
    println!(
        "bf16 x bf16 -> {}, otherwise {}",
        kernel_name(DType::BF16, DType::BF16),
        f32_kernel
    );
    assert_eq!(kernel_name(DType::BF16, DType::BF16), bf16_kernel);
    for a in DTYPES {
        for b in DTYPES {
            if (a, b) != (DType::BF16, DType::BF16) {
                assert_eq!(kernel_name(a, b), f32_kernel, "{a:?} x {b:?}");
            }
        }
    }
    assert_eq!(Kernel::Avx512Bf16.is_available(), bf16_dot);
    assert_eq!(Kernel::Avx2Fma.is_available(), avx2);
}

/// BF16 products take `vdpbf16ps` pairs on AMD and widen to F32 on Intel unless the CPU
/// configuration (`--bf16-route`, `HEMI_BF16_GEMM`) says otherwise; a setting that names
/// neither is an error that quotes it.
#[test]
fn bf16_route_follows_the_vendor_and_the_setting() {
    assert_eq!(Bf16Route::choose(None, false), Bf16Route::Pairs);
    assert_eq!(Bf16Route::choose(None, true), Bf16Route::Widen);
    for intel in [false, true] {
        for r in [Bf16Route::Pairs, Bf16Route::Widen] {
            assert_eq!(Bf16Route::choose(Some(r), intel), r);
            assert_eq!(Bf16Route::parse(r.name()), Ok(r));
        }
    }
    let err = Bf16Route::parse("fast").unwrap_err();
    assert!(err.contains("\"fast\"") && err.contains("pairs"), "{err}");
}

/// GFLOP/s at 1024³ on 2 threads, median of 5 (run with `--ignored --nocapture`): the gemm
/// crate on F32, the gemm crate after converting F16/BF16 operands to F32 (conversion timed),
/// and gemm_half on F32, F16 and BF16 with the F32-panel kernel (`avx2-fma` where the CPU has
/// it), plus BF16 with the kernel the dispatcher picks. The cases take turns, rep by rep, so
/// that load from other processes falls on all of them alike. `GEMM_HALF_BENCH_N`, `_THREADS`,
/// `_REPS` and `_ONLY` (a substring of the case names) change the defaults.
#[test]
#[ignore]
fn bench_gemm_half() {
    use hemi::dtype::convert::{bf16_to_f32, f16_to_f32};
    use std::time::Instant;

    let env = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let (n, threads, reps) = (
        env("GEMM_HALF_BENCH_N", 1024),
        env("GEMM_HALF_BENCH_THREADS", 2),
        env("GEMM_HALF_BENCH_REPS", 5),
    );
    let only = std::env::var("GEMM_HALF_BENCH_ONLY").unwrap_or_default();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut rng = Generator::new(7);
    let a32: Vec<f32> = (0..n * n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let b32: Vec<f32> = (0..n * n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let a16: Vec<f16> = a32.iter().map(|&x| f16::from_f32(x)).collect();
    let b16: Vec<f16> = b32.iter().map(|&x| f16::from_f32(x)).collect();
    let ab: Vec<bf16> = a32.iter().map(|&x| bf16::from_f32(x)).collect();
    let bb: Vec<bf16> = b32.iter().map(|&x| bf16::from_f32(x)).collect();
    fn sq<T>(d: &[T], n: usize) -> MatRef<'_, T> {
        MatRef::row_major(d, n, n)
    }
    // 'static views for the boxed closures below: the buffers live until the end of the test.
    let (a32, b32): (&'static [f32], &'static [f32]) = (a32.leak(), b32.leak());
    let (a16, b16): (&'static [f16], &'static [f16]) = (a16.leak(), b16.leak());
    let (ab, bb): (&'static [bf16], &'static [bf16]) = (ab.leak(), bb.leak());
    let kernel = if Kernel::Avx2Fma.is_available() {
        Kernel::Avx2Fma
    } else {
        Kernel::PortableF32
    };
    let convert_then_gemm = |x: &dyn Fn(&mut [f32]), y: &dyn Fn(&mut [f32]), d: &mut [f32]| {
        let (mut xs, mut ys) = (vec![0f32; n * n], vec![0f32; n * n]);
        x(&mut xs);
        y(&mut ys);
        matmul_into(
            d,
            MatRef::row_major(&xs, n, n),
            MatRef::row_major(&ys, n, n),
            false,
        )
    };
    type Case<'a> = (String, Box<dyn Fn(&mut [f32]) + Sync + 'a>);
    let auto = kernel_name(DType::BF16, DType::BF16);
    let cases: Vec<Case> = vec![
        (
            "gemm crate, F32".into(),
            Box::new(move |d: &mut [f32]| {
                matmul_into(
                    d,
                    MatRef::row_major(a32, n, n),
                    MatRef::row_major(b32, n, n),
                    false,
                )
            }),
        ),
        (
            "convert F16 -> F32, then gemm crate".into(),
            Box::new(move |d: &mut [f32]| {
                convert_then_gemm(&|x| f16_to_f32(a16, x), &|y| f16_to_f32(b16, y), d)
            }),
        ),
        (
            "convert BF16 -> F32, then gemm crate".into(),
            Box::new(move |d: &mut [f32]| {
                convert_then_gemm(&|x| bf16_to_f32(ab, x), &|y| bf16_to_f32(bb, y), d)
            }),
        ),
        (
            "gemm_half F32".into(),
            Box::new(move |d: &mut [f32]| {
                gemm_with(kernel, d, sq(a32, n), sq(b32, n), false, true)
            }),
        ),
        (
            "gemm_half F16".into(),
            Box::new(move |d: &mut [f32]| {
                gemm_with(kernel, d, sq(a16, n), sq(b16, n), false, true)
            }),
        ),
        (
            "gemm_half BF16".into(),
            Box::new(move |d: &mut [f32]| gemm_with(kernel, d, sq(ab, n), sq(bb, n), false, true)),
        ),
        (
            "gemm_half F32 x F32ᵀ".into(),
            Box::new(move |d: &mut [f32]| {
                gemm_with(kernel, d, sq(a32, n), sq(b32, n).t(), false, true)
            }),
        ),
        (
            "gemm_half F16 x F16ᵀ".into(),
            Box::new(move |d: &mut [f32]| {
                gemm_with(kernel, d, sq(a16, n), sq(b16, n).t(), false, true)
            }),
        ),
        (
            format!("gemm_half BF16, dispatched ({auto})"),
            Box::new(move |d: &mut [f32]| gemm(d, sq(ab, n), sq(bb, n), false, true)),
        ),
    ];
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|(name, _)| name.contains(&only))
        .collect();
    let mut dst = vec![0f32; n * n];
    let mut secs = vec![Vec::new(); cases.len()];
    pool.install(|| {
        for (_, f) in &cases {
            f(&mut dst); // warm-up: page faults, pack buffers
        }
        for _ in 0..reps {
            for ((_, f), s) in cases.iter().zip(&mut secs) {
                let t = Instant::now();
                f(&mut dst);
                s.push(t.elapsed().as_secs_f64());
            }
        }
    });
    println!(
        "{n}^3, {threads} threads, F32-panel kernel {}",
        kernel.name()
    );
    let flops = 2.0 * (n * n * n) as f64;
    for ((name, _), s) in cases.iter().zip(&mut secs) {
        s.sort_by(f64::total_cmp);
        let (median, best) = (flops / s[reps / 2] / 1e9, flops / s[0] / 1e9);
        println!("{name:<40} {median:7.1} GFLOP/s (best {best:.1})");
    }
}

/// One image's stride-1 convolution geometry whose padding and dilation keep output rows as
/// long as input rows (asserted): the cases the unfolds read.
fn stride1_geom(
    c_in: usize,
    (h, w): (usize, usize),
    (kh, kw): (usize, usize),
    (ph, pw): (usize, usize),
    d: usize,
    groups: usize,
    c_out: usize,
) -> Conv2dGeom {
    let g = Conv2dGeom {
        n: 1,
        c_in,
        h,
        w,
        c_out,
        kh,
        kw,
        stride: (1, 1),
        padding: (ph, pw),
        dilation: (d, d),
        groups,
        h_out: conv_out_size(h, kh, 1, ph, d).unwrap(),
        w_out: conv_out_size(w, kw, 1, pw, d).unwrap(),
    };
    assert_eq!(g.w_out, g.w, "{g:?}");
    g
}

/// `gemm_unfold` on one group of one image against `gemm_with` on `im2col`'s explicit column
/// matrix, both into copies of `init` (accumulating when `acc`): the bits of the results.
/// Asserts that `gemm_unfold_packed` (A packed beforehand, split among threads) gives the
/// bits of `gemm_unfold`.
fn unfold_vs_im2col<T: WithDType>(
    kernel: Kernel,
    x: &[T],
    w: &[T],
    g: &Conv2dGeom,
    grp: usize,
    init: &[f32],
    acc: bool,
) -> (Vec<u32>, Vec<u32>) {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let mut col = vec![T::default(); g.col_len()];
    im2col(x, &mut col, g);
    let a = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k);
    let b = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l);
    let u = Unfold::conv(x, g, grp).expect("a stride-1 'same'-width convolution");
    assert_eq!((u.rows(), u.cols()), (k, l));
    let (mut explicit, mut implicit) = (init.to_vec(), init.to_vec());
    gemm_with(kernel, &mut explicit, a, b, acc, false);
    gemm_unfold(kernel, &mut implicit, a, u, acc, false);
    let mut packed = init.to_vec();
    gemm_unfold_packed(&mut packed, &PackedA::new(kernel, a), u, acc, true);
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    let implicit = bits(implicit);
    assert_eq!(bits(packed), implicit, "{} {g:?}: packed A", kernel.name());
    (bits(explicit), implicit)
}

/// The column matrix read straight from the image (`gemm_unfold`) gives the bits of
/// `im2col` + `gemm_with`, for every F32-panel kernel this CPU runs (the portable twins of
/// `avx2-fma` and `avx512f` always), every operand dtype, accumulate on and off, and odd
/// geometries: output rows fewer and more than input rows, rows and columns entirely in the
/// padding, dilation, groups, ResNet-20's planes, widths around the 16/32-lane panels.
#[test]
fn unfolded_columns_equal_im2col_bit_for_bit() {
    let mut rng = Generator::new(41);
    // (c_in, h, w, kh, kw, (pad_h, pad_w), dilation, groups, c_out); padding and dilation
    // keep w_out == w.
    let cases = [
        (3, 7, 9, 3, 3, (1, 1), 1, 1, 5),
        (4, 5, 33, 3, 3, (0, 1), 1, 2, 6),
        (2, 6, 11, 5, 3, (2, 1), 1, 1, 3),
        (5, 9, 8, 3, 3, (2, 2), 2, 1, 17),
        (3, 4, 17, 1, 3, (0, 1), 1, 1, 9),
        (2, 3, 5, 3, 5, (3, 2), 1, 1, 4),
        (2, 2, 1, 3, 1, (1, 0), 1, 1, 3),
        (16, 32, 32, 3, 3, (1, 1), 1, 1, 16),
        (8, 8, 8, 3, 3, (1, 1), 1, 1, 13),
        (3, 5, 31, 3, 7, (1, 3), 1, 1, 8),
    ];
    let mut ran = 0;
    for kernel in kernels().into_iter().filter(|k| k.packs_f32()) {
        for (c_in, h, w, kh, kw, pad, d, groups, c_out) in cases {
            let g = stride1_geom(c_in, (h, w), (kh, kw), pad, d, groups, c_out);
            for dtype in DTYPES {
                let random = |len, rng: &mut Generator| {
                    Mat::random(1, len, dtype, Layout::RowMajor, rng).store
                };
                let (x, wt) = (
                    random(g.in_image(), &mut rng),
                    random(g.weight_len(), &mut rng),
                );
                let init: Vec<f32> = (0..g.c_out_g() * g.l())
                    .map(|_| rng.uniform(-1.0, 1.0) as f32)
                    .collect();
                for grp in 0..groups {
                    for acc in [false, true] {
                        let (explicit, implicit) = match (&x, &wt) {
                            (Store::F32(x), Store::F32(w)) => {
                                unfold_vs_im2col(kernel, x, w, &g, grp, &init, acc)
                            }
                            (Store::F16(x), Store::F16(w)) => {
                                unfold_vs_im2col(kernel, x, w, &g, grp, &init, acc)
                            }
                            (Store::BF16(x), Store::BF16(w)) => {
                                unfold_vs_im2col(kernel, x, w, &g, grp, &init, acc)
                            }
                            _ => unreachable!(),
                        };
                        assert_eq!(
                            explicit,
                            implicit,
                            "{} {dtype:?} acc={acc} group {grp} {g:?}",
                            kernel.name()
                        );
                        ran += 1;
                    }
                }
            }
        }
    }
    assert!(
        ran >= 2 * 3 * 2 * cases.len(),
        "only {ran} products compared"
    );
}

/// A BF16 convolution's column matrix in channel pairs, read straight from the image's
/// planes interleaved in pairs (`gemm_unfold_pairs`), gives the bits of `gemm_with` on the
/// explicit matrix with its rows in that order (k = 2·(channel pair, kernel offset) +
/// parity, a zero row for the channel that pads an odd count): on `portable-bf16-pairs`
/// always and `avx512bf16` where the CPU has it, accumulate on and off, odd channel counts,
/// padding on one side only, dilation, rows entirely in the padding, ResNet-20's planes,
/// widths around the 32-lane panels, and k past one k block (KC).
#[test]
fn channel_pair_unfold_equals_the_explicit_pair_matrix_bit_for_bit() {
    let mut rng = Generator::new(43);
    // (c_in, h, w, kh, kw, (pad_h, pad_w), dilation, c_out); w_out == w.
    let cases = [
        (3, 7, 9, 3, 3, (1, 1), 1, 5),
        (4, 5, 33, 3, 3, (0, 1), 1, 6),
        (5, 6, 11, 5, 3, (2, 1), 1, 3),
        (5, 9, 8, 3, 3, (2, 2), 2, 17),
        (2, 3, 5, 3, 5, (3, 2), 1, 4),
        (1, 2, 1, 3, 1, (1, 0), 1, 3),
        (16, 32, 32, 3, 3, (1, 1), 1, 16),
        (64, 8, 8, 3, 3, (1, 1), 1, 13),
        (7, 5, 31, 3, 7, (1, 3), 1, 8),
    ];
    let kernels: Vec<Kernel> = kernels()
        .into_iter()
        .filter(|k| k.unfolds_pairs())
        .collect();
    assert!(kernels.contains(&Kernel::PortableBf16Pairs));
    let mut ran = 0;
    for kernel in kernels {
        for (c_in, h, w, kh, kw, pad, d, c_out) in cases {
            let g = stride1_geom(c_in, (h, w), (kh, kw), pad, d, 1, c_out);
            let (cp, kk, l, hw) = (c_in.div_ceil(2), kh * kw, g.l(), h * w);
            let random = |len, rng: &mut Generator| -> Vec<bf16> {
                (0..len)
                    .map(|_| bf16::from_f64(rng.uniform(-2.0, 2.0)))
                    .collect()
            };
            let (x, wt) = (
                random(g.in_image(), &mut rng),
                random(g.weight_len(), &mut rng),
            );
            let mut col = vec![bf16::ZERO; g.col_len()];
            im2col(&x, &mut col, &g);
            // Row 2·(cp·kk + r) + e of the pair order is im2col's row (2cp + e)·kk + r.
            let k2 = 2 * cp * kk;
            let (mut colp, mut wp) = (vec![bf16::ZERO; k2 * l], vec![bf16::ZERO; c_out * k2]);
            for c in 0..c_in {
                for r in 0..kk {
                    let to = 2 * ((c / 2) * kk + r) + c % 2;
                    colp[to * l..(to + 1) * l].copy_from_slice(&col[(c * kk + r) * l..][..l]);
                    for o in 0..c_out {
                        wp[o * k2 + to] = wt[(o * c_in + c) * kk + r];
                    }
                }
            }
            let planes: Vec<f32> = (0..cp * hw)
                .map(|i| {
                    let (p, at) = (i / hw, i % hw);
                    let lo = x[2 * p * hw + at].to_bits() as u32;
                    let hi = x.get((2 * p + 1) * hw + at).filter(|_| 2 * p + 1 < c_in);
                    f32::from_bits(lo | (hi.map_or(0, |h| h.to_bits()) as u32) << 16)
                })
                .collect();
            let pg = Conv2dGeom { c_in: cp, ..g };
            let u = Unfold::conv(&planes, &pg, 0).expect("stride 1, same width");
            let a = MatRef::row_major(&wp, c_out, k2);
            let b = MatRef::row_major(&colp, k2, l);
            let init: Vec<f32> = (0..c_out * l)
                .map(|_| rng.uniform(-1.0, 1.0) as f32)
                .collect();
            for acc in [false, true] {
                let (mut explicit, mut implicit) = (init.clone(), init.clone());
                gemm_with(kernel, &mut explicit, a, b, acc, false);
                gemm_unfold_pairs(kernel, &mut implicit, a, u, acc, false);
                let mut packed = init.clone();
                gemm_unfold_pairs_packed(&mut packed, &PackedA::new(kernel, a), u, acc, true);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
                assert_eq!(
                    bits(&explicit),
                    bits(&implicit),
                    "{} acc={acc} {g:?}",
                    kernel.name()
                );
                assert_eq!(
                    bits(&packed),
                    bits(&implicit),
                    "{} acc={acc} {g:?}: packed A",
                    kernel.name()
                );
                ran += 1;
            }
        }
    }
    assert!(ran >= 2 * cases.len(), "only {ran} products compared");
}

/// Where the shortcut does not apply: strides other than 1, output rows of another length
/// than input rows, pointwise convolutions.
#[test]
fn unfold_refuses_what_it_cannot_read() {
    let x = vec![0f32; 2 * 6 * 6];
    let geom = |k: usize, s: usize, p: usize| Conv2dGeom {
        n: 1,
        c_in: 2,
        h: 6,
        w: 6,
        c_out: 3,
        kh: k,
        kw: k,
        stride: (s, s),
        padding: (p, p),
        dilation: (1, 1),
        groups: 1,
        h_out: conv_out_size(6, k, s, p, 1).unwrap(),
        w_out: conv_out_size(6, k, s, p, 1).unwrap(),
    };
    assert!(Unfold::conv(&x, &geom(3, 1, 1), 0).is_some());
    assert!(Unfold::conv(&x, &geom(3, 2, 1), 0).is_none(), "stride 2");
    assert!(
        Unfold::conv(&x, &geom(3, 1, 0), 0).is_none(),
        "w_out = w - 2"
    );
    assert!(Unfold::conv(&x, &geom(1, 1, 0), 0).is_none(), "pointwise");
}

/// `gemm_round` into `O`: every element of the m × n output.
fn round_into<A: WithDType, B: WithDType, O: WithDType>(
    kernel: Kernel,
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    bias: Option<&[f32]>,
    par: bool,
) -> Option<Vec<O>> {
    let len = a.rows * b.cols;
    let mut out: Vec<O> = Vec::with_capacity(len);
    if !gemm_round(
        kernel,
        &mut out.spare_capacity_mut()[..len],
        a,
        b,
        bias,
        par,
    ) {
        return None;
    }
    // SAFETY: gemm_round returned true: it wrote all `len` elements.
    unsafe { out.set_len(len) };
    Some(out)
}

/// `gemm_round` (each tile summed from the bias in L1 and rounded into F16/BF16 at once)
/// gives the bits of `gemm_with` into an F32 matrix filled with the bias rows, then rounded:
/// every kernel, F16 and BF16 operands and outputs, odd shapes, strided and transposed
/// operands, one thread and several; and declines (writing nothing) where k needs two
/// blocks.
#[test]
fn rounded_tiles_equal_the_f32_product_rounded() {
    let mut rng = Generator::new(41);
    for kernel in kernels() {
        for dtype in [DType::F16, DType::BF16] {
            if !kernel.accepts(dtype, dtype) {
                continue;
            }
            for &(m, k, n) in &[(37, 29, 45), (131, 96, 67), (1, 5, 1), (203, 17, 33)] {
                for (la, lb) in [
                    (Layout::RowMajor, Layout::Transposed),
                    (Layout::Strided, Layout::RowMajor),
                    (Layout::Transposed, Layout::Padded),
                ] {
                    let a = Mat::random(m, k, dtype, la, &mut rng);
                    let b = Mat::random(k, n, dtype, lb, &mut rng);
                    let bias: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
                    for (bias, par) in [
                        (None, true),
                        (Some(&bias[..]), true),
                        (Some(&bias[..]), false),
                    ] {
                        let mut want = vec![0f32; m * n];
                        if let Some(bias) = bias {
                            for row in want.chunks_mut(n) {
                                row.copy_from_slice(bias);
                            }
                        }
                        a.gemm_with(&b, kernel, &mut want, bias.is_some(), par);
                        let what = format!(
                            "{} {dtype:?} {m}x{k}x{n} {la:?}·{lb:?} bias {}",
                            kernel.name(),
                            bias.is_some()
                        );
                        macro_rules! check {
                            ($av:expr, $bv:expr) => {{
                                let (av, bv) = (a.view($av), b.view($bv));
                                let got: Vec<bf16> =
                                    round_into(kernel, av, bv, bias, par).expect(&what);
                                let mut exp = vec![bf16::ZERO; m * n];
                                hemi::dtype::convert::f32_to_bf16(&want, &mut exp);
                                let bits =
                                    |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                                assert_eq!(bits(&got), bits(&exp), "BF16 out: {what}");
                                let got: Vec<f16> =
                                    round_into(kernel, av, bv, bias, par).expect(&what);
                                let mut exp = vec![f16::ZERO; m * n];
                                hemi::dtype::convert::f32_to_f16(&want, &mut exp);
                                let bits =
                                    |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                                assert_eq!(bits(&got), bits(&exp), "F16 out: {what}");
                            }};
                        }
                        match (&a.store, &b.store) {
                            (Store::F16(av), Store::F16(bv)) => check!(av, bv),
                            (Store::BF16(av), Store::BF16(bv)) => check!(av, bv),
                            _ => unreachable!(),
                        }
                    }
                }
            }
        }
        // Past one k block: declined, nothing written.
        let k = (1..5000).find(|&k| !rounds_in_tiles(kernel, k)).unwrap();
        let a = vec![bf16::ONE; 3 * k];
        let b = vec![bf16::ONE; k * 2];
        if kernel.accepts(DType::BF16, DType::BF16) {
            let got: Option<Vec<bf16>> = round_into(
                kernel,
                MatRef::row_major(&a, 3, k),
                MatRef::row_major(&b, k, 2),
                None,
                true,
            );
            assert!(got.is_none(), "{}: k = {k} taken", kernel.name());
        }
    }
}
