//! INT8 through the CLI: `hemi quantize` (static and dynamic) of a trained checkpoint writes
//! an INT8 file under a third of the float one that `hemi eval` runs to the accuracy
//! `quantize` reported; `hemi train --qat` fine-tunes with fake quantisation from a float
//! checkpoint; bad arguments and corrupt files are errors that name the problem.

use crate::common;
use common::{hemi, ok};
use serde_json::Value;

fn train(dir: &std::path::Path, model: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "train",
        "--model",
        model,
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "1024",
        "--synthetic-test-size",
        "400",
        "--batch-size",
        "64",
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
        "--threads",
        "1",
        "--workers",
        "1",
    ];
    if !extra.contains(&"--epochs") {
        args.extend_from_slice(&["--epochs", "3"]);
    }
    args.extend_from_slice(extra);
    ok(&hemi(dir, &args))
}

/// A copy in `dir/ck` of one CifarNet float checkpoint directory trained once per test
/// process (3 epochs, amp-fp16 Adam on 1024 synthetic images, 400 test images): the INT8 tests quantise it
/// and fine-tune from it, and each works in its own directory.
fn trained_cifar_net(dir: &std::path::Path) {
    static TRAINED: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let src = TRAINED.get_or_init(|| {
        let t = tempfile::tempdir().unwrap();
        train(t.path(), "cifar-net", &["--checkpoint-dir", "ck"]);
        t
    });
    copy_dir(&src.path().join("ck"), &dir.join("ck"));
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

fn summary(out: &str) -> Value {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("a JSON line");
    serde_json::from_str(line).unwrap()
}

/// `hemi quantize --checkpoint CK --out q --batch-size 64 --json` plus `args`: its JSON
/// summary and its output.
fn quantize(dir: &std::path::Path, ck: &str, args: &[&str]) -> (Value, String) {
    let mut all = vec![
        "quantize",
        "--checkpoint",
        ck,
        "--out",
        "q",
        "--batch-size",
        "64",
        "--json",
    ];
    all.extend_from_slice(args);
    let out = ok(&hemi(dir, &all));
    (summary(&out), out)
}

/// The float and INT8 test accuracies of a quantize summary.
fn accuracies(s: &Value) -> (f64, f64) {
    (
        s["float_accuracy"].as_f64().unwrap(),
        s["int8_accuracy"].as_f64().unwrap(),
    )
}

/// The accuracy `hemi eval` prints, in percent.
fn eval_accuracy(out: &str) -> f64 {
    let at = out
        .find("images:")
        .unwrap_or_else(|| panic!("no accuracy in:\n{out}"));
    let rest = &out[at..];
    let num: String = rest
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().unwrap()
}

#[test]
fn static_and_dynamic_int8_checkpoints_evaluate_as_quantize_reported() {
    let t = tempfile::tempdir().unwrap();
    trained_cifar_net(t.path());
    for (mode, observer) in [
        ("static", "minmax"),
        ("static", "percentile:99.9"),
        ("dynamic", "minmax"),
    ] {
        let (s, out) = quantize(
            t.path(),
            "ck",
            &[
                "--mode",
                mode,
                "--calib-batches",
                "3",
                "--observer",
                observer,
            ],
        );
        let (f, q) = accuracies(&s);
        // CifarNet: 4 layers static (conv1, conv2, fc1, fc2), its 2 Linear dynamic.
        assert_eq!(s["layers"], if mode == "static" { 4 } else { 2 }, "{out}");
        assert!(f > 0.3, "the float model learned nothing: {out}");
        assert!(
            (f - q).abs() < 0.05,
            "{mode}/{observer}: float {f} vs int8 {q}\n{out}"
        );
        let ratio = s["int8_bytes"].as_f64().unwrap() / s["float_bytes"].as_f64().unwrap();
        assert!(ratio <= 0.3, "INT8 file {ratio:.3} of the float one");
        // eval of the INT8 directory gives the accuracy quantize measured.
        let ev = ok(&hemi(
            t.path(),
            &["eval", "--checkpoint", "q", "--batch-size", "64"],
        ));
        assert!(ev.contains(&format!("{mode} INT8")), "{ev}");
        let got = eval_accuracy(ev.lines().last().unwrap());
        assert!(
            (got - 100.0 * q).abs() < 0.01,
            "eval {got} vs quantize {q}\n{ev}"
        );
    }
}

#[test]
fn qat_fine_tunes_a_float_checkpoint_and_quantizes() {
    let t = tempfile::tempdir().unwrap();
    trained_cifar_net(t.path());
    let out = train(
        t.path(),
        "cifar-net",
        &["--qat", "ck", "--epochs", "1", "--checkpoint-dir", "qat"],
    );
    assert!(out.to_lowercase().contains("qat"), "{out}");
    let (s, out) = quantize(
        t.path(),
        "qat",
        &["--mode", "static", "--calib-batches", "2"],
    );
    let (f, q) = accuracies(&s);
    assert!(f > 0.3 && (f - q).abs() < 0.05, "float {f} int8 {q}\n{out}");
}

#[test]
fn bad_quantize_arguments_and_corrupt_files_are_errors() {
    let t = tempfile::tempdir().unwrap();
    let fail = |args: &[&str], needle: &str| {
        let o = hemi(t.path(), args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
    };
    fail(
        &["quantize", "--checkpoint", "nowhere", "--out", "q"],
        "nowhere",
    );
    train(
        t.path(),
        "mlp",
        &["--epochs", "1", "--checkpoint-dir", "ck"],
    );
    fail(
        &[
            "quantize",
            "--checkpoint",
            "ck",
            "--out",
            "q",
            "--observer",
            "median",
        ],
        "median",
    );
    fail(
        &[
            "quantize",
            "--checkpoint",
            "ck",
            "--out",
            "q",
            "--calib-batches",
            "0",
            "--mode",
            "static",
        ],
        "calib-batches",
    );
    ok(&hemi(
        t.path(),
        &["quantize", "--checkpoint", "ck", "--out", "q", "--no-eval"],
    ));
    // Truncate the INT8 file: eval names it.
    let f = t.path().join("q/quantized.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    fail(&["eval", "--checkpoint", "q"], "quantized.safetensors");
}
