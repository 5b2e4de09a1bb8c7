//! BF16 forward convolutions on AMX tiles read from the image (`cpu::conv::amx`): the
//! portable twin against F64 within the F32 summation bound on every CPU, and the AMX tiles,
//! where the process may use them, against F64 the same way and against the twin (equal to
//! the bit on sums that are exact). Images one after another on one thread (the copy is
//! kept between them), pixel counts that are no multiple of a block, both tile shapes (2×2
//! and, for an odd multiple of 16 output channels, 1×4), padding from none to wide and
//! one-sided, dilation, rectangular and pointwise kernels, and ResNet's shapes.
//! Convolutions it does not take get no plan.

use half::bf16;
use hemi::cpu::conv::amx::{AmxConvPlan, AmxInputGradPlan, AmxWgradPlan};
use hemi::cpu::conv::reference::{conv2d_reference, conv2d_weight_grad_reference};
use hemi::cpu::conv::{conv_out_size, Conv2dGeom};
use hemi::Generator;

/// (c_in, (h, w), (kh, kw), (pad_h, pad_w), dilation, c_out).
type Geom6 = (
    usize,
    (usize, usize),
    (usize, usize),
    (usize, usize),
    usize,
    usize,
);

fn geom(&(c_in, (h, w), (kh, kw), padding, d, c_out): &Geom6) -> Conv2dGeom {
    Conv2dGeom {
        n: 1,
        c_in,
        h,
        w,
        c_out,
        kh,
        kw,
        stride: (1, 1),
        padding,
        dilation: (d, d),
        groups: 1,
        h_out: conv_out_size(h, kh, 1, padding.0, d).unwrap(),
        w_out: conv_out_size(w, kw, 1, padding.1, d).unwrap(),
    }
}

const CASES: [Geom6; 20] = [
    // Same copy layout, input at another place: the kept copy must not keep the first
    // image's values where the second has zeros.
    (32, (8, 8), (3, 3), (0, 0), 1, 32),
    (32, (6, 6), (3, 3), (1, 1), 1, 32),
    (32, (7, 9), (3, 3), (1, 1), 1, 16),
    (64, (5, 13), (3, 3), (0, 1), 1, 48),
    (32, (6, 11), (5, 3), (2, 1), 1, 32),
    (32, (9, 8), (3, 3), (2, 2), 2, 64),
    (32, (3, 5), (3, 5), (3, 2), 1, 16),
    (96, (7, 7), (1, 1), (0, 0), 1, 32),
    (64, (9, 9), (1, 1), (0, 0), 1, 80),
    (32, (16, 16), (3, 3), (1, 1), 1, 32),
    (64, (8, 8), (3, 3), (1, 1), 1, 64),
    (32, (11, 1), (3, 1), (1, 0), 1, 16),
    // 16 input channels: two taps per chunk, odd and even kernel widths, dilation, no
    // padding on the left (the shifted planes start before the image).
    (16, (8, 8), (3, 3), (1, 1), 1, 16),
    (16, (7, 10), (3, 4), (1, 0), 1, 32),
    (16, (9, 9), (3, 3), (2, 2), 2, 48),
    (16, (5, 6), (1, 1), (0, 0), 1, 16),
    (16, (32, 32), (3, 3), (1, 1), 1, 16),
    // One pixel, and kernels wider than the image: every tap but the centre reads padding.
    (32, (1, 1), (3, 3), (1, 1), 1, 16),
    (16, (2, 2), (5, 5), (2, 2), 1, 16),
    (32, (2, 3), (5, 5), (2, 2), 1, 32),
];

