//! Training checkpoints: one directory per save under a checkpoint root,
//!
//! ```text
//! ck/
//!   epoch-0002/                 after 2 whole epochs
//!   epoch-0003/                 after 3
//!   epoch-0004-batch-000120/    stopped (Ctrl-C) after 120 batches of epoch 4
//!     model.safetensors         weights, PyTorch state_dict names and layouts
//!     optimizer.safetensors     the optimizer's F32 buffers
//!     state.json                progress, optimizer/scaler scalars, what the run is
//!     MANIFEST.json             written last: every file with its size and SHA-256
//! ```
//!
//! A save writes every file into a temporary directory `.tmp-NAME-PID`, syncs each file,
//! writes the manifest, syncs the directory and renames it into place, then syncs the root.
//! So a directory with a final name is always complete: a kill or a full disk at any moment
//! leaves either the whole new checkpoint or none of it, never weights of one epoch with
//! the state of another. Loading verifies the manifest (sizes and hashes) and refuses,
//! naming the file, anything incomplete or altered. Temporaries left by a killed run are
//! removed by the next run (`remove_stray`).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::amp::ScalerState;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::io::{from_safetensors_bytes, to_safetensors_bytes};
use crate::nn::Module;
use crate::optim::{OptimizerState, StateBuffer};
use crate::tensor::Tensor;

/// The checkpoint format written by this version (`state.json`'s `format`).
pub const FORMAT: &str = "hemi-checkpoint-2";
const MANIFEST_FORMAT: &str = "hemi-checkpoint-manifest-1";
const MANIFEST: &str = "MANIFEST.json";
const FILES: [&str; 3] = ["model.safetensors", "optimizer.safetensors", "state.json"];
/// Limits on sizes read from a checkpoint, so that a crafted `state.json` is refused
/// instead of allocating terabytes.
const MAX_CLASSES: usize = 1 << 24;
const MAX_INPUT_NUMEL: usize = 1 << 30;
const MAX_EPOCHS: usize = 1 << 32;

/// What a run is, so that `eval` and `resume` can rebuild it and `resume` can tell whether
/// it is being continued with the same settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunInfo {
    /// Model name (`cifar-net`, `mlp`).
    pub model: String,
    /// Data set kind (`synthetic`, `cifar10`, `image-folder`, `mnist`...).
    pub dataset: String,
    /// Where the data set was read from (made absolute by the CLI).
    pub data_dir: Option<PathBuf>,
    /// Input shape [C, H, W] and number of classes.
    pub input_shape: [usize; 3],
    /// Number of classes the model predicts (the width of its output).
    pub classes: usize,
    /// The class names in label order (empty where the data set has none).
    pub class_names: Vec<String>,
    /// Samples in the training and test sets.
    pub train_len: usize,
    /// Samples in the test set.
    pub test_len: usize,
    /// The run's seed (initialisation, data order and augmentation derive from it).
    pub seed: u64,
    /// The precision preset's name (`amp-fp16`...); `train` fills it in from its config.
    pub precision: String,
    /// Every other setting that changes the result, as name → value text: `train` adds the
    /// optimizer's and the scaler's (`lr`, `momentum`...), the CLI the batch size and
    /// augmentation.
    pub settings: BTreeMap<String, String>,
}

/// Settings a resumed run cannot take over from the command line, because the saved
/// weights and optimizer state only fit the run they came from.
const FIXED: [&str; 6] = [
    "model",
    "input_shape",
    "classes",
    "class_names",
    "precision",
    "optimizer",
];

impl RunInfo {
    /// The run as a flat list of setting → value text, the form in which two runs are
    /// compared.
    pub fn flat(&self) -> BTreeMap<String, String> {
        let mut m = self.settings.clone();
        m.insert("model".into(), self.model.clone());
        m.insert("dataset".into(), self.dataset.clone());
        m.insert(
            "data_dir".into(),
            self.data_dir
                .as_ref()
                .map_or("-".into(), |p| p.display().to_string()),
        );
        m.insert("input_shape".into(), format!("{:?}", self.input_shape));
        m.insert("classes".into(), self.classes.to_string());
        m.insert("class_names".into(), self.class_names.join(","));
        m.insert("train_len".into(), self.train_len.to_string());
        m.insert("test_len".into(), self.test_len.to_string());
        m.insert("seed".into(), self.seed.to_string());
        m.insert("precision".into(), self.precision.clone());
        m
    }

