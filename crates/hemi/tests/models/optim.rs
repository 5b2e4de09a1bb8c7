//! Optimizers, schedules and gradient clipping against the published formulas.
//!
//! The optimizers run several steps on small parameters of odd shapes with fixed random
//! gradients; the references in this file replay PyTorch's documented update rules in f64
//! (torch.optim.SGD / Adam / AdamW pseudo-code). Half-precision parameters are checked
//! against an F32 twin whose parameter is rounded to the half dtype after every step: with
//! F32 state and F32 maths the two must agree bit for bit.

use crate::common;
use common::*;
use hemi::optim::{
    clip_grad_norm, clip_grad_value, no_decay_mask, Adam, AdamConfig, AdamW, AdamWConfig,
    CosineAnnealingLR, LinearWarmup, LrScheduler, MultiStepLR, Optimizer, OptimizerState,
    Scheduler, Sgd, SgdConfig, StateBuffer, StepLR,
};
use hemi::{DType, Generator, Tensor};

// ----- harness ------------------------------------------------------------------------------

/// Odd sizes, a matrix, a vector and a single element.
const SHAPES: [&[usize]; 3] = [&[3, 5], &[7], &[1]];
const STEPS: usize = 6;

/// Gradients per step and parameter; `None` = the parameter has no gradient that step.
type StepGrads = Vec<Option<Vec<f64>>>;
type Grads = Vec<StepGrads>;
/// Parameter values after each step: `[step][param][element]`.
type Trajectory = Vec<Vec<Vec<f64>>>;

fn make_params(dtype: DType, rng: &mut Generator) -> (Vec<Tensor>, Vec<Vec<f64>>) {
    SHAPES
        .iter()
        .map(|shape| {
            let v = rand_values(shape.iter().product(), -1.0, 1.0, dtype, rng);
            let t = Tensor::from_f64_vec(v.clone(), shape, dtype)
                .unwrap()
                .requires_grad_();
            (t, v)
        })
        .unzip()
}

/// Random gradients (rounded to `dtype`); `skip(step, i)` leaves a parameter without one.
fn make_grads(
    dtype: DType,
    steps: usize,
    rng: &mut Generator,
    skip: impl Fn(usize, usize) -> bool,
) -> Grads {
    (0..steps)
        .map(|s| {
            SHAPES
                .iter()
                .enumerate()
                .map(|(i, shape)| {
                    let g = rand_values(shape.iter().product(), -1.0, 1.0, dtype, rng);
                    (!skip(s, i)).then_some(g)
                })
                .collect()
        })
        .collect()
}

fn set_grads(params: &[Tensor], grads: &[Option<Vec<f64>>], dtype: DType) {
    for (p, g) in params.iter().zip(grads) {
        p.set_grad(
            g.as_ref()
                .map(|g| Tensor::from_f64_vec(g.clone(), p.shape(), dtype).unwrap()),
        );
    }
}

fn values(params: &[Tensor]) -> Vec<Vec<f64>> {
    params.iter().map(Tensor::to_vec_f64).collect()
}

/// Runs `opt` over the gradients (given in the parameters' dtype) and records the
/// parameters after each step.
fn run_hemi(opt: &mut dyn Optimizer, grads: &[StepGrads]) -> Trajectory {
    let params = opt.params().to_vec();
    let dtype = params[0].dtype();
    grads
        .iter()
        .map(|gs| {
            set_grads(&params, gs, dtype);
            opt.step().unwrap();
            values(&params)
        })
        .collect()
}

/// One reference step of parameter `i`: updates `p` in place from `g`.
trait Reference {
    fn step(&mut self, i: usize, p: &mut [f64], g: &[f64]);
}

fn run_ref(init: &[Vec<f64>], grads: &[StepGrads], r: &mut dyn Reference) -> Trajectory {
    let mut p = init.to_vec();
    grads
        .iter()
        .map(|gs| {
            for (i, g) in gs.iter().enumerate() {
                if let Some(g) = g {
                    r.step(i, &mut p[i], g);
                }
            }
            p.clone()
        })
        .collect()
}

/// F32 trajectory tolerance: each step rounds the update's few F32 operations and the new
/// parameter (a handful of unit roundoffs of O(1) values), and the errors add up over the
/// steps; 32 roundoffs per step leaves room for the state's own roundings.
fn traj_tol(steps: usize) -> Tol {
    let e = 32.0 * steps as f64 * u(DType::F32);
    Tol { rtol: e, atol: e }
}

fn assert_trajectory(what: &str, got: &Trajectory, want: &Trajectory) {
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert_close(
                &format!("{what}: step {} param {i}", s + 1),
                g,
                w,
                traj_tol(s + 1),
            );
        }
    }
}

// ----- references: PyTorch's documented update rules in f64 -------------------------------

/// torch.optim.SGD:
/// g += wd·θ; b = g (first step) or μ·b + (1-τ)·g; g = g + μ·b (nesterov) or b; θ -= γ·g.
struct RefSgd {
    c: SgdConfig,
    bufs: Vec<Option<Vec<f64>>>,
}

impl RefSgd {
    fn new(c: SgdConfig) -> Self {
        RefSgd {
            c,
            bufs: vec![None; SHAPES.len()],
        }
    }
}

impl Reference for RefSgd {
    fn step(&mut self, i: usize, p: &mut [f64], g: &[f64]) {
        let c = self.c;
        let mut d: Vec<f64> = (0..p.len()).map(|k| g[k] + c.weight_decay * p[k]).collect();
        if c.momentum != 0.0 {
            let b = match self.bufs[i].take() {
                None => d.clone(),
                Some(b) => (0..p.len())
                    .map(|k| c.momentum * b[k] + (1.0 - c.dampening) * d[k])
                    .collect(),
            };
            if c.nesterov {
                d = (0..p.len()).map(|k| d[k] + c.momentum * b[k]).collect();
            } else {
                d = b.clone();
            }
            self.bufs[i] = Some(b);
        }
        for k in 0..p.len() {
            p[k] -= c.lr * d[k];
        }
    }
}

/// torch.optim.Adam / AdamW:
/// θ *= 1 - γλ (AdamW) or g += λθ (Adam); m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
/// m̂ = m / (1-β1^t); v_max = max(v_max, v) (amsgrad); v̂ = v (or v_max) / (1-β2^t);
/// θ -= γ·m̂ / (√v̂ + ε).
/// (t, m, v, v_max) of one parameter.
type AdamRefState = (i32, Vec<f64>, Vec<f64>, Vec<f64>);

struct RefAdam {
    c: AdamConfig,
    decoupled: bool,
    /// Per parameter, created on its first gradient.
    state: Vec<Option<AdamRefState>>,
}

impl RefAdam {
    fn new(c: AdamConfig, decoupled: bool) -> Self {
        RefAdam {
            c,
            decoupled,
            state: vec![None; SHAPES.len()],
        }
    }
}

