//! The unit tests of `hemi::dist::ring` (`src/dist/ring.rs`), run against the built library.

use hemi::dist::ring::*;

#[test]
fn chunks_cover_the_buffer_once() {
    for n in [0usize, 1, 2, 7, 100] {
        for parts in 1..6 {
            let mut next = 0;
            for c in 0..parts {
                let r = chunk(n, parts, c);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }
}

#[test]
fn prescale_keeps_sums_below_f16_max() {
    for &amax in &[1e-30f32, 1e-8, 0.5, 1.0, 3.0, 1000.0, 65504.0, 3e38] {
        for ranks in [2usize, 3, 8, 512] {
            let k = f16_prescale_exponent(amax, ranks);
            let top = ranks as f64 * amax as f64 * (k as f64).exp2();
            assert!(
                top <= 32768.0 || k == -120,
                "amax {amax} ranks {ranks} k {k}"
            );
            // One more doubling would exceed the bound (unless clamped).
            assert!(
                top * 2.0 > 32768.0 || k.abs() == 120,
                "amax {amax} ranks {ranks} k {k}"
            );
        }
    }
    assert_eq!(f16_prescale_exponent(0.0, 4), 0);
}
