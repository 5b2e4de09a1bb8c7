//! INT8 quantisation: the quantise/dequantise arithmetic on its edge values against an f64
//! reference of PyTorch's formula, observers' qparams, the dynamic and static INT8 layers
//! against exact integer references, fake quantisation's straight-through gradient, and the
//! quantised file's round trip and errors.

use std::collections::HashMap;

use hemi::cpu::qgemm::quant as k;
use hemi::models::Mlp;
use hemi::nn::{Conv2d, ForwardHook, LayerRef, Linear, Module};
use hemi::ops::conv::Conv2dOptions;
use hemi::quant::{
    self, fake_quant_ste, fake_quant_weight, DynamicHook, Mode, Observer, ObserverKind, QDType,
    QTensor, QWeights, StaticHook,
};
use hemi::{Generator, Tensor};

/// PyTorch's CPU quantisation in f64: the f32 product `x · (1/scale)` (the f64 product of
/// two f32 is exact, so rounding it to f32 gives the correctly rounded f32 product), then
/// round-half-even, plus the zero point, clamped. NaN goes to the zero point (hemi's
/// choice; PyTorch leaves it unspecified).
fn quantize_ref(x: f32, scale: f32, zp: i32, qmin: i32, qmax: i32) -> i32 {
    let inv = 1.0f32 / scale;
    let p = ((x as f64) * (inv as f64)) as f32 as f64;
    if p.is_nan() {
        return zp.clamp(qmin, qmax);
    }
    let r = p.round_ties_even() + zp as f64;
    r.clamp(qmin as f64, qmax as f64) as i32
}

/// The f32 neighbours of `x` one ulp away (finite ones).
fn neighbours(x: f32) -> [f32; 3] {
    [x.next_down(), x, x.next_up()]
}

const SCALES: [f32; 7] = [1.0, 0.1, 1.0 / 3.0, 0.0371, 0.0078125, 1e-6, 3.5e3];

/// Inputs that exercise every edge: each half-integer multiple of the scale over and beyond
/// the range (the ties) and their neighbours, signed zeros, subnormals, huge and infinite
/// values, NaN.
fn edge_values(scale: f32) -> Vec<f32> {
    let mut v = Vec::new();
    for t in -600..=600 {
        let x = (t as f64 * 0.5 * scale as f64) as f32;
        v.extend(neighbours(x));
    }
    v.extend([
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        -f32::from_bits(1),
        f32::MAX,
        f32::MIN,
        1e30,
        -1e30,
        3e9,
        -3e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]);
    v
}

#[test]
fn quantize_matches_the_f64_reference_on_every_edge_value() {
    let mut checked = 0;
    for &scale in &SCALES {
        let xs = edge_values(scale);
        for (qmin, qmax, zps) in [
            (0, 255, &[0, 1, 77, 128, 254, 255][..]),
            (-128, 127, &[-128, -5, 0, 3, 127][..]),
        ] {
            for &zp in zps {
                let inv = 1.0 / scale;
                for &x in &xs {
                    let got = k::quantize_one(x, inv, zp, qmin, qmax);
                    let want = quantize_ref(x, scale, zp, qmin, qmax);
                    assert_eq!(
                        got,
                        want,
                        "x {x:e} ({:#x}) scale {scale:e} zp {zp} range {qmin}..={qmax}",
                        x.to_bits()
                    );
                    checked += 1;
                }
                // The slice functions and QTensor agree with the scalar one.
                let t = Tensor::from_vec(xs.clone(), &[xs.len()]).unwrap();
                if qmin == 0 {
                    let mut q = vec![0u8; xs.len()];
                    k::quantize_u8(&xs, scale, zp, &mut q);
                    let qt = QTensor::quantize_per_tensor(&t, scale, zp, QDType::U8).unwrap();
                    let hemi::quant::QData::U8(qd) = qt.data() else {
                        panic!("quantize_per_tensor(U8) did not give u8 data")
                    };
                    for ((&x, &a), &b) in xs.iter().zip(&q).zip(qd) {
                        let want = quantize_ref(x, scale, zp, 0, 255);
                        assert_eq!((a as i32, b as i32), (want, want), "x {x:e}");
                    }
                } else {
                    let mut q = vec![0i8; xs.len()];
                    k::quantize_i8(&xs, scale, zp, &mut q);
                    let qt = QTensor::quantize_per_tensor(&t, scale, zp, QDType::I8).unwrap();
                    for ((&x, &a), &b) in xs.iter().zip(&q).zip(qt.as_i8().unwrap()) {
                        let want = quantize_ref(x, scale, zp, -128, 127);
                        assert_eq!((a as i32, b as i32), (want, want), "x {x:e}");
                    }
                }
            }
        }
    }
    assert!(checked > 100_000, "only {checked} values checked");
}