/// Strided convolutions (the copy cut into phase planes): ResNet's downsampling 3×3 and
/// 1×1 convolutions and the 7×7 stem's shape, odd sizes, 16 input channels (two taps per
/// chunk) at column strides 1 and 2 with odd and even kernel widths, a dilation that keeps
/// every tap in one phase plane, unequal strides.
const STRIDED: [(Geom6, (usize, usize)); 12] = [
    ((16, (32, 32), (3, 3), (1, 1), 1, 32), (2, 2)),
    ((32, (16, 16), (3, 3), (1, 1), 1, 64), (2, 2)),
    ((16, (9, 11), (3, 3), (1, 1), 1, 16), (2, 2)),
    ((16, (7, 10), (3, 4), (1, 0), 1, 32), (2, 2)),
    ((16, (9, 9), (5, 5), (2, 2), 1, 16), (3, 1)),
    ((32, (9, 8), (3, 3), (2, 2), 2, 32), (2, 2)),
    ((64, (7, 7), (1, 1), (0, 0), 1, 32), (2, 2)),
    ((32, (11, 9), (3, 3), (1, 1), 1, 16), (2, 3)),
    ((32, (13, 13), (7, 7), (3, 3), 1, 32), (2, 2)),
    ((32, (6, 7), (2, 2), (0, 1), 1, 48), (2, 2)),
    // Nine phases (more than a thread keeps copies of), and a dilation whose taps fall in
    // both phases of each axis.
    ((32, (10, 11), (3, 3), (0, 0), 1, 32), (3, 3)),
    ((32, (13, 12), (3, 3), (3, 3), 3, 32), (2, 2)),
];

fn strided(case: &Geom6, (sh, sw): (usize, usize)) -> Conv2dGeom {
    let g = geom(case);
    Conv2dGeom {
        stride: (sh, sw),
        h_out: conv_out_size(g.h, g.kh, sh, g.padding.0, g.dilation.0).unwrap(),
        w_out: conv_out_size(g.w, g.kw, sw, g.padding.1, g.dilation.1).unwrap(),
        ..g
    }
}

/// Every geometry the tests run: `CASES`, then `STRIDED`.
fn all_geoms() -> Vec<Conv2dGeom> {
    let strided = STRIDED.iter().map(|(c, s)| strided(c, *s));
    CASES.iter().map(geom).chain(strided).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// Checks `plan` (twin or AMX) on image `x`: every output within the F32 summation bound
/// of F64, and nothing written past the output. Returns the outputs.
fn check_plan(
    plan: &AmxConvPlan,
    g: &Conv2dGeom,
    x: &[bf16],
    w: &[bf16],
    b: Option<&[f32]>,
) -> Vec<f32> {
    let f = |v: &[bf16]| v.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
    let abs = |v: &[f64]| v.iter().map(|a| a.abs()).collect::<Vec<f64>>();
    let (x64, w64) = (f(x), f(w));
    let b64: Option<Vec<f64>> = b.map(|b| b.iter().map(|&v| v as f64).collect());
    let want = conv2d_reference(&x64, &w64, b64.as_deref(), g);
    let mag = conv2d_reference(&abs(&x64), &abs(&w64), b64.map(|b| abs(&b)).as_deref(), g);
    let mut got = vec![f32::NAN; g.out_image() + 1];
    plan.image(x, b, &mut got);
    assert!(got[g.out_image()].is_nan(), "{g:?}: wrote past the output");
    // Each output sums K exact products in F32 (one rounding each), then the bias.
    let tol_of = |m: f64| 2.0 * (g.k() as f64 + 2.0) * f64::powi(2.0, -24) * m;
    for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
        assert!(
            (v as f64 - w).abs() <= tol_of(m),
            "{g:?} amx {} bias {}: y[{i}] = {v}, want {w}",
            plan.uses_amx(),
            b.is_some()
        );
    }
    got.pop();
    // The BF16 output is the F32 one rounded once, nearest-even, and ends where it does.
    let mut got16 = vec![bf16::from_bits(0x7FC1); g.out_image() + 1];
    plan.image(x, b, &mut got16);
    assert_eq!(
        got16[g.out_image()].to_bits(),
        0x7FC1,
        "{g:?}: BF16 wrote past the output"
    );
    let mut want16 = vec![bf16::ZERO; g.out_image()];
    hemi::dtype::convert::f32_to_bf16(&got, &mut want16);
    assert!(
        got16[..g.out_image()]
            .iter()
            .zip(&want16)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{g:?} amx {}: the BF16 output is not the F32 one rounded",
        plan.uses_amx()
    );
    got
}

