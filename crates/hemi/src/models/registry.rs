//! The model registry: every ready-made model declared once (name, what it is, the input it
//! was designed for, its task and recipe, a constructor), so the CLI and the training loop
//! know no model names.

use std::path::Path;

use crate::error::{Error, Result};
use crate::models::bert::{BertConfig, BertForMaskedLM, BertForSequenceClassification};
use crate::nn::Module;
use crate::rng::Generator;

use super::{resnet, CifarNet, Mlp};

/// Builds the model registered as `name` for images of `shape` ([C, H, W]) and `classes`
/// outputs (the name lets one function serve a family, as `rgb_resnet` does).
type Build = fn(
    name: &'static str,
    shape: [usize; 3],
    classes: usize,
    rng: &mut Generator,
) -> Result<Box<dyn Module>>;

/// Builds the text model registered as `name` from a Hugging Face `config.json` with
/// `classes` outputs (ignored by models whose outputs are the vocabulary).
type BuildText = fn(
    name: &'static str,
    config: &Path,
    classes: usize,
    rng: &mut Generator,
) -> Result<Box<dyn Module>>;

/// What a model takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// Images `[B, C, H, W]`.
    Image,
    /// Token ids, attention mask and token types `[B, L]` (`data::TextInputs`).
    Text,
}

/// One registered model.
pub struct ModelSpec {
    /// The name `--model` takes.
    pub name: &'static str,
    /// One line saying what the model is, for `hemi models`.
    pub description: &'static str,
    /// What the model's `forward` takes: images or text.
    pub input: InputKind,
    /// The input it was designed for, [C, H, W] (others may work: see `build`); [0, 0, 0]
    /// for text models.
    pub input_shape: [usize; 3],
    /// The training recipe `hemi train --model NAME` uses unless told otherwise
    /// (`crate::train::Recipe::find`).
    pub recipe: &'static str,
    /// The task it trains for (`crate::train::find_task`).
    pub task: &'static str,
    /// The `transformers` class its `save_pretrained` layout loads into (text models).
    pub architecture: Option<&'static str>,
    /// The activation-checkpointing segments the model takes
    /// (`Module::set_activation_checkpointing`), the default first; empty: none.
    pub checkpoint: &'static [&'static str],
    build: Option<Build>,
    build_text: Option<BuildText>,
}

impl std::fmt::Debug for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSpec")
            .field("name", &self.name)
            .field("input_shape", &self.input_shape)
            .finish()
    }
}

impl ModelSpec {
    /// A fresh model for images of `shape` and `classes` outputs, initialised from `seed`.
    pub fn build(&self, shape: [usize; 3], classes: usize, seed: u64) -> Result<Box<dyn Module>> {
        if classes == 0 {
            return Err(Error::arg(self.name, "needs at least one class"));
        }
        let build = self.build.ok_or_else(|| {
            Error::arg(
                self.name,
                "is a text model: it is built from a config.json (build_text)",
            )
        })?;
        build(self.name, shape, classes, &mut Generator::new(seed))
    }

    /// A fresh text model from the Hugging Face `config.json` at `config`, with `classes`
    /// outputs, initialised from `seed` (load pretrained weights afterwards).
    pub fn build_text(&self, config: &Path, classes: usize, seed: u64) -> Result<Box<dyn Module>> {
        if classes == 0 {
            return Err(Error::arg(self.name, "needs at least one class"));
        }
        let build = self.build_text.ok_or_else(|| {
            Error::arg(
                self.name,
                "is an image model: it is built for an image shape",
            )
        })?;
        build(self.name, config, classes, &mut Generator::new(seed))
    }
}

/// A ResNet, whose stem takes 3-channel images.
fn rgb_resnet(
    name: &'static str,
    shape: [usize; 3],
    classes: usize,
    rng: &mut Generator,
) -> Result<Box<dyn Module>> {
    if shape[0] != 3 {
        return Err(Error::shape(
            name,
            format!("takes 3-channel (RGB) images; the data's images are {shape:?}"),
        ));
    }
    Ok(Box::new(resnet::resnet(name, classes, rng)?))
}