    /// The settings in which `self` (the checkpoint's run) and `now` (the run being
    /// resumed) differ: (name, checkpoint's value, new value).
    pub fn differences(&self, now: &RunInfo) -> Vec<(String, String, String)> {
        let (a, b) = (self.flat(), now.flat());
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        // What the run decided itself (`--auto-promote`), not a setting to compare; and
        // activation checkpointing and the ZeRO stage, which change memory and time but not
        // a bit of the result, so a run may be resumed with or without them (a ZeRO run's
        // rank count is checked on its own).
        keys.retain(|k| {
            !matches!(
                k.as_str(),
                "promoted"
                    | "settings.promoted"
                    | "checkpoint_activations"
                    | "zero"
                    | "settings.zero"
            )
        });
        keys.into_iter()
            .filter_map(|k| {
                let (x, y) = (a.get(k), b.get(k));
                (x != y).then(|| {
                    let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "-".into());
                    (k.clone(), show(x), show(y))
                })
            })
            .collect()
    }

    /// Checks that a run `now` may continue the checkpoint's run `self`: every difference
    /// must be named in `overrides`, and none may be a setting the saved state depends on
    /// (model, shapes, classes, precision, optimizer). Unknown override names are errors.
    pub fn check_resume(&self, now: &RunInfo, overrides: &[String], what: &Path) -> Result<()> {
        let known = now.flat();
        for o in overrides {
            if !known.contains_key(o) {
                let names: Vec<&str> = known.keys().map(String::as_str).collect();
                return Err(Error::arg(
                    "resume",
                    format!(
                        "--override {o:?}: no such setting (settings: {})",
                        names.join(", ")
                    ),
                ));
            }
            if FIXED.contains(&o.as_str()) {
                return Err(Error::arg(
                    "resume",
                    format!("--override {o}: the saved weights and optimizer state depend on it"),
                ));
            }
        }
        let diffs: Vec<_> = self
            .differences(now)
            .into_iter()
            .filter(|(k, _, _)| !overrides.contains(k))
            .collect();
        if diffs.is_empty() {
            return Ok(());
        }
        let lines: Vec<String> = diffs
            .iter()
            .map(|(k, a, b)| format!("  {k}: checkpoint {a}, now {b}"))
            .collect();
        let fixed: Vec<&str> = diffs
            .iter()
            .filter(|(k, _, _)| FIXED.contains(&k.as_str()))
            .map(|(k, _, _)| k.as_str())
            .collect();
        let hint = if fixed.is_empty() {
            let names: Vec<&str> = diffs.iter().map(|(k, _, _)| k.as_str()).collect();
            format!(
                "resume with the checkpoint's settings, or accept the new ones with --override {}",
                names.join(",")
            )
        } else {
            format!(
                "{} cannot change in a resumed run; start a new run in another directory",
                fixed.join(", ")
            )
        };
        Err(Error::Msg(format!(
            "{}: the run to resume differs from the checkpoint's:\n{}\n{hint}",
            what.display(),
            lines.join("\n")
        )))
    }
}

/// How far a run had got when a checkpoint was written.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// Whole epochs finished.
    pub epochs_done: usize,
    /// Batches of epoch `epochs_done + 1` already trained (0 at an epoch boundary).
    pub batches_done: usize,
    /// Sum of the finite losses, their count and the images of that partial epoch, so the
    /// resumed epoch reports the same train loss as an uninterrupted one.
    pub partial_loss_sum: f64,
    /// Number of finite losses in `partial_loss_sum`.
    pub partial_batches: usize,
    /// Samples trained in the partial epoch.
    pub partial_images: usize,
}

