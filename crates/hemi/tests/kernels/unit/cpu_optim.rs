//! The unit tests of `hemi::cpu::elementwise::optim` (`src/cpu/elementwise/optim.rs`), run against the built library.

use hemi::backend::train::{AdamScalars, SgdScalars};
use hemi::cpu::elementwise::optim::*;

/// Values in [-1, 1) with a spread of magnitudes, different for each `k` (the optimizer
/// kernels' unit tests).
fn data(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i * 7919 + k * 104_729) % 2003) as f32 / 1001.5 - 1.0;
            x * [1.0, 1e-3, 37.0][i % 3]
        })
        .collect()
}

fn sgd_agree<const WD: bool, const M: bool, const F: bool, const N: bool>() {
    let s = SgdScalars {
        neg_lr: -0.0123,
        weight_decay: 1e-3,
        momentum: 0.9,
        keep: 0.7,
    };
    // Lengths around 8- and 16-lane vectors and their tails.
    for n in [1, 7, 8, 9, 15, 17, 31, 33, 100] {
        let (mut p1, g, mut b1) = (data(n, 1), data(n, 2), data(n, 3));
        let (mut p2, mut b2) = (p1.clone(), b1.clone());
        let (b1, b2): (&mut [f32], &mut [f32]) = if M {
            (&mut b1, &mut b2)
        } else {
            (&mut [], &mut [])
        };
        sgd_loop::<WD, M, F, N>(&mut p1, &g, b1, s); // the FMA build where there is one
        sgd_kernel::<WD, M, F, N>(&mut p2, &g, b2, s); // the portable build
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p1), bits(&p2), "n {n}");
        assert_eq!(bits(b1), bits(b2), "n {n}");
    }
}

#[test]
fn sgd_fma_and_portable_builds_give_the_same_bits() {
    sgd_agree::<false, false, false, false>();
    sgd_agree::<true, false, false, false>();
    sgd_agree::<false, true, true, false>();
    sgd_agree::<true, true, false, false>();
    sgd_agree::<true, true, false, true>();
    sgd_agree::<false, true, false, true>();
}

fn adam_agree<const DECAY: u8, const AMSGRAD: bool>(lerp_small: bool) {
    let k = AdamScalars {
        decay: 0.999,
        lerp_small,
        lerp_coeff: if lerp_small { 0.1 } else { 0.7 - 1.0 },
        beta2: 0.999,
        one_minus_beta2: 1e-3,
        bias_correction2_sqrt: 0.0316,
        eps: 1e-8,
        neg_step_size: -0.0101,
    };
    for n in [1, 7, 8, 9, 15, 17, 31, 33, 100] {
        let (mut p1, g, mut m1) = (data(n, 1), data(n, 2), data(n, 3));
        // Second moments are non-negative.
        let mut v1: Vec<f32> = data(n, 4).iter().map(|x| x * x).collect();
        let mut x1: Vec<f32> = data(n, 5).iter().map(|x| x * x).collect();
        let (mut p2, mut m2, mut v2, mut x2) = (p1.clone(), m1.clone(), v1.clone(), x1.clone());
        adam_loop::<DECAY, AMSGRAD>(&mut p1, &g, &mut m1, &mut v1, &mut x1, k);
        adam_kernel::<DECAY, AMSGRAD>(&mut p2, &g, &mut m2, &mut v2, &mut x2, k);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p1), bits(&p2), "n {n}");
        assert_eq!(bits(&m1), bits(&m2), "n {n}");
        assert_eq!(bits(&v1), bits(&v2), "n {n}");
        assert_eq!(bits(&x1), bits(&x2), "n {n}");
    }
}

#[test]
fn adam_fma_and_portable_builds_give_the_same_bits() {
    for small in [true, false] {
        adam_agree::<NO_DECAY, false>(small);
        adam_agree::<L2, false>(small);
        adam_agree::<DECOUPLED, true>(small);
    }
}
