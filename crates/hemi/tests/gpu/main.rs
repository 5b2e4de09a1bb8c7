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

/// True when `gpu:0` has `SHADER_F16` (the native F16 route); else prints `SKIPPED (the
/// adapter lacks SHADER_F16)`, or fails under `HEMI_REQUIRE_SHADER_F16=1` (CI: lavapipe has
/// it, so the native route must run there).
fn have_shader_f16(test: &str) -> bool {
    let ctx = hemi::gpu::context(0).unwrap();
    if ctx.info().shader_f16 {
        return true;
    }
    if std::env::var("HEMI_REQUIRE_SHADER_F16").as_deref() == Ok("1") {
        panic!(
            "{test}: HEMI_REQUIRE_SHADER_F16=1 but {} lacks SHADER_F16",
            ctx.info().name
        );
    }
    eprintln!("{test}: SKIPPED (the adapter lacks SHADER_F16)");
    false
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
    both_routes(|_route| {
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
    });
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
    both_routes(|_route| {
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
    });
}

#[test]
fn unary_maps_match_the_cpu() {
    need_gpu!("unary_maps_match_the_cpu");
    both_routes(|_route| {
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
    });
}

#[test]
fn binary_maps_broadcast_over_strided_layouts() {
    need_gpu!("binary_maps_broadcast_over_strided_layouts");
    both_routes(|_route| {
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
    });
}

#[test]
fn reductions_match_the_cpu() {
    need_gpu!("reductions_match_the_cpu");
    both_routes(|_route| {
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
    });
}

#[test]
fn matmul_batched_broadcast_transposed_with_bias() {
    need_gpu!("matmul_batched_broadcast_transposed_with_bias");
    both_routes(|_route| {
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
    });
}

/// Softmax and layer norm are default compositions (reduce, binary, unary): they run on
/// the GPU as soon as those exist, and match the CPU's fused kernels.
#[test]
fn compositions_run_on_the_gpu() {
    need_gpu!("compositions_run_on_the_gpu");
    both_routes(|_route| {
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
    });
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
    both_routes(|_route| {
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
    });
}

/// Runs `f` on both F16 routes: the native one (`array<f16>`, where the adapter has
/// `SHADER_F16`) and the packed-`u32` fallback (`hemi::gpu::with_packed_halves`), checking
/// that each is the route taken.
fn both_routes(f: impl Fn(&str)) {
    let ctx = hemi::gpu::context(0).unwrap();
    assert_eq!(ctx.native_f16(), ctx.info().shader_f16);
    if have_shader_f16("the native F16 route") {
        assert!(ctx.native_f16());
        eprintln!("route: native f16");
        f("native f16");
    }
    hemi::gpu::with_packed_halves(|| {
        assert!(!ctx.native_f16());
        eprintln!("route: packed f16");
        f("packed f16");
    });
    assert_eq!(ctx.native_f16(), ctx.info().shader_f16);
}

/// Low 12 bits combined with every value of the high 20 (sign, exponent, the mantissa's
/// top 11 bits) in `dense_f32_bits`: zero, the least, ties and their neighbours at every
/// bit position from 0 to 11, all ones.
const LOW_BITS: [u32; 16] = [
    0, 1, 2, 3, 0x10, 0x100, 0x3ff, 0x400, 0x555, 0x7ff, 0x800, 0x801, 0xaaa, 0xc00, 0xffe, 0xfff,
];

/// F32 bit patterns `i` in `range` of the dense set of 2^24: `(i >> 4) << 12 | LOW_BITS[i &
/// 15]`. Every sign and exponent, every F16 result with either parity of its last bit, and
/// below F16's last kept bit (bit 13 for normals, higher for F16 subnormals; bit 16 for
/// BF16) the round bit set or clear with the sticky bits zero (a tie) or not: so every
/// rounding case (ties to even, subnormal results, the overflow edge at 65520, infinities,
/// NaN payloads) of both half dtypes.
fn dense_f32_bits(range: std::ops::Range<u32>) -> Vec<u32> {
    range
        .map(|i| ((i >> 4) << 12) | LOW_BITS[(i & 15) as usize])
        .collect()
}