#[test]
fn ties_round_to_even_and_out_of_range_values_saturate() {
    // scale 1: x.5 rounds to the even neighbour, both signs.
    let q = |x: f32| k::quantize_one(x, 1.0, 128, 0, 255);
    assert_eq!(
        [q(0.5), q(1.5), q(2.5), q(-0.5), q(-1.5)],
        [128, 130, 130, 128, 126]
    );
    assert_eq!([q(127.0), q(127.5), q(1e9), q(f32::INFINITY)], [255; 4]);
    assert_eq!(
        [q(-128.0), q(-128.5), q(-1e9), q(f32::NEG_INFINITY)],
        [0; 4]
    );
    assert_eq!(q(f32::NAN), 128);
    let s = |x: f32| k::quantize_one(x, 1.0, 0, -128, 127);
    assert_eq!(
        [s(-128.5), s(127.5), s(-1e30), s(1e30)],
        [-128, 127, -128, 127]
    );
}

#[test]
fn dequantize_is_the_correctly_rounded_product_for_every_code() {
    for &scale in &SCALES {
        for zp in [0, 1, 77, 128, 255] {
            let q: Vec<u8> = (0..=255).collect();
            let mut out = vec![0f32; 256];
            k::dequantize_u8(&q, scale, zp, &mut out);
            for (&c, &y) in q.iter().zip(&out) {
                let want = ((c as i32 - zp) as f64 * scale as f64) as f32;
                assert_eq!(
                    y.to_bits(),
                    want.to_bits(),
                    "u8 {c} zp {zp} scale {scale:e}"
                );
            }
        }
        for zp in [-128, -5, 0, 127] {
            let q: Vec<i8> = (-128..=127).collect();
            let mut out = vec![0f32; 256];
            k::dequantize_i8(&q, scale, zp, &mut out);
            for (&c, &y) in q.iter().zip(&out) {
                let want = ((c as i32 - zp) as f64 * scale as f64) as f32;
                assert_eq!(
                    y.to_bits(),
                    want.to_bits(),
                    "i8 {c} zp {zp} scale {scale:e}"
                );
            }
        }
    }
}

#[test]
fn a_round_trip_is_within_half_a_step_inside_the_range() {
    let mut rng = Generator::new(7);
    for &scale in &SCALES[..5] {
        for zp in [0, 100, 255] {
            let lo = (0 - zp) as f64 * scale as f64;
            let hi = (255 - zp) as f64 * scale as f64;
            let xs: Vec<f32> = (0..4000).map(|_| rng.uniform(lo, hi) as f32).collect();
            let mut q = vec![0u8; xs.len()];
            k::quantize_u8(&xs, scale, zp, &mut q);
            let mut back = vec![0f32; xs.len()];
            k::dequantize_u8(&q, scale, zp, &mut back);
            for (&x, &y) in xs.iter().zip(&back) {
                // Half a step, plus the f32 roundings of x·(1/scale) and of the product.
                let bound = 0.5 * scale as f64 + 4.0 * f32::EPSILON as f64 * x.abs() as f64;
                assert!(
                    (x as f64 - y as f64).abs() <= bound,
                    "x {x} -> {y} (scale {scale}, zp {zp})"
                );
            }
        }
    }
}

#[test]
fn affine_qparams_cover_the_range_and_hold_zero_exactly() {
    let mut rng = Generator::new(3);
    for _ in 0..2000 {
        let a = rng.uniform(-50.0, 50.0) as f32 * rng.uniform_f64() as f32;
        let b = rng.uniform(-50.0, 50.0) as f32;
        let (lo, hi) = (a.min(b), a.max(b));
        let (scale, zp) = k::affine_qparams(lo, hi, 0, 255);
        assert!((0..=255).contains(&zp));
        assert!(scale >= f32::EPSILON);
        // 0 is a code (zp), and the extremes of the range lie within half a step of codes.
        let (qlo, qhi) = (
            (0 - zp) as f64 * scale as f64,
            (255 - zp) as f64 * scale as f64,
        );
        let slack = 0.5 * scale as f64 + 1e-5 * (hi - lo) as f64;
        assert!(qlo <= lo.min(0.0) as f64 + slack, "{lo} {hi}: {qlo}");
        assert!(qhi >= hi.max(0.0) as f64 - slack, "{lo} {hi}: {qhi}");
        // PyTorch's formula, in f32.
        let want_scale = ((hi.max(0.0) - lo.min(0.0)) / 255.0).max(f32::EPSILON);
        assert_eq!(scale.to_bits(), want_scale.to_bits());
    }
    // Degenerate ranges: a constant zero tensor gets the smallest scale, zero point 0.
    assert_eq!(k::affine_qparams(0.0, 0.0, 0, 255), (f32::EPSILON, 0));
    // All-positive data still has 0 in range: zero point 0.
    assert_eq!(k::affine_qparams(2.0, 5.1, 0, 255).1, 0);
    // All-negative data: zero point 255.
    assert_eq!(k::affine_qparams(-5.0, -1.0, 0, 255).1, 255);
}

