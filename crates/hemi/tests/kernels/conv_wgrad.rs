//! The weight gradient of BF16 convolutions read straight from the image in pixel pairs
//! (`cpu::conv::wgrad`): `portable-bf16-pairs` against F64 within the F32 summation bound,
//! and `avx512bf16` and the widened `avx512f` route, where the CPU has them, equal to the twin
//! to the bit (F32 planes likewise, on `portable-wide` and `avx512f`); on odd channel
//! counts (partial blocks), planes whose pixel count is no multiple of the 32-pixel chunk,
//! one-sided padding, dilation, rows entirely in the padding, pointwise kernels, ResNet-20's
//! planes, and several images summed together. Convolutions it does not read (strided,
//! grouped, output rows of another length) get no plan, nor, automatically, those with more
//! than 16 output channels.

use half::bf16;
use hemi::cpu::conv::reference::conv2d_weight_grad_reference;
use hemi::cpu::conv::wgrad::WgradPlan;
use hemi::cpu::conv::{conv_out_size, Conv2dGeom};
use hemi::cpu::gemm::select::Kernel;
use hemi::Generator;

#[allow(clippy::too_many_arguments)]
fn geom(
    n: usize,
    c_in: usize,
    (h, w): (usize, usize),
    (kh, kw): (usize, usize),
    (ph, pw): (usize, usize),
    d: usize,
    stride: usize,
    c_out: usize,
) -> Conv2dGeom {
    Conv2dGeom {
        n,
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

fn random(len: usize, rng: &mut Generator) -> Vec<bf16> {
    (0..len)
        .map(|_| bf16::from_f64(rng.uniform(-2.0, 2.0)))
        .collect()
}

/// The plan's sum over all images of `g`, added into `start`.
fn run(
    plan: &WgradPlan,
    x: &[bf16],
    dy: &[bf16],
    g: &Conv2dGeom,
    start: &[f32],
    par: bool,
) -> Vec<f32> {
    let mut dw = start.to_vec();
    plan.add_images(x, dy, g.n, &mut dw, par);
    dw
}

#[test]
fn pixel_pair_weight_gradients_match_f64_and_the_twin_bit_for_bit() {
    let mut rng = Generator::new(91);
    // (n, c_in, (h, w), (kh, kw), (pad_h, pad_w), dilation, c_out); stride 1, w_out == w.
    let cases = [
        (1, 3, (7, 9), (3, 3), (1, 1), 1, 5),
        (2, 4, (5, 33), (3, 3), (0, 1), 1, 6),
        (1, 5, (6, 11), (5, 3), (2, 1), 1, 3),
        (3, 5, (9, 8), (3, 3), (2, 2), 2, 17),
        (1, 2, (3, 5), (3, 5), (3, 2), 1, 4),
        (2, 1, (2, 1), (3, 1), (1, 0), 1, 3),
        (2, 16, (32, 32), (3, 3), (1, 1), 1, 16),
        (3, 64, (8, 8), (3, 3), (1, 1), 1, 13),
        (1, 7, (5, 31), (3, 7), (1, 3), 1, 8),
        (2, 9, (7, 7), (1, 1), (0, 0), 1, 10),
        (1, 6, (4, 6), (3, 3), (4, 1), 1, 2),
    ];
    let avx = Kernel::Avx512Bf16.is_available();
    println!("avx512bf16 checked against the twin: {avx}");
    let mut fma_checked = false;
    for (n, c_in, hw, k, pad, d, c_out) in cases {
        let g = geom(n, c_in, hw, k, pad, d, 1, c_out);
        assert_eq!(g.w_out, g.w, "{g:?}");
        let (x, dy) = (
            random(n * g.in_image(), &mut rng),
            random(n * g.out_image(), &mut rng),
        );
        // A non-zero start: the plan adds into dw.
        let start: Vec<f32> = (0..g.weight_len()).map(|i| (i % 7) as f32 - 3.0).collect();
        let (want, abs) = conv2d_weight_grad_reference(&x, &dy, &g);
        let twin = WgradPlan::with_kernel(&g, Kernel::PortableBf16Pairs).expect("a plan");
        let got = run(&twin, &x, &dy, &g, &start, false);
        // Each lane sums n·l/32 pair steps, then 16 lanes and the start: all F32 adds.
        let terms = (n * g.l()) as f64 + 20.0;
        for (i, (&v, (&w, &a))) in got.iter().zip(want.iter().zip(&abs)).enumerate() {
            let w = w + start[i] as f64;
            let tol = 2.0 * terms * f64::powi(2.0, -24) * (a + start[i].abs() as f64);
            assert!(
                (v as f64 - w).abs() <= tol,
                "{g:?} dw[{i}]: {v} vs {w} (tol {tol})"
            );
        }
        assert_eq!(
            run(&twin, &x, &dy, &g, &start, true),
            got,
            "{g:?}: threads change the sums"
        );
        if avx {
            let simd = WgradPlan::with_kernel(&g, Kernel::Avx512Bf16).expect("a plan");
            for par in [false, true] {
                let s = run(&simd, &x, &dy, &g, &start, par);
                let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{g:?} (parallel {par}): avx512bf16 differs from the twin"
                );
            }
        }
        // The widened route (`avx512f`: odd and even elements as F32, one FMA each).
        if let Some(fma) = WgradPlan::with_kernel(&g, Kernel::Avx512F32) {
            fma_checked = true;
            for par in [false, true] {
                let s = run(&fma, &x, &dy, &g, &start, par);
                let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{g:?} (parallel {par}): avx512f differs from the twin"
                );
            }
        }
    }
    println!("avx512f (widened BF16) checked against the twin: {fma_checked}");
}

