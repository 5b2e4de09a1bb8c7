//! `hemi bench`: kernel throughput, medians of repeated runs.

use clap::Args;

#[derive(Args)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> hemi::Result<()> {
    Ok(())
}