#[test]
fn observers_track_their_ranges() {
    let batches: [&[f32]; 3] = [&[-1.0, 2.0, 0.5], &[-3.0, 1.0], &[0.0, 4.0, f32::NAN]];
    let mut mm = Observer::new(ObserverKind::MinMax);
    let mut ma = Observer::new(ObserverKind::MovingAverage(0.01));
    for b in batches {
        mm.observe(b);
        ma.observe(b);
    }
    assert_eq!(mm.range(), (-3.0, 4.0));
    // PyTorch's update in f32: r += c · (now - r), from the first batch's range.
    let (mut lo, mut hi) = (-1.0f32, 2.0f32);
    lo += 0.01 * (-3.0 - lo);
    hi += 0.01 * (1.0 - hi);
    lo += 0.01 * (0.0 - lo);
    hi += 0.01 * (4.0 - hi);
    assert_eq!(ma.range(), (lo, hi));
    assert_eq!(ma.batches(), 3);

    // Percentile clips a rare outlier that min-max keeps; MSE shrinks the range too.
    let mut rng = Generator::new(11);
    let mut data: Vec<f32> = (0..20_000).map(|_| rng.normal() as f32).collect();
    data[17] = 1000.0;
    let mut mm = Observer::new(ObserverKind::MinMax);
    let mut pc = Observer::new(ObserverKind::parse("percentile:99.9").unwrap());
    let mut mse = Observer::new(ObserverKind::parse("mse").unwrap());
    for o in [&mut mm, &mut pc, &mut mse] {
        o.observe(&data);
    }
    assert_eq!(mm.range().1, 1000.0);
    let (plo, phi) = pc.range();
    assert!(
        phi > 2.5 && phi < 4.5 && plo < -2.5 && plo > -4.5,
        "{plo} {phi}"
    );
    // MSE keeps an outlier that costs more clipped than it saves (it is one of the
    // candidates), and never does worse than min-max on the values it saw.
    let err = |(lo, hi): (f32, f32), xs: &[f32]| -> f64 {
        let (s, z) = k::affine_qparams(lo, hi, 0, 255);
        xs.iter()
            .map(|&v| {
                let q = quantize_ref(v, s, z, 0, 255);
                ((q - z) as f64 * s as f64 - v as f64).powi(2)
            })
            .sum()
    };
    assert!(err(mse.range(), &data) <= err(mm.range(), &data));
    // On heavy-tailed data (a ratio of normals) clipping pays: MSE shrinks the range and
    // its error is lower than min-max's.
    let tail: Vec<f32> = (0..20_000)
        .map(|_| (rng.normal() / rng.normal().abs().max(0.05)) as f32)
        .collect();
    let mut mm = Observer::new(ObserverKind::MinMax);
    let mut mse = Observer::new(ObserverKind::Mse);
    mm.observe(&tail);
    mse.observe(&tail);
    let (full, clipped) = (mm.range(), mse.range());
    assert!(
        clipped.1 < full.1 && clipped.0 > full.0,
        "{full:?} -> {clipped:?}"
    );
    assert!(err(clipped, &tail) < err(full, &tail));
    // Bad specs are errors, not panics.
    for bad in [
        "percentile:20",
        "moving-average:2",
        "median",
        "percentile:x",
    ] {
        assert!(ObserverKind::parse(bad).is_err(), "{bad}");
    }
}

/// Symmetric per-channel s8 weights, as the reference computes them.
fn weight_ref(w: &[f32], out: usize) -> (Vec<i32>, Vec<f32>) {
    let per = w.len() / out;
    let mut q = Vec::new();
    let mut scales = Vec::new();
    for c in w.chunks(per) {
        let m = c.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let s = (m / 127.5).max(f32::EPSILON);
        scales.push(s);
        q.extend(c.iter().map(|&v| quantize_ref(v, s, 0, -128, 127)));
    }
    (q, scales)
}

fn random_linear(i: usize, o: usize, rng: &mut Generator) -> Linear {
    Linear::new(i, o, true, rng).unwrap()
}

