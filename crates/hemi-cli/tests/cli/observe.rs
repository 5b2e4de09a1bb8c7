//! Seeing a run: `hemi train --tensorboard DIR` writes event files whose values are the
//! run's (checked against its --metrics file), `--grad-stats` writes per-epoch log2
//! histograms, and `hemi plot` draws PNGs from metrics files; bad inputs are named errors.

use crate::common;
use common::{hemi, ok};
use std::path::Path;
use std::process::Output;

use hemi::io::tensorboard::read_events;
use serde_json::Value;

fn fails(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected a failure, got success");
    assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

fn train(dir: &Path, precision: &str, metrics: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "train",
        "--model",
        "mlp",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "256",
        "--batch-size",
        "64",
        "--epochs",
        "2",
        "--lr",
        "0.05",
        "--precision",
        precision,
        "--log-every",
        "1",
        "--quiet",
        "--grad-stats",
        "--metrics",
        metrics,
    ];
    args.extend_from_slice(extra);
    ok(&hemi(dir, &args))
}

fn lines(path: &Path, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .collect()
}

/// Every value of series `tag` as (step, value).
fn scalars(events: &[hemi::io::tensorboard::Event], tag: &str) -> Vec<(i64, f32)> {
    events
        .iter()
        .filter_map(|e| {
            let v = e.summary.as_ref()?.value.first()?;
            (v.tag == tag).then(|| (e.step, v.simple_value.expect("a scalar")))
        })
        .collect()
}

