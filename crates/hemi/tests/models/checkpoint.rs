//! Checkpoints: atomic per-save directories with a verified manifest, stray temporaries
//! removed, pruning, resume checks, and a run stopped mid-epoch (the Ctrl-C path) that
//! resumes bit-identically.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
use hemi::models::Mlp;
use hemi::nn::Module;
use hemi::train::checkpoint::{
    lock_dir, parse_manifest, parse_state, prune_checkpoints, remove_stray, Progress, LOCK_FILE,
};
use hemi::train::{list_checkpoints, load_checkpoint, train, Event, RunInfo, TrainConfig};
use hemi::{Error, Generator};

fn loaders() -> (DataLoader, DataLoader) {
    let tr = Arc::new(Synthetic::generate(3, Split::Train, 320));
    let te = Arc::new(Synthetic::generate(3, Split::Test, 64));
    let cfg = |shuffle| LoaderConfig {
        batch_size: 32,
        shuffle,
        seed: 5,
        workers: 1,
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
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        ..Default::default()
    }
}

fn model() -> Mlp {
    Mlp::new(3 * 32 * 32, 16, 10, &mut Generator::new(1)).unwrap()
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn cfg(dir: &Path, epochs: usize) -> TrainConfig {
    TrainConfig {
        epochs,
        optimizer: hemi::train::OptimizerKind::Adam,
        lr: 0.01,
        log_every: 3,
        checkpoint_dir: Some(dir.to_path_buf()),
        precision: hemi::amp::Precision::AmpFp16,
        ..Default::default()
    }
}

/// A checkpoint root holding `epochs` epochs of the `cfg` run.
fn trained(epochs: usize) -> tempfile::TempDir {
    let t = tmp();
    let (tr, te) = loaders();
    train(
        &mut model(),
        &tr,
        &te,
        &cfg(t.path(), epochs),
        &info(),
        &mut |_| {},
    )
    .unwrap();
    t
}

fn bits(m: &dyn Module) -> Vec<(String, Vec<u32>)> {
    m.state_dict()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f32().iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// The entries of `root`, sorted, but for the lock file every run leaves in its checkpoint
/// directory (`.hemi-lock`).
fn names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".hemi-lock")
        .collect();
    v.sort();
    v
}

#[test]
fn every_save_is_a_verified_directory_and_resume_takes_the_newest() {
    let t = tmp();
    let (tr, te) = loaders();
    let mut m = model();
    train(&mut m, &tr, &te, &cfg(t.path(), 2), &info(), &mut |_| {}).unwrap();
    assert_eq!(names(t.path()), ["epoch-0001", "epoch-0002"]);
    for d in ["epoch-0001", "epoch-0002"] {
        assert_eq!(
            names(&t.path().join(d)),
            [
                "MANIFEST.json",
                "model.safetensors",
                "optimizer.safetensors",
                "state.json"
            ]
        );
    }
    let ck = load_checkpoint(t.path()).unwrap();
    assert_eq!(ck.dir, t.path().join("epoch-0002"));
    assert_eq!(ck.epochs_done, 2);
    assert!(ck.test_accuracy.is_some());
    // The settings of the run are recorded.
    for k in [
        "lr",
        "optimizer",
        "epochs",
        "scaler.init_scale",
        "scaler.max_scale",
    ] {
        assert!(
            ck.info.settings.contains_key(k),
            "{k}: {:?}",
            ck.info.settings
        );
    }
    assert_eq!(ck.info.precision, "amp-fp16");
    let listed: Vec<_> = list_checkpoints(t.path())
        .unwrap()
        .into_iter()
        .map(|(_, k)| k)
        .collect();
    assert_eq!(listed, [(1, 0), (2, 0)]);
}

#[test]
fn stray_temporaries_are_removed_and_a_moved_aside_checkpoint_is_restored() {
    let t = trained(1);
    let root = t.path();
    std::fs::create_dir(root.join(".tmp-epoch-0002-77")).unwrap();
    std::fs::write(root.join(".tmp-epoch-0002-77/model.safetensors"), b"x").unwrap();
    std::fs::write(root.join(".model.safetensors.tmp77"), b"x").unwrap();
    // A save that replaced epoch-0001 and died between its two renames.
    std::fs::rename(root.join("epoch-0001"), root.join(".old-epoch-0001-77")).unwrap();
    let removed = remove_stray(root).unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert_eq!(names(root), ["epoch-0001"]);
    load_checkpoint(root).unwrap();
}

