//! Inference from a checkpoint: load the weights into a freshly built model, switch it to eval
//! mode, turn gradient recording off, and predict.
//!
//! ```text
//! cargo run --release -p hemi --example inference            # train, save, load, predict
//! cargo run --release -p hemi --example inference -- CK_DIR  # a checkpoint of `hemi train`
//! ```
//!
//! Without an argument it first trains CifarNet for one epoch on 2,560 images of the
//! built-in synthetic set with `hemi::train::train` (Adam, lr 0.001, amp-fp16), which writes
//! a checkpoint directory (`model.safetensors` under PyTorch's names, optimizer state,
//! `state.json`, a SHA-256 manifest) into a temporary directory; it removes it at the end.
//! With an argument it reads that checkpoint instead: a directory written by
//! `hemi train --checkpoint-dir CK_DIR` (its newest checkpoint) or one of its `epoch-NNNN`
//! directories, of a model trained on the synthetic set (for other data use `hemi eval`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use hemi::amp::Precision;
use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform, SYNTHETIC_CLASSES};
use hemi::models::registry;
use hemi::train::recipe::parse_values;
use hemi::train::{load_checkpoint, train, Event, OptimizerKind, RunInfo, TrainConfig};
use hemi::{Error, Result};

fn main() -> Result<()> {
    let (dir, temporary) = match std::env::args().nth(1) {
        Some(d) => (PathBuf::from(d), false),
        None => (train_briefly()?, true),
    };
    let result = predict(&dir);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
        println!("removed {}", dir.display());
    }
    result
}

/// One short epoch of `hemi::train::train` with a checkpoint directory; returns it.
fn train_briefly() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("hemi-inference-{}", std::process::id()));
    let (train_set, test_set) = (
        Synthetic::generate(0, Split::Train, 2560),
        Synthetic::generate(0, Split::Test, 500),
    );
    let info = RunInfo {
        model: "cifar-net".into(),
        dataset: "synthetic".into(),
        input_shape: [3, 32, 32],
        classes: 10,
        class_names: SYNTHETIC_CLASSES.iter().map(|s| s.to_string()).collect(),
        train_len: 2560,
        test_len: 500,
        ..Default::default()
    };
    let train_loader = loader(Arc::new(train_set), &[0.5], &[0.5], true)?;
    let test_loader = loader(Arc::new(test_set), &[0.5], &[0.5], false)?;
    let mut model = registry::build("cifar-net", [3, 32, 32], 10, 0)?;
    let cfg = TrainConfig {
        epochs: 1,
        optimizer: OptimizerKind::Adam,
        lr: 1e-3,
        log_every: 10,
        checkpoint_dir: Some(dir.clone()),
        ..Default::default() // precision amp-fp16
    };
    println!("training cifar-net for 1 epoch on 2560 synthetic images (Adam, lr 0.001, amp-fp16)");
    let start = Instant::now();
    let summary = train(
        model.as_mut(),
        &train_loader,
        &test_loader,
        &cfg,
        &info,
        &mut |e| {
            if let Event::Log {
                epoch, step, loss, ..
            } = e
            {
                println!("[{epoch}, {step:5}] loss: {loss:.3}");
            }
        },
    )?;
    println!(
        "trained in {:.1} s; test accuracy {:.1} %; checkpoint written to {}",
        start.elapsed().as_secs_f64(),
        100.0 * summary.test_accuracy,
        dir.display()
    );
    Ok(dir)
}

/// Loads the checkpoint under `dir` into a new model and classifies the synthetic test images.
fn predict(dir: &Path) -> Result<()> {
    let start = Instant::now();
    let ck = load_checkpoint(dir)?; // checks every file against the manifest
    let info = &ck.info;
    if info.dataset != "synthetic" || info.input_shape != [3, 32, 32] || info.classes != 10 {
        return Err(Error::Msg(format!(
            "{}: a {} model trained on {} {:?}; this example runs on the synthetic set (use \
             `hemi eval --checkpoint` for other data)",
            ck.dir.display(),
            info.model,
            info.dataset,
            info.input_shape
        )));
    }
    // The model as the run built it, in its preset's weight dtype, then the saved weights
    // (strict: every name and shape must match).
    let precision = Precision::parse(&info.precision)?;
    let mut model = registry::build(&info.model, info.input_shape, info.classes, 0)?;
    precision.prepare_model(model.as_mut())?;
    model.load_state_dict(&ck.model)?;
    model.set_training(false); // `model.eval()`: dropout off, BatchNorm's running statistics
    println!(
        "loaded {} ({}, precision {precision}, {} tensors) in {:.2} s",
        ck.dir.display(),
        info.model,
        ck.model.len(),
        start.elapsed().as_secs_f64()
    );

    // The test images as the run normalised them.
    let setting = |k: &str| info.settings.get(k).map(|v| parse_values(k, v));
    let (mean, std) = match (setting("normalize.mean"), setting("normalize.std")) {
        (Some(m), Some(s)) => (m?, s?),
        _ => (vec![0.5], vec![0.5]),
    };
    let len = if info.test_len > 0 {
        info.test_len
    } else {
        500
    };
    let test = loader(
        Arc::new(Synthetic::try_generate(info.seed, Split::Test, len)?),
        &mean,
        &std,
        false,
    )?;

    let _g = hemi::no_grad(); // `torch.no_grad()`: no graph, no saved activations
    let _ac = precision.autocast(); // the forward pass as in training (F16 under amp-fp16)
    let (mut correct, mut total) = (0usize, 0usize);
    let mut per_class = [[0usize; 2]; 10]; // [correct, seen] per true class
    let start = Instant::now();
    for (b, batch) in test.epoch(0).enumerate() {
        let batch = batch?;
        let logits = model.forward(&precision.input(batch.images()?)?)?;
        let probs = logits.softmax(1)?.to_vec_f32(); // [B, 10], F32
        let predicted = logits.argmax(1, false)?.to_vec_i64();
        let labels = batch.labels.to_vec_i64();
        for (i, (&p, &l)) in predicted.iter().zip(&labels).enumerate() {
            if b == 0 && i < 8 {
                println!(
                    "image {:3}: predicted {:<22} p = {:.2}   true: {}",
                    batch.indices[i],
                    SYNTHETIC_CLASSES[p as usize],
                    probs[i * 10 + p as usize],
                    SYNTHETIC_CLASSES[l as usize]
                );
            }
            per_class[l as usize][0] += usize::from(p == l);
            per_class[l as usize][1] += 1;
            correct += usize::from(p == l);
            total += 1;
        }
    }
    println!(
        "accuracy on the {total} test images: {:.1} % ({:.0} images/s)",
        100.0 * correct as f64 / total as f64,
        total as f64 / start.elapsed().as_secs_f64()
    );
    let best = (0..10)
        .max_by_key(|&c| per_class[c][0] * 1000 / per_class[c][1].max(1))
        .unwrap_or(0);
    println!(
        "best class: {} ({} of {})",
        SYNTHETIC_CLASSES[best], per_class[best][0], per_class[best][1]
    );
    Ok(())
}

fn loader(
    data: Arc<dyn hemi::data::Dataset>,
    mean: &[f32],
    std: &[f32],
    shuffle: bool,
) -> Result<DataLoader> {
    DataLoader::new(
        data,
        LoaderConfig {
            batch_size: 128,
            shuffle,
            transform: Transform::new().normalize(mean, std),
            ..Default::default()
        },
    )
}
