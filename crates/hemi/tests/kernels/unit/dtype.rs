//! The unit tests of `hemi::dtype` (`src/dtype/mod.rs`), run against the built library.

use half::{bf16, f16};
use hemi::dtype::*;

#[test]
fn promotion_follows_pytorch() {
    use DType::*;
    assert_eq!(F16.promote(F32), F32);
    assert_eq!(BF16.promote(F16), F32);
    assert_eq!(BF16.promote(BF16), BF16);
    assert_eq!(F64.promote(F16), F64);
    assert_eq!(I64.promote(BF16), BF16);
}

#[test]
fn with_dtype_round_trips_and_same_slice_checks_the_type() {
    fn check<T: WithDType>(vals: &[f64]) {
        for &v in vals {
            let t = T::from_f64(v);
            assert_eq!(
                T::from_f64(t.to_f64()).to_f64(),
                t.to_f64(),
                "{:?}",
                T::DTYPE
            );
        }
        let buf = hemi::cpu::storage::CpuStorage::from_vec(vec![T::from_f64(1.5); 3]);
        assert_eq!(buf.dtype(), T::DTYPE);
        assert_eq!(buf.as_slice::<T>().map(|s| s.len()), Some(3));
        assert!(buf.clone().into_vec::<T>().is_some());
    }
    let vals = [0.0, -0.0, 1.0, -2.5, 65504.0, 1e-8, 3.0e38];
    check::<f16>(&vals);
    check::<bf16>(&vals);
    check::<f32>(&vals);
    check::<f64>(&vals);
    check::<i64>(&[0.0, -7.0, 9.0e15]);
    // Exact where the value fits, nearest-even otherwise.
    assert_eq!(f16::from_f64(2049.0).to_f64(), 2048.0);
    assert_eq!(<f32 as WithDType>::from_f64(1.0 + 2f64.powi(-24)), 1.0);
    let f = hemi::cpu::storage::CpuStorage::from_vec(vec![1.0f32]);
    assert!(f.as_slice::<f64>().is_none() && f.as_slice::<f16>().is_none());
    assert!(f.into_vec::<i64>().is_none());
    let x = [1.0f32, 2.0];
    assert_eq!(same_slice::<f32, f32>(&x), Some(&x[..]));
    assert_eq!(same_slice::<f32, u32>(&x), None);
}

#[test]
fn finfo_matches_half() {
    let f = DType::F16.finfo().unwrap();
    assert_eq!(f.max, f64::from(f16::MAX.to_f32()));
    assert_eq!(f.min_positive_normal, f64::from(f16::MIN_POSITIVE.to_f32()));
    assert_eq!(f.epsilon, f64::from(f16::EPSILON.to_f32()));
    assert_eq!(
        f.min_positive_subnormal,
        f64::from(f16::from_bits(1).to_f32())
    );
    let b = DType::BF16.finfo().unwrap();
    assert_eq!(b.epsilon, f64::from(bf16::EPSILON.to_f32()));
    assert_eq!(
        b.min_positive_normal,
        f64::from(bf16::MIN_POSITIVE.to_f32())
    );
    assert_eq!(
        b.min_positive_subnormal,
        f64::from(bf16::from_bits(1).to_f32())
    );
    assert!(DType::I64.finfo().is_none());
}
