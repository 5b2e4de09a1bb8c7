//! The unit tests of `hemi::cpu::attention` (`src/cpu/attention.rs`), run against the built library.

use hemi::cpu::attention::*;

/// Rows of odd lengths, some entries masked to -inf or a large negative value.
fn rows() -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut out = Vec::new();
    let mut seed = 12345u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for n in [1usize, 7, 15, 16, 17, 64, 128, 131] {
        let s: Vec<f32> = (0..n).map(|_| 20.0 * next()).collect();
        let m: Vec<f32> = (0..n)
            .map(|j| match j % 5 {
                1 => f32::NEG_INFINITY,
                3 => -1e4,
                _ => 0.5 * next(),
            })
            .collect();
        out.push((s, m));
    }
    out
}

/// The vectorised row loops give the baseline loop's bits, and a softmax within a few
/// F32 ulps of F64's.
#[test]
fn wide_softmax_rows_equal_the_baseline_and_f64() {
    let scale = 0.176_776_7f32;
    for (s, m) in rows() {
        let n = s.len();
        for mask in [None, Some(&m[..])] {
            let mut plain = s.clone();
            let lse_plain = softmax_row_lanes(&mut plain, scale, mask);
            let mut wide = s.clone();
            let lse_wide = softmax_row(&mut wide, scale, mask);
            assert_eq!(lse_plain.to_bits(), lse_wide.to_bits(), "lse, n={n}");
            assert!(plain
                .iter()
                .zip(&wide)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            // F64 reference.
            let z: Vec<f64> = (0..n)
                .map(|j| f64::from(s[j] * scale) + mask.map_or(0.0, |m| f64::from(m[j])))
                .collect();
            let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = z.iter().map(|v| (v - mx).exp()).sum();
            for (j, &p) in wide.iter().enumerate() {
                let want = (z[j] - mx).exp() / sum;
                assert!(
                    (f64::from(p) - want).abs() <= 8.0 * f64::from(f32::EPSILON) * want.max(1e-30),
                    "p[{j}] = {p}, want {want}, n={n}"
                );
            }
            assert!(
                (f64::from(lse_wide) - (mx + sum.ln())).abs()
                    <= 4e-6 * (mx + sum.ln()).abs().max(1.0)
            );
            // The probabilities recomputed from the log-sum-exp, and dS.
            let (mut pp, mut pw) = (s.clone(), s.clone());
            probs_row_lanes(&mut pp, scale, mask, lse_wide);
            probs_row(&mut pw, scale, mask, lse_wide);
            assert!(pp.iter().zip(&pw).all(|(a, b)| a.to_bits() == b.to_bits()));
            for (j, &p) in pw.iter().enumerate() {
                let want = (z[j] - mx).exp() / sum;
                assert!(
                    (f64::from(p) - want).abs() <= 1e-5 * want + 1e-30,
                    "probs n={n}"
                );
            }
            let dp: Vec<f32> = (0..n).map(|j| (j as f32 * 0.37).sin()).collect();
            let (mut dsp, mut dsw) = (dp.clone(), dp.clone());
            ds_row_lanes(&pw, &mut dsp, scale);
            ds_row(&pw, &mut dsw, scale);
            assert!(dsp
                .iter()
                .zip(&dsw)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let d: f64 = pw
                .iter()
                .zip(&dp)
                .map(|(&p, &g)| f64::from(p) * f64::from(g))
                .sum();
            for j in 0..n {
                let want = f64::from(pw[j]) * (f64::from(dp[j]) - d) * f64::from(scale);
                assert!((f64::from(dsw[j]) - want).abs() <= 1e-6, "ds n={n}");
            }
        }
    }
    // A fully masked row: zeros and -inf.
    let mut s = vec![1.0f32; 19];
    let m = vec![f32::NEG_INFINITY; 19];
    assert_eq!(softmax_row(&mut s, 1.0, Some(&m)), f32::NEG_INFINITY);
    assert!(s.iter().all(|&p| p == 0.0));
}