#[test]
fn dynamic_linear_matches_the_integer_reference() {
    let mut rng = Generator::new(1);
    for (m, i, o) in [(1, 1, 1), (3, 37, 5), (17, 130, 33), (64, 300, 70)] {
        let lin = random_linear(i, o, &mut rng);
        let hook = DynamicHook {
            weights: QWeights::from_layer(LayerRef::Linear(&lin)).unwrap(),
        };
        let w = lin.weight.to_vec_f32();
        let b = lin.bias.as_ref().unwrap().to_vec_f32();
        let (wq, ws) = weight_ref(&w, o);
        assert_eq!(hook.weights.weight.scales(), ws);
        let got_w: Vec<i32> = hook
            .weights
            .weight
            .as_i8()
            .unwrap()
            .iter()
            .map(|&v| v as i32)
            .collect();
        assert_eq!(got_w, wq, "weights");
        // Inputs with a shifted range per row so that the zero points differ.
        let x: Vec<f32> = (0..m * i)
            .map(|j| (rng.uniform(-1.0, 1.0) + (j / i) as f64 * 0.3) as f32)
            .collect();
        let xt = Tensor::from_vec(x.clone(), &[m, i]).unwrap();
        for relu in [false, true] {
            let y = hook.forward(LayerRef::Linear(&lin), &xt, relu).unwrap();
            assert_eq!(y.shape(), &[m, o]);
            let y = y.to_vec_f32();
            let yf = xt
                .linear(&lin.weight, lin.bias.as_ref())
                .unwrap()
                .to_vec_f32();
            for r in 0..m {
                let row = &x[r * i..(r + 1) * i];
                let (lo, hi) = k::min_max(row);
                let (sa, za) = k::affine_qparams(lo, hi, 0, 255);
                let xq: Vec<i32> = row
                    .iter()
                    .map(|&v| quantize_ref(v, sa, za, 0, 255))
                    .collect();
                for c in 0..o {
                    let wrow = &wq[c * i..(c + 1) * i];
                    let acc: i64 = xq
                        .iter()
                        .zip(wrow)
                        .map(|(&a, &w)| (a - za) as i64 * w as i64)
                        .sum();
                    let mag: i64 = xq
                        .iter()
                        .zip(wrow)
                        .map(|(&a, &w)| ((a - za) as i64 * w as i64).abs())
                        .sum();
                    let s = sa as f64 * ws[c] as f64;
                    let mut want = acc as f64 * s + b[c] as f64;
                    if relu {
                        want = want.max(0.0);
                    }
                    let got = y[r * o + c] as f64;
                    let tol =
                        4.0 * f32::EPSILON as f64 * (mag as f64 * s + (b[c] as f64).abs()) + 1e-30;
                    assert!(
                        (got - want).abs() <= tol,
                        "[{r},{c}] {got} vs {want} (m {m} i {i} o {o})"
                    );
                    // And the float layer is within the quantisation error bound.
                    let mut f = yf[r * o + c] as f64;
                    if relu {
                        f = f.max(0.0);
                    }
                    let bound: f64 = row
                        .iter()
                        .zip(&w[c * i..(c + 1) * i])
                        .map(|(&xv, &wv)| {
                            (xv.abs() as f64) * ws[c] as f64 / 2.0
                                + (wv.abs() as f64) * sa as f64 / 2.0
                                + sa as f64 * ws[c] as f64 / 4.0
                        })
                        .sum::<f64>()
                        + tol
                        + 1e-6;
                    assert!(
                        (got - f).abs() <= bound,
                        "[{r},{c}] int8 {got} float {f} bound {bound}"
                    );
                }
            }
        }
    }
}

/// A direct integer convolution of u8 codes (padding = the zero point) with s8 weights.
#[allow(clippy::too_many_arguments)]
fn conv_acc(
    xq: &[i32],
    za: i32,
    shape: [usize; 4],
    wq: &[i32],
    oc: usize,
    kh: usize,
    kw: usize,
    o: Conv2dOptions,
) -> (Vec<i64>, Vec<i64>, usize, usize) {
    let [n, c, h, w] = shape;
    let oh = (h + 2 * o.padding.0 - o.dilation.0 * (kh - 1) - 1) / o.stride.0 + 1;
    let ow = (w + 2 * o.padding.1 - o.dilation.1 * (kw - 1) - 1) / o.stride.1 + 1;
    let mut acc = vec![0i64; n * oc * oh * ow];
    let mut mag = vec![0i64; n * oc * oh * ow];
    for b in 0..n {
        for f in 0..oc {
            for y in 0..oh {
                for x in 0..ow {
                    let (mut s, mut m) = (0i64, 0i64);
                    for ci in 0..c {
                        for i in 0..kh {
                            for j in 0..kw {
                                let iy = (y * o.stride.0 + i * o.dilation.0) as isize
                                    - o.padding.0 as isize;
                                let ix = (x * o.stride.1 + j * o.dilation.1) as isize
                                    - o.padding.1 as isize;
                                let a = if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize
                                {
                                    za
                                } else {
                                    xq[((b * c + ci) * h + iy as usize) * w + ix as usize]
                                };
                                let p =
                                    (a - za) as i64 * wq[((f * c + ci) * kh + i) * kw + j] as i64;
                                s += p;
                                m += p.abs();
                            }
                        }
                    }
                    let at = ((b * oc + f) * oh + y) * ow + x;
                    acc[at] = s;
                    mag[at] = m;
                }
            }
        }
    }
    (acc, mag, oh, ow)
}

