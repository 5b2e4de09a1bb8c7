//! The bad-input suite of `hemi train` / `hemi eval` / `hemi bench`: every case is run
//! through the real binary and must end in an error that names the file or setting and the
//! problem (never a panic or a signal), with nothing on disk lost.
//!
//! Runs use the built-in synthetic set at a few hundred images, one thread, so each takes
//! a second or two.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use sha2::{Digest, Sha256};

/// The binary under test: this build's, or `HEMI_BIN` (to show which cases an older build
/// fails).
fn hemi_bin() -> String {
    std::env::var("HEMI_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_hemi").to_string())
}

fn hemi_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(hemi_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run hemi")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Asserts the run failed with exit status 1 (an error, not a panic's 101 or a signal) and
/// that stderr mentions every one of `needles`; returns stderr.
fn fails_with(o: &Output, needles: &[&str]) -> String {
    let (out, err) = text(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "expected an error exit\nstdout:\n{out}\nstderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "a panic:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    err
}

fn succeeds(o: &Output) -> String {
    let (out, err) = text(o);
    assert!(
        o.status.success(),
        "expected success\nstdout:\n{out}\nstderr:\n{err}"
    );
    out
}

/// A small, fast training run on the synthetic set (256 training and 200 test images).
fn small(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "256",
        "--synthetic-test-size",
        "200",
        "--batch-size",
        "64",
        "--log-every",
        "2",
        "--threads",
        "1",
        "--workers",
        "1",
        "--epochs",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Later flags win in clap only for repeated options it allows; replace instead.
    let mut i = 0;
    while i < extra.len() {
        let flag = extra[i];
        let takes_value = i + 1 < extra.len() && !extra[i + 1].starts_with("--");
        if let Some(p) = v.iter().position(|x| x == flag) {
            if takes_value {
                v[p + 1] = extra[i + 1].to_string();
            }
        } else {
            v.push(flag.to_string());
            if takes_value {
                v.push(extra[i + 1].to_string());
            }
        }
        i += if takes_value { 2 } else { 1 };
    }
    v
}

fn run(dir: &Path, extra: &[&str]) -> Output {
    let args = small(extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    hemi_in(dir, &refs)
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Rewrites `state.json` of checkpoint `ck` through `edit` and fixes the manifest, as a
/// crafted (not merely damaged) checkpoint would be.
fn craft_state(ck: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_slice(&read(&ck.join("state.json"))).unwrap();
    edit(&mut v);
    let bytes = v.to_string().into_bytes();
    std::fs::write(ck.join("state.json"), &bytes).unwrap();
    let mut m: serde_json::Value =
        serde_json::from_slice(&read(&ck.join("MANIFEST.json"))).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["name"] == "state.json" {
            f["size"] = bytes.len().into();
            f["sha256"] = sha_hex(&bytes).into();
        }
    }
    std::fs::write(ck.join("MANIFEST.json"), m.to_string()).unwrap();
}

fn dirs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".hemi-lock")
        .collect();
    v.sort();
    v
}

#[test]
fn a_killed_save_never_mixes_epochs_and_its_leftovers_are_removed() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let ck = t.path().join("ck");
    let good = read(&ck.join("epoch-0001/model.safetensors"));
    // What a SIGKILL in the middle of saving epoch 2 leaves: a temporary directory holding
    // some files of the new epoch but no manifest, and an old-style temporary file.
    let partial = ck.join(".tmp-epoch-0002-4242");
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("model.safetensors"), b"half of a file").unwrap();
    std::fs::write(ck.join(".model.safetensors.tmp4242"), vec![0u8; 1000]).unwrap();
    let out = succeeds(&hemi_in(t.path(), &["eval", "--checkpoint", "ck"]));
    assert!(out.contains("after epoch 1"), "{out}");
    // Resuming continues from epoch 1 and removes the leftovers.
    let o = run(
        t.path(),
        &[
            "--checkpoint-dir",
            "ck",
            "--resume",
            "--epochs",
            "2",
            "--override",
            "epochs",
        ],
    );
    let out = succeeds(&o);
    assert!(out.contains("resuming at epoch 2"), "{out}");
    assert_eq!(dirs(&ck), ["epoch-0001", "epoch-0002"]);
    assert_eq!(read(&ck.join("epoch-0001/model.safetensors")), good);
}