#[test]
fn matches_f64_on_the_twin_and_on_amx() {
    let mut rng = Generator::new(301);
    let amx =
        AmxConvPlan::with_amx(&geom(&CASES[0]), &vec![bf16::ZERO; 32 * 32 * 9], true).is_some();
    println!("AMX tiles checked: {amx}");
    for g in all_geoms() {
        let w: Vec<bf16> = (0..g.weight_len())
            .map(|_| bf16::from_f64(rng.uniform(-1.0, 1.0)))
            .collect();
        let bias: Vec<f32> = (0..g.c_out)
            .map(|_| rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let twin = AmxConvPlan::with_amx(&g, &w, false).expect("a plan");
        let tiles = AmxConvPlan::with_amx(&g, &w, true);
        // Two images per case (the second reuses the copy's zeros), one with bias.
        for with_bias in [false, true] {
            let x: Vec<bf16> = (0..g.in_image())
                .map(|_| bf16::from_f64(rng.uniform(-2.0, 2.0)))
                .collect();
            let b = with_bias.then_some(&bias[..]);
            check_plan(&twin, &g, &x, &w, b);
            if let Some(tiles) = &tiles {
                check_plan(tiles, &g, &x, &w, b);
            }
        }
    }
}

/// Outputs that are F32 subnormals (a zero image plus a subnormal bias) keep their BF16
/// rounding: the stores' `vcvtneps2bf16` reads subnormals as zero, so a vector holding one
/// must round by the bits instead (`check_plan` holds BF16 = F32 rounded).
#[test]
fn subnormal_outputs_round_as_convert_does() {
    for case in [CASES[1], CASES[12]] {
        let g = geom(&case);
        let w = vec![bf16::from_f32(0.5); g.weight_len()];
        let x = vec![bf16::ZERO; g.in_image()];
        let bias: Vec<f32> = (0..g.c_out)
            .map(|o| {
                f32::from_bits(0x0000_8001 + 0x1_0000 * o as u32)
                    * if o % 2 == 0 { 1.0 } else { -1.0 }
            })
            .collect();
        assert!(bias.iter().all(|b| b.is_subnormal()));
        let mut plans = vec![AmxConvPlan::with_amx(&g, &w, false).expect("a plan")];
        plans.extend(AmxConvPlan::with_amx(&g, &w, true));
        for plan in &plans {
            let got = check_plan(plan, &g, &x, &w, Some(&bias));
            assert!(
                got.iter().all(|v| v.is_subnormal()),
                "{g:?}: outputs not the bias"
            );
        }
    }
}

/// On small integers every partial sum is exact, so the AMX tiles and the twin must agree
/// to the bit whatever order each sums in.
#[test]
fn amx_equals_the_twin_on_exact_sums() {
    let mut rng = Generator::new(302);
    for g in all_geoms() {
        let int = |rng: &mut Generator, r: f64| bf16::from_f64(rng.uniform(-r, r).round());
        let w: Vec<bf16> = (0..g.weight_len()).map(|_| int(&mut rng, 4.0)).collect();
        let x: Vec<bf16> = (0..g.in_image()).map(|_| int(&mut rng, 8.0)).collect();
        let bias: Vec<f32> = (0..g.c_out)
            .map(|_| rng.uniform(-9.0, 9.0).round() as f32)
            .collect();
        let twin = AmxConvPlan::with_amx(&g, &w, false).expect("a plan");
        let t = check_plan(&twin, &g, &x, &w, Some(&bias));
        if let Some(tiles) = AmxConvPlan::with_amx(&g, &w, true) {
            let a = check_plan(&tiles, &g, &x, &w, Some(&bias));
            assert_eq!(
                bits(&a),
                bits(&t),
                "{g:?}: AMX differs from the twin on exact sums"
            );
        }
    }
}

#[test]
fn convolutions_it_does_not_take_get_no_plan() {
    let w = vec![bf16::ZERO; 64 * 64 * 9];
    let plain = (32, (8, 8), (3, 3), (1, 1), 1, 32);
    assert!(AmxConvPlan::with_amx(&geom(&plain), &w, false).is_some());
    for (c_in, c_out) in [(8, 32), (48, 32), (3, 32), (32, 8), (32, 24), (16, 8)] {
        let g = geom(&(c_in, (8, 8), (3, 3), (1, 1), 1, c_out));
        assert!(
            AmxConvPlan::with_amx(&g, &w, false).is_none(),
            "{c_in} -> {c_out}"
        );
    }
    // Two taps of a row at one offset: not at column stride 3, nor 2 dilated.
    let pair = (16, (9, 9), (3, 3), (1, 1), 1, 16);
    assert!(AmxConvPlan::with_amx(&strided(&pair, (1, 2)), &w, false).is_some());
    assert!(AmxConvPlan::with_amx(&strided(&pair, (1, 3)), &w, false).is_none());
    let dilated = (16, (9, 9), (3, 3), (2, 2), 2, 16);
    assert!(AmxConvPlan::with_amx(&strided(&dilated, (2, 2)), &w, false).is_none());
    assert!(AmxConvPlan::with_amx(
        &strided(&(32, (9, 9), (3, 3), (2, 2), 2, 16), (2, 2)),
        &w,
        false
    )
    .is_some());
    let grouped = Conv2dGeom {
        groups: 2,
        ..geom(&plain)
    };
    assert!(AmxConvPlan::with_amx(&grouped, &w, false).is_none());
}

/// The weight gradient of three images added onto a gradient already there: the twin and
/// the AMX tiles against F64 within the F32 summation bound, and equal to each other on
/// exact sums; both tilings (2×2 channel tiles, 4 taps of 16-channel tiles).
#[test]
fn weight_grads_match_f64_on_the_twin_and_on_amx() {
    let mut rng = Generator::new(303);
    let n = 3;
    let extra: [Geom6; 2] = [
        (16, (7, 5), (3, 3), (1, 1), 1, 48),
        (48, (6, 9), (3, 3), (2, 0), 2, 16),
    ];
    for g in all_geoms().into_iter().chain(extra.iter().map(geom)) {
        for exact in [false, true] {
            let mut val = |r: f64| {
                let v = rng.uniform(-r, r);
                bf16::from_f64(if exact { v.round() } else { v })
            };
            let x: Vec<bf16> = (0..n * g.in_image()).map(|_| val(4.0)).collect();
            let dy: Vec<bf16> = (0..n * g.out_image()).map(|_| val(2.0)).collect();
            let dw0: Vec<f32> = (0..g.weight_len()).map(|_| val(8.0).to_f32()).collect();
            let x64: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
            let dy64: Vec<f64> = dy.iter().map(|v| v.to_f64()).collect();
            let (want, mag) = conv2d_weight_grad_reference(&x64, &dy64, &Conv2dGeom { n, ..g });
            let run = |plan: &AmxWgradPlan| {
                let mut got = dw0.clone();
                got.push(f32::NAN);
                plan.add_weight_grad(&x, &dy, n, &mut got);
                assert!(got[g.weight_len()].is_nan(), "{g:?}: wrote past dw");
                // All n images' terms summed in F32 (with the zero columns), then added.
                let terms = (n * (g.h_out + g.kh) * (g.w_out + g.kw) + 2) as f64;
                for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                    let w = w + dw0[i] as f64;
                    let tol = 2.0 * terms * f64::powi(2.0, -24) * (m + dw0[i].abs() as f64);
                    assert!(
                        (v as f64 - w).abs() <= tol,
                        "{g:?} amx {}: dw[{i}] = {v}, want {w}",
                        plan.uses_amx()
                    );
                }
                got
            };
            let twin = AmxWgradPlan::with_amx(&g, false).expect("a plan");
            let t = run(&twin);
            if let Some(tiles) = AmxWgradPlan::with_amx(&g, true) {
                let a = run(&tiles);
                if exact {
                    assert_eq!(
                        bits(&a),
                        bits(&t),
                        "{g:?}: AMX differs from the twin on exact sums"
                    );
                }
            }
        }
    }
}

