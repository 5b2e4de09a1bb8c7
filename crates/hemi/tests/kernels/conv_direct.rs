//! Forward convolutions read straight from the image (`cpu::conv::direct`): the portable
//! block against F64 within the F32 summation bound, and the AVX-512 block, where the CPU
//! has it, equal to the twin to the bit; F32, F16 and BF16 planes, with and without bias, on odd
//! channel counts (partial blocks of 8), planes whose pixel count is no multiple of the
//! 16-pixel chunk or of a block's 48 pixels, one-sided padding, dilation, rows entirely in
//! the padding, pointwise kernels and ResNet-20's planes. Convolutions it does not read get
//! no plan, nor, automatically, those with more than 16 output channels.

use half::{bf16, f16};
use hemi::cpu::conv::direct::{DirectElem, DirectPlan, MAX_C_OUT};
use hemi::cpu::conv::reference::conv2d_reference;
use hemi::cpu::conv::{conv_out_size, Conv2dGeom};
use hemi::Generator;

fn geom(
    c_in: usize,
    (h, w): (usize, usize),
    (kh, kw): (usize, usize),
    (ph, pw): (usize, usize),
    d: usize,
    stride: usize,
    c_out: usize,
) -> Conv2dGeom {
    Conv2dGeom {
        n: 1,
        c_in,
        h,
        w,
        c_out,
        kh,
        kw,
        stride: (stride, stride),
        padding: (ph, pw),
        dilation: (d, d),
        groups: 1,
        h_out: conv_out_size(h, kh, stride, ph, d).unwrap(),
        w_out: conv_out_size(w, kw, stride, pw, d).unwrap(),
    }
}

/// (c_in, (h, w), (kh, kw), (pad_h, pad_w), dilation, c_out); stride 1, w_out == w.
type Geom6 = (
    usize,
    (usize, usize),
    (usize, usize),
    (usize, usize),
    usize,
    usize,
);
const CASES: [Geom6; 11] = [
    (3, (7, 9), (3, 3), (1, 1), 1, 5),
    (4, (5, 33), (3, 3), (0, 1), 1, 6),
    (5, (6, 11), (5, 3), (2, 1), 1, 3),
    (5, (9, 8), (3, 3), (2, 2), 2, 16),
    (2, (3, 5), (3, 5), (3, 2), 1, 4),
    (1, (2, 1), (3, 1), (1, 0), 1, 3),
    (16, (32, 32), (3, 3), (1, 1), 1, 16),
    (3, (32, 32), (3, 3), (1, 1), 1, 16),
    (7, (5, 31), (3, 7), (1, 3), 1, 9),
    (9, (7, 7), (1, 1), (0, 0), 1, 10),
    (6, (4, 6), (3, 3), (4, 1), 1, 2),
];

/// Checks one element type: `to` rounds an F64 into it, `back` reads it as F64.
fn check<T: DirectElem>(seed: u64, to: impl Fn(f64) -> T, back: impl Fn(T) -> f64) {
    let mut rng = Generator::new(seed);
    let g0 = CASES[0].geom();
    let simd_runs = DirectPlan::with_simd(&g0, &vec![to(0.0); g0.weight_len()], true).is_some();
    println!("AVX-512 block checked against the twin: {simd_runs}");
    for case in CASES {
        let g = case.geom();
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
        let twin = DirectPlan::with_simd(&g, &w, false).expect("a plan");
        for with_bias in [false, true] {
            let b = with_bias.then_some(&bias[..]);
            let b64: Option<Vec<f64>> = b.map(|b| b.iter().map(|&v| v as f64).collect());
            let want = conv2d_reference(&x64, &w64, b64.as_deref(), &g);
            let mag = conv2d_reference(&abs(&x64), &abs(&w64), b64.map(|b| abs(&b)).as_deref(), &g);
            let mut got = vec![f32::NAN; g.out_image()];
            twin.image(&x, b, &mut got);
            // Each output sums K terms, one rounding each, then the bias: γ_{K+1} · Σ|terms|.
            let tol_of = |m: f64| 2.0 * (g.k() as f64 + 2.0) * f64::powi(2.0, -24) * m;
            for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                assert!(
                    (v as f64 - w).abs() <= tol_of(m),
                    "{g:?} bias {with_bias}: y[{i}] = {v}, want {w}"
                );
            }
            if let Some(simd) = DirectPlan::with_simd(&g, &w, true) {
                let mut s = vec![f32::NAN; g.out_image()];
                simd.image(&x, b, &mut s);
                let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{g:?} bias {with_bias}: the AVX-512 block differs from the twin"
                );
            }
        }
    }
}

trait Case {
    fn geom(&self) -> Conv2dGeom;
}

impl Case
    for (
        usize,
        (usize, usize),
        (usize, usize),
        (usize, usize),
        usize,
        usize,
    )
{
    fn geom(&self) -> Conv2dGeom {
        let &(c_in, hw, k, pad, d, c_out) = self;
        let g = geom(c_in, hw, k, pad, d, 1, c_out);
        assert_eq!(g.w_out, g.w, "{g:?}");
        g
    }
}

#[test]
fn f32_planes_match_f64_and_the_twin_bit_for_bit() {
    check(93, |v| v as f32, |v: f32| v as f64);
}

#[test]
fn f16_planes_match_f64_and_the_twin_bit_for_bit() {
    check(95, f16::from_f64, |v: f16| v.to_f64());
}

#[test]
fn bf16_planes_match_f64_and_the_twin_bit_for_bit() {
    check(94, bf16::from_f64, |v: bf16| v.to_f64());
}

#[test]
fn convolutions_read_otherwise_get_no_plan() {
    let w = vec![0f32; 64 * 64 * 9];
    // Strided, 'valid' width (output rows shorter than input rows), grouped.
    assert!(DirectPlan::with_simd(&geom(4, (8, 8), (3, 3), (1, 1), 1, 2, 4), &w, false).is_none());
    assert!(DirectPlan::with_simd(&geom(4, (8, 8), (3, 3), (1, 0), 1, 1, 4), &w, false).is_none());
    let grouped = Conv2dGeom {
        groups: 2,
        ..geom(4, (8, 8), (3, 3), (1, 1), 1, 1, 4)
    };
    assert!(DirectPlan::with_simd(&grouped, &w, false).is_none());
    assert!(DirectPlan::with_simd(&geom(4, (8, 8), (3, 3), (1, 1), 1, 1, 4), &w, false).is_some());
    // Automatically: more than 16 output channels stay with the GEMM.
    assert_eq!(MAX_C_OUT, 16);
    assert!(DirectPlan::new(&geom(4, (8, 8), (3, 3), (1, 1), 1, 1, 17), &w).is_none());
}
