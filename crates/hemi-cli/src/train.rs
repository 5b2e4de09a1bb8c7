//! `hemi train` and `hemi eval`: the documents' CIFAR-10 recipe from the command line.

use std::fs::File;
use std::io::IsTerminal;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use hemi::amp::Precision;
use hemi::data::{
    Cifar10, Column, DataLoader, Dataset, ImageFolder, LoaderConfig, MlmConfig, MnistKind, Shard,
    Split, Synthetic, TextColumns,
};
use hemi::dist::{DistConfig, ProcessGroup, ReducerConfig, Wire, ZeroStage};
use hemi::io::tensorboard::SummaryWriter;
use hemi::models::registry::{InputKind, ModelSpec};
use hemi::nn::Module;
use hemi::train::{
    class_difference, load_checkpoint, recipe, train, DivergenceConfig, Event, GradStat,
    Log2Histogram, OptimizerKind, Recipe, RunInfo, Schedule, Summary, TrainConfig,
};
use hemi::{Error, Result};

use crate::text::{load_text_data, text_loaders, TextLoading, TextSources};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DatasetArg {
    /// CIFAR-10 when found under --data-dir, else the built-in synthetic set.
    Auto,
    Synthetic,
    Cifar10,
    ImageFolder,
    Mnist,
    FashionMnist,
    /// Text (the default for text models): `train.tsv` and `dev.tsv` under --data-dir
    /// (GLUE's layout), or for masked-LM a plain text file, one example per line.
    Text,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    Sgd,
    Adam,
    Adamw,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A registered model (`hemi models` lists them): cifar-net, mlp, resnet20, resnet18...
    #[arg(help_heading = "Model and recipe", long, default_value = "cifar-net")]
    model: String,
    /// The kind of data set under --data-dir (auto: CIFAR-10 if found, else the built-in
    /// synthetic set).
    #[arg(help_heading = "Data", long, value_enum, default_value_t = DatasetArg::Auto)]
    dataset: DatasetArg,
    /// Where the data lives: CIFAR-10 binary batches, or `train/` and `test/` class folders
    /// (the layout of the CIFAR-10 JPEG archive), or MNIST IDX files.
    #[arg(help_heading = "Data", long, default_value = "data")]
    data_dir: PathBuf,
    /// A training recipe (`hemi models` lists them); default: the model's own
    /// (`documents` for cifar-net and mlp, `resnet-cifar` for the CIFAR ResNets). The flags
    /// below override its single settings.
    #[arg(help_heading = "Model and recipe", long)]
    recipe: Option<String>,
    /// Default: the recipe's (10 for `documents`, 30 for `resnet-cifar`).
    #[arg(help_heading = "Model and recipe", long)]
    epochs: Option<usize>,
    /// Default: the recipe's (128).
    #[arg(help_heading = "Model and recipe", long)]
    batch_size: Option<usize>,
    /// Default: the recipe's (SGD; AdamW for the BERT recipes).
    #[arg(help_heading = "Optimizer and schedule", long, value_enum)]
    optimizer: Option<OptimizerArg>,
    /// Default: the recipe's (0.001 for `documents`, 0.1 for `resnet-cifar`).
    #[arg(help_heading = "Optimizer and schedule", long)]
    lr: Option<f64>,
    /// Default: the recipe's (0.9).
    #[arg(help_heading = "Optimizer and schedule", long)]
    momentum: Option<f64>,
    /// Default: the recipe's, else the optimizer's own (0; 0.01 for AdamW).
    #[arg(help_heading = "Optimizer and schedule", long)]
    weight_decay: Option<f64>,
    /// Nesterov momentum (SGD): `--nesterov` or `--nesterov false`.
    #[arg(help_heading = "Optimizer and schedule", long, num_args = 0..=1, default_missing_value = "true")]
    nesterov: Option<bool>,
    /// No weight decay on biases and BatchNorm/LayerNorm weights (parameters of rank < 2).
    #[arg(help_heading = "Optimizer and schedule", long, num_args = 0..=1, default_missing_value = "true")]
    no_decay_norm_bias: Option<bool>,
    /// The lr schedule after the warm-up, per step: constant, cosine (to 0 at the end of the
    /// run) or step (x --gamma at each of --milestones epochs).
    #[arg(help_heading = "Optimizer and schedule", long)]
    schedule: Option<String>,
    /// Epochs at which the step schedule multiplies the lr by --gamma, e.g. `82,123`.
    #[arg(help_heading = "Optimizer and schedule", long, value_delimiter = ',')]
    milestones: Vec<usize>,
    /// The step schedule's lr factor at each milestone.
    #[arg(help_heading = "Optimizer and schedule", long, default_value_t = 0.1)]
    gamma: f64,
    /// Linear warm-up over this many epochs (fractions allowed).
    #[arg(help_heading = "Optimizer and schedule", long)]
    warmup_epochs: Option<f64>,
    /// Stop after this many epochs in total, checkpointed as usual; the schedule still spans
    /// --epochs and --resume continues the run (a 30-epoch cosine run looked at after 10).
    #[arg(help_heading = "Model and recipe", long)]
    stop_after: Option<usize>,
    /// Label smoothing ε of the training loss, in [0, 1].
    #[arg(help_heading = "Optimizer and schedule", long)]
    label_smoothing: Option<f64>,
    /// Seed of the initialisation, the data order and the augmentation.
    #[arg(help_heading = "Model and recipe", long, default_value_t = 0)]
    seed: u64,
    /// Compute threads (default: all cores; more than the cores available is capped to
    /// them, with a warning).
    #[arg(help_heading = "Model and recipe", long)]
    threads: Option<usize>,
    /// Where the model trains: cpu, or gpu / gpu:N, a GPU of the wgpu backend (any Vulkan
    /// driver, Mesa's lavapipe included; needs a build with `--features gpu`). Each batch is
    /// uploaded to it while the step before it runs; checkpoints hold host copies and a run
    /// resumes on either device.
    #[arg(help_heading = "Model and recipe", long, default_value = "cpu")]
    device: String,
    /// Data loader threads.
    #[arg(help_heading = "Data", long, default_value_t = 2)]
    workers: usize,
    /// Print the loss every this many batches.
    #[arg(help_heading = "Observation", long, default_value_t = 200)]
    log_every: usize,
    /// Random crop (padding an eighth of the side: 4 on 32x32) and horizontal flip on the
    /// training images: `--augment` or `--augment false` (default: the recipe's).
    #[arg(help_heading = "Data", long, num_args = 0..=1, default_missing_value = "true")]
    augment: Option<bool>,
    /// Size of the built-in synthetic training set.
    #[arg(help_heading = "Data", long, default_value_t = Synthetic::DEFAULT_TRAIN_LEN)]
    synthetic_size: usize,
    /// Size of the built-in synthetic test set (evaluated after every epoch).
    #[arg(help_heading = "Data", long, default_value_t = Synthetic::DEFAULT_TEST_LEN)]
    synthetic_test_size: usize,
    /// Checkpoint root: a checkpoint directory (epoch-0003/...) is written into it after every
    /// epoch and on Ctrl-C. A directory that already holds checkpoints needs --resume.
    #[arg(help_heading = "Checkpoints", long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the newest complete checkpoint in --checkpoint-dir.
    #[arg(help_heading = "Checkpoints", long)]
    resume: bool,
    /// With --resume: settings that may differ from the checkpoint's run, comma-separated
    /// (e.g. `lr,epochs`); any other difference is an error that lists them.
    #[arg(help_heading = "Checkpoints", long, value_delimiter = ',')]
    r#override: Vec<String>,
    /// Keep only the newest N checkpoints.
    #[arg(help_heading = "Checkpoints", long)]
    keep: Option<usize>,
    /// Also keep the checkpoint with the best test accuracy (with --keep).
    #[arg(help_heading = "Checkpoints", long)]
    keep_best: bool,
    /// Write JSON lines of metrics (one per log line, one per epoch) to this file; with
    /// --resume they are appended.
    #[arg(help_heading = "Observation", long)]
    metrics: Option<PathBuf>,
    /// A loss-scaled run stops as diverged when more than this fraction of the last 100 steps
    /// was skipped for inf/NaN gradients (1 never stops).
    #[arg(help_heading = "Precision", long, default_value_t = 0.5)]
    max_skipped_fraction: f64,
    /// No progress bar (log lines only).
    #[arg(help_heading = "Observation", long)]
    quiet: bool,
    /// Precision preset: fp32, amp-fp16 (mixed_float16), amp-bf16 (mixed_bfloat16),
    /// fp16-master, pure-fp16, pure-bf16.
    #[arg(help_heading = "Precision", long, default_value = "amp-fp16", value_parser = parse_precision)]
    precision: Precision,
    /// A precision policy file (JSON) that pins modules or ops to f32, f16 or bf16 over the
    /// preset, e.g. {"modules": {"layer3.1.bn2": "f32"}, "ops": {"softmax": "f32"}}; see
    /// the README. `hemi doctor --search` writes one.
    #[arg(help_heading = "Precision", long)]
    policy: Option<PathBuf>,
    /// Replay this many skipped (inf/NaN) steps with per-op checks and name the op and
    /// module where the overflow started (log line and metrics `"kind": "overflow"`);
    /// later skips are only counted. 0: no replays.
    #[arg(help_heading = "Observation", long, default_value_t = 8)]
    overflow_reports: usize,
    /// Self-healing (amp presets): when the overflow replays name the same module this many
    /// times (or once the loss scale has fallen to 1), pin it to F32 for the rest of the run
    /// and go on; logged, in the metrics (`"kind": "promote"`) and TensorBoard, and recorded
    /// in checkpoints so --resume continues with it. Off unless given (`--auto-promote` alone
    /// means 3).
    #[arg(help_heading = "Precision", long, num_args = 0..=1, default_missing_value = "3")]
    auto_promote: Option<usize>,
    /// Count, per parameter, gradient values F16 could not hold without loss scaling
    /// (|g| < 2^-24 or > 65504); printed at the end.
    #[arg(help_heading = "Observation", long)]
    grad_stats: bool,
    /// Write TensorBoard event files into this directory (`tensorboard --logdir DIR`):
    /// loss, lr, loss scale, skipped steps, images/s per step; test accuracy and loss per
    /// epoch; histograms of parameters and gradients every --histogram-every steps; with
    /// --grad-stats, the share of gradient values F16 loses per epoch.
    #[arg(help_heading = "Observation", long)]
    tensorboard: Option<PathBuf>,
    /// With --tensorboard: histograms of every parameter and its (unscaled) gradient every
    /// this many steps (0: none).
    #[arg(help_heading = "Observation", long, default_value_t = 100)]
    histogram_every: usize,
    /// Text models: a Hugging Face model directory (config.json, model.safetensors,
    /// tokenizer.json) to start from, e.g. ../shared/models/all-MiniLM-L6-v2.
    #[arg(help_heading = "Model and recipe", long)]
    pretrained: Option<PathBuf>,
    /// Text models: a BERT config.json for a freshly initialised model (default:
    /// --pretrained's).
    #[arg(help_heading = "Model and recipe", long)]
    config: Option<PathBuf>,
    /// Text models: a tokenizer.json, or a directory holding one (default: --pretrained's).
    #[arg(help_heading = "Model and recipe", long)]
    tokenizer: Option<PathBuf>,
    /// Text: tokens per sequence at most, special tokens included (longer texts are
    /// truncated); each batch is padded to its longest sequence.
    #[arg(help_heading = "Data", long, default_value_t = 64)]
    max_length: usize,
    /// Text: batch sequences of similar length together (less padding).
    #[arg(help_heading = "Data", long)]
    bucket: bool,
    /// Train on the samples in file order every epoch (PyTorch's `shuffle=False`): for
    /// step-by-step comparisons with another framework fed the same batches.
    #[arg(help_heading = "Data", long)]
    no_shuffle: bool,
    /// Text classification: the column holding the text (a header name, or a 0-based
    /// index for files without a header line).
    #[arg(help_heading = "Data", long, default_value = "sentence")]
    text_column: String,
    /// Text classification: the column holding the label.
    #[arg(help_heading = "Data", long, default_value = "label")]
    label_column: String,
    /// Text classification: the number of classes, when the data uses fewer than it has
    /// (integer labels must be below it). Without it, integer labels must be exactly
    /// 0..N-1 for the N distinct labels in the file.
    #[arg(help_heading = "Data", long)]
    num_classes: Option<usize>,
    /// Masked-LM: the share of tokens chosen as targets (of which 80 % become [MASK], 10 %
    /// a random token, 10 % stay).
    #[arg(help_heading = "Data", long, default_value_t = 0.15)]
    mlm_probability: f64,
    /// Text models: after training, write the model in Hugging Face's layout (config.json,
    /// model.safetensors, tokenizer.json) to this directory, so `transformers` loads it.
    #[arg(help_heading = "Checkpoints", long)]
    save_pretrained: Option<PathBuf>,
    /// Quantisation-aware training from this float checkpoint (a run root or one
    /// checkpoint directory of the same model): its weights are loaded, then every Conv2d
    /// and Linear trains with fake-quantised weights (per channel) and activations (moving
    /// averages of their ranges), straight-through gradients. `hemi quantize --mode static`
    /// turns the result into INT8.
    #[arg(help_heading = "Model and recipe", long, value_name = "CHECKPOINT")]
    qat: Option<PathBuf>,
    /// Activation checkpointing: the model's segments keep only their inputs for the
    /// backward and run their forward again there (the same gradients, bit for bit; less
    /// memory, more time). Optionally which segments: `blocks` (default) or `stages` for
    /// the ResNets, `layers` for BERT (each but the last); other models have none (an
    /// error).
    #[arg(help_heading = "Model and recipe", long, value_name = "SEGMENTS", num_args = 0..=1, default_missing_value = "")]
    checkpoint_activations: Option<String>,
    /// Gradient accumulation: split each batch into this many micro-batches, one backward
    /// each, and step once (1 rank with --micro-batches N trains exactly like N ranks).
    #[arg(help_heading = "Optimizer and schedule", long, default_value_t = 1)]
    micro_batches: usize,
    /// Clip the total 2-norm of the unscaled gradients to this before every step
    /// (PyTorch's clip_grad_norm_ after the scaler's unscale_; the F32 masters' gradients
    /// under fp16-master).
    #[arg(help_heading = "Optimizer and schedule", long, value_name = "MAX_NORM")]
    clip_grad_norm: Option<f64>,
    /// Data parallel (`mpirun -np N hemi train`, a build with `--features mpi`): the dtype
    /// gradients are all-reduced in: f32, f16 (pre-scaled by a power of two so the sum
    /// neither overflows nor underflows) or bf16; sums are always accumulated in F32.
    /// --batch-size is per rank, as with PyTorch's DDP.
    #[arg(help_heading = "Distributed (mpirun, a build with --features mpi)", long, default_value = "f32", value_parser = parse_wire)]
    allreduce: Wire,
    /// Data parallel: gradient bucket size in MiB (DDP's bucket_cap_mb).
    #[arg(
        help_heading = "Distributed (mpirun, a build with --features mpi)",
        long,
        default_value_t = 25.0
    )]
    bucket_mb: f64,
    /// Data parallel: seconds a rank waits for another before the job ends with an error.
    #[arg(
        help_heading = "Distributed (mpirun, a build with --features mpi)",
        long,
        default_value_t = 300.0
    )]
    dist_timeout: f64,
    /// Data parallel: SyncBatchNorm, batch-norm statistics over the batches of all ranks
    /// (default: each rank's own batch, as DDP does; rank 0's running statistics are used
    /// for evaluation and saved).
    #[arg(
        help_heading = "Distributed (mpirun, a build with --features mpi)",
        long
    )]
    sync_bn: bool,
    /// Data parallel: ZeRO stage. 1: each rank keeps the F32 master weights and optimizer
    /// state (momentum, Adam moments) of its shard of the parameters only, updates its
    /// shard after the all-reduce and all-gathers the weights; 2: also reduce-scatters the
    /// gradients, keeping only its shard of them. Bit-identical to 0 (plain data parallel).
    #[arg(
        help_heading = "Distributed (mpirun, a build with --features mpi)",
        long,
        default_value_t = 0,
        value_parser = clap::value_parser!(u8).range(0..=2)
    )]
    zero: u8,
}

