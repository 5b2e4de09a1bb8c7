//! Throughput of hemi's bulk F32 <-> F16/BF16 conversions on 16M elements (64 MiB of F32,
//! far larger than any cache, so this measures the streaming case), against the scalar
//! element-by-element `bf16::from_f32` loop they replace.
//!
//! Run: `cargo bench -p hemi --features bench --bench convert -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::{bf16, f16};
use hemi::dtype::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use std::hint::black_box;

const N: usize = 16 << 20;

fn inputs() -> Vec<f32> {
    // Smooth, mostly normal values in the range activations and weights live in; the exact
    // values do not matter to these branch-free kernels, only that they are not all equal.
    (0..N).map(|i| ((i as f32) * 0.001).sin() * 100.0).collect()
}

fn convert(c: &mut Criterion) {
    let src = inputs();
    let mut g = c.benchmark_group("convert_16M");
    g.throughput(Throughput::Elements(N as u64));
    g.sample_size(10);

    let mut h = vec![f16::ZERO; N];
    g.bench_function("f32_to_f16", |b| {
        b.iter(|| f32_to_f16(black_box(&src), &mut h))
    });
    let mut w = vec![0f32; N];
    g.bench_function("f16_to_f32", |b| {
        b.iter(|| f16_to_f32(black_box(&h), &mut w))
    });

    let mut bf = vec![bf16::ZERO; N];
    g.bench_function("f32_to_bf16", |b| {
        b.iter(|| f32_to_bf16(black_box(&src), &mut bf))
    });
    g.bench_function("bf16_to_f32", |b| {
        b.iter(|| bf16_to_f32(black_box(&bf), &mut w))
    });

    // The baseline: half's scalar conversion, one element at a time, one thread.
    g.bench_function("f32_to_bf16_scalar", |b| {
        b.iter(|| {
            for (d, s) in bf.iter_mut().zip(black_box(&src)) {
                *d = bf16::from_f32(*s);
            }
        })
    });
    g.finish();
}

criterion_group!(benches, convert);
criterion_main!(benches);