impl Reference for RefAdam {
    fn step(&mut self, i: usize, p: &mut [f64], g: &[f64]) {
        let c = self.c;
        let (b1, b2) = c.betas;
        let n = p.len();
        let (t, m, v, vmax) =
            self.state[i].get_or_insert_with(|| (0, vec![0.0; n], vec![0.0; n], vec![0.0; n]));
        *t += 1;
        for k in 0..n {
            let mut gk = g[k];
            if self.decoupled {
                p[k] *= 1.0 - c.lr * c.weight_decay;
            } else {
                gk += c.weight_decay * p[k];
            }
            m[k] = b1 * m[k] + (1.0 - b1) * gk;
            v[k] = b2 * v[k] + (1.0 - b2) * gk * gk;
            vmax[k] = vmax[k].max(v[k]);
            let m_hat = m[k] / (1.0 - b1.powi(*t));
            let v_hat = if c.amsgrad { vmax[k] } else { v[k] } / (1.0 - b2.powi(*t));
            p[k] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
}

// ----- SGD ----------------------------------------------------------------------------------

/// SGD at lr 0.1 with (momentum, dampening, weight_decay, nesterov).
fn sgd(momentum: f64, dampening: f64, weight_decay: f64, nesterov: bool) -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum,
        dampening,
        weight_decay,
        nesterov,
    }
}

fn sgd_lr(lr: f64) -> SgdConfig {
    SgdConfig {
        lr,
        ..SgdConfig::default()
    }
}

fn sgd_configs() -> Vec<(&'static str, SgdConfig)> {
    vec![
        ("plain", sgd(0.0, 0.0, 0.0, false)),
        ("momentum", sgd(0.9, 0.0, 0.0, false)),
        ("momentum+dampening", sgd(0.8, 0.3, 0.0, false)),
        ("nesterov", sgd(0.9, 0.0, 0.0, true)),
        ("weight_decay", sgd(0.0, 0.0, 0.05, false)),
        ("all", sgd(0.7, 0.0, 0.02, true)),
    ]
}

#[test]
fn sgd_trajectories_match_formula() {
    for (name, cfg) in sgd_configs() {
        let mut rng = Generator::new(11);
        let (params, init) = make_params(DType::F32, &mut rng);
        let grads = make_grads(DType::F32, STEPS, &mut rng, |_, _| false);
        let mut opt = Sgd::new(params, cfg).unwrap();
        let got = run_hemi(&mut opt, &grads);
        let want = run_ref(&init, &grads, &mut RefSgd::new(cfg));
        assert_trajectory(&format!("sgd {name}"), &got, &want);
    }
}

#[test]
fn sgd_momentum_buffer_starts_as_the_gradient() {
    // PyTorch's first step sets the buffer to the gradient itself, undampened: with
    // dampening 0.5 the first update is lr·g, not lr·0.5·g.
    let cfg = SgdConfig {
        lr: 0.25,
        ..sgd(0.9, 0.5, 0.0, false)
    };
    let mut rng = Generator::new(12);
    let (params, init) = make_params(DType::F32, &mut rng);
    let grads = make_grads(DType::F32, 2, &mut rng, |_, _| false);
    let mut opt = Sgd::new(params.clone(), cfg).unwrap();
    assert!(opt.momentum_buffer(0).is_none(), "no buffer before a step");
    set_grads(&params, &grads[0], DType::F32);
    opt.step().unwrap();
    for (i, p) in params.iter().enumerate() {
        let g = grads[0][i].as_ref().unwrap();
        let buf: Vec<f64> = opt.momentum_buffer(i).unwrap().to_vec_f64();
        assert_eq!(
            &buf, g,
            "param {i}: buffer after the first step is the gradient"
        );
        let want: Vec<f64> = init[i].iter().zip(g).map(|(p, g)| p - 0.25 * g).collect();
        assert_close(
            &format!("param {i} step 1"),
            &p.to_vec_f64(),
            &want,
            traj_tol(1),
        );
    }
    // Second step: b = 0.9·g1 + 0.5·g2.
    set_grads(&params, &grads[1], DType::F32);
    opt.step().unwrap();
    let (g1, g2) = (grads[0][1].as_ref().unwrap(), grads[1][1].as_ref().unwrap());
    let want: Vec<f64> = g1.iter().zip(g2).map(|(a, b)| 0.9 * a + 0.5 * b).collect();
    let buf: Vec<f64> = opt.momentum_buffer(1).unwrap().to_vec_f64();
    assert_close("buffer step 2", &buf, &want, traj_tol(2));
}

#[test]
fn sgd_rejects_invalid_hyperparameters() {
    let p = || vec![Tensor::zeros(&[2], DType::F32).unwrap().requires_grad_()];
    type Edit = fn(&mut SgdConfig);
    let bad: [(&str, Edit); 6] = [
        ("nesterov without momentum", |c| c.nesterov = true),
        ("nesterov with dampening", |c| *c = sgd(0.9, 0.1, 0.0, true)),
        ("negative lr", |c| c.lr = -1.0),
        ("negative momentum", |c| c.momentum = -0.5),
        ("negative weight decay", |c| c.weight_decay = -1e-4),
        ("NaN lr", |c| c.lr = f64::NAN),
    ];
    for (what, edit) in bad {
        let mut cfg = SgdConfig::default();
        edit(&mut cfg);
        let err = Sgd::new(p(), cfg)
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"));
        if what.starts_with("nesterov") {
            assert!(err.to_string().contains("Nesterov"), "{what}: {err}");
        }
    }
    Sgd::new(p(), sgd(0.9, 0.0, 0.0, true)).unwrap();
}

// ----- Adam and AdamW -----------------------------------------------------------------------

#[test]
fn adam_defaults_are_pytorchs() {
    let a = AdamConfig::default();
    assert_eq!(
        (a.lr, a.betas, a.eps, a.weight_decay, a.amsgrad),
        (1e-3, (0.9, 0.999), 1e-8, 0.0, false)
    );
    let w = AdamWConfig::default();
    assert_eq!(
        (w.lr, w.betas, w.eps, w.weight_decay, w.amsgrad),
        (1e-3, (0.9, 0.999), 1e-8, 1e-2, false)
    );
    let s = SgdConfig::default();
    assert_eq!(
        (s.momentum, s.dampening, s.weight_decay, s.nesterov),
        (0.0, 0.0, 0.0, false)
    );
}

/// Adam(W) at lr 0.05 with (betas, eps, weight_decay, amsgrad).
fn adam(betas: (f64, f64), eps: f64, weight_decay: f64, amsgrad: bool) -> AdamConfig {
    AdamConfig {
        lr: 0.05,
        betas,
        eps,
        weight_decay,
        amsgrad,
    }
}
const BETAS: (f64, f64) = (0.9, 0.999);

