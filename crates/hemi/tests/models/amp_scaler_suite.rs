// The GradScaler tests that drive real tensors, as functions of the device `DEVICE`, which
// the file that includes this one (`include!`) defines, with `SGD_FUSED` (whether the
// device's SGD update is one fused multiply-add, as the CPU's) and a macro
// `on_device!(test_name)` each test calls first (nothing on the CPU; `need_gpu!` on the
// GPU): `amp_scaler.rs` (the CPU) and `../gpu/models.rs` (the wgpu backend). Parameters,
// inputs and injected gradients live on `DEVICE`; the scaler's found-inf flag is the
// device's.

use hemi::amp::scaler::{GradScaler, GradScalerConfig};
use hemi::optim::{Optimizer, Sgd, SgdConfig};
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

// ----- harness ------------------------------------------------------------------------------

/// Parameters `p_i` with the loss `sum_i sum(p_i * x_i)`: the gradient of `p_i` is `x_i`.
struct Model {
    params: Vec<Tensor>,
    xs: Vec<Tensor>,
    xv: Vec<Vec<f32>>,
}

const SHAPES: [&[usize]; 2] = [&[3, 5], &[7]];

/// A tensor moved to `DEVICE`.
fn on(t: Result<Tensor>) -> Tensor {
    t.and_then(|t| t.to_device(DEVICE)).unwrap()
}

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
            .map(|(v, s)| on(Tensor::from_f32_vec(v.clone(), s, dtype)).requires_grad_())
            .collect();
        let xs = (xv.iter().zip(shapes))
            .map(|(v, s)| on(Tensor::from_f32_vec(v.clone(), s, dtype)))
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
    let g = Tensor::from_f32_vec(v, p.shape(), dtype).and_then(|g| g.to_device(p.device()));
    p.set_grad(Some(g.unwrap()));
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
/// multiply-add; `SGD_FUSED` false: the product rounded first, as the default composition
/// on other backends runs it), so that a correctly fed optimizer matches it bit for bit.
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
                *p = if SGD_FUSED {
                    b.mul_add(-self.lr, *p)
                } else {
                    *p + *b * -self.lr
                };
            }
        }
    }
}

#[test]
fn scale_trajectory_matches_pytorch_rule_through_sgd() {
    on_device!("scale_trajectory_matches_pytorch_rule_through_sgd");
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
            .map(|(v, s)| on(Tensor::from_f32_vec(v.clone(), s, DType::F32)))
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
// ----- the PyTorch protocol ----------------------------------------------------------------

#[test]
fn several_optimizers_share_a_scaler() {
    on_device!("several_optimizers_share_a_scaler");
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
fn gradient_accumulation_sums_micro_batches() {
    on_device!("gradient_accumulation_sums_micro_batches");
    let mut rng = Generator::new(19);
    let m = Model::random(&SHAPES, DType::F32, &mut rng);
    let xb: Vec<Vec<f32>> = m.xv.iter().map(|x| rand_f32(x.len(), &mut rng)).collect();
    let xb_t: Vec<Tensor> = (xb.iter().zip(&SHAPES))
        .map(|(v, s)| on(Tensor::from_f32_vec(v.clone(), s, DType::F32)))
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
    on_device!("f16_loss_is_scaled_in_f32");
    // An F16 loss of 3 times a scale of 2^15 is 98304, beyond F16's 65504.
    let w = on(Tensor::from_f32_vec(vec![1.0, 2.0], &[2], DType::F32)).requires_grad_();
    let x = on(Tensor::from_f32_vec(vec![1.0, 1.0], &[2], DType::F16));
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

