//! GradScaler and LossScale against plain references of the published rules: PyTorch's
//! `_amp_update_scale_` (torch/amp/grad_scaler.py and aten's AmpGradScalerKernels) and
//! DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py) for
//! hysteresis and the minimum scale. The scaler is driven through a real `Sgd` with real
//! backward passes; overflows are injected by poisoning one gradient element with inf or
//! NaN after backward.
//!
//! The tests that drive tensors through the scaler (the trajectory, several optimizers,
//! gradient accumulation, an F16 loss) are in `amp_scaler_suite.rs`, shared with the GPU
//! backend's suite (`../gpu/models.rs`); here they run on the CPU.

use hemi::amp::scaler::{LossScale, ScalerState};
use hemi::optim::clip_grad_norm;
use hemi::Device;

/// The device the shared tests run on.
const DEVICE: Device = Device::Cpu;

/// The CPU's SGD update is one fused multiply-add, as ATen's CPU kernel.
const SGD_FUSED: bool = true;

/// The CPU is always there.
macro_rules! on_device {
    ($name:expr) => {};
}

include!("amp_scaler_suite.rs");

// ----- DeepSpeed's rule -----------------------------------------------------------------------

/// DeepSpeed's `DynamicLossScaler.update_scale` (consecutive_hysteresis=False), line for line.
struct DeepSpeedRule {
    cur_scale: f64,
    cur_iter: i64,
    last_overflow_iter: i64,
    scale_factor: f64,
    scale_window: i64,
    min_scale: f64,
    delayed_shift: u32,
    cur_hysteresis: u32,
}

impl DeepSpeedRule {
    fn update(&mut self, overflow: bool) {
        if overflow {
            if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
                self.cur_scale = (self.cur_scale / self.scale_factor).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter;
        } else if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0 {
            self.cur_hysteresis = self.delayed_shift;
            self.cur_scale *= self.scale_factor;
        }
        self.cur_iter += 1;
    }
}

#[test]
fn growth_to_infinity_is_refused() {
    let mut rng = Generator::new(3);
    let init = 2f32.powi(124);
    let mut scale = LossScale::new(cfg(f64::from(init), 2)).unwrap();
    let mut reference = TorchRule {
        scale: init,
        growth_tracker: 0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2,
    };
    let mut refused = 0;
    for step in 0..400 {
        let found_inf = rng.below(100) < 15;
        let old = reference.scale;
        reference.update(found_inf);
        refused +=
            usize::from(!found_inf && old == 2f32.powi(127) && reference.growth_tracker == 0);
        scale.update(found_inf);
        assert_eq!(scale.scale(), f64::from(reference.scale), "step {step}");
        assert_eq!(
            scale.state().get("growth_tracker"),
            Some(reference.growth_tracker as f64),
            "step {step}"
        );
    }
    assert!(refused >= 3, "growth was refused only {refused} times");
    assert!(scale.scale() <= 2f64.powi(127));
}

