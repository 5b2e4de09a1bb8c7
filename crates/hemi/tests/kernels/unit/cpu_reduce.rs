//! The unit tests of `hemi::cpu::reduce` (`src/cpu/reduce/mod.rs`), run against the built library.

//! Paths the op tests do not reach: permuted (non-contiguous) layouts straight into the
//! primitives, against f64 references.
use half::f16;
use hemi::backend::reduce::{ReduceOp, ReduceOps, Rows};
use hemi::cpu::storage::CpuStorage;
use hemi::dtype::DType;
use hemi::tensor::Layout;

/// A [2, 3, 4] buffer of small distinct values (exact in F16) and the layout that
/// moves dim 1 last (reduce over dim 1: outer 8, inner 3).
fn permuted() -> (Vec<f64>, CpuStorage, Layout) {
    let x: Vec<f64> = (0..24)
        .map(|i| ((i * 7) % 24) as f64 * 0.25 - 2.0)
        .collect();
    let s = CpuStorage::from_vec(x.iter().map(|&v| f16::from_f64(v)).collect::<Vec<_>>());
    (x, s, Layout::new(vec![2, 4, 3], vec![12, 1, 4], 0))
}

fn row(x: &[f64], o: usize) -> Vec<f64> {
    let (a, c) = (o / 4, o % 4);
    (0..3).map(|b| x[a * 12 + b * 4 + c]).collect()
}

#[test]
fn reduce_reads_a_permuted_half_layout() {
    let (x, s, l) = permuted();
    for op in [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Var { correction: 1 },
    ] {
        let got = s.reduce(&l, 8, 3, op, DType::F32).unwrap();
        let got = got.as_slice::<f32>().unwrap();
        for (o, &v) in got.iter().enumerate() {
            let r = row(&x, o);
            let mean = r.iter().sum::<f64>() / 3.0;
            let want = match op {
                ReduceOp::Sum => r.iter().sum(),
                ReduceOp::Mean => mean,
                ReduceOp::Max => r.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => r.iter().cloned().fold(f64::MAX, f64::min),
                ReduceOp::Var { .. } => r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 2.0,
            };
            assert!(
                (v as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{op:?} row {o}: {v} vs {want}"
            );
        }
    }
}

#[test]
fn extreme_backward_splits_ties_in_a_permuted_layout() {
    // Rows of 3 along dim 1 of [2, 3, 2]; row (0, 0) holds a tie.
    let x = [
        1.0f32, 5.0, 3.0, 2.0, 3.0, 0.0, 4.0, 4.0, 4.0, 1.0, 9.0, 2.0,
    ];
    let s = CpuStorage::from_vec(x.to_vec());
    let l = Layout::new(vec![2, 2, 3], vec![6, 1, 2], 0);
    let m = s.reduce(&l, 4, 3, ReduceOp::Max, DType::F32).unwrap();
    assert_eq!(m.as_slice::<f32>().unwrap(), &[3.0, 5.0, 9.0, 4.0]);
    let g = CpuStorage::from_vec(vec![1.0f32, 2.0, 3.0, 4.0]);
    let c = Layout::contiguous(&[4]);
    let gi = s
        .extreme_backward(&l, (&m, &c), (&g, &c), (4, 3), DType::F32)
        .unwrap();
    // Row-major in the permuted order: rows (x[0], x[2], x[4]) = (1, 3, 3) share 1.
    let want = [0.0, 0.5, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0];
    assert_eq!(gi.as_slice::<f32>().unwrap(), &want);
}

#[test]
fn extreme_dim_and_softmax_with_inner_rows() {
    let (x, s, _) = permuted();
    // Along dim 1 of [2, 3, 4]: outer 2, len 3, inner 4, read through the contiguous
    // layout.
    let rows = Rows {
        outer: 2,
        len: 3,
        inner: 4,
    };
    let l = Layout::contiguous(&[2, 3, 4]);
    let (v, i) = s.extreme_dim(&l, rows, ReduceOp::Min, DType::F32).unwrap();
    let (v, i) = (v.as_slice::<f32>().unwrap(), i.as_slice::<i64>().unwrap());
    for r in 0..8 {
        let want = row(&x, r);
        let k = (0..3)
            .min_by(|&a, &b| want[a].partial_cmp(&want[b]).unwrap())
            .unwrap();
        assert_eq!((v[r] as f64, i[r] as usize), (want[k], k), "row {r}");
    }
    let g = CpuStorage::from_vec((1..=8).map(|v| v as f32).collect::<Vec<_>>());
    let c = Layout::contiguous(&[8]);
    let idx = CpuStorage::from_vec(i.to_vec());
    let gi = g
        .extreme_dim_backward(&c, &idx, &c, rows, DType::F32)
        .unwrap();
    let gi = gi.as_slice::<f32>().unwrap();
    for r in 0..8 {
        assert_eq!(gi[rows.start(r) + i[r] as usize * 4], (r + 1) as f32);
    }
    assert_eq!(gi.iter().filter(|&&v| v != 0.0).count(), 8);

    let y = s.softmax(&l, rows, false, DType::F64).unwrap();
    let y = y.as_slice::<f64>().unwrap();
    for r in 0..8 {
        let xr = row(&x, r);
        let z: f64 = xr.iter().map(|v| v.exp()).sum();
        for k in 0..3 {
            let got = y[rows.start(r) + k * 4];
            assert!((got - xr[k].exp() / z).abs() < 1e-12, "row {r} class {k}");
        }
    }
}
