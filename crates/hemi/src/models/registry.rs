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

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(r: Result<Box<dyn Module>>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn every_model_builds_for_its_input_and_names_are_unique() {
        let all = models();
        let mut names: Vec<&str> = all.iter().map(|m| m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for m in all
            .iter()
            .filter(|m| m.name != "resnet50" && m.name != "resnet34" && m.input == InputKind::Image)
        {
            let net = m.build(m.input_shape, 10, 1).unwrap();
            assert!(net.num_parameters() > 0, "{}", m.name);
        }
        let e = find("resnet7").unwrap_err().to_string();
        assert!(
            e.contains("resnet7") && e.contains("cifar-net") && e.contains("resnet56"),
            "{e}"
        );
        let e = err_of(build("resnet20", [1, 28, 28], 10, 0));
        assert!(e.contains("3-channel") && e.contains("[1, 28, 28]"), "{e}");
        assert!(build("mlp", [1, 28, 28], 0, 0).is_err());
    }

    #[test]
    fn every_model_names_a_known_recipe() {
        for m in models() {
            let r = crate::train::Recipe::find(m.recipe).unwrap();
            crate::train::find_task(m.task).unwrap();
            if m.input == InputKind::Image {
                r.normalize_for(m.input_shape[0]).unwrap();
            }
        }
        assert_eq!(find("resnet20").unwrap().recipe, "resnet-cifar");
        assert_eq!(find("cifar-net").unwrap().recipe, "documents");
    }

    #[test]
    fn text_models_build_from_a_config_and_refuse_image_shapes() {
        let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/bert/tiny/cls/config.json");
        let cls = find("bert-classifier").unwrap();
        let net = cls.build_text(&cfg, 3, 0).unwrap();
        let head = net
            .tensors()
            .into_iter()
            .find(|(n, ..)| n == "classifier.weight")
            .map(|(_, t, ..)| t.shape().to_vec());
        assert_eq!(head.unwrap()[0], 3);
        let mlm = find("bert-mlm").unwrap().build_text(&cfg, 1, 0).unwrap();
        assert!(mlm
            .tensors()
            .iter()
            .any(|(n, ..)| n == "cls.predictions.transform.dense.weight"));
        let e = err_of(cls.build([3, 32, 32], 10, 0));
        assert!(e.contains("text model"), "{e}");
        let e = err_of(find("mlp").unwrap().build_text(&cfg, 2, 0));
        assert!(e.contains("image model"), "{e}");
        let e = err_of(cls.build_text(std::path::Path::new("/nonexistent/config.json"), 2, 0));
        assert!(e.contains("/nonexistent/config.json"), "{e}");
    }

    /// The shapes `hemi models` describes are the shapes the models have.
    #[test]
    fn descriptions_match_the_built_models() {
        let shape = |net: &dyn Module, name: &str| -> Vec<usize> {
            net.tensors()
                .into_iter()
                .find(|(n, ..)| n == name)
                .map(|(_, t, ..)| t.shape().to_vec())
                .unwrap_or_else(|| panic!("no {name}"))
        };
        let d = |name: &str| find(name).unwrap().description;
        let net = build("cifar-net", [3, 32, 32], 10, 0).unwrap();
        assert_eq!(shape(net.as_ref(), "conv1.weight"), [64, 3, 3, 3]);
        assert_eq!(shape(net.as_ref(), "conv2.weight"), [128, 64, 3, 3]);
        assert_eq!(shape(net.as_ref(), "fc1.weight"), [256, 4608]);
        assert_eq!(shape(net.as_ref(), "fc2.weight"), [10, 256]);
        for part in ["3->64", "64->128", "4608->256", "256->classes"] {
            assert!(d("cifar-net").contains(part), "{part}");
        }
        let net = build("mlp", [1, 28, 28], 10, 0).unwrap();
        assert_eq!(shape(net.as_ref(), "fc1.weight"), [512, 784]);
        assert_eq!(shape(net.as_ref(), "fc2.weight"), [10, 512]);
        assert!(d("mlp").contains("->512") && d("mlp").contains("512->classes"));
        // ResNets: blocks per stage and each stage's output channels, from the weights.
        for name in [
            "resnet20", "resnet32", "resnet56", "resnet18", "resnet34", "resnet50",
        ] {
            let net = build(name, find(name).unwrap().input_shape, 10, 0).unwrap();
            let names: Vec<String> = net.tensors().into_iter().map(|(n, ..)| n).collect();
            let mut blocks = Vec::new();
            let mut widths = Vec::new();
            for stage in 1..=4 {
                let n = (0..)
                    .take_while(|b| {
                        names
                            .iter()
                            .any(|x| x.starts_with(&format!("layer{stage}.{b}.")))
                    })
                    .count();
                if n == 0 {
                    break;
                }
                blocks.push(n);
                let last = format!("layer{stage}.{}.", n - 1);
                let bn = if names.contains(&format!("{last}bn3.weight")) {
                    "bn3"
                } else {
                    "bn2"
                };
                widths.push(shape(net.as_ref(), &format!("{last}{bn}.weight"))[0]);
                if bn == "bn3" {
                    assert!(d(name).contains("Bottlenecks"), "{name}");
                }
            }
            let desc = d(name);
            let widths_text = widths
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join("/");
            assert!(
                desc.contains(&widths_text),
                "{name}: {desc} vs {widths_text}"
            );
            if blocks.iter().all(|&b| b == blocks[0]) && blocks.len() == 3 {
                assert!(
                    desc.contains(&format!("with {} BasicBlocks each", blocks[0])),
                    "{name}: {desc}"
                );
            } else {
                let list = blocks
                    .iter()
                    .map(|b| b.to_string())
                    .collect::<Vec<_>>()
                    .join(", ");
                assert!(
                    desc.contains(&format!("[{list}]")),
                    "{name}: {desc} vs {list}"
                );
            }
        }
    }
}