impl Progress {
    /// An epoch boundary.
    pub fn epoch(epochs_done: usize) -> Progress {
        Progress {
            epochs_done,
            ..Default::default()
        }
    }

    /// The directory name of a checkpoint at this point.
    pub fn dir_name(&self) -> String {
        if self.batches_done == 0 {
            format!("epoch-{:04}", self.epochs_done)
        } else {
            format!(
                "epoch-{:04}-batch-{:06}",
                self.epochs_done + 1,
                self.batches_done
            )
        }
    }

    /// Parses `dir_name`'s form back to (epochs_done, batches_done), the order of saves.
    pub fn parse_dir_name(name: &str) -> Option<(usize, usize)> {
        let rest = name.strip_prefix("epoch-")?;
        let mut parts = rest.split("-batch-");
        let e: usize = parts.next()?.parse().ok()?;
        match parts.next() {
            None => Some((e, 0)),
            Some(b) => {
                let b: usize = b.parse().ok()?;
                (e >= 1 && b > 0 && parts.next().is_none()).then(|| (e - 1, b))
            }
        }
    }
}

/// A loaded checkpoint.
pub struct Checkpoint {
    /// The directory it was read from.
    pub dir: PathBuf,
    /// The model's weights under their `state_dict` names, as saved (dtypes kept).
    pub model: Vec<(String, Tensor)>,
    /// The optimizer's state (F32 buffers and scalars) under PyTorch's state_dict names.
    pub optimizer: OptimizerState,
    /// The loss scaler's state (amp-fp16 runs).
    pub scaler: Option<ScalerState>,
    /// Where the run had got: whole epochs and batches of a partial one.
    pub progress: Progress,
    /// Whole epochs finished (`progress.epochs_done`).
    pub epochs_done: usize,
    /// Test accuracy after the last whole epoch, if it was measured.
    pub test_accuracy: Option<f64>,
    /// What the run was: model, data, seed, precision and settings, for `eval` and
    /// `resume`.
    pub info: RunInfo,
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, e))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

/// The lock file in a checkpoint root: a run holds an exclusive advisory lock (`flock`) on
/// it for as long as it may write there, and writes its PID, host and start time into it so
/// that a second run can say who holds the directory. The file stays when the run ends (the
/// lock, not the file, is what counts: the kernel drops it when its holder exits, however it
/// exits), so a stale file never blocks a later run.
pub const LOCK_FILE: &str = ".hemi-lock";

/// An exclusive hold on a checkpoint root for the life of a run (see [`lock_dir`]). Dropping
/// it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: fs::File,
    path: PathBuf,
}

impl DirLock {
    /// The lock file held.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// This machine's host name (for naming a lock's holder).
fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".to_string())
}

/// Takes the checkpoint root `root` (created if needed) for this process: an exclusive lock
/// on `root/.hemi-lock`, held until the returned guard drops. A directory another live run
/// holds is an error naming that run's PID and host, and nothing in it is touched. While the
/// lock is held, whatever temporaries lie in `root` belong to runs that are gone (every run
/// that writes there holds the lock first), so [`remove_stray`] may remove them.
pub fn lock_dir(root: &Path) -> Result<DirLock> {
    if root.exists() && !root.is_dir() {
        return Err(Error::Msg(format!(
            "{}: the checkpoint directory exists and is not a directory",
            root.display()
        )));
    }
    fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
    let path = root.join(LOCK_FILE);
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| {
            Error::Msg(format!(
                "{}: cannot write checkpoints here: {e}",
                root.display()
            ))
        })?;
    match file.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let holder = fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another hemi run (it has not written its name yet)".to_string()
            } else {
                format!("another hemi run ({holder})")
            };
            return Err(Error::Msg(format!(
                "{}: the checkpoint directory is in use by {who}; wait for that run to end or \
                 choose another --checkpoint-dir (nothing here was touched)",
                root.display()
            )));
        }
        Err(fs::TryLockError::Error(e)) => {
            return Err(Error::Msg(format!(
                "{}: cannot lock the checkpoint directory ({}): {e}",
                root.display(),
                path.display()
            )))
        }
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let text = format!(
        "pid {} on host {}, started at unix time {started}\n",
        std::process::id(),
        host_name()
    );
    file.set_len(0)
        .and_then(|_| {
            use std::io::Seek;
            file.seek(std::io::SeekFrom::Start(0))
        })
        .and_then(|_| file.write_all(text.as_bytes()))
        .and_then(|_| file.sync_all())
        .map_err(|e| io_err(&path, e))?;
    Ok(DirLock { _file: file, path })
}