#[test]
fn a_damaged_checkpoint_is_refused_naming_the_file() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let model = t.path().join("ck/epoch-0001/model.safetensors");
    let bytes = read(&model);
    // Truncated (a full disk, a copy that stopped).
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck"]),
        &["model.safetensors", "manifest"],
    );
    // Same size, one byte changed.
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 1;
    std::fs::write(&model, &flipped).unwrap();
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck"]),
        &["model.safetensors", "SHA-256"],
    );
    // Resume refuses it too, and leaves it where it is.
    fails_with(
        &run(t.path(), &["--checkpoint-dir", "ck", "--resume"]),
        &["model.safetensors"],
    );
    assert_eq!(read(&model), flipped);
    // No manifest: not a complete checkpoint.
    std::fs::remove_file(t.path().join("ck/epoch-0001/MANIFEST.json")).unwrap();
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck/epoch-0001"]),
        &["MANIFEST.json", "missing"],
    );
}

#[test]
fn a_crafted_state_file_is_refused_before_allocating() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let ck = t.path().join("ck/epoch-0001");
    let orig = read(&ck.join("state.json"));
    let manifest = read(&ck.join("MANIFEST.json"));
    let restore = || {
        std::fs::write(ck.join("state.json"), &orig).unwrap();
        std::fs::write(ck.join("MANIFEST.json"), &manifest).unwrap();
    };
    craft_state(&ck, |v| v["run"]["classes"] = 1_000_000_000_000u64.into());
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck"]),
        &["state.json", "classes", "out of range"],
    );
    restore();
    craft_state(&ck, |v| {
        v["run"]["input_shape"] = serde_json::json!([3, 4294967296u64, 4294967296u64])
    });
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck"]),
        &["state.json", "input_shape"],
    );
    restore();
    craft_state(&ck, |v| v["epochs_done"] = u64::MAX.into());
    fails_with(
        &run(t.path(), &["--checkpoint-dir", "ck", "--resume"]),
        &["state.json", "epochs_done"],
    );
    restore();
    craft_state(&ck, |v| v["format"] = "hemi-checkpoint-9".into());
    fails_with(
        &hemi_in(t.path(), &["eval", "--checkpoint", "ck"]),
        &["state.json", "format"],
    );
}

#[test]
fn a_new_run_never_overwrites_an_existing_checkpoint() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let before = read(&t.path().join("ck/epoch-0001/model.safetensors"));
    fails_with(
        &run(t.path(), &["--checkpoint-dir", "ck", "--seed", "7"]),
        &["ck", "already holds checkpoints", "--resume"],
    );
    assert_eq!(
        read(&t.path().join("ck/epoch-0001/model.safetensors")),
        before
    );
}

#[test]
fn resume_lists_changed_settings_and_takes_only_overridden_ones() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let base = ["--checkpoint-dir", "ck", "--resume", "--epochs", "2"];
    fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [base, more].concat()
    }
    let e = fails_with(
        &run(t.path(), &with(&base, &["--lr", "0.5"])),
        &["lr: checkpoint 0.001, now 0.5", "epochs", "--override"],
    );
    assert!(!e.contains("batch_size"), "{e}");
    // Another data set (here: another size of the synthetic one) is named too.
    fails_with(
        &run(
            t.path(),
            &with(&base, &["--synthetic-size", "320", "--override", "epochs"]),
        ),
        &["train_len", "synthetic_size"],
    );
    // The model and the precision cannot be overridden.
    fails_with(
        &run(
            t.path(),
            &with(
                &base,
                &["--precision", "fp32", "--override", "epochs,precision"],
            ),
        ),
        &["precision"],
    );
    fails_with(
        &run(t.path(), &with(&base, &["--override", "epochs,colour"])),
        &["colour", "no such setting"],
    );
    // Overridden: the run uses the new learning rate (the optimizer's saved one is replaced).
    succeeds(&run(
        t.path(),
        &with(&base, &["--lr", "0.5", "--override", "epochs,lr"]),
    ));
    let ck = hemi::train::load_checkpoint(&t.path().join("ck")).unwrap();
    assert_eq!(ck.epochs_done, 2);
    assert_eq!(ck.optimizer.scalar("lr"), Some(0.5));
    assert_eq!(ck.info.settings["lr"], "0.5");
}