/// The first mismatches of `got` against `want` (u16 bit patterns of F16 results of the
/// F32 inputs `x`), and their count.
fn half_mismatches(x: &[u32], got: &[u16], want: &[u16]) -> (usize, Vec<String>) {
    let bad: Vec<usize> = (0..x.len()).filter(|&i| got[i] != want[i]).collect();
    let shown = bad
        .iter()
        .take(8)
        .map(|&i| {
            format!(
                "{:#010x} ({:e}): got {:#06x}, want {:#06x}",
                x[i],
                f32::from_bits(x[i]),
                got[i],
                want[i]
            )
        })
        .collect();
    (bad.len(), shown)
}

/// What decided how the native route stores F16 (the `gpu::shaders` module doc): WGSL's own
/// `f16(x)` conversion on this adapter against the CPU's (round-to-nearest-even, NaN payload
/// kept) over the dense set of F32 patterns. WGSL leaves the rounding of an inexact
/// conversion, and the result of a NaN, to the implementation. On lavapipe every finite
/// input rounds as on the CPU but every NaN comes out as the canonical 0x7e00 (sign kept),
/// payload lost: so hemi rounds on the bits (`f2h`) and stores words on both routes, which
/// `f16_and_bf16_casts_match_the_cpu_on_a_dense_set` holds to the CPU. On lavapipe this
/// asserts that finding; elsewhere it reports the adapter's behaviour.
#[test]
fn wgsl_native_f16_conversion_drops_nan_payloads_on_lavapipe() {
    need_gpu!("wgsl_native_f16_conversion_drops_nan_payloads_on_lavapipe");
    if !have_shader_f16("wgsl_native_f16_conversion_drops_nan_payloads_on_lavapipe") {
        return;
    }
    let ctx = hemi::gpu::context(0).unwrap();
    let src = "enable f16;\n\
        @group(0) @binding(0) var<storage, read> p: array<u32>;\n\
        @group(0) @binding(1) var<storage, read_write> out: array<f16>;\n\
        @group(0) @binding(2) var<storage, read_write> x: array<u32>;\n\
        @compute @workgroup_size(64)\n\
        fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {\n\
            let t = gid.x + gid.y * nw.x * 64u;\n\
            if (t >= p[0]) { return; }\n\
            out[t] = f16(bitcast<f32>(x[t]));\n\
        }\n";
    const CHUNK: u32 = 1 << 22;
    let (mut bad, mut bad_nan, mut shown) = (0, 0, Vec::new());
    for c in 0..4 {
        let x = dense_f32_bits(c * CHUNK..(c + 1) * CHUNK);
        let bytes: Vec<u8> = x.iter().flat_map(|w| w.to_le_bytes()).collect();
        let input = ctx.upload_bytes(&bytes).unwrap();
        let out = ctx.alloc(x.len() * 2).unwrap();
        ctx.launch(
            "f16 probe",
            src,
            &[x.len() as u32],
            &out,
            &[&input],
            hemi::gpu::context::groups_1d(x.len()),
        )
        .unwrap();
        let got: Vec<u16> = ctx
            .download_bytes(&out, x.len() * 2)
            .unwrap()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let host = CpuStorage::from_vec(x.iter().map(|&b| f32::from_bits(b)).collect());
        let want = host.cast(&Layout::contiguous(&[x.len()]), DType::F16);
        let want: Vec<u16> = want
            .as_slice::<half::f16>()
            .unwrap()
            .iter()
            .map(|h| h.to_bits())
            .collect();
        let (n, s) = half_mismatches(&x, &got, &want);
        bad += n;
        bad_nan += (0..x.len())
            .filter(|&i| got[i] != want[i] && f32::from_bits(x[i]).is_nan())
            .count();
        shown.extend(s);
    }
    eprintln!(
        "{}: WGSL f16(x) differs from the CPU on {bad} of {} patterns ({bad_nan} NaNs): \
         {shown:#?}",
        ctx.info().name,
        4 * CHUNK
    );
    if ctx.info().name.contains("llvmpipe") {
        // Measured on Mesa 22.3.6: the 65,408 NaNs whose payload has bits F16 keeps (mantissa
        // bits 13..21), and nothing finite.
        assert_eq!(
            bad, bad_nan,
            "lavapipe rounds a finite value differently: {shown:#?}"
        );
        assert!(
            bad_nan > 0,
            "lavapipe now keeps NaN payloads: f16(x) could store natively"
        );
    }
}