/// Removes what an interrupted save left in `root`: temporary checkpoint directories
/// (`.tmp-*`), the trash of a replaced checkpoint, and temporary files of older versions
/// (`.NAME.tmpPID`, the `.write-test-PID` probes of versions before the lock). Returns the paths removed. Call it only while holding the directory's
/// lock ([`lock_dir`]): then no live run owns any of them.
pub fn remove_stray(root: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(io_err(root, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_err(root, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let stray = name.starts_with(".tmp-")
            || name.starts_with(".old-")
            || name.starts_with(".write-test-")
            || (name.starts_with('.') && name.contains(".tmp"));
        if !stray {
            continue;
        }
        let path = entry.path();
        // `.old-NAME-PID` is a complete checkpoint moved aside while NAME was replaced; if
        // the run died before the new NAME landed, it is the only copy: put it back.
        if let Some(orig) = name
            .strip_prefix(".old-")
            .and_then(|r| r.rsplit_once('-'))
            .map(|(n, _)| n)
            .filter(|n| Progress::parse_dir_name(n).is_some())
        {
            let target = root.join(orig);
            if !target.exists() && path.join(MANIFEST).is_file() {
                fs::rename(&path, &target).map_err(|e| io_err(&path, e))?;
                continue;
            }
        }
        let ft = entry.file_type().map_err(|e| io_err(&path, e))?;
        if ft.is_dir() {
            fs::remove_dir_all(&path).map_err(|e| io_err(&path, e))?;
        } else {
            fs::remove_file(&path).map_err(|e| io_err(&path, e))?;
        }
        removed.push(path);
    }
    Ok(removed)
}

/// Writes a checkpoint of `model`, the optimizer state `st` and the loss scaler's `scaler`
/// at `progress` into a new directory under `root`, atomically (see the module docs), and
/// returns that directory. `test_accuracy` is the accuracy after the epoch, if measured.
pub fn save_checkpoint(
    root: &Path,
    model: &dyn Module,
    st: &OptimizerState,
    scaler: Option<&ScalerState>,
    progress: Progress,
    test_accuracy: Option<f64>,
    info: &RunInfo,
) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
    let model_bytes = to_safetensors_bytes(&model.state_dict(), None)?;
    let mut buffers = Vec::with_capacity(st.buffers.len());
    for b in &st.buffers {
        buffers.push((
            b.name.clone(),
            Tensor::from_f32_vec(b.data.clone(), &b.shape, DType::F32)?,
        ));
    }
    let opt_bytes = to_safetensors_bytes(&buffers, None)?;
    let state = state_json(st, scaler, progress, test_accuracy, info);
    let state_bytes = serde_json::to_string_pretty(&state)
        .map_err(|e| Error::Msg(format!("state.json: {e}")))?
        .into_bytes();

    let name = progress.dir_name();
    let fin = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    let write = || -> Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        }
        fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
        let mut files = Vec::new();
        for (file, bytes) in FILES.iter().zip([&model_bytes, &opt_bytes, &state_bytes]) {
            write_synced(&tmp.join(file), bytes)?;
            files.push(json!({"name": file, "size": bytes.len(),
                              "sha256": hex(&Sha256::digest(bytes))}));
        }
        let manifest = json!({"format": MANIFEST_FORMAT, "files": files});
        write_synced(&tmp.join(MANIFEST), manifest.to_string().as_bytes())?;
        sync_dir(&tmp)?;
        if fin.exists() {
            // Only a run resumed from an older checkpoint writes a name twice: move the old
            // one aside (its name never means "incomplete"), then drop it.
            let old = root.join(format!(".old-{name}-{}", std::process::id()));
            fs::rename(&fin, &old).map_err(|e| io_err(&fin, e))?;
            fs::rename(&tmp, &fin).map_err(|e| io_err(&fin, e))?;
            sync_dir(root)?;
            fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))?;
        } else {
            fs::rename(&tmp, &fin).map_err(|e| io_err(&fin, e))?;
        }
        sync_dir(root)
    };
    write().inspect_err(|_| {
        let _ = fs::remove_dir_all(&tmp);
    })?;
    Ok(fin)
}