#[test]
fn metrics_survive_a_failed_resume_and_a_resume_appends() {
    let t = tmp();
    let m = t.path().join("m.jsonl");
    let ms = m.to_str().unwrap();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck", "--metrics", ms]));
    let first = read(&m);
    let n = first.iter().filter(|&&b| b == b'\n').count();
    assert!(n >= 3, "{}", String::from_utf8_lossy(&first));
    // A resume that fails its checks leaves the file as it was.
    fails_with(
        &run(
            t.path(),
            &[
                "--checkpoint-dir",
                "ck",
                "--resume",
                "--metrics",
                ms,
                "--lr",
                "0.7",
            ],
        ),
        &["lr"],
    );
    assert_eq!(read(&m), first);
    // A new run that is refused does not touch it either.
    fails_with(
        &run(t.path(), &["--checkpoint-dir", "ck", "--metrics", ms]),
        &["already holds"],
    );
    assert_eq!(read(&m), first);
    // A successful resume appends.
    succeeds(&run(
        t.path(),
        &[
            "--checkpoint-dir",
            "ck",
            "--resume",
            "--metrics",
            ms,
            "--epochs",
            "2",
            "--override",
            "epochs",
        ],
    ));
    let after = read(&m);
    assert!(after.starts_with(&first) && after.len() > first.len());
}

#[test]
fn a_metrics_write_error_names_the_file() {
    let t = tmp();
    fails_with(
        &run(t.path(), &["--metrics", "/dev/full"]),
        &["metrics file /dev/full", "No space left"],
    );
    std::fs::create_dir(t.path().join("m")).unwrap();
    fails_with(&run(t.path(), &["--metrics", "m"]), &["m", "directory"]);
}

#[test]
fn log_lines_reach_stdout_when_it_is_not_a_terminal() {
    let t = tmp();
    let out = succeeds(&run(t.path(), &[]));
    assert!(out.contains("[1,     2] loss: "), "{out}");
    assert!(out.contains("[1,     4] loss: "), "{out}");
    assert!(
        out.contains("Accuracy of the network on the 200 test images"),
        "{out}"
    );
}

#[test]
fn bad_setups_fail_before_the_first_step() {
    let t = tmp();
    let e = fails_with(&run(t.path(), &["--epochs", "0"]), &["epochs"]);
    assert!(!e.contains("NaN"), "{e}");
    std::fs::write(t.path().join("file"), b"x").unwrap();
    for bad in ["file", "file/sub"] {
        let o = run(t.path(), &["--checkpoint-dir", bad]);
        fails_with(&o, &[bad]);
        assert!(!text(&o).0.contains("[1,"), "trained before failing");
    }
    fails_with(&run(t.path(), &["--resume"]), &["--resume", "checkpoint"]);
    fails_with(
        &run(t.path(), &["--override", "lr"]),
        &["--override", "--resume"],
    );
    fails_with(
        &run(t.path(), &["--checkpoint-dir", "k", "--keep", "0"]),
        &["keep"],
    );
}

#[test]
fn huge_sizes_are_errors_not_crashes() {
    let t = tmp();
    fails_with(
        &hemi_in(t.path(), &["bench", "matmul", "--sizes", "4294967296"]),
        &["4294967296"],
    );
    fails_with(
        &run(t.path(), &["--synthetic-size", "18446744073709551615"]),
        &["--synthetic-size", "18446744073709551615"],
    );
    fails_with(
        &run(t.path(), &["--synthetic-size", "0"]),
        &["--synthetic-size"],
    );
    fails_with(&run(t.path(), &["--batch-size", "0"]), &["batch"]);
}

#[test]
fn a_diverged_run_fails_loudly_and_never_prints_a_zero_loss() {
    let t = tmp();
    let o = run(t.path(), &["--lr", "1000", "--synthetic-size", "1024"]);
    let e = fails_with(&o, &["diverged", "loss scale"]);
    let out = text(&o).0;
    assert!(!out.contains("loss: 0.000"), "{out}");
    assert!(!e.contains("F32"), "advice for amp-fp16: {e}");
    // fp32 has no scaler: the first non-finite loss stops it, and it is not told to use F32.
    let o = run(
        t.path(),
        &[
            "--lr",
            "1000",
            "--synthetic-size",
            "1024",
            "--precision",
            "fp32",
        ],
    );
    let e = fails_with(&o, &["diverged"]);
    assert!(!e.contains("F32"), "{e}");
}

