//! Training recipes: the hyper-parameters, schedule and data preparation a model is usually
//! trained with, declared once and named (`hemi train --recipe resnet-cifar`). Each model in
//! the registry names its default recipe; command-line flags override single settings.
//!
//! Schedules are given in epochs and applied per optimizer step (closed forms of the step
//! count, so a resumed run continues exactly): `lr_schedule` turns them into an
//! `LrScheduler` once the loader's batches per epoch are known.

use crate::data::Transform;
use crate::error::{Error, Result};
use crate::optim::{
    CosineAnnealingLR, LinearDecay, LinearWarmup, LrScheduler, MultiStepLR, StepLR,
};

use super::OptimizerKind;

/// How the learning rate moves over a run after the warm-up, in epochs.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// The base lr throughout.
    Constant,
    /// Cosine annealing from the base lr to 0 at the last step of the run, per step
    /// (`CosineAnnealingLR(T_max = steps after warm-up, eta_min = 0)` stepped every batch).
    Cosine,
    /// Multiply by `gamma` at the start of each milestone epoch (PyTorch's `MultiStepLR`
    /// stepped per epoch; He et al. 2016: milestones 82 and 123 of 164, gamma 0.1).
    Step {
        /// Epoch counts after which the lr is multiplied by `gamma` (PyTorch's
        /// `milestones`), increasing.
        milestones: Vec<usize>,
        /// The factor applied at each milestone (0.1 in He et al.).
        gamma: f64,
    },
    /// Linear decay from the base lr to 0 at the last step of the run, per step (after a
    /// warm-up: Hugging Face's `get_linear_schedule_with_warmup`, the BERT fine-tuning
    /// schedule).
    Linear,
}

impl Schedule {
    /// The schedule's name as `--schedule` takes it: `"constant"`, `"cosine"`, `"step"` or
    /// `"linear"`.
    pub fn name(&self) -> &'static str {
        match self {
            Schedule::Constant => "constant",
            Schedule::Cosine => "cosine",
            Schedule::Step { .. } => "step",
            Schedule::Linear => "linear",
        }
    }

    /// The schedule's settings as one string for a checkpoint's run description.
    pub fn describe(&self) -> String {
        match self {
            Schedule::Step { milestones, gamma } => {
                let m: Vec<String> = milestones.iter().map(|m| m.to_string()).collect();
                format!("step(milestones={}, gamma={gamma})", m.join(","))
            }
            s => s.name().to_string(),
        }
    }

    /// Parses `constant`, `cosine` or `step` (the latter with `milestones` and `gamma`).
    pub fn parse(name: &str, milestones: &[usize], gamma: f64) -> Result<Schedule> {
        let s = match name {
            "constant" => Schedule::Constant,
            "cosine" => Schedule::Cosine,
            "linear" => Schedule::Linear,
            "step" => Schedule::Step {
                milestones: milestones.to_vec(),
                gamma,
            },
            _ => {
                return Err(Error::arg(
                    "schedule",
                    format!("unknown schedule {name:?} (constant, cosine, linear, step)"),
                ))
            }
        };
        if name != "step" && !milestones.is_empty() {
            return Err(Error::arg(
                "schedule",
                "milestones only apply to the step schedule",
            ));
        }
        Ok(s)
    }
}

