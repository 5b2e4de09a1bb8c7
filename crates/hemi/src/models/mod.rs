//! Ready-made models.

mod cifar_net;
mod mlp;
pub mod registry;
mod resnet;

pub use cifar_net::CifarNet;
pub use mlp::Mlp;
pub use resnet::{
    resnet, resnet18, resnet20, resnet32, resnet34, resnet50, resnet56, Block, BlockKind,
    CifarShortcut, ResNet, ResNetConfig, Shortcut, RESNET_ARCHS,
};