/// Writes a PNG of `w`×`h` pixels in colour `c`.
fn png(path: &Path, w: u32, h: u32, c: u8) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let pixels: Vec<u8> = (0..w * h).flat_map(|_| [c, 255 - c, c / 2]).collect();
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut e = png::Encoder::new(file, w, h);
    e.set_color(png::ColorType::Rgb);
    e.set_depth(png::BitDepth::Eight);
    let mut writer = e.write_header().unwrap();
    writer.write_image_data(&pixels).unwrap();
    writer.finish().unwrap();
}

/// An image folder data set under `root/data`: `train/` and `test/` with the given classes,
/// three 8×8 images each.
fn folders(root: &Path, train: &[&str], test: &[&str]) {
    for (split, classes) in [("train", train), ("test", test)] {
        for (k, c) in classes.iter().enumerate() {
            for i in 0..3u8 {
                png(
                    &root.join(format!("data/{split}/{c}/{i}.png")),
                    8,
                    8,
                    40 * k as u8 + i,
                );
            }
        }
    }
}

fn folder_run(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "--dataset",
        "image-folder",
        "--data-dir",
        "data",
        "--model",
        "mlp",
        "--batch-size",
        "4",
    ];
    args.extend_from_slice(extra);
    run(dir, &args)
}

#[test]
fn train_and_test_classes_must_match() {
    let t = tmp();
    folders(t.path(), &["cat", "dog", "emu"], &["cat", "dog"]);
    fails_with(
        &folder_run(t.path(), &[]),
        &["data/train", "data/test", "only in train: emu"],
    );
    let t = tmp();
    folders(t.path(), &["cat", "dog"], &["cat", "dog", "emu"]);
    fails_with(&folder_run(t.path(), &[]), &["only in test: emu"]);
    // An image of another size in the test set is named before training starts.
    let t = tmp();
    folders(t.path(), &["cat", "dog"], &["cat", "dog"]);
    png(&t.path().join("data/test/dog/odd.png"), 9, 8, 7);
    let o = folder_run(t.path(), &[]);
    fails_with(&o, &["odd.png"]);
    assert!(!text(&o).0.contains("[1,"), "trained before failing");
}

#[test]
fn eval_checks_classes_and_works_from_another_directory() {
    let t = tmp();
    folders(t.path(), &["cat", "dog", "emu"], &["cat", "dog", "emu"]);
    succeeds(&folder_run(t.path(), &["--checkpoint-dir", "ck"]));
    let ck = t.path().join("ck");
    // The data directory was given relative to the training run's directory; eval from
    // elsewhere still finds it.
    let out = succeeds(&hemi_in(
        Path::new("/"),
        &["eval", "--checkpoint", ck.to_str().unwrap()],
    ));
    assert!(out.contains("test images"), "{out}");
    // A test set that lost a class would shift every label: refused.
    std::fs::remove_dir_all(t.path().join("data/test/dog")).unwrap();
    fails_with(
        &hemi_in(
            Path::new("/"),
            &["eval", "--checkpoint", ck.to_str().unwrap()],
        ),
        &["classes", "dog"],
    );
}

