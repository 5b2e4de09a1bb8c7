//! `--checkpoint-activations` end to end: a ResNet-20 run with it trains to the same bits
//! as without (losses and test results of every epoch), records it in the checkpoint, and
//! resumes without it; a model without segments, or segments it does not have, are errors
//! naming them; `hemi bench train` reports the heap it saves.

use crate::common;
use common::{hemi, ok};

fn train(dir: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut a = vec![
        "train",
        "--model",
        "resnet20",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "128",
        "--batch-size",
        "32",
        "--epochs",
        "2",
        "--threads",
        "1",
        "--workers",
        "1",
        "--precision",
        "amp-bf16",
        "--log-every",
        "1",
    ];
    a.extend_from_slice(extra);
    hemi(dir, &a)
}

/// The metrics lines without their timings.
fn metrics(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.contains("per_s") && !k.contains("seconds") && !k.contains("time"));
            v.to_string()
        })
        .collect()
}

#[test]
fn a_checkpointed_run_is_the_plain_run_and_resumes_without_the_flag() {
    let t = tempfile::tempdir().unwrap();
    ok(&train(t.path(), &["--metrics", "plain.jsonl"]));
    // Epoch 1 checkpointed by stages, stopped, resumed for epoch 2 without the flag.
    let out = ok(&train(
        t.path(),
        &[
            "--metrics",
            "ckpt.jsonl",
            "--checkpoint-activations",
            "stages",
            "--checkpoint-dir",
            "ck",
            "--stop-after",
            "1",
        ],
    ));
    assert!(
        out.contains("activation checkpointing: resnet20 stages"),
        "{out}"
    );
    let state = std::fs::read_to_string(t.path().join("ck/epoch-0001/state.json")).unwrap();
    assert!(
        state.contains("\"checkpoint_activations\": \"stages\"")
            || state.contains("\"checkpoint_activations\":\"stages\""),
        "{state}"
    );
    ok(&train(
        t.path(),
        &[
            "--metrics",
            "ckpt.jsonl",
            "--checkpoint-dir",
            "ck",
            "--resume",
        ],
    ));
    let (a, b) = (
        metrics(&t.path().join("plain.jsonl")),
        metrics(&t.path().join("ckpt.jsonl")),
    );
    assert!(a.len() >= 10, "{a:?}");
    assert_eq!(a, b);
}

#[test]
fn checkpointing_a_model_without_segments_is_an_error_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let o = hemi(
        t.path(),
        &[
            "train",
            "--model",
            "cifar-net",
            "--dataset",
            "synthetic",
            "--checkpoint-activations",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("model cifar-net has no checkpointed segments")
            && err.contains("resnet20")
            && err.contains("bert-classifier"),
        "{err}"
    );
    let o = train(t.path(), &["--checkpoint-activations", "layers"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("model resnet20 checkpoints blocks or stages, not \"layers\""),
        "{err}"
    );
}

#[test]
fn bench_train_reports_the_heap_checkpointing_saves() {
    let t = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "bench",
            "train",
            "--model",
            "resnet20",
            "--precision",
            "fp32",
            "--batch-size",
            "16",
            "--steps",
            "1",
            "--threads",
            "1",
            "--json",
        ];
        a.extend_from_slice(extra);
        let out = ok(&hemi(t.path(), &a));
        let line = out
            .lines()
            .rfind(|l| l.starts_with('{'))
            .unwrap()
            .to_string();
        serde_json::from_str::<serde_json::Value>(&line).unwrap()
    };
    let plain = run(&[]);
    let ckpt = run(&["--checkpoint-activations"]);
    assert_eq!(plain["checkpoint_activations"], serde_json::Value::Null);
    assert_eq!(ckpt["checkpoint_activations"], "blocks");
    let kept = |v: &serde_json::Value| v["kept_heap_mib"].as_f64().unwrap();
    let peak = |v: &serde_json::Value| v["step_heap_mib"].as_f64().unwrap();
    // ResNet-20's blocks keep their inputs (and the last block's activations), 0.42x of what
    // the plain step keeps (7.8 of 18.5 MiB), and hold one block's activations in the
    // backward (13.0 of 19.4 MiB at the peak).
    assert!(kept(&ckpt) < 0.5 * kept(&plain), "{plain}\n{ckpt}");
    assert!(peak(&ckpt) < 0.75 * peak(&plain), "{plain}\n{ckpt}");
    assert_eq!(plain["loss"], ckpt["loss"]);
}
