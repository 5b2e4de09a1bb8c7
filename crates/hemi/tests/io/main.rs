//! Data sets, text data, ONNX, TensorBoard files and the fuzzers' regressions.
//!
//! One test binary for these files (each a module, as each was its own binary before), so
//! the suite links a few binaries instead of one per file.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod data;
mod data_bad_input;
mod fuzz_regressions;
mod onnx;
mod tensorboard;
mod text_data;
mod unit;