#[test]
fn keep_prunes_old_checkpoints_and_keep_best_keeps_the_best() {
    let t = tmp();
    succeeds(&run(
        t.path(),
        &["--checkpoint-dir", "ck", "--epochs", "3", "--keep", "1"],
    ));
    assert_eq!(dirs(&t.path().join("ck")), ["epoch-0003"]);
    let m = t.path().join("m.jsonl");
    succeeds(&run(
        t.path(),
        &[
            "--checkpoint-dir",
            "kb",
            "--epochs",
            "3",
            "--keep",
            "1",
            "--keep-best",
            "--metrics",
            path_str(&m),
        ],
    ));
    // The best epoch by the metrics' test accuracy (ties: the later one).
    let text = String::from_utf8(read(&m)).unwrap();
    let mut best = (0, -1.0);
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["kind"] == "epoch" {
            let a = v["test_accuracy"].as_f64().unwrap();
            if a >= best.1 {
                best = (v["epoch"].as_u64().unwrap(), a);
            }
        }
    }
    let mut want = vec![format!("epoch-{:04}", best.0), "epoch-0003".to_string()];
    want.sort();
    want.dedup();
    assert_eq!(dirs(&t.path().join("kb")), want, "best {best:?}");
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The first SIGINT stops at a step boundary with a mid-epoch checkpoint and status 130;
/// the resumed run ends with the same bytes as an uninterrupted one.
#[test]
fn ctrl_c_writes_a_mid_epoch_checkpoint_and_the_resume_is_bit_identical() {
    let t = tmp();
    let args = [
        "--synthetic-size",
        "640",
        "--epochs",
        "2",
        "--checkpoint-dir",
    ];
    let whole = t.path().join("whole");
    succeeds(&run(t.path(), &[&args[..], &[path_str(&whole)]].concat()));
    let cut = t.path().join("cut");
    let full = small(&[&args[..], &[path_str(&cut)]].concat());
    let mut child = Command::new(hemi_bin())
        .args(&full)
        .current_dir(t.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    // Stop in the middle of epoch 2, after its second log line.
    for line in lines.by_ref() {
        if line.unwrap().starts_with("[2,     4]") {
            break;
        }
    }
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(130), "{err}\n{rest:?}");
    assert!(
        err.contains("interrupted") && err.contains("--resume"),
        "{err}"
    );
    let partial: Vec<String> = dirs(&cut)
        .into_iter()
        .filter(|d| d.starts_with("epoch-0002-batch-"))
        .collect();
    assert_eq!(partial.len(), 1, "{:?}", dirs(&cut));
    let resumed = run(
        t.path(),
        &[&args[..], &[path_str(&cut), "--resume"]].concat(),
    );
    // The banner names the batch the run continues after (the checkpoint's name has it).
    let after: usize = partial[0]["epoch-0002-batch-".len()..].parse().unwrap();
    assert!(
        succeeds(&resumed).contains(&format!("resuming at epoch 2 of 2, after batch {after} of"))
    );
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            read(&whole.join("epoch-0002").join(f)) == read(&cut.join("epoch-0002").join(f)),
            "{f} differs from the uninterrupted run's"
        );
    }
}

#[test]
fn a_partial_cifar10_copy_is_named_not_replaced_by_synthetic_data() {
    let t = tmp();
    let d = t.path().join("data");
    std::fs::create_dir(&d).unwrap();
    for i in 1..=5 {
        std::fs::write(d.join(format!("data_batch_{i}.bin")), [0u8; 3073]).unwrap();
    }
    // `auto` (the default) with test_batch.bin missing.
    let args = ["train", "--data-dir", "data", "--epochs", "1"];
    let o = hemi_in(t.path(), &args);
    let e = fails_with(&o, &["test_batch.bin"]);
    assert!(!text(&o).0.contains("synthetic"), "{e}");
}

/// A run's checkpoint does not depend on the thread count, so a run resumed with another
/// `--threads` is still bit-identical.
#[test]
fn checkpoints_are_identical_for_1_2_and_3_threads() {
    let t = tmp();
    let mut first: Option<Vec<u8>> = None;
    for n in ["1", "2", "3"] {
        let ck = format!("ck{n}");
        succeeds(&run(
            t.path(),
            &["--threads", n, "--checkpoint-dir", &ck, "--epochs", "2"],
        ));
        let bytes = [
            read(&t.path().join(&ck).join("epoch-0002/model.safetensors")),
            read(&t.path().join(&ck).join("epoch-0002/optimizer.safetensors")),
        ]
        .concat();
        match &first {
            None => first = Some(bytes),
            Some(f) => assert!(*f == bytes, "--threads {n} gave other weights"),
        }
    }
}

/// Two Ctrl-Cs in quick succession (the second may abort the first one's save, or the
/// kernel may merge them into one): status 130 either way, nothing half-written carries a
/// final name, and `--resume` continues from the newest complete checkpoint.
#[test]
fn two_quick_ctrl_cs_leave_a_resumable_directory() {
    let t = tmp();
    let ck = t.path().join("ck");
    let args = [
        "--synthetic-size",
        "640",
        "--epochs",
        "2",
        "--checkpoint-dir",
        path_str(&ck),
    ];
    let full = small(&args);
    let mut child = Command::new(hemi_bin())
        .args(&full)
        .current_dir(t.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().starts_with("[2,     2]") {
            break;
        }
    }
    let pid = child.id().to_string();
    let st = Command::new("sh")
        .args(["-c", &format!("kill -INT {pid}; kill -INT {pid}")])
        .status()
        .unwrap();
    assert!(st.success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(130), "{err}\n{rest:?}");
    // Epoch 1 was saved before the signals; whatever else is there is complete or hidden.
    let names = dirs(&ck);
    assert!(names.iter().any(|d| d == "epoch-0001"), "{names:?}");
    for d in names.iter().filter(|d| d.starts_with("epoch-")) {
        assert!(
            ck.join(d).join("MANIFEST.json").is_file(),
            "{d} has a final name but no manifest: {names:?}"
        );
    }
    let resumed = run(t.path(), &[&args[..], &["--resume"]].concat());
    assert!(succeeds(&resumed).contains("resuming at epoch 2"));
    assert!(
        dirs(&ck).iter().any(|d| d == "epoch-0002"),
        "{:?}",
        dirs(&ck)
    );
}