/// Casts between F32 and the half dtypes are the CPU's bit for bit on both F16 routes:
/// F32 -> F16 and F32 -> BF16 over the dense set of F32 patterns (every rounding case), and
/// every one of the 65,536 F16 and BF16 patterns (subnormals, infinities, NaN payloads) into
/// F32, with an odd count and an odd offset.
#[test]
fn f16_and_bf16_casts_match_the_cpu_on_a_dense_set() {
    need_gpu!("f16_and_bf16_casts_match_the_cpu_on_a_dense_set");
    both_routes(|route| {
        const CHUNK: u32 = 1 << 22;
        for c in 0..4 {
            let x = dense_f32_bits(c * CHUNK..(c + 1) * CHUNK);
            let (cpu, gpu) = pair(CpuStorage::from_vec(
                x.iter().map(|&b| f32::from_bits(b)).collect(),
            ));
            let l = Layout::contiguous(&[x.len()]);
            for to in [DType::F16, DType::BF16] {
                let want = bits(&cpu.cast(&l, to).unwrap());
                let got = bits(&gpu.cast(&l, to).unwrap());
                let u16s = |b: &[u8]| -> Vec<u16> {
                    b.chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect()
                };
                let (n, shown) = half_mismatches(&x, &u16s(&got), &u16s(&want));
                assert_eq!(n, 0, "{route}: F32 -> {to:?}: {shown:#?}");
            }
        }
        for from in [DType::F16, DType::BF16] {
            // Every 16-bit pattern from element 1 on (odd offset, odd count 65,535).
            let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
            let (cpu, gpu) = pair(CpuStorage::from_le_bytes(from, &all).unwrap());
            let l = Layout::new(vec![65_535], vec![1], 1);
            let want = bits(&cpu.cast(&l, DType::F32).unwrap());
            let got = bits(&gpu.cast(&l, DType::F32).unwrap());
            if got != want {
                let i = (0..65_535).find(|&i| got[4 * i..4 * i + 4] != want[4 * i..4 * i + 4]);
                panic!(
                    "{route}: {from:?} -> F32 differs at pattern {:?}",
                    i.map(|i| i + 1)
                );
            }
        }
    });
}

