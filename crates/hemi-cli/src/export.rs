//! `hemi export`: a trained model as an ONNX file (eval mode: batch norms with their running
//! statistics, no dropout), read from a checkpoint as `hemi eval` reads it, or a text model
//! from a Hugging Face directory (`--pretrained`). With `--sample N` it also writes
//! `OUT.sample.safetensors`: N seeded random inputs and hemi's own logits for them, so that
//! a runtime's output can be checked against hemi's (`bench/onnx_check.py`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;
use hemi::data::{Inputs, TextInputs};
use hemi::io::onnx::{encode, ExportOptions, OnnxDType};
use hemi::models::registry::{self, InputKind, ModelSpec};
use hemi::models::{load_pretrained, BertConfig};
use hemi::nn::Module;
use hemi::train::{load_checkpoint, recipe};
use hemi::{DType, Error, Generator, Result, Tensor};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint root written by `hemi train` (its newest complete checkpoint) or one
    /// checkpoint directory.
    #[arg(
        long,
        conflicts_with = "pretrained",
        required_unless_present = "pretrained"
    )]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face BERT directory (config.json, model.safetensors) instead of a
    /// checkpoint; a base-model file (all-MiniLM-L6-v2) leaves the head freshly initialised
    /// from `--seed`.
    #[arg(long)]
    pretrained: Option<PathBuf>,
    /// The text model `--pretrained` builds.
    #[arg(long, default_value = "bert-classifier")]
    model: String,
    /// Classes of the `--pretrained` classifier's head (default: the config's labels).
    #[arg(long)]
    classes: Option<usize>,
    /// Only `onnx`.
    #[arg(long, default_value = "onnx")]
    format: String,
    /// The file to write (atomically: a temporary file beside it, then a rename).
    #[arg(long)]
    out: PathBuf,
    /// Weights stored as f32, or f16 (normalisation layers stay f32; the graph casts the
    /// weights to f32 and computes in f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Also write OUT.sample.safetensors with N random inputs and hemi's logits for them.
    #[arg(long, default_value_t = 0)]
    sample: usize,
    /// Tokens per sample of a text model (some rows are padded shorter).
    #[arg(long, default_value_t = 16)]
    sample_length: usize,
    /// Seeds the sample inputs (and a fresh head of `--pretrained`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// A model ready to export: eval mode, every float tensor F32.
struct Loaded {
    spec: ModelSpec,
    model: Box<dyn Module>,
    /// `[C, H, W]` of an image model.
    image_shape: Option<[usize; 3]>,
    /// The text model's config (vocabulary and sizes for the samples).
    text: Option<BertConfig>,
    metadata: Vec<(String, String)>,
}

fn load(args: &ExportArgs) -> Result<Loaded> {
    let mut metadata = Vec::new();
    let (spec, mut model, image_shape, text) = if let Some(dir) = &args.pretrained {
        let spec = registry::find(&args.model)?;
        if spec.input != InputKind::Text {
            return Err(Error::arg(
                "export",
                format!(
                    "--pretrained builds text models; {} takes images (export its checkpoint)",
                    spec.name
                ),
            ));
        }
        let config_path = dir.join("config.json");
        let mut config = BertConfig::from_file(&config_path)?;
        let classes = args.classes.unwrap_or(config.num_labels());
        if spec.task == "classification" {
            config = config.with_num_labels(classes);
        }
        let mut model = spec.build_text(&config_path, classes, args.seed)?;
        load_pretrained(model.as_mut(), &dir.join("model.safetensors"))?;
        metadata.push(("source".into(), dir.display().to_string()));
        (spec, model, None, Some(config))
    } else {
        let path = args
            .checkpoint
            .as_ref()
            .ok_or_else(|| Error::arg("export", "give --checkpoint DIR (or --pretrained DIR)"))?;
        let ck = load_checkpoint(path)?;
        let spec = registry::find(&ck.info.model)?;
        let precision = hemi::amp::Precision::parse(&ck.info.precision)?;
        let setting = |k: &str| ck.info.settings.get(k);
        let (mut model, image_shape, text) = match spec.input {
            InputKind::Image => {
                let m = spec.build(ck.info.input_shape, ck.info.classes, 0)?;
                // The normalisation `hemi eval` applies, which the file's input expects.
                let (mean, std) = match (setting("normalize.mean"), setting("normalize.std")) {
                    (Some(m), Some(s)) => (
                        recipe::parse_values("normalize.mean", m)?,
                        recipe::parse_values("normalize.std", s)?,
                    ),
                    _ => (vec![0.5], vec![0.5]),
                };
                metadata.push(("normalize.mean".into(), format!("{mean:?}")));
                metadata.push(("normalize.std".into(), format!("{std:?}")));
                (m, Some(ck.info.input_shape), None)
            }
            InputKind::Text => {
                let config = setting("config").ok_or_else(|| {
                    Error::Msg(format!(
                        "checkpoint {}: a text model's run without its config path",
                        ck.dir.display()
                    ))
                })?;
                let config = Path::new(config);
                let m = spec.build_text(config, ck.info.classes, 0)?;
                let mut cfg = BertConfig::from_file(config)?;
                if spec.task == "classification" {
                    cfg = cfg.with_num_labels(ck.info.classes);
                }
                (m, None, Some(cfg))
            }
        };
        precision.prepare_model(model.as_mut())?;
        model.load_state_dict(&ck.model)?;
        metadata.push(("checkpoint".into(), ck.dir.display().to_string()));
        metadata.push(("trained_precision".into(), ck.info.precision.clone()));
        if !ck.info.class_names.is_empty() {
            metadata.push((
                "class_names".into(),
                serde_json::to_string(&ck.info.class_names)
                    .map_err(|e| Error::Msg(format!("class names: {e}")))?,
            ));
        }
        (spec, model, image_shape, text)
    };
    model.set_training(false);
    model.to_dtype(DType::F32, false)?;
    metadata.insert(0, ("model".into(), spec.name.to_string()));
    Ok(Loaded {
        spec,
        model,
        image_shape,
        text,
        metadata,
    })
}

