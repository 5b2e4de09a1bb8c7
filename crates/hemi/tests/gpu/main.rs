//! The wgpu backend (`--features gpu`) against the CPU backend: every primitive it
//! implements on the same random, odd-sized, strided inputs, within the dtype's tolerance
//! (casts and copies bit for bit); a composition (softmax, layer norm) running on the GPU
//! from the default bodies; the errors of bad input. `ops.rs`: the op suite of
//! `tests/ops/naive.rs`; `models.rs`: training steps of `tests/models/naive.rs`.
//!
//! In CI the device is Mesa's lavapipe (software Vulkan). Without an adapter each test prints
//! `SKIPPED (no GPU adapter)` and returns, unless `HEMI_REQUIRE_GPU=1`, where it fails.
//! `cargo test --release -p hemi --features gpu --test gpu`.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

use common::{assert_close, balanced, strict, Tol};
use hemi::backend::map::{BinaryOp, UnaryOp};
use hemi::backend::reduce::ReduceOp;
use hemi::cpu::storage::CpuStorage;
use hemi::device::Device;
use hemi::dtype::convert::Rounding;
use hemi::rng::Generator;
use hemi::tensor::{Layout, Storage, Tensor};
use hemi::DType;

const GPU: Device = Device::Gpu(0);
const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// True when `gpu:0` opens; else prints `SKIPPED (no GPU adapter)` (the test returns),
/// or fails under `HEMI_REQUIRE_GPU=1`.
fn have_gpu(test: &str) -> bool {
    match hemi::gpu::context(0) {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("HEMI_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: HEMI_REQUIRE_GPU=1 but {e}");
            }
            eprintln!("{test}: SKIPPED (no GPU adapter): {e}");
            false
        }
    }
}

macro_rules! need_gpu {
    ($name:expr) => {
        if !crate::have_gpu($name) {
            return;
        }
    };
}

/// The op suite of `tests/ops/naive.rs` on the GPU.
mod ops;

/// Training steps of `tests/models/naive.rs` on the GPU (which runs some of its helpers).
#[allow(dead_code, unused_imports)]
mod models;

/// A buffer of `n` random values of `dtype` in [lo, hi) on the CPU.
fn host(n: usize, lo: f64, hi: f64, dtype: DType, rng: &mut Generator) -> CpuStorage {
    let v: Vec<f64> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    CpuStorage::from_f64(v, dtype)
}

/// The same buffer on the CPU and on the GPU.
fn pair(h: CpuStorage) -> (Storage, Storage) {
    let cpu = Storage::Cpu(h);
    let gpu = cpu.to_device(GPU).unwrap();
    assert_eq!(gpu.device(), GPU);
    (cpu, gpu)
}

/// A strided view of `shape` into a larger buffer: the last two dims transposed, every
/// dim's stride padded, an offset of 3 (rank >= 1). Returns the layout and the buffer
/// length it needs.
fn strided(shape: &[usize]) -> (Layout, usize) {
    let r = shape.len();
    let mut order: Vec<usize> = (0..r).collect();
    if r >= 2 {
        order.swap(r - 1, r - 2);
    }
    // Storage dims in `order` (outermost first), each padded by one element.
    let mut strides = vec![0; r];
    let mut acc = 1;
    for &d in order.iter().rev() {
        strides[d] = acc;
        acc *= shape[d] + 1;
    }
    (Layout::new(shape.to_vec(), strides, 3), acc + 3)
}

fn values(s: &Storage, shape: &[usize]) -> Vec<f64> {
    let h = s.to_cpu().unwrap().into_owned();
    assert_eq!(h.len(), shape.iter().product::<usize>());
    Tensor::from_storage_layout(h, Layout::contiguous(shape))
        .unwrap()
        .to_vec_f64()
}

fn bits(s: &Storage) -> Vec<u8> {
    s.to_le_bytes().unwrap()
}

/// One rounding of the dtype beyond the CPU's own: both sides round an F32 value once,
/// and F32 transcendental functions differ by a few ulps between libm and a GPU.
fn tol(dtype: DType) -> Tol {
    let t = strict(dtype);
    Tol {
        rtol: t.rtol + 2.0 * dtype.unit_roundoff() + 64.0 * DType::F32.unit_roundoff(),
        atol: t.atol + 64.0 * DType::F32.unit_roundoff(),
    }
}