#[test]
fn static_conv_matches_the_integer_reference() {
    let mut rng = Generator::new(5);
    let cases = [
        ([2, 3, 9, 7], 4, (3, 3), Conv2dOptions::default().padding(1)),
        ([1, 5, 8, 11], 6, (2, 3), Conv2dOptions::default().stride(2)),
        (
            [3, 2, 7, 7],
            3,
            (3, 2),
            Conv2dOptions {
                stride: (1, 2),
                padding: (2, 1),
                dilation: (2, 1),
                groups: 1,
            },
        ),
        ([1, 1, 5, 5], 1, (1, 1), Conv2dOptions::default()),
    ];
    for (shape, oc, (kh, kw), opts) in cases {
        let conv = Conv2d::new(shape[1], oc, (kh, kw), opts, true, &mut rng).unwrap();
        let n: usize = shape.iter().product();
        let x: Vec<f32> = (0..n).map(|_| rng.uniform(-0.7, 1.3) as f32).collect();
        let xt = Tensor::from_vec(x.clone(), &shape).unwrap();
        let input = k::affine_qparams(-0.7, 1.3, 0, 255);
        let output = k::affine_qparams(-0.9, 1.1, 0, 255);
        let hook = StaticHook {
            weights: QWeights::from_layer(LayerRef::Conv2d(&conv)).unwrap(),
            input,
            output,
        };
        let w = conv.weight.to_vec_f32();
        let b = conv.bias.as_ref().unwrap().to_vec_f32();
        let (wq, ws) = weight_ref(&w, oc);
        let xq: Vec<i32> = x
            .iter()
            .map(|&v| quantize_ref(v, input.0, input.1, 0, 255))
            .collect();
        let (acc, mag, oh, ow) = conv_acc(&xq, input.1, shape, &wq, oc, kh, kw, opts);
        for relu in [false, true] {
            let y = hook.forward(LayerRef::Conv2d(&conv), &xt, relu).unwrap();
            assert_eq!(y.shape(), &[shape[0], oc, oh, ow]);
            let y = y.to_vec_f32();
            let (so, zo) = output;
            let mut exact = 0;
            for (at, (&a, &m)) in acc.iter().zip(&mag).enumerate() {
                let f = (at / (oh * ow)) % oc;
                let s = input.0 as f64 * ws[f] as f64;
                let mut v = a as f64 * s + b[f] as f64;
                if relu {
                    v = v.max(0.0);
                }
                let q = ((v / so as f64).round_ties_even() + zo as f64).clamp(0.0, 255.0);
                // The u8 output dequantised in f32, as the layer hands it on.
                let want = ((q - zo as f64) * so as f64) as f32 as f64;
                let got = y[at] as f64;
                // Exact, except where v / out_scale lies within the f32 epilogue's
                // rounding error of a tie (it may round the other way: one step).
                let slack =
                    8.0 * f32::EPSILON as f64 * (m as f64 * s + b[f].abs() as f64) / so as f64;
                let t = v / so as f64;
                let from_tie = (t - t.floor() - 0.5).abs();
                if got == want {
                    exact += 1;
                } else {
                    assert!(
                        (got - want).abs() <= so as f64 * (1.0 + 1e-6) && from_tie <= slack,
                        "{shape:?} [{at}] {got} vs {want}: v/scale {t} is {from_tie} from a tie"
                    );
                }
            }
            assert!(
                exact * 100 >= acc.len() * 98,
                "{exact} of {} exact",
                acc.len()
            );
        }
    }
}

#[test]
fn quantized_layers_reject_bad_inputs() {
    let mut rng = Generator::new(2);
    let lin = random_linear(8, 3, &mut rng);
    let hook = DynamicHook {
        weights: QWeights::from_layer(LayerRef::Linear(&lin)).unwrap(),
    };
    let bad = Tensor::from_vec(vec![0.0; 14], &[2, 7]).unwrap();
    let e = hook
        .forward(LayerRef::Linear(&lin), &bad, false)
        .unwrap_err();
    assert!(e.to_string().contains("[.., 8]"), "{e}");
    let conv = Conv2d::new(3, 2, (3, 3), Conv2dOptions::default(), false, &mut rng).unwrap();
    let hook = StaticHook {
        weights: QWeights::from_layer(LayerRef::Conv2d(&conv)).unwrap(),
        input: (0.1, 0),
        output: (0.1, 0),
    };
    for s in [&[1usize, 2, 5, 5][..], &[1, 3, 2, 2], &[3, 5, 5]] {
        let x = Tensor::zeros(s, hemi::DType::F32).unwrap();
        assert!(
            hook.forward(LayerRef::Conv2d(&conv), &x, false).is_err(),
            "{s:?}"
        );
    }
    let grouped = Conv2d::new(
        4,
        4,
        (3, 3),
        Conv2dOptions {
            groups: 2,
            ..Default::default()
        },
        false,
        &mut rng,
    )
    .unwrap();
    assert!(QWeights::from_layer(LayerRef::Conv2d(&grouped)).is_err());
    assert!(QTensor::quantize_per_tensor(&bad, 0.0, 0, QDType::U8).is_err());
    assert!(QTensor::quantize_per_tensor(&bad, 0.1, 300, QDType::U8).is_err());
    assert!(QTensor::quantize_per_channel(&bad, &[0.1; 3], &[0; 3], 1, QDType::I8).is_err());
}

