//! `hemi`: the command-line front end (train, eval, bench).

use clap::{Parser, Subcommand};

mod bench;
mod train;

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
    /// Train a model (CifarNet on CIFAR-10 or the built-in data set).
    Train(train::TrainArgs),
    /// Test accuracy of a saved checkpoint.
    Eval(train::EvalArgs),
    /// Data sets: `hemi data fetch cifar10`.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Micro-benchmarks of hemi's kernels.
    Bench(bench::BenchArgs),
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

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train::run_train(args),
        Command::Eval(args) => train::run_eval(args),
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
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