fn adam_configs() -> Vec<(&'static str, AdamConfig)> {
    vec![
        ("default", adam(BETAS, 1e-8, 0.0, false)),
        ("weight_decay", adam(BETAS, 1e-8, 0.1, false)),
        // A fast-forgetting second moment, so that it falls below its running maximum.
        ("amsgrad", adam((0.8, 0.6), 1e-8, 0.03, true)),
        // A large eps and unusual betas make eps placement and bias correction visible.
        ("eps+betas", adam((0.5, 0.9), 0.1, 0.0, false)),
    ]
}

#[test]
fn adam_trajectories_match_formula() {
    for (name, cfg) in adam_configs() {
        let mut rng = Generator::new(21);
        let (params, init) = make_params(DType::F32, &mut rng);
        let grads = make_grads(DType::F32, STEPS, &mut rng, |_, _| false);
        let mut opt = Adam::new(params, cfg).unwrap();
        let got = run_hemi(&mut opt, &grads);
        let want = run_ref(&init, &grads, &mut RefAdam::new(cfg, false));
        assert_trajectory(&format!("adam {name}"), &got, &want);
    }
}

#[test]
fn adamw_trajectories_match_formula() {
    for (name, cfg) in adam_configs() {
        // AdamW's own default decay, and a larger one for the decoupled term to show.
        for wd in [1e-2, 0.2] {
            let cfg = AdamConfig {
                weight_decay: wd,
                ..cfg
            };
            let mut rng = Generator::new(22);
            let (params, init) = make_params(DType::F32, &mut rng);
            let grads = make_grads(DType::F32, STEPS, &mut rng, |_, _| false);
            let mut opt = AdamW::new(params, cfg.into()).unwrap();
            let got = run_hemi(&mut opt, &grads);
            let want = run_ref(&init, &grads, &mut RefAdam::new(cfg, true));
            assert_trajectory(&format!("adamw {name} wd {wd}"), &got, &want);
        }
    }
}

#[test]
fn adamw_decay_is_decoupled_from_adams_l2() {
    let mut rng = Generator::new(23);
    let (_, init) = make_params(DType::F32, &mut rng);
    let grads = make_grads(DType::F32, STEPS, &mut rng, |_, _| false);
    let params = || {
        SHAPES
            .iter()
            .zip(&init)
            .map(|(s, v)| {
                Tensor::from_f64_vec(v.clone(), s, DType::F32)
                    .unwrap()
                    .requires_grad_()
            })
            .collect::<Vec<_>>()
    };
    let run = |decoupled: bool, wd: f64| {
        let cfg = adam(BETAS, 1e-8, wd, false);
        if decoupled {
            run_hemi(&mut AdamW::new(params(), cfg.into()).unwrap(), &grads)
        } else {
            run_hemi(&mut Adam::new(params(), cfg).unwrap(), &grads)
        }
    };
    // Without decay they are the same optimizer, bit for bit.
    assert_eq!(run(false, 0.0), run(true, 0.0));
    // With decay they differ, and each matches its own rule (checked above); here the
    // difference itself: after one step AdamW's decay is exactly lr·wd·θ away from plain
    // Adam, while Adam's L2 term goes through the normalisation.
    let (adam, adamw, plain) = (run(false, 0.5), run(true, 0.5), run(false, 0.0));
    assert_ne!(adam, adamw);
    for i in 0..SHAPES.len() {
        let want: Vec<f64> = plain[0][i]
            .iter()
            .zip(&init[i])
            .map(|(p, p0)| p - 0.05 * 0.5 * p0)
            .collect();
        assert_close(
            &format!("adamw step 1 param {i}"),
            &adamw[0][i],
            &want,
            traj_tol(1),
        );
    }
}

#[test]
fn adam_rejects_invalid_hyperparameters() {
    let p = || vec![Tensor::zeros(&[2], DType::F32).unwrap().requires_grad_()];
    type Edit = fn(&mut AdamConfig);
    let bad: [(&str, Edit); 5] = [
        ("beta1 = 1", |c| c.betas.0 = 1.0),
        ("beta2 < 0", |c| c.betas.1 = -0.1),
        ("negative eps", |c| c.eps = -1e-8),
        ("negative lr", |c| c.lr = -1e-3),
        ("negative weight decay", |c| c.weight_decay = -1.0),
    ];
    for (what, edit) in bad {
        let mut cfg = AdamConfig::default();
        edit(&mut cfg);
        assert!(Adam::new(p(), cfg).is_err(), "adam {what}: accepted");
        assert!(
            AdamW::new(p(), cfg.into()).is_err(),
            "adamw {what}: accepted"
        );
    }
}

// ----- every optimizer ----------------------------------------------------------------------

/// One optimizer of each kind with settings that exercise its whole rule, each over its own
/// copy of `params`.
fn all_optimizers(params: &[Tensor]) -> Vec<(&'static str, Box<dyn Optimizer>)> {
    let (sgd, adam, adamw) = all_configs();
    vec![
        ("sgd", Box::new(Sgd::new(same_params(params), sgd).unwrap())),
        (
            "adam",
            Box::new(Adam::new(same_params(params), adam).unwrap()),
        ),
        (
            "adamw",
            Box::new(AdamW::new(same_params(params), adamw.into()).unwrap()),
        ),
    ]
}

fn all_configs() -> (SgdConfig, AdamConfig, AdamConfig) {
    (
        sgd(0.9, 0.0, 0.01, true),
        adam(BETAS, 1e-8, 0.01, true),
        adam(BETAS, 1e-8, 0.1, false),
    )
}

/// The reference for the optimizer `all_optimizers` names `name`.
fn all_references(name: &str) -> Box<dyn Reference> {
    let (sgd, adam, adamw) = all_configs();
    match name {
        "sgd" => Box::new(RefSgd::new(sgd)),
        "adam" => Box::new(RefAdam::new(adam, false)),
        _ => Box::new(RefAdam::new(adamw, true)),
    }
}

fn same_params(params: &[Tensor]) -> Vec<Tensor> {
    params
        .iter()
        .map(|p| {
            Tensor::from_f64_vec(p.to_vec_f64(), p.shape(), p.dtype())
                .unwrap()
                .requires_grad_()
        })
        .collect()
}