fn state_json(
    st: &OptimizerState,
    scaler: Option<&ScalerState>,
    p: Progress,
    test_accuracy: Option<f64>,
    info: &RunInfo,
) -> Value {
    json!({
        "format": FORMAT,
        "epochs_done": p.epochs_done,
        "batches_done": p.batches_done,
        "partial_loss_sum": p.partial_loss_sum,
        "partial_batches": p.partial_batches,
        "partial_images": p.partial_images,
        "test_accuracy": test_accuracy,
        "optimizer": st.optimizer,
        "optimizer_scalars": st.scalars.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "optimizer_buffers": st.buffers.iter().map(|b| b.name.clone()).collect::<Vec<_>>(),
        "scaler": scaler.map(|s| s.scalars.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()),
        "run": {
            "model": info.model,
            "dataset": info.dataset,
            "data_dir": info.data_dir.as_ref().map(|p| p.display().to_string()),
            "input_shape": info.input_shape,
            "classes": info.classes,
            "class_names": info.class_names,
            "train_len": info.train_len,
            "test_len": info.test_len,
            "seed": info.seed,
            "precision": info.precision,
            "settings": info.settings,
        },
    })
}

/// A manifest entry: a file of the checkpoint with its size and SHA-256 (hex).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestEntry {
    /// The file's name within the checkpoint directory (`model.safetensors`).
    pub name: String,
    /// The file's size in bytes.
    pub size: u64,
    /// The file's SHA-256 as 64 lowercase hex digits.
    pub sha256: String,
}

/// Parses `MANIFEST.json`'s bytes; `what` names the file in errors.
pub fn parse_manifest(what: &str, bytes: &[u8]) -> Result<Vec<ManifestEntry>> {
    let bad = |msg: String| Error::Data {
        path: what.to_string(),
        msg,
    };
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    if v.get("format").and_then(Value::as_str) != Some(MANIFEST_FORMAT) {
        return Err(bad(format!("not a {MANIFEST_FORMAT} manifest")));
    }
    let files = v
        .get("files")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("missing the list \"files\"".into()))?;
    let mut out = Vec::with_capacity(files.len().min(16));
    for f in files {
        let name = f.get("name").and_then(Value::as_str);
        let size = f.get("size").and_then(Value::as_u64);
        let sha = f.get("sha256").and_then(Value::as_str);
        match (name, size, sha) {
            (Some(n), Some(s), Some(h))
                if !n.contains(['/', '\\']) && n != ".." && n != "." && h.len() == 64 =>
            {
                out.push(ManifestEntry {
                    name: n.to_string(),
                    size: s,
                    sha256: h.to_ascii_lowercase(),
                })
            }
            _ => return Err(bad(format!("bad entry {f}"))),
        }
    }
    for need in FILES {
        if !out.iter().any(|e| e.name == need) {
            return Err(bad(format!("does not list {need}")));
        }
    }
    Ok(out)
}