fn parse_wire(s: &str) -> std::result::Result<Wire, String> {
    Wire::parse(s).map_err(|e| e.to_string())
}

pub(crate) fn parse_precision(s: &str) -> std::result::Result<Precision, String> {
    Precision::parse(s).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint root written by `hemi train --checkpoint-dir` (its newest complete
    /// checkpoint is used) or one checkpoint directory in it (`ck/epoch-0003`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Override the data directory recorded in the checkpoint.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
}

/// Train and test sets, and a line saying what they are.
struct Data {
    name: &'static str,
    train: Arc<dyn Dataset>,
    test: Arc<dyn Dataset>,
    description: String,
}

fn has_class_folders(dir: &Path) -> bool {
    dir.join("train").is_dir() && dir.join("test").is_dir()
}

/// The synthetic split sizes (train, test), used when `kind` picks the synthetic set.
fn load_data(
    kind: DatasetArg,
    dir: &Path,
    seed: u64,
    (synthetic_size, synthetic_test_size): (usize, usize),
) -> Result<Data> {
    let t0 = Instant::now();
    let folder = |name: &'static str| -> Result<Data> {
        // Opened together: the same classes and one image size, checked before decoding.
        let (train, test) = ImageFolder::open_pair(&dir.join("train"), &dir.join("test"))?;
        let (train, test) = (train.load()?, test.load()?);
        Ok(Data {
            name,
            description: format!(
                "{name} image folders under {} ({} train / {} test images, decoded in {:.1} s)",
                dir.display(),
                train.len(),
                test.len(),
                t0.elapsed().as_secs_f64()
            ),
            train: Arc::new(train),
            test: Arc::new(test),
        })
    };
    let cifar_bin = |located: PathBuf| -> Result<Data> {
        let train = Cifar10::load(&located, Split::Train)?;
        let test = Cifar10::load(&located, Split::Test)?;
        Ok(Data {
            name: "cifar10",
            description: format!(
                "CIFAR-10 binary batches in {} ({} train / {} test images)",
                located.display(),
                train.len(),
                test.len()
            ),
            train: Arc::new(train),
            test: Arc::new(test),
        })
    };
    let synthetic = |why: &str| -> Result<Data> {
        let train = Synthetic::try_generate(seed, Split::Train, synthetic_size)
            .map_err(|e| Error::arg("train", format!("--synthetic-size: {e}")))?;
        let test = Synthetic::try_generate(seed, Split::Test, synthetic_test_size)
            .map_err(|e| Error::arg("train", format!("--synthetic-test-size: {e}")))?;
        Ok(Data {
            name: "synthetic",
            description: format!(
                "the built-in synthetic set ({} train / {} test 32x32 images, 10 classes){why}",
                train.len(),
                test.len()
            ),
            train: Arc::new(train),
            test: Arc::new(test),
        })
    };
    match kind {
        DatasetArg::Synthetic => synthetic(""),
        // A partial copy of CIFAR-10 is an error naming the missing files, never a silent
        // switch to the synthetic set.
        DatasetArg::Auto => match Cifar10::probe(dir)? {
            Some(d) => cifar_bin(d),
            None if has_class_folders(dir) => folder("cifar10"),
            None => synthetic(&format!(
                ": no CIFAR-10 under {} (see README: using real CIFAR-10)",
                dir.display()
            )),
        },
        DatasetArg::Cifar10 => match Cifar10::probe(dir)? {
            Some(d) => cifar_bin(d),
            None if has_class_folders(dir) => folder("cifar10"),
            None => Err(Error::Msg(format!(
                "{}: no CIFAR-10 here: expected data_batch_1..5.bin and test_batch.bin (or \
                 cifar-10-batches-bin/ holding them), or train/ and test/ class folders",
                dir.display()
            ))),
        },
        DatasetArg::ImageFolder => folder("image-folder"),
        DatasetArg::Text => Err(Error::arg(
            "train",
            "--dataset text is for text models (bert-classifier, bert-mlm)",
        )),
        DatasetArg::Mnist | DatasetArg::FashionMnist => {
            let (k, name) = if kind == DatasetArg::Mnist {
                (MnistKind::Mnist, "mnist")
            } else {
                (MnistKind::FashionMnist, "fashion-mnist")
            };
            let train = k.load(dir, Split::Train)?;
            let test = k.load(dir, Split::Test)?;
            Ok(Data {
                name,
                description: format!(
                    "{name} in {} ({} train / {} test images)",
                    dir.display(),
                    train.len(),
                    test.len()
                ),
                train: Arc::new(train),
                test: Arc::new(test),
            })
        }
    }
}

