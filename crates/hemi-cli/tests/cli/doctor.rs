//! The precision doctor from the command line: a diverging run names the op and module
//! where the overflow started (log and metrics), policy files are checked against the
//! model, and `hemi doctor` reports per module and writes JSON and a plot.

use crate::common;
use common::{hemi, ok};

use serde_json::Value;

const SMALL: [&str; 10] = [
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "256",
    "--batch-size",
    "64",
    "--quiet",
    "--epochs",
];

#[test]
fn a_diverging_half_run_names_the_op_and_module_where_it_overflowed() {
    let t = tempfile::tempdir().unwrap();
    let mut args = vec!["train"];
    args.extend(SMALL);
    args.extend([
        "1",
        "--precision",
        "pure-fp16",
        "--lr",
        "1000",
        "--metrics",
        "m.jsonl",
    ]);
    let o = hemi(t.path(), &args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run diverges");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("overflow: forward: `linear` in fc"), "{err}");
    let lines = std::fs::read_to_string(t.path().join("m.jsonl")).unwrap();
    let ov: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "overflow")
        .collect();
    assert_eq!(ov.len(), 1, "{lines}");
    let f = &ov[0]["forward"];
    assert_eq!(f["op"], "linear");
    assert!(f["module"].as_str().unwrap().starts_with("fc"), "{f}");
    assert_eq!(f["dtype"], "float16");
}

#[test]
fn policy_files_are_checked_and_a_run_with_one_records_it() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("bad.json"), r#"{"modules": {"fc3": "f32"}}"#).unwrap();
    std::fs::write(t.path().join("empty.json"), r#"{"modules": {}}"#).unwrap();
    std::fs::write(t.path().join("p.json"), r#"{"modules": {"fc1": "f32"}}"#).unwrap();
    let run = |policy: &str, ck: &str| {
        let mut args = vec!["train"];
        args.extend(SMALL);
        args.extend(["1", "--policy", policy, "--checkpoint-dir", ck]);
        hemi(t.path(), &args)
    };
    let o = run("bad.json", "ck0");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("\"fc3\"") && err.contains("nearest: fc"),
        "{err}"
    );
    let o = run("empty.json", "ck1");
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("pins nothing"));
    ok(&run("p.json", "ck2"));
    let ck = hemi::train::load_checkpoint(&t.path().join("ck2")).unwrap();
    assert!(
        ck.info
            .settings
            .get("policy")
            .is_some_and(|p| p.contains("fc1")),
        "{:?}",
        ck.info.settings
    );
    let o = run("missing.json", "ck3");
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing.json"));
}

#[test]
fn hemi_doctor_reports_per_module_and_writes_json_and_a_plot() {
    let t = tempfile::tempdir().unwrap();
    let mut args = vec!["doctor"];
    args.extend(SMALL);
    args.extend(["1", "--steps", "3", "--json", "d.json", "--plot", "d.png"]);
    let out = ok(&hemi(t.path(), &args));
    assert!(
        out.contains("precision doctor: amp-fp16 against fp32 over 3 steps"),
        "{out}"
    );
    assert!(out.contains("fc1") && out.contains("fc2"), "{out}");
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("d.json")).unwrap()).unwrap();
    assert_eq!(j["kind"], "doctor");
    let mods = j["modules"].as_array().unwrap();
    let fc1 = mods.iter().find(|m| m["module"] == "fc1").unwrap();
    let e = fc1["act_rel_err"].as_f64().unwrap();
    // F16 activations: a few F16 ulps (2^-11) of relative error, not zero.
    assert!(e > 1e-5 && e < 3e-3, "{e}");
    assert!(std::fs::metadata(t.path().join("d.png")).unwrap().len() > 1000);
    let mut bad = vec!["doctor"];
    bad.extend(SMALL);
    bad.extend(["1", "--steps", "0"]);
    let o = hemi(t.path(), &bad);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--steps"));
}

#[test]
fn the_search_never_pins_every_parameter() {
    // With a tolerance no policy reaches, forward selection goes on until only sets that
    // would put every parameter in F32 remain: plain FP32, which under pure-fp16 leaves the
    // optimizer no half weight (it used to end the search with that error).
    let t = tempfile::tempdir().unwrap();
    let mut args = vec!["doctor"];
    args.extend(SMALL);
    args.extend([
        "1",
        "--precision",
        "pure-fp16",
        "--steps",
        "4",
        "--search",
        "--tolerance",
        "0",
        "--write-policy",
        "p.json",
        "--json",
        "d.json",
    ]);
    let out = ok(&hemi(t.path(), &args));
    assert!(out.contains("would pin all the parameters"), "{out}");
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("d.json")).unwrap()).unwrap();
    let steps = j["search"]["steps"].as_array().unwrap();
    assert!(!steps.is_empty(), "{j}");
    for s in steps {
        let pinned = s["pinned"].as_array().unwrap().len() + s["added"].as_array().unwrap().len();
        assert!(pinned < 2, "a trial pinned both of the MLP's layers: {s}");
    }
}