#[test]
fn hysteresis_and_min_scale_follow_deepspeed() {
    // A readable case first: hysteresis 3, growth after 4 clean steps.
    let mut s = LossScale::new(GradScalerConfig {
        hysteresis: 3,
        ..cfg(1024.0, 4)
    })
    .unwrap();
    let left = |s: &LossScale| s.state().get("hysteresis_left").unwrap();
    // (found_inf, scale after, hysteresis_left after)
    let table = [
        (true, 1024.0, 2.0), // absorbed
        (true, 1024.0, 1.0), // absorbed
        (true, 512.0, 1.0),  // backs off
        (true, 256.0, 1.0),  // and again: the budget is spent
        (false, 256.0, 1.0),
        (false, 256.0, 1.0),
        (false, 256.0, 1.0),
        (false, 512.0, 3.0), // growth point: grows, budget restored
        (true, 512.0, 2.0),  // absorbed again
        (false, 512.0, 2.0), // a clean step does not restore it
        (true, 512.0, 1.0),
        (true, 256.0, 1.0),
    ];
    for (k, &(inf, scale, hyst)) in table.iter().enumerate() {
        s.update(inf);
        assert_eq!((s.scale(), left(&s)), (scale, hyst), "row {k}");
    }
    assert_eq!(s.skipped_steps(), 7);
    assert_eq!(s.steps(), 12);

    // Then a long random sequence against DeepSpeed's code, down to the minimum scale.
    let mut rng = Generator::new(5);
    let mut s = LossScale::new(GradScalerConfig {
        hysteresis: 3,
        min_scale: Some(1.0),
        ..cfg(64.0, 4)
    })
    .unwrap();
    let mut ds = DeepSpeedRule {
        cur_scale: 64.0,
        cur_iter: 0,
        last_overflow_iter: -1,
        scale_factor: 2.0,
        scale_window: 4,
        min_scale: 1.0,
        delayed_shift: 3,
        cur_hysteresis: 3,
    };
    let (mut at_min, mut absorbed) = (0, 0);
    for step in 0..2000 {
        // Overflow-heavy stretches push the scale down to its floor, clean ones lift it.
        let p = if (step / 250) % 2 == 0 { 55 } else { 15 };
        let inf = rng.below(100) < p;
        let old = ds.cur_scale;
        ds.update(inf);
        s.update(inf);
        assert_eq!(s.scale(), ds.cur_scale, "step {step}: scale");
        assert_eq!(
            left(&s),
            f64::from(ds.cur_hysteresis),
            "step {step}: hysteresis"
        );
        at_min += usize::from(inf && old == 1.0);
        absorbed += usize::from(inf && old == ds.cur_scale && old > 1.0);
    }
    assert!(
        at_min >= 10 && absorbed >= 10,
        "at_min {at_min}, absorbed {absorbed}"
    );
}

#[test]
fn min_scale_floor_keeps_stepping() {
    let mut rng = Generator::new(8);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut scaler = GradScaler::new(GradScalerConfig {
        min_scale: Some(4096.0),
        ..cfg(8192.0, 1000)
    })
    .unwrap();
    let mut opt = sgd(&m.params, 0.1, 0.0);
    for k in 0..6 {
        opt.zero_grad();
        scaler.scale(&m.loss()).unwrap().backward().unwrap();
        let overflow = k % 2 == 0;
        if overflow {
            poison(&m.params[0], 1, f32::INFINITY);
        }
        let before = m.values();
        // At the floor overflowing steps are still skipped, clean ones still step.
        assert_eq!(scaler.step(&mut opt).unwrap(), !overflow, "iteration {k}");
        assert_eq!(m.values() == before, overflow, "iteration {k}");
        scaler.update().unwrap();
        assert_eq!(scaler.get_scale(), 4096.0, "iteration {k}");
    }
    assert_eq!(scaler.skipped_steps(), 3);
}

#[test]
fn max_scale_caps_growth() {
    assert_eq!(
        GradScalerConfig::default().max_scale,
        None,
        "PyTorch's GradScaler has no cap (apex amp's 2^24 is opt-in)"
    );
    let cap = 3.0 * 2f64.powi(19); // not a power-of-two multiple of the scale
    let mut s = LossScale::new(GradScalerConfig {
        max_scale: Some(cap),
        ..cfg(2f64.powi(19), 2)
    })
    .unwrap();
    let mut seen = Vec::new();
    for _ in 0..8 {
        s.update(false);
        seen.push(s.scale());
    }
    let p = 2f64.powi(19);
    assert_eq!(seen, [p, 2.0 * p, 2.0 * p, cap, cap, cap, cap, cap]);
    s.update(true);
    assert_eq!(s.scale(), cap / 2.0);
}

#[test]
fn fixed_scale_never_changes() {
    let mut s = LossScale::fixed(128.0).unwrap();
    for k in 0..10 {
        s.update(k % 3 == 0);
        assert_eq!(s.scale(), 128.0);
    }
    assert_eq!((s.skipped_steps(), s.steps()), (4, 10));
    assert!(!s.is_dynamic());
    assert_eq!(s.state().get("dynamic"), Some(0.0));
    for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
        assert_contains(&err_msg(LossScale::fixed(bad)), "finite and > 0");
    }
}