/// The segments `--checkpoint-activations ASKED` names for `model` (`spec`): ASKED, or the
/// model's first granularity when empty; an error naming the model when it has none (and
/// the models that have), or the granularities it has when ASKED is not one.
pub(crate) fn checkpoint_segments(
    spec: &hemi::models::registry::ModelSpec,
    model: &dyn Module,
    asked: &str,
) -> Result<&'static str> {
    let have = model.checkpoint_granularities();
    let Some(&first) = have.first() else {
        let with: Vec<&str> = hemi::models::registry::models()
            .iter()
            .filter(|m| !m.checkpoint.is_empty())
            .map(|m| m.name)
            .collect();
        return Err(Error::arg(
            "--checkpoint-activations",
            format!(
                "model {} has no checkpointed segments (models that have: {})",
                spec.name,
                with.join(", ")
            ),
        ));
    };
    if asked.is_empty() {
        return Ok(first);
    }
    have.iter().copied().find(|g| *g == asked).ok_or_else(|| {
        Error::arg(
            "--checkpoint-activations",
            format!(
                "model {} checkpoints {}, not {asked:?}",
                spec.name,
                have.join(" or ")
            ),
        )
    })
}

pub(crate) fn build_model(
    model: &str,
    shape: [usize; 3],
    classes: usize,
    seed: u64,
) -> Result<Box<dyn Module>> {
    hemi::models::registry::build(model, shape, classes, seed)
}

/// The input normalisation: per channel or one value for all.
struct Normalize {
    mean: Vec<f32>,
    std: Vec<f32>,
}

impl Normalize {
    /// The documents' Normalize(0.5, 0.5), which runs before recipes did used.
    fn half() -> Normalize {
        Normalize {
            mean: vec![0.5],
            std: vec![0.5],
        }
    }

    fn is_half(&self) -> bool {
        self.mean == [0.5] && self.std == [0.5]
    }
}