/// `OUT.sample.safetensors` beside `out`.
pub fn sample_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".sample.safetensors");
    out.with_file_name(name)
}

/// `n` seeded random inputs: standard-normal images (normalised data is about that), or
/// token ids with token types and masks, row `i > 0` padded to a random length.
fn sample_inputs(l: &Loaded, n: usize, length: usize, seed: u64) -> Result<Inputs> {
    let mut rng = Generator::new(seed);
    if let Some([c, h, w]) = l.image_shape {
        return Ok(Inputs::Images(Tensor::randn(
            &[n, c, h, w],
            0.0,
            1.0,
            DType::F32,
            &mut rng,
        )?));
    }
    let cfg = l
        .text
        .as_ref()
        .ok_or_else(|| Error::Msg("export: a model with neither images nor text".into()))?;
    let len = length.clamp(1, cfg.max_position_embeddings);
    let pad = cfg.pad_token_id.unwrap_or(0) as i64;
    let (mut ids, mut mask, mut types) = (Vec::new(), Vec::new(), Vec::new());
    for row in 0..n {
        let real = if row == 0 {
            len
        } else {
            1 + (rng.next_u64() % len as u64) as usize
        };
        for j in 0..len {
            let keep = j < real;
            ids.push(if keep {
                (rng.next_u64() % cfg.vocab_size as u64) as i64
            } else {
                pad
            });
            mask.push(keep as i64);
            // A sentence pair: the second half of the real tokens is segment 1.
            types.push((keep && cfg.type_vocab_size > 1 && j >= real / 2) as i64);
        }
    }
    Ok(Inputs::Text(TextInputs {
        input_ids: Tensor::from_vec(ids, &[n, len])?,
        attention_mask: Tensor::from_vec(mask, &[n, len])?,
        token_type_ids: Tensor::from_vec(types, &[n, len])?,
    }))
}

/// `hemi export`.
pub fn run_export(args: ExportArgs) -> Result<()> {
    if args.format != "onnx" {
        return Err(Error::arg(
            "export",
            format!("unknown format {:?}: the only format is onnx", args.format),
        ));
    }
    let dtype = OnnxDType::parse(&args.dtype)?;
    if args.out.is_dir() {
        return Err(Error::Msg(format!(
            "--out {}: is a directory; give a file name (model.onnx)",
            args.out.display()
        )));
    }
    let mut l = load(&args)?;
    let mut metadata = l.metadata.clone();
    metadata.push(("weights_dtype".into(), dtype.name().into()));
    let opts = ExportOptions {
        dtype,
        image_shape: l.image_shape,
        metadata,
    };
    let onnx = hemi::models::onnx::export_onnx(l.spec.name, l.model.as_ref(), &opts)?;
    let bytes = encode(&onnx);
    hemi::io::atomic_write(&args.out, &bytes)?;
    let graph = onnx.graph.as_ref();
    println!(
        "wrote {} ({} {} weights, opset {}, {} nodes, {} initializers, {:.2} MB)",
        args.out.display(),
        l.spec.name,
        dtype.name(),
        hemi::io::onnx::OPSET,
        graph.map_or(0, |g| g.node.len()),
        graph.map_or(0, |g| g.initializer.len()),
        bytes.len() as f64 / 1e6
    );
    if args.sample == 0 {
        return Ok(());
    }
    let inputs = sample_inputs(&l, args.sample, args.sample_length, args.seed)?;
    let _g = hemi::autograd::no_grad();
    // hemi's logits of the F32 model, then of the model the file holds (for f16: its weights
    // rounded to F16 as the file stores them, computed in F32 as the file computes).
    let logits_f32 = l.model.forward_inputs(&inputs)?;
    let logits = match dtype {
        OnnxDType::F32 => logits_f32.clone(),
        OnnxDType::F16 => {
            l.model.to_dtype(DType::F16, true)?;
            l.model.to_dtype(DType::F32, false)?;
            l.model.forward_inputs(&inputs)?
        }
    };
    let mut tensors = match inputs {
        Inputs::Images(x) => vec![("input".to_string(), x)],
        Inputs::Text(t) => vec![
            ("input_ids".to_string(), t.input_ids),
            ("attention_mask".to_string(), t.attention_mask),
            ("token_type_ids".to_string(), t.token_type_ids),
        ],
    };
    tensors.push(("logits".into(), logits));
    tensors.push(("logits_f32".into(), logits_f32));
    let meta = HashMap::from([
        ("model".to_string(), l.spec.name.to_string()),
        ("weights_dtype".to_string(), dtype.name().to_string()),
        ("seed".to_string(), args.seed.to_string()),
    ]);
    let path = sample_path(&args.out);
    hemi::io::save_safetensors(&path, &tensors, Some(meta))?;
    println!(
        "wrote {} ({} inputs; `logits`: hemi's for the file's weights, `logits_f32`: for the \
         F32 model)",
        path.display(),
        args.sample
    );
    Ok(())
}
