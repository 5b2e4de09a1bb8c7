//! Tasks: what a training run optimises and how it is scored. A `Task` turns a batch into a
//! loss (for the optimizer) and counts (for the metrics), so the loop, AMP, checkpoints and
//! metrics are the same for image classifiers, text classifiers and masked-LM pretraining.
//!
//! - `Classification`: logits `[B, C]` against labels `[B]`; metric: accuracy.
//! - `MaskedLm`: logits `[B, L, V]` against labels `[B, L]` that hold -100 where no loss is
//!   taken (Hugging Face's convention); metric: accuracy on the masked tokens, and the loss
//!   per target token, whose exponential is the perplexity.

use std::fmt::Debug;

use crate::amp::Precision;
use crate::data::{Batch, Inputs, TextInputs};
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::ops::loss::{cross_entropy, CrossEntropyOptions};
use crate::tensor::Tensor;

/// The label of positions a masked-LM loss skips.
pub const IGNORE_INDEX: i64 = -100;

/// The loss of one batch and what the metrics need.
pub struct TaskOutput {
    /// Scalar loss: the mean over `count` targets.
    pub loss: Tensor,
    /// Targets the loss averages over (samples, or masked tokens).
    pub count: usize,
    /// Targets predicted correctly (arg-max of the logits), counted only when asked.
    pub correct: usize,
}

/// What a run optimises.
pub trait Task: Send + Sync + Debug {
    /// `classification`, `masked-lm`: recorded in checkpoints.
    fn name(&self) -> &'static str;

    /// The forward pass and loss of `batch` (the caller holds the autocast scope).
    /// `label_smoothing` applies to the training loss; `score` also counts correct
    /// predictions (evaluation).
    fn forward(
        &self,
        model: &dyn Module,
        batch: &Batch,
        precision: Precision,
        label_smoothing: f64,
        score: bool,
    ) -> Result<TaskOutput>;

    /// Whether the run reports perplexity (exp of the mean loss) beside the accuracy.
    fn reports_perplexity(&self) -> bool {
        false
    }
}

/// The inputs of `batch` as the model of `precision` takes them: images cast to the
/// preset's weight dtype (as `Precision::input`), token ids as they are.
pub fn model_inputs(batch: &Batch, precision: Precision) -> Result<Inputs> {
    Ok(match &batch.inputs {
        Inputs::Images(x) => Inputs::Images(precision.input(x)?),
        Inputs::Text(t) => Inputs::Text(TextInputs::clone(t)),
    })
}

fn count_correct(logits: &Tensor, labels: &Tensor) -> Result<usize> {
    let pred = logits.argmax(-1, false)?.try_to_vec_i64()?;
    let labels = labels.try_to_vec_i64()?;
    Ok(pred
        .iter()
        .zip(&labels)
        .filter(|(p, l)| p == l && **l != IGNORE_INDEX)
        .count())
}

/// Classification of images or texts: cross-entropy of `[B, C]` logits, accuracy.
#[derive(Clone, Copy, Debug, Default)]
pub struct Classification;

impl Task for Classification {
    fn name(&self) -> &'static str {
        "classification"
    }

    fn forward(
        &self,
        model: &dyn Module,
        batch: &Batch,
        precision: Precision,
        label_smoothing: f64,
        score: bool,
    ) -> Result<TaskOutput> {
        let logits = model.forward_inputs(&model_inputs(batch, precision)?)?;
        if logits.rank() != 2 || logits.shape()[0] != batch.len() {
            return Err(Error::shape(
                "classification",
                format!(
                    "the model gave {:?} for a batch of {}; classification needs logits \
                     [batch, classes]",
                    logits.shape(),
                    batch.len()
                ),
            ));
        }
        let opts = CrossEntropyOptions {
            label_smoothing,
            ..Default::default()
        };
        let loss = cross_entropy(&logits, &batch.labels, opts)?;
        let correct = if score {
            count_correct(&logits, &batch.labels)?
        } else {
            0
        };
        Ok(TaskOutput {
            loss,
            count: batch.len(),
            correct,
        })
    }
}

/// Masked-language-model pretraining: cross-entropy over the vocabulary at the positions
/// whose label is not `IGNORE_INDEX`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MaskedLm;

impl Task for MaskedLm {
    fn name(&self) -> &'static str {
        "masked-lm"
    }

    fn forward(
        &self,
        model: &dyn Module,
        batch: &Batch,
        precision: Precision,
        label_smoothing: f64,
        score: bool,
    ) -> Result<TaskOutput> {
        let labels = &batch.labels;
        if labels.rank() != 2 {
            return Err(Error::shape(
                "masked-lm",
                format!(
                    "labels are {:?}; masked-LM needs [batch, length] token labels (the loader's \
                     masked-LM mode makes them)",
                    labels.shape()
                ),
            ));
        }
        let logits = model.forward_inputs(&model_inputs(batch, precision)?)?;
        if logits.rank() != 3 || logits.shape()[..2] != labels.shape()[..] {
            return Err(Error::shape(
                "masked-lm",
                format!(
                    "the model gave {:?} for labels {:?}; masked-LM needs logits [batch, \
                     length, vocabulary]",
                    logits.shape(),
                    labels.shape()
                ),
            ));
        }
        let count = labels
            .try_to_vec_i64()?
            .iter()
            .filter(|&&l| l != IGNORE_INDEX)
            .count();
        if count == 0 {
            return Err(Error::arg(
                "masked-lm",
                "a batch without a single masked token (all labels are -100)",
            ));
        }
        let v = logits.shape()[2];
        let flat = logits.reshape(&[logits.shape()[0] * logits.shape()[1], v])?;
        let targets = labels.reshape(&[labels.numel()])?;
        let opts = CrossEntropyOptions {
            label_smoothing,
            ignore_index: Some(IGNORE_INDEX),
            ..Default::default()
        };
        let loss = cross_entropy(&flat, &targets, opts)?;
        let correct = if score {
            count_correct(&flat, &targets)?
        } else {
            0
        };
        Ok(TaskOutput {
            loss,
            count,
            correct,
        })
    }

    fn reports_perplexity(&self) -> bool {
        true
    }
}

/// The task called `name` (`classification`, `masked-lm`).
pub fn find_task(name: &str) -> Result<std::sync::Arc<dyn Task>> {
    match name {
        "classification" => Ok(std::sync::Arc::new(Classification)),
        "masked-lm" => Ok(std::sync::Arc::new(MaskedLm)),
        _ => Err(Error::arg(
            "task",
            format!("unknown task {name:?} (classification, masked-lm)"),
        )),
    }
}