#[allow(clippy::too_many_arguments)]
fn loaders(
    data: &Data,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    workers: usize,
    augment: bool,
    norm: &Normalize,
) -> Result<(DataLoader, DataLoader)> {
    let side = data.train.image_shape()[2];
    let train_tf = recipe::train_transform(augment, side, &norm.mean, &norm.std);
    let train = DataLoader::new(
        data.train.clone(),
        LoaderConfig {
            batch_size,
            shuffle,
            seed,
            workers,
            transform: train_tf,
            ..Default::default()
        },
    )?;
    let test = DataLoader::new(
        data.test.clone(),
        LoaderConfig {
            batch_size: batch_size.max(256),
            shuffle: false,
            seed,
            workers,
            transform: recipe::eval_transform(&norm.mean, &norm.std),
            ..Default::default()
        },
    )?;
    Ok((train, test))
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`), if known.
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source: e,
    }
}

/// Installs the Ctrl-C / SIGTERM handling of a training run: the first signal sets the
/// returned flag (the loop stops at the next step boundary and checkpoints), a second one
/// exits at once with status 130.
fn stop_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it runs first: with the flag already set, exit now.
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())
            .and_then(|_| signal_hook::flag::register(sig, flag.clone()))
            .map_err(|e| Error::Msg(format!("installing the signal handler: {e}")))?;
    }
    Ok(flag)
}

/// The metrics file, opened on its first line so that a run that fails its checks leaves
/// an existing file as it was; a resumed run appends.
struct Metrics {
    path: PathBuf,
    append: bool,
    file: Option<BufWriter<File>>,
}

impl Metrics {
    fn write(&mut self, line: &serde_json::Value, flush: bool) -> Result<()> {
        let err = |e: std::io::Error| Error::Io {
            path: format!("metrics file {}", self.path.display()),
            source: e,
        };
        if self.file.is_none() {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(self.append)
                .truncate(!self.append)
                .open(&self.path)
                .map_err(err)?;
            self.file = Some(BufWriter::new(f));
        }
        let f = self.file.as_mut().expect("opened above");
        writeln!(f, "{line}").map_err(err)?;
        if flush {
            f.flush().map_err(err)?;
        }
        Ok(())
    }
}

/// A model and its data, ready for `train`.
struct Prepared {
    model: Box<dyn Module>,
    /// Builds the same initial model again (the doctor's copies).
    make: Box<dyn Fn() -> Result<Box<dyn Module>>>,
    train: DataLoader,
    test: DataLoader,
    /// What a sample is called in rates: `images`, `texts`.
    unit: &'static str,
    /// The input side of the recipe line (augmentation and normalisation, or tokenisation).
    inputs_note: String,
    /// How `--save-pretrained` writes the model (text models).
    save: Option<SavePretrained>,
    /// Everything but the model name, seed, precision and settings.
    info: RunInfo,
}

/// `--save-pretrained DIR`: the model in Hugging Face's layout, with its tokenizer.
struct SavePretrained {
    config: hemi::models::BertConfig,
    architecture: &'static str,
    tokenizer: PathBuf,
}

impl SavePretrained {
    fn write(&self, model: &dyn Module, dir: &Path) -> Result<()> {
        hemi::models::save_pretrained(model, &self.config, self.architecture, dir)?;
        std::fs::copy(&self.tokenizer, dir.join("tokenizer.json"))
            .map_err(|e| io_err(&self.tokenizer, e))?;
        Ok(())
    }
}

fn unfinished_info(
    dataset: &str,
    data_dir: Option<PathBuf>,
    input_shape: [usize; 3],
    classes: usize,
    class_names: Vec<String>,
    lens: (usize, usize),
) -> RunInfo {
    RunInfo {
        model: String::new(),
        dataset: dataset.into(),
        data_dir,
        input_shape,
        classes,
        class_names,
        train_len: lens.0,
        test_len: lens.1,
        seed: 0,
        precision: String::new(),
        settings: Default::default(),
    }
}

fn prepare_images(
    args: &TrainArgs,
    recipe: &Recipe,
    batch_size: usize,
    augment: bool,
    data_dir: &Path,
    settings: &mut std::collections::BTreeMap<String, String>,
) -> Result<Prepared> {
    let text_only = [
        ("--pretrained", args.pretrained.is_some()),
        ("--config", args.config.is_some()),
        ("--tokenizer", args.tokenizer.is_some()),
        ("--save-pretrained", args.save_pretrained.is_some()),
        ("--dataset text", args.dataset == DatasetArg::Text),
    ];
    if let Some((flag, _)) = text_only.iter().find(|(_, set)| *set) {
        return Err(Error::arg(
            "train",
            format!(
                "{flag} is for text models (bert-classifier, bert-mlm); {} takes images",
                args.model
            ),
        ));
    }
    let sizes = (args.synthetic_size, args.synthetic_test_size);
    let data = load_data(args.dataset, data_dir, args.seed, sizes)?;
    println!("data: {}", data.description);
    let shape = data.train.image_shape();
    let classes = data.train.num_classes();
    let model = build_model(&args.model, shape, classes, args.seed)?;
    let make = {
        let (name, seed) = (args.model.clone(), args.seed);
        Box::new(move || build_model(&name, shape, classes, seed))
    };
    let (mean, std) = recipe.normalize_for(shape[0])?;
    let norm = Normalize { mean, std };
    let (train, test) = loaders(
        &data,
        batch_size,
        !args.no_shuffle,
        args.seed,
        args.workers,
        augment,
        &norm,
    )?;
    settings.insert("augment".to_string(), augment.to_string());
    if args.no_shuffle {
        settings.insert("shuffle".into(), "false".into());
    }
    if !norm.is_half() {
        // Only when not the documents' (0.5, 0.5): older checkpoints still resume.
        settings.insert(
            "normalize.mean".to_string(),
            recipe::format_values(&norm.mean),
        );
        settings.insert(
            "normalize.std".to_string(),
            recipe::format_values(&norm.std),
        );
    }
    if data.name == "synthetic" {
        settings.insert(
            "synthetic_size".to_string(),
            args.synthetic_size.to_string(),
        );
        // Only when not the default: older checkpoints still resume and evaluate.
        if args.synthetic_test_size != Synthetic::DEFAULT_TEST_LEN {
            settings.insert(
                "synthetic_test_size".to_string(),
                args.synthetic_test_size.to_string(),
            );
        }
    }
    Ok(Prepared {
        model,
        make,
        train,
        test,
        unit: "images",
        inputs_note: format!(
            "augment {augment}, normalize {:?}/{:?}",
            norm.mean, norm.std
        ),
        save: None,
        info: unfinished_info(
            data.name,
            (data.name != "synthetic").then(|| data_dir.to_path_buf()),
            shape,
            classes,
            data.train.class_names().to_vec(),
            (data.train.len(), data.test.len()),
        ),
    })
}

/// A text column flag: a 0-based index when it is a number, else a header name.
fn column(s: &str) -> Column {
    s.parse::<usize>()
        .map_or_else(|_| Column::Name(s.to_string()), Column::Index)
}

fn prepare_text(
    args: &TrainArgs,
    spec: &ModelSpec,
    batch_size: usize,
    data_dir: &Path,
    settings: &mut std::collections::BTreeMap<String, String>,
) -> Result<Prepared> {
    if !matches!(args.dataset, DatasetArg::Auto | DatasetArg::Text) {
        return Err(Error::arg(
            "train",
            format!("{} is a text model: it trains on --dataset text", spec.name),
        ));
    }
    if args.max_length < 2 {
        return Err(Error::arg(
            "train",
            "--max-length must be at least 2 ([CLS] and [SEP])",
        ));
    }
    let mlm = spec.task == "masked-lm";
    let mlm_config = if mlm {
        let p = args.mlm_probability;
        if !(p > 0.0 && p <= 1.0) {
            return Err(Error::arg(
                "train",
                format!("--mlm-probability {p} is not in (0, 1]"),
            ));
        }
        Some(MlmConfig {
            probability: p,
            ..Default::default()
        })
    } else {
        None
    };
    let sources = TextSources::resolve(
        spec.name,
        args.pretrained.as_deref(),
        args.config.as_deref(),
        args.tokenizer.as_deref(),
    )?;
    let tokenizer = Arc::new(sources.tokenizer()?);
    let columns = TextColumns {
        text: column(&args.text_column),
        label: column(&args.label_column),
        header: !(args.text_column.parse::<usize>().is_ok()
            && args.label_column.parse::<usize>().is_ok()),
        num_classes: args.num_classes,
        ..TextColumns::named("sentence", "label")
    };
    let data = load_text_data(data_dir, mlm, &columns)?;
    println!("data: {}", data.description);
    let t0 = Instant::now();
    let (train, test) = text_loaders(
        &data,
        &tokenizer,
        &TextLoading {
            batch_size,
            max_length: args.max_length,
            bucket: args.bucket,
            shuffle: !args.no_shuffle,
            mlm: mlm_config,
            seed: args.seed,
            workers: args.workers,
        },
    )?;
    println!(
        "tokenised with {} in {:.1} s (vocabulary {})",
        sources.tokenizer.display(),
        t0.elapsed().as_secs_f64(),
        tokenizer.vocab_size()
    );
    let classes = if mlm {
        tokenizer.vocab_size()
    } else {
        data.train.num_classes()
    };
    let model = sources.build(spec, classes, &tokenizer, args.seed)?;
    let make: Box<dyn Fn() -> Result<Box<dyn Module>>> = {
        let (src, name, seed) = (sources.clone(), spec.name, args.seed);
        let tok = tokenizer.clone();
        Box::new(move || src.build(&hemi::models::registry::find(name)?, classes, &tok, seed))
    };
    match &sources.weights {
        Some(w) => println!("weights: {}", w.display()),
        None => println!("weights: fresh, from {}", sources.config.display()),
    }
    sources.record(settings);
    settings.insert("max_length".into(), args.max_length.to_string());
    settings.insert("bucket".into(), args.bucket.to_string());
    if args.no_shuffle {
        // Only when set: checkpoints of shuffled runs (all older ones) still resume.
        settings.insert("shuffle".into(), "false".into());
    }
    if mlm {
        settings.insert("mlm_probability".into(), args.mlm_probability.to_string());
    } else {
        settings.insert("text_column".into(), args.text_column.clone());
        settings.insert("label_column".into(), args.label_column.clone());
        if let Some(k) = args.num_classes {
            settings.insert("num_classes".into(), k.to_string());
        }
    }
    let save = match spec.architecture {
        Some(architecture) => Some(SavePretrained {
            config: sources.bert_config(spec, classes)?,
            architecture,
            tokenizer: sources.tokenizer.clone(),
        }),
        None => None,
    };
    let class_names = if mlm {
        Vec::new()
    } else {
        data.train.class_names().to_vec()
    };
    Ok(Prepared {
        model,
        make,
        train,
        test,
        unit: "texts",
        inputs_note: format!(
            "max length {}{}{}",
            args.max_length,
            if args.bucket { ", length buckets" } else { "" },
            mlm_config.map_or(String::new(), |m| format!(
                ", {} % of tokens masked (80/10/10)",
                100.0 * m.probability
            ))
        ),
        save,
        info: unfinished_info(
            data.name,
            Some(data_dir.to_path_buf()),
            [1, 1, args.max_length],
            classes,
            class_names,
            (data.train.len(), data.test.len()),
        ),
    })
}

pub fn run_train(args: TrainArgs) -> Result<()> {
    if !(args.dist_timeout > 0.0 && args.dist_timeout.is_finite()) {
        return Err(Error::arg("train", "--dist-timeout must be > 0 seconds"));
    }
    if !(args.bucket_mb > 0.0 && args.bucket_mb.is_finite()) {
        return Err(Error::arg("train", "--bucket-mb must be > 0"));
    }
    // HEMI_COUNT_HEAP=1: every rank reports its peak heap and optimizer state at the end (the
    // ZeRO memory figures; counting costs two atomic additions per allocation).
    if std::env::var_os("HEMI_COUNT_HEAP").is_some() {
        crate::alloc::count_heap();
    }
    let group = crate::dist::setup(Duration::from_secs_f64(args.dist_timeout))?;
    let result = run_train_on(args, group.clone(), None);
    match (&result, &group) {
        (Err(Error::Interrupted(_)), _) | (Ok(()), _) | (_, None) => result,
        (Err(e), Some(g)) => {
            crate::dist::fail(g, e);
            result
        }
    }
}

/// `hemi doctor`: the run `args` describes, diagnosed instead of trained.
pub fn run_doctor(args: TrainArgs, opts: &crate::doctor::DoctorOpts) -> Result<()> {
    run_train_on(args, None, Some(opts))
}

fn run_train_on(
    args: TrainArgs,
    group: Option<Arc<ProcessGroup>>,
    doctor: Option<&crate::doctor::DoctorOpts>,
) -> Result<()> {
    let root = group.as_ref().is_none_or(|g| g.rank() == 0);
    // First, so that a Ctrl-C during data loading is already a clean stop.
    let stop = stop_flag()?;
    // An unknown model or recipe name fails before any data is read.
    let spec = hemi::models::registry::find(&args.model)?;
    let recipe = Recipe::find(args.recipe.as_deref().unwrap_or(spec.recipe))?;
    let schedule = match &args.schedule {
        Some(name) => Schedule::parse(name, &args.milestones, args.gamma)?,
        None if !args.milestones.is_empty() => {
            return Err(Error::arg("train", "--milestones needs --schedule step"))
        }
        None => recipe.schedule.clone(),
    };
    let epochs = args.epochs.unwrap_or(recipe.epochs);
    let batch_size = args.batch_size.unwrap_or(recipe.batch_size);
    let lr = args.lr.unwrap_or(recipe.lr);
    let momentum = args.momentum.unwrap_or(recipe.momentum);
    let augment = args.augment.unwrap_or(recipe.augment);
    // Before any data is read, as the other flags' checks.
    let device: hemi::Device = args.device.parse()?;
    if args.resume && args.checkpoint_dir.is_none() {
        return Err(Error::arg("train", "--resume needs --checkpoint-dir"));
    }
    if !args.r#override.is_empty() && !args.resume {
        return Err(Error::arg("train", "--override only applies with --resume"));
    }
    if let Some(p) = &args.tensorboard {
        if p.exists() && !p.is_dir() {
            return Err(Error::Msg(format!(
                "--tensorboard {}: exists and is not a directory",
                p.display()
            )));
        }
    }
    if let Some(p) = &args.metrics {
        if p.is_dir() {
            return Err(Error::Msg(format!(
                "metrics file {}: is a directory",
                p.display()
            )));
        }
    }
    // Ranks sharing a machine share its cores (torchrun sets OMP_NUM_THREADS=1 for the
    // same reason): without --threads each takes cores / ranks on this machine.
    let threads = match args.threads {
        Some(t) => Some(crate::cap_threads(t)?),
        None => group.as_ref().map(|_| crate::dist::threads_per_rank()),
    };
    if let Some(t) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .map_err(|e| Error::Msg(format!("--threads {t}: {e}")))?;
    }
    let data_dir = std::path::absolute(&args.data_dir).map_err(|e| io_err(&args.data_dir, e))?;
    let task = hemi::train::find_task(spec.task)?;
    let mut settings = std::collections::BTreeMap::new();
    settings.insert("batch_size".to_string(), batch_size.to_string());
    if args.num_classes.is_some() && spec.input != InputKind::Text {
        return Err(Error::arg(
            "train",
            format!(
                "--num-classes applies to text classification data; {}'s classes are the \
                 data set's",
                spec.name
            ),
        ));
    }
    let prepared = match spec.input {
        InputKind::Image => prepare_images(
            &args,
            &recipe,
            batch_size,
            augment,
            &data_dir,
            &mut settings,
        )?,
        InputKind::Text => prepare_text(&args, &spec, batch_size, &data_dir, &mut settings)?,
    };
    let Prepared {
        mut model,
        make,
        train: mut train_loader,
        test: mut test_loader,
        unit,
        inputs_note,
        save,
        info: partial,
    } = prepared;
    if let Some(from) = &args.qat {
        let ck = load_checkpoint(from)?;
        if ck.info.model != args.model {
            return Err(Error::arg(
                "train",
                format!(
                    "--qat {}: a {} checkpoint, not {}",
                    from.display(),
                    ck.info.model,
                    args.model
                ),
            ));
        }
        // A resumed QAT run takes its weights from its own checkpoint instead.
        if !args.resume {
            model.load_state_dict(&ck.model)?;
        }
        let layers = hemi::quant::prepare_qat(model.as_mut())?;
        println!(
            "QAT: fake quantisation on {} layers ({}), float weights from {}",
            layers.len(),
            layers.join(", "),
            ck.dir.display()
        );
        settings.insert("qat".into(), ck.dir.display().to_string());
    }
    if let Some(asked) = &args.checkpoint_activations {
        let g = checkpoint_segments(&spec, model.as_ref(), asked)?;
        model.set_activation_checkpointing(Some(g))?;
        println!("activation checkpointing: {} {g}", args.model);
        settings.insert("checkpoint_activations".into(), g.into());
    }
    let dist = match &group {
        Some(g) => {
            let (rank, world) = (g.rank(), g.size());
            // Every rank takes every N-th sample of the seeded order (DistributedSampler):
            // padded for training, so all ranks run the same number of steps; exact for the
            // test set, whose counts are summed over the ranks.
            train_loader = train_loader.sharded(Shard {
                rank,
                world,
                pad: true,
            })?;
            test_loader = test_loader.sharded(Shard {
                rank,
                world,
                pad: false,
            })?;
            println!(
                "data parallel: {world} ranks x batch {batch_size} = global batch {}, \
                 all-reduce in {} (F32 sums), buckets of {} MiB",
                world * batch_size,
                args.allreduce.name(),
                args.bucket_mb
            );
            if let Some(line) = crate::dist::hosts_line(g.hosts()) {
                println!("{line}");
            }
            if args.sync_bn {
                let n = hemi::dist::convert_sync_batch_norm(model.as_mut(), g);
                if n == 0 {
                    return Err(Error::arg(
                        "train",
                        format!("--sync-bn: {} has no BatchNorm2d layers", args.model),
                    ));
                }
                println!("SyncBatchNorm: {n} batch norms use the statistics of all ranks");
                settings.insert("sync_bn".into(), "true".into());
            }
            let zero = ZeroStage::from_number(args.zero)?;
            if zero != ZeroStage::Off {
                println!(
                    "ZeRO stage {}: rank {rank} keeps the optimizer state and F32 masters{} of \
                     its 1/{world} shard",
                    args.zero,
                    if args.zero == 2 { " and gradients" } else { "" }
                );
            }
            Some(DistConfig {
                group: g.clone(),
                reducer: ReducerConfig {
                    wire: args.allreduce,
                    bucket_bytes: ((args.bucket_mb * (1 << 20) as f64) as usize).max(1),
                },
                zero,
            })
        }
        None if args.zero != 0 => {
            return Err(Error::arg(
                "train",
                format!(
                    "--zero {} shards the optimizer state over the ranks of a data-parallel \
                     run; this run has one rank (start it with mpirun -np N, N >= 2, from a \
                     build with --features mpi)",
                    args.zero
                ),
            ))
        }
        None => None,
    };
    let optimizer = match args.optimizer {
        None => recipe.optimizer,
        Some(OptimizerArg::Sgd) => OptimizerKind::Sgd,
        Some(OptimizerArg::Adam) => OptimizerKind::Adam,
        Some(OptimizerArg::Adamw) => OptimizerKind::AdamW,
    };
    if device != hemi::Device::Cpu {
        if doctor.is_some() {
            return Err(Error::arg(
                "doctor",
                format!("--device {device}: the doctor replays on the CPU only (--device cpu)"),
            ));
        }
        model.to_device(device)?;
        println!("device: {device}");
    }
    let cfg = TrainConfig {
        epochs,
        optimizer,
        lr,
        momentum,
        weight_decay: args.weight_decay.or(recipe.weight_decay),
        nesterov: args.nesterov.unwrap_or(recipe.nesterov),
        no_decay_norm_bias: args.no_decay_norm_bias.unwrap_or(recipe.no_decay_norm_bias),
        schedule,
        warmup_epochs: args.warmup_epochs.unwrap_or(recipe.warmup_epochs),
        label_smoothing: args.label_smoothing.unwrap_or(recipe.label_smoothing),
        log_every: args.log_every,
        checkpoint_dir: args.checkpoint_dir.clone(),
        resume: args.resume,
        overrides: args.r#override.clone(),
        keep: args.keep,
        keep_best: args.keep_best,
        stop: Some(stop),
        divergence: DivergenceConfig {
            max_skipped_fraction: args.max_skipped_fraction,
            ..Default::default()
        },
        stop_after: args.stop_after,
        precision: args.precision,
        grad_stats: args.grad_stats,
        tensors_every: if args.tensorboard.is_some() {
            args.histogram_every
        } else {
            0
        },
        seed: args.seed,
        task,
        dist,
        micro_batches: args.micro_batches,
        inject_inf: crate::dist::inject_inf()?,
        policy: load_policy(args.policy.as_deref())?,
        overflow_reports: args.overflow_reports,
        auto_promote: args.auto_promote,
        clip_grad_norm: args.clip_grad_norm,
        ..Default::default()
    };
    let model_name = args.model.as_str();
    let test_len = partial.test_len;
    let info = RunInfo {
        model: model_name.into(),
        seed: args.seed,
        precision: args.precision.name().into(),
        settings,
        ..partial
    };
    println!(
        "model: {model_name} ({} parameters), {} threads, precision {}, cpu {}",
        model.num_parameters(),
        rayon::current_num_threads(),
        args.precision,
        hemi::cpu::features::describe(&hemi::cpu::features::current()),
    );
    println!(
        "recipe {}: {} lr {} momentum {}{}, weight decay {}{}, batch {batch_size}, {epochs} \
         epochs, schedule {}{}{}, {inputs_note}",
        recipe.name,
        optimizer.name(),
        cfg.lr,
        cfg.momentum,
        if cfg.nesterov { " (nesterov)" } else { "" },
        cfg.weight_decay.map_or("default".into(), |w| w.to_string()),
        if cfg.no_decay_norm_bias {
            " (not on biases and norms)"
        } else {
            ""
        },
        cfg.schedule.describe(),
        if cfg.warmup_epochs > 0.0 {
            format!(" after {} warm-up epochs", cfg.warmup_epochs)
        } else {
            String::new()
        },
        if cfg.label_smoothing > 0.0 {
            format!(", label smoothing {}", cfg.label_smoothing)
        } else {
            String::new()
        },
    );
    if let Some(opts) = doctor {
        drop(model);
        return crate::doctor::run(opts, &*make, &train_loader, &cfg);
    }
    let perplexity = cfg.task.reports_perplexity();
    let mut last_test_loss = f64::NAN;
    let precision = args.precision;
    let show_scale = precision.loss_scaling();
    let mut metrics = args.metrics.as_ref().filter(|_| root).map(|p| Metrics {
        path: p.clone(),
        append: args.resume,
        file: None,
    });
    // The bar only on a terminal: a hidden bar would swallow the log lines.
    let use_bar = root && !args.quiet && std::io::stderr().is_terminal();
    let mut bar: Option<ProgressBar> = None;
    let mut bar_start = Instant::now();
    let mut bar_images = 0usize;
    let mut running = 0.0;
    let mut batches = 0usize;
    let mut write_err: Option<Error> = None;
    let mut tb: Option<SummaryWriter> = None;
    let mut promoted_total = 0usize;
    let mut on_event = |ev: &Event| match ev {
        Event::Start {
            first_epoch,
            epochs,
            batches_per_epoch,
            batches_done,
        } => {
            batches = *batches_per_epoch;
            // Created here, after the run's checks: a run that fails them writes nothing.
            if let Some(dir) = args.tensorboard.as_ref().filter(|_| root) {
                match SummaryWriter::create(dir) {
                    Ok(w) => tb = Some(w),
                    Err(e) => {
                        write_err.get_or_insert(e);
                    }
                }
            }
            if *batches_done > 0 {
                println!(
                    "resuming at epoch {first_epoch} of {epochs}, after batch {batches_done} of \
                     {batches_per_epoch}"
                );
            } else if *first_epoch > 1 {
                println!("resuming at epoch {first_epoch} of {epochs}");
            }
        }
        Event::Batch {
            epoch,
            batch,
            global_step,
            lr,
            loss,
            images,
            scale,
            skipped,
        } => {
            if let Some(w) = tb.as_mut() {
                let mut points = vec![("train/lr", *lr)];
                if loss.is_finite() {
                    points.push(("train/loss", *loss));
                }
                if show_scale {
                    points.push(("train/loss_scale", *scale));
                    points.push(("train/skipped_steps", *skipped as f64));
                }
                for (tag, v) in points {
                    if let Err(e) = w.add_scalar(tag, v, *global_step) {
                        write_err.get_or_insert(e);
                    }
                }
            }
            if !use_bar {
                return;
            }
            if bar.is_none() {
                let b = ProgressBar::new(batches as u64);
                b.set_style(
                    ProgressStyle::with_template(
                        "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({eta})",
                    )
                    .expect("static template")
                    .progress_chars("=> "),
                );
                b.set_prefix(epoch.to_string());
                bar = Some(b);
                bar_start = Instant::now();
                bar_images = 0;
                running = *loss;
            }
            running = 0.98 * running + 0.02 * loss;
            bar_images += images;
            if let Some(b) = &bar {
                b.set_position(*batch as u64);
                let scale = if show_scale {
                    format!(", scale {scale}, skipped {skipped}")
                } else {
                    String::new()
                };
                b.set_message(format!(
                    "{:.0} {unit}/s, loss {running:.3}{scale}",
                    bar_images as f64 / bar_start.elapsed().as_secs_f64().max(1e-9)
                ));
            }
        }
        Event::Log {
            epoch,
            step,
            global_step,
            loss,
            lr,
            images_per_s,
            scale,
            skipped,
        } => {
            let mut line = format!("[{epoch}, {step:5}] loss: {loss:.3}");
            if show_scale {
                line += &format!("  (scale {scale}, skipped {skipped})");
            }
            match &bar {
                Some(b) => b.suspend(|| println!("{line}")),
                None => println!("{line}"),
            }
            if let Some(m) = metrics.as_mut() {
                // JSON has no NaN: a non-finite loss is written as null.
                let j = json!({"kind": "step", "epoch": epoch, "step": step,
                               "global_step": global_step, "loss": loss, "lr": lr,
                               "images_per_s": images_per_s, "scale": scale, "skipped": skipped});
                if let Err(e) = m.write(&j, false) {
                    write_err.get_or_insert(e);
                }
            }
            if let Some(w) = tb.as_mut() {
                if let Err(e) = w.add_scalar("train/images_per_s", *images_per_s, *global_step) {
                    write_err.get_or_insert(e);
                }
            }
        }
        Event::Overflow {
            epoch,
            batch,
            global_step,
            scale,
            message,
            reports_left,
            ..
        } => {
            let mut line = format!("[{epoch}, {batch:5}] step {global_step} overflow: {message}");
            if *reports_left == 0 {
                line += " (no more overflow replays in this run: --overflow-reports)";
            }
            match &bar {
                Some(b) => b.suspend(|| eprintln!("{line}")),
                None => eprintln!("{line}"),
            }
            if let Some(m) = metrics.as_mut() {
                let j = overflow_json(ev);
                if let Err(e) = m.write(&j, true) {
                    write_err.get_or_insert(e);
                }
            }
            if let Some(w) = tb.as_mut() {
                // The step's finding is in the log and the metrics; TensorBoard marks it.
                if let Err(e) = w.add_scalar("train/overflow_replayed", *scale, *global_step) {
                    write_err.get_or_insert(e);
                }
            }
        }
        Event::Promoted {
            global_step,
            modules,
            reason,
        } => {
            let line = format!(
                "step {global_step}: auto-promote: {} now in F32 ({reason})",
                modules.join(", ")
            );
            match &bar {
                Some(b) => b.suspend(|| eprintln!("{line}")),
                None => eprintln!("{line}"),
            }
            promoted_total += modules.len();
            if let Some(m) = metrics.as_mut() {
                let j = json!({"kind": "promote", "global_step": global_step,
                               "modules": modules, "reason": reason});
                if let Err(e) = m.write(&j, true) {
                    write_err.get_or_insert(e);
                }
            }
            if let Some(w) = tb.as_mut() {
                if let Err(e) = w.add_scalar(
                    "train/promoted_modules",
                    promoted_total as f64,
                    *global_step,
                ) {
                    write_err.get_or_insert(e);
                }
            }
        }
        Event::GradStats {
            epoch,
            global_step,
            scale,
            stats,
        } => {
            if let Some(m) = metrics.as_mut() {
                let j = grad_stats_json(*epoch, *global_step, *scale, stats);
                if let Err(e) = m.write(&j, true) {
                    write_err.get_or_insert(e);
                }
            }
            if let Some(w) = tb.as_mut() {
                let mut all = Log2Histogram::default();
                stats.iter().for_each(|s| all.merge(&s.log2));
                // A power-of-two scale shifts the binades F16 holds.
                let shift = scale.log2().round() as i32;
                for (tag, v) in [
                    ("grad_stats/f16_lost_unscaled", all.f16_lost_share(0)),
                    ("grad_stats/f16_lost_scaled", all.f16_lost_share(shift)),
                ] {
                    if let Err(e) = w.add_scalar(tag, v, *global_step) {
                        write_err.get_or_insert(e);
                    }
                }
            }
        }
        Event::Tensors {
            global_step,
            tensors,
        } => {
            if let Some(w) = tb.as_mut() {
                for (name, p, g) in tensors {
                    let r = w
                        .add_histogram(&format!("params/{name}"), &p.to_vec_f32(), *global_step)
                        .and_then(|()| match g {
                            Some(g) => w.add_histogram(
                                &format!("grads/{name}"),
                                &g.to_vec_f32(),
                                *global_step,
                            ),
                            None => Ok(()),
                        });
                    if let Err(e) = r {
                        write_err.get_or_insert(e);
                    }
                }
            }
        }
        Event::Epoch {
            epoch,
            train_loss,
            test_accuracy,
            test_loss,
            seconds,
            images_per_s,
        } => {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
            last_test_loss = *test_loss;
            if perplexity {
                println!(
                    "epoch {epoch}: train loss {train_loss:.3}, held-out MLM loss {test_loss:.4}, \
                     perplexity {:.2}, masked-token accuracy {:.2} %, {seconds:.1} s, \
                     {images_per_s:.0} {unit}/s",
                    test_loss.exp(),
                    100.0 * test_accuracy
                );
            } else {
                println!(
                    "epoch {epoch}: train loss {train_loss:.3}, test accuracy {:.2} %, {seconds:.1} s, {images_per_s:.0} {unit}/s",
                    100.0 * test_accuracy
                );
            }
            if let Some(w) = tb.as_mut() {
                let step = (*epoch * batches) as u64;
                let r = [
                    ("epoch/train_loss", *train_loss),
                    ("epoch/test_accuracy", *test_accuracy),
                    ("epoch/test_loss", *test_loss),
                    ("epoch/images_per_s", *images_per_s),
                ]
                .into_iter()
                .filter(|(_, v)| v.is_finite())
                .try_for_each(|(tag, v)| w.add_scalar(tag, v, step))
                .and_then(|()| w.flush());
                if let Err(e) = r {
                    write_err.get_or_insert(e);
                }
            }
            if let Some(m) = metrics.as_mut() {
                let j = json!({"kind": "epoch", "epoch": epoch, "train_loss": train_loss,
                               "test_accuracy": test_accuracy, "test_loss": test_loss,
                               "seconds": seconds,
                               "images_per_s": images_per_s, "precision": precision.name()});
                if let Err(e) = m.write(&j, true) {
                    write_err.get_or_insert(e);
                }
            }
        }
    };
    if perplexity && !args.resume {
        // The starting point the run's held-out perplexity is compared against.
        let e = hemi::train::evaluate_task(
            model.as_mut(),
            &test_loader,
            Precision::Fp32,
            cfg.task.as_ref(),
        )?;
        println!(
            "before training (fp32): held-out MLM loss {:.4}, perplexity {:.2}, masked-token \
             accuracy {:.2} %",
            e.loss,
            e.perplexity(),
            100.0 * e.accuracy
        );
    }
    let result = train(
        model.as_mut(),
        &train_loader,
        &test_loader,
        &cfg,
        &info,
        &mut on_event,
    );
    if let Some(b) = bar.take() {
        b.finish_and_clear();
    }
    if let Some(m) = metrics.as_mut().and_then(|m| m.file.as_mut()) {
        let _ = m.flush();
    }
    if let Some(w) = tb.as_mut() {
        if let Err(e) = w.flush() {
            write_err.get_or_insert(e);
        }
    }
    let summary = result?;
    if let Some(e) = write_err {
        return Err(e);
    }
    println!("Finished Training");
    if perplexity {
        println!(
            "Held-out masked-LM loss {last_test_loss:.4}, perplexity {:.2}, masked-token \
             accuracy {:.2} % ({test_len} texts)",
            last_test_loss.exp(),
            100.0 * summary.test_accuracy
        );
    } else {
        println!(
            "Accuracy of the network on the {test_len} test {unit}: {:.0} %",
            100.0 * summary.test_accuracy
        );
    }
    println!(
        "summary: {} epochs in {:.1} s of training, {:.0} {unit}/s, peak memory {}",
        summary.epochs_run,
        summary.train_seconds,
        summary.images_per_s(),
        peak_rss_mib().map_or("unknown".into(), |m| format!("{m:.0} MiB"))
    );
    if let Some(c) = &summary.comm {
        let steps = summary.steps.max(1) as f64;
        println!(
            "communication (rank 0): {:.2} MB sent per step in {:.1} messages, {:.1} ms per \
             step waiting for the other ranks; global {:.0} {unit}/s",
            c.bytes_sent as f64 / steps / 1e6,
            c.messages as f64 / steps,
            c.wait_nanos as f64 / steps / 1e6,
            summary.images_per_s() * group.as_ref().map_or(1, |g| g.size()) as f64
        );
    }
    if std::env::var_os("HEMI_COUNT_HEAP").is_some() {
        // stderr: ranks other than 0 print nothing on stdout.
        eprintln!(
            "memory (rank {}): peak heap {:.1} MiB, optimizer state {:.1} MiB, ZeRO shard \
             copies {:.1} MiB",
            group.as_ref().map_or(0, |g| g.rank()),
            crate::alloc::reset_heap_peak() as f64 / (1 << 20) as f64,
            summary.optimizer_bytes as f64 / (1 << 20) as f64,
            summary.shard_bytes as f64 / (1 << 20) as f64
        );
    }
    if let (Some(dir), Some(save), true) = (&args.save_pretrained, &save, root) {
        save.write(model.as_ref(), dir)?;
        println!("saved in Hugging Face's layout to {}", dir.display());
    }
    print_precision_summary(&summary);
    Ok(())
}

/// An `Event::Overflow` as a metrics line (`"kind": "overflow"`).
fn overflow_json(ev: &Event) -> serde_json::Value {
    let Event::Overflow {
        epoch,
        batch,
        global_step,
        scale,
        forward,
        backward,
        message,
        ..
    } = ev
    else {
        return json!(null);
    };
    let fwd = forward.as_ref().map(|f| {
        json!({"op": f.op, "module": f.module, "dtype": f.dtype.to_string(), "index": f.index,
               "input_max_abs": f.input_max_abs, "nonfinite": f.nonfinite, "nan": f.nan})
    });
    let bwd = backward.as_ref().map(|b| {
        json!({"op": b.op, "module": b.module, "param": b.param, "dtype": b.dtype.to_string(),
               "index": b.index})
    });
    json!({"kind": "overflow", "epoch": epoch, "batch": batch, "global_step": global_step,
           "scale": scale, "forward": fwd, "backward": bwd, "message": message})
}

/// Reads `--policy`; a policy that pins nothing is a warning.
fn load_policy(path: Option<&std::path::Path>) -> Result<Option<hemi::amp::PrecisionPolicy>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let p = hemi::amp::PrecisionPolicy::load(path)?;
    if p.is_empty() {
        eprintln!(
            "warning: the policy {} pins nothing; the run uses the preset as it is",
            path.display()
        );
    }
    Ok(Some(p))
}

/// One epoch's `--grad-stats` as a metrics line (`"kind": "grad_stats"`): per parameter the
/// counts of `floor(log2 |g|)` over the unscaled gradients of every step of the epoch, as
/// `counts[i]` for exponent `e_lo + i` (only the span holding values), with the zeros and
/// non-finite values apart; `scale` is the loss scale at the epoch's end. `hemi plot` draws it.
fn grad_stats_json(
    epoch: usize,
    global_step: u64,
    scale: f64,
    stats: &[GradStat],
) -> serde_json::Value {
    let layers: Vec<serde_json::Value> = stats
        .iter()
        .map(|s| {
            let h = &s.log2;
            let first = h.counts.iter().position(|&c| c > 0);
            let last = h.counts.iter().rposition(|&c| c > 0);
            let (e_lo, counts) = match (first, last) {
                (Some(a), Some(b)) => (Log2Histogram::E_MIN + a as i32, h.counts[a..=b].to_vec()),
                _ => (0, Vec::new()),
            };
            json!({"name": s.name, "values": s.values, "underflow": s.underflow,
                   "overflow": s.overflow, "zeros": h.zeros, "nonfinite": h.nonfinite,
                   "e_lo": e_lo, "counts": counts})
        })
        .collect();
    json!({"kind": "grad_stats", "epoch": epoch, "global_step": global_step, "scale": scale,
           "layers": layers})
}

/// The end-of-run numerics: skipped steps, final scale, and with --grad-stats the F16
/// range of the gradients per parameter.
fn print_precision_summary(s: &Summary) {
    println!(
        "precision {}: {} of {} steps skipped ({:.2} %), final loss scale {}",
        s.precision,
        s.skipped_steps,
        s.steps,
        100.0 * s.skipped_fraction(),
        s.final_scale
    );
    if s.grad_stats.is_empty() {
        return;
    }
    println!(
        "gradient values F16 cannot hold without loss scaling (unscaled gradients, all steps):"
    );
    println!(
        "  {:<16} {:>14} {:>14} {:>9} {:>10}",
        "parameter", "values", "underflow", "%", "overflow"
    );
    for g in &s.grad_stats {
        println!(
            "  {:<16} {:>14} {:>14} {:>8.3}% {:>10}",
            g.name,
            g.values,
            g.underflow,
            100.0 * g.underflow as f64 / g.values.max(1) as f64,
            g.overflow
        );
    }
}

/// What evaluating (or calibrating) a checkpoint needs: its float model with the saved
/// weights, the train and test loaders its settings name, the task.
pub(crate) struct EvalSetup {
    pub model: Box<dyn Module>,
    pub train: DataLoader,
    pub test: DataLoader,
    pub precision: Precision,
    pub task: Arc<dyn hemi::train::Task>,
    pub description: String,
    pub test_len: usize,
    /// "images" or "texts".
    pub unit: &'static str,
    pub masked_lm: bool,
}

pub fn run_eval(args: EvalArgs) -> Result<()> {
    if args.checkpoint.join(crate::quant::QUANT_FILE).exists() {
        return crate::quant::eval_quantized(
            &args.checkpoint,
            args.data_dir.clone(),
            args.batch_size,
        );
    }
    let ck = load_checkpoint(&args.checkpoint)?;
    let mut setup = eval_setup(&ck, args.data_dir.clone(), args.batch_size, true)?;
    let when = if ck.progress.batches_done == 0 {
        format!("after epoch {}", ck.epochs_done)
    } else {
        format!(
            "stopped in epoch {} after batch {}",
            ck.epochs_done + 1,
            ck.progress.batches_done
        )
    };
    println!(
        "checkpoint {} ({when}, precision {}), data: {}",
        ck.dir.display(),
        setup.precision,
        setup.description
    );
    report_eval(&mut setup)?;
    Ok(())
}

/// Evaluates `setup.model` on its test set and prints the result line; returns it.
pub(crate) fn report_eval(setup: &mut EvalSetup) -> Result<hemi::train::Evaluation> {
    let e = hemi::train::evaluate_task(
        setup.model.as_mut(),
        &setup.test,
        setup.precision,
        setup.task.as_ref(),
    )?;
    if setup.masked_lm {
        println!(
            "Held-out masked-LM loss {:.4}, perplexity {:.2}, masked-token accuracy {:.2} % \
             ({} texts)",
            e.loss,
            e.perplexity(),
            100.0 * e.accuracy,
            setup.test_len
        );
    } else {
        println!(
            "Accuracy of the network on the {} test {}: {:.2} % (loss {:.4})",
            setup.test_len,
            setup.unit,
            100.0 * e.accuracy,
            e.loss
        );
    }
    Ok(e)
}

/// The model, data and task to evaluate checkpoint `ck` (its weights loaded unless
/// `load_weights` is false: a quantised file brings its own).
pub(crate) fn eval_setup(
    ck: &hemi::train::Checkpoint,
    data_dir: Option<PathBuf>,
    batch_size: usize,
    load_weights: bool,
) -> Result<EvalSetup> {
    let spec = hemi::models::registry::find(&ck.info.model)?;
    if spec.input == InputKind::Text {
        return eval_setup_text(ck, data_dir, batch_size, &spec, load_weights);
    }
    // A --data-dir given here is where to evaluate: it must exist, and a checkpoint trained
    // on the built-in set is evaluated on whatever data set lies there (checked below
    // against the checkpoint's classes and input shape), never silently on the built-in set.
    let given = data_dir.is_some();
    if let Some(d) = &data_dir {
        if !d.is_dir() {
            return Err(Error::Msg(format!(
                "--data-dir {}: no such directory (omit --data-dir to evaluate on the data \
                 the checkpoint was trained on)",
                d.display()
            )));
        }
    }
    let dir = data_dir
        .or(ck.info.data_dir.clone())
        .unwrap_or_else(|| PathBuf::from("data"));
    let kind = match ck.info.dataset.as_str() {
        "synthetic" if given => {
            if Cifar10::probe(&dir)?.is_none() && !has_class_folders(&dir) {
                return Err(Error::Msg(format!(
                    "--data-dir {}: no data set there (CIFAR-10 binary batches, or train/ and \
                     test/ image folders); the checkpoint was trained on the built-in \
                     synthetic set, which `hemi eval` uses when --data-dir is omitted",
                    dir.display()
                )));
            }
            DatasetArg::Auto
        }
        "synthetic" => DatasetArg::Synthetic,
        "cifar10" => DatasetArg::Cifar10,
        "image-folder" => DatasetArg::ImageFolder,
        "mnist" => DatasetArg::Mnist,
        "fashion-mnist" => DatasetArg::FashionMnist,
        other => {
            return Err(Error::Msg(format!(
                "checkpoint names an unknown data set {other:?}"
            )))
        }
    };
    // The synthetic splits as the run had them (quantize calibrates on the training split).
    let size = |key: &str, absent: usize| -> Result<usize> {
        match ck.info.settings.get(key) {
            Some(s) => s.parse().map_err(|_| {
                Error::Msg(format!(
                    "checkpoint {}: {key} {s:?} is not a number",
                    ck.dir.display()
                ))
            }),
            None => Ok(absent),
        }
    };
    let synthetic_size = size("synthetic_size", 1)?;
    let synthetic_test_size = size("synthetic_test_size", Synthetic::DEFAULT_TEST_LEN)?;
    let data = load_data(
        kind,
        &dir,
        ck.info.seed,
        (synthetic_size, synthetic_test_size),
    )?;
    let names = data.test.class_names();
    if data.test.num_classes() != ck.info.classes
        || (!ck.info.class_names.is_empty() && names != ck.info.class_names.as_slice())
    {
        return Err(Error::Msg(format!(
            "{}: the test set's classes differ from the checkpoint's, so its labels would not \
             mean the same: {}",
            dir.display(),
            class_difference(
                &ck.info.class_names,
                names,
                ck.info.classes,
                data.test.num_classes()
            )
        )));
    }
    if data.test.image_shape() != ck.info.input_shape {
        return Err(Error::Msg(format!(
            "{}: test images are {:?}, the checkpoint's model takes {:?}",
            dir.display(),
            data.test.image_shape(),
            ck.info.input_shape
        )));
    }
    let precision = Precision::parse(&ck.info.precision)?;
    let mut model = build_model(&ck.info.model, ck.info.input_shape, ck.info.classes, 0)?;
    precision.prepare_model(model.as_mut())?;
    if load_weights {
        model.load_state_dict(&ck.model)?;
    }
    let setting = |k: &str| ck.info.settings.get(k);
    let norm = match (setting("normalize.mean"), setting("normalize.std")) {
        (Some(m), Some(s)) => Normalize {
            mean: recipe::parse_values("normalize.mean", m)?,
            std: recipe::parse_values("normalize.std", s)?,
        },
        _ => Normalize::half(),
    };
    let (train, test) = loaders(&data, batch_size, false, ck.info.seed, 2, false, &norm)?;
    Ok(EvalSetup {
        model,
        train,
        test,
        precision,
        task: hemi::train::find_task(spec.task)?,
        description: data.description,
        test_len: data.test.len(),
        unit: "images",
        masked_lm: false,
    })
}

/// `eval_setup` of a text model's checkpoint: the model, tokenizer and held-out texts its
/// settings name.
fn eval_setup_text(
    ck: &hemi::train::Checkpoint,
    data_dir: Option<PathBuf>,
    batch_size: usize,
    spec: &ModelSpec,
    load_weights: bool,
) -> Result<EvalSetup> {
    let setting = |k: &str| -> Result<&String> {
        ck.info.settings.get(k).ok_or_else(|| {
            Error::Msg(format!(
                "checkpoint {}: a text model's run without the setting {k:?}",
                ck.dir.display()
            ))
        })
    };
    let number = |k: &str| -> Result<usize> {
        setting(k)?.parse().map_err(|_| {
            Error::Msg(format!(
                "checkpoint {}: setting {k} is not a number",
                ck.dir.display()
            ))
        })
    };
    let sources = TextSources::resolve(
        spec.name,
        None,
        Some(Path::new(setting("config")?)),
        Some(Path::new(setting("tokenizer")?)),
    )?;
    let tokenizer = sources.tokenizer()?;
    let dir = data_dir
        .or(ck.info.data_dir.clone())
        .ok_or_else(|| Error::Msg("the checkpoint names no data; give --data-dir".into()))?;
    let mlm = spec.task == "masked-lm";
    let columns = if mlm {
        TextColumns::named("sentence", "label")
    } else {
        let (t, l) = (setting("text_column")?, setting("label_column")?);
        let num_classes = match ck.info.settings.get("num_classes") {
            Some(_) => Some(number("num_classes")?),
            None => None,
        };
        TextColumns {
            text: column(t),
            label: column(l),
            header: !(t.parse::<usize>().is_ok() && l.parse::<usize>().is_ok()),
            num_classes,
            ..TextColumns::named("sentence", "label")
        }
    };
    let data = load_text_data(&dir, mlm, &columns)?;
    if !mlm && data.test.class_names() != ck.info.class_names.as_slice() {
        return Err(Error::Msg(format!(
            "{}: the held-out texts' classes differ from the checkpoint's: {}",
            dir.display(),
            class_difference(
                &ck.info.class_names,
                data.test.class_names(),
                ck.info.classes,
                data.test.num_classes()
            )
        )));
    }
    let mlm_config = if mlm {
        let p: f64 = setting("mlm_probability")?.parse().map_err(|_| {
            Error::Msg(format!(
                "checkpoint {}: bad mlm_probability",
                ck.dir.display()
            ))
        })?;
        Some(MlmConfig {
            probability: p,
            ..Default::default()
        })
    } else {
        None
    };
    let (train, test) = text_loaders(
        &data,
        &tokenizer,
        &TextLoading {
            batch_size,
            max_length: number("max_length")?,
            bucket: false,
            shuffle: false,
            mlm: mlm_config,
            seed: ck.info.seed,
            workers: 2,
        },
    )?;
    let precision = Precision::parse(&ck.info.precision)?;
    let mut model = spec.build_text(&sources.config, ck.info.classes, 0)?;
    precision.prepare_model(model.as_mut())?;
    if load_weights {
        model.load_state_dict(&ck.model)?;
    }
    Ok(EvalSetup {
        model,
        train,
        test,
        precision,
        task: hemi::train::find_task(spec.task)?,
        description: data.description,
        test_len: data.test.len(),
        unit: "texts",
        masked_lm: mlm,
    })
}
