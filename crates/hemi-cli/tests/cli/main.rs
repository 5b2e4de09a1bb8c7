//! The `hemi` command end to end: training, bad input, benchmarks, export, quantisation, text models, plots.
//!
//! One test binary for these files (each a module, as each was its own binary before), so
//! the suite links a few binaries instead of one per file.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod bench;
mod checkpointing;
mod doctor;
mod export;
mod models;
mod observe;
mod quant;
mod text;
