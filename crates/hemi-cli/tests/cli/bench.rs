//! The kernel benchmarks through the CLI: every pass of `hemi bench conv` and `hemi bench
//! pool` runs more than once (the backward passes reuse one graph built outside the timing)
//! and reports a positive time for each dtype. Tiny sizes, so this checks that the
//! benchmarks run, not how fast.

use crate::common;
use common::{hemi, ok};

/// `hemi bench KIND --batch-size 2 --reps 3 --json ARGS`, its JSON lines parsed.
fn bench_rows(kind: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let t = tempfile::tempdir().unwrap();
    let base = ["bench", kind, "--batch-size", "2", "--reps", "3", "--json"];
    let all: Vec<&str> = base.iter().chain(args).copied().collect();
    let out = ok(&hemi(t.path(), &all));
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Each (pass, dtype) pair exactly once, with a positive, finite median.
fn check(rows: &[serde_json::Value], passes: &[&str]) {
    assert_eq!(rows.len(), passes.len() * 3, "{rows:?}");
    for pass in passes {
        for dt in ["float32", "float16", "bfloat16"] {
            let r = rows
                .iter()
                .find(|r| r["pass"] == *pass && r["dtype"] == dt)
                .unwrap_or_else(|| panic!("no {pass} {dt} in {rows:?}"));
            let s = r["median_s"].as_f64().unwrap();
            assert!(s.is_finite() && s > 0.0, "{r}");
        }
    }
}

#[test]
fn conv_bench_times_every_pass_repeatedly() {
    let rows = bench_rows("conv", &["--layers", "resnet20-64"]);
    check(&rows, &["forward", "backward-input", "backward-weight"]);
    assert!(rows.iter().all(|r| r["layer"] == "resnet20-64"), "{rows:?}");
    assert_eq!(rows[0]["input"], serde_json::json!([2, 64, 8, 8]));
}

#[test]
fn pool_bench_times_forward_and_backward_repeatedly() {
    let rows = bench_rows("pool", &[]);
    assert_eq!(rows.len() % 6, 0, "{rows:?}");
    for chunk in rows.chunks(6) {
        check(chunk, &["forward", "backward"]);
    }
}

/// `--cpu-level` caps the kernels every product may take, and the benchmark records the
/// configuration it ran under; a level that does not exist is an error naming the levels.
#[test]
fn cpu_level_caps_the_kernels_and_is_recorded() {
    let t = tempfile::tempdir().unwrap();
    let kernels = |level: &str| -> Vec<(String, String)> {
        let out = ok(&hemi(
            t.path(),
            &[
                "bench",
                "matmul",
                "--sizes",
                "64",
                "--reps",
                "1",
                "--json",
                "--cpu-level",
                level,
            ],
        ));
        out.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|r| {
                assert_eq!(r["cpu"]["level"], level, "{r}");
                (
                    r["dtype"].as_str().unwrap().to_string(),
                    r["kernel"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    // The plain-Rust twins only.
    for (dtype, k) in kernels("portable") {
        assert!(
            k == "gemm" || k.starts_with("portable"),
            "{dtype}: {k} at the portable level"
        );
    }
    // At most AVX2: no AVX-512 or AMX kernel, whatever this CPU has.
    for (dtype, k) in kernels("avx2") {
        assert!(
            !k.contains("avx512") && !k.contains("amx"),
            "{dtype}: {k} at the avx2 level"
        );
    }
    let o = hemi(t.path(), &["--cpu-level", "sse9", "models"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("sse9") && err.contains("avx2"), "{err}");
}

/// `hemi bench train` records the device it ran on (`--device`, the CPU by default, with no
/// adapter); a device that does not parse, and a GPU in a build without the `gpu` feature,
/// are errors naming the device and the fix, not panics.
#[test]
fn train_bench_records_its_device_and_refuses_bad_ones() {
    let t = tempfile::tempdir().unwrap();
    let base = [
        "bench",
        "train",
        "--model",
        "mlp",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--json",
    ];
    let run = |extra: &[&str]| {
        let all: Vec<&str> = base.iter().chain(extra).copied().collect();
        hemi(t.path(), &all)
    };
    let out = ok(&run(&["--device", "cpu"]));
    let row: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(
        (&row["device"], &row["adapter"]),
        (&"cpu".into(), &serde_json::Value::Null)
    );
    assert!(row["images_per_s"].as_f64().unwrap() > 0.0, "{row}");

    let bad = run(&["--device", "tpu:0"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("tpu:0") && err.contains("gpu:N"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    if !cfg!(feature = "gpu") {
        let gpu = run(&["--device", "gpu"]);
        let err = String::from_utf8_lossy(&gpu.stderr);
        assert!(
            !gpu.status.success() && err.contains("--features gpu"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}