#[test]
fn update_to_sets_the_scale() {
    let mut rng = Generator::new(9);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let mut opt = sgd(&m.params, 0.1, 0.0);
    // Without any inf check, as PyTorch's update(new_scale).
    scaler.update_to(1024.0).unwrap();
    assert_eq!(scaler.get_scale(), 1024.0);
    let loss = m.loss();
    let s = scaler.scale(&loss).unwrap();
    assert_eq!(
        s.to_scalar().unwrap(),
        (loss.to_scalar().unwrap() as f32 * 1024.0) as f64
    );
    s.backward().unwrap();
    assert!(scaler.step(&mut opt).unwrap());
    // Resets the per-optimizer state: another step in the same iteration is allowed.
    scaler.update_to(512.0).unwrap();
    assert!(scaler.step(&mut opt).unwrap());
    scaler.update().unwrap();
    assert_eq!(scaler.get_scale(), 512.0);
    // 2^128 and 1e-50 are finite and > 0 in f64 but not in F32, the scale's type.
    for bad in [0.0, -2.0, f64::NAN, f64::INFINITY, 2f64.powi(128), 1e-50] {
        assert_contains(&err_msg(scaler.update_to(bad)), "finite and > 0");
    }
    assert_eq!(scaler.get_scale(), 512.0);
    // The new scale is rounded to F32, as PyTorch's `fill_` of its F32 scale tensor.
    scaler.update_to(0.1).unwrap();
    assert_eq!(scaler.get_scale(), f64::from(0.1f32));
    // No ceiling by default; a configured one is enforced.
    scaler.update_to(2f64.powi(100)).unwrap();
    let mut capped = GradScaler::new(GradScalerConfig {
        max_scale: Some(2f64.powi(24)),
        ..GradScalerConfig::default()
    })
    .unwrap();
    assert_contains(
        &err_msg(capped.update_to(2f64.powi(25))),
        "outside [min_scale, max_scale]",
    );
    assert_eq!(capped.get_scale(), 65536.0);
}

/// Unscaling is PyTorch's `_amp_foreach_non_finite_check_and_unscale_`: F32 gradients times
/// `inv = f32(1 / f64(scale))`, F64 gradients times that same F32 `inv` widened, and inf/NaN
/// looked for in the scaled gradients read, not in the products.
#[test]
fn unscale_arithmetic_is_pytorchs() {
    let p = Tensor::from_f32_vec(vec![0.0; 3], &[3], DType::F32)
        .unwrap()
        .requires_grad_();
    let q = Tensor::from_f32_vec(vec![0.0; 2], &[2], DType::F32)
        .unwrap()
        .requires_grad_();
    let opt = sgd(&[p.clone(), q.clone()], 0.1, 0.0);
    // A scale whose reciprocal is not an F32: inv is rounded once, from the f64 reciprocal.
    let mut scaler = GradScaler::new(cfg(3.0, 2000)).unwrap();
    let inv = (1.0f64 / 3.0) as f32;
    assert_eq!(scaler.loss_scale().inv_scale(), inv);
    let g = vec![1.0f32, -7.5, 3.0e-30];
    p.set_grad(Some(
        Tensor::from_f32_vec(g.clone(), &[3], DType::F32).unwrap(),
    ));
    let g64 = vec![1.0f64 / 7.0, 5.0];
    q.set_grad(Some(
        Tensor::from_f64_vec(g64.clone(), &[2], DType::F64).unwrap(),
    ));
    scaler.unscale_(&opt).unwrap();
    let want: Vec<f32> = g.iter().map(|&x| x * inv).collect();
    assert_eq!(p.grad().unwrap().to_vec_f32(), want);
    let want64: Vec<f64> = g64.iter().map(|&x| x * f64::from(inv)).collect();
    assert_eq!(q.grad().unwrap().to_vec_f64(), want64);
    scaler.update().unwrap();

    // Below a scale of 1, inv > 1 can overflow a finite gradient: PyTorch checks the
    // gradients it reads, so this is not an overflow and the step is not skipped.
    let mut scaler = GradScaler::new(cfg(0.25, 2000)).unwrap();
    let mut opt = sgd(std::slice::from_ref(&p), 0.1, 0.0);
    p.set_grad(Some(
        Tensor::from_f32_vec(vec![f32::MAX / 2.0, 1.0, 0.0], &[3], DType::F32).unwrap(),
    ));
    scaler.unscale_(&opt).unwrap();
    assert_eq!(p.grad().unwrap().to_vec_f32()[..2], [f32::INFINITY, 4.0]);
    assert!(scaler.step(&mut opt).unwrap(), "no inf/NaN was read");
    scaler.update().unwrap();
    assert_eq!(scaler.skipped_steps(), 0);
}

