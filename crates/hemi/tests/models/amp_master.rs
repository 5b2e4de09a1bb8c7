//! F32 master weights (`Fp16Optimizer`, apex's FP16_Optimizer) and the rounding that writes
//! masters back into half-precision weights.
//!
//! The references: an ordinary `Sgd` over F32 copies of the parameters fed the true
//! (unscaled) gradients, which the masters must match bit for bit; nearest-even rounding by
//! the `half` crate's scalar conversion; and, for stochastic rounding, the two neighbours
//! of a value computed from the format's exponent and mantissa widths in f64.

use half::{bf16, f16};
use hemi::amp::master::{Fp16Optimizer, LossScaling, MasterConfig};
use hemi::amp::rounding::{round_f32_into, stochastic_round_bf16, stochastic_round_f16, Rounding};
use hemi::amp::scaler::GradScalerConfig;
use hemi::optim::{clip_grad_norm, Adam, AdamConfig, Optimizer, OptimizerState, Sgd, SgdConfig};
use hemi::{DType, Generator, Result, Tensor};

// ----- harness ------------------------------------------------------------------------------

type Build = Box<dyn FnOnce(Vec<Tensor>) -> Result<Box<dyn Optimizer>>>;

fn sgd_cfg(lr: f64, momentum: f64) -> SgdConfig {
    SgdConfig {
        lr,
        momentum,
        ..SgdConfig::default()
    }
}

/// Builds the inner Sgd over the masters.
fn sgd(lr: f64, momentum: f64) -> Build {
    Box::new(move |m| Ok(Box::new(Sgd::new(m, sgd_cfg(lr, momentum))?) as Box<dyn Optimizer>))
}

fn dynamic(init_scale: f64, growth_interval: u64) -> LossScaling {
    LossScaling::Dynamic(GradScalerConfig {
        init_scale,
        growth_interval,
        ..GradScalerConfig::default()
    })
}

fn config(loss_scaling: LossScaling, rounding: Rounding) -> MasterConfig {
    MasterConfig {
        loss_scaling,
        rounding,
        ..MasterConfig::default()
    }
}

/// `n` values uniform in [lo, hi) rounded into `dtype` (as f32, exactly what a tensor holds).
fn rand_in(n: usize, lo: f64, hi: f64, dtype: DType, rng: &mut Generator) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi) as f32).collect();
    Tensor::from_f32_vec(v, &[n], dtype).unwrap().to_vec_f32()
}

fn leaf(values: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f32_vec(values.to_vec(), shape, dtype)
        .unwrap()
        .requires_grad_()
}

/// A model parameter of each given dtype and shape with random values, and an F32 twin.
fn params(specs: &[(DType, &[usize])], rng: &mut Generator) -> (Vec<Tensor>, Vec<Tensor>) {
    specs
        .iter()
        .map(|&(dtype, shape)| {
            let v = rand_in(shape.iter().product(), -1.0, 1.0, dtype, rng);
            (leaf(&v, shape, dtype), leaf(&v, shape, DType::F32))
        })
        .unzip()
}

fn values(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter().map(Tensor::to_vec_f32).collect()
}

