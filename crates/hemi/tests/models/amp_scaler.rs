//! GradScaler and LossScale against plain references of the published rules: PyTorch's
//! `_amp_update_scale_` (torch/amp/grad_scaler.py and aten's AmpGradScalerKernels) and
//! DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py) for
//! hysteresis and the minimum scale. The scaler is driven through a real `Sgd` with real
//! backward passes; overflows are injected by poisoning one gradient element with inf or
//! NaN after backward.

use hemi::amp::scaler::{GradScaler, GradScalerConfig, LossScale, ScalerState};
use hemi::optim::{clip_grad_norm, Optimizer, Sgd, SgdConfig};
use hemi::{DType, Generator, Result, Tensor};

// ----- references ---------------------------------------------------------------------------

/// PyTorch's `_amp_update_scale_cpu_kernel`, line for line: the scale is a float, the
/// factors doubles, each product is taken in double and stored into the float.
struct TorchRule {
    scale: f32,
    growth_tracker: u64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
}

impl TorchRule {
    fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale = (f64::from(self.scale) * self.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.growth_interval {
                let grown = (f64::from(self.scale) * self.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
    }
}

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

// ----- harness ------------------------------------------------------------------------------

/// Parameters `p_i` with the loss `sum_i sum(p_i * x_i)`: the gradient of `p_i` is `x_i`.
struct Model {
    params: Vec<Tensor>,
    xs: Vec<Tensor>,
    xv: Vec<Vec<f32>>,
}

const SHAPES: [&[usize]; 2] = [&[3, 5], &[7]];

fn rand_f32(n: usize, rng: &mut Generator) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
}

impl Model {
    fn from_values(
        values: &[Vec<f32>],
        xv: &[Vec<f32>],
        shapes: &[&[usize]],
        dtype: DType,
    ) -> Model {
        let params = (values.iter().zip(shapes))
            .map(|(v, s)| {
                Tensor::from_f32_vec(v.clone(), s, dtype)
                    .unwrap()
                    .requires_grad_()
            })
            .collect();
        let xs = (xv.iter().zip(shapes))
            .map(|(v, s)| Tensor::from_f32_vec(v.clone(), s, dtype).unwrap())
            .collect();
        Model {
            params,
            xs,
            xv: xv.to_vec(),
        }
    }

    fn random(shapes: &[&[usize]], dtype: DType, rng: &mut Generator) -> Model {
        let n = |s: &&[usize]| s.iter().product::<usize>();
        let values: Vec<Vec<f32>> = shapes.iter().map(|s| rand_f32(n(s), rng)).collect();
        let xv: Vec<Vec<f32>> = shapes.iter().map(|s| rand_f32(n(s), rng)).collect();
        Model::from_values(&values, &xv, shapes, dtype)
    }

    fn loss_with(&self, xs: &[Tensor]) -> Tensor {
        let mut total: Option<Tensor> = None;
        for (p, x) in self.params.iter().zip(xs) {
            let l = p.mul(x).unwrap().sum_all().unwrap();
            total = Some(match total {
                None => l,
                Some(t) => t.add(&l).unwrap(),
            });
        }
        total.unwrap()
    }

    fn loss(&self) -> Tensor {
        self.loss_with(&self.xs)
    }

