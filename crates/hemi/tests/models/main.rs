//! Models, training, AMP and optimizers: PyTorch parity, presets, checkpoints, BERT, ResNets, quantisation, data parallel.
//!
//! One test binary for these files (each a module, as each was its own binary before), so
//! the suite links a few binaries instead of one per file.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod act_checkpoint;
mod amp_master;
mod amp_presets;
mod amp_scaler;
mod bert;
mod bert_train;
mod checkpoint;
mod dist;
mod doctor;
mod naive;
mod optim;
mod quant;
mod quant_torch;
mod resnet;
mod resnet_interop;
mod torch_parity;
mod train;
mod training;
mod unit;
mod visit;