/// Bit patterns, so that -0.0 vs 0.0 and NaN payloads count as differences.
fn bits(ts: &[Tensor]) -> Vec<Vec<u32>> {
    ts.iter()
        .map(|t| t.to_vec_f32().iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Nearest-even rounding of an F32 value into `dtype`, by `half`'s scalar conversion.
fn rne(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Sets `p`'s gradient to `g * scale`, stored in the parameter's dtype.
fn set_scaled_grad(p: &Tensor, g: &[f32], scale: f64) {
    let v: Vec<f32> = g.iter().map(|&x| x * scale as f32).collect();
    p.set_grad(Some(Tensor::from_f32_vec(v, p.shape(), p.dtype()).unwrap()));
}

#[track_caller]
fn err_msg<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn assert_contains(msg: &str, want: &str) {
    assert!(msg.contains(want), "error {msg:?} does not say {want:?}");
}

/// The two neighbours `(down, up)` of `|x|` in a binary format with `mant` explicit mantissa
/// bits whose smallest normal is 2^emin (subnormal spacing 2^(emin - mant)), in f64.
fn neighbours(x: f64, mant: i32, emin: i32) -> (f64, f64) {
    let a = x.abs();
    let e = if a < 2f64.powi(emin) {
        emin
    } else {
        ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023 // exact binade of a normal f64
    };
    let ulp = 2f64.powi(e - mant);
    let down = (a / ulp).floor() * ulp;
    (down, down + ulp)
}

fn format_of(dtype: DType) -> (i32, i32) {
    match dtype {
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
        _ => unreachable!(),
    }
}

/// Checks that `r` is one of the two neighbours of `x` (with x's sign).
#[track_caller]
fn assert_neighbour(what: &str, x: f32, r: f32, dtype: DType) {
    let (mant, emin) = format_of(dtype);
    let (down, up) = neighbours(f64::from(x), mant, emin);
    let a = f64::from(r.abs());
    let sign_ok = r == 0.0 || r.is_sign_negative() == x.is_sign_negative();
    assert!(
        (a == down || a == up) && sign_ok,
        "{what}: {r} is not a neighbour of {x} ({down}, {up})"
    );
}

// ----- rounding -----------------------------------------------------------------------------

#[test]
fn rounding_keeps_representable_values_exact() {
    let mut rng = Generator::new(1);
    // Every F16 and BF16 bit pattern, with random rounding bits.
    for h in 0..=u16::MAX {
        let (a, b) = (f16::from_bits(h), bf16::from_bits(h));
        let r = rng.next_u64();
        let (ra, rb) = (
            stochastic_round_f16(a.to_f32(), r),
            stochastic_round_bf16(b.to_f32(), r as u16),
        );
        if a.is_nan() {
            assert!(ra.is_nan(), "F16 NaN {h:#06x}");
        } else {
            assert_eq!(ra.to_bits(), h, "F16 {a}");
        }
        if b.is_nan() {
            assert!(rb.is_nan(), "BF16 NaN {h:#06x}");
        } else {
            assert_eq!(rb.to_bits(), h, "BF16 {b}");
        }
    }
    // Through the slice entry point, with every random word's bits used.
    for dtype in [DType::F16, DType::BF16] {
        let v = rand_in(1001, -3.0, 3.0, dtype, &mut rng);
        let t = round_f32_into(&v, &[7, 11, 13], dtype, Rounding::Stochastic, &mut rng).unwrap();
        assert_eq!((t.dtype(), t.shape()), (dtype, &[7usize, 11, 13][..]));
        assert_eq!(t.to_vec_f32(), v, "{dtype}");
    }
}

#[test]
fn rounding_beyond_the_range_and_special_values() {
    let mut rng = Generator::new(2);
    // Infinities, and finite values beyond the largest finite value: nothing finite lies
    // above them, so they round as nearest-even does (to the maximum or to inf).
    let beyond = |dtype: DType| -> Vec<f32> {
        let mut v = vec![f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX];
        if dtype == DType::F16 {
            v.extend([65505.0, 65519.0, -65520.0, 70000.0]);
        } else {
            v.extend([bf16::MAX.to_f32() * 1.002, -3.39e38]);
        }
        v
    };
    for dtype in [DType::F16, DType::BF16] {
        for x in beyond(dtype) {
            for _ in 0..8 {
                let t = round_f32_into(&[x], &[1], dtype, Rounding::Stochastic, &mut rng).unwrap();
                assert_eq!(
                    t.to_vec_f32()[0].to_bits(),
                    rne(x, dtype).to_bits(),
                    "{dtype} {x}"
                );
            }
        }
        let t = round_f32_into(
            &[f32::NAN, -f32::NAN],
            &[2],
            dtype,
            Rounding::Stochastic,
            &mut rng,
        )
        .unwrap();
        assert!(t.to_vec_f32().iter().all(|x| x.is_nan()));
    }
    // Nearest-even is the bulk conversion; F32 is a copy; bad shapes and integers fail.
    let v = rand_in(64, -1e5, 1e5, DType::F32, &mut rng);
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let t = round_f32_into(&v, &[8, 8], dtype, Rounding::NearestEven, &mut rng).unwrap();
        let want: Vec<f32> = v.iter().map(|&x| rne(x, dtype)).collect();
        assert_eq!(t.to_vec_f32(), want, "{dtype}");
    }
    let t = round_f32_into(&v, &[64], DType::F32, Rounding::Stochastic, &mut rng).unwrap();
    assert_eq!(t.to_vec_f32(), v);
    assert_contains(
        &err_msg(round_f32_into(
            &v,
            &[5],
            DType::F16,
            Rounding::Stochastic,
            &mut rng,
        )),
        "do not fill shape",
    );
    assert!(round_f32_into(&v, &[64], DType::I64, Rounding::Stochastic, &mut rng).is_err());
}

/// Values spread over the interesting ranges of `dtype`: normal binades of both signs,
/// F16's subnormals and the values below its smallest subnormal.
fn probe_values(dtype: DType, rng: &mut Generator) -> Vec<f32> {
    let mut v = Vec::new();
    for e in [-20, -14, -3, 0, 1, 7, 14] {
        for _ in 0..3 {
            let x = rng.uniform(1.0, 2.0) * 2f64.powi(e);
            let s = if rng.below(2) == 0 { 1.0 } else { -1.0 };
            v.push((s * x) as f32);
        }
    }
    if dtype == DType::F16 {
        v.extend([1e-8, -3e-8, 1e-7, 4.5e-6, -6.0e-5]); // below and inside the subnormals
    } else {
        v.extend([1e-39, -3e-39, 2e30]); // F32 subnormals are BF16 subnormals
    }
    v
}

#[test]
fn stochastic_rounding_gives_a_neighbour() {
    let mut rng = Generator::new(3);
    for dtype in [DType::F16, DType::BF16] {
        let mut v = probe_values(dtype, &mut rng);
        v.extend(rand_in(500, -4.0, 4.0, DType::F32, &mut rng));
        let mut differs = 0;
        for _ in 0..20 {
            let t = round_f32_into(&v, &[v.len()], dtype, Rounding::Stochastic, &mut rng).unwrap();
            for (&x, &r) in v.iter().zip(&t.to_vec_f32()) {
                assert_neighbour(&format!("{dtype}"), x, r, dtype);
                differs += usize::from(r != rne(x, dtype));
            }
        }
        // Not nearest-even in disguise: about a quarter of the roundings go the other way.
        assert!(
            differs > v.len() * 20 / 10,
            "{dtype}: only {differs} differ from RNE"
        );
    }
}

#[test]
fn stochastic_rounding_is_unbiased() {
    // For x between neighbours d < u with p = (x - d) / (u - d), each draw rounds up with
    // probability p, so the fraction of ups over N draws has standard deviation
    // sqrt(p (1 - p) / N) <= 0.5 / sqrt(N). Six of those bound it (a false failure about
    // once in 10^9 per value); a biased rule (nearest-even, truncation, an off-by-half
    // threshold) misses p by at least 0.1 for the p in [0.1, 0.9] used here.
    const N: usize = 4000;
    let mut rng = Generator::new(4);
    for dtype in [DType::F16, DType::BF16] {
        let (mant, emin) = format_of(dtype);
        for x0 in probe_values(dtype, &mut rng) {
            let (d, u) = neighbours(f64::from(x0), mant, emin);
            // Move x to a random fraction of its gap; p is exact for the F32 value.
            let target = d + rng.uniform(0.1, 0.9) * (u - d);
            let x = (target as f32).copysign(x0);
            let p = (f64::from(x.abs()) - d) / (u - d);
            if !(0.05..=0.95).contains(&p) {
                continue; // F32 could not place x inside the gap (huge exponents)
            }
            let t =
                round_f32_into(&vec![x; N], &[N], dtype, Rounding::Stochastic, &mut rng).unwrap();
            let ups = t
                .to_vec_f32()
                .iter()
                .filter(|r| f64::from(r.abs()) == u)
                .count();
            let frac = ups as f64 / N as f64;
            let bound = 6.0 * (p * (1.0 - p) / N as f64).sqrt();
            assert!(
                (frac - p).abs() <= bound,
                "{dtype} x = {x}: rounded up {frac}, expected {p} ± {bound}"
            );
            // The same statement about the mean: E[round(x)] = x.
            let mean = t.to_vec_f32().iter().map(|&r| f64::from(r)).sum::<f64>() / N as f64;
            assert!((mean - f64::from(x)).abs() <= bound * (u - d) + 1e-300);
        }
    }
}

// ----- Fp16Optimizer ------------------------------------------------------------------------

/// Half-precision true gradients would underflow to zero in F16 backward; dynamic loss
/// scaling brings them back (the reason loss scaling exists).
#[test]
fn loss_scaling_recovers_gradients_below_f16_range() {
    let mut rng = Generator::new(5);
    let wv = rand_in(12, -1.0, 1.0, DType::F16, &mut rng);
    let xv = rand_in(20, 0.5, 1.0, DType::F16, &mut rng);
    let w = leaf(&wv, &[4, 3], DType::F16);
    let x = Tensor::from_f32_vec(xv.clone(), &[5, 4], DType::F16).unwrap();
    // loss = 1e-8 * sum(x @ w): dloss/dw[k][j] = 1e-8 * sum_i x[i][k], about 4e-8, below
    // F16's smallest subnormal 6e-8 (and the 1e-8 factor itself rounds to 0 in F16).
    let loss_of = |w: &Tensor| {
        x.matmul(w)
            .unwrap()
            .sum_all()
            .unwrap()
            .mul_scalar(1e-8)
            .unwrap()
    };
    let want: Vec<f64> = (0..4)
        .flat_map(|k| {
            let col: f64 = (0..5).map(|i| f64::from(xv[i * 4 + k])).sum();
            std::iter::repeat_n(1e-8 * col, 3)
        })
        .collect();

    // Plain F16 backward: every gradient is zero.
    loss_of(&w).backward().unwrap();
    assert!(w.grad().unwrap().to_vec_f32().iter().all(|&g| g == 0.0));
    w.zero_grad();

    // Through Fp16Optimizer with dynamic scaling (lr 0: only the gradients matter).
    let mut opt =
        Fp16Optimizer::new(vec![w.clone()], MasterConfig::default(), sgd(0.0, 0.0)).unwrap();
    let mut skipped = Vec::new();
    for _ in 0..4 {
        opt.zero_grad();
        opt.scale_loss(&loss_of(&w)).unwrap().backward().unwrap();
        opt.step().unwrap();
        skipped.push(opt.last_step_skipped());
        if !opt.last_step_skipped() {
            break;
        }
    }
    // 2^16 itself overflows F16 on its way into the F16 graph; 2^15 works.
    assert_eq!(skipped, [true, false]);
    assert_eq!(opt.loss_scale(), 32768.0);
    assert_eq!(opt.skipped_steps(), 1);
    // Error: 1e-8 * scale rounded into F16, the F16 rounding of the matmul's gradient and
    // F32's own: below 2 u(F16) + small, so 3 u(F16) relative.
    let got = opt.masters()[0].grad().unwrap().to_vec_f64();
    let tol = 3.0 * DType::F16.unit_roundoff();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= tol * w.abs(), "master grad {g:e} vs {w:e}");
    }
}