#[test]
fn adapter_opens_and_reports_itself() {
    need_gpu!("adapter_opens_and_reports_itself");
    let ctx = hemi::gpu::context(0).unwrap();
    let info = ctx.info();
    eprintln!(
        "gpu:0 = {} ({}), SHADER_F16 {}, largest binding {} bytes",
        info.name, info.driver, info.shader_f16, info.max_binding
    );
    assert_eq!(ctx.device(), GPU);
    assert!(hemi::gpu::device_count() >= 1);
    // A second ordinal that does not exist is an error naming it, not a panic.
    let e = hemi::gpu::context(999).unwrap_err().to_string();
    assert!(e.contains("gpu:999"), "{e}");
}

#[test]
fn upload_download_and_copy_strided_are_exact() {
    need_gpu!("upload_download_and_copy_strided_are_exact");
    let mut rng = Generator::new(1);
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64] {
        for shape in [
            vec![7usize],
            vec![5, 7],
            vec![3, 1, 4, 9],
            vec![0, 3],
            vec![],
        ] {
            let (l, len) = strided(&shape);
            let (cpu, gpu) = pair(host(len, -100.0, 100.0, dtype, &mut rng));
            assert_eq!(bits(&gpu), bits(&cpu), "{dtype:?} round trip");
            let want = cpu.copy_strided(&l).unwrap();
            let got = gpu.copy_strided(&l).unwrap();
            assert_eq!(got.device(), GPU);
            assert_eq!(bits(&got), bits(&want), "copy_strided {dtype:?} {shape:?}");
            // A strided download is the same gather.
            let Storage::Gpu(g) = &gpu else {
                unreachable!()
            };
            let down = hemi::backend::BackendStorage::download(g, &l).unwrap();
            assert_eq!(
                down.to_le_bytes(),
                bits(&want),
                "download {dtype:?} {shape:?}"
            );
        }
    }
}

/// F32 bit patterns over every class: normals of every exponent, subnormals, zeros, infs,
/// NaNs, half's overflow edge and round-to-nearest-even ties.
fn f32_patterns(rng: &mut Generator) -> Vec<f32> {
    let mut v: Vec<f32> = (0..4001)
        .map(|_| f32::from_bits(rng.next_u64() as u32))
        .collect();
    v.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65519.99,
        65520.0,
        -65520.0,
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        2f32.powi(-24),
        2f32.powi(-25),
        1.5 * 2f32.powi(-25),
        2f32.powi(-14) * 0.75,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
    ]);
    // Values of ordinary size as well (the random bits are mostly huge or tiny).
    v.extend((0..999).map(|_| rng.uniform(-70000.0, 70000.0) as f32));
    v
}

#[test]
fn casts_match_the_cpu_bit_for_bit() {
    need_gpu!("casts_match_the_cpu_bit_for_bit");
    let mut rng = Generator::new(2);
    let all = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64];
    // From F32 bit patterns of every class, and from random values of every dtype.
    let patterns = CpuStorage::from_vec(f32_patterns(&mut rng));
    let n = patterns.len();
    let mut sources = vec![(patterns, Layout::contiguous(&[n]))];
    for &d in &all {
        let (l, len) = strided(&[13, 11]);
        sources.push((host(len, -300.0, 300.0, d, &mut rng), l));
    }
    for (h, l) in sources {
        let from = h.dtype();
        let (cpu, gpu) = pair(h);
        for &to in &all {
            let want = cpu.cast(&l, to).unwrap();
            let got = gpu.cast(&l, to).unwrap();
            assert_eq!(got.dtype(), to);
            let (g, w) = (bits(&got), bits(&want));
            if g != w {
                let size = to.size_in_bytes();
                let i = (0..g.len() / size)
                    .find(|&i| g[i * size..(i + 1) * size] != w[i * size..(i + 1) * size])
                    .unwrap();
                panic!(
                    "cast {from:?} -> {to:?}: element {i} (input {:?}) got {:?} want {:?}",
                    values(&cpu.copy_strided(&l).unwrap(), &[l.numel()])[i],
                    &g[i * size..(i + 1) * size],
                    &w[i * size..(i + 1) * size]
                );
            }
        }
    }
}