#[test]
fn weight_grads_it_does_not_take_get_no_plan() {
    let plain = (16, (8, 8), (3, 3), (1, 1), 1, 16);
    assert!(AmxWgradPlan::with_amx(&geom(&plain), false).is_some());
    for (c_in, c_out) in [(8, 32), (3, 16), (32, 8), (32, 24)] {
        let g = geom(&(c_in, (8, 8), (3, 3), (1, 1), 1, c_out));
        assert!(
            AmxWgradPlan::with_amx(&g, false).is_none(),
            "{c_in} -> {c_out}"
        );
    }
    let grouped = Conv2dGeom {
        groups: 2,
        ..geom(&(32, (8, 8), (3, 3), (1, 1), 1, 32))
    };
    assert!(AmxWgradPlan::with_amx(&grouped, false).is_none());
}

/// `dx` of one image in F64 (`dx[c][ih][iw] = Σ w[o][c][ki][kj] · dy[o][oh][ow]` over the
/// taps that reach it) and the same sum of magnitudes.
fn input_grad_reference(w: &[f64], dy: &[f64], g: &Conv2dGeom) -> (Vec<f64>, Vec<f64>) {
    let (mut dx, mut mag) = (vec![0.0; g.in_image()], vec![0.0; g.in_image()]);
    for o in 0..g.c_out {
        for c in 0..g.c_in {
            for ki in 0..g.kh {
                for kj in 0..g.kw {
                    let wv = w[((o * g.c_in + c) * g.kh + ki) * g.kw + kj];
                    for oh in 0..g.h_out {
                        for ow in 0..g.w_out {
                            let ih = (oh * g.stride.0 + ki * g.dilation.0) as isize
                                - g.padding.0 as isize;
                            let iw = (ow * g.stride.1 + kj * g.dilation.1) as isize
                                - g.padding.1 as isize;
                            if ih < 0 || iw < 0 || ih >= g.h as isize || iw >= g.w as isize {
                                continue;
                            }
                            let at = (c * g.h + ih as usize) * g.w + iw as usize;
                            let d = dy[(o * g.h_out + oh) * g.w_out + ow];
                            dx[at] += wv * d;
                            mag[at] += (wv * d).abs();
                        }
                    }
                }
            }
        }
    }
    (dx, mag)
}