/// F32 planes (`add_images_f32`): `portable-wide`'s block against F64 within the F32
/// summation bound (each term one fused multiply-add: one rounding), and `avx512f`, where the
/// CPU has it, equal to the twin to the bit, on the same geometries as the BF16 test, with
/// values that are not BF16 (so the products round, and an unfused multiply would differ).
#[test]
fn f32_weight_gradients_match_f64_and_the_twin_bit_for_bit() {
    let mut rng = Generator::new(92);
    let cases = [
        (1, 3, (7, 9), (3, 3), (1, 1), 1, 5),
        (2, 4, (5, 33), (3, 3), (0, 1), 1, 6),
        (3, 5, (9, 8), (3, 3), (2, 2), 2, 17),
        (1, 2, (3, 5), (3, 5), (3, 2), 1, 4),
        (2, 16, (32, 32), (3, 3), (1, 1), 1, 16),
        (3, 64, (8, 8), (3, 3), (1, 1), 1, 13),
        (1, 7, (5, 31), (3, 7), (1, 3), 1, 8),
        (2, 9, (7, 7), (1, 1), (0, 0), 1, 10),
        (1, 6, (4, 6), (3, 3), (4, 1), 1, 2),
    ];
    let simd_runs = Kernel::Avx512F32.is_available()
        && hemi::cpu::features::has(hemi::cpu::features::Feature::Avx512bw);
    println!("avx512f checked against the twin: {simd_runs}");
    for (n, c_in, hw, k, pad, d, c_out) in cases {
        let g = geom(n, c_in, hw, k, pad, d, 1, c_out);
        let random = |len, rng: &mut Generator| -> Vec<f32> {
            (0..len).map(|_| rng.uniform(-2.0, 2.0) as f32).collect()
        };
        let (x, dy) = (
            random(n * g.in_image(), &mut rng),
            random(n * g.out_image(), &mut rng),
        );
        let start: Vec<f32> = (0..g.weight_len()).map(|i| (i % 7) as f32 - 3.0).collect();
        let (want, abs) = conv2d_weight_grad_reference(&x, &dy, &g);
        let run = |plan: &WgradPlan, par: bool| -> Vec<f32> {
            let mut dw = start.clone();
            plan.add_images_f32(&x, &dy, g.n, &mut dw, par);
            dw
        };
        let twin = WgradPlan::with_kernel(&g, Kernel::PortableF32Wide).expect("a plan");
        let got = run(&twin, false);
        let terms = (n * g.l()) as f64 + 20.0;
        for (i, (&v, (&w, &a))) in got.iter().zip(want.iter().zip(&abs)).enumerate() {
            let w = w + start[i] as f64;
            let tol = 2.0 * terms * f64::powi(2.0, -24) * (a + start[i].abs() as f64);
            assert!(
                (v as f64 - w).abs() <= tol,
                "{g:?} dw[{i}]: {v} vs {w} (tol {tol})"
            );
        }
        assert_eq!(run(&twin, true), got, "{g:?}: threads change the sums");
        let simd = WgradPlan::with_kernel(&g, Kernel::Avx512F32);
        assert_eq!(simd.is_some(), simd_runs, "{g:?}");
        if let Some(simd) = simd {
            for par in [false, true] {
                let s = run(&simd, par);
                let same = s.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{g:?} (parallel {par}): avx512f differs from the twin"
                );
            }
        }
    }
}

