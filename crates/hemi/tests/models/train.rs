//! The training loop: it learns, logs, checkpoints, and a run stopped after epoch k and
//! resumed ends bit-identical to an uninterrupted one.

use std::sync::Arc;

use hemi::data::{DataLoader, InMemoryDataset, LoaderConfig, Split, Synthetic, Transform};
use hemi::models::Mlp;
use hemi::nn::Module;
use hemi::train::{load_checkpoint, train, Event, OptimizerKind, RunInfo, TrainConfig};
use hemi::Generator;

fn loaders(workers: usize) -> (DataLoader, DataLoader) {
    let tr = Arc::new(Synthetic::generate(3, Split::Train, 300));
    let te = Arc::new(Synthetic::generate(3, Split::Test, 100));
    let cfg = |shuffle| LoaderConfig {
        batch_size: 32,
        shuffle,
        seed: 5,
        workers,
        transform: Transform::to_tensor_normalize_half(),
        ..Default::default()
    };
    (
        DataLoader::new(tr, cfg(true)).unwrap(),
        DataLoader::new(te, cfg(false)).unwrap(),
    )
}

fn info() -> RunInfo {
    RunInfo {
        model: "mlp".into(),
        dataset: "synthetic".into(),
        data_dir: None,
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        precision: "fp32".into(),
        ..Default::default()
    }
}

fn model() -> Mlp {
    Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(1)).unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hemi-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn resumed_run_ends_bit_identical_to_an_uninterrupted_one() {
    let (tr, te) = loaders(2);
    let cfg = TrainConfig {
        epochs: 3,
        optimizer: OptimizerKind::Sgd,
        lr: 0.01,
        log_every: 4,
        ..Default::default()
    };

    let mut whole = model();
    train(&mut whole, &tr, &te, &cfg, &info(), &mut |_| {}).unwrap();

    let dir = tmp("resume");
    let mut first = model();
    let stop = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        stop_after: Some(1),
        ..cfg.clone()
    };
    let s = train(&mut first, &tr, &te, &stop, &info(), &mut |_| {}).unwrap();
    assert_eq!(s.last_epoch, 1);
    assert_eq!(load_checkpoint(&dir).unwrap().epochs_done, 1);

    // A fresh process would build a fresh model; the checkpoint restores everything. The
    // resumed run uses a different worker count: batches do not depend on it.
    let (tr1, te1) = loaders(1);
    let mut resumed = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(99)).unwrap();
    let resume = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        resume: true,
        ..cfg.clone()
    };
    let mut epochs_seen = Vec::new();
    let s = train(&mut resumed, &tr1, &te1, &resume, &info(), &mut |e| {
        if let Event::Epoch { epoch, .. } = e {
            epochs_seen.push(*epoch)
        }
    })
    .unwrap();
    assert_eq!(epochs_seen, [2, 3]);
    assert_eq!(s.epochs_run, 2);
    for ((n, a), (_, b)) in whole.state_dict().iter().zip(resumed.state_dict().iter()) {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n} differs after resume"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Colour-coded classes: each class has its own mean colour, plus pixel noise. An MLP
/// separates them within a few epochs.
fn colour_loaders() -> (DataLoader, DataLoader) {
    let make = |n: usize, seed: u64| {
        let mut rng = Generator::new(seed);
        let mut pixels = Vec::with_capacity(n * 3 * 32 * 32);
        let labels: Vec<u32> = (0..n).map(|i| (i % 10) as u32).collect();
        for &l in &labels {
            let base = [
                (l * 25) as f64,
                ((l * 67) % 250) as f64,
                ((l * 131) % 250) as f64,
            ];
            for c in base {
                for _ in 0..32 * 32 {
                    pixels.push((c + rng.uniform(0.0, 60.0)).min(255.0) as u8);
                }
            }
        }
        let classes = (0..10).map(|i| format!("c{i}")).collect();
        Arc::new(InMemoryDataset::new([3, 32, 32], pixels, labels, classes).unwrap())
    };
    let cfg = |shuffle| LoaderConfig {
        batch_size: 32,
        shuffle,
        seed: 5,
        workers: 2,
        ..Default::default()
    };
    (
        DataLoader::new(make(320, 1), cfg(true)).unwrap(),
        DataLoader::new(make(100, 2), cfg(false)).unwrap(),
    )
}