#[test]
fn manifest_and_state_parsers_refuse_bad_input_without_panicking() {
    let t = trained(1);
    let d = t.path().join("epoch-0001");
    let manifest = std::fs::read(d.join("MANIFEST.json")).unwrap();
    let state = std::fs::read(d.join("state.json")).unwrap();
    parse_manifest("m", &manifest).unwrap();
    parse_state("s", &state).unwrap();
    // Every truncation, and bytes flipped at many positions: an error or a value, never a
    // panic.
    let mut rng = Generator::new(9);
    for src in [&manifest, &state] {
        for cut in 0..src.len() {
            let _ = parse_manifest("m", &src[..cut]);
            let _ = parse_state("s", &src[..cut]);
        }
        for _ in 0..2000 {
            let mut b = src.clone();
            let i = rng.below(b.len() as u64) as usize;
            b[i] = rng.below(256) as u8;
            let _ = parse_manifest("m", &b);
            let _ = parse_state("s", &b);
        }
    }
    // A manifest may not point outside its directory.
    let evil = br#"{"format":"hemi-checkpoint-manifest-1","files":[
        {"name":"../model.safetensors","size":1,"sha256":"0000000000000000000000000000000000000000000000000000000000000000"}]}"#;
    let e = parse_manifest("MANIFEST.json", evil)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("MANIFEST.json") && e.contains("bad entry"),
        "{e}"
    );
    // Sizes out of range are refused before anything is allocated from them.
    let mut v: serde_json::Value = serde_json::from_slice(&state).unwrap();
    v["run"]["classes"] = 1_000_000_000_000u64.into();
    let e = parse_state("state.json", v.to_string().as_bytes())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("classes") && e.contains("out of range"), "{e}");
}

#[test]
fn prune_keeps_the_newest_and_the_best() {
    let t = tmp();
    let (tr, te) = loaders();
    let c = TrainConfig {
        keep: Some(1),
        keep_best: true,
        ..cfg(t.path(), 4)
    };
    let mut accs = Vec::new();
    train(&mut model(), &tr, &te, &c, &info(), &mut |e| {
        if let Event::Epoch { test_accuracy, .. } = e {
            accs.push(*test_accuracy)
        }
    })
    .unwrap();
    let best = (0..accs.len())
        .rev()
        .max_by(|&a, &b| accs[a].partial_cmp(&accs[b]).unwrap())
        .unwrap();
    let mut want = vec![format!("epoch-{:04}", best + 1), "epoch-0004".into()];
    want.sort();
    want.dedup();
    assert_eq!(names(t.path()), want, "accuracies {accs:?}");
    // Without keep_best only the newest stays.
    prune_checkpoints(t.path(), Some(1), false).unwrap();
    assert_eq!(names(t.path()), ["epoch-0004"]);
}

#[test]
fn a_stop_request_checkpoints_mid_epoch_and_the_resume_is_bit_identical() {
    let (tr, te) = loaders();
    let whole_dir = tmp();
    let mut whole = model();
    train(
        &mut whole,
        &tr,
        &te,
        &cfg(whole_dir.path(), 2),
        &info(),
        &mut |_| {},
    )
    .unwrap();

    let t = tmp();
    let stop = Arc::new(AtomicBool::new(false));
    let c = TrainConfig {
        stop: Some(stop.clone()),
        ..cfg(t.path(), 2)
    };
    let flag = stop.clone();
    let e = train(&mut model(), &tr, &te, &c, &info(), &mut |e| {
        // "Ctrl-C" during batch 4 of epoch 2: the loop stops before batch 5.
        if let Event::Batch {
            epoch: 2, batch: 4, ..
        } = e
        {
            flag.store(true, Ordering::SeqCst)
        }
    })
    .unwrap_err();
    assert!(matches!(e, Error::Interrupted(_)), "{e}");
    assert!(e.to_string().contains("epoch 2, batch 4"), "{e}");
    assert_eq!(names(t.path()), ["epoch-0001", "epoch-0002-batch-000004"]);
    let ck = load_checkpoint(t.path()).unwrap();
    assert_eq!((ck.progress.epochs_done, ck.progress.batches_done), (1, 4));

    let mut resumed = model();
    let mut first_batch = None;
    let mut losses = Vec::new();
    let r = TrainConfig {
        resume: true,
        ..cfg(t.path(), 2)
    };
    train(&mut resumed, &tr, &te, &r, &info(), &mut |e| match e {
        Event::Batch { batch, .. } => {
            first_batch.get_or_insert(*batch);
        }
        Event::Epoch { train_loss, .. } => losses.push(*train_loss),
        _ => {}
    })
    .unwrap();
    assert_eq!(first_batch, Some(5));
    assert_eq!(bits(&whole), bits(&resumed));
    let a = load_checkpoint(&whole_dir.path().join("epoch-0002")).unwrap();
    let b = load_checkpoint(&t.path().join("epoch-0002")).unwrap();
    assert_eq!(a.optimizer, b.optimizer);
    // The resumed epoch reports the same train loss as the uninterrupted one.
    assert_eq!(a.test_accuracy, b.test_accuracy);
    let whole_state = std::fs::read(whole_dir.path().join("epoch-0002/state.json")).unwrap();
    let cut_state = std::fs::read(t.path().join("epoch-0002/state.json")).unwrap();
    assert_eq!(whole_state, cut_state);
    assert_eq!(losses.len(), 1);
}