// ----- checkpoints ---------------------------------------------------------------------------

/// Runs `events` through scaler and optimizer; returns the scale after each update.
fn drive(scaler: &mut GradScaler, opt: &mut Sgd, m: &Model, events: &[Option<f32>]) -> Vec<f64> {
    let mut scales = Vec::new();
    for (k, e) in events.iter().enumerate() {
        opt.zero_grad();
        scaler.scale(&m.loss()).unwrap().backward().unwrap();
        if let Some(bad) = e {
            poison(&m.params[k % 2], 0, *bad);
        }
        scaler.step(opt).unwrap();
        scaler.update().unwrap();
        scales.push(scaler.get_scale());
    }
    scales
}

#[test]
fn state_dict_round_trip_mid_run() {
    let mut rng = Generator::new(21);
    let events: Vec<Option<f32>> = (0..60).map(|_| random_event(&mut rng)).collect();
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let (values0, xv) = (m.values(), m.xv.clone());
    let config = GradScalerConfig {
        hysteresis: 2,
        min_scale: Some(1.0),
        max_scale: Some(2f64.powi(20)),
        ..cfg(2f64.powi(18), 3)
    };

    // Uninterrupted.
    let mut scaler = GradScaler::new(config.clone()).unwrap();
    let mut opt = sgd(&m.params, 0.01, 0.9);
    let full = drive(&mut scaler, &mut opt, &m, &events);
    let (full_end, full_state) = (snapshot(&opt), scaler.state_dict());

    // Interrupted after 30 steps, restored into fresh objects.
    let m1 = Model::from_values(&values0, &xv, &SHAPES, DType::F32);
    let mut scaler1 = GradScaler::new(config.clone()).unwrap();
    let mut opt1 = sgd(&m1.params, 0.01, 0.9);
    let mut first = drive(&mut scaler1, &mut opt1, &m1, &events[..30]);
    let (st, ost, vals) = (scaler1.state_dict(), opt1.state_dict(), m1.values());
    let mut names: Vec<&str> = st.scalars.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    let mut want = vec![
        "scale",
        "growth_tracker",
        "hysteresis_left",
        "skipped_steps",
        "steps",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "hysteresis",
        "min_scale",
        "max_scale",
        "enabled",
        "dynamic",
    ];
    want.sort_unstable();
    assert_eq!(names, want);
    assert_eq!(st.get("steps"), Some(30.0));

    let m2 = Model::from_values(&vals, &xv, &SHAPES, DType::F32);
    // A different configuration: the loaded state's values win.
    let mut scaler2 = GradScaler::new(GradScalerConfig {
        max_scale: None,
        ..cfg(1.0, 7)
    })
    .unwrap();
    let mut opt2 = sgd(&m2.params, 0.5, 0.0);
    scaler2.load_state_dict(&st).unwrap();
    opt2.load_state_dict(&ost).unwrap();
    assert_eq!(scaler2.get_scale(), first[29]);
    first.extend(drive(&mut scaler2, &mut opt2, &m2, &events[30..]));
    assert_eq!(first, full);
    assert_eq!(snapshot(&opt2), full_end);
    assert_eq!(scaler2.state_dict(), full_state);
}