/// Masters follow an ordinary F32 Sgd fed the true gradients bit for bit, and the half
/// parameters are their nearest-even image, while the scale grows underneath.
#[test]
fn step_equals_sgd_on_f32_copies() {
    let mut rng = Generator::new(6);
    let specs: [(DType, &[usize]); 3] = [
        (DType::F16, &[3, 5]),
        (DType::F16, &[7]),
        (DType::BF16, &[2, 3]),
    ];
    let (model, twins) = params(&specs, &mut rng);
    let mut opt = Fp16Optimizer::new(
        model.clone(),
        config(dynamic(1024.0, 2), Rounding::NearestEven),
        sgd(0.05, 0.9),
    )
    .unwrap();
    let mut reference = Sgd::new(twins.clone(), sgd_cfg(0.05, 0.9)).unwrap();
    let mut scales = Vec::new();
    for step in 0..8 {
        let scale = opt.loss_scale();
        scales.push(scale);
        opt.zero_grad();
        reference.zero_grad();
        for (i, ((p, t), &(dtype, _))) in model.iter().zip(&twins).zip(&specs).enumerate() {
            if step == 3 && i == 1 {
                continue; // no gradient: neither optimizer touches it
            }
            // True gradients representable in the parameter's dtype: times a power-of-two
            // scale they stay exact, so the master gradient is exactly g.
            let g = rand_in(p.numel(), -1.0, 1.0, dtype, &mut rng);
            set_scaled_grad(p, &g, scale);
            t.set_grad(Some(
                Tensor::from_f32_vec(g, t.shape(), DType::F32).unwrap(),
            ));
        }
        opt.step().unwrap();
        reference.step().unwrap();
        assert!(!opt.last_step_skipped());
        for (i, ((p, m), t)) in model.iter().zip(opt.masters()).zip(&twins).enumerate() {
            assert_eq!(
                bits(std::slice::from_ref(m)),
                bits(std::slice::from_ref(t)),
                "step {step} master {i}"
            );
            let want: Vec<f32> = m.to_vec_f32().iter().map(|&x| rne(x, p.dtype())).collect();
            assert_eq!(p.to_vec_f32(), want, "step {step} param {i}");
            if let Some(g) = t.grad() {
                assert_eq!(m.grad().unwrap().to_vec_f32(), g.to_vec_f32());
            }
        }
    }
    assert_eq!(
        scales,
        [1024.0, 1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0, 8192.0]
    );
    // The half parameters really are rounded images: the masters hold more bits.
    assert_ne!(values(&model), values(opt.masters()));
}

