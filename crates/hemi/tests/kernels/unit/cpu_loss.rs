//! The unit tests of `hemi::cpu::reduce::loss` (`src/cpu/reduce/loss.rs`), run against the built library.

//! A strided target layout and half logits straight into the primitives, against an
//! f64 reference.
use half::f16;
use hemi::backend::loss::{ClassLoss, ClassSaved, LossOps, Reduction};
use hemi::backend::reduce::Rows;
use hemi::cpu::storage::CpuStorage;
use hemi::dtype::DType;
use hemi::tensor::Layout;

#[test]
fn class_loss_reads_a_strided_target_and_its_backward_sums_to_zero() {
    let (n, c) = (3usize, 4usize);
    let x: Vec<f64> = (0..n * c)
        .map(|i| ((i * 5) % 7) as f64 * 0.5 - 1.0)
        .collect();
    let logits = CpuStorage::from_vec(x.iter().map(|&v| f16::from_f64(v)).collect::<Vec<_>>());
    // Targets at every other element of [2, 9, 1, 7, 3]: (2, 1, 3).
    let target = CpuStorage::from_vec(vec![2i64, 9, 1, 7, 3]);
    let lt = Layout::new(vec![3], vec![2], 0);
    let rows = Rows {
        outer: n,
        len: c,
        inner: 1,
    };
    let loss = ClassLoss {
        op: "cross_entropy",
        from_logits: true,
        reduction: Reduction::Mean,
        ignore_index: Some(-100),
        label_smoothing: 0.1,
    };
    let lx = Layout::contiguous(&[n, c]);
    let f = logits
        .class_loss(&lx, &target, &lt, rows, loss, DType::F64)
        .unwrap();
    let t = [2usize, 1, 3];
    let mut want = 0.0;
    for r in 0..n {
        let xr = &x[r * c..(r + 1) * c];
        let lse = xr.iter().map(|v| v.exp()).sum::<f64>().ln();
        let lp: Vec<f64> = xr.iter().map(|v| v - lse).collect();
        want += 0.9 * -lp[t[r]] - 0.1 / c as f64 * lp.iter().sum::<f64>();
    }
    want /= n as f64;
    let got = f.loss.as_slice::<f64>().unwrap()[0];
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    assert_eq!(f.counted, 3);

    let g = CpuStorage::from_vec(vec![1.0f64]);
    let gi = g
        .class_loss_backward(
            &Layout::contiguous(&[1]),
            ClassSaved {
                log_probs: f.log_probs.as_ref(),
                counted: f.counted,
            },
            (&target, &lt),
            rows,
            loss,
            DType::F64,
        )
        .unwrap();
    for r in gi.as_slice::<f64>().unwrap().chunks(c) {
        assert!(r.iter().sum::<f64>().abs() < 1e-12);
    }

    // A target outside the classes is an index error naming the op.
    let bad = CpuStorage::from_vec(vec![2i64, 4, 1]);
    let err = logits
        .class_loss(&lx, &bad, &Layout::contiguous(&[3]), rows, loss, DType::F32)
        .unwrap_err();
    assert!(err.to_string().contains("cross_entropy"), "{err}");
}