/// The straight-through mask at the edges: codes at half steps around both ends of 0..=255
/// (round half to even decides), far-out values, infinities and NaN, against the mask's
/// definition `round_ties_even(x / scale) + zp ∈ 0..=255` evaluated in F32.
#[test]
fn fake_quant_mask_at_half_steps_infinities_and_nan() {
    let (scale, zp) = (0.25f32, 7);
    let mut xs: Vec<f32> = Vec::new();
    for end in [-zp, 255 - zp] {
        for k in -6..=6 {
            xs.push((end as f32 + k as f32 * 0.5) * scale);
        }
    }
    xs.extend([
        1e30,
        -1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
    ]);
    let n = xs.len();
    let x = Tensor::from_vec(xs.clone(), &[n]).unwrap().requires_grad_();
    let y = fake_quant_ste(&x, scale, zp).unwrap();
    y.sum(&[], false).unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec_f32();
    for (i, &v) in xs.iter().enumerate() {
        let code = (v * (1.0 / scale)).round_ties_even() + zp as f32;
        let want = if (0.0..=255.0).contains(&code) {
            1.0
        } else {
            0.0
        };
        assert_eq!(g[i], want, "x {v}: gradient {} (code {code})", g[i]);
    }
}

#[test]
fn fake_quant_passes_gradients_straight_through_inside_the_range() {
    let (scale, zp) = (0.05f32, 60);
    let lo = (0 - zp) as f32 * scale;
    let hi = (255 - zp) as f32 * scale;
    let mut rng = Generator::new(9);
    let xs: Vec<f32> = (0..500).map(|_| rng.uniform(-5.0, 12.0) as f32).collect();
    let x = Tensor::from_vec(xs.clone(), &[500])
        .unwrap()
        .requires_grad_();
    let y = fake_quant_ste(&x, scale, zp).unwrap();
    let w: Vec<f32> = (0..500).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let wt = Tensor::from_vec(w.clone(), &[500]).unwrap();
    y.mul(&wt)
        .unwrap()
        .sum(&[], false)
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap().to_vec_f32();
    let yv = y.to_vec_f32();
    let mut inside = 0;
    for i in 0..500 {
        let q = quantize_ref(xs[i], scale, zp, 0, 255);
        let want = (q - zp) as f32 * scale;
        assert!(
            (yv[i] - want).abs() <= want.abs() * f32::EPSILON + 1e-7,
            "{} -> {} vs {want}",
            xs[i],
            yv[i]
        );
        // PyTorch's mask: the rounded code lies in 0..=255 (half a step beyond the range).
        let code = (xs[i] * (1.0 / scale)).round_ties_even() + zp as f32;
        let pass = (0.0..=255.0).contains(&code);
        let half = scale * 0.5001;
        if xs[i] >= lo && xs[i] <= hi {
            assert!(pass, "x {} inside the range is blocked", xs[i]);
        } else if pass {
            assert!(
                xs[i] >= lo - half && xs[i] <= hi + half,
                "x {} passes",
                xs[i]
            );
        }
        inside += pass as usize;
        assert_eq!(g[i], if pass { w[i] } else { 0.0 }, "x {}", xs[i]);
    }
    assert!(inside > 100 && inside < 500, "{inside} inside");

    // Weights: fake-quantised per channel, gradient unchanged.
    let wv: Vec<f32> = (0..24).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let wt = Tensor::from_vec(wv.clone(), &[4, 6])
        .unwrap()
        .requires_grad_();
    let fq = fake_quant_weight(&wt).unwrap();
    let (q, s) = weight_ref(&wv, 4);
    for (i, v) in fq.to_vec_f32().iter().enumerate() {
        let want = q[i] as f32 * s[i / 6];
        assert!(
            (v - want).abs() <= want.abs() * f32::EPSILON + 1e-9,
            "{i}: {v} vs {want}"
        );
    }
    fq.sum(&[], false).unwrap().backward().unwrap();
    assert_eq!(wt.grad().unwrap().to_vec_f32(), vec![1.0; 24]);
}