#[test]
fn bad_states_are_rejected_and_change_nothing() {
    let mut scaler = GradScaler::new(cfg(256.0, 3)).unwrap();
    let good = scaler.state_dict();
    let with = |name: &str, v: Option<f64>| {
        let mut s = good.clone();
        s.scalars.retain(|(n, _)| n != name);
        if let Some(v) = v {
            s.scalars.push((name.to_string(), v));
        }
        s
    };
    let cases = [
        (with("growth_tracker", Some(3.0)), "below growth_interval"),
        (with("growth_tracker", Some(1.5)), "non-negative integer"),
        (with("hysteresis_left", Some(0.0)), "hysteresis_left"),
        (with("scale", Some(f64::INFINITY)), "finite and > 0"),
        (with("scale", Some(2f64.powi(128))), "finite and > 0"),
        (with("backoff_factor", Some(1.0)), "backoff_factor"),
        (with("steps", None), "no scalar \"steps\""),
        (with("enabled", Some(0.0)), "disabled"),
        (with("dynamic", Some(0.0)), "static"),
        (with("surprise", Some(1.0)), "does not use"),
        (with("min_scale", Some(512.0)), "min_scale"),
    ];
    scaler.update_to(64.0).unwrap();
    let before = scaler.state_dict();
    for (state, want) in &cases {
        assert_contains(&err_msg(scaler.load_state_dict(state)), want);
        assert_eq!(
            scaler.state_dict(),
            before,
            "a failed load changed the scaler"
        );
    }
    let empty = ScalerState { scalars: vec![] };
    assert!(scaler.load_state_dict(&empty).is_err());
    scaler.load_state_dict(&good).unwrap();
    assert_eq!(scaler.get_scale(), 256.0);
}

#[test]
fn clip_after_unscale_sees_true_gradients() {
    let mut rng = Generator::new(17);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut opt = sgd(&m.params, 1.0, 0.0);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    scaler.scale(&m.loss()).unwrap().backward().unwrap();
    scaler.unscale_(&opt).unwrap();
    let true_norm =
        m.xv.iter()
            .flatten()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
    let max_norm = 0.5;
    let norm = clip_grad_norm(opt.params(), max_norm, 2.0).unwrap();
    // The norm of the unscaled F32 gradients, summed in f64: only F32 rounding of x apart.
    assert!(
        (norm - true_norm).abs() <= 1e-12 * true_norm,
        "{norm} vs {true_norm}"
    );
    let before = m.values();
    assert!(scaler.step(&mut opt).unwrap());
    scaler.update().unwrap();
    // step did not unscale a second time: the update is the clipped true gradient.
    let coef = max_norm / (norm + 1e-6);
    let mut clipped_norm = 0.0;
    for ((b, a), x) in before.iter().zip(m.values()).zip(&m.xv) {
        for ((&b, &a), &x) in b.iter().zip(&a).zip(x) {
            let g = f64::from(x) * coef;
            clipped_norm += g * g;
            let want = f64::from(b) - g;
            assert!((f64::from(a) - want).abs() <= 1e-6, "{a} vs {want}");
        }
    }
    assert!((clipped_norm.sqrt() - max_norm).abs() < 1e-5);
}

