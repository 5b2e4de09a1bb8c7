//! The unit tests of `hemi::dtype::fastmath` (`src/dtype/fastmath.rs`), run against the built library.

use hemi::dtype::fastmath::*;

/// |got − want| in units of the F32 spacing at want.
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let spacing = f64::from(f32::from_bits(w.abs().to_bits() + 1) - w.abs());
    (f64::from(got) - want).abs() / spacing.max(f64::from(f32::from_bits(1)))
}

/// Every F32 in [0, 5] against F64 erf: within 2.5 ulp; its negation gives exactly the
/// negated value (erf is odd; checked bit for bit, which holds the negatives to the same
/// bound without a second F64 erf per input).
#[test]
fn erf_matches_f64_on_every_f32_up_to_5() {
    let (mut worst, mut at) = (0.0, 0.0);
    let mut bits = 0u32;
    loop {
        let x = f32::from_bits(bits);
        if x > 5.0 {
            break;
        }
        let y = erf_f32(x);
        let e = ulps(y, libm::erf(f64::from(x)));
        if e > worst {
            (worst, at) = (e, x);
        }
        assert_eq!(erf_f32(-x).to_bits(), (-y).to_bits(), "erf(-{x:e})");
        // All inputs where erf is not x·2/√π to F32 precision; a stride of 7 below.
        bits += if x < 1e-4 { 7919 } else { 1 };
    }
    assert!(worst <= 2.5, "erf: {worst} ulp at {at}");
    assert_eq!(erf_f32(10.0), 1.0);
    assert_eq!(erf_f32(f32::INFINITY), 1.0);
    assert_eq!(erf_f32(f32::NEG_INFINITY), -1.0);
    assert!(erf_f32(f32::NAN).is_nan());
    assert_eq!(erf_f32(0.0).to_bits(), 0.0f32.to_bits());
    assert_eq!(erf_f32(-0.0).to_bits(), (-0.0f32).to_bits());
}

/// exp against F64 on every 3rd F32 of [-87, 88]: within 1.5 ulp; edges.
#[test]
fn exp_matches_f64() {
    let mut worst = (0.0, 0.0f32);
    for x in [-87.0f32, 88.0] {
        let mut v = x;
        while v.abs() > 1e-30 {
            let e = ulps(exp_f32(v), f64::from(v).exp());
            if e > worst.0 {
                worst = (e, v);
            }
            let b = v.to_bits();
            v = f32::from_bits(b.saturating_sub(3));
        }
    }
    assert!(worst.0 <= 1.5, "exp: {} ulp at {}", worst.0, worst.1);
    assert_eq!(exp_f32(0.0), 1.0);
    assert_eq!(exp_f32(-100.0), 0.0);
    assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_f32(100.0), f32::INFINITY);
    assert!(exp_f32(f32::NAN).is_nan());
}
