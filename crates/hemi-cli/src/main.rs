//! `hemi`: the command-line front end (train, eval, bench).

use clap::{Parser, Subcommand};
use hemi::models::registry::InputKind;

mod alloc;
mod bench;
mod dist;
mod export;
mod plot;
mod quant;
mod text;
mod train;

#[global_allocator]
static ALLOC: alloc::HugePageAlloc = alloc::HugePageAlloc;

#[derive(Parser)]
#[command(
    name = "hemi",
    version,
    about = "Half-precision deep-learning training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (CifarNet on CIFAR-10 or the built-in data set); boxed, it is by far
    /// the largest set of arguments.
    Train(Box<train::TrainArgs>),
    /// Test accuracy of a saved checkpoint.
    Eval(train::EvalArgs),
    /// Data sets: `hemi data fetch cifar10`.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// The models `--model` takes, with their parameter counts.
    Models {
        /// Output classes to count parameters for.
        #[arg(long, default_value_t = 10)]
        classes: usize,
    },
    /// Micro-benchmarks of hemi's kernels.
    Bench(bench::BenchArgs),
    /// PNG charts of runs from their --metrics files: loss and accuracy per epoch (runs
    /// overlaid), loss scale and skipped steps, gradient magnitudes against F16's range.
    Plot(plot::PlotArgs),
    /// Sentence embeddings of a text file's lines (JSON lines), as sentence-transformers
    /// computes them: mean of the final hidden states, L2-normalised.
    Embed(text::EmbedArgs),
    /// A trained model as an ONNX file (`--format onnx`), eval mode.
    Export(export::ExportArgs),
    /// INT8 post-training quantisation of a checkpoint (dynamic or static with
    /// calibration): writes I8 weights with their scales, reports float and INT8 accuracy.
    Quantize(quant::QuantizeArgs),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Download and unpack a data set into the data dir.
    Fetch {
        /// Only `cifar10` (the official binary archive, checked by SHA-256).
        name: String,
        #[arg(long, default_value = "data")]
        data_dir: std::path::PathBuf,
    },
}

/// A training step allocates and frees the same large buffers (activations, im2col columns,
/// gradients) every iteration. glibc serves blocks above its mmap threshold with fresh
/// mappings, so each step paid page faults and kernel zeroing for them (~10% of a CifarNet
/// step in `perf`); keeping them in the heap lets the next step reuse the pages.
///
/// One arena for all threads: buffers are made on rayon's workers and freed on the main
/// thread (the backward frees each layer's activations as it goes), and with an arena per
/// thread the freed memory of one could not serve the next allocation of another. BERT-MiniLM
/// training (batch 32 × 64, fp32, Zen 4) peaked at 882–1093 MiB from run to run with the
/// default arenas, 768–771 MiB with one, at the same speed within the machine's noise.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    if std::env::var_os("HEMI_DEFAULT_MALLOC").is_some() {
        return;
    }
    // SAFETY: mallopt only changes allocator parameters; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() {
    tune_allocator();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train::run_train(*args),
        Command::Eval(args) => train::run_eval(args),
        Command::Quantize(args) => quant::run_quantize(args),
        Command::Data {
            command: DataCommand::Fetch { name, data_dir },
        } => match name.as_str() {
            "cifar10" => hemi::data::fetch_cifar10(&data_dir)
                .map(|d| println!("CIFAR-10 is in {}", d.display())),
            other => Err(hemi::Error::Msg(format!(
                "unknown data set {other:?}: `hemi data fetch cifar10`"
            ))),
        },
        Command::Bench(args) => bench::run(args),
        Command::Embed(args) => text::run_embed(args),
        Command::Plot(args) => plot::run(args),
        Command::Export(args) => export::run_export(args),
        Command::Models { classes } => list_models(classes),
    };
    match result {
        Ok(()) => {}
        // The shell's code for a run ended by SIGINT.
        Err(e @ hemi::Error::Interrupted(_)) => {
            eprintln!("{e}");
            std::process::exit(130);
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

/// `hemi models`: every registered model, its designed input and parameter count.
fn list_models(classes: usize) -> hemi::Result<()> {
    println!(
        "{:<15} {:>13} {:>12}  {:<16} description",
        "model", "input", "parameters", "recipe"
    );
    for m in hemi::models::registry::models() {
        // Text models take their size from a config.json (`--pretrained DIR`), so they have
        // no parameter count of their own.
        let (input, n) = match m.input {
            InputKind::Image => {
                let [c, h, w] = m.input_shape;
                let n = m.build(m.input_shape, classes, 0)?.num_parameters();
                (format!("{c}x{h}x{w}"), n.to_string())
            }
            InputKind::Text => ("text".to_string(), "config".to_string()),
        };
        println!(
            "{:<15} {:>13} {:>12}  {:<16} {}",
            m.name, input, n, m.recipe, m.description
        );
    }
    println!();
    println!("recipes (hemi train --recipe NAME; flags override single settings):");
    for r in hemi::train::Recipe::all() {
        println!("  {:<16} {}", r.name, r.description);
    }
    Ok(())
}
