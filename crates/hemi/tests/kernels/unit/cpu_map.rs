//! The unit tests of `hemi::cpu::elementwise::map` (`src/cpu/elementwise/map.rs`), run against the built library.

//! Paths the op tests do not reach: strided and broadcast layouts straight into the
//! primitives, against f64 references.
use half::bf16;
use hemi::backend::map::{BinaryOp, MapOps, UnaryOp};
use hemi::cpu::elementwise::map::*;
use hemi::cpu::storage::CpuStorage;
use hemi::dtype::DType;
use hemi::tensor::Layout;

/// The loops compiled for AVX2 / AVX-512 give the baseline loop's bits for every unary
/// op and its backward, on values across the ranges the polynomials split (|x| < 1,
/// 1..4, beyond), odd lengths (vector tails), infinities, NaN and signed zeros.
#[test]
fn wide_elementwise_loops_equal_the_baseline_loop() {
    let mut x: Vec<f32> = (0..1037).map(|i| (i as f32 - 518.0) * 0.0137).collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0,
        -1.0,
        4.0,
    ]);
    x.extend([88.5, -88.5, 1e-30, -1e-30, 3.999, 1e30]);
    let g: Vec<f32> = (0..x.len()).map(|i| 1.0 - (i % 7) as f32 * 0.25).collect();
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::AddScalar(0.5),
        UnaryOp::MulScalar(-3.0),
        UnaryOp::Clamp(-1.0, 2.0),
        UnaryOp::PowScalar(3.0),
    ];
    let same = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    };
    for op in ops {
        for n in [x.len(), 1, 15, 17] {
            let (xs, gs) = (&x[x.len() - n..], &g[..n]);
            let (mut plain, mut wide) = (vec![0f32; n], vec![0f32; n]);
            unary_loop(op, xs, &mut plain);
            unary_chunk(op, xs, &mut wide);
            assert!(same(&plain, &wide), "{op:?} forward, n {n}");
            #[cfg(target_arch = "x86_64")]
            if hemi::cpu::features::Feature::Avx2.detected() {
                // The AVX2 loop too where the CPU would pick AVX-512.
                // SAFETY: the CPU has AVX2.
                unsafe { x86_loops::unary_avx2(op, xs, &mut wide) };
                assert!(same(&plain, &wide), "{op:?} forward (avx2), n {n}");
            }
            for uses_out in [false, true] {
                unary_backward_loop(op, uses_out, gs, xs, &mut plain);
                unary_backward_chunk(op, uses_out, gs, xs, &mut wide);
                assert!(same(&plain, &wide), "{op:?} backward, n {n}");
                #[cfg(target_arch = "x86_64")]
                if hemi::cpu::features::Feature::Avx2.detected() {
                    // SAFETY: the CPU has AVX2.
                    unsafe { x86_loops::unary_backward_avx2(op, uses_out, gs, xs, &mut wide) };
                    assert!(same(&plain, &wide), "{op:?} backward (avx2), n {n}");
                }
            }
        }
    }
}

#[test]
fn unary_on_a_strided_half_layout_matches_the_chunked_path() {
    let x: Vec<f64> = (0..12).map(|i| i as f64 * 0.375 - 2.0).collect();
    let s = CpuStorage::from_vec(x.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<_>>());
    // The transpose of [3, 4]: not contiguous, so not the chunked kernel.
    let t = Layout::new(vec![4, 3], vec![1, 4], 0);
    let c = s.gather(&t);
    for op in [UnaryOp::Gelu, UnaryOp::Sigmoid, UnaryOp::PowScalar(3.0)] {
        let strided = s.unary(&t, op, DType::F32).unwrap();
        let chunked = c
            .unary(&Layout::contiguous(&[4, 3]), op, DType::F32)
            .unwrap();
        let (a, b) = (
            strided.as_slice::<f32>().unwrap(),
            chunked.as_slice::<f32>().unwrap(),
        );
        assert_eq!(a, b, "{op:?}");
        for (i, &v) in a.iter().enumerate() {
            let xv = x[(i % 3) * 4 + i / 3];
            let want = match op {
                UnaryOp::Sigmoid => 1.0 / (1.0 + (-xv).exp()),
                UnaryOp::PowScalar(p) => xv.powf(p),
                _ => UnaryOp::Gelu.f(xv),
            };
            assert!((v as f64 - want).abs() < 1e-5, "{op:?} {i}: {v} vs {want}");
        }
    }
}

#[test]
fn where_and_its_backward_with_a_broadcast_condition() {
    // cond [3] broadcast over [2, 3] (stride 0 on dim 0); I64, nonzero is true.
    let cond = CpuStorage::from_vec(vec![1i64, 0, -3]);
    let lc = Layout::new(vec![2, 3], vec![0, 1], 0);
    let a = CpuStorage::from_vec((0..6).map(|v| v as f64).collect::<Vec<_>>());
    let b = CpuStorage::from_vec(vec![-1.0f32]);
    let lb = Layout::new(vec![2, 3], vec![0, 0], 0);
    let la = Layout::contiguous(&[2, 3]);
    let y = cond
        .where_cond(&lc, (&a, &la), (&b, &lb), DType::F64)
        .unwrap();
    assert_eq!(
        y.as_slice::<f64>().unwrap(),
        &[0.0, -1.0, 2.0, 3.0, -1.0, 5.0]
    );
    let g = CpuStorage::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let (ga, gb) = cond.where_backward(&lc, &g, &la, DType::F32).unwrap();
    assert_eq!(
        ga.as_slice::<f32>().unwrap(),
        &[1.0, 0.0, 3.0, 4.0, 0.0, 6.0]
    );
    assert_eq!(
        gb.as_slice::<f32>().unwrap(),
        &[0.0, 2.0, 0.0, 0.0, 5.0, 0.0]
    );
}

#[test]
fn minmax_backward_splits_ties_with_a_broadcast_input() {
    let g = CpuStorage::from_vec(vec![2.0f32; 4]);
    let a = CpuStorage::from_vec(vec![1.0f32, 3.0, 0.0, 5.0]);
    let b = CpuStorage::from_vec(vec![3.0f32]);
    let l = Layout::contiguous(&[4]);
    let lb = Layout::new(vec![4], vec![0], 0);
    let (ga, gb) = g
        .minmax_backward(&l, (&a, &l), (&b, &lb), BinaryOp::Maximum, DType::F32)
        .unwrap();
    assert_eq!(ga.as_slice::<f32>().unwrap(), &[0.0, 1.0, 0.0, 2.0]);
    assert_eq!(gb.as_slice::<f32>().unwrap(), &[2.0, 1.0, 2.0, 0.0]);
}