/// Out of memory and a shader that fails to compile are `Error`s naming the device and the
/// fix, and the device stays usable after them.
#[test]
fn out_of_memory_and_bad_shaders_are_errors() {
    need_gpu!("out_of_memory_and_bad_shaders_are_errors");
    let ctx = hemi::gpu::context(0).unwrap();
    // One byte more than the adapter's largest buffer, and a size no device has.
    for bytes in [ctx.info().max_binding as usize + 1, usize::MAX / 2] {
        let e = ctx.alloc(bytes).unwrap_err().to_string();
        assert!(
            e.contains("out of memory") && e.contains("gpu:0") && e.contains("--device cpu"),
            "{bytes} bytes: {e}"
        );
    }
    // A tensor too large for one buffer: its upload is the same error.
    let n = ctx.info().max_binding as usize / 4 + 1;
    if n <= 1 << 28 {
        let big = Tensor::from_vec(vec![0f32; n], &[n]).unwrap();
        let e = big.to_device(GPU).unwrap_err().to_string();
        assert!(e.contains("out of memory") && e.contains("gpu:0"), "{e}");
    }
    // WGSL that does not parse, and WGSL that parses but does not validate.
    let out = ctx.alloc(16).unwrap();
    for src in [
        "this is not wgsl",
        "@group(0) @binding(0) var<storage, read> p: array<u32>;\n\
         @compute @workgroup_size(64) fn main() { let x: f32 = p[0]; }",
    ] {
        let e = ctx
            .launch("bad kernel", src, &[1], &out, &[], (1, 1, 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("failed to compile") && e.contains("gpu:0") && e.contains("--device cpu"),
            "{e}"
        );
    }
    // The device still works (a product rounds the same on both backends).
    let t = Tensor::from_vec(vec![1.5f32, -2.0, 3.1], &[3]).unwrap();
    let g = t.to_device(GPU).unwrap();
    let back = g.mul(&g).unwrap();
    assert_eq!(
        back.try_to_vec_f32().unwrap(),
        t.mul(&t).unwrap().to_vec_f32()
    );
}

/// A lost device (destroyed here, on a context of its own so the shared `gpu:0` is not
/// disturbed) makes every later use an `Error` naming the device and the fix: launches,
/// uploads, read-backs of its tensors (`try_to_vec_*`, `to_scalar`, `to_device`).
#[test]
fn a_lost_device_is_an_error_not_a_panic() {
    need_gpu!("a_lost_device_is_an_error_not_a_panic");
    let ctx = hemi::gpu::GpuContext::open(0).unwrap();
    let host = CpuStorage::from_vec(vec![1.0f32, 2.0, 3.0]);
    let s = hemi::gpu::GpuStorage::from_host_on(&ctx, &host).unwrap();
    let t = Tensor::from_storage(
        std::sync::Arc::new(Storage::Gpu(s)),
        Layout::contiguous(&[3]),
    );
    assert_eq!(t.try_to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0]);
    let one = t.sum_all().unwrap();
    ctx.destroy();
    let lost = |what: &str, e: hemi::Error| {
        let e = e.to_string();
        assert!(
            e.contains("gpu:0") && e.contains("lost") && e.contains("--device cpu"),
            "{what}: {e}"
        );
    };
    lost("try_to_vec_f32", t.try_to_vec_f32().unwrap_err());
    lost("try_to_vec_f64", t.try_to_vec_f64().unwrap_err());
    lost("to_scalar", one.to_scalar().unwrap_err());
    lost("to_device", t.to_device(Device::Cpu).unwrap_err());
    lost("exp", t.exp().unwrap_err());
    lost("upload", ctx.upload_bytes(&[0; 8]).unwrap_err());
    let out = ctx.alloc(16);
    if let Ok(out) = out {
        lost(
            "launch",
            ctx.launch("k", "not run", &[], &out, &[], (1, 1, 1))
                .unwrap_err(),
        );
    }
    // The shared device is untouched.
    let t = Tensor::from_vec(vec![4.0f32], &[1]).unwrap();
    assert_eq!(
        t.to_device(GPU).unwrap().try_to_vec_f32().unwrap(),
        vec![4.0]
    );
}

/// Without a Vulkan driver the context is an `Error` naming the device and the fix: this
/// test runs `no_adapter_child` in a child process whose Vulkan loader finds no driver.
#[test]
fn no_adapter_is_an_error_naming_the_fix() {
    need_gpu!("no_adapter_is_an_error_naming_the_fix");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["no_adapter_child", "--exact", "--ignored", "--nocapture"])
        .env("HEMI_GPU_TEST_CHILD", "1")
        .env("VK_ICD_FILENAMES", "/nonexistent/hemi_icd.json")
        .env("VK_DRIVER_FILES", "/nonexistent/hemi_icd.json")
        .env_remove("VK_ADD_DRIVER_FILES")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

