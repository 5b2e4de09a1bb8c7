//! `hemi quantize`: INT8 post-training quantisation of a checkpoint, and `hemi eval` of the
//! result.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, ValueEnum};
use serde_json::json;

use hemi::amp::Precision;
use hemi::optim::OptimizerState;
use hemi::quant::{self, Mode, ObserverKind};
use hemi::train::{load_checkpoint, parse_state, Checkpoint};
use hemi::{Error, Result};

use crate::train::{eval_setup, report_eval};

/// The quantised weights in an output directory (beside a copy of the source checkpoint's
/// `state.json`, which names the model, data and settings).
pub const QUANT_FILE: &str = "quantized.safetensors";

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModeArg {
    /// Linear layers' weights INT8; activations quantised per row at run time.
    Dynamic,
    /// Conv2d and Linear weights and activations INT8, scales calibrated on training batches.
    Static,
}

#[derive(Args)]
pub struct QuantizeArgs {
    /// A checkpoint root written by `hemi train --checkpoint-dir` (its newest complete
    /// checkpoint) or one checkpoint directory.
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, value_enum, default_value = "dynamic")]
    mode: ModeArg,
    /// Static mode: training batches (no augmentation) run through the float model to
    /// calibrate the activations' ranges.
    #[arg(long, default_value_t = 32)]
    calib_batches: usize,
    /// Static mode: minmax, moving-average[:C], percentile[:P] (P in percent, default 99.99)
    /// or mse.
    #[arg(long, default_value = "minmax")]
    observer: String,
    /// Output directory: `quantized.safetensors` and the checkpoint's `state.json`.
    #[arg(long)]
    out: PathBuf,
    /// Override the data directory recorded in the checkpoint.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Batch size of calibration and evaluation.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// Skip the float and INT8 test-set evaluations.
    #[arg(long)]
    no_eval: bool,
    /// Also print a JSON summary line.
    #[arg(long)]
    json: bool,
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