#[test]
fn qat_observers_learn_only_in_training_steps() {
    let mut rng = Generator::new(4);
    let mut m = Mlp::new(12, 10, 3, &mut rng).unwrap();
    let names = quant::prepare_qat(&mut m).unwrap();
    assert_eq!(names, ["fc1", "fc2"]);
    let x = Tensor::from_vec((0..48).map(|i| i as f32 / 24.0 - 1.0).collect(), &[4, 12]).unwrap();
    m.forward(&x).unwrap();
    let hook = m.layers_mut().into_iter().next().unwrap().1;
    let seen = |h: &hemi::nn::LayerMut<'_>| match h {
        hemi::nn::LayerMut::Linear(l) => {
            let any = l.hook.as_ref().unwrap().as_any();
            let f = any.downcast_ref::<hemi::quant::FakeQuantHook>().unwrap();
            f.input.lock().unwrap().batches()
        }
        _ => unreachable!(),
    };
    assert_eq!(seen(&hook), 1);
    {
        let _g = hemi::no_grad();
        m.forward(&x).unwrap();
    }
    let hook = m.layers_mut().into_iter().next().unwrap().1;
    assert_eq!(
        seen(&hook),
        1,
        "evaluation under no_grad moved the observer"
    );
    // The fake-quantised model computes what the converted INT8 model computes, nearly.
    let yq = m.forward(&x).unwrap().to_vec_f32();
    quant::convert_static(&mut m).unwrap();
    let yi = m.forward(&x).unwrap().to_vec_f32();
    for (a, b) in yq.iter().zip(&yi) {
        assert!((a - b).abs() < 0.05, "QAT {a} vs INT8 {b}");
    }
}

fn calibrated_mlp(seed: u64) -> (Mlp, Tensor) {
    let mut rng = Generator::new(seed);
    let mut m = Mlp::new(40, 32, 6, &mut rng).unwrap();
    quant::prepare_static(&mut m, ObserverKind::MinMax).unwrap();
    let x = Tensor::from_vec(
        (0..40 * 9).map(|_| rng.uniform(-1.0, 1.0) as f32).collect(),
        &[9, 40],
    )
    .unwrap();
    m.forward(&x).unwrap();
    quant::convert_static(&mut m).unwrap();
    (m, x)
}

