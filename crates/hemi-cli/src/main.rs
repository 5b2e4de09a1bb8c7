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
    /// Micro-benchmarks of hemi's kernels.
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train::run_train(args),
        Command::Eval(args) => train::run_eval(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
