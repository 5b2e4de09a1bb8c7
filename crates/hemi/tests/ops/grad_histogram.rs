//! The `floor(log2 |x|)` histogram behind `--grad-stats` and `hemi plot`: exact exponents
//! over F32's whole range (subnormals included), and the storage primitive on F32/F16/BF16
//! tensors read through strided views, against an f64 reference.

use hemi::train::Log2Histogram;
use hemi::{DType, Tensor};

/// The reference: floor(log2 |x|) in f64, where every F32 is exact.
fn exponent_f64(x: f32) -> i32 {
    f64::from(x).abs().log2().floor() as i32
}

#[test]
fn exponents_are_exact_on_every_binade_edge_and_subnormal() {
    let mut cases = vec![
        f32::MIN_POSITIVE,
        f32::MAX,
        1.0,
        1.5,
        65504.0,
        2f32.powi(-24),
    ];
    for e in -149..=127 {
        let p = if e < -126 {
            f32::from_bits(1u32 << (e + 149))
        } else {
            f32::from_bits(((e + 127) as u32) << 23)
        };
        cases.extend([p, -p, f32::from_bits(p.to_bits() - 1), p * 1.75]);
    }
    // Every 4099th bit pattern across all positive finite values.
    cases.extend((1u32..0x7f80_0000).step_by(4099).map(f32::from_bits));
    for x in cases.into_iter().filter(|x| x.is_finite() && *x != 0.0) {
        assert_eq!(Log2Histogram::exponent(x), exponent_f64(x), "{x:e}");
    }
    assert_eq!(Log2Histogram::exponent(f32::from_bits(1)), -149);
    assert_eq!(Log2Histogram::exponent(f32::MAX), 127);
}

#[test]
fn histogram_primitive_matches_reference_per_dtype_on_strided_views() {
    // Values spread over 2^-40 .. 2^20 with both signs, zeros and non-finite ones; as a
    // [13, 11] tensor read transposed (a non-contiguous layout).
    let mut vals: Vec<f32> = (0..143)
        .map(|i| {
            let e: i32 = (i * 7919 % 61) - 40;
            let m = 1.0 + (i % 17) as f32 / 17.0;
            let s = if i % 3 == 0 { -1.0 } else { 1.0 };
            s * m * 2f32.powi(e)
        })
        .collect();
    vals[5] = 0.0;
    vals[77] = -0.0;
    vals[100] = f32::INFINITY;
    vals[101] = f32::NAN;
    let base = Tensor::from_vec(vals, &[13, 11]).unwrap();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let t = base.to_dtype(dt).unwrap().t().unwrap();
        assert!(!t.layout().is_contiguous());
        let got = t.storage().log2_histogram(t.layout()).unwrap();
        // Reference: the values as the tensor holds them (rounded to dtype), in f64.
        let mut want = Log2Histogram::default();
        for x in t.to_vec_f64() {
            if x == 0.0 {
                want.zeros += 1;
            } else if !x.is_finite() {
                want.nonfinite += 1;
            } else {
                let e = x.abs().log2().floor() as i32;
                want.counts[(e - Log2Histogram::E_MIN) as usize] += 1;
            }
        }
        assert_eq!(got, want, "{dt:?}");
        assert_eq!(got.total(), 143);
        // F16 flushes what lies below 2^-24 to zero: those become zeros, not counts.
        if dt == DType::F16 {
            assert_eq!(got.count_between(Log2Histogram::E_MIN, -25), 0);
            assert!(got.zeros > 2, "F16 underflowed values are zeros");
        }
    }
    let ids = Tensor::from_vec(vec![1i64, 2], &[2]).unwrap();
    assert!(ids.storage().log2_histogram(ids.layout()).is_err());
}

#[test]
fn count_between_clamps_to_the_range() {
    let mut h = Log2Histogram::default();
    for x in [1e-45f32, 1e-30, 1.0, 3.0, 1e38] {
        h.add(x);
    }
    assert_eq!(h.count_between(-1000, 1000), 5);
    assert_eq!(h.count_between(0, 1), 2);
    assert_eq!(h.count_between(-149, -149), 1);
    assert_eq!(h.count_between(200, 300), 0);
    assert_eq!(h.count_between(5, -5), 0);
}

#[test]
fn f16_lost_share_counts_what_leaves_the_window_after_the_shift() {
    let mut h = Log2Histogram::default();
    // 2^-30 (lost unscaled, kept at 2^16), 1.0 (kept), 2^20 (overflows), a zero (kept), a NaN.
    for x in [2f32.powi(-30), 1.0, 2f32.powi(20), 0.0, f32::NAN] {
        h.add(x);
    }
    assert_eq!(h.f16_lost_share(0), 3.0 / 5.0);
    // x 2^16: 2^-14 kept, but 1.0 becomes 2^16, F16's first overflowing binade.
    assert_eq!(h.f16_lost_share(16), 3.0 / 5.0);
    // x 2^10: 2^-20 and 2^10 kept, 2^30 lost.
    assert_eq!(h.f16_lost_share(10), 2.0 / 5.0);
    // / 2^4: 2^-34 lost, 2^-4 kept, 2^16 lost; / 2^5: 2^15 kept.
    assert_eq!(h.f16_lost_share(-4), 3.0 / 5.0);
    assert_eq!(h.f16_lost_share(-5), 2.0 / 5.0);
    assert_eq!(Log2Histogram::default().f16_lost_share(0), 0.0);
    let bins: Vec<(i32, u64)> = h.nonzero_bins().collect();
    assert_eq!(bins, [(-30, 1), (0, 1), (20, 1)]);
}