/// Reads `dir`'s manifest and every file it lists, checking sizes and hashes. Returns the
/// files' bytes by name. Errors name the file that is missing, short or altered.
fn read_verified(dir: &Path) -> Result<HashMap<String, Vec<u8>>> {
    let mpath = dir.join(MANIFEST);
    let mbytes = match fs::read(&mpath) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let legacy = dir.join("state.json").is_file();
            return Err(Error::Data {
                path: mpath.display().to_string(),
                msg: if legacy {
                    "missing: this checkpoint was written by an older hemi without manifests \
                     (or its save did not finish); it cannot be verified"
                        .into()
                } else {
                    "missing: not a complete hemi checkpoint".into()
                },
            });
        }
        Err(e) => return Err(io_err(&mpath, e)),
    };
    let entries = parse_manifest(&mpath.display().to_string(), &mbytes)?;
    let mut out = HashMap::new();
    for e in entries {
        let path = dir.join(&e.name);
        let meta = fs::symlink_metadata(&path).map_err(|err| io_err(&path, err))?;
        if !meta.is_file() {
            return Err(Error::Data {
                path: path.display().to_string(),
                msg: "not a regular file".into(),
            });
        }
        if meta.len() != e.size {
            return Err(Error::Data {
                path: path.display().to_string(),
                msg: format!(
                    "{} bytes, the manifest says {}: the checkpoint is incomplete or altered",
                    meta.len(),
                    e.size
                ),
            });
        }
        let bytes = fs::read(&path).map_err(|err| io_err(&path, err))?;
        if hex(&Sha256::digest(&bytes)) != e.sha256 {
            return Err(Error::Data {
                path: path.display().to_string(),
                msg: "SHA-256 differs from the manifest: the file was altered or damaged".into(),
            });
        }
        out.insert(e.name, bytes);
    }
    Ok(out)
}

/// The complete checkpoints under `root` (directories with a final name and a manifest),
/// oldest first, with their (epochs_done, batches_done).
pub fn list_checkpoints(root: &Path) -> Result<Vec<(PathBuf, (usize, usize))>> {
    let mut out = Vec::new();
    let entries = fs::read_dir(root).map_err(|e| io_err(root, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(root, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(key) = Progress::parse_dir_name(&name) {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) && path.join(MANIFEST).is_file() {
                out.push((path, key));
            }
        }
    }
    out.sort_by_key(|(_, k)| *k);
    Ok(out)
}

/// The newest complete checkpoint under `root`, if any.
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(root)?.pop().map(|(p, _)| p))
}

/// Reads a checkpoint: `path` is either one checkpoint directory (`ck/epoch-0003`) or a
/// checkpoint root, whose newest complete checkpoint is read. Every file is verified
/// against the manifest first.
pub fn load_checkpoint(path: &Path) -> Result<Checkpoint> {
    let meta = fs::metadata(path).map_err(|e| io_err(path, e))?;
    if !meta.is_dir() {
        return Err(Error::Msg(format!(
            "{}: not a checkpoint directory",
            path.display()
        )));
    }
    let dir = if path.join(MANIFEST).exists() || path.join("state.json").exists() {
        path.to_path_buf()
    } else {
        latest_checkpoint(path)?.ok_or_else(|| {
            Error::Msg(format!(
                "{}: no complete checkpoint here (expected epoch-NNNN directories with a {MANIFEST})",
                path.display()
            ))
        })?
    };
    let mut files = read_verified(&dir)?;
    let mut take = |name: &str| files.remove(name).unwrap_or_default();
    let state_path = dir.join("state.json");
    let (state, info) = parse_state(&state_path.display().to_string(), &take("state.json"))?;
    let (model, _) = from_safetensors_bytes(
        &dir.join("model.safetensors").display().to_string(),
        &take("model.safetensors"),
    )?;
    let opt_path = dir.join("optimizer.safetensors").display().to_string();
    let (bufs, _) = from_safetensors_bytes(&opt_path, &take("optimizer.safetensors"))?;
    let mut by_name: HashMap<String, Tensor> = bufs.into_iter().collect();
    let mut buffers = Vec::with_capacity(state.buffer_names.len());
    for name in &state.buffer_names {
        let t = by_name.remove(name).ok_or_else(|| Error::Data {
            path: opt_path.clone(),
            msg: format!("optimizer buffer {name:?} (listed in state.json) is missing"),
        })?;
        buffers.push(StateBuffer {
            name: name.clone(),
            shape: t.shape().to_vec(),
            data: t.try_to_vec_f32()?,
        });
    }
    Ok(Checkpoint {
        dir,
        model,
        optimizer: OptimizerState {
            optimizer: state.optimizer,
            scalars: state.scalars,
            buffers,
        },
        scaler: state.scaler,
        epochs_done: state.progress.epochs_done,
        progress: state.progress,
        test_accuracy: state.test_accuracy,
        info,
    })
}