#[test]
fn none_grads_are_skipped() {
    // Parameter 1 has no gradient on steps 1-3; parameter 2 never has one.
    let skip = |s: usize, i: usize| i == 2 || (i == 1 && s < 3);
    let mut rng = Generator::new(31);
    let (params, init) = make_params(DType::F32, &mut rng);
    let grads = make_grads(DType::F32, STEPS, &mut rng, skip);
    for (name, mut opt) in all_optimizers(&params) {
        let got = run_hemi(opt.as_mut(), &grads);
        // The untouched parameter keeps its bits and gets no state.
        assert_eq!(got[STEPS - 1][2], init[2], "{name}: param 2 changed");
        let state = opt.state_dict();
        assert!(
            state.buffers.iter().all(|b| !b.name.starts_with("2.")),
            "{name}: state for a parameter that never had a gradient"
        );
        for (s, step) in got.iter().take(3).enumerate() {
            assert_eq!(
                step[1],
                init[1],
                "{name}: param 1 changed at step {}",
                s + 1
            );
        }
        // Adam counts steps per parameter: parameter 1 has taken 3, parameter 0 six.
        if name != "sgd" {
            assert_eq!(state.scalar("0.step"), Some(STEPS as f64), "{name}");
            assert_eq!(state.scalar("1.step"), Some(3.0), "{name}");
            assert_eq!(state.scalar("2.step"), None, "{name}");
        }
        // And the trajectory (with parameter 1's late start and its own bias correction)
        // follows the reference.
        let want = run_ref(&init, &grads, all_references(name).as_mut());
        assert_trajectory(name, &got, &want);
    }
}

/// Half-precision parameters: F32 state, F32 maths from the rounded parameter, one rounding
/// into the dtype per step. An F32 twin whose parameters are rounded to `dtype` after every
/// step must therefore match bit for bit, parameters and state alike.
fn half_params_keep_f32_state(dtype: DType) {
    let mut rng = Generator::new(41);
    let (params, _) = make_params(dtype, &mut rng);
    let grads = make_grads(dtype, STEPS, &mut rng, |s, i| i == 1 && s == 2);
    let twin_params: Vec<Tensor> = params
        .iter()
        .map(|p| {
            Tensor::from_f64_vec(p.to_vec_f64(), p.shape(), DType::F32)
                .unwrap()
                .requires_grad_()
        })
        .collect();
    let opts = all_optimizers(&params)
        .into_iter()
        .zip(all_optimizers(&twin_params));
    for ((name, mut opt), (_, mut twin)) in opts {
        let (ps, ts) = (opt.params().to_vec(), twin.params().to_vec());
        for (s, gs) in grads.iter().enumerate() {
            set_grads(&ps, gs, dtype);
            set_grads(&ts, gs, DType::F32);
            opt.step().unwrap();
            twin.step().unwrap();
            for (i, (p, t)) in ps.iter().zip(&ts).enumerate() {
                assert_eq!(p.dtype(), dtype, "{name}: the parameter keeps its dtype");
                let rounded = round_to(&t.to_vec_f64(), dtype);
                t.set_data(&Tensor::from_f64_vec(rounded.clone(), t.shape(), DType::F32).unwrap())
                    .unwrap();
                assert_eq!(
                    p.to_vec_f64(),
                    rounded,
                    "{name} {dtype}: step {} param {i}",
                    s + 1
                );
            }
        }
        let (state, twin_state) = (opt.state_dict(), twin.state_dict());
        assert_eq!(
            state, twin_state,
            "{name} {dtype}: state differs from the F32 twin"
        );
        // The state really is F32: its values are not all representable in the half dtype.
        if dtype != DType::F32 {
            let all: Vec<f64> = state
                .buffers
                .iter()
                .flat_map(|b| b.data.iter().map(|&x| f64::from(x)))
                .collect();
            assert_ne!(
                round_to(&all, dtype),
                all,
                "{name} {dtype}: state looks rounded to the dtype"
            );
        }
        // The updates were large enough to move every parameter (the test can fail).
        for (i, (p, t)) in ps.iter().zip(&twin_params).enumerate() {
            assert_ne!(
                p.to_vec_f64(),
                t.to_vec_f64(),
                "{name}: param {i} did not move"
            );
        }
    }
}
dtype_tests!(
    half_params_match_rounded_f32_twin,
    super::half_params_keep_f32_state
);

#[test]
fn state_dict_round_trip_continues_bit_exactly() {
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = Generator::new(51);
        let (params, _) = make_params(dtype, &mut rng);
        let grads = make_grads(dtype, STEPS, &mut rng, |s, i| i == 2 && s < 4);
        let (first, second) = grads.split_at(3);
        for ((name, mut whole), (_, mut resumed)) in all_optimizers(&params)
            .into_iter()
            .zip(all_optimizers(&params))
        {
            // Uninterrupted: six steps.
            let want = run_hemi(whole.as_mut(), &grads);
            // Interrupted after three: save, build a new optimizer over copies of the
            // parameters with default hyper-parameters (the state brings the saved ones),
            // load, go on.
            run_hemi(resumed.as_mut(), first);
            let saved = resumed.state_dict();
            let copies = same_params(resumed.params());
            let mut restored: Box<dyn Optimizer> = match name {
                "sgd" => Box::new(Sgd::new(copies, SgdConfig::default()).unwrap()),
                "adam" => Box::new(Adam::new(copies, AdamConfig::default()).unwrap()),
                _ => Box::new(AdamW::new(copies, AdamWConfig::default()).unwrap()),
            };
            restored.load_state_dict(&saved).unwrap();
            assert_eq!(restored.lr(), whole.lr(), "{name}: lr restored");
            assert_eq!(
                restored.state_dict(),
                saved,
                "{name}: state_dict after load"
            );
            let got = run_hemi(restored.as_mut(), second);
            assert_eq!(got, want[3..], "{name} {dtype}: resumed run differs");
            assert_eq!(
                restored.state_dict(),
                whole.state_dict(),
                "{name} {dtype}: final state"
            );
        }
    }
}

fn set_scalar(s: &mut OptimizerState, name: &str, value: f64) {
    s.scalars.iter_mut().find(|(n, _)| n == name).unwrap().1 = value;
}