#[test]
fn the_loop_learns_and_reports() {
    let (tr, te) = colour_loaders();
    let cfg = TrainConfig {
        epochs: 4,
        optimizer: OptimizerKind::Adam,
        lr: 1e-3,
        log_every: 5,
        ..Default::default()
    };
    let mut m = model();
    let mut logs = 0;
    let mut losses = Vec::new();
    let s = train(&mut m, &tr, &te, &cfg, &info(), &mut |e| match e {
        Event::Log { step, .. } => {
            assert_eq!(step % 5, 0);
            logs += 1
        }
        Event::Epoch {
            train_loss,
            test_accuracy,
            ..
        } => {
            assert!((0.0..=1.0).contains(test_accuracy));
            losses.push(*train_loss)
        }
        _ => {}
    })
    .unwrap();
    assert_eq!(
        logs,
        4 * (10 / 5),
        "10 batches per epoch, a log line every 5"
    );
    assert!(losses[3] < losses[0], "train loss falls: {losses:?}");
    assert!(
        s.test_accuracy > 0.5,
        "well above the 10% of chance: {}",
        s.test_accuracy
    );
}

#[test]
fn resume_without_a_checkpoint_is_a_clear_error() {
    let (tr, te) = loaders(0);
    let dir = tmp("missing");
    let cfg = TrainConfig {
        epochs: 1,
        checkpoint_dir: Some(dir.clone()),
        resume: true,
        ..Default::default()
    };
    let e = train(&mut model(), &tr, &te, &cfg, &info(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("no complete checkpoint"), "{e}");
    // A checkpoint directory whose state file was replaced names the file and the problem.
    let ck = dir.join("epoch-0001");
    std::fs::create_dir_all(&ck).unwrap();
    let cfg1 = TrainConfig {
        resume: false,
        checkpoint_dir: Some(
            std::env::temp_dir().join(format!("hemi-train-src-{}", std::process::id())),
        ),
        ..cfg.clone()
    };
    let _ = std::fs::remove_dir_all(cfg1.checkpoint_dir.as_ref().unwrap());
    train(&mut model(), &tr, &te, &cfg1, &info(), &mut |_| {}).unwrap();
    let src = cfg1.checkpoint_dir.as_ref().unwrap().join("epoch-0001");
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "MANIFEST.json",
    ] {
        std::fs::copy(src.join(f), ck.join(f)).unwrap();
    }
    std::fs::write(ck.join("state.json"), b"{ not json").unwrap();
    let e = train(&mut model(), &tr, &te, &cfg, &info(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("state.json") && e.contains("bytes"), "{e}");
    std::fs::remove_dir_all(cfg1.checkpoint_dir.as_ref().unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `resnet-cifar` recipe's pieces (cosine per step after a warm-up, Nesterov, label
/// smoothing, no decay on biases): the loop sets the closed-form lr at every step, and a run
/// stopped after one epoch and resumed ends bit-identical to an uninterrupted one.
#[test]
fn scheduled_recipe_runs_resume_bit_identically() {
    use hemi::train::{recipe::lr_schedule, Schedule};
    let (tr, te) = loaders(2);
    let cfg = TrainConfig {
        epochs: 3,
        optimizer: OptimizerKind::Sgd,
        lr: 0.05,
        momentum: 0.9,
        weight_decay: Some(1e-3),
        nesterov: true,
        no_decay_norm_bias: true,
        schedule: Schedule::Cosine,
        warmup_epochs: 0.5,
        label_smoothing: 0.1,
        log_every: 1,
        ..Default::default()
    };
    let mut whole = model();
    let mut lrs = Vec::new();
    train(&mut whole, &tr, &te, &cfg, &info(), &mut |e| {
        if let Event::Log { lr, .. } = e {
            lrs.push(*lr)
        }
    })
    .unwrap();
    // Each Log line reports the lr of the step just taken.
    let nb = tr.num_batches();
    let sched = lr_schedule(&Schedule::Cosine, 0.5, 3, nb).unwrap();
    let want: Vec<f64> = (0..3 * nb as u64).map(|t| sched.lr_at(0.05, t)).collect();
    assert_eq!(lrs, want);
    assert!(want[0] < 0.05 / 2.0 && want[nb / 2] == 0.05 && *want.last().unwrap() < 1e-3);

    let dir = tmp("resume-recipe");
    let stop = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        stop_after: Some(1),
        ..cfg.clone()
    };
    train(&mut model(), &tr, &te, &stop, &info(), &mut |_| {}).unwrap();
    let mut resumed = Mlp::new(3 * 32 * 32, 32, 10, &mut Generator::new(99)).unwrap();
    let resume = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        resume: true,
        ..cfg.clone()
    };
    train(&mut resumed, &tr, &te, &resume, &info(), &mut |_| {}).unwrap();
    for ((n, a), (_, b)) in whole.state_dict().iter().zip(resumed.state_dict().iter()) {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n} differs after resume"
        );
    }
    // A resume that changes the schedule is refused, naming it.
    let changed = TrainConfig {
        schedule: Schedule::Constant,
        ..resume.clone()
    };
    let e = train(&mut model(), &tr, &te, &changed, &info(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("schedule"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recipe_settings_are_checked_before_training() {
    let (tr, te) = loaders(0);
    let bad = [
        TrainConfig {
            optimizer: OptimizerKind::Adam,
            nesterov: true,
            ..Default::default()
        },
        TrainConfig {
            label_smoothing: 1.5,
            ..Default::default()
        },
        TrainConfig {
            epochs: 2,
            warmup_epochs: 3.0,
            ..Default::default()
        },
    ];
    for (cfg, word) in bad.iter().zip(["Nesterov", "label smoothing", "warm-up"]) {
        let e = train(&mut model(), &tr, &te, cfg, &info(), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(word), "{e}");
    }
}

/// A user's callback: counts the hooks, checks that it sees the step's gradients unscaled
/// when it asks for them, and stops the run with its own error at a chosen step.
struct Watcher {
    epochs_started: Vec<usize>,
    backward_losses: Vec<f64>,
    step_losses: Vec<f64>,
    epochs_ended: Vec<(usize, f64)>,
    /// Max |gradient| of the first parameter after each step (unscaled on request).
    grad_max: Vec<f64>,
    unscaled: bool,
    stop_at: Option<u64>,
}

impl Watcher {
    fn new(unscaled: bool, stop_at: Option<u64>) -> Self {
        Watcher {
            epochs_started: Vec::new(),
            backward_losses: Vec::new(),
            step_losses: Vec::new(),
            epochs_ended: Vec::new(),
            grad_max: Vec::new(),
            unscaled,
            stop_at,
        }
    }
}

impl hemi::train::Callback for Watcher {
    fn on_epoch_start(&mut self, epoch: usize) -> hemi::Result<()> {
        self.epochs_started.push(epoch);
        Ok(())
    }
    fn after_backward(
        &mut self,
        b: &hemi::train::BackwardEnd<'_>,
        _emit: &mut hemi::train::callbacks::Emit<'_>,
    ) -> hemi::Result<()> {
        self.backward_losses.push(b.loss);
        Ok(())
    }
    fn wants_unscaled(&self, _step: u64) -> bool {
        self.unscaled
    }
    fn on_step_end(
        &mut self,
        s: &hemi::train::StepEnd<'_>,
        _emit: &mut hemi::train::callbacks::Emit<'_>,
    ) -> hemi::Result<()> {
        self.step_losses.push(s.loss);
        let g = s.opt.grad_tensors()[0].grad().unwrap().to_vec_f64();
        self.grad_max
            .push(g.iter().fold(0.0f64, |m, x| m.max(x.abs())));
        if Some(s.global_step) == self.stop_at {
            return Err(hemi::Error::Msg(format!(
                "the watcher stops at step {}",
                s.global_step
            )));
        }
        Ok(())
    }
    fn on_epoch_end(
        &mut self,
        e: &hemi::train::EpochEnd<'_>,
        _emit: &mut hemi::train::callbacks::Emit<'_>,
    ) -> hemi::Result<()> {
        self.epochs_ended.push((e.epoch, e.test_accuracy));
        Ok(())
    }
}

#[test]
fn a_users_callback_sees_every_step_and_can_end_the_run() {
    use hemi::train::train_with_callbacks;
    let (tr, te) = loaders(1);
    let cfg = TrainConfig {
        epochs: 2,
        optimizer: OptimizerKind::Sgd,
        lr: 0.01,
        log_every: 4,
        precision: hemi::amp::Precision::AmpFp16,
        ..Default::default()
    };
    // Watched (gradients left scaled) and unwatched runs end with the same weights: a
    // callback that only reads changes nothing.
    let mut plain = model();
    let mut events = Vec::new();
    let s0 = train(&mut plain, &tr, &te, &cfg, &info(), &mut |e| {
        events.push(format!("{e:?}").chars().take(12).collect::<String>())
    })
    .unwrap();
    let mut watched = model();
    let mut w = Watcher::new(false, None);
    let mut watched_events = Vec::new();
    let s1 = train_with_callbacks(
        &mut watched,
        &tr,
        &te,
        &cfg,
        &info(),
        &mut [&mut w],
        &mut |e| watched_events.push(format!("{e:?}").chars().take(12).collect::<String>()),
    )
    .unwrap();
    assert_eq!(events, watched_events, "the same events in the same order");
    assert_eq!(s0.test_accuracy, s1.test_accuracy);
    for ((_, a), (_, b)) in plain.state_dict().iter().zip(watched.state_dict().iter()) {
        assert_eq!(a.to_vec_f64(), b.to_vec_f64());
    }
    let steps = 2 * tr.num_batches();
    assert_eq!(w.epochs_started, [1, 2]);
    assert_eq!(w.backward_losses.len(), steps);
    assert_eq!(w.backward_losses, w.step_losses);
    assert_eq!(w.epochs_ended.len(), 2);
    assert_eq!(w.epochs_ended[1].1, s1.test_accuracy);
    // Asking for the gradients unscaled before the step (as gradient statistics do): the
    // step, which unscales them itself otherwise, takes the same values, and after it the
    // gradients are the unscaled ones either way.
    let mut u = Watcher::new(true, None);
    let mut m = model();
    train_with_callbacks(&mut m, &tr, &te, &cfg, &info(), &mut [&mut u], &mut |_| {}).unwrap();
    assert_eq!(u.grad_max, w.grad_max);
    assert!(
        w.grad_max.iter().all(|g| g.is_finite() && *g < 100.0),
        "{:?}",
        w.grad_max
    );
    for ((_, a), (_, b)) in plain.state_dict().iter().zip(m.state_dict().iter()) {
        assert_eq!(
            a.to_vec_f64(),
            b.to_vec_f64(),
            "unscaling first changes no bit"
        );
    }
    // An error from a callback ends the run with that error.
    let mut stopper = Watcher::new(false, Some(3));
    let err = match train_with_callbacks(
        &mut model(),
        &tr,
        &te,
        &cfg,
        &info(),
        &mut [&mut stopper],
        &mut |_| {},
    ) {
        Ok(_) => panic!("the callback's error ends the run"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("the watcher stops at step 3"), "{err}");
    assert_eq!(stopper.step_losses.len(), 3);
}