/// `state.json` without the tensors.
pub struct SavedState {
    /// Where the run had got.
    pub progress: Progress,
    /// Test accuracy after the last whole epoch, if measured.
    pub test_accuracy: Option<f64>,
    /// The optimizer's kind (`"sgd"`, `"adam"`, `"adamw"`).
    pub optimizer: String,
    /// The optimizer's scalars (hyper-parameters and step counts) by name.
    pub scalars: Vec<(String, f64)>,
    /// The names of the optimizer buffers `optimizer.safetensors` must hold.
    pub buffer_names: Vec<String>,
    /// The loss scaler's state, for runs that scale the loss.
    pub scaler: Option<ScalerState>,
}

/// Parses `state.json`'s bytes (`what` names the file in errors), checking every size
/// against sane limits before anything is allocated from it.
pub fn parse_state(what: &str, bytes: &[u8]) -> Result<(SavedState, RunInfo)> {
    let bad = |msg: String| Error::Data {
        path: what.to_string(),
        msg,
    };
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    if v.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(bad(format!(
            "format {} is not {FORMAT}",
            v.get("format").map_or("missing".into(), |f| f.to_string())
        )));
    }
    let get = |obj: &Value, key: &str| -> Result<Value> {
        obj.get(key)
            .cloned()
            .ok_or_else(|| bad(format!("missing field {key:?}")))
    };
    let uint = |obj: &Value, key: &str, max: usize| -> Result<usize> {
        let x = get(obj, key)?
            .as_u64()
            .ok_or_else(|| bad(format!("{key} is not a non-negative integer")))?;
        usize::try_from(x)
            .ok()
            .filter(|&x| x <= max)
            .ok_or_else(|| bad(format!("{key} = {x} is out of range (at most {max})")))
    };
    let string = |obj: &Value, key: &str| -> Result<String> {
        get(obj, key)?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("{key} is not a string")))
    };
    let float = |obj: &Value, key: &str| -> Result<f64> {
        get(obj, key)?
            .as_f64()
            .ok_or_else(|| bad(format!("{key} is not a number")))
    };
    let run = get(&v, "run")?;
    let shape: Vec<usize> = get(&run, "input_shape")?
        .as_array()
        .ok_or_else(|| bad("input_shape is not a list".into()))?
        .iter()
        .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("input_shape holds a non-integer".into()))?;
    let input_shape: [usize; 3] = shape
        .try_into()
        .map_err(|_| bad("input_shape is not [C, H, W]".into()))?;
    let numel = input_shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n > 0 && n <= MAX_INPUT_NUMEL)
        .ok_or_else(|| bad(format!("input_shape {input_shape:?} is out of range")))?;
    let _ = numel;
    let classes = uint(&run, "classes", MAX_CLASSES)?;
    if classes == 0 {
        return Err(bad("classes is 0".into()));
    }
    let class_names: Vec<String> = match run.get("class_names") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("class_names holds a non-string".into()))?,
        _ => return Err(bad("class_names is not a list".into())),
    };
    if !class_names.is_empty() && class_names.len() != classes {
        return Err(bad(format!(
            "{} class names for {classes} classes",
            class_names.len()
        )));
    }
    let settings: BTreeMap<String, String> = match run.get("settings") {
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, x)| x.as_str().map(|s| (k.clone(), s.to_string())))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("settings holds a non-string value".into()))?,
        _ => return Err(bad("settings is not an object".into())),
    };
    let info = RunInfo {
        model: string(&run, "model")?,
        dataset: string(&run, "dataset")?,
        data_dir: run
            .get("data_dir")
            .and_then(Value::as_str)
            .map(PathBuf::from),
        input_shape,
        classes,
        class_names,
        train_len: uint(&run, "train_len", usize::MAX)?,
        test_len: uint(&run, "test_len", usize::MAX)?,
        seed: get(&run, "seed")?
            .as_u64()
            .ok_or_else(|| bad("seed is not a non-negative integer".into()))?,
        precision: string(&run, "precision")?,
        settings,
    };
    let pairs = |key: &str, list: &Value| -> Result<Vec<(String, f64)>> {
        list.as_array()
            .ok_or_else(|| bad(format!("{key} is not a list")))?
            .iter()
            .map(|p| {
                match (
                    p.get(0).and_then(Value::as_str),
                    p.get(1).and_then(Value::as_f64),
                ) {
                    (Some(k), Some(x)) => Ok((k.to_string(), x)),
                    _ => Err(bad(format!("bad {key} entry {p}"))),
                }
            })
            .collect()
    };
    let scaler = match v.get("scaler") {
        None | Some(Value::Null) => None,
        Some(list) => Some(ScalerState {
            scalars: pairs("scaler", list)?,
        }),
    };
    let buffer_names = get(&v, "optimizer_buffers")?
        .as_array()
        .ok_or_else(|| bad("optimizer_buffers is not a list".into()))?
        .iter()
        .map(|n| n.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| bad("an optimizer buffer name is not a string".into()))?;
    let test_accuracy = match v.get("test_accuracy") {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|a| (0.0..=1.0).contains(a))
                .ok_or_else(|| bad(format!("test_accuracy {x} is not in [0, 1]")))?,
        ),
    };
    let progress = Progress {
        epochs_done: uint(&v, "epochs_done", MAX_EPOCHS)?,
        batches_done: uint(&v, "batches_done", usize::MAX / 2)?,
        partial_loss_sum: float(&v, "partial_loss_sum")?,
        partial_batches: uint(&v, "partial_batches", usize::MAX / 2)?,
        partial_images: uint(&v, "partial_images", usize::MAX / 2)?,
    };
    let state = SavedState {
        progress,
        test_accuracy,
        optimizer: string(&v, "optimizer")?,
        scalars: pairs("optimizer_scalars", &get(&v, "optimizer_scalars")?)?,
        buffer_names,
        scaler,
    };
    Ok((state, info))
}

