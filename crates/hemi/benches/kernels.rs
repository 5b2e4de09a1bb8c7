//! The kernels a CifarNet training step spends its time in, through the public `Tensor`
//! API (so dtype conversions, allocation and dispatch count, as in training): matmul
//! 256³ and 512³ in F32/F16/BF16, the forward of CifarNet's conv2 at batch 16 in F32/BF16,
//! 2×2 max pooling forward on [16,64,30,30], and relu forward on 1M elements. All forwards
//! run without a graph (no input requires grad), on rayon's global pool.
//!
//! Short by design (10 samples, ~2 s each) so the whole run takes a couple of minutes:
//! `cargo bench -p hemi --features bench --bench kernels` (a name filter after `--` picks some;
//! the feature `bench` brings in criterion).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};
use std::hint::black_box;
use std::time::Duration;

/// The dtypes by their short names, for bench ids.
const HALF_AND_F32: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

/// A benchmark group kept short: 10 samples over ~2 s after a 0.5 s warm-up.
fn group<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    g
}

fn matmul(c: &mut Criterion) {
    let mut rng = Generator::new(1);
    let mut g = group(c, "matmul");
    for n in [256usize, 512] {
        let a = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng).unwrap();
        let b = Tensor::rand(&[n, n], -1.0, 1.0, DType::F32, &mut rng).unwrap();
        // Criterion reports "elements/s"; with 2n³ elements per iteration that is FLOP/s.
        g.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
        for (dt, name) in HALF_AND_F32 {
            let (a, b) = (a.to_dtype(dt).unwrap(), b.to_dtype(dt).unwrap());
            g.bench_function(format!("{name}/{n}"), |bch| {
                bch.iter(|| black_box(a.matmul(black_box(&b)).unwrap()))
            });
        }
    }
    g.finish();
}

fn conv2d(c: &mut Criterion) {
    let mut rng = Generator::new(2);
    let mut g = group(c, "conv2d_cifar_conv2_b16");
    // CifarNet's conv2 at batch 16: [16,64,15,15] * [128,64,3,3] -> [16,128,13,13].
    let x = Tensor::randn(&[16, 64, 15, 15], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    let w = Tensor::rand(&[128, 64, 3, 3], -0.04, 0.04, DType::F32, &mut rng).unwrap();
    // FLOP per forward: 2·N·C_out·H_out·W_out·C_in·kh·kw (as "elements").
    g.throughput(Throughput::Elements(2 * 16 * 128 * 13 * 13 * 64 * 9));
    for (dt, name) in [(DType::F32, "f32"), (DType::BF16, "bf16")] {
        let (x, w) = (x.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap());
        g.bench_function(name, |b| {
            b.iter(|| black_box(x.conv2d(&w, None, Conv2dOptions::default()).unwrap()))
        });
    }
    g.finish();
}

fn max_pool2d(c: &mut Criterion) {
    let mut rng = Generator::new(3);
    let mut g = group(c, "max_pool2d_2x2_16x64x30x30");
    let shape = [16usize, 64, 30, 30];
    let x = Tensor::randn(&shape, 0.0, 1.0, DType::F32, &mut rng).unwrap();
    g.throughput(Throughput::Elements(shape.iter().product::<usize>() as u64));
    for (dt, name) in HALF_AND_F32 {
        let x = x.to_dtype(dt).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| black_box(x.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap()))
        });
    }
    g.finish();
}

fn relu(c: &mut Criterion) {
    let mut rng = Generator::new(4);
    let mut g = group(c, "relu_1M");
    let n = 1usize << 20;
    let x = Tensor::randn(&[n], 0.0, 1.0, DType::F32, &mut rng).unwrap();
    g.throughput(Throughput::Elements(n as u64));
    for (dt, name) in HALF_AND_F32 {
        let x = x.to_dtype(dt).unwrap();
        g.bench_function(name, |b| b.iter(|| black_box(x.relu().unwrap())));
    }
    g.finish();
}

criterion_group!(benches, matmul, conv2d, max_pool2d, relu);
criterion_main!(benches);