#[test]
fn load_of_mismatched_state_is_an_error() {
    let mut rng = Generator::new(61);
    let (params, _) = make_params(DType::F32, &mut rng);
    let grads = make_grads(DType::F32, 2, &mut rng, |_, _| false);
    for (name, mut opt) in all_optimizers(&params) {
        run_hemi(opt.as_mut(), &grads);
        let good = opt.state_dict();
        type Edit = fn(&mut OptimizerState);
        let mut edits: Vec<(&str, Edit)> = vec![
            ("another optimizer's state", |s| {
                s.optimizer = "lbfgs".into()
            }),
            ("parameter count", |s| set_scalar(s, "num_params", 2.0)),
            ("buffer shape", |s| s.buffers[0].shape = vec![5, 3]),
            ("buffer length", |s| s.buffers[1].data.truncate(3)),
            ("missing lr", |s| s.scalars.retain(|(n, _)| n != "lr")),
            ("unknown scalar", |s| s.scalars.push(("bogus".into(), 1.0))),
            ("buffer of a parameter that does not exist", |s| {
                let extra = StateBuffer {
                    name: "9.exp_avg".into(),
                    ..s.buffers[0].clone()
                };
                s.buffers.push(extra)
            }),
        ];
        if name != "sgd" {
            // (SGD's buffers are optional: a parameter without one has not stepped yet.)
            edits.push(("missing buffer", |s| {
                s.buffers.truncate(s.buffers.len() - 1)
            }));
            edits.push(("buffers without a step count", |s| {
                s.scalars.retain(|(n, _)| n != "1.step")
            }));
        }
        if name == "adam" {
            edits.push(("amsgrad off with max_exp_avg_sq buffers", |s| {
                set_scalar(s, "amsgrad", 0.0)
            }));
        }
        let cases = edits.into_iter().map(|(what, edit)| {
            let mut s = good.clone();
            edit(&mut s);
            (what, s)
        });
        for (what, bad) in cases {
            assert!(opt.load_state_dict(&bad).is_err(), "{name}: {what}: loaded");
            assert_eq!(
                opt.state_dict(),
                good,
                "{name}: {what}: a failed load changed the state"
            );
        }
        // Into an optimizer over differently shaped parameters.
        let other = vec![
            Tensor::zeros(&[5, 3], DType::F32).unwrap().requires_grad_(),
            Tensor::zeros(&[7], DType::F32).unwrap().requires_grad_(),
            Tensor::zeros(&[1], DType::F32).unwrap().requires_grad_(),
        ];
        let mut o = all_optimizers(&other)
            .into_iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1;
        assert!(
            o.load_state_dict(&good).is_err(),
            "{name}: loaded into other shapes"
        );
        opt.load_state_dict(&good).unwrap();
    }
}

#[test]
fn invalid_parameters_are_rejected() {
    let leaf = Tensor::ones(&[2, 3], DType::F32).unwrap().requires_grad_();
    let computed = leaf.mul_scalar(2.0).unwrap();
    let f64_param = Tensor::ones(&[2], DType::F64).unwrap().requires_grad_();
    let view = leaf.transpose(0, 1).unwrap().detach();
    for (what, params) in [
        ("non-leaf", vec![computed]),
        ("F64", vec![f64_param]),
        ("view", vec![view]),
        ("duplicate", vec![leaf.clone(), leaf.clone()]),
    ] {
        assert!(
            Sgd::new(params.clone(), SgdConfig::default()).is_err(),
            "sgd: {what}"
        );
        assert!(
            Adam::new(params, AdamConfig::default()).is_err(),
            "adam: {what}"
        );
    }
}

