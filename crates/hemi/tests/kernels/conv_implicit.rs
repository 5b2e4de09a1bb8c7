//! Forward convolutions as an implicit GEMM from a padded copy of the image
//! (`cpu::conv::implicit`): the portable tile against F64 within the F32 summation bound, and
//! the AVX-512 tile, where the CPU has it, equal to the twin to the bit; F32, F16 and BF16
//! images, with and without bias, one after another on one thread (the padded copy is kept
//! between them), on pixel counts that are no multiple of the 8-pixel tile,
//! strides, one-sided and wide padding, dilation, rectangular kernels, pointwise kernels, 96
//! output channels (three panels) and ResNet's shapes. The weight gradient of two images
//! added onto a gradient already there, the same way against F64 and the twin. Convolutions
//! it does not take get no plan, nor, automatically, pointwise ones.

use half::{bf16, f16};
use hemi::cpu::conv::direct::DirectElem;
use hemi::cpu::conv::implicit::{ImplicitPlan, MIN_WGRAD_K};
use hemi::cpu::conv::reference::{conv2d_reference, conv2d_weight_grad_reference};
use hemi::cpu::conv::{conv_out_size, Conv2dGeom};
use hemi::Generator;

/// (c_in, (h, w), (kh, kw), (pad_h, pad_w), (stride_h, stride_w), dilation, c_out).
type Geom7 = (
    usize,
    (usize, usize),
    (usize, usize),
    (usize, usize),
    (usize, usize),
    usize,
    usize,
);

fn geom(&(c_in, (h, w), (kh, kw), padding, stride, d, c_out): &Geom7) -> Conv2dGeom {
    Conv2dGeom {
        n: 1,
        c_in,
        h,
        w,
        c_out,
        kh,
        kw,
        stride,
        padding,
        dilation: (d, d),
        groups: 1,
        h_out: conv_out_size(h, kh, stride.0, padding.0, d).unwrap(),
        w_out: conv_out_size(w, kw, stride.1, padding.1, d).unwrap(),
    }
}

const CASES: [Geom7; 14] = [
    // The same padded plane size (8×8), input at another place: the copy kept between
    // images must not keep the first one's values where the second has its zeros.
    (4, (8, 8), (3, 3), (0, 0), (1, 1), 1, 32),
    (4, (6, 6), (3, 3), (1, 1), (1, 1), 1, 32),
    (3, (7, 9), (3, 3), (1, 1), (1, 1), 1, 32),
    (5, (5, 13), (3, 3), (0, 1), (1, 1), 1, 64),
    (4, (6, 11), (5, 3), (2, 1), (1, 1), 1, 32),
    (5, (9, 8), (3, 3), (2, 2), (1, 1), 2, 32),
    (2, (3, 5), (3, 5), (3, 2), (1, 1), 1, 32),
    (6, (9, 7), (3, 3), (1, 1), (2, 2), 1, 32),
    (3, (10, 11), (7, 7), (3, 3), (2, 2), 1, 64),
    (7, (8, 9), (3, 2), (0, 1), (2, 1), 1, 96),
    (9, (7, 7), (1, 1), (0, 0), (1, 1), 1, 32),
    (8, (9, 9), (1, 1), (0, 0), (2, 2), 1, 32),
    (32, (16, 16), (3, 3), (1, 1), (1, 1), 1, 32),
    (64, (8, 8), (3, 3), (1, 1), (1, 1), 1, 64),
];

/// Checks one element type: `to` rounds an F64 into it, `back` reads it as F64.
fn check<T: DirectElem>(seed: u64, to: impl Fn(f64) -> T, back: impl Fn(T) -> f64) {
    let mut rng = Generator::new(seed);
    let g0 = geom(&CASES[0]);
    let simd_runs = ImplicitPlan::with_simd(&g0, &vec![to(0.0); g0.weight_len()], true).is_some();
    println!("AVX-512 tile checked against the twin: {simd_runs}");
    for case in &CASES {
        let g = geom(case);
        let x: Vec<T> = (0..g.in_image())
            .map(|_| to(rng.uniform(-2.0, 2.0)))
            .collect();
        let w: Vec<T> = (0..g.weight_len())
            .map(|_| to(rng.uniform(-1.0, 1.0)))
            .collect();
        let bias: Vec<f32> = (0..g.c_out)
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let (x64, w64): (Vec<f64>, Vec<f64>) = (
            x.iter().map(|&v| back(v)).collect(),
            w.iter().map(|&v| back(v)).collect(),
        );
        let abs = |v: &[f64]| v.iter().map(|a| a.abs()).collect::<Vec<f64>>();
        let twin = ImplicitPlan::with_simd(&g, &w, false).expect("a plan");
        for with_bias in [false, true] {
            let b = with_bias.then_some(&bias[..]);
            let b64: Option<Vec<f64>> = b.map(|b| b.iter().map(|&v| v as f64).collect());
            let want = conv2d_reference(&x64, &w64, b64.as_deref(), &g);
            let mag = conv2d_reference(&abs(&x64), &abs(&w64), b64.map(|b| abs(&b)).as_deref(), &g);
            // One slack element past the output: a store past it would show.
            let mut got = vec![f32::NAN; g.out_image() + 1];
            twin.image(&x, b, &mut got);
            assert!(got[g.out_image()].is_nan(), "{g:?}: wrote past the output");
            // Each output sums K terms, one rounding each, then the bias: γ_{K+1} · Σ|terms|.
            let tol_of = |m: f64| 2.0 * (g.k() as f64 + 2.0) * f64::powi(2.0, -24) * m;
            for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                assert!(
                    (v as f64 - w).abs() <= tol_of(m),
                    "{g:?} bias {with_bias}: y[{i}] = {v}, want {w}"
                );
            }
            if let Some(simd) = ImplicitPlan::with_simd(&g, &w, true) {
                let mut s = vec![f32::NAN; g.out_image() + 1];
                simd.image(&x, b, &mut s);
                let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && s[g.out_image()].is_nan(),
                    "{g:?} bias {with_bias}: the AVX-512 tile differs from the twin"
                );
            }
        }
    }
}

