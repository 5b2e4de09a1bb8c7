//! Files: tensors in safetensors format (PyTorch's names and layouts, so that
//! `safetensors.torch.load_file` + `load_state_dict` read hemi checkpoints), written
//! atomically (temporary file, fsync, rename) so a crash never leaves a broken file.

pub mod onnx;

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;

pub mod tensorboard;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::tensor::{Storage, Tensor};

/// Tensors with their names, in `state_dict` order, or as a file stores them (see
/// `from_safetensors_bytes`).
pub type NamedTensors = Vec<(String, Tensor)>;

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `bytes` to `path` atomically: a temporary file beside it is written, flushed to
/// disk, and renamed over `path`; the directory is synced so the rename is durable.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io_err(path, e)
    })
}

fn st_dtype(d: DType) -> StDtype {
    match d {
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::F32 => StDtype::F32,
        DType::F64 => StDtype::F64,
        DType::I64 => StDtype::I64,
    }
}

/// Little-endian bytes of a tensor's elements in row-major order.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    t.storage().copy_strided(t.layout())?.to_le_bytes()
}

/// Serialises named tensors (and string metadata) to safetensors bytes.
pub fn to_safetensors_bytes(
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, t)| tensor_bytes(t))
        .collect::<Result<_>>()?;
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, t), b) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(st_dtype(t.dtype()), t.shape().to_vec(), b)
            .map_err(|e| Error::Msg(format!("safetensors: {name}: {e}")))?;
        views.push((name.clone(), view));
    }
    safetensors::serialize(views, metadata).map_err(|e| Error::Msg(format!("safetensors: {e}")))
}

/// Saves named tensors to `path` in safetensors format, atomically.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    atomic_write(path, &to_safetensors_bytes(tensors, metadata)?)
}

/// Parses safetensors bytes into named tensors, in the order of their data in the file;
/// `what` names the source in errors.
///
/// That is not the order they were saved in: `safetensors::serialize` (hemi's writer, and
/// `safetensors.torch.save_file`) lays tensors out by descending dtype alignment, then by
/// name, so a `state_dict` comes back with its I64 `num_batches_tracked` counters first and
/// the rest sorted by name. Match tensors by name (`load_state_dict` does).
pub fn from_safetensors_bytes(
    what: &str,
    data: &[u8],
) -> Result<(NamedTensors, HashMap<String, String>)> {
    let bad = |msg: String| Error::Data {
        path: what.to_string(),
        msg,
    };
    let (_, meta) = SafeTensors::read_metadata(data)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let st = SafeTensors::deserialize(data)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let mut out = Vec::new();
    // The order of the data in the file (offsets): dtype alignment, then name.
    let mut entries: Vec<(String, TensorView<'_>)> = st.tensors();
    entries.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    for (name, view) in entries {
        let shape = view.shape().to_vec();
        let b = view.data();
        let dtype = match view.dtype() {
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            StDtype::F32 => DType::F32,
            StDtype::F64 => DType::F64,
            StDtype::I64 => DType::I64,
            other => {
                return Err(bad(format!(
                    "tensor {name}: dtype {other:?} is not supported by hemi"
                )))
            }
        };
        let storage = Storage::from_le_bytes(dtype, b);
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let Some(storage) = storage.filter(|s| Some(s.len()) == n) else {
            return Err(bad(format!(
                "tensor {name}: {} bytes of {:?} for shape {shape:?}",
                b.len(),
                view.dtype()
            )));
        };
        out.push((
            name,
            Tensor::from_storage(
                std::sync::Arc::new(storage),
                crate::tensor::Layout::contiguous(&shape),
            ),
        ));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Loads named tensors (and metadata) from a safetensors file. Only a regular file is
/// opened (a FIFO would block the open forever); everything else is `from_safetensors_bytes`.
pub fn load_safetensors(path: &Path) -> Result<(NamedTensors, HashMap<String, String>)> {
    let meta = fs::metadata(path).map_err(|e| io_err(path, e))?;
    if !meta.is_file() {
        return Err(Error::Data {
            path: path.display().to_string(),
            msg: "not a regular file: expected a safetensors file".into(),
        });
    }
    let data = fs::read(path).map_err(|e| io_err(path, e))?;
    from_safetensors_bytes(&path.display().to_string(), &data)
}

pub use crate::nn::{state_dict_mismatch, StateDictMismatch};

/// `model.load_state_dict(state)`, which checks the whole dict first (every name of the
/// model present once, no other names, the same shapes), lists every mismatch in its error
/// and loads nothing unless all of it can be loaded.
pub fn load_state_dict_strict<M: Module + ?Sized>(
    model: &mut M,
    state: &[(String, Tensor)],
) -> Result<()> {
    model.load_state_dict(state)
}
