//! The unit tests of `hemi::rng` (`src/rng.rs`), run against the built library.

use half::bf16;
use hemi::rng::*;

/// The vector builds of `keep_factors` decide every element as `keep53` does, at odd
/// bases and lengths (vector tails), for 4-, 2- and 8-byte factors, and drop about `p`.
#[test]
fn keep_factors_equal_keep53_element_by_element() {
    for (p, base, n) in [
        (0.1, 0u64, 1037usize),
        (0.5, 12_345, 77),
        (0.9, u64::MAX - 40, 100),
    ] {
        let (seed, t) = (0x5EED_u64.wrapping_mul(base | 1), threshold53(p));
        let want: Vec<bool> = (0..n as u64)
            .map(|j| keep53(seed, base.wrapping_add(j), t))
            .collect();
        let mut f32s = vec![7.0f32; n];
        keep_factors(seed, base, t, 2.0, 0.0, &mut f32s);
        let mut bf16s = vec![bf16::ONE; n];
        keep_factors(seed, base, t, bf16::from_f32(2.0), bf16::ZERO, &mut bf16s);
        let mut f64s = vec![7.0f64; n];
        keep_factors(seed, base, t, 2.0, 0.0, &mut f64s);
        for j in 0..n {
            let w = if want[j] { 2.0 } else { 0.0 };
            assert_eq!(f32s[j], w as f32, "f32 element {j} of base {base}");
            assert_eq!(bf16s[j].to_f32(), w as f32, "bf16 element {j}");
            assert_eq!(f64s[j], w, "f64 element {j}");
        }
        if n > 1000 {
            let dropped = want.iter().filter(|&&k| !k).count() as f64 / n as f64;
            assert!((dropped - p).abs() < 0.05, "dropped {dropped} for p {p}");
        }
    }
}
