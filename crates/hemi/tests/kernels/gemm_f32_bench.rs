//! The measurement behind `gemm::select::f32_kernel` (which F32 products leave the `gemm` crate
//! for hemi's `avx512f` kernel): both on the products that matter to hemi, one thread, CPU
//! time of that thread (so that time the shared machine spends on other work is not counted),
//! median of several rounds in which the two take turns. Run it with
//!
//! ```sh
//! cargo test --release -p hemi --test kernels -- --ignored --nocapture
//! ```
//!
//! `GEMM_F32_BENCH_REPS` sets the rounds (default 7), `GEMM_F32_BENCH_ONLY` a substring of
//! the case names. Prints nothing useful without AVX-512 F.

use hemi::cpu::gemm::blocked::gemm_with;
use hemi::cpu::gemm::select::{f32_kernel, Kernel};
use hemi::cpu::gemm::{matmul_into_par, MatRef};
use hemi::Generator;
use std::time::Instant;

/// A product `m×k · k×n`, A and/or B given transposed (as the convolution passes them),
/// `batch` of them one after another sharing A (a convolution's per-image products, each
/// on one thread as the convolution runs them), accumulating into C or not.
struct Case {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    a_t: bool,
    b_t: bool,
    acc: bool,
    batch: usize,
}

const fn case(name: &'static str, m: usize, k: usize, n: usize, batch: usize) -> Case {
    Case {
        name,
        m,
        k,
        n,
        a_t: false,
        b_t: false,
        acc: false,
        batch,
    }
}

/// ResNet-20 at batch 128 (channels 16/32/64 at 32²/16²/8²): `y = w · col`, `dcol = wᵀ · dy`,
/// `dw += dy · colᵀ`, per image (as `cpu::conv` multiplies; 16 images here) and batched.
const fn conv(name: &'static str, m: usize, k: usize, n: usize, batch: usize, pass: u8) -> Case {
    Case {
        a_t: pass == 1,
        b_t: pass == 2,
        acc: pass == 2,
        ..case(name, m, k, n, batch)
    }
}

const CASES: [Case; 26] = [
    case("square 256", 256, 256, 256, 1),
    case("square 512", 512, 512, 512, 1),
    case("square 1024", 1024, 1024, 1024, 1),
    case("square 2048", 2048, 2048, 2048, 1),
    conv("image fwd conv1", 16, 27, 1024, 16, 0),
    conv("image fwd stage1", 16, 144, 1024, 16, 0),
    conv("image fwd stage2", 32, 288, 256, 16, 0),
    conv("image fwd stage3", 64, 576, 64, 16, 0),
    conv("image dx stage1", 144, 16, 1024, 16, 1),
    conv("image dx stage2", 288, 32, 256, 16, 1),
    conv("image dx stage3", 576, 64, 64, 16, 1),
    conv("image dw conv1", 16, 1024, 27, 16, 2),
    conv("image dw stage1", 16, 1024, 144, 16, 2),
    conv("image dw stage2", 32, 256, 288, 16, 2),
    conv("image dw stage3", 64, 64, 576, 16, 2),
    conv("batch fwd stage1", 16, 144, 131072, 1, 0),
    conv("batch fwd stage3", 64, 576, 8192, 1, 0),
    conv("batch dx stage1", 144, 16, 131072, 1, 1),
    conv("batch dx stage3", 576, 64, 8192, 1, 1),
    conv("batch dw stage1", 16, 131072, 144, 1, 2),
    conv("batch dw stage3", 64, 8192, 576, 1, 2),
    // Where the tiles are mostly padding or the product is small: the gemm crate's.
    case("matrix-vector", 1, 1024, 1024, 1),
    case("classifier 128x64x10", 128, 64, 10, 1),
    case("n = 16", 512, 256, 16, 1),
    case("16x256x48", 16, 256, 48, 1),
    case("square 32", 32, 32, 32, 64),
];

/// Seconds this thread has run (Linux's schedstat), else wall time.
fn thread_seconds(wall: Instant) -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or_else(|| wall.elapsed().as_secs_f64(), |ns| ns * 1e-9)
}

fn run(kernel: Option<Kernel>, c: &Case, a: &[f32], b: &[f32], dst: &mut [f32]) {
    let (m, k, n) = (c.m, c.k, c.n);
    let am = if c.a_t {
        MatRef::row_major(a, k, m).t()
    } else {
        MatRef::row_major(a, m, k)
    };
    let bm = if c.b_t {
        MatRef::row_major(b, n, k).t()
    } else {
        MatRef::row_major(b, k, n)
    };
    for d in dst.chunks_exact_mut(m * n).take(c.batch) {
        match kernel {
            Some(kernel) => gemm_with(kernel, d, am, bm, c.acc, c.batch == 1),
            None => matmul_into_par(d, am, bm, c.acc, c.batch == 1),
        }
    }
}

#[test]
#[ignore]
fn bench_f32_routes() {
    if !Kernel::Avx512F32.is_available() {
        println!("no AVX-512 F on this CPU: F32 products all stay on the gemm crate");
        return;
    }
    let env = |name: &str| std::env::var(name).ok();
    let reps: usize = env("GEMM_F32_BENCH_REPS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let only = env("GEMM_F32_BENCH_ONLY").unwrap_or_default();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut rng = Generator::new(76);
    println!(
        "{:<22} {:>5} {:>6} {:>6} {:>5} {:>10} {:>10} {:>6}  route",
        "GFLOP/s, 1 thread", "m", "k", "n", "batch", "gemm", "avx512f", "ratio"
    );
    for c in CASES.iter().filter(|c| c.name.contains(only.as_str())) {
        let a: Vec<f32> = (0..c.m * c.k)
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let b: Vec<f32> = (0..c.k * c.n)
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let mut dst = vec![0f32; c.m * c.n * c.batch];
        let flop = 2.0 * (c.m * c.k * c.n * c.batch) as f64;
        // Enough calls per timing that one lasts ~20 ms.
        let calls = ((2e9 / flop) as usize).clamp(1, 1000);
        let kernels = [None, Some(Kernel::Avx512F32)];
        let mut secs = [Vec::new(), Vec::new()];
        pool.install(|| {
            for kernel in kernels {
                run(kernel, c, &a, &b, &mut dst);
            }
            for _ in 0..reps {
                for (kernel, s) in kernels.into_iter().zip(&mut secs) {
                    let wall = Instant::now();
                    let t0 = thread_seconds(wall);
                    for _ in 0..calls {
                        run(kernel, c, &a, &b, &mut dst);
                    }
                    s.push((thread_seconds(wall) - t0) / calls as f64);
                }
            }
        });
        let rate = secs.map(|mut v| {
            v.sort_by(f64::total_cmp);
            flop / v[v.len() / 2] / 1e9
        });
        let route = f32_kernel(c.m, c.k, c.n).map_or("gemm crate", |k| k.name());
        println!(
            "{:<22} {:>5} {:>6} {:>6} {:>5} {:>10.1} {:>10.1} {:>5.2}x  {route}",
            c.name,
            c.m,
            c.k,
            c.n,
            c.batch,
            rate[0],
            rate[1],
            rate[1] / rate[0]
        );
    }
}