/// A build without MPI support started by `mpirun` would train N unrelated copies.
#[cfg(not(feature = "mpi"))]
#[test]
fn an_mpi_launch_of_a_build_without_mpi_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_hemi"))
        .args(["train", "--dataset", "synthetic", "--epochs", "1"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("2 ranks") && err.contains("--features mpi"),
        "{err}"
    );
}

/// The lock file a run holds in its checkpoint directory (see `train::checkpoint::lock_dir`).
const LOCK: &str = ".hemi-lock";

/// A longer run (5 epochs of 512 images) in the background, holding `ck` while it trains.
fn spawn_run(dir: &Path, ck: &str, seed: &str) -> std::process::Child {
    let args = small(&[
        "--synthetic-size",
        "512",
        "--epochs",
        "5",
        "--checkpoint-dir",
        ck,
        "--seed",
        seed,
        "--quiet",
    ]);
    Command::new(hemi_bin())
        .args(&args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start hemi")
}

fn seed_of(ck: &Path) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(&read(&ck.join("state.json"))).unwrap();
    v["run"]["seed"]
        .as_u64()
        .or_else(|| v["seed"].as_u64())
        .unwrap_or_else(|| panic!("no seed in {}: {v}", ck.display()))
}

#[test]
fn a_second_run_in_a_held_checkpoint_directory_is_refused_naming_the_holder() {
    let t = tmp();
    let first = spawn_run(t.path(), "ck", "0");
    // Wait until the first run holds the directory (its PID is in the lock file).
    let lock = t.path().join("ck").join(LOCK);
    let pid = first.id().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.contains(&format!("pid {pid} "))) {
        assert!(
            std::time::Instant::now() < deadline,
            "the first run never took the lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = run(
        t.path(),
        &["--checkpoint-dir", "ck", "--seed", "5", "--epochs", "3"],
    );
    let err = fails_with(&o, &["ck", "in use", &format!("pid {pid}"), "host"]);
    assert!(!text(&o).0.contains("[1,"), "trained before failing: {err}");
    let out = first.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the first run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every checkpoint is the first run's.
    let names: Vec<String> = dirs(&t.path().join("ck"))
        .into_iter()
        .filter(|n| n.starts_with("epoch-"))
        .collect();
    assert_eq!(names.len(), 5, "{names:?}");
    for n in &names {
        assert_eq!(seed_of(&t.path().join("ck").join(n)), 0, "{n}");
    }
    // Once it has ended the lock is free again: a resume takes it (nothing to resume).
    fails_with(
        &run(
            t.path(),
            &[
                "--checkpoint-dir",
                "ck",
                "--synthetic-size",
                "512",
                "--epochs",
                "5",
                "--resume",
            ],
        ),
        &["already holds 5 of 5 epochs"],
    );
}

#[test]
fn two_runs_started_together_in_one_directory_one_trains_one_is_refused() {
    let t = tmp();
    let a = spawn_run(t.path(), "ck", "0");
    let b = spawn_run(t.path(), "ck", "5");
    let (oa, ob) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let ok: Vec<&Output> = [&oa, &ob]
        .into_iter()
        .filter(|o| o.status.success())
        .collect();
    assert_eq!(
        ok.len(),
        1,
        "exactly one run trains\nA: {}\nB: {}",
        String::from_utf8_lossy(&oa.stderr),
        String::from_utf8_lossy(&ob.stderr)
    );
    let (winner_seed, loser) = if oa.status.success() {
        (0, &ob)
    } else {
        (5, &oa)
    };
    fails_with(loser, &["in use", "pid "]);
    let names: Vec<String> = dirs(&t.path().join("ck"))
        .into_iter()
        .filter(|n| n.starts_with("epoch-"))
        .collect();
    assert_eq!(names.len(), 5, "{names:?}");
    for n in &names {
        assert_eq!(seed_of(&t.path().join("ck").join(n)), winner_seed, "{n}");
    }
}