#[test]
fn unary_maps_match_the_cpu() {
    need_gpu!("unary_maps_match_the_cpu");
    let mut rng = Generator::new(3);
    let shape = [7, 13];
    let (l, len) = strided(&shape);
    for op in UnaryOp::ALL {
        // Log and sqrt on positive inputs (their NaN/-inf edges are the driver's).
        let lo = if matches!(op, UnaryOp::Log | UnaryOp::Sqrt) {
            0.05
        } else {
            -4.0
        };
        for din in FLOATS {
            let (cpu, gpu) = pair(host(len, lo, 4.0, din, &mut rng));
            for out in FLOATS {
                let want = cpu.unary(&l, op, out).unwrap();
                let got = gpu.unary(&l, op, out).unwrap();
                assert_eq!((got.device(), got.dtype()), (GPU, out));
                assert_close(
                    &format!("{} {din:?} -> {out:?}", op.name()),
                    &values(&got, &shape),
                    &values(&want, &shape),
                    tol(out),
                );
            }
        }
    }
}

#[test]
fn binary_maps_broadcast_over_strided_layouts() {
    need_gpu!("binary_maps_broadcast_over_strided_layouts");
    let mut rng = Generator::new(4);
    let shape = [3, 5, 9];
    let (la, len_a) = strided(&shape);
    // b: a [5, 1] buffer broadcast along dims 0 and 2 (zero strides), offset 2.
    let lb = Layout::new(shape.to_vec(), vec![0, 1, 0], 2);
    for op in BinaryOp::ALL {
        for (da, db, out) in [
            (DType::F32, DType::F32, DType::F32),
            (DType::F16, DType::F16, DType::F16),
            (DType::BF16, DType::BF16, DType::BF16),
            (DType::F16, DType::F32, DType::F32),
            (DType::BF16, DType::F16, DType::F32),
        ] {
            let (ca, ga) = pair(host(len_a, -3.0, 3.0, da, &mut rng));
            // Divisors away from 0.
            let hb = host(7, 0.5, 3.0, db, &mut rng);
            let (cb, gb) = pair(hb);
            let want = ca.binary(&la, &cb, &lb, op, out).unwrap();
            let got = ga.binary(&la, &gb, &lb, op, out).unwrap();
            assert_close(
                &format!("{} {da:?},{db:?} -> {out:?}", op.name()),
                &values(&got, &shape),
                &values(&want, &shape),
                tol(out),
            );
        }
    }
    // NaN propagates through maximum and minimum, as on the CPU.
    let (c, g) = pair(CpuStorage::from_vec(vec![f32::NAN, 1.0, 2.0, f32::NAN]));
    let l = Layout::contiguous(&[2]);
    let l2 = Layout::new(vec![2], vec![1], 2);
    for op in [BinaryOp::Maximum, BinaryOp::Minimum] {
        let want = values(&c.binary(&l, &c, &l2, op, DType::F32).unwrap(), &[2]);
        let got = values(&g.binary(&l, &g, &l2, op, DType::F32).unwrap(), &[2]);
        assert!(
            want[0].is_nan() && got[0].is_nan() && got[1].is_nan(),
            "{got:?}"
        );
    }
    // And through clamp.
    let got = values(
        &g.unary(&l, UnaryOp::Clamp(-1.0, 1.0), DType::F32).unwrap(),
        &[2],
    );
    assert!(got[0].is_nan() && got[1] == 1.0, "{got:?}");
}