/// Every registered model, in the order `hemi models` lists them.
pub fn models() -> Vec<ModelSpec> {
    let mut v = vec![
        ModelSpec {
            name: "cifar-net",
            description: "the documents' CNN: conv 3->64 and 64->128 (3x3, no padding, each \
                          with ReLU and a 2x2 max-pool), fc 4608->256 (ReLU) and 256->classes \
                          on 32x32 images",
            input: InputKind::Image,
            input_shape: [3, 32, 32],
            recipe: "documents",
            task: "classification",
            architecture: None,
            checkpoint: &[],
            build: Some(|_, s, c, r| Ok(Box::new(CifarNet::new(s[0], s[1], s[2], c, r)?))),
            build_text: None,
        },
        ModelSpec {
            name: "mlp",
            description: "fc (C*H*W)->512 (ReLU) and 512->classes over the flattened image",
            input: InputKind::Image,
            input_shape: [1, 28, 28],
            recipe: "documents",
            task: "classification",
            architecture: None,
            checkpoint: &[],
            build: Some(|_, s, c, r| Ok(Box::new(Mlp::new(s.iter().product(), 512, c, r)?))),
            build_text: None,
        },
    ];
    /// The input and the recipe of a family of ResNets.
    type Family = ([usize; 3], &'static str);
    const CIFAR: Family = ([3, 32, 32], "resnet-cifar");
    const IMAGENET: Family = ([3, 224, 224], "resnet-imagenet");
    let resnets: [(&'static str, &'static str, Family); 6] = [
        (
            "resnet20",
            "He et al. 2016 CIFAR ResNet: 3x3 stem, 3 stages of 16/32/64 channels with 3 \
             BasicBlocks each, option-A shortcuts",
            CIFAR,
        ),
        (
            "resnet32",
            "He et al. 2016 CIFAR ResNet: 3x3 stem, 3 stages of 16/32/64 channels with 5 \
             BasicBlocks each, option-A shortcuts",
            CIFAR,
        ),
        (
            "resnet56",
            "He et al. 2016 CIFAR ResNet: 3x3 stem, 3 stages of 16/32/64 channels with 9 \
             BasicBlocks each, option-A shortcuts",
            CIFAR,
        ),
        (
            "resnet18",
            "torchvision resnet18: ImageNet stem, BasicBlocks [2, 2, 2, 2] over 64/128/256/512 \
             channels",
            IMAGENET,
        ),
        (
            "resnet34",
            "torchvision resnet34: ImageNet stem, BasicBlocks [3, 4, 6, 3] over 64/128/256/512 \
             channels",
            IMAGENET,
        ),
        (
            "resnet50",
            "torchvision resnet50 v1.5: ImageNet stem, Bottlenecks [3, 4, 6, 3] over \
             256/512/1024/2048 channels",
            IMAGENET,
        ),
    ];
    for (name, description, (input_shape, recipe)) in resnets {
        v.push(ModelSpec {
            name,
            description,
            input: InputKind::Image,
            input_shape,
            recipe,
            task: "classification",
            architecture: None,
            checkpoint: &super::ResNetCheckpoint::NAMES,
            build: Some(rgb_resnet),
            build_text: None,
        });
    }
    v.push(ModelSpec {
        name: "bert-classifier",
        description: "BERT encoder + pooler + linear head (transformers' \
                      BertForSequenceClassification), from a config.json or --pretrained",
        input: InputKind::Text,
        input_shape: [0, 0, 0],
        recipe: "bert-finetune",
        task: "classification",
        architecture: Some("BertForSequenceClassification"),
        checkpoint: &["layers"],
        build: None,
        build_text: Some(|_, config, classes, rng| {
            let cfg = BertConfig::from_file(config)?.with_num_labels(classes);
            Ok(Box::new(BertForSequenceClassification::new(&cfg, rng)?))
        }),
    });
    v.push(ModelSpec {
        name: "bert-mlm",
        description: "BERT encoder + masked-LM head tied to the word embeddings \
                      (transformers' BertForMaskedLM), from a config.json or --pretrained",
        input: InputKind::Text,
        input_shape: [0, 0, 0],
        recipe: "bert-mlm",
        task: "masked-lm",
        architecture: Some("BertForMaskedLM"),
        checkpoint: &["layers"],
        build: None,
        build_text: Some(|_, config, _, rng| {
            let cfg = BertConfig::from_file(config)?;
            Ok(Box::new(BertForMaskedLM::new(&cfg, rng)?))
        }),
    });
    v
}

/// The registered model named `name`, or an error listing the names there are.
pub fn find(name: &str) -> Result<ModelSpec> {
    let all = models();
    let names: Vec<&str> = all.iter().map(|m| m.name).collect();
    let list = names.join(", ");
    all.into_iter()
        .find(|m| m.name == name)
        .ok_or_else(|| Error::Arg {
            op: "model",
            msg: format!("unknown model {name:?}; the models are: {list}"),
        })
}

/// `find(name)?.build(shape, classes, seed)`.
pub fn build(name: &str, shape: [usize; 3], classes: usize, seed: u64) -> Result<Box<dyn Module>> {
    find(name)?.build(shape, classes, seed)
}
