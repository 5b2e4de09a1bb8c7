//! `hemi`: the command-line front end (train, bench).

use clap::{Parser, Subcommand};

mod bench;

#[derive(Parser)]
#[command(name = "hemi", version, about = "Half-precision deep-learning training")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (CifarNet on CIFAR-10 or the built-in data set).
    Train,
    /// Micro-benchmarks of hemi's kernels.
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train => {
            println!(
                "hemi train: the training loop lands with the training issue. It will train \
                 CifarNet (conv 3->64, conv 64->128, fc 4608->256->10) with SGD lr 0.001, \
                 momentum 0.9, batch 128 for 10 epochs, on CIFAR-10 when found under the data \
                 dir and on a built-in synthetic set otherwise, in mixed precision."
            );
            Ok(())
        }
        Command::Bench(args) => bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