/// The weight gradient of two images for one element type, as `check`.
fn check_weight_grad<T: DirectElem>(seed: u64, to: impl Fn(f64) -> T, back: impl Fn(T) -> f64) {
    let mut rng = Generator::new(seed);
    let n = 2;
    for case in &CASES {
        let g = geom(case);
        let x: Vec<T> = (0..n * g.in_image())
            .map(|_| to(rng.uniform(-2.0, 2.0)))
            .collect();
        let dy: Vec<T> = (0..n * g.out_image())
            .map(|_| to(rng.uniform(-1.0, 1.0)))
            .collect();
        let dw0: Vec<f32> = (0..g.weight_len())
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let x64: Vec<f64> = x.iter().map(|&v| back(v)).collect();
        let dy64: Vec<f64> = dy.iter().map(|&v| back(v)).collect();
        let (want, mag) = conv2d_weight_grad_reference(&x64, &dy64, &Conv2dGeom { n, ..g });
        let twin = ImplicitPlan::weight_grad_with_simd(&g, false).expect("a plan");
        let mut got = dw0.clone();
        got.push(f32::NAN);
        twin.add_weight_grad(&x, &dy, n, &mut got);
        assert!(got[g.weight_len()].is_nan(), "{g:?}: wrote past dw");
        // Each image's L terms summed from zero, then added: γ_{n(L+1)+1} · Σ|terms| + |dw0|.
        let terms = (n * (g.l() + 1) + 2) as f64;
        for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
            let w = w + dw0[i] as f64;
            let tol = 2.0 * terms * f64::powi(2.0, -24) * (m + dw0[i].abs() as f64);
            assert!(
                (v as f64 - w).abs() <= tol,
                "{g:?}: dw[{i}] = {v}, want {w}"
            );
        }
        if let Some(simd) = ImplicitPlan::weight_grad_with_simd(&g, true) {
            let mut s = dw0.clone();
            s.push(f32::NAN);
            simd.add_weight_grad(&x, &dy, n, &mut s);
            let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && s[g.weight_len()].is_nan(),
                "{g:?}: the AVX-512 weight gradient differs from the twin"
            );
        }
    }
}

#[test]
fn weight_grads_match_f64_and_the_twin_bit_for_bit() {
    check_weight_grad(104, |v| v as f32, |v: f32| v as f64);
    check_weight_grad(105, f16::from_f64, |v: f16| v.to_f64());
    check_weight_grad(106, bf16::from_f64, |v: bf16| v.to_f64());
}

#[test]
fn f32_images_match_f64_and_the_twin_bit_for_bit() {
    check(101, |v| v as f32, |v: f32| v as f64);
}

#[test]
fn f16_images_match_f64_and_the_twin_bit_for_bit() {
    check(102, f16::from_f64, |v: f16| v.to_f64());
}

#[test]
fn bf16_images_match_f64_and_the_twin_bit_for_bit() {
    check(103, bf16::from_f64, |v: bf16| v.to_f64());
}

#[test]
fn convolutions_it_does_not_take_get_no_plan() {
    let w = vec![0f32; 96 * 64 * 9];
    let plain = (4, (8, 8), (3, 3), (1, 1), (1, 1), 1, 32);
    assert!(ImplicitPlan::with_simd(&geom(&plain), &w, false).is_some());
    // Output channels not a multiple of 32.
    for c_out in [16, 48, 33] {
        let g = geom(&(4, (8, 8), (3, 3), (1, 1), (1, 1), 1, c_out));
        assert!(ImplicitPlan::with_simd(&g, &w, false).is_none(), "{c_out}");
    }
    let grouped = Conv2dGeom {
        groups: 2,
        ..geom(&plain)
    };
    assert!(ImplicitPlan::with_simd(&grouped, &w, false).is_none());
    // Automatically: pointwise convolutions stay with the GEMM, which reads them in place.
    let pointwise = geom(&(4, (8, 8), (1, 1), (0, 0), (1, 1), 1, 32));
    assert!(ImplicitPlan::new(&pointwise, &w).is_none());
    assert!(ImplicitPlan::weight_grad(&pointwise).is_none());
    // Automatically: weight gradients of few k steps stay with the GEMM.
    let shallow = geom(&(3, (8, 8), (3, 3), (1, 1), (1, 1), 1, 32));
    assert!(shallow.k() < MIN_WGRAD_K);
    assert!(ImplicitPlan::weight_grad(&shallow).is_none());
    assert!(ImplicitPlan::weight_grad_with_simd(&geom(&plain), false).is_some());
    assert!(ImplicitPlan::weight_grad_with_simd(&grouped, false).is_none());
}