#[test]
fn overflow_step_is_skipped_with_everything_unchanged() {
    let mut rng = Generator::new(7);
    let specs: [(DType, &[usize]); 3] = [
        (DType::F16, &[4, 3]),
        (DType::F16, &[5]),
        (DType::BF16, &[6]),
    ];
    let (model, _) = params(&specs, &mut rng);
    let mut opt = Fp16Optimizer::new(
        model.clone(),
        config(dynamic(4096.0, 1000), Rounding::NearestEven),
        sgd(0.1, 0.9),
    )
    .unwrap();
    let fill = |opt: &Fp16Optimizer, rng: &mut Generator| {
        for (p, &(dtype, _)) in model.iter().zip(&specs) {
            let g = rand_in(p.numel(), -1.0, 1.0, dtype, rng);
            set_scaled_grad(p, &g, opt.loss_scale());
        }
    };
    for _ in 0..2 {
        fill(&opt, &mut rng);
        opt.step().unwrap();
    }
    for (k, (i, bad)) in [(0, f32::INFINITY), (2, f32::NAN), (1, f32::NEG_INFINITY)]
        .into_iter()
        .enumerate()
    {
        fill(&opt, &mut rng);
        let p = &model[i];
        let mut g = p.grad().unwrap().to_vec_f32();
        let last = g.len() - 1;
        g[last] = bad;
        p.set_grad(Some(Tensor::from_f32_vec(g, p.shape(), p.dtype()).unwrap()));
        let (pb, mb, sb) = (bits(&model), bits(opt.masters()), opt.inner().state_dict());
        let scale = opt.loss_scale();
        opt.step().unwrap();
        assert!(opt.last_step_skipped());
        assert_eq!(bits(&model), pb, "overflow {k}: parameters changed");
        assert_eq!(bits(opt.masters()), mb, "overflow {k}: masters changed");
        assert_eq!(
            opt.inner().state_dict(),
            sb,
            "overflow {k}: optimizer state changed"
        );
        assert_eq!(opt.loss_scale(), scale / 2.0);
        assert_eq!(opt.skipped_steps(), k as u64 + 1);
    }
    // And a clean step moves everything again.
    fill(&opt, &mut rng);
    let pb = bits(&model);
    opt.step().unwrap();
    assert!(!opt.last_step_skipped());
    assert!(bits(&model).iter().zip(&pb).all(|(a, b)| a != b));
}

/// Gradients of a fixed quadratic pull (p - target), plus a per-step wiggle; the `overflow`
/// steps get an inf in the first parameter.
fn quadratic_grads(opt: &Fp16Optimizer, model: &[Tensor], step: usize, overflow: &[usize]) {
    for (i, p) in model.iter().enumerate() {
        let g: Vec<f32> = (p.to_vec_f32().iter().enumerate())
            .map(|(j, &x)| x - 0.3 + 0.1 * ((step * 7 + j * 3 + i) as f32).sin())
            .collect();
        set_scaled_grad(p, &g, opt.loss_scale());
    }
    if overflow.contains(&step) {
        let p = &model[0];
        let mut g = p.grad().unwrap().to_vec_f32();
        g[1] = f32::INFINITY;
        p.set_grad(Some(Tensor::from_f32_vec(g, p.shape(), p.dtype()).unwrap()));
    }
}

