//! Training checkpoints: a directory holding `model.safetensors` (PyTorch state_dict names
//! and layouts), `optimizer.safetensors` (the optimizer's F32 buffers) and `state.json`
//! (epoch, optimizer scalars, what the run is). Each file is written atomically, and
//! `state.json` last, so a crash mid-save leaves the previous epoch's checkpoint loadable.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::amp::ScalerState;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::io::{atomic_write, load_safetensors, save_safetensors};
use crate::nn::Module;
use crate::optim::{OptimizerState, StateBuffer};
use crate::tensor::Tensor;

/// What a run is, so that `eval` and `resume` can rebuild it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    /// Model name (`cifar-net`, `mlp`).
    pub model: String,
    /// Data set name and directory.
    pub dataset: String,
    pub data_dir: Option<PathBuf>,
    /// Input shape [C, H, W] and number of classes.
    pub input_shape: [usize; 3],
    pub classes: usize,
    pub seed: u64,
    /// The precision preset's name (`amp-fp16`...); `train` fills it in from its config.
    pub precision: String,
}

/// A loaded checkpoint.
pub struct Checkpoint {
    pub model: Vec<(String, Tensor)>,
    pub optimizer: OptimizerState,
    /// The loss scaler's state (amp-fp16 runs).
    pub scaler: Option<ScalerState>,
    pub epochs_done: usize,
    pub info: RunInfo,
}

/// Writes the checkpoint of a finished epoch into `dir`: the model, the optimizer's state
/// (`Optimizer::state_dict`) and the loss scaler's, if any.
pub fn save_checkpoint(
    dir: &Path,
    model: &dyn Module,
    st: &OptimizerState,
    scaler: Option<&ScalerState>,
    epochs_done: usize,
    info: &RunInfo,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    save_safetensors(&dir.join("model.safetensors"), &model.state_dict(), None)?;
    let mut buffers = Vec::with_capacity(st.buffers.len());
    for b in &st.buffers {
        buffers.push((
            b.name.clone(),
            Tensor::from_f32_vec(b.data.clone(), &b.shape, DType::F32)?,
        ));
    }
    save_safetensors(&dir.join("optimizer.safetensors"), &buffers, None)?;
    let state = json!({
        "format": "hemi-checkpoint-1",
        "epochs_done": epochs_done,
        "optimizer": st.optimizer,
        "optimizer_scalars": st.scalars.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "optimizer_buffers": st.buffers.iter().map(|b| b.name.clone()).collect::<Vec<_>>(),
        "model": info.model,
        "dataset": info.dataset,
        "data_dir": info.data_dir.as_ref().map(|p| p.display().to_string()),
        "input_shape": info.input_shape,
        "classes": info.classes,
        "seed": info.seed,
        "precision": info.precision,
        "scaler": scaler.map(|s| s.scalars.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>()),
    });
    let text =
        serde_json::to_string_pretty(&state).map_err(|e| Error::Msg(format!("state.json: {e}")))?;
    atomic_write(&dir.join("state.json"), text.as_bytes())
}

fn field<'a>(path: &Path, v: &'a Value, key: &str) -> Result<&'a Value> {
    v.get(key).ok_or_else(|| Error::Data {
        path: path.display().to_string(),
        msg: format!("missing field {key:?}"),
    })
}

/// Reads the checkpoint in `dir`.
pub fn load_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| Error::Io {
        path: state_path.display().to_string(),
        source: e,
    })?;
    let bad = |msg: String| Error::Data {
        path: state_path.display().to_string(),
        msg,
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let as_usize = |key: &str| -> Result<usize> {
        field(&state_path, &v, key)?
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| bad(format!("{key} is not a number")))
    };
    let as_str = |key: &str| -> Result<String> {
        field(&state_path, &v, key)?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("{key} is not a string")))
    };
    let shape: Vec<usize> = field(&state_path, &v, "input_shape")?
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().map(|x| x as usize))
                .collect()
        })
        .unwrap_or_default();
    let input_shape: [usize; 3] = shape
        .try_into()
        .map_err(|_| bad("input_shape is not [C, H, W]".into()))?;
    let info = RunInfo {
        model: as_str("model")?,
        dataset: as_str("dataset")?,
        data_dir: v
            .get("data_dir")
            .and_then(|d| d.as_str())
            .map(PathBuf::from),
        input_shape,
        classes: as_usize("classes")?,
        seed: field(&state_path, &v, "seed")?
            .as_u64()
            .ok_or_else(|| bad("seed is not a number".into()))?,
        // Checkpoints from before presets existed were trained in F32.
        precision: v
            .get("precision")
            .and_then(|p| p.as_str())
            .unwrap_or("fp32")
            .to_string(),
    };
    let pairs = |key: &str, list: &Value| -> Result<Vec<(String, f64)>> {
        list.as_array()
            .ok_or_else(|| bad(format!("{key} is not a list")))?
            .iter()
            .map(|p| {
                match (
                    p.get(0).and_then(|k| k.as_str()),
                    p.get(1).and_then(|x| x.as_f64()),
                ) {
                    (Some(k), Some(x)) => Ok((k.to_string(), x)),
                    _ => Err(bad(format!("bad {key} entry {p}"))),
                }
            })
            .collect()
    };
    let scalars = pairs(
        "optimizer_scalars",
        field(&state_path, &v, "optimizer_scalars")?,
    )?;
    let scaler = match v.get("scaler") {
        None | Some(Value::Null) => None,
        Some(list) => Some(ScalerState {
            scalars: pairs("scaler", list)?,
        }),
    };
    let (model, _) = load_safetensors(&dir.join("model.safetensors"))?;
    let (bufs, _) = load_safetensors(&dir.join("optimizer.safetensors"))?;
    let by_name: HashMap<String, Tensor> = bufs.into_iter().collect();
    // Keep the optimizer's own buffer order, recorded in state.json.
    let order = field(&state_path, &v, "optimizer_buffers")?
        .as_array()
        .ok_or_else(|| bad("optimizer_buffers is not a list".into()))?;
    let mut buffers = Vec::with_capacity(order.len());
    for name in order {
        let name = name
            .as_str()
            .ok_or_else(|| bad("optimizer buffer name is not a string".into()))?;
        let t = by_name.get(name).ok_or_else(|| {
            bad(format!(
                "optimizer buffer {name:?} missing from optimizer.safetensors"
            ))
        })?;
        buffers.push(StateBuffer {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            data: t.to_vec_f32(),
        });
    }
    Ok(Checkpoint {
        model,
        optimizer: OptimizerState {
            optimizer: as_str("optimizer")?,
            scalars,
            buffers,
        },
        scaler,
        epochs_done: as_usize("epochs_done")?,
        info,
    })
}
