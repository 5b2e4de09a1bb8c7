//! The model registry through the CLI: `hemi models` lists every model with its parameter
//! count, `--model` takes any of them (a ResNet trains and its checkpoint evaluates), and an
//! unknown name is an error naming it and the known ones (inputs a model cannot take are
//! covered by the registry's unit test).

use std::process::{Command, Output};

fn hemi(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hemi"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run hemi")
}

fn ok(o: &Output) -> String {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    out
}

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
    ];
    let out = ok(&hemi(t.path(), &base));
    assert!(out.contains("resnet20 (269722 parameters)"), "{out}");
    let ev = ok(&hemi(t.path(), &["eval", "--checkpoint", "ck"]));
    assert!(ev.contains("Accuracy"), "{ev}");
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