/// Removes old checkpoints under `root`, keeping the newest `keep` (all when `None`) and,
/// with `keep_best`, the one with the best test accuracy. Returns the directories removed.
pub fn prune_checkpoints(
    root: &Path,
    keep: Option<usize>,
    keep_best: bool,
) -> Result<Vec<PathBuf>> {
    let Some(keep) = keep else {
        return Ok(Vec::new());
    };
    let all = list_checkpoints(root)?;
    let best = if keep_best {
        let mut best: Option<(PathBuf, f64)> = None;
        for (p, (_, b)) in &all {
            if *b != 0 {
                continue;
            }
            let text = fs::read(p.join("state.json")).unwrap_or_default();
            let acc = serde_json::from_slice::<Value>(&text)
                .ok()
                .and_then(|v| v.get("test_accuracy").and_then(Value::as_f64));
            if let Some(a) = acc {
                // Ties go to the newer checkpoint.
                if best.as_ref().is_none_or(|(_, x)| a >= *x) {
                    best = Some((p.clone(), a));
                }
            }
        }
        best.map(|(p, _)| p)
    } else {
        None
    };
    let n = all.len();
    let mut removed = Vec::new();
    for (i, (p, _)) in all.into_iter().enumerate() {
        if i + keep >= n || best.as_ref() == Some(&p) {
            continue;
        }
        fs::remove_dir_all(&p).map_err(|e| io_err(&p, e))?;
        removed.push(p);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(removed)
}