#[test]
fn resume_refuses_other_settings_unless_overridden() {
    let t = trained(1);
    let (tr, te) = loaders();
    let r = TrainConfig {
        resume: true,
        lr: 0.5,
        ..cfg(t.path(), 2)
    };
    let e = train(&mut model(), &tr, &te, &r, &info(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lr: checkpoint 0.01, now 0.5") && e.contains("epochs: checkpoint 1, now 2"),
        "{e}"
    );
    let other_data = RunInfo {
        train_len: 999,
        ..info()
    };
    let e = train(
        &mut model(),
        &tr,
        &te,
        &TrainConfig {
            overrides: vec!["epochs".into(), "lr".into()],
            ..r.clone()
        },
        &other_data,
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("train_len"), "{e}");
    let ok = TrainConfig {
        overrides: vec!["epochs".into(), "lr".into()],
        ..r
    };
    let mut lrs = Vec::new();
    train(&mut model(), &tr, &te, &ok, &info(), &mut |e| {
        if let Event::Log { lr, .. } = e {
            lrs.push(*lr)
        }
    })
    .unwrap();
    assert!(!lrs.is_empty() && lrs.iter().all(|&l| l == 0.5), "{lrs:?}");
}

#[test]
fn a_diverging_loss_scaled_run_stops_and_never_logs_a_zero_loss() {
    let (tr, te) = loaders();
    let c = TrainConfig {
        epochs: 3,
        lr: 1e4,
        log_every: 1,
        optimizer: hemi::train::OptimizerKind::Sgd,
        precision: hemi::amp::Precision::AmpFp16,
        ..Default::default()
    };
    let mut logged = Vec::new();
    let e = train(&mut model(), &tr, &te, &c, &info(), &mut |e| {
        if let Event::Log { loss, .. } = e {
            logged.push(*loss)
        }
    })
    .unwrap_err();
    assert!(matches!(e, Error::Diverged(_)), "{e}");
    assert!(!e.to_string().contains("F32"), "{e}");
    assert!(logged.iter().all(|&l| l != 0.0), "{logged:?}");
    assert!(logged.iter().any(|l| l.is_nan()), "{logged:?}");
}

#[test]
fn progress_names_sort_in_training_order() {
    let p = |e, b| {
        Progress {
            epochs_done: e,
            batches_done: b,
            ..Default::default()
        }
        .dir_name()
    };
    assert_eq!(p(3, 0), "epoch-0003");
    assert_eq!(p(3, 17), "epoch-0004-batch-000017");
    for n in ["epoch-0003", "epoch-0004-batch-000017"] {
        let (e, b) = Progress::parse_dir_name(n).unwrap();
        assert_eq!(p(e, b), n);
    }
    for bad in [
        "epoch-",
        "epoch-x",
        "epoch-0000-batch-000001",
        "epoch-1-batch-0",
        "x",
    ] {
        assert_eq!(Progress::parse_dir_name(bad), None, "{bad}");
    }
}

#[test]
fn a_held_checkpoint_directory_refuses_a_second_holder_and_its_stray_files_stay() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let held = lock_dir(&root).unwrap();
    assert_eq!(held.path(), root.join(LOCK_FILE));
    let text = std::fs::read_to_string(root.join(LOCK_FILE)).unwrap();
    assert!(
        text.contains(&format!("pid {} on host ", std::process::id())),
        "{text}"
    );
    // A second holder (another open file description, as another process has) is refused,
    // naming the holder.
    let err = lock_dir(&root).unwrap_err().to_string();
    assert!(
        err.contains("in use") && err.contains(&format!("pid {}", std::process::id())),
        "{err}"
    );
    // A training run into the held directory fails before touching it: the live save's
    // temporary stays.
    std::fs::create_dir(root.join(".tmp-epoch-0001-4242")).unwrap();
    let (tr, te) = loaders();
    let err = match train(&mut model(), &tr, &te, &cfg(&root, 1), &info(), &mut |_| {}) {
        Ok(_) => panic!("a held directory is refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("in use"), "{err}");
    assert!(
        root.join(".tmp-epoch-0001-4242").is_dir(),
        "a live temporary was removed"
    );
    // Released, the directory is free; the lock file stays and never blocks.
    drop(held);
    let again = lock_dir(&root).unwrap();
    drop(again);
    assert!(root.join(LOCK_FILE).is_file());
    // The lock file is not a stray temporary.
    assert!(remove_stray(&root)
        .unwrap()
        .iter()
        .all(|p| !p.ends_with(LOCK_FILE)));
    assert!(root.join(LOCK_FILE).is_file());
    assert!(!root.join(".tmp-epoch-0001-4242").exists());
}