    fn values(&self) -> Vec<Vec<f32>> {
        self.params.iter().map(Tensor::to_vec_f32).collect()
    }
}

fn sgd(params: &[Tensor], lr: f64, momentum: f64) -> Sgd {
    let cfg = SgdConfig {
        lr,
        momentum,
        ..SgdConfig::default()
    };
    Sgd::new(params.to_vec(), cfg).unwrap()
}

/// Parameter values and momentum buffers of an Sgd.
fn snapshot(opt: &Sgd) -> (Vec<Vec<f32>>, Vec<Option<Vec<f32>>>) {
    let params = opt.params().iter().map(Tensor::to_vec_f32).collect();
    let bufs = (0..opt.params().len())
        .map(|i| opt.momentum_buffer(i).map(|t| t.to_vec_f32()))
        .collect();
    (params, bufs)
}

/// Replaces element `j` of `p`'s gradient by `bad`.
fn poison(p: &Tensor, j: usize, bad: f32) {
    let g = p.grad().expect("poison: no gradient");
    let dtype = g.dtype();
    let mut v = g.to_vec_f32();
    v[j] = bad;
    p.set_grad(Some(Tensor::from_f32_vec(v, p.shape(), dtype).unwrap()));
}

fn scaled(v: &[f32], s: f64) -> Vec<f32> {
    v.iter().map(|&x| x * s as f32).collect()
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

fn cfg(init_scale: f64, growth_interval: u64) -> GradScalerConfig {
    GradScalerConfig {
        init_scale,
        growth_interval,
        ..GradScalerConfig::default()
    }
}

/// A step's injected event: `None` = clean, `Some(x)` = one gradient element set to x.
fn random_event(rng: &mut Generator) -> Option<f32> {
    // 22% overflows: with growth_interval 3 the scale then random-walks (growth about 0.9
    // times per overflow), so it both grows and backs off many times in a few hundred steps.
    match rng.below(100) {
        0..=11 => Some(f32::INFINITY),
        12..=16 => Some(f32::NEG_INFINITY),
        17..=21 => Some(f32::NAN),
        _ => None,
    }
}

// ----- the scale trajectory -----------------------------------------------------------------

/// PyTorch's SGD with momentum (no dampening) in F32 with its CPU kernels' rounding
/// (`buf.mul_(momentum).add_(grad)`, then `param.add_(buf, alpha=-lr)` as one fused
/// multiply-add), so that a correctly fed optimizer matches it bit for bit.
struct SgdRef {
    params: Vec<Vec<f32>>,
    bufs: Vec<Option<Vec<f32>>>,
    lr: f32,
    momentum: f32,
}

impl SgdRef {
    fn step(&mut self, grads: &[Vec<f32>]) {
        for ((p, b), g) in self.params.iter_mut().zip(&mut self.bufs).zip(grads) {
            let first = b.is_none();
            let b = b.get_or_insert_with(|| vec![0.0; p.len()]);
            for ((p, b), &g) in p.iter_mut().zip(b.iter_mut()).zip(g) {
                *b = if first {
                    g
                } else {
                    self.momentum * *b + 1.0 * g
                };
                *p = b.mul_add(-self.lr, *p);
            }
        }
    }
}

#[test]
fn scale_trajectory_matches_pytorch_rule_through_sgd() {
    let mut rng = Generator::new(11);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut scaler = GradScaler::new(cfg(65536.0, 3)).unwrap();
    let mut opt = sgd(&m.params, 0.01, 0.9);
    let mut sgd_ref = SgdRef {
        params: m.values(),
        bufs: vec![None, None],
        lr: 0.01,
        momentum: 0.9,
    };
    let mut reference = TorchRule {
        scale: 65536.0f32,
        growth_tracker: 0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 3,
    };
    let (mut grew, mut backed_off, mut skipped) = (0, 0, 0u64);
    for step in 0..300 {
        opt.zero_grad();
        // Fresh inputs each step, so that every clean step moves every entry.
        let xv: Vec<Vec<f32>> = m.xv.iter().map(|x| rand_f32(x.len(), &mut rng)).collect();
        let xs: Vec<Tensor> = (xv.iter().zip(&SHAPES))
            .map(|(v, s)| Tensor::from_f32_vec(v.clone(), s, DType::F32).unwrap())
            .collect();
        let s = scaler.get_scale();
        scaler.scale(&m.loss_with(&xs)).unwrap().backward().unwrap();
        // The scale is a power of two, so the scaled gradients are exactly x * scale.
        for (p, x) in m.params.iter().zip(&xv) {
            assert_eq!(p.grad().unwrap().to_vec_f32(), scaled(x, s), "step {step}");
        }
        let event = random_event(&mut rng);
        if let Some(bad) = event {
            let i = rng.below(2) as usize;
            let j = rng.below(xv[i].len() as u64) as usize;
            poison(&m.params[i], j, bad);
        }
        let before = snapshot(&opt);
        let stepped = scaler.step(&mut opt).unwrap();
        assert_eq!(stepped, event.is_none(), "step {step}: stepped");
        let after = snapshot(&opt);
        if stepped {
            // The optimizer saw the true gradients: parameters and momentum buffers are
            // those of SGD fed the unscaled gradients, and they moved.
            for (p, x) in m.params.iter().zip(&xv) {
                assert_eq!(&p.grad().unwrap().to_vec_f32(), x, "step {step}");
            }
            sgd_ref.step(&xv);
            assert_eq!(after.0, sgd_ref.params, "step {step}: parameters");
            assert_eq!(after.1, sgd_ref.bufs, "step {step}: momentum buffers");
            assert_ne!(after.0, before.0, "step {step}");
            assert_ne!(after.1, before.1, "step {step}");
        } else {
            skipped += 1;
            assert_eq!(
                before, after,
                "step {step}: a skipped step changed the optimizer"
            );
        }
        scaler.update().unwrap();
        let old = reference.scale;
        reference.update(event.is_some());
        assert_eq!(
            scaler.get_scale(),
            f64::from(reference.scale),
            "step {step}: scale"
        );
        grew += usize::from(reference.scale > old);
        backed_off += usize::from(reference.scale < old);
    }
    assert!(
        grew >= 10 && backed_off >= 10,
        "grew {grew}, backed off {backed_off}"
    );
    assert_eq!(scaler.skipped_steps(), skipped);
    assert_eq!(scaler.loss_scale().steps(), 300);
}

/// The rule at the edge of F32 (the scale's type, as PyTorch's): growth that would overflow
/// to inf is refused (the tracker still resets), so the scale tops out at 2^127.
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

// ----- the PyTorch protocol ----------------------------------------------------------------

#[test]
fn several_optimizers_share_a_scaler() {
    let mut rng = Generator::new(13);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let mut opt_a = sgd(&m.params[..1], 0.1, 0.9);
    let mut opt_b = sgd(&m.params[1..], 0.1, 0.9);
    let mut scaler = GradScaler::new(cfg(1024.0, 2)).unwrap();

    // Only b's gradients overflow: a steps, b skips, and the scale backs off.
    scaler.scale(&m.loss()).unwrap().backward().unwrap();
    poison(&m.params[1], 2, f32::NAN);
    let (a0, b0) = (snapshot(&opt_a), snapshot(&opt_b));
    assert!(scaler.step(&mut opt_a).unwrap());
    assert!(!scaler.step(&mut opt_b).unwrap());
    assert_ne!(snapshot(&opt_a), a0);
    assert_eq!(snapshot(&opt_b), b0);
    scaler.update().unwrap();
    assert_eq!(scaler.get_scale(), 512.0);

    // Clean for both, twice: both step, then the scale grows.
    for _ in 0..2 {
        opt_a.zero_grad();
        opt_b.zero_grad();
        scaler.scale(&m.loss()).unwrap().backward().unwrap();
        let b0 = snapshot(&opt_b);
        assert!(scaler.step(&mut opt_a).unwrap());
        assert!(scaler.step(&mut opt_b).unwrap());
        assert_ne!(snapshot(&opt_b), b0);
        scaler.update().unwrap();
    }
    assert_eq!(scaler.get_scale(), 1024.0);

    // An overflow seen only by unscale_ (no step) still counts in update.
    opt_a.zero_grad();
    opt_b.zero_grad();
    scaler.scale(&m.loss()).unwrap().backward().unwrap();
    poison(&m.params[0], 0, f32::INFINITY);
    scaler.unscale_(&opt_a).unwrap();
    assert!(scaler.step(&mut opt_b).unwrap());
    scaler.update().unwrap();
    assert_eq!(scaler.get_scale(), 512.0);
    assert_eq!(scaler.skipped_steps(), 2);
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
fn gradient_accumulation_sums_micro_batches() {
    let mut rng = Generator::new(19);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let xb: Vec<Vec<f32>> = m.xv.iter().map(|x| rand_f32(x.len(), &mut rng)).collect();
    let xb_t: Vec<Tensor> = (xb.iter().zip(&SHAPES))
        .map(|(v, s)| Tensor::from_f32_vec(v.clone(), s, DType::F32).unwrap())
        .collect();
    let lr = 0.25f32;
    let mut opt = sgd(&m.params, f64::from(lr), 0.0);
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    scaler.scale(&m.loss()).unwrap().backward().unwrap();
    scaler
        .scale(&m.loss_with(&xb_t))
        .unwrap()
        .backward()
        .unwrap();
    let before = m.values();
    assert!(scaler.step(&mut opt).unwrap());
    scaler.update().unwrap();
    for (i, p) in m.params.iter().enumerate() {
        // (xa*s + xb*s) / s with a power-of-two s: exactly the F32 sum xa + xb.
        let want: Vec<f32> = m.xv[i].iter().zip(&xb[i]).map(|(a, b)| a + b).collect();
        assert_eq!(p.grad().unwrap().to_vec_f32(), want);
        let stepped: Vec<f32> = (before[i].iter().zip(&want))
            .map(|(&p, &g)| p + -lr * g)
            .collect();
        assert_eq!(p.to_vec_f32(), stepped);
    }
}

#[test]
fn f16_loss_is_scaled_in_f32() {
    // An F16 loss of 3 times a scale of 2^15 is 98304, beyond F16's 65504.
    let w = Tensor::from_f32_vec(vec![1.0, 2.0], &[2], DType::F32)
        .unwrap()
        .requires_grad_();
    let x = Tensor::from_f32_vec(vec![1.0, 1.0], &[2], DType::F16).unwrap();
    let loss = w
        .to_dtype(DType::F16)
        .unwrap()
        .mul(&x)
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(loss.dtype(), DType::F16);
    let mut scaler = GradScaler::new(cfg(32768.0, 10)).unwrap();
    let s = scaler.scale(&loss).unwrap();
    assert_eq!(s.dtype(), DType::F32);
    assert_eq!(s.to_scalar().unwrap(), 98304.0);
    s.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec_f32(), [32768.0, 32768.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.5, 0.0);
    assert!(scaler.step(&mut opt).unwrap());
    assert_eq!(w.to_vec_f32(), [0.5, 1.5]);
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