#[test]
fn gradient_of_the_wrong_shape_is_an_error() {
    let q = Tensor::zeros(&[4], DType::F32).unwrap().requires_grad_();
    let p = Tensor::zeros(&[2, 3], DType::F32).unwrap().requires_grad_();
    for (name, mut opt) in all_optimizers(&[q, p]) {
        let (q, p) = (opt.params()[0].clone(), opt.params()[1].clone());
        q.set_grad(Some(Tensor::ones(&[4], DType::F32).unwrap()));
        p.set_grad(Some(Tensor::ones(&[3, 2], DType::F32).unwrap()));
        let err = opt.step().unwrap_err().to_string();
        assert!(err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");
        // Nothing was updated, not even the parameter before the bad one.
        assert_eq!(q.to_vec_f64(), vec![0.0; 4], "{name}");
        assert_eq!(p.to_vec_f64(), vec![0.0; 6], "{name}");
        assert!(opt.state_dict().buffers.is_empty(), "{name}");
    }
}

#[test]
fn step_is_not_recorded_by_autograd() {
    let p = Tensor::from_f64_vec(vec![1.0, -2.0, 3.0], &[3], DType::F32)
        .unwrap()
        .requires_grad_();
    let alias = p.clone();
    let mut opt = Sgd::new(vec![p.clone()], sgd_lr(0.5)).unwrap();
    // A real backward: loss = sum(p²), grad 2p.
    p.square().unwrap().sum_all().unwrap().backward().unwrap();
    opt.step().unwrap();
    assert!(p.is_leaf() && p.requires_grad(), "still a trainable leaf");
    assert_eq!(
        alias.to_vec_f64(),
        vec![0.0, 0.0, 0.0],
        "every handle sees p - 0.5·2p"
    );
    // The next backward differentiates from the new values only.
    opt.zero_grad();
    let q = Tensor::from_f64_vec(vec![4.0, 5.0, 6.0], &[3], DType::F32).unwrap();
    p.set_data(&q).unwrap();
    p.square().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(p.grad().unwrap().to_vec_f64(), vec![8.0, 10.0, 12.0]);
}

#[test]
fn zero_grad_clears_grads() {
    let mut rng = Generator::new(71);
    let (params, _) = make_params(DType::F32, &mut rng);
    for (name, opt) in all_optimizers(&params) {
        for p in opt.params() {
            p.set_grad(Some(Tensor::ones(p.shape(), DType::F32).unwrap()));
        }
        opt.zero_grad();
        assert!(opt.params().iter().all(|p| p.grad().is_none()), "{name}");
    }
}

// ----- learning-rate schedules --------------------------------------------------------------

/// PyTorch's recursive (chainable) forms, an independent derivation of the closed forms.
fn step_lr_recursive(base: f64, step_size: u64, gamma: f64, steps: u64) -> Vec<f64> {
    let mut lr = base;
    (0..=steps)
        .map(|t| {
            if t != 0 && t % step_size == 0 {
                lr *= gamma;
            }
            lr
        })
        .collect()
}

fn cosine_recursive(base: f64, t_max: u64, eta_min: f64, steps: u64) -> Vec<f64> {
    let pi = std::f64::consts::PI;
    let tm = t_max as f64;
    let mut lr = base;
    (0..=steps)
        .map(|t| {
            let tf = t as f64;
            if t == 0 {
            } else if (t as i64 - 1 - t_max as i64).rem_euclid(2 * t_max as i64) == 0 {
                lr += (base - eta_min) * (1.0 - (pi / tm).cos()) / 2.0;
            } else {
                lr = (1.0 + (pi * tf / tm).cos()) / (1.0 + (pi * (tf - 1.0) / tm).cos())
                    * (lr - eta_min)
                    + eta_min;
            }
            lr
        })
        .collect()
}

fn linear_recursive(base: f64, start: f64, total: u64, steps: u64) -> Vec<f64> {
    let mut lr = base * start;
    (0..=steps)
        .map(|t| {
            if t != 0 && t <= total {
                lr *=
                    1.0 + (1.0 - start) / (total as f64 * start + (t as f64 - 1.0) * (1.0 - start));
            }
            lr
        })
        .collect()
}

fn schedule(s: &dyn LrScheduler, base: f64, steps: u64) -> Vec<f64> {
    (0..=steps).map(|t| s.lr_at(base, t)).collect()
}

/// Recursive forms accumulate a few f64 roundings per step.
const SCHED_TOL: Tol = Tol {
    rtol: 1e-12,
    atol: 1e-15,
};

#[test]
fn step_lr_matches_closed_and_recursive_forms() {
    let s = StepLR {
        step_size: 3,
        gamma: 0.1,
    };
    let got = schedule(&s, 0.5, 10);
    assert_close(
        "StepLR",
        &got,
        &step_lr_recursive(0.5, 3, 0.1, 10),
        SCHED_TOL,
    );
    assert_eq!((got[0], got[2]), (0.5, 0.5));
    assert_close(
        "StepLR t=3,9",
        &[got[3], got[9]],
        &[0.05, 0.5e-3],
        SCHED_TOL,
    );
}

#[test]
fn cosine_annealing_matches_closed_and_recursive_forms() {
    for (t_max, eta_min) in [(10, 0.0), (7, 1e-3)] {
        let s = CosineAnnealingLR { t_max, eta_min };
        let got = schedule(&s, 0.1, 2 * t_max + 3);
        assert_close(
            "cosine",
            &got,
            &cosine_recursive(0.1, t_max, eta_min, 2 * t_max + 3),
            SCHED_TOL,
        );
        assert_eq!(got[0], 0.1);
        assert_close(
            "cosine at t_max",
            &[got[t_max as usize]],
            &[eta_min],
            SCHED_TOL,
        );
    }
    let half = CosineAnnealingLR {
        t_max: 10,
        eta_min: 0.0,
    }
    .lr_at(0.1, 5);
    assert_close("cosine midpoint", &[half], &[0.05], SCHED_TOL);
}

#[test]
fn linear_warmup_then_cosine() {
    // Warm-up alone is LinearLR.
    let w = LinearWarmup::new(4, 0.25);
    assert_close(
        "warmup",
        &schedule(&w, 0.2, 9),
        &linear_recursive(0.2, 0.25, 4, 9),
        SCHED_TOL,
    );
    // Warm-up then cosine: SequentialLR with the milestone at the end of the warm-up.
    let cos = CosineAnnealingLR {
        t_max: 6,
        eta_min: 0.01,
    };
    let w = LinearWarmup::new(4, 0.25).then(cos);
    let got = schedule(&w, 0.2, 12);
    let want: Vec<f64> = (0..=12u64)
        .map(|t| {
            if t < 4 {
                0.2 * (0.25 + 0.75 * t as f64 / 4.0)
            } else {
                cos.lr_at(0.2, t - 4)
            }
        })
        .collect();
    assert_close("warmup+cosine", &got, &want, SCHED_TOL);
    assert_close("peak and end", &[got[4], got[10]], &[0.2, 0.01], SCHED_TOL);
    assert!(
        got[..4].windows(2).all(|w| w[0] < w[1]) && got[4..=10].windows(2).all(|w| w[0] > w[1])
    );
}

#[test]
fn scheduler_sets_the_optimizer_lr_and_resumes() {
    let p = || vec![Tensor::zeros(&[2], DType::F32).unwrap().requires_grad_()];
    let sched = || {
        LinearWarmup::new(3, 0.1).then(StepLR {
            step_size: 2,
            gamma: 0.5,
        })
    };
    let mut opt = Sgd::new(p(), sgd_lr(0.4)).unwrap();
    let mut s = Scheduler::new(sched(), &mut opt).unwrap();
    assert_close("lr at step 0", &[opt.lr()], &[0.04], SCHED_TOL);
    let mut lrs = vec![opt.lr()];
    for _ in 0..8 {
        s.step(&mut opt);
        lrs.push(opt.lr());
    }
    assert_eq!(lrs, schedule(&sched(), 0.4, 8));
    // Save after 4 steps, resume in a fresh scheduler over a fresh optimizer.
    let mut opt2 = Sgd::new(p(), sgd_lr(0.4)).unwrap();
    let mut s2 = Scheduler::new(sched(), &mut opt2).unwrap();
    for _ in 0..4 {
        s2.step(&mut opt2);
    }
    let saved = s2.state();
    assert_eq!((saved.base_lr, saved.step), (0.4, 4));
    let mut opt3 = Sgd::new(p(), SgdConfig::default()).unwrap();
    let mut s3 = Scheduler::new(Box::new(sched()) as Box<dyn LrScheduler>, &mut opt3).unwrap();
    s3.load_state(&saved, &mut opt3).unwrap();
    let mut resumed = vec![opt3.lr()];
    for _ in 0..4 {
        s3.step(&mut opt3);
        resumed.push(opt3.lr());
    }
    assert_eq!(resumed, lrs[4..]);
}

#[test]
fn invalid_schedules_are_rejected() {
    let mut opt = Sgd::new(
        vec![Tensor::zeros(&[1], DType::F32).unwrap().requires_grad_()],
        SgdConfig::default(),
    )
    .unwrap();
    assert!(Scheduler::new(
        StepLR {
            step_size: 0,
            gamma: 0.1
        },
        &mut opt
    )
    .is_err());
    assert!(Scheduler::new(
        CosineAnnealingLR {
            t_max: 0,
            eta_min: 0.0
        },
        &mut opt
    )
    .is_err());
    assert!(Scheduler::new(LinearWarmup::new(5, 0.0), &mut opt).is_err());
    assert!(Scheduler::new(LinearWarmup::new(5, 1.5), &mut opt).is_err());
    assert!(Scheduler::new(
        LinearWarmup::new(5, 0.5).then(StepLR {
            step_size: 0,
            gamma: 1.0
        }),
        &mut opt
    )
    .is_err());
    assert_eq!(opt.lr(), 1e-3, "a rejected schedule leaves the lr alone");
}

// ----- gradient clipping --------------------------------------------------------------------

fn clip_grad_norm_scales(dtype: DType) {
    let mut rng = Generator::new(81);
    // Small gradients make the 1e-6 in the scale visible (a relative 1e-3 at norm 1e-3).
    let cases = [
        (2.0, 1.0),
        (f64::INFINITY, 1.0),
        (1.0, 1.0),
        (3.0, 1.0),
        (2.0, 2e-4),
    ];
    for (norm_type, magnitude) in cases {
        let (params, _) = make_params(dtype, &mut rng);
        let grads: StepGrads = make_grads(dtype, 1, &mut rng, |_, i| i == 1)
            .remove(0)
            .into_iter()
            .map(|g| {
                g.map(|g| round_to(&g.iter().map(|x| x * magnitude).collect::<Vec<_>>(), dtype))
            })
            .collect();
        set_grads(&params, &grads, dtype);
        let all: Vec<f64> = grads.iter().flatten().flatten().copied().collect();
        let want_total = if norm_type == f64::INFINITY {
            all.iter().fold(0.0f64, |m, x| m.max(x.abs()))
        } else {
            all.iter()
                .map(|x| x.abs().powf(norm_type))
                .sum::<f64>()
                .powf(1.0 / norm_type)
        };
        // Above the total: nothing changes, bit for bit.
        let total = clip_grad_norm(&params, want_total * 2.0, norm_type).unwrap();
        assert_close(
            &format!("total {norm_type}"),
            &[total],
            &[want_total],
            balanced(DType::F64),
        );
        for (p, g) in params.iter().zip(&grads) {
            assert_eq!(p.grad().map(|g| g.to_vec_f64()), g.clone());
        }
        // Below: every gradient scaled by max_norm / (total + 1e-6), in the grad's dtype.
        let max_norm = want_total / 4.0;
        let total = clip_grad_norm(&params, max_norm, norm_type).unwrap();
        assert_close(
            "total before clipping",
            &[total],
            &[want_total],
            balanced(DType::F64),
        );
        let scale = max_norm / (want_total + 1e-6);
        // strict's atol assumes O(1) values: scale it with the gradients, keeping half the
        // dtype's subnormal spacing (F16 gradients this small are partly subnormal).
        let small_tol = Tol {
            atol: strict(dtype).atol * magnitude
                + dtype.finfo().unwrap().min_positive_subnormal / 2.0,
            ..strict(dtype)
        };
        for (i, (p, g)) in params.iter().zip(&grads).enumerate() {
            let Some(g) = g else {
                assert!(p.grad().is_none(), "a missing gradient stays missing");
                continue;
            };
            let got = p.grad().unwrap();
            assert_eq!(got.dtype(), dtype);
            let want: Vec<f64> = g.iter().map(|x| x * scale).collect();
            assert_close(
                &format!("clipped grad {i} ({norm_type})"),
                &got.to_vec_f64(),
                &want,
                small_tol,
            );
        }
        // The clipped gradients now have norm max_norm (up to the 1e-6 and rounding).
        let after = clip_grad_norm(&params, f64::MAX, norm_type).unwrap();
        assert_close(
            "norm after clipping",
            &[after],
            &[max_norm],
            balanced(dtype),
        );
    }
}
dtype_tests!(
    clip_grad_norm_total_and_scaling,
    super::clip_grad_norm_scales
);

#[test]
fn clip_grad_norm_returns_nonfinite_totals_untouched() {
    for (bad, norm_type) in [
        (f64::INFINITY, 2.0),
        (f64::NAN, 2.0),
        (f64::NAN, f64::INFINITY),
        (f64::INFINITY, f64::INFINITY),
    ] {
        let a = Tensor::zeros(&[3], DType::F16).unwrap().requires_grad_();
        let b = Tensor::zeros(&[2], DType::F32).unwrap().requires_grad_();
        let ga = vec![1.0, bad, -2.0];
        a.set_grad(Some(
            Tensor::from_f64_vec(ga.clone(), &[3], DType::F16).unwrap(),
        ));
        b.set_grad(Some(
            Tensor::from_f64_vec(vec![3.0, 4.0], &[2], DType::F32).unwrap(),
        ));
        let total = clip_grad_norm(&[a.clone(), b.clone()], 1.0, norm_type).unwrap();
        if bad.is_nan() {
            assert!(total.is_nan(), "{bad} {norm_type}: {total}");
        } else {
            assert_eq!(total, f64::INFINITY);
        }
        assert_eq!(
            b.grad().unwrap().to_vec_f64(),
            vec![3.0, 4.0],
            "grads left for the caller"
        );
    }
    let p = vec![Tensor::zeros(&[1], DType::F32).unwrap().requires_grad_()];
    assert_eq!(
        clip_grad_norm(&p, 1.0, 2.0).unwrap(),
        0.0,
        "no gradients: norm 0"
    );
    assert!(clip_grad_norm(&p, -1.0, 2.0).is_err());
    assert!(clip_grad_norm(&p, 1.0, 0.0).is_err());
    assert!(clip_grad_norm(&p, 1.0, f64::NAN).is_err());
}

#[test]
fn clip_grad_value_clamps() {
    for dtype in [DType::F32, DType::BF16] {
        let p = Tensor::zeros(&[5], DType::F32).unwrap().requires_grad_();
        let q = Tensor::zeros(&[2], DType::F32).unwrap().requires_grad_();
        let g = vec![-3.0, -0.25, 0.0, 0.5, 7.0];
        p.set_grad(Some(Tensor::from_f64_vec(g, &[5], dtype).unwrap()));
        clip_grad_value(&[p.clone(), q.clone()], 0.5).unwrap();
        let got = p.grad().unwrap();
        assert_eq!(got.dtype(), dtype);
        assert_eq!(got.to_vec_f64(), vec![-0.5, -0.25, 0.0, 0.5, 0.5]);
        assert!(q.grad().is_none());
    }
    assert!(clip_grad_value(&[], -1.0).is_err());
}

// ----- timing (not a test of speed: run it by hand) -----------------------------------------

/// Prints the time of one optimizer step over CifarNet's parameters (1.26M, F32):
/// `cargo test --release -p hemi --test models -- --ignored --nocapture step_timing`.
#[test]
#[ignore]
fn step_timing_on_cifar_net_sized_parameters() {
    const SHAPES: [&[usize]; 8] = [
        &[64, 3, 3, 3],
        &[64],
        &[128, 64, 3, 3],
        &[128],
        &[256, 4608],
        &[256],
        &[10, 256],
        &[10],
    ];
    let mut rng = Generator::new(5);
    let params: Vec<Tensor> = SHAPES
        .iter()
        .map(|s| {
            Tensor::rand(s, -1.0, 1.0, DType::F32, &mut rng)
                .unwrap()
                .requires_grad_()
        })
        .collect();
    let n: usize = params.iter().map(Tensor::numel).sum();
    let grads: Vec<Tensor> = SHAPES
        .iter()
        .map(|s| Tensor::rand(s, -1e-3, 1e-3, DType::F32, &mut rng).unwrap())
        .collect();
    let sgd = |momentum, weight_decay, nesterov| {
        move |p| -> Box<dyn Optimizer> {
            Box::new(
                Sgd::new(
                    p,
                    SgdConfig {
                        lr: 1e-3,
                        momentum,
                        weight_decay,
                        nesterov,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        }
    };
    type Build = Box<dyn Fn(Vec<Tensor>) -> Box<dyn Optimizer>>;
    let builds: Vec<(&str, Build)> = vec![
        ("sgd", Box::new(sgd(0.0, 0.0, false))),
        ("sgd momentum 0.9", Box::new(sgd(0.9, 0.0, false))),
        ("sgd nesterov + wd", Box::new(sgd(0.9, 5e-4, true))),
        (
            "adam",
            Box::new(|p| Box::new(Adam::new(p, AdamConfig::default()).unwrap())),
        ),
        (
            "adamw",
            Box::new(|p| Box::new(AdamW::new(p, AdamWConfig::default()).unwrap())),
        ),
    ];
    for (name, build) in builds {
        let ps: Vec<Tensor> = params.iter().map(|p| p.detach().requires_grad_()).collect();
        let mut opt = build(ps.clone());
        let mut times = Vec::new();
        for _ in 0..30 {
            for (p, g) in ps.iter().zip(&grads) {
                p.set_grad(Some(g.clone()));
            }
            let t = std::time::Instant::now();
            opt.step().unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{name:20} {n} params: median {:.2} ms/step (min {:.2})",
            times[times.len() / 2],
            times[0]
        );
    }
}

#[test]
fn multistep_lr_drops_at_each_milestone() {
    let s = MultiStepLR {
        milestones: vec![3, 5],
        gamma: 0.1,
    };
    let got = schedule(&s, 1.0, 7);
    assert_close(
        "multistep",
        &got,
        &[1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01, 0.01],
        SCHED_TOL,
    );
    let bad = MultiStepLR {
        milestones: vec![5, 3],
        gamma: 0.1,
    };
    assert!(bad.validate().is_err());
}

/// With a weight-decay mask, the undecayed parameters follow the optimizer without weight
/// decay and the others the optimizer with it, bit for bit.
#[test]
fn weight_decay_mask_leaves_biases_and_norms_undecayed() {
    let mut rng = Generator::new(17);
    let shapes: [&[usize]; 3] = [&[4, 3], &[4], &[2, 3, 3, 3]];
    let values: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| rand_values(s.iter().product(), -1.0, 1.0, DType::F32, &mut rng))
        .collect();
    let grads: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| rand_values(s.iter().product(), -1.0, 1.0, DType::F32, &mut rng))
        .collect();
    let make = || -> Vec<Tensor> {
        shapes
            .iter()
            .zip(&values)
            .map(|(s, v)| {
                Tensor::from_f64_vec(v.clone(), s, DType::F32)
                    .unwrap()
                    .requires_grad_()
            })
            .collect()
    };
    let run = |opt: &mut dyn Optimizer| -> Vec<Vec<u32>> {
        for _ in 0..3 {
            for (p, g) in opt.params().iter().zip(&grads) {
                p.set_grad(Some(
                    Tensor::from_f64_vec(g.clone(), p.shape(), DType::F32).unwrap(),
                ));
            }
            opt.step().unwrap();
        }
        opt.params()
            .iter()
            .map(|p| {
                p.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .collect()
    };
    let params = make();
    let mask = no_decay_mask(&params);
    assert_eq!(mask, [true, false, true]);
    type Build = Box<dyn Fn(Vec<Tensor>, f64) -> Box<dyn Optimizer>>;
    let builders: [(&str, Build); 3] = [
        (
            "sgd",
            Box::new(|p, wd| {
                let c = SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: wd,
                    nesterov: true,
                    ..Default::default()
                };
                Box::new(Sgd::new(p, c).unwrap())
            }),
        ),
        (
            "adam",
            Box::new(|p, wd| {
                let c = AdamConfig {
                    weight_decay: wd,
                    ..Default::default()
                };
                Box::new(Adam::new(p, c).unwrap())
            }),
        ),
        (
            "adamw",
            Box::new(|p, wd| {
                let c = AdamWConfig {
                    weight_decay: wd,
                    ..Default::default()
                };
                Box::new(AdamW::new(p, c).unwrap())
            }),
        ),
    ];
    for (name, build) in &builders {
        let mut masked = build(make(), 0.05);
        masked.set_weight_decay_mask(&mask).unwrap();
        let got = run(masked.as_mut());
        let decayed = run(build(make(), 0.05).as_mut());
        let plain = run(build(make(), 0.0).as_mut());
        assert_eq!(got[0], decayed[0], "{name}: weight");
        assert_eq!(got[1], plain[1], "{name}: bias");
        assert_eq!(got[2], decayed[2], "{name}: conv weight");
        assert_ne!(decayed[1], plain[1], "{name}: decay must matter");
        let e = masked
            .set_weight_decay_mask(&[true])
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 flags for 3 parameters"), "{e}");
    }
}

/// Parameters are updated in place, in parallel parts of 32768 elements: a parameter of
/// 100 003 elements (four parts, a short last one) steps to the same bits as the same values
/// cut into slices across the part boundaries and stepped as separate parameters.
#[test]
fn large_parameters_update_in_parallel_with_the_bits_of_small_ones() {
    let n = 100_003;
    let cuts = [0, 1000, 32_760, 32_777, 65_536, 98_000, n];
    let mut rng = Generator::new(5);
    let init = rand_values(n, -1.0, 1.0, DType::F32, &mut rng);
    let grads: Vec<Vec<f64>> = (0..3)
        .map(|_| rand_values(n, -1.0, 1.0, DType::F32, &mut rng))
        .collect();
    let big = vec![Tensor::from_f64_vec(init.clone(), &[n], DType::F32)
        .unwrap()
        .requires_grad_()];
    let small: Vec<Tensor> = cuts
        .windows(2)
        .map(|w| {
            Tensor::from_f64_vec(init[w[0]..w[1]].to_vec(), &[w[1] - w[0]], DType::F32)
                .unwrap()
                .requires_grad_()
        })
        .collect();
    for ((name, mut whole), (_, mut parts)) in
        all_optimizers(&big).into_iter().zip(all_optimizers(&small))
    {
        for g in &grads {
            whole.params()[0].set_grad(Some(
                Tensor::from_f64_vec(g.clone(), &[n], DType::F32).unwrap(),
            ));
            for (p, w) in parts.params().iter().zip(cuts.windows(2)) {
                let gs = g[w[0]..w[1]].to_vec();
                p.set_grad(Some(
                    Tensor::from_f64_vec(gs, &[w[1] - w[0]], DType::F32).unwrap(),
                ));
            }
            whole.step().unwrap();
            parts.step().unwrap();
        }
        let got = whole.params()[0].to_vec_f64();
        let want: Vec<f64> = parts.params().iter().flat_map(|p| p.to_vec_f64()).collect();
        assert_ne!(got, init, "{name}: the parameter moved");
        let first = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(first, None, "{name}: first differing element");
    }
}

/// The update is in place, but a handle that shares the parameter's buffer (a `detach`ed
/// snapshot) keeps the values it saw: the buffer is copied first when it is shared.
#[test]
fn a_detached_snapshot_keeps_its_values_through_a_step() {
    let init = vec![1.0, -2.0, 3.0, 0.5];
    let p = Tensor::from_f64_vec(init.clone(), &[4], DType::F32)
        .unwrap()
        .requires_grad_();
    for (name, mut opt) in all_optimizers(&[p]) {
        let p = opt.params()[0].clone();
        let snapshot = p.detach();
        p.set_grad(Some(Tensor::ones(&[4], DType::F32).unwrap()));
        opt.step().unwrap();
        assert_eq!(snapshot.to_vec_f64(), init, "{name}: the snapshot");
        assert!(
            p.to_vec_f64().iter().zip(&init).all(|(a, b)| a < b),
            "{name}: the step"
        );
    }
}