#[test]
fn stop_after_zero_is_an_error_like_epochs_zero() {
    let t = tmp();
    let o = run(t.path(), &["--epochs", "3", "--stop-after", "0"]);
    let e = fails_with(&o, &["stop_after"]);
    assert!(!text(&o).0.contains("NaN"), "{e}");
}

#[test]
fn threads_above_the_cores_are_capped_with_a_warning() {
    let t = tmp();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let o = run(t.path(), &["--threads", "1000"]);
    let out = succeeds(&o);
    let err = text(&o).1;
    assert!(
        err.contains("--threads 1000") && err.contains(&format!("using {cores}")),
        "{err}"
    );
    assert!(out.contains(&format!("{cores} threads")), "{out}");
    fails_with(&run(t.path(), &["--threads", "0"]), &["--threads"]);
}

#[test]
fn negative_numbers_reach_the_flags_own_check() {
    let t = tmp();
    let o = run(t.path(), &["--lr", "-1"]);
    let err = fails_with(&o, &["learning rate", "-1"]);
    assert!(!err.contains("unexpected argument"), "{err}");
    let o = run(t.path(), &["--epochs", "-1"]);
    let (_, err) = text(&o);
    // clap's own parse error for a count (exit 2) names the value, not an unknown argument.
    assert!(
        err.contains("-1") && !err.contains("unexpected argument"),
        "{err}"
    );
}

#[test]
fn eval_with_a_data_dir_evaluates_there_or_says_why_not() {
    let t = tmp();
    succeeds(&run(t.path(), &["--checkpoint-dir", "ck"]));
    let ck = t.path().join("ck");
    let ck = ck.to_str().unwrap();
    // A directory that does not exist.
    fails_with(
        &hemi_in(
            t.path(),
            &["eval", "--checkpoint", ck, "--data-dir", "/nonexistent"],
        ),
        &["/nonexistent", "no such directory"],
    );
    // A directory with no data set in it.
    std::fs::create_dir_all(t.path().join("empty")).unwrap();
    fails_with(
        &hemi_in(
            t.path(),
            &["eval", "--checkpoint", ck, "--data-dir", "empty"],
        ),
        &["empty", "no data set"],
    );
    // A data set of other classes and image size than the synthetic set's: named, refused.
    folders(t.path(), &["cat", "dog"], &["cat", "dog"]);
    fails_with(
        &hemi_in(
            t.path(),
            &["eval", "--checkpoint", ck, "--data-dir", "data"],
        ),
        &["data", "classes"],
    );
    // Without --data-dir: the data the run trained on.
    let out = succeeds(&hemi_in(t.path(), &["eval", "--checkpoint", ck]));
    assert!(out.contains("synthetic"), "{out}");
}

#[test]
fn quantize_refuses_a_model_without_quantisable_layers_before_evaluating() {
    let t = tmp();
    succeeds(&run(
        t.path(),
        &[
            "--model",
            "resnet20",
            "--synthetic-size",
            "64",
            "--batch-size",
            "32",
            "--checkpoint-dir",
            "ck",
        ],
    ));
    let o = hemi_in(
        t.path(),
        &[
            "quantize",
            "--checkpoint",
            "ck",
            "--out",
            "q",
            "--mode",
            "dynamic",
        ],
    );
    fails_with(&o, &["resnet20", "no layers", "dynamic"]);
    let out = text(&o).0;
    assert!(!out.contains("float:"), "evaluated first:\n{out}");
    assert!(!t.path().join("q").exists(), "wrote an output");
}

#[test]
fn num_classes_is_for_text_data_and_fetch_names_what_it_can_fetch() {
    let t = tmp();
    let o = run(t.path(), &["--num-classes", "12"]);
    fails_with(&o, &["--num-classes", "text"]);
    assert!(!text(&o).0.contains("[1,"), "trained before failing");
    fails_with(
        &hemi_in(t.path(), &["data", "fetch", "imagenet"]),
        &["imagenet", "cifar10", "all-minilm-l6-v2"],
    );
}