const SPECS: [(DType, &[usize]); 3] = [
    (DType::F16, &[4, 3]),
    (DType::BF16, &[5]),
    (DType::F32, &[3]),
];

fn round_trip_config() -> MasterConfig {
    MasterConfig {
        loss_scaling: LossScaling::Dynamic(GradScalerConfig {
            init_scale: 4096.0,
            growth_interval: 3,
            hysteresis: 2,
            ..GradScalerConfig::default()
        }),
        rounding: Rounding::Stochastic,
        clip_grad_norm: Some(0.5),
        keep_masters: true,
        seed: 42,
    }
}

#[test]
fn state_round_trip_continues_bit_for_bit() {
    const STEPS: usize = 14;
    const SPLIT: usize = 6;
    let overflow = [2, 3, 9];
    let mut rng = Generator::new(8);
    let (model, _) = params(&SPECS, &mut rng);
    let start = values(&model);
    let fresh = |v: &[Vec<f32>]| -> Vec<Tensor> {
        (v.iter().zip(&SPECS))
            .map(|(v, &(dtype, shape))| leaf(v, shape, dtype))
            .collect()
    };

    // Uninterrupted.
    let mut opt = Fp16Optimizer::new(model.clone(), round_trip_config(), sgd(0.1, 0.9)).unwrap();
    for step in 0..STEPS {
        quadratic_grads(&opt, &model, step, &overflow);
        opt.step().unwrap();
    }

    // Interrupted: save after SPLIT steps, rebuild everything, load, continue.
    let m1 = fresh(&start);
    let mut opt1 = Fp16Optimizer::new(m1.clone(), round_trip_config(), sgd(0.1, 0.9)).unwrap();
    for step in 0..SPLIT {
        quadratic_grads(&opt1, &m1, step, &overflow);
        opt1.step().unwrap();
    }
    let saved = opt1.state_dict();
    let m2 = fresh(&values(&m1));
    let mut opt2 = Fp16Optimizer::new(m2.clone(), round_trip_config(), sgd(0.7, 0.0)).unwrap();
    opt2.load_state_dict(&saved).unwrap();
    assert_eq!(opt2.loss_scale(), opt1.loss_scale());
    assert_ne!(opt2.loss_scale(), 4096.0, "the scale moved before the save");
    assert_eq!(opt2.lr(), 0.1);
    assert_eq!(bits(opt2.masters()), bits(opt1.masters()));
    for step in SPLIT..STEPS {
        quadratic_grads(&opt2, &m2, step, &overflow);
        opt2.step().unwrap();
    }
    assert_eq!(bits(&m2), bits(&model));
    assert_eq!(bits(opt2.masters()), bits(opt.masters()));
    assert_eq!(opt2.state_dict(), opt.state_dict());
    assert_eq!(opt.skipped_steps(), 3);

    // What the state holds.
    let has_scalar = |n: &str| saved.scalar(n).is_some();
    for n in [
        "num_params",
        "rounding_step",
        "inner_optimizer.sgd",
        "inner.lr",
        "inner.momentum",
        "scaler.scale",
        "scaler.growth_tracker",
        "scaler.hysteresis_left",
    ] {
        assert!(has_scalar(n), "no scalar {n}");
    }
    assert_eq!(saved.optimizer, "fp16_master");
    assert_eq!(saved.scalar("rounding_step"), Some((SPLIT - 2) as f64));
    let mut names: Vec<&str> = saved.buffers.iter().map(|b| b.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "inner.0.momentum_buffer",
            "inner.1.momentum_buffer",
            "inner.2.momentum_buffer",
            "master.0",
            "master.1"
        ]
    );
}