/// The lr schedule of a run of `epochs` epochs of `steps_per_epoch` optimizer steps, with a
/// linear warm-up over the first `warmup_epochs` (fractions allowed) from `1/warmup_steps`
/// of the base lr. The schedule after the warm-up counts its steps from the warm-up's end,
/// so the cosine reaches 0 at the run's last step.
pub fn lr_schedule(
    schedule: &Schedule,
    warmup_epochs: f64,
    epochs: usize,
    steps_per_epoch: usize,
) -> Result<Box<dyn LrScheduler>> {
    if !(warmup_epochs.is_finite() && warmup_epochs >= 0.0 && warmup_epochs <= epochs as f64) {
        return Err(Error::arg(
            "schedule",
            format!("warm-up must be between 0 and the {epochs} epochs, got {warmup_epochs}"),
        ));
    }
    let spe = steps_per_epoch.max(1) as u64;
    let total = epochs as u64 * spe;
    let warmup = (warmup_epochs * spe as f64).round() as u64;
    let after: Box<dyn LrScheduler> = match schedule {
        // A StepLR that never steps: exactly the base lr.
        Schedule::Constant => Box::new(StepLR {
            step_size: u64::MAX,
            gamma: 1.0,
        }),
        Schedule::Cosine => Box::new(CosineAnnealingLR {
            t_max: (total - warmup).max(1),
            eta_min: 0.0,
        }),
        Schedule::Linear => Box::new(LinearDecay {
            total_steps: (total - warmup).max(1),
        }),
        Schedule::Step { milestones, gamma } => {
            // Milestones are epochs of the whole run; the scheduler after the warm-up
            // counts from the warm-up's end.
            let steps = milestones
                .iter()
                .map(|&m| (m as u64 * spe).saturating_sub(warmup))
                .collect();
            Box::new(MultiStepLR {
                milestones: steps,
                gamma: *gamma,
            })
        }
    };
    let schedule: Box<dyn LrScheduler> = if warmup == 0 {
        after
    } else {
        Box::new(LinearWarmup {
            warmup_steps: warmup,
            start_factor: 1.0 / warmup as f64,
            after: Some(after),
        })
    };
    // The warm-up validates the schedule after it too.
    schedule.validate()?;
    Ok(schedule)
}

/// A named training recipe.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// The name `--recipe` takes (`"documents"`, `"resnet-cifar"`...).
    pub name: &'static str,
    /// One line saying what the recipe is and where it comes from, for `hemi models`.
    pub description: &'static str,
    /// Number of epochs.
    pub epochs: usize,
    /// Samples per batch.
    pub batch_size: usize,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// The base learning rate.
    pub lr: f64,
    /// SGD momentum (ignored by Adam and AdamW).
    pub momentum: f64,
    /// `None`: the optimizer's default.
    pub weight_decay: Option<f64>,
    /// Nesterov momentum (SGD).
    pub nesterov: bool,
    /// No weight decay on biases and normalisation weights (parameters of rank < 2).
    pub no_decay_norm_bias: bool,
    /// The lr schedule after the warm-up.
    pub schedule: Schedule,
    /// Linear warm-up length in epochs (fractions allowed; 0: none).
    pub warmup_epochs: f64,
    /// Label smoothing ε of the training loss (0: none).
    pub label_smoothing: f64,
    /// Random crop with padding (an eighth of the side) and horizontal flip on training
    /// images.
    pub augment: bool,
    /// Per-channel mean and standard deviation of the input normalisation, or one value
    /// for every channel.
    pub normalize: (&'static [f32], &'static [f32]),
}

/// CIFAR-10's per-channel mean and standard deviation of the training images (in [0, 1]).
pub const CIFAR10_MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
/// CIFAR-10's per-channel standard deviation of the training images (in [0, 1]), paired
/// with [`CIFAR10_MEAN`].
pub const CIFAR10_STD: [f32; 3] = [0.2470, 0.2435, 0.2616];