/// The child of `no_adapter_is_an_error_naming_the_fix` (ignored unless run by it).
#[test]
#[ignore = "run by no_adapter_is_an_error_naming_the_fix with no Vulkan driver"]
fn no_adapter_child() {
    if std::env::var("HEMI_GPU_TEST_CHILD").as_deref() != Ok("1") {
        return;
    }
    assert_eq!(hemi::gpu::device_count(), 0);
    let e = hemi::gpu::context(0).unwrap_err().to_string();
    assert!(
        e.contains("gpu:0") && e.contains("mesa-vulkan-drivers") && e.contains("--device cpu"),
        "{e}"
    );
    let t = Tensor::from_vec(vec![1.0f32], &[1]).unwrap();
    let e = t.to_device(GPU).unwrap_err().to_string();
    assert!(
        e.contains("gpu:0") && e.contains("mesa-vulkan-drivers"),
        "{e}"
    );
}

/// The native route's kernels read F16 as `array<f16>` under `enable f16;` (maps, reductions,
/// matmul, convolutions), and the packed route's never mention f16; BF16 and stores are
/// words on both.
#[test]
fn the_routes_generate_native_and_packed_kernels() {
    use hemi::gpu::shaders::{self, Load};
    let f16_in = [(DType::F16, Load::Value), (DType::BF16, Load::Value)];
    for native in [true, false] {
        let kernels = [
            shaders::map(&f16_in, "", "a + b", DType::F16, false, native),
            shaders::reduce(DType::F16, "sum", native),
            shaders::matmul(DType::F16, DType::F32, true, native),
        ];
        for k in &kernels {
            assert_eq!(k.starts_with("enable f16;"), native, "{k}");
            assert_eq!(k.contains("array<f16>"), native, "{k}");
            assert!(
                k.contains("var<storage, read_write> out: array<u32>"),
                "{k}"
            );
        }
    }
    // Bit copies and `where`'s condition read words on either route.
    let copy = shaders::map(&[(DType::F16, Load::Bits)], "", "a", DType::F16, true, true);
    assert!(!copy.contains("f16;"), "{copy}");
    // BF16 has no WGSL type: packed on the native route too.
    let bf = shaders::map(
        &[(DType::BF16, Load::Value)],
        "",
        "a",
        DType::F32,
        false,
        true,
    );
    assert!(!bf.contains("f16;"), "{bf}");
    let conv = shaders::conv2d("f16", "f32");
    assert!(conv.starts_with("enable f16;") && conv.contains("x: array<f16>"));
    assert!(!shaders::conv2d("f32", "f32").contains("f16"));
}

/// Every one of the 2^32 F32 patterns cast into F16 and BF16 on both routes, bit for bit
/// the CPU's. About 5 minutes a route on lavapipe with 2 cores (the dense set of
/// `f16_and_bf16_casts_match_the_cpu_on_a_dense_set` covers every rounding case in a
/// second): `--ignored` runs it. Passed on lavapipe (Mesa 22.3.6), both routes.
#[test]
#[ignore = "all 2^32 F32 patterns: minutes on lavapipe"]
fn every_f32_pattern_casts_like_the_cpu() {
    need_gpu!("every_f32_pattern_casts_like_the_cpu");
    const CHUNK: u64 = 1 << 22;
    both_routes(|route| {
        let start = std::time::Instant::now();
        for c in 0..(1u64 << 32) / CHUNK {
            let x: Vec<u32> = (c * CHUNK..(c + 1) * CHUNK).map(|b| b as u32).collect();
            let (cpu, gpu) = pair(CpuStorage::from_vec(
                x.iter().map(|&b| f32::from_bits(b)).collect(),
            ));
            let l = Layout::contiguous(&[x.len()]);
            for to in [DType::F16, DType::BF16] {
                let want = bits(&cpu.cast(&l, to).unwrap());
                let got = bits(&gpu.cast(&l, to).unwrap());
                if got != want {
                    let u16s = |b: &[u8]| -> Vec<u16> {
                        b.chunks_exact(2)
                            .map(|b| u16::from_le_bytes([b[0], b[1]]))
                            .collect()
                    };
                    let (n, shown) = half_mismatches(&x, &u16s(&got), &u16s(&want));
                    panic!("{route}: F32 -> {to:?}: {n} mismatches in chunk {c}: {shown:#?}");
                }
            }
        }
        eprintln!("{route}: 2^32 patterns in {:?}", start.elapsed());
    });
}