#[test]
fn bad_states_are_rejected_and_change_nothing() {
    let mut rng = Generator::new(9);
    let (model, _) = params(&SPECS, &mut rng);
    let mut opt = Fp16Optimizer::new(model.clone(), round_trip_config(), sgd(0.1, 0.9)).unwrap();
    for step in 0..3 {
        quadratic_grads(&opt, &model, step, &[]);
        opt.step().unwrap();
    }
    let good = opt.state_dict();
    // A state of another run: different masters, scale and momentum, all valid.
    let (other_model, _) = params(&SPECS, &mut rng);
    let mut other =
        Fp16Optimizer::new(other_model.clone(), round_trip_config(), sgd(0.3, 0.5)).unwrap();
    for step in 0..5 {
        quadratic_grads(&other, &other_model, step, &[1]);
        other.step().unwrap();
    }
    let valid = other.state_dict();
    let edit = |f: &dyn Fn(&mut OptimizerState)| {
        let mut s = valid.clone();
        f(&mut s);
        s
    };
    let adam_state = {
        let (m, _) = params(&SPECS, &mut rng);
        let build: Build =
            Box::new(|m| Ok(Box::new(Adam::new(m, AdamConfig::default())?) as Box<dyn Optimizer>));
        Fp16Optimizer::new(m, round_trip_config(), build)
            .unwrap()
            .state_dict()
    };
    let cases: Vec<(OptimizerState, &str)> = vec![
        (adam_state, "inner optimizer"),
        (edit(&|s| s.optimizer = "sgd".into()), "fp16_master"),
        (
            edit(&|s| s.buffers.retain(|b| b.name != "master.1")),
            "no master for parameter 1",
        ),
        (
            edit(&|s| {
                s.buffers.iter_mut().for_each(|b| {
                    if b.name == "master.0" {
                        b.name = "master.2".into()
                    }
                })
            }),
            "does not use",
        ),
        (
            edit(&|s| {
                s.buffers.iter_mut().for_each(|b| {
                    if b.name == "master.0" {
                        b.shape = vec![3, 4]
                    }
                })
            }),
            "master 0 has shape",
        ),
        (
            edit(&|s| s.scalars.push(("extra".into(), 1.0))),
            "does not use",
        ),
        (
            edit(&|s| s.scalars.retain(|(n, _)| n != "scaler.steps")),
            "steps",
        ),
        (
            edit(&|s| s.scalars.retain(|(n, _)| n != "rounding_step")),
            "rounding_step",
        ),
        (
            edit(&|s| {
                s.scalars.iter_mut().for_each(|(n, v)| {
                    if n == "num_params" {
                        *v = 2.0
                    }
                })
            }),
            "parameters",
        ),
        // Everything else valid: the inner optimizer refuses last, and nothing has moved.
        (
            edit(&|s| {
                s.scalars.iter_mut().for_each(|(n, v)| {
                    if n == "inner.lr" {
                        *v = -1.0
                    }
                })
            }),
            "learning rate",
        ),
    ];
    for (state, want) in &cases {
        assert_contains(&err_msg(opt.load_state_dict(state)), want);
        assert_eq!(
            opt.state_dict(),
            good,
            "a failed load ({want}) changed the optimizer"
        );
    }
    opt.load_state_dict(&valid).unwrap();
    assert_eq!(opt.state_dict(), valid);
    assert_eq!(opt.loss_scale(), other.loss_scale());
}

/// BatchNorm's F32 weight and bias beside F16 weights: they are their own masters.
#[test]
fn f32_parameters_beside_half_ones() {
    let mut rng = Generator::new(10);
    let specs: [(DType, &[usize]); 3] = [
        (DType::F16, &[4, 3]),
        (DType::F32, &[3]),
        (DType::F32, &[3]),
    ];
    let (model, twins) = params(&specs, &mut rng);
    let mut opt = Fp16Optimizer::new(
        model.clone(),
        config(dynamic(512.0, 1000), Rounding::NearestEven),
        sgd(0.1, 0.9),
    )
    .unwrap();
    assert_eq!(opt.masters()[1].id(), model[1].id());
    assert_eq!(opt.masters()[2].id(), model[2].id());
    assert_ne!(opt.masters()[0].id(), model[0].id());
    let mut reference = Sgd::new(twins.clone(), sgd_cfg(0.1, 0.9)).unwrap();
    for step in 0..5 {
        let mut grads = Vec::new();
        for (p, &(dtype, _)) in model.iter().zip(&specs) {
            let g = rand_in(p.numel(), -1.0, 1.0, dtype.max_half(), &mut rng);
            set_scaled_grad(p, &g, opt.loss_scale());
            grads.push(g);
        }
        if step == 2 {
            // An overflow in BatchNorm's gradient skips the whole step.
            let mut g = model[1].grad().unwrap().to_vec_f32();
            g[0] = f32::NAN;
            model[1].set_grad(Some(Tensor::from_f32_vec(g, &[3], DType::F32).unwrap()));
            let before = bits(&model);
            opt.step().unwrap();
            assert!(opt.last_step_skipped());
            assert_eq!(bits(&model), before);
            continue;
        }
        for (t, g) in twins.iter().zip(&grads) {
            t.set_grad(Some(
                Tensor::from_f32_vec(g.clone(), t.shape(), DType::F32).unwrap(),
            ));
        }
        opt.step().unwrap();
        reference.step().unwrap();
        assert_eq!(bits(opt.masters()), bits(&twins), "step {step}");
        // The F32 parameters' own gradients were replaced by the unscaled ones.
        assert_eq!(model[1].grad().unwrap().to_vec_f32(), grads[1]);
    }
    assert_eq!(bits(&model[1..]), bits(&twins[1..]));
    let names: Vec<String> = opt
        .state_dict()
        .buffers
        .iter()
        .map(|b| b.name.clone())
        .collect();
    assert!(
        names.contains(&"master.0".to_string())
            && !names.iter().any(|n| n == "master.1" || n == "master.2")
    );
}

/// Gradient values for an F32 parameter are drawn at F16 precision too, so that times a
/// power-of-two scale they stay exact in every dtype of the test.
trait MaxHalf {
    fn max_half(self) -> DType;
}
impl MaxHalf for DType {
    fn max_half(self) -> DType {
        if self == DType::F32 {
            DType::F16
        } else {
            self
        }
    }
}