impl Recipe {
    /// Every recipe, in the order `hemi models` lists them.
    pub fn all() -> Vec<Recipe> {
        let documents = Recipe {
            name: "documents",
            description: "the documents' CIFAR-10 loop: SGD lr 0.001, momentum 0.9, batch 128, \
                          10 epochs, Normalize(0.5, 0.5)",
            epochs: 10,
            batch_size: 128,
            optimizer: OptimizerKind::Sgd,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: None,
            nesterov: false,
            no_decay_norm_bias: false,
            schedule: Schedule::Constant,
            warmup_epochs: 0.0,
            label_smoothing: 0.0,
            augment: false,
            normalize: (&[0.5], &[0.5]),
        };
        let resnet_cifar = Recipe {
            name: "resnet-cifar",
            description: "He et al. 2016's CIFAR setting shortened to 30 epochs: SGD lr 0.1, \
                          momentum 0.9, weight decay 1e-4, batch 128, cosine per step to 0, \
                          random crop (padding 4) + flip, CIFAR-10 mean/std",
            epochs: 30,
            lr: 0.1,
            weight_decay: Some(1e-4),
            schedule: Schedule::Cosine,
            augment: true,
            normalize: (&CIFAR10_MEAN, &CIFAR10_STD),
            ..documents.clone()
        };
        let resnet_imagenet = Recipe {
            name: "resnet-imagenet",
            description: "torchvision's ResNet reference: SGD lr 0.1, momentum 0.9, weight \
                          decay 1e-4, batch 32, lr x0.1 every 30 of 90 epochs, crop + flip",
            epochs: 90,
            batch_size: 32,
            schedule: Schedule::Step {
                milestones: vec![30, 60],
                gamma: 0.1,
            },
            normalize: (&[0.485, 0.456, 0.406], &[0.229, 0.224, 0.225]),
            ..resnet_cifar.clone()
        };
        let bert_finetune = Recipe {
            name: "bert-finetune",
            description: "BERT fine-tuning (Devlin et al. 2019, Hugging Face's defaults): AdamW \
                          lr 5e-5, weight decay 0.01 except biases and LayerNorm, linear \
                          warm-up over 6 % of the steps then linear decay to 0, batch 32, \
                          1 epoch",
            epochs: 1,
            batch_size: 32,
            optimizer: OptimizerKind::AdamW,
            lr: 5e-5,
            momentum: 0.9,
            weight_decay: Some(0.01),
            nesterov: false,
            no_decay_norm_bias: true,
            schedule: Schedule::Linear,
            warmup_epochs: 0.06,
            label_smoothing: 0.0,
            augment: false,
            normalize: (&[], &[]),
        };
        let bert_mlm = Recipe {
            name: "bert-mlm",
            description: "masked-LM (continued) pretraining: AdamW lr 1e-4, weight decay 0.01 \
                          except biases and LayerNorm, 6 % linear warm-up then linear decay, \
                          batch 32, 1 epoch, 15 % of tokens masked 80/10/10",
            lr: 1e-4,
            ..bert_finetune.clone()
        };
        vec![
            documents,
            resnet_cifar,
            resnet_imagenet,
            bert_finetune,
            bert_mlm,
        ]
    }

    /// The recipe called `name`; the error lists the known ones.
    pub fn find(name: &str) -> Result<Recipe> {
        let all = Recipe::all();
        let names: Vec<&str> = all.iter().map(|r| r.name).collect();
        all.iter().find(|r| r.name == name).cloned().ok_or_else(|| {
            Error::arg(
                "recipe",
                format!("unknown recipe {name:?} (known: {})", names.join(", ")),
            )
        })
    }

    /// The normalisation for images of `channels` channels: the recipe's per-channel values
    /// when it has one per channel or a single one; an error otherwise.
    pub fn normalize_for(&self, channels: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (m, s) = self.normalize;
        if m.len() == 1 || m.len() == channels {
            Ok((m.to_vec(), s.to_vec()))
        } else {
            Err(Error::shape(
                "recipe",
                format!(
                    "recipe {} normalises {} channels; the images have {channels}",
                    self.name,
                    m.len()
                ),
            ))
        }
    }
}

/// The training transform: optional random crop (padding an eighth of the side, as 4 for
/// CIFAR's 32) and horizontal flip, then the conversion to float and `Normalize(mean, std)`.
pub fn train_transform(augment: bool, side: usize, mean: &[f32], std: &[f32]) -> Transform {
    let t = if augment {
        Transform::new()
            .random_crop(side, (side / 8).max(1))
            .random_horizontal_flip(0.5)
    } else {
        Transform::new()
    };
    t.normalize(mean, std)
}

/// The evaluation transform: only the conversion to float and `Normalize(mean, std)`.
pub fn eval_transform(mean: &[f32], std: &[f32]) -> Transform {
    Transform::new().normalize(mean, std)
}

/// Formats a normalisation for a checkpoint's run description (`0.4914,0.4822,0.4465`).
pub fn format_values(v: &[f32]) -> String {
    let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    s.join(",")
}

/// Parses `format_values`' output.
pub fn parse_values(what: &str, s: &str) -> Result<Vec<f32>> {
    let v = s
        .split(',')
        .map(|x| x.trim().parse::<f32>())
        .collect::<std::result::Result<Vec<f32>, _>>()
        .map_err(|e| Error::arg("recipe", format!("{what}: {s:?}: {e}")))?;
    if v.is_empty() || v.iter().any(|x| !x.is_finite()) {
        return Err(Error::arg(
            "recipe",
            format!("{what}: {s:?}: need finite values"),
        ));
    }
    Ok(v)
}
