//! The model registry through the CLI: `hemi models` lists every model with its parameter
//! count, `--model` takes any of them (a ResNet trains and its checkpoint evaluates), and an
//! unknown name is an error naming it and the known ones (inputs a model cannot take are
//! covered by the registry's unit test).

use crate::common;
use common::{hemi, ok};

#[test]
fn models_lists_every_registered_model_with_torchvision_counts() {
    let t = tempfile::tempdir().unwrap();
    let out = ok(&hemi(t.path(), &["models", "--classes", "1000"]));
    for (name, params) in [
        ("cifar-net", None),
        ("mlp", None),
        ("resnet18", Some("11689512")),
        ("resnet34", Some("21797672")),
        ("resnet50", Some("25557032")),
        ("resnet20", None),
    ] {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing from:\n{out}"));
        if let Some(p) = params {
            assert!(line.contains(p), "{line}");
        }
    }
}

#[test]
fn a_resnet_trains_from_the_cli_and_its_checkpoint_evaluates() {
    let t = tempfile::tempdir().unwrap();
    let base = [
        "train",
        "--model",
        "resnet20",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "256",
        "--batch-size",
        "64",
        "--epochs",
        "1",
        "--threads",
        "1",
        "--workers",
        "1",
        "--precision",
        "amp-bf16",
        "--checkpoint-dir",
        "ck",
        "--metrics",
        "m.jsonl",
    ];
    let out = ok(&hemi(t.path(), &base));
    assert!(out.contains("resnet20 (269722 parameters)"), "{out}");
    // The model's default recipe, with the flags given overriding it.
    assert!(
        out.contains("recipe resnet-cifar: sgd lr 0.1 momentum 0.9, weight decay 0.0001")
            && out.contains("batch 64, 1 epochs, schedule cosine, augment true"),
        "{out}"
    );
    // eval normalises as the run did (CIFAR-10 mean/std, recorded in the checkpoint), so it
    // reproduces the run's test accuracy.
    let metrics = std::fs::read_to_string(t.path().join("m.jsonl")).unwrap();
    let epoch: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let acc = 100.0 * epoch["test_accuracy"].as_f64().unwrap();
    let ev = ok(&hemi(t.path(), &["eval", "--checkpoint", "ck"]));
    assert!(ev.contains(&format!("images: {acc:.2} %")), "{acc}\n{ev}");
}

#[test]
fn recipes_are_listed_and_flags_override_them() {
    let t = tempfile::tempdir().unwrap();
    let out = ok(&hemi(t.path(), &["models"]));
    for r in ["documents", "resnet-cifar", "resnet-imagenet"] {
        assert!(out.contains(r), "{r} missing from:\n{out}");
    }
    let run = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            "mlp",
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "64",
            "--epochs",
            "1",
            "--threads",
            "1",
            "--precision",
            "fp32",
        ];
        a.extend_from_slice(extra);
        hemi(t.path(), &a)
    };
    let out = ok(&run(&[
        "--recipe",
        "resnet-cifar",
        "--schedule",
        "step",
        "--milestones",
        "1",
        "--nesterov",
        "--no-decay-norm-bias",
        "--label-smoothing",
        "0.1",
        "--augment",
        "false",
    ]));
    assert!(
        out.contains("sgd lr 0.1 momentum 0.9 (nesterov), weight decay 0.0001 (not on biases")
            && out.contains("schedule step(milestones=1, gamma=0.1), label smoothing 0.1")
            && out.contains("augment false"),
        "{out}"
    );
    for (args, word) in [
        (&["--recipe", "fast"][..], "fast"),
        (&["--schedule", "triangle"][..], "triangle"),
        (&["--milestones", "3"][..], "--schedule step"),
        (&["--warmup-epochs", "2"][..], "warm-up"),
    ] {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(word), "{args:?}: {err}");
    }
}

#[test]
fn unknown_models_are_errors_naming_them_and_the_known_ones() {
    let t = tempfile::tempdir().unwrap();
    let o = hemi(
        t.path(),
        &["train", "--model", "resnet7", "--dataset", "synthetic"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("resnet7") && err.contains("resnet20"), "{err}");
}

#[test]
fn help_screens_are_grouped_and_read_as_a_users_sentences() {
    let t = tempfile::tempdir().unwrap();
    let top = ok(&hemi(t.path(), &["--help"]));
    let train_line = top
        .lines()
        .find(|l| l.trim_start().starts_with("train"))
        .unwrap_or_else(|| panic!("no train line:\n{top}"));
    assert!(
        !train_line.contains("boxed") && train_line.contains("Train a model"),
        "{train_line}"
    );
    assert!(
        top.contains("all-minilm-l6-v2"),
        "data fetch names the model:\n{top}"
    );
    let help = ok(&hemi(t.path(), &["train", "--help"]));
    let headings = [
        "Data:",
        "Model and recipe:",
        "Precision:",
        "Optimizer and schedule:",
        "Checkpoints:",
        "Observation:",
        "Distributed",
    ];
    let mut at = Vec::new();
    for h in headings {
        let i = help
            .lines()
            .position(|l| l.starts_with(h))
            .unwrap_or_else(|| panic!("no heading {h:?} in:\n{help}"));
        at.push(i);
    }
    // Each flag under the heading of its group.
    let under = |flag: &str| -> &str {
        let line = help
            .lines()
            .position(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("no {flag}"));
        // The nearest heading above the flag.
        let (k, _) = at
            .iter()
            .enumerate()
            .filter(|(_, &h)| h < line)
            .max_by_key(|(_, &h)| h)
            .expect("flag before any heading");
        headings[k]
    };
    assert_eq!(under("--data-dir"), "Data:");
    assert_eq!(under("--precision"), "Precision:");
    assert_eq!(under("--lr"), "Optimizer and schedule:");
    assert_eq!(under("--checkpoint-dir"), "Checkpoints:");
    assert_eq!(under("--tensorboard"), "Observation:");
    assert_eq!(under("--sync-bn"), "Distributed");
    assert_eq!(under("--model"), "Model and recipe:");
    // Every flag says what it does: a sentence on its line or on the next.
    let short = ok(&hemi(t.path(), &["train", "-h"]));
    let lines: Vec<&str> = short.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.trim_start().starts_with("--") || line.contains("--help") {
            continue;
        }
        let next = lines.get(i + 1).map_or("", |l| l.trim_start());
        let described = line.split_whitespace().count() >= 3
            || (!next.is_empty() && !next.starts_with('-') && next.split_whitespace().count() >= 3);
        assert!(described, "a flag without a description: {line:?}");
    }
}
