//! Ready-made models.

mod cifar_net;
mod mlp;

pub use cifar_net::CifarNet;
pub use mlp::Mlp;
