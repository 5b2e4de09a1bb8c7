//! What a batch feeds a model: images, or token ids with their attention mask and token
//! types. Models with one image input take `Inputs::Images`; text models take
//! `Inputs::Text` (see `nn::Module::forward_inputs`).

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The inputs of a text model, Hugging Face's names: each `[B, L]` I64, padded to the
/// longest sequence of the batch.
#[derive(Clone, Debug)]
pub struct TextInputs {
    /// Token ids (padding holds the tokenizer's pad id).
    pub input_ids: Tensor,
    /// 1 for a real token, 0 for padding.
    pub attention_mask: Tensor,
    /// Segment of each token (0 for single sentences, 0/1 for pairs).
    pub token_type_ids: Tensor,
}

/// A batch's model inputs.
#[derive(Clone, Debug)]
pub enum Inputs {
    /// `[B, C, H, W]` F32.
    Images(Tensor),
    /// Token ids, attention mask and token types of a text batch, each `[B, L]` I64.
    Text(TextInputs),
}

impl Inputs {
    /// Samples in the batch.
    pub fn batch_size(&self) -> usize {
        match self {
            Inputs::Images(x) => x.shape().first().copied().unwrap_or(0),
            Inputs::Text(t) => t.input_ids.shape().first().copied().unwrap_or(0),
        }
    }

    /// The images; an error for text inputs.
    pub fn images(&self) -> Result<&Tensor> {
        match self {
            Inputs::Images(x) => Ok(x),
            Inputs::Text(_) => Err(Error::arg(
                "inputs",
                "this model takes images, but the batch holds text (token ids)",
            )),
        }
    }

    /// The same inputs on `device`.
    pub fn to_device(&self, device: crate::Device) -> Result<Inputs> {
        Ok(match self {
            Inputs::Images(x) => Inputs::Images(x.to_device(device)?),
            Inputs::Text(t) => Inputs::Text(TextInputs {
                input_ids: t.input_ids.to_device(device)?,
                attention_mask: t.attention_mask.to_device(device)?,
                token_type_ids: t.token_type_ids.to_device(device)?,
            }),
        })
    }

    /// The text inputs; an error for images.
    pub fn text(&self) -> Result<&TextInputs> {
        match self {
            Inputs::Text(t) => Ok(t),
            Inputs::Images(_) => Err(Error::arg(
                "inputs",
                "this model takes text (token ids), but the batch holds images",
            )),
        }
    }
}