#[test]
fn tensorboard_events_hold_the_runs_values() {
    let t = tempfile::tempdir().unwrap();
    train(
        t.path(),
        "amp-fp16",
        "m.jsonl",
        &["--tensorboard", "tb", "--histogram-every", "3"],
    );
    let files: Vec<_> = std::fs::read_dir(t.path().join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = read_events(&files[0]).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    // 256 images in batches of 64: 4 steps an epoch, 8 in all, one point per step.
    let metrics = t.path().join("m.jsonl");
    let steps = lines(&metrics, "step");
    assert_eq!(steps.len(), 8);
    let loss = scalars(&events, "train/loss");
    assert_eq!(
        loss.iter().map(|p| p.0).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>()
    );
    for (s, (step, v)) in steps.iter().zip(&loss) {
        assert_eq!(s["global_step"].as_i64(), Some(*step));
        // One batch per log line: the logged mean is that step's loss.
        assert_eq!(*v, s["loss"].as_f64().unwrap() as f32, "step {step}");
    }
    let scale = scalars(&events, "train/loss_scale");
    assert_eq!(scale.len(), 8);
    assert_eq!(scale[7].1, steps[7]["scale"].as_f64().unwrap() as f32);
    assert_eq!(scalars(&events, "train/lr").len(), 8);
    assert_eq!(scalars(&events, "train/skipped_steps").len(), 8);
    let epochs = lines(&metrics, "epoch");
    let acc = scalars(&events, "epoch/test_accuracy");
    assert_eq!(acc.len(), 2);
    for (e, (step, v)) in epochs.iter().zip(&acc) {
        assert_eq!(*step, 4 * e["epoch"].as_i64().unwrap());
        assert_eq!(*v, e["test_accuracy"].as_f64().unwrap() as f32);
    }
    // Histograms of the 4 parameters and their gradients at steps 3 and 6, whole.
    let histos: Vec<_> = events
        .iter()
        .filter_map(|e| {
            let v = e.summary.as_ref()?.value.first()?;
            Some((e.step, v.tag.clone(), v.histo.clone()?))
        })
        .collect();
    assert_eq!(
        histos.len(),
        2 * 2 * 4,
        "{:?}",
        histos.iter().map(|h| &h.1).collect::<Vec<_>>()
    );
    for (step, tag, h) in &histos {
        assert!([3, 6].contains(step), "{tag} at {step}");
        let numel = if tag.ends_with("fc1.weight") {
            3 * 32 * 32 * 512
        } else if tag.ends_with("fc1.bias") {
            512
        } else if tag.ends_with("fc2.weight") {
            512 * 10
        } else {
            10
        };
        assert_eq!(h.num, numel as f64, "{tag}");
        assert_eq!(h.bucket.iter().sum::<f64>(), h.num, "{tag}");
    }
    // The per-epoch F16 loss share, unscaled and scaled.
    assert_eq!(scalars(&events, "grad_stats/f16_lost_unscaled").len(), 2);
    let lost = scalars(&events, "grad_stats/f16_lost_scaled");
    assert!(lost.iter().all(|p| (0.0..=1.0).contains(&p.1)), "{lost:?}");
}

#[test]
fn grad_stats_lines_count_every_gradient_value() {
    let t = tempfile::tempdir().unwrap();
    let out = train(t.path(), "amp-bf16", "m.jsonl", &[]);
    let recs = lines(&t.path().join("m.jsonl"), "grad_stats");
    assert_eq!(recs.len(), 2);
    for r in &recs {
        let layers = r["layers"].as_array().unwrap();
        let names: Vec<&str> = layers.iter().map(|l| l["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
        for l in layers {
            let counts: u64 = l["counts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_u64().unwrap())
                .sum();
            let all = counts + l["zeros"].as_u64().unwrap() + l["nonfinite"].as_u64().unwrap();
            assert_eq!(all, l["values"].as_u64().unwrap(), "{}", l["name"]);
            // The underflow count is the mass below 2^-24.
            let e_lo = l["e_lo"].as_i64().unwrap();
            let below: u64 = l["counts"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
                .filter(|(i, _)| e_lo + (*i as i64) < -24)
                .map(|(_, c)| c.as_u64().unwrap())
                .sum();
            assert_eq!(below, l["underflow"].as_u64().unwrap(), "{}", l["name"]);
        }
    }
    // The end-of-run table is the sum of the epochs'.
    assert!(out.contains("fc1.weight"), "{out}");
}

/// A chart decoded by hemi's own image decoder.
fn png(path: &Path) -> hemi::data::Image {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    hemi::data::parse_image(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (width, height) of a decoded image.
fn dimensions(img: &hemi::data::Image) -> (u32, u32) {
    let [_, h, w] = img.shape();
    (w as u32, h as u32)
}

/// How many pixels have colour `c`.
fn has_color(img: &hemi::data::Image, c: [u8; 3]) -> usize {
    let (r, g, b) = (img.plane(0), img.plane(1), img.plane(2));
    (0..r.len()).filter(|&i| [r[i], g[i], b[i]] == c).count()
}

#[test]
fn plot_draws_runs_overlaid_and_the_gradient_histogram() {
    let t = tempfile::tempdir().unwrap();
    train(t.path(), "fp32", "fp32.jsonl", &[]);
    train(t.path(), "amp-fp16", "amp.jsonl", &[]);
    let out = ok(&hemi(
        t.path(),
        &[
            "plot",
            "fp32.jsonl",
            "amp.jsonl",
            "--out",
            "plots",
            "--grad-run",
            "1",
        ],
    ));
    for f in ["curves.png", "scale.png", "grad_hist.png"] {
        assert!(out.contains(f), "{out}");
    }
    let curves = png(&t.path().join("plots/curves.png"));
    assert_eq!(dimensions(&curves), (1400, 560));
    // Both runs drawn, in their colours (first blue, second red).
    assert!(
        has_color(&curves, [31, 119, 180]) > 200,
        "first run missing"
    );
    assert!(
        has_color(&curves, [214, 39, 40]) > 200,
        "second run missing"
    );
    let scale = png(&t.path().join("plots/scale.png"));
    assert!(
        has_color(&scale, [214, 39, 40]) > 100,
        "the amp run's scale line"
    );
    let hist = png(&t.path().join("plots/grad_hist.png"));
    // 4 parameter rows under the main histogram; its bars are blue.
    assert_eq!(dimensions(&hist), (1400, 520 + 110 + 4 * 16));
    assert!(has_color(&hist, [31, 119, 180]) > 1000, "histogram bars");
    // Labels replace the file names.
    ok(&hemi(
        t.path(),
        &[
            "plot",
            "fp32.jsonl",
            "amp.jsonl",
            "--out",
            "p2",
            "--labels",
            "a,b",
            "--grad-epoch",
            "1",
        ],
    ));
    assert!(t.path().join("p2/grad_hist.png").exists());
}

#[test]
fn bad_plot_and_tensorboard_inputs_are_named_errors() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path();
    std::fs::write(
        p.join("bad.jsonl"),
        "{\"kind\":\"epoch\",\"epoch\":1}\nnot json\n",
    )
    .unwrap();
    fails(
        &hemi(p, &["plot", "bad.jsonl"]),
        "bad.jsonl, line 2: not JSON",
    );
    std::fs::write(p.join("empty.jsonl"), "\n").unwrap();
    fails(&hemi(p, &["plot", "empty.jsonl"]), "no metrics lines");
    fails(&hemi(p, &["plot", "missing.jsonl"]), "missing.jsonl");
    std::fs::write(
        p.join("one.jsonl"),
        "{\"kind\":\"epoch\",\"epoch\":1,\"train_loss\":2.0,\"test_accuracy\":0.1}\n",
    )
    .unwrap();
    fails(
        &hemi(p, &["plot", "one.jsonl", "--labels", "a,b"]),
        "--labels names 2 runs, but 1 files",
    );
    fails(
        &hemi(p, &["plot", "one.jsonl", "--grad-run", "0"]),
        "no gradient statistics",
    );
    fails(
        &hemi(p, &["plot", "one.jsonl", "--grad-run", "3"]),
        "there are 1 runs",
    );
    std::fs::write(p.join("afile"), "x").unwrap();
    fails(
        &hemi(
            p,
            &[
                "train",
                "--model",
                "mlp",
                "--synthetic-size",
                "64",
                "--tensorboard",
                "afile",
            ],
        ),
        "not a directory",
    );
}