/// Strided input gradients phase by phase (`AmxInputGradPlan`): the twin and the AMX tiles
/// against F64 within the F32 summation bound, every element written (phases no tap reaches
/// as zeros) and nothing past `dx`; the BF16 output is the F32 one rounded once; AMX equal to
/// the twin on exact sums. Plans for every strided shape but the dilated one, the one whose
/// 48 output channels no phase convolution takes, and the column stride 3 one (its phase
/// `b = 0` starts at the second column and has one tap: padding −1).
#[test]
fn strided_input_grads_match_f64_on_the_twin_and_on_amx() {
    let mut rng = Generator::new(304);
    // Input gradients only (the forward takes no 48 input channels): dx channels an odd
    // multiple of 16, which stores its last 16 through the 1 × 4 tiling.
    let extra = [
        ((48, (9, 9), (3, 3), (1, 1), 1, 32), (2, 2)),
        ((48, (8, 9), (1, 1), (0, 0), 1, 16), (2, 2)),
    ];
    for (i, (case, stride)) in STRIDED.iter().chain(&extra).enumerate() {
        let g = strided(case, *stride);
        let w0 = vec![bf16::ZERO; g.weight_len()];
        let expect = !matches!(i, 5 | 7 | 9 | 11);
        assert_eq!(
            AmxInputGradPlan::with_amx(&g, &w0, false).is_some(),
            expect,
            "{g:?}"
        );
        if !expect {
            continue;
        }
        for exact in [false, true] {
            let mut val = |r: f64| {
                let v = rng.uniform(-r, r);
                bf16::from_f64(if exact { v.round() } else { v })
            };
            let w: Vec<bf16> = (0..g.weight_len()).map(|_| val(4.0)).collect();
            let dy: Vec<bf16> = (0..g.out_image()).map(|_| val(2.0)).collect();
            let f = |v: &[bf16]| v.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
            let (want, mag) = input_grad_reference(&f(&w), &f(&dy), &g);
            let run = |plan: &AmxInputGradPlan| {
                let mut got = vec![f32::NAN; g.in_image() + 1];
                plan.image(&dy, &mut got[..g.in_image()], 0.0);
                assert!(got[g.in_image()].is_nan(), "{g:?}: wrote past dx");
                got.pop();
                let tol_of =
                    |m: f64| 2.0 * (g.c_out * g.kh * g.kw + 2) as f64 * f64::powi(2.0, -24) * m;
                for (i, ((&v, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                    assert!(
                        (v as f64 - w).abs() <= tol_of(m),
                        "{g:?} amx {}: dx[{i}] = {v}, want {w}",
                        plan.uses_amx()
                    );
                }
                let mut got16 = vec![bf16::from_bits(0x7FC1); g.in_image()];
                plan.image(&dy, &mut got16, bf16::ZERO);
                let mut want16 = vec![bf16::ZERO; g.in_image()];
                hemi::dtype::convert::f32_to_bf16(&got, &mut want16);
                assert!(
                    got16
                        .iter()
                        .zip(&want16)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{g:?} amx {}: the BF16 dx is not the F32 one rounded",
                    plan.uses_amx()
                );
                got
            };
            let twin = AmxInputGradPlan::with_amx(&g, &w, false).expect("a plan");
            let t = run(&twin);
            if let Some(tiles) = AmxInputGradPlan::with_amx(&g, &w, true) {
                let a = run(&tiles);
                if exact {
                    assert_eq!(
                        bits(&a),
                        bits(&t),
                        "{g:?}: AMX differs from the twin on exact sums"
                    );
                }
            }
        }
    }
    // Padded past the kernel: a phase would need negative padding.
    let wide = strided(&(16, (8, 8), (1, 1), (1, 1), 1, 16), (2, 2));
    assert!(AmxInputGradPlan::with_amx(&wide, &[bf16::ZERO; 256], false).is_none());
    // Stride 1 is a plain convolution of dy, not this plan's.
    let plain = geom(&(16, (8, 8), (3, 3), (1, 1), 1, 16));
    assert!(AmxInputGradPlan::with_amx(&plain, &vec![bf16::ZERO; 16 * 16 * 9], false).is_none());
}

/// One plan over batches of changing size (its buffers laid out for the last one): each
/// call adds exactly the gradient of its own images. Small integers keep every sum exact,
/// so the result must equal the F64 reference to the bit.
#[test]
fn weight_grads_follow_the_batch_size() {
    let mut rng = Generator::new(305);
    for case in [
        (16, (7, 9), (3, 3), (1, 1), 1, 32),
        (32, (6, 5), (3, 3), (1, 1), 1, 16),
    ] {
        let g = geom(&case);
        let int = |rng: &mut Generator, r: f64| bf16::from_f64(rng.uniform(-r, r).round());
        let x: Vec<bf16> = (0..3 * g.in_image()).map(|_| int(&mut rng, 4.0)).collect();
        let dy: Vec<bf16> = (0..3 * g.out_image()).map(|_| int(&mut rng, 3.0)).collect();
        let mut plans = vec![AmxWgradPlan::with_amx(&g, false).expect("a plan")];
        plans.extend(AmxWgradPlan::with_amx(&g, true));
        for plan in &plans {
            let mut got = vec![0f32; g.weight_len()];
            let mut want = vec![0f64; g.weight_len()];
            for n in [3, 2, 3, 0, 1] {
                let (x, dy) = (&x[..n * g.in_image()], &dy[..n * g.out_image()]);
                plan.add_weight_grad(x, dy, n, &mut got);
                if n > 0 {
                    let f = |v: &[bf16]| v.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
                    let (dw, _) =
                        conv2d_weight_grad_reference(&f(x), &f(dy), &Conv2dGeom { n, ..g });
                    want.iter_mut().zip(&dw).for_each(|(a, b)| *a += b);
                }
                let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
                assert_eq!(
                    bits(&got),
                    bits(&want32),
                    "{g:?} amx {}: after a batch of {n}",
                    plan.uses_amx()
                );
            }
        }
    }
}

/// A convolution whose copies or outputs would hold positions past what the plans' `u32`
/// runs keep gets no plan (the caller's other routes take it) rather than a panic.
#[test]
fn images_too_large_for_the_runs_get_no_plan() {
    let big = geom(&(32, (40_000, 40_000), (3, 3), (1, 1), 1, 32));
    let w = vec![bf16::ZERO; big.weight_len()];
    assert!(AmxConvPlan::with_amx(&big, &w, false).is_none());
    assert!(AmxWgradPlan::with_amx(&big, false).is_none());
    let big2 = strided(&(32, (40_000, 40_000), (3, 3), (1, 1), 1, 32), (2, 2));
    assert!(AmxInputGradPlan::with_amx(&big2, &w, false).is_none());
    // The same convolution on a small image is taken.
    let small = geom(&(32, (40, 40), (3, 3), (1, 1), 1, 32));
    assert!(AmxConvPlan::with_amx(&small, &w, false).is_some());
}