#[test]
fn quantized_files_round_trip_bit_for_bit() {
    // Static.
    let (mut m, x) = calibrated_mlp(1);
    let y = m.forward(&x).unwrap().to_vec_f32();
    let bytes = quant::quantized_bytes(&mut m, &HashMap::new()).unwrap();
    let mut fresh = Mlp::new(40, 32, 6, &mut Generator::new(99)).unwrap();
    let (mode, meta) = quant::load_quantized(&mut fresh, "mem", &bytes).unwrap();
    assert_eq!(mode, Mode::Static);
    assert_eq!(meta["layers"], "fc1,fc2");
    let y2 = fresh.forward(&x).unwrap().to_vec_f32();
    assert_eq!(
        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        y2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // Dynamic.
    let mut rng = Generator::new(2);
    let mut m = Mlp::new(40, 32, 6, &mut rng).unwrap();
    assert_eq!(quant::quantize_dynamic(&mut m).unwrap(), ["fc1", "fc2"]);
    let y = m.forward(&x).unwrap().to_vec_f32();
    let bytes = quant::quantized_bytes(&mut m, &HashMap::new()).unwrap();
    let mut fresh = Mlp::new(40, 32, 6, &mut Generator::new(98)).unwrap();
    let (mode, _) = quant::load_quantized(&mut fresh, "mem", &bytes).unwrap();
    assert_eq!(mode, Mode::Dynamic);
    assert_eq!(fresh.forward(&x).unwrap().to_vec_f32(), y);
}

#[test]
fn int8_files_are_under_a_third_of_the_float_ones() {
    let mut rng = Generator::new(3);
    let mut m = Mlp::new(3 * 32 * 32, 256, 10, &mut rng).unwrap();
    let float: usize = m.tensors().iter().map(|(_, t, _, _)| t.numel() * 4).sum();
    quant::quantize_dynamic(&mut m).unwrap();
    let bytes = quant::quantized_bytes(&mut m, &HashMap::new()).unwrap();
    let ratio = bytes.len() as f64 / float as f64;
    assert!(
        ratio <= 0.3,
        "INT8 file {} bytes, float tensors {float}: {ratio:.3}",
        bytes.len()
    );
}

#[test]
fn corrupt_or_mismatched_files_are_errors() {
    let (mut m, _) = calibrated_mlp(4);
    let bytes = quant::quantized_bytes(&mut m, &HashMap::new()).unwrap();
    // Truncated anywhere: an error, never a panic.
    for cut in [0, 7, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        let mut fresh = Mlp::new(40, 32, 6, &mut Generator::new(1)).unwrap();
        assert!(
            quant::load_quantized(&mut fresh, "cut", &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    // Another architecture: the error names the tensor.
    let mut other = Mlp::new(40, 16, 6, &mut Generator::new(1)).unwrap();
    let e = quant::load_quantized(&mut other, "mem", &bytes)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fc1"), "{e}");
    // A float checkpoint is not an INT8 file.
    let plain = safetensors::serialize(
        [(
            "fc1.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0u8; 4])
                .unwrap(),
        )],
        None,
    )
    .unwrap();
    let mut fresh = Mlp::new(40, 32, 6, &mut Generator::new(1)).unwrap();
    let e = quant::load_quantized(&mut fresh, "plain", &plain)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hemi-int8"), "{e}");
    // A model without layers cannot be quantised.
    struct Empty;
    impl Module for Empty {
        fn forward(&self, x: &Tensor) -> hemi::Result<Tensor> {
            Ok(x.clone())
        }
    }
    impl hemi::nn::Visit for Empty {
        fn visit<'a>(&'a self, _: &mut dyn hemi::nn::Visitor<'a>) {}
        fn visit_mut<'a>(&'a mut self, _: &mut dyn hemi::nn::VisitorMut<'a>) {}
    }
    assert!(quant::quantize_dynamic(&mut Empty).is_err());
}

#[test]
fn a_dynamic_bert_saves_its_embeddings_weight_only_and_round_trips() {
    use hemi::models::{BertConfig, BertForSequenceClassification};
    let cfg = BertConfig {
        vocab_size: 1000,
        hidden_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 512,
        max_position_embeddings: 16,
        ..BertConfig::default()
    }
    .with_num_labels(2);
    let mut m = BertForSequenceClassification::new(&cfg, &mut Generator::new(1)).unwrap();
    m.set_training(false);
    let _g = hemi::no_grad();
    let ids = Tensor::from_vec(vec![1i64, 40, 7, 2, 999, 9, 3, 0], &[2, 4]).unwrap();
    let yf = m.forward(&ids).unwrap().to_vec_f32();
    let w_float = m
        .tensors()
        .into_iter()
        .find(|(n, ..)| n == "bert.embeddings.word_embeddings.weight")
        .unwrap()
        .1
        .to_vec_f32();
    let float_bytes: usize = m.tensors().iter().map(|(_, t, _, _)| t.numel() * 4).sum();
    let names = quant::quantize_dynamic(&mut m).unwrap();
    // 2 layers × (q, k, v, attention output, intermediate, output) + pooler + classifier.
    assert_eq!(names.len(), 14, "{names:?}");
    let yq = m.forward(&ids).unwrap().to_vec_f32();
    for (a, b) in yf.iter().zip(&yq) {
        assert!((a - b).abs() < 0.05, "float {a} vs INT8 {b}");
    }
    let bytes = quant::quantized_bytes(&mut m, &HashMap::new()).unwrap();
    let meta = quant::quantized_metadata("mem", &bytes).unwrap();
    assert_eq!(
        meta["weight_only"],
        "bert.embeddings.word_embeddings.weight,bert.embeddings.position_embeddings.weight,\
         bert.embeddings.token_type_embeddings.weight"
    );
    let ratio = bytes.len() as f64 / float_bytes as f64;
    assert!(ratio <= 0.3, "{ratio:.3}");
    let mut fresh = BertForSequenceClassification::new(&cfg, &mut Generator::new(2)).unwrap();
    fresh.set_training(false);
    quant::load_quantized(&mut fresh, "mem", &bytes).unwrap();
    // In memory the embeddings stayed float; the file's are INT8: close, and the file
    // loads to the same model wherever it is loaded.
    let yl = fresh.forward(&ids).unwrap().to_vec_f32();
    for (a, b) in yq.iter().zip(&yl) {
        assert!((a - b).abs() < 0.02, "in memory {a} vs loaded {b}");
    }
    quant::load_quantized(&mut m, "mem", &bytes).unwrap();
    assert_eq!(m.forward(&ids).unwrap().to_vec_f32(), yl);
    // The loaded embedding table is the dequantised one: within half a row step of the float.
    let w = &w_float;
    let got = fresh
        .tensors()
        .into_iter()
        .find(|(n, ..)| n == "bert.embeddings.word_embeddings.weight")
        .unwrap()
        .1
        .to_vec_f32();
    for (row, (a, b)) in w.chunks(128).zip(got.chunks(128)).enumerate() {
        let step = a.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.5;
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= step * 0.5001, "row {row}: {x} vs {y}");
        }
    }
}