#[test]
fn convolutions_read_otherwise_get_no_plan() {
    let k = Kernel::PortableBf16Pairs;
    assert!(WgradPlan::with_kernel(&geom(1, 4, (8, 8), (3, 3), (1, 1), 1, 2, 4), k).is_none());
    let grouped = Conv2dGeom {
        groups: 2,
        ..geom(1, 4, (8, 8), (3, 3), (1, 1), 1, 1, 4)
    };
    assert!(WgradPlan::with_kernel(&grouped, k).is_none());
    // 'valid' width: output rows shorter than input rows.
    assert!(WgradPlan::with_kernel(&geom(1, 4, (8, 8), (3, 3), (1, 0), 1, 1, 4), k).is_none());
    // F32 kernels do not multiply BF16 pairs.
    let same = geom(1, 4, (8, 8), (3, 3), (1, 1), 1, 1, 4);
    assert!(WgradPlan::with_kernel(&same, Kernel::PortableF32).is_none());
    assert!(WgradPlan::with_kernel(&same, k).is_some());
    // Automatic choice: more than 16 output channels stay with the GEMM (faster there).
    assert!(WgradPlan::new(&geom(1, 4, (8, 8), (3, 3), (1, 1), 1, 1, 17)).is_none());
    assert!(WgradPlan::new_f32(&geom(1, 4, (8, 8), (3, 3), (1, 1), 1, 1, 17)).is_none());
}

/// F16 weight gradients of the convolutions the F32 plan reads (`conv2d_backward_weight`
/// widens each run of images and runs that plan) are the F32 gradients of the widened values,
/// bit for bit where the plan exists, and within the F32 summation bound of F64 everywhere;
/// ResNet-20's 16-channel shape and an odd one, several runs of images.
#[test]
fn f16_weight_grads_are_the_f32_ones_of_the_widened_values() {
    use half::f16;
    use hemi::cpu::conv::conv2d_backward_weight;
    let mut rng = Generator::new(404);
    for g in [
        geom(5, 16, (32, 32), (3, 3), (1, 1), 1, 1, 16),
        geom(9, 5, (9, 11), (3, 3), (1, 1), 1, 1, 7),
    ] {
        let mut val = |len: usize| -> Vec<f16> {
            (0..len)
                .map(|_| f16::from_f64(rng.uniform(-2.0, 2.0)))
                .collect()
        };
        let (x, dy) = (val(g.n * g.in_image()), val(g.n * g.out_image()));
        let widen = |v: &[f16]| v.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let (xf, dyf) = (widen(&x), widen(&dy));
        let dw16 = conv2d_backward_weight::<f16, f32>(&x, &dy, &g);
        let dw32 = conv2d_backward_weight::<f32, f32>(&xf, &dyf, &g);
        if WgradPlan::new_f32(&g).is_some() {
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            assert_eq!(
                bits(&dw16),
                bits(&dw32),
                "{g:?}: F16 differs from F32 widened"
            );
        }
        let f64s = |v: &[f32]| v.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
        let (want, mag) = conv2d_weight_grad_reference(&f64s(&xf), &f64s(&dyf), &g);
        let tol = 2.0 * (g.n * (g.l() + 1) + 2) as f64 * f64::powi(2.0, -24);
        for (i, ((&v, &w), &m)) in dw16.iter().zip(&want).zip(&mag).enumerate() {
            assert!(
                (f64::from(v) - w).abs() <= tol * m,
                "{g:?}: dw[{i}] = {v}, want {w}"
            );
        }
    }
}