#[test]
fn stochastic_write_back_is_a_neighbour_of_the_master() {
    let mut rng = Generator::new(11);
    let specs: [(DType, &[usize]); 2] = [(DType::F16, &[300]), (DType::BF16, &[300])];
    let (model, _) = params(&specs, &mut rng);
    let mut opt = Fp16Optimizer::new(
        model.clone(),
        config(LossScaling::Static(256.0), Rounding::Stochastic),
        sgd(1.0, 0.0),
    )
    .unwrap();
    let mut differs = 0;
    for _ in 0..3 {
        for (p, &(dtype, _)) in model.iter().zip(&specs) {
            // Updates of about an ulp, so that the masters leave the half grid.
            let g = rand_in(p.numel(), -4e-3, 4e-3, dtype, &mut rng);
            set_scaled_grad(p, &g, 256.0);
        }
        opt.step().unwrap();
        for (p, m) in model.iter().zip(opt.masters()) {
            for (&r, &x) in p.to_vec_f32().iter().zip(&m.to_vec_f32()) {
                assert_neighbour("write-back", x, r, p.dtype());
                differs += usize::from(r != rne(x, p.dtype()));
            }
        }
    }
    assert!(
        differs > 100,
        "only {differs} write-backs differ from nearest-even"
    );
    // A parameter without a gradient is not updated, so it is not rounded again either.
    model[0].zero_grad();
    let before = bits(&model[..1]);
    opt.step().unwrap();
    assert_eq!(bits(&model[..1]), before);
    assert_eq!(opt.loss_scale(), 256.0);
}

/// Clipping acts on the unscaled F32 master gradients: the masters follow an Sgd whose
/// gradients were clipped the same way.
#[test]
fn clip_acts_on_unscaled_master_gradients() {
    let mut rng = Generator::new(14);
    let specs: [(DType, &[usize]); 2] = [(DType::F16, &[6, 5]), (DType::F32, &[4])];
    let (model, twins) = params(&specs, &mut rng);
    let cfg = MasterConfig {
        clip_grad_norm: Some(0.25),
        ..config(dynamic(1024.0, 1000), Rounding::NearestEven)
    };
    let mut opt = Fp16Optimizer::new(model.clone(), cfg, sgd(0.5, 0.9)).unwrap();
    let mut reference = Sgd::new(twins.clone(), sgd_cfg(0.5, 0.9)).unwrap();
    for step in 0..3 {
        for (p, t) in model.iter().zip(&twins) {
            let g = rand_in(p.numel(), -1.0, 1.0, DType::F16, &mut rng);
            set_scaled_grad(p, &g, opt.loss_scale());
            t.set_grad(Some(
                Tensor::from_f32_vec(g, t.shape(), DType::F32).unwrap(),
            ));
        }
        let norm = clip_grad_norm(&twins, 0.25, 2.0).unwrap();
        assert!(norm > 1.0, "the clip must bite");
        opt.step().unwrap();
        reference.step().unwrap();
        assert_eq!(bits(opt.masters()), bits(&twins), "step {step}");
    }
}

/// pure-bf16: without persistent masters an update below half an ulp is lost under
/// nearest-even every step; stochastic rounding keeps it on average; persistent masters
/// keep it exactly.
#[test]
fn pure_bf16_updates_survive_only_with_stochastic_rounding_or_masters() {
    const N: usize = 512;
    const STEPS: usize = 64;
    let run = |keep_masters: bool, rounding: Rounding| -> (Vec<f32>, Vec<f32>) {
        let p = leaf(&[1.0; N], &[N], DType::BF16);
        let cfg = MasterConfig {
            loss_scaling: LossScaling::None,
            rounding,
            keep_masters,
            ..MasterConfig::default()
        };
        let mut opt = Fp16Optimizer::new(vec![p.clone()], cfg, sgd(1.0, 0.0)).unwrap();
        for _ in 0..STEPS {
            // An update of 2^-12, below half BF16's ulp (2^-8 just under 1).
            set_scaled_grad(&p, &[2f32.powi(-12); N], 1.0);
            opt.step().unwrap();
        }
        (p.to_vec_f32(), opt.masters()[0].to_vec_f32())
    };
    let exact = 1.0 - STEPS as f64 * 2f64.powi(-12); // 0.984375, representable in BF16

    let (p, _) = run(false, Rounding::NearestEven);
    assert!(p.iter().all(|&x| x == 1.0), "nearest-even stagnates");

    // Each step's rounding error has mean 0 given the past and |error| < 2^-8, so each
    // element's total error has variance < STEPS * 2^-16 / 4 and the mean over N elements
    // standard deviation < sqrt(STEPS / 4 / N) * 2^-8; six of those bound it.
    let (p, _) = run(false, Rounding::Stochastic);
    let mean = p.iter().map(|&x| f64::from(x)).sum::<f64>() / N as f64;
    let bound = 6.0 * (STEPS as f64 / 4.0 / N as f64).sqrt() * 2f64.powi(-8);
    assert!(
        (mean - exact).abs() <= bound,
        "mean {mean} vs {exact} ± {bound}"
    );

    let (p, m) = run(true, Rounding::NearestEven);
    assert!(m.iter().all(|&x| f64::from(x) == exact));
    assert!(p.iter().all(|&x| f64::from(x) == exact));
}