#[test]
fn reductions_match_the_cpu() {
    need_gpu!("reductions_match_the_cpu");
    let mut rng = Generator::new(5);
    // [outer dims..., reduced dims...] as a strided view; inner from 1 to 1000.
    for shape in [
        vec![5usize, 7],
        vec![3, 1],
        vec![2, 3, 10, 100],
        vec![1, 999],
    ] {
        let (l, len) = strided(&shape);
        let inner = *shape.last().unwrap() * if shape.len() == 4 { shape[2] } else { 1 };
        let outer = shape.iter().product::<usize>() / inner;
        for din in FLOATS {
            let (cpu, gpu) = pair(host(len, -2.0, 2.0, din, &mut rng));
            for op in [
                ReduceOp::Sum,
                ReduceOp::Mean,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Var { correction: 1 },
            ] {
                for out in FLOATS {
                    let want = cpu.reduce(&l, outer, inner, op, out).unwrap();
                    let got = gpu.reduce(&l, outer, inner, op, out).unwrap();
                    let mut t = balanced(out);
                    // Sums of up to 1000 terms of magnitude 2 in another order.
                    t.atol += 1e-6 * inner as f64;
                    assert_close(
                        &format!("{} {din:?} -> {out:?} {shape:?}", op.name()),
                        &values(&got, &[outer]),
                        &values(&want, &[outer]),
                        t,
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_batched_broadcast_transposed_with_bias() {
    need_gpu!("matmul_batched_broadcast_transposed_with_bias");
    let mut rng = Generator::new(6);
    // a [2, 3, m, k] strided (transposed), b [3, k, n] (batch broadcast over a's first dim).
    for (m, k, n) in [(17, 33, 19), (1, 5, 1), (40, 70, 3), (16, 16, 16)] {
        let ashape = [2, 3, m, k];
        let (la, len_a) = strided(&ashape);
        let lb = Layout::contiguous(&[3, k, n]);
        for (da, db, out) in [
            (DType::F32, DType::F32, DType::F32),
            (DType::F16, DType::F16, DType::F16),
            (DType::BF16, DType::BF16, DType::BF16),
            (DType::F16, DType::F16, DType::F32),
            (DType::F32, DType::BF16, DType::F32),
        ] {
            let (ca, ga) = pair(host(len_a, -1.0, 1.0, da, &mut rng));
            let (cb, gb) = pair(host(3 * k * n, -1.0, 1.0, db, &mut rng));
            let (cbias, gbias) = pair(host(n + 1, -1.0, 1.0, out, &mut rng));
            let lbias = Layout::new(vec![n], vec![1], 1);
            for with_bias in [false, true] {
                let want = ca
                    .matmul(&la, &cb, &lb, with_bias.then_some((&cbias, &lbias)), out)
                    .unwrap();
                let got = ga
                    .matmul(&la, &gb, &lb, with_bias.then_some((&gbias, &lbias)), out)
                    .unwrap();
                let mut t = balanced(out);
                t.atol += 1e-6 * k as f64;
                assert_close(
                    &format!("matmul {m}x{k}x{n} {da:?},{db:?} -> {out:?} bias {with_bias}"),
                    &values(&got, &[2, 3, m, n]),
                    &values(&want, &[2, 3, m, n]),
                    t,
                );
            }
        }
    }
}

/// Softmax and layer norm are default compositions (reduce, binary, unary): they run on
/// the GPU as soon as those exist, and match the CPU's fused kernels.
#[test]
fn compositions_run_on_the_gpu() {
    need_gpu!("compositions_run_on_the_gpu");
    let mut rng = Generator::new(7);
    for dtype in FLOATS {
        let (x, _) = common::rand_tensor(&[6, 37], dtype, true, &mut rng);
        let xg = x.to_device(GPU).unwrap();
        let want = x.softmax(-1).unwrap();
        let got = xg.softmax(-1).unwrap();
        assert_eq!(got.device(), GPU);
        assert_close(
            &format!("softmax {dtype:?}"),
            &got.to_device(Device::Cpu).unwrap().to_vec_f64(),
            &want.to_vec_f64(),
            common::permissive(dtype),
        );
        let (w, _) = common::rand_tensor(&[37], dtype, false, &mut rng);
        let (b, _) = common::rand_tensor(&[37], dtype, false, &mut rng);
        let (wg, bg) = (w.to_device(GPU).unwrap(), b.to_device(GPU).unwrap());
        let want = x.layer_norm(&[37], Some(&w), Some(&b), 1e-5).unwrap();
        let got = xg.layer_norm(&[37], Some(&wg), Some(&bg), 1e-5).unwrap();
        assert_eq!(got.device(), GPU);
        assert_close(
            &format!("layer_norm {dtype:?}"),
            &got.to_vec_f64(),
            &want.to_vec_f64(),
            common::permissive(dtype),
        );
    }
}

#[test]
fn bad_input_and_mixed_devices_are_errors() {
    need_gpu!("bad_input_and_mixed_devices_are_errors");
    let mut rng = Generator::new(8);
    let (c, g) = pair(host(12, -1.0, 1.0, DType::F32, &mut rng));
    let l = Layout::contiguous(&[3, 4]);
    // Rounding into I64 is an error naming the op and the dtype.
    let e = g
        .round_into(&l, DType::I64, Rounding::Stochastic, &mut rng)
        .unwrap_err()
        .to_string();
    assert!(e.contains("round_into") && e.contains("I64"), "{e}");
    // Mixing a CPU and a GPU buffer is the existing device error, naming both.
    let e = g
        .binary(&l, &c, &l, BinaryOp::Add, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("binary") && e.contains("cpu") && e.contains("gpu:0"),
        "{e}"
    );
    // F64 maps run the CPU's on the host (batch norm's running statistics use them); other
    // F64 arithmetic is an error naming the dtype and the device.
    let (c64, g64) = pair(host(12, -1.0, 1.0, DType::F64, &mut rng));
    let want = c64.unary(&l, UnaryOp::Exp, DType::F64).unwrap();
    let got = g64.unary(&l, UnaryOp::Exp, DType::F64).unwrap();
    assert_eq!((got.device(), bits(&got)), (GPU, bits(&want)));
    let e = g64
        .reduce(&l, 3, 4, ReduceOp::Sum, DType::F64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("F64") && e.contains("gpu:0"), "{e}");
    // Tensors move back and forth.
    let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
    let back = t.to_device(GPU).unwrap().to_device(Device::Cpu).unwrap();
    assert_eq!(back.to_vec_f32(), vec![1.0, 2.0, 3.0]);
}

#[test]
fn freed_buffers_are_reused_from_the_cache() {
    need_gpu!("freed_buffers_are_reused_from_the_cache");
    let ctx = hemi::gpu::context(0).unwrap();
    let mut rng = Generator::new(9);
    let h = host(1000, -1.0, 1.0, DType::F32, &mut rng);
    drop(pair(h.clone()));
    let before = ctx.memory_stats();
    for _ in 0..10 {
        drop(pair(h.clone()));
    }
    let after = ctx.memory_stats();
    assert_eq!(after.raw_mallocs, before.raw_mallocs, "{before} / {after}");
    assert!(after.allocs > before.allocs);
}

/// `round_into` draws the CPU's random bits in the CPU's order, so stochastic rounding into
/// F16 and BF16 is the CPU's bit for bit (and nearest-even is the cast), from F32 values of
/// every class and from a strided F16 view.
#[test]
fn round_into_matches_the_cpu_bit_for_bit() {
    need_gpu!("round_into_matches_the_cpu_bit_for_bit");
    let mut rng = Generator::new(10);
    let patterns = CpuStorage::from_vec(f32_patterns(&mut rng));
    let n = patterns.len();
    let (l16, len16) = strided(&[9, 7]);
    let sources = [
        (patterns, Layout::contiguous(&[n])),
        (host(len16, -3.0, 3.0, DType::F32, &mut rng), l16.clone()),
        (host(len16, -3.0, 3.0, DType::F16, &mut rng), l16),
    ];
    for (h, l) in sources {
        let from = h.dtype();
        let (cpu, gpu) = pair(h);
        for to in [DType::F16, DType::BF16, DType::F32] {
            for rounding in [Rounding::Stochastic, Rounding::NearestEven] {
                let (mut rc, mut rg) = (Generator::new(77), Generator::new(77));
                let want = cpu.round_into(&l, to, rounding, &mut rc).unwrap();
                let got = gpu.round_into(&l, to, rounding, &mut rg).unwrap();
                assert_eq!((got.device(), got.dtype()), (GPU, to));
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "round_into {from:?} -> {to:?} {rounding:?}"
                );
                // Both drew as many numbers.
                assert_eq!(
                    rc.next_u64(),
                    rg.next_u64(),
                    "{from:?} -> {to:?} {rounding:?}"
                );
            }
        }
    }
}