#[test]
fn misuse_is_an_error_with_a_message() {
    let mut rng = Generator::new(23);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut opt = sgd(&m.params, 0.1, 0.0);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();

    assert_contains(
        &err_msg(scaler.update()),
        "no inf checks were recorded prior to update()",
    );
    scaler.scale(&m.loss()).unwrap().backward().unwrap();
    scaler.unscale_(&opt).unwrap();
    let unscaled = m.params[0].grad().unwrap().to_vec_f32();
    assert_contains(
        &err_msg(scaler.unscale_(&opt)),
        "unscale_() has already been called on this optimizer since the last update()",
    );
    // The failed call did not unscale again, and the iteration goes on.
    assert_eq!(m.params[0].grad().unwrap().to_vec_f32(), unscaled);
    assert!(scaler.step(&mut opt).unwrap());
    assert_contains(
        &err_msg(scaler.unscale_(&opt)),
        "unscale_() is being called after step()",
    );
    assert_contains(
        &err_msg(scaler.step(&mut opt)),
        "step() has already been called since the last update()",
    );
    scaler.update().unwrap();
    assert_contains(
        &err_msg(scaler.update()),
        "no inf checks were recorded prior to update()",
    );

    // Half-precision gradients: refused before anything is touched. (A scale of 2^10 keeps
    // the F16 backward finite, so the gradients compare equal.)
    scaler.update_to(1024.0).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let h = Model::random(&SHAPES, dtype, &mut rng);
        let mut hopt = sgd(&h.params, 0.1, 0.0);
        scaler.scale(&h.loss()).unwrap().backward().unwrap();
        let grads: Vec<Vec<f32>> = h
            .params
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f32())
            .collect();
        let before = h.values();
        let msg = err_msg(scaler.step(&mut hopt));
        assert_contains(&msg, "F32 master weights");
        assert_contains(&msg, "Fp16Optimizer");
        assert_contains(&msg, dtype.as_str());
        assert_contains(&err_msg(scaler.unscale_(&hopt)), "F32 master weights");
        let after: Vec<Vec<f32>> = h
            .params
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f32())
            .collect();
        assert_eq!(after, grads);
        assert_eq!(h.values(), before);
    }

    // Configuration values.
    let bad = [
        (cfg(0.0, 10), "the scale must be finite and > 0"),
        (cfg(-4.0, 10), "the scale must be finite and > 0"),
        (cfg(f64::NAN, 10), "the scale must be finite and > 0"),
        (cfg(f64::INFINITY, 10), "the scale must be finite and > 0"),
        // Finite in f64, inf in F32 (the scale's type).
        (cfg(1e39, 10), "the scale must be finite and > 0"),
        (cfg(1.0, 0), "growth_interval must be >= 1"),
        (
            GradScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            "growth_factor must be finite and > 1",
        ),
        (
            GradScalerConfig {
                backoff_factor: 1.0,
                ..Default::default()
            },
            "backoff_factor must be in (0, 1)",
        ),
        (
            GradScalerConfig {
                backoff_factor: 0.0,
                ..Default::default()
            },
            "backoff_factor must be in (0, 1)",
        ),
        (
            GradScalerConfig {
                hysteresis: 0,
                ..Default::default()
            },
            "hysteresis must be >= 1",
        ),
        (
            GradScalerConfig {
                min_scale: Some(1e6),
                ..Default::default()
            },
            "min_scale must be",
        ),
        (
            GradScalerConfig {
                min_scale: Some(0.0),
                ..Default::default()
            },
            "min_scale must be",
        ),
        (
            GradScalerConfig {
                max_scale: Some(1024.0),
                ..Default::default()
            },
            "max_scale must be >= the scale",
        ),
        (
            GradScalerConfig {
                max_scale: Some(f64::NAN),
                ..Default::default()
            },
            "max_scale must be >= the scale",
        ),
    ];
    for (c, want) in bad {
        assert_contains(&err_msg(GradScaler::new(c.clone())), want);
        assert_contains(&err_msg(LossScale::new(c)), want);
    }
}

#[test]
fn disabled_scaler_is_transparent() {
    let mut rng = Generator::new(29);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut opt = sgd(&m.params, 0.1, 0.0);
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: false,
        ..GradScalerConfig::default()
    })
    .unwrap();
    assert!(!scaler.is_enabled());
    assert_eq!(scaler.get_scale(), 1.0);
    scaler.update().unwrap(); // no inf checks needed
    let loss = m.loss();
    let s = scaler.scale(&loss).unwrap();
    assert_eq!(s.id(), loss.id());
    s.backward().unwrap();
    scaler.unscale_(&opt).unwrap();
    scaler.unscale_(&opt).unwrap();
    assert_eq!(m.params[0].grad().unwrap().to_vec_f32(), m.xv[0]);
    // An inf gradient is not checked: the optimizer steps into it.
    poison(&m.params[1], 0, f32::INFINITY);
    assert!(scaler.step(&mut opt).unwrap());
    assert!(scaler.step(&mut opt).unwrap());
    assert_eq!(m.params[1].to_vec_f32()[0], f32::NEG_INFINITY);
    scaler.update().unwrap();
    scaler.update_to(5.0).unwrap();
    assert_eq!(scaler.get_scale(), 1.0);
    assert_eq!(scaler.skipped_steps(), 0);
    assert_eq!(scaler.state_dict().get("enabled"), Some(0.0));
    // A disabled scaler's state does not load into an enabled one.
    let mut on = GradScaler::new(GradScalerConfig::default()).unwrap();
    assert_contains(
        &err_msg(on.load_state_dict(&scaler.state_dict())),
        "disabled",
    );
}
