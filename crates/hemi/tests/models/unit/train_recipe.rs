//! The unit tests of `hemi::train::recipe` (`src/train/recipe.rs`), run against the built library.

use hemi::optim::LrScheduler;
use hemi::train::recipe::*;
use hemi::train::OptimizerKind;

#[test]
fn cosine_after_warmup_spans_the_run_and_ends_at_zero() {
    let s = lr_schedule(&Schedule::Cosine, 1.0, 4, 10).unwrap();
    // Warm-up: 10 steps from 0.1·lr up; then the cosine from lr down to 0 at step 40.
    assert!((s.lr_at(0.1, 0) - 0.01).abs() < 1e-15);
    assert!(s.lr_at(0.1, 5) < s.lr_at(0.1, 9));
    assert_eq!(s.lr_at(0.1, 10), 0.1);
    assert!((s.lr_at(0.1, 25) - 0.05).abs() < 1e-12);
    assert!(s.lr_at(0.1, 40).abs() < 1e-15);
    let no_warmup = lr_schedule(&Schedule::Cosine, 0.0, 4, 10).unwrap();
    assert_eq!(no_warmup.lr_at(0.1, 0), 0.1);
    assert!((no_warmup.lr_at(0.1, 20) - 0.05).abs() < 1e-12);
}

#[test]
fn step_milestones_are_epochs_of_the_whole_run() {
    let step = Schedule::parse("step", &[2, 3], 0.1).unwrap();
    for warmup in [0.0, 1.0] {
        let s = lr_schedule(&step, warmup, 4, 10).unwrap();
        assert_eq!(s.lr_at(1.0, 15), 1.0);
        assert!((s.lr_at(1.0, 20) - 0.1).abs() < 1e-15, "warmup {warmup}");
        assert!((s.lr_at(1.0, 30) - 0.01).abs() < 1e-15, "warmup {warmup}");
    }
    let c = lr_schedule(&Schedule::Constant, 0.0, 4, 10).unwrap();
    assert_eq!(c.lr_at(0.3, 39), 0.3);
}

#[test]
fn linear_decay_after_warmup_reaches_zero_at_the_end() {
    // 1 epoch of 100 steps, 6 % warm-up: Hugging Face's linear schedule.
    let s = lr_schedule(&Schedule::Linear, 0.06, 1, 100).unwrap();
    assert!(s.lr_at(1.0, 0) > 0.0 && s.lr_at(1.0, 0) < s.lr_at(1.0, 5));
    assert_eq!(s.lr_at(1.0, 6), 1.0);
    assert!((s.lr_at(1.0, 53) - 0.5).abs() < 1e-12);
    assert_eq!(s.lr_at(1.0, 100), 0.0);
    let r = Recipe::find("bert-finetune").unwrap();
    assert_eq!(
        (r.optimizer, r.lr, r.batch_size),
        (OptimizerKind::AdamW, 5e-5, 32)
    );
    assert!(r.no_decay_norm_bias && r.weight_decay == Some(0.01));
}

#[test]
fn bad_settings_are_errors() {
    assert!(Schedule::parse("exponential", &[], 0.1).is_err());
    assert!(Schedule::parse("cosine", &[3], 0.1).is_err());
    assert!(lr_schedule(&Schedule::Cosine, 5.0, 4, 10).is_err());
    assert!(lr_schedule(&Schedule::Cosine, f64::NAN, 4, 10).is_err());
    let step = Schedule::parse("step", &[3, 2], 0.1).unwrap();
    assert!(lr_schedule(&step, 0.0, 4, 10).is_err());
    let e = Recipe::find("imagenet").unwrap_err().to_string();
    assert!(e.contains("resnet-cifar") && e.contains("documents"), "{e}");
    let r = Recipe::find("resnet-cifar").unwrap();
    assert!(r.normalize_for(3).is_ok() && r.normalize_for(1).is_err());
    assert!(parse_values("mean", "0.5,x").is_err());
    assert_eq!(
        parse_values("mean", &format_values(&CIFAR10_MEAN)).unwrap(),
        CIFAR10_MEAN
    );
}

#[test]
fn resnet_cifar_is_he_et_al_shortened() {
    let r = Recipe::find("resnet-cifar").unwrap();
    assert_eq!((r.batch_size, r.lr, r.momentum), (128, 0.1, 0.9));
    assert_eq!((r.weight_decay, r.epochs), (Some(1e-4), 30));
    assert_eq!(r.schedule, Schedule::Cosine);
    assert!(r.augment);
}