#[test]
fn without_kept_masters_the_copies_are_refreshed_from_the_params() {
    let mut rng = Generator::new(12);
    let lr = 0.5f32;
    let run = |keep_masters: bool, rng: &mut Generator| {
        let v = rand_in(6, -1.0, 1.0, DType::F16, rng);
        let p = leaf(&v, &[6], DType::F16);
        let cfg = MasterConfig {
            loss_scaling: LossScaling::Static(64.0),
            keep_masters,
            ..MasterConfig::default()
        };
        let mut opt = Fp16Optimizer::new(vec![p.clone()], cfg, sgd(f64::from(lr), 0.0)).unwrap();
        let g1 = rand_in(6, -1e-3, 1e-3, DType::F16, rng);
        set_scaled_grad(&p, &g1, 64.0);
        opt.step().unwrap();
        let m1 = opt.masters()[0].to_vec_f32();
        // Someone else changes the weights (a model load, a manual edit).
        let x = rand_in(6, -1.0, 1.0, DType::F16, rng);
        p.set_data(&Tensor::from_f32_vec(x.clone(), &[6], DType::F16).unwrap())
            .unwrap();
        let g2 = rand_in(6, -1.0, 1.0, DType::F16, rng);
        set_scaled_grad(&p, &g2, 64.0);
        opt.step().unwrap();
        let after = opt.masters()[0].to_vec_f32();
        let from = |base: &[f32]| -> Vec<f32> {
            base.iter().zip(&g2).map(|(&b, &g)| b + -lr * g).collect()
        };
        let names: Vec<String> = opt
            .state_dict()
            .buffers
            .iter()
            .map(|b| b.name.clone())
            .collect();
        (after, from(&x), from(&m1), names)
    };
    let (after, from_params, from_masters, names) = run(false, &mut rng);
    assert_eq!(after, from_params);
    assert_ne!(after, from_masters);
    assert!(!names.iter().any(|n| n.starts_with("master.")), "{names:?}");
    let (after, from_params, from_masters, names) = run(true, &mut rng);
    assert_eq!(after, from_masters);
    assert_ne!(after, from_params);
    assert!(names.contains(&"master.0".to_string()));
}

#[test]
fn optimizer_plumbing_and_construction_errors() {
    let mut rng = Generator::new(13);
    let (model, _) = params(&[(DType::F16, &[2, 2]), (DType::F32, &[2])], &mut rng);
    let mut opt =
        Fp16Optimizer::new(model.clone(), MasterConfig::default(), sgd(0.1, 0.9)).unwrap();
    assert_eq!(
        opt.params().iter().map(Tensor::id).collect::<Vec<_>>(),
        model.iter().map(Tensor::id).collect::<Vec<_>>()
    );
    opt.set_lr(0.25);
    assert_eq!((opt.lr(), opt.inner().lr()), (0.25, 0.25));
    for p in &model {
        set_scaled_grad(p, &[0.5; 4][..p.numel()], 1024.0);
    }
    opt.step().unwrap();
    assert!(opt.masters().iter().all(|m| m.grad().is_some()));
    opt.zero_grad();
    assert!(model
        .iter()
        .chain(opt.masters())
        .all(|t| t.grad().is_none()));
    // A step with no gradients at all changes nothing but counts as clean.
    let before = bits(&model);
    opt.step().unwrap();
    assert_eq!(bits(&model), before);
    // A gradient of the wrong shape fails before anything changes.
    model[0].set_grad(Some(Tensor::zeros(&[4], DType::F16).unwrap()));
    assert_contains(&err_msg(opt.step()), "shape");
    assert_eq!(bits(&model), before);

    let f16 = |n: usize| leaf(&vec![0.5; n], &[n], DType::F16);
    let a = f16(3);
    let cases: Vec<(Vec<Tensor>, MasterConfig, Build, &str)> = vec![
        (
            vec![leaf(&[1.0], &[1], DType::F64)],
            MasterConfig::default(),
            sgd(0.1, 0.0),
            "F32, F16 or BF16",
        ),
        (
            vec![a.clone(), a.clone()],
            MasterConfig::default(),
            sgd(0.1, 0.0),
            "more than once",
        ),
        (
            vec![a.mul_scalar(2.0).unwrap()],
            MasterConfig::default(),
            sgd(0.1, 0.0),
            "not a leaf",
        ),
        (
            vec![f16(2)],
            MasterConfig {
                clip_grad_norm: Some(-1.0),
                ..MasterConfig::default()
            },
            sgd(0.1, 0.0),
            "clip_grad_norm",
        ),
        (
            vec![f16(2)],
            config(dynamic(0.0, 10), Rounding::NearestEven),
            sgd(0.1, 0.0),
            "finite and > 0",
        ),
        (
            vec![f16(2)],
            config(LossScaling::Static(f64::NAN), Rounding::NearestEven),
            sgd(0.1, 0.0),
            "finite and > 0",
        ),
        (
            vec![f16(2)],
            MasterConfig::default(),
            Box::new(|_| {
                Ok(Box::new(Sgd::new(
                    vec![Tensor::zeros(&[2], DType::F32).unwrap()],
                    SgdConfig::default(),
                )?) as Box<dyn Optimizer>)
            }),
            "exactly the master tensors",
        ),
        (
            vec![f16(2)],
            MasterConfig::default(),
            sgd(-1.0, 0.0),
            "learning rate",
        ),
    ];
    for (params, cfg, build, want) in cases {
        assert_contains(&err_msg(Fp16Optimizer::new(params, cfg, build)), want);
    }
}