pub fn run_quantize(args: QuantizeArgs) -> Result<()> {
    if args.calib_batches == 0 {
        return Err(Error::arg("quantize", "--calib-batches must be at least 1"));
    }
    let observer = ObserverKind::parse(&args.observer)?;
    if args.out.exists() && !args.out.is_dir() {
        return Err(Error::Msg(format!(
            "--out {}: exists and is not a directory",
            args.out.display()
        )));
    }
    let ck = load_checkpoint(&args.checkpoint)?;
    let mut setup = eval_setup(&ck, args.data_dir.clone(), args.batch_size, true)?;
    println!(
        "checkpoint {} (model {}, precision {}), data: {}",
        ck.dir.display(),
        ck.info.model,
        setup.precision,
        setup.description
    );
    let mode = match args.mode {
        ModeArg::Dynamic => Mode::Dynamic,
        ModeArg::Static => Mode::Static,
    };
    // Refused before the float model's evaluation, which can take minutes.
    if mode == Mode::Static && setup.unit != "images" {
        return Err(Error::arg(
            "quantize",
            "static quantisation is implemented for image models; use --mode dynamic",
        ));
    }
    if quant::quantizable_layers(setup.model.as_mut(), mode).is_empty() {
        return Err(Error::arg(
            "quantize",
            format!(
                "{} has no layers {} quantisation takes (it lists no {}); nothing was written",
                ck.info.model,
                mode.name(),
                if mode == Mode::Static {
                    "Conv2d or Linear layers"
                } else {
                    "Linear layers"
                }
            ),
        ));
    }
    let float = if args.no_eval {
        None
    } else {
        print!("float: ");
        Some(report_eval(&mut setup)?)
    };
    let t0 = Instant::now();
    let model = setup.model.as_mut();
    let layers = match mode {
        Mode::Dynamic => quant::quantize_dynamic(model)?,
        Mode::Static => {
            quant::prepare_static(model, observer)?;
            model.set_training(false);
            let _g = hemi::autograd::no_grad();
            let mut seen = 0;
            for batch in setup.train.epoch(0).take(args.calib_batches) {
                let batch = batch?;
                model.forward_inputs(&batch.inputs)?;
                seen += 1;
            }
            println!(
                "calibrated on {seen} training batches of {} (observer {})",
                args.batch_size, args.observer
            );
            quant::convert_static(model)?
        }
    };
    if layers.is_empty() {
        return Err(Error::arg(
            "quantize",
            format!(
                "{} has no layers {} quantisation takes",
                ck.info.model,
                mode.name()
            ),
        ));
    }
    println!(
        "{} quantisation of {} layers in {:.1} s: {}",
        mode.name(),
        layers.len(),
        t0.elapsed().as_secs_f64(),
        layers.join(", ")
    );
    std::fs::create_dir_all(&args.out).map_err(|e| io_err(&args.out, e))?;
    let mut extra = HashMap::new();
    extra.insert("source".to_string(), ck.dir.display().to_string());
    extra.insert("model".to_string(), ck.info.model.clone());
    if mode == Mode::Static {
        extra.insert("observer".to_string(), args.observer.clone());
        extra.insert("calib_batches".to_string(), args.calib_batches.to_string());
    }
    let state_src = ck.dir.join("state.json");
    let state = std::fs::read(&state_src).map_err(|e| io_err(&state_src, e))?;
    hemi::io::atomic_write(&args.out.join("state.json"), &state)?;
    let qpath = args.out.join(QUANT_FILE);
    let qbytes = quant::save_quantized(model, &qpath, &extra)?;
    let fpath = ck.dir.join("model.safetensors");
    let fbytes = std::fs::metadata(&fpath)
        .map_err(|e| io_err(&fpath, e))?
        .len();
    println!(
        "wrote {} ({:.2} MiB; the checkpoint's model.safetensors {:.2} MiB: {:.3}x)",
        qpath.display(),
        qbytes as f64 / 1048576.0,
        fbytes as f64 / 1048576.0,
        qbytes as f64 / fbytes as f64
    );
    // Evaluate what the file holds (embedding tables are INT8 only there): load it back.
    let written = std::fs::read(&qpath).map_err(|e| io_err(&qpath, e))?;
    quant::load_quantized(setup.model.as_mut(), &qpath.display().to_string(), &written)?;
    let int8 = if args.no_eval {
        None
    } else {
        setup.precision = Precision::Fp32;
        print!("int8 {}: ", mode.name());
        Some(report_eval(&mut setup)?)
    };
    if let (Some(f), Some(q)) = (float, int8) {
        println!(
            "accuracy change: {:+.2} points",
            100.0 * (q.accuracy - f.accuracy)
        );
    }
    if args.json {
        println!(
            "{}",
            json!({"kind": "quantize", "mode": mode.name(), "model": ck.info.model,
                   "observer": if mode == Mode::Static { Some(&args.observer) } else { None },
                   "calib_batches": args.calib_batches, "layers": layers.len(),
                   "float_accuracy": float.map(|e| e.accuracy),
                   "int8_accuracy": int8.map(|e| e.accuracy),
                   "float_bytes": fbytes, "int8_bytes": qbytes})
        );
    }
    Ok(())
}

/// `hemi eval` of a directory written by `hemi quantize`.
pub fn eval_quantized(dir: &Path, data_dir: Option<PathBuf>, batch_size: usize) -> Result<()> {
    let state_path = dir.join("state.json");
    let bytes = std::fs::read(&state_path).map_err(|e| io_err(&state_path, e))?;
    let (state, info) = parse_state(&state_path.display().to_string(), &bytes)?;
    let ck = Checkpoint {
        dir: dir.to_path_buf(),
        model: Vec::new(),
        optimizer: OptimizerState {
            optimizer: state.optimizer,
            scalars: Vec::new(),
            buffers: Vec::new(),
        },
        scaler: None,
        epochs_done: state.progress.epochs_done,
        progress: state.progress,
        test_accuracy: state.test_accuracy,
        info,
    };
    let mut setup = eval_setup(&ck, data_dir, batch_size, false)?;
    let qpath = dir.join(QUANT_FILE);
    let data = std::fs::read(&qpath).map_err(|e| io_err(&qpath, e))?;
    let (mode, meta) =
        quant::load_quantized(setup.model.as_mut(), &qpath.display().to_string(), &data)?;
    setup.precision = Precision::Fp32;
    println!(
        "quantised model {} ({} INT8, {} layers, from {}), data: {}",
        qpath.display(),
        mode.name(),
        meta.get("layers").map_or(0, |l| l.split(',').count()),
        meta.get("source").map_or("?", String::as_str),
        setup.description
    );
    report_eval(&mut setup)?;
    Ok(())
}
