//! Ready-made models.

mod bert;
mod cifar_net;
mod mlp;
pub mod onnx;
pub mod registry;
mod resnet;

pub use bert::{
    extended_attention_mask, load_pretrained, load_pretrained_state, save_pretrained,
    sentence_embedding, BertConfig, BertEmbeddings, BertForMaskedLM, BertForSequenceClassification,
    BertLayer, BertModel, HiddenAct,
};
pub use cifar_net::CifarNet;
pub use mlp::Mlp;
pub use resnet::{
    resnet, resnet18, resnet20, resnet32, resnet34, resnet50, resnet56, Block, BlockKind,
    CifarShortcut, ResNet, ResNetCheckpoint, ResNetConfig, Shortcut, RESNET_ARCHS,
};
