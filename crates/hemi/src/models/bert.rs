//! BERT (Devlin et al. 2019) with Hugging Face transformers' names, layout and numerics:
//! `BertModel`, `BertForSequenceClassification`, `BertForMaskedLM`, their `config.json`
//! (`BertConfig`), loading `model.safetensors` checkpoints (a base-model checkpoint such as
//! sentence-transformers' all-MiniLM-L6-v2 loads into the `bert.` part of a head model) and
//! saving checkpoints that `from_pretrained` in transformers reads with no missing or
//! unexpected keys. `sentence_embedding` is sentence-transformers' mean pooling.
//!
//! Layout (post-LayerNorm, as transformers' `BertLayer`):
//! ```text
//! h0 = LN(word[ids] + position[0..L] + token_type[types]);  dropout
//! per layer:  a = LN(h + dropout(dense(attention(q(h), k(h), v(h), mask))))
//!             h = LN(a + dropout(dense2(act(dense1(a)))))
//! pooled = tanh(pooler.dense(h[:, 0]))
//! ```
//!
//! Tied weights: the masked-LM decoder multiplies by the word-embedding matrix itself (one
//! tensor used twice, so its gradient is the sum of both uses), and its bias is
//! `cls.predictions.bias`. transformers' `save_pretrained` omits the tied names
//! `cls.predictions.decoder.weight` and `cls.predictions.decoder.bias` from
//! `model.safetensors` (its `_tied_weights_keys`); hemi's `state_dict` does the same, and
//! loading accepts files that hold them (older writers) and ignores them, as transformers
//! re-ties them.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value};

use crate::autograd::Segment;
use crate::data::Inputs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{
    param, Dropout, Embedding, LayerNorm, Linear, Module, Replicate, StateDictMismatch, Visit,
    Visitor, VisitorMut,
};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// The feed-forward activation (`hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenAct {
    /// `gelu`: the exact (erf) GELU.
    Gelu,
    /// `gelu_new`: the tanh approximation (GPT-2's name).
    GeluNew,
    /// `gelu_pytorch_tanh`: the same tanh approximation.
    GeluPytorchTanh,
    /// `relu`.
    Relu,
}

impl HiddenAct {
    /// transformers' name.
    pub fn name(self) -> &'static str {
        match self {
            HiddenAct::Gelu => "gelu",
            HiddenAct::GeluNew => "gelu_new",
            HiddenAct::GeluPytorchTanh => "gelu_pytorch_tanh",
            HiddenAct::Relu => "relu",
        }
    }

    fn from_name(s: &str) -> Option<Self> {
        [
            HiddenAct::Gelu,
            HiddenAct::GeluNew,
            HiddenAct::GeluPytorchTanh,
            HiddenAct::Relu,
        ]
        .into_iter()
        .find(|a| a.name() == s)
    }

    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            HiddenAct::Gelu => x.gelu(),
            HiddenAct::GeluNew | HiddenAct::GeluPytorchTanh => x.gelu_tanh(),
            HiddenAct::Relu => x.relu(),
        }
    }

    /// `act(layer(x))` in one call, so that a quantised layer fuses the activation.
    fn after(self, layer: &Linear, x: &Tensor) -> Result<Tensor> {
        match self {
            HiddenAct::Gelu => layer.forward_gelu(x, false),
            HiddenAct::GeluNew | HiddenAct::GeluPytorchTanh => layer.forward_gelu(x, true),
            HiddenAct::Relu => layer.forward_relu(x),
        }
    }
}

/// transformers' `BertConfig` (the fields hemi uses; absent optional fields take
/// transformers' defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// Rows of the word-embedding matrix: the tokenizer's vocabulary size.
    pub vocab_size: usize,
    /// Width of every hidden state (H), divisible by `num_attention_heads`.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; each has `hidden_size / num_attention_heads` features.
    pub num_attention_heads: usize,
    /// Width of the feed-forward block's inner layer (usually 4 × H).
    pub intermediate_size: usize,
    /// The feed-forward block's activation (`hidden_act`, e.g. `"gelu"`).
    pub hidden_act: HiddenAct,
    /// Dropout probability after the embeddings, the attention output and the feed-forward
    /// output.
    pub hidden_dropout_prob: f64,
    /// Dropout probability on the attention probabilities.
    pub attention_probs_dropout_prob: f64,
    /// Longest sequence the position embeddings cover.
    pub max_position_embeddings: usize,
    /// Rows of the token-type (segment) embedding, usually 2.
    pub type_vocab_size: usize,
    /// The LayerNorms' ε (transformers' default 1e-12).
    pub layer_norm_eps: f64,
    /// The padding token's id (its word-embedding row starts at zero).
    pub pad_token_id: Option<usize>,
    /// Standard deviation of the normal initialisation of weights and embeddings (default
    /// 0.02).
    pub initializer_range: f64,
    /// Dropout before the classifier; `None`: `hidden_dropout_prob` (transformers' rule).
    pub classifier_dropout: Option<f64>,
    /// Class names by index (`id2label`); its length is `num_labels`.
    pub id2label: Vec<String>,
}

impl Default for BertConfig {
    /// bert-base-uncased (transformers' `BertConfig()` defaults), 2 labels.
    fn default() -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: HiddenAct::Gelu,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: Some(0),
            initializer_range: 0.02,
            classifier_dropout: None,
            id2label: vec!["LABEL_0".into(), "LABEL_1".into()],
        }
    }
}

impl BertConfig {
    /// Number of classes of a sequence-classification head.
    pub fn num_labels(&self) -> usize {
        self.id2label.len()
    }

    /// Sets `num_labels` classes named `LABEL_i` (transformers' default names).
    pub fn with_num_labels(mut self, n: usize) -> Self {
        self.id2label = (0..n).map(|i| format!("LABEL_{i}")).collect();
        self
    }

    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Reads a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&path.display().to_string(), &text)
    }

    /// Parses a `config.json`'s text; `what` (the file) is named in errors, with the field.
    pub fn from_json_str(what: &str, text: &str) -> Result<Self> {
        let bad = |msg: String| Error::Data {
            path: what.to_string(),
            msg,
        };
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("expected a JSON object".into()))?;
        if let Some(t) = obj.get("model_type").and_then(Value::as_str) {
            if t != "bert" {
                return Err(bad(format!("model_type is \"{t}\", expected \"bert\"")));
            }
        }
        let d = BertConfig::default();
        let usize_field = |name: &str, default: Option<usize>| -> Result<usize> {
            match obj.get(name) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| bad(format!("field `{name}` is missing")))
                }
                Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    bad(format!(
                        "field `{name}`: expected a non-negative integer, got {x}"
                    ))
                }),
            }
        };
        let prob_field = |name: &str, default: f64| -> Result<f64> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| {
                        bad(format!(
                            "field `{name}`: expected a number in [0, 1], got {x}"
                        ))
                    }),
            }
        };
        let pos_field = |name: &str, default: f64| -> Result<f64> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .filter(|p| *p > 0.0 && p.is_finite())
                    .ok_or_else(|| {
                        bad(format!(
                            "field `{name}`: expected a positive number, got {x}"
                        ))
                    }),
            }
        };
        let hidden_act = match obj.get("hidden_act") {
            None => d.hidden_act,
            Some(x) => x.as_str().and_then(HiddenAct::from_name).ok_or_else(|| {
                bad(format!(
                    "field `hidden_act`: {x} is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)"
                ))
            })?,
        };
        if obj.get("tie_word_embeddings") == Some(&Value::Bool(false)) {
            return Err(bad(
                "field `tie_word_embeddings`: false is not supported (hemi's masked-LM decoder \
                 is the word-embedding matrix)"
                    .into(),
            ));
        }
        if let Some(x) = obj.get("position_embedding_type") {
            if x.as_str() != Some("absolute") {
                return Err(bad(format!(
                    "field `position_embedding_type`: {x} is not supported (only \"absolute\")"
                )));
            }
        }
        let pad_token_id = match obj.get("pad_token_id") {
            None => d.pad_token_id,
            Some(Value::Null) => None,
            Some(x) => Some(x.as_u64().map(|n| n as usize).ok_or_else(|| {
                bad(format!(
                    "field `pad_token_id`: expected a non-negative integer, got {x}"
                ))
            })?),
        };
        let classifier_dropout = match obj.get("classifier_dropout") {
            None | Some(Value::Null) => None,
            Some(_) => Some(prob_field("classifier_dropout", 0.0)?),
        };
        // id2label wins over num_labels when both are given (as transformers).
        let id2label = match obj.get("id2label") {
            Some(Value::Object(m)) => {
                let mut labels: Vec<Option<String>> = vec![None; m.len()];
                for (k, name) in m {
                    let i = k.parse::<usize>().ok().filter(|&i| i < m.len());
                    let name = name.as_str();
                    match (i, name) {
                        (Some(i), Some(n)) => labels[i] = Some(n.to_string()),
                        _ => {
                            return Err(bad(format!(
                                "field `id2label`: entry \"{k}\" is not an index below {} with a string label",
                                m.len()
                            )))
                        }
                    }
                }
                labels
                    .into_iter()
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        bad("field `id2label`: indices must be 0..n without gaps".into())
                    })?
            }
            Some(x) if !x.is_null() => {
                return Err(bad(format!(
                    "field `id2label`: expected an object, got {x}"
                )))
            }
            _ => {
                let n = usize_field("num_labels", Some(2))?;
                (0..n).map(|i| format!("LABEL_{i}")).collect()
            }
        };
        let c = BertConfig {
            vocab_size: usize_field("vocab_size", None)?,
            hidden_size: usize_field("hidden_size", None)?,
            num_hidden_layers: usize_field("num_hidden_layers", None)?,
            num_attention_heads: usize_field("num_attention_heads", None)?,
            intermediate_size: usize_field("intermediate_size", None)?,
            hidden_act,
            hidden_dropout_prob: prob_field("hidden_dropout_prob", d.hidden_dropout_prob)?,
            attention_probs_dropout_prob: prob_field(
                "attention_probs_dropout_prob",
                d.attention_probs_dropout_prob,
            )?,
            max_position_embeddings: usize_field(
                "max_position_embeddings",
                Some(d.max_position_embeddings),
            )?,
            type_vocab_size: usize_field("type_vocab_size", Some(d.type_vocab_size))?,
            layer_norm_eps: pos_field("layer_norm_eps", d.layer_norm_eps)?,
            pad_token_id,
            initializer_range: pos_field("initializer_range", d.initializer_range)?,
            classifier_dropout,
            id2label,
        };
        c.validate().map_err(bad)?;
        Ok(c)
    }

    /// Checks that the sizes fit together; the message names the field.
    fn validate(&self) -> std::result::Result<(), String> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if v == 0 {
                return Err(format!("field `{name}` must be > 0"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "field `hidden_size` ({}) is not a multiple of `num_attention_heads` ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if let Some(p) = self.pad_token_id {
            if p >= self.vocab_size {
                return Err(format!(
                    "field `pad_token_id` ({p}) is not below `vocab_size` ({})",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// The config as transformers writes it, with `architectures` naming the model class.
    pub fn to_json(&self, architecture: &str) -> Value {
        let id2label: Map<String, Value> = self
            .id2label
            .iter()
            .enumerate()
            .map(|(i, n)| (i.to_string(), json!(n)))
            .collect();
        let label2id: Map<String, Value> = self
            .id2label
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), json!(i)))
            .collect();
        json!({
            "architectures": [architecture],
            "model_type": "bert",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act.name(),
            "hidden_dropout_prob": self.hidden_dropout_prob,
            "attention_probs_dropout_prob": self.attention_probs_dropout_prob,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "classifier_dropout": self.classifier_dropout,
            "position_embedding_type": "absolute",
            "id2label": id2label,
            "label2id": label2id,
            "tie_word_embeddings": true,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Layers, initialised as transformers' `BertPreTrainedModel._init_weights`: Linear and
// Embedding weights N(0, initializer_range), biases 0, LayerNorm 1 and 0, the padding row
// of the word embeddings 0.

fn linear(cfg: &BertConfig, i: usize, o: usize, rng: &mut Generator) -> Result<Linear> {
    Ok(Linear {
        weight: param(Tensor::randn(
            &[o, i],
            0.0,
            cfg.initializer_range,
            DType::F32,
            rng,
        )?)?,
        bias: Some(param(Tensor::zeros(&[o], DType::F32)?)?),
        hook: None,
    })
}

fn embedding(
    cfg: &BertConfig,
    n: usize,
    pad: Option<usize>,
    rng: &mut Generator,
) -> Result<Embedding> {
    let mut w = Tensor::randn(
        &[n, cfg.hidden_size],
        0.0,
        cfg.initializer_range,
        DType::F32,
        rng,
    )?;
    if let Some(p) = pad {
        let mut v = w.to_vec_f32();
        v[p * cfg.hidden_size..(p + 1) * cfg.hidden_size].fill(0.0);
        w = Tensor::from_vec(v, &[n, cfg.hidden_size])?;
    }
    Ok(Embedding { weight: param(w)? })
}

fn layer_norm(cfg: &BertConfig) -> Result<LayerNorm> {
    let mut ln = LayerNorm::new(&[cfg.hidden_size])?;
    ln.eps = cfg.layer_norm_eps;
    Ok(ln)
}

fn dropout(p: f64, rng: &mut Generator) -> Result<Dropout> {
    Dropout::new(p, rng.next_u64())
}

/// The additive attention mask `[B, 1, 1, L]` of `attention_mask` `[B, L]` (1 keep, 0 pad)
/// in `dtype`: 0 where kept, a large negative number where padded.
///
/// transformers adds `finfo(dtype).min`; hemi adds half of it, which masks the same way
/// (`exp` of it is 0 in every dtype) but stays finite when a score is added to it: in F16
/// `-65504 + s` rounds to `-inf` for `s < -16`, and a row of `-inf` gives NaN.
pub fn extended_attention_mask(attention_mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let [b, l] = attention_mask.shape() else {
        return Err(Error::shape(
            "BERT attention_mask",
            format!("expected [B, L], got {:?}", attention_mask.shape()),
        ));
    };
    let large = dtype
        .finfo()
        .ok_or_else(|| Error::dtype("BERT attention mask", dtype, "needs a float dtype"))?
        .max
        / 2.0;
    attention_mask
        .to_dtype(dtype)?
        .neg()?
        .add_scalar(1.0)?
        .mul_scalar(-large)?
        .reshape(&[*b, 1, 1, *l])
}

/// Scaled dot-product attention, `softmax(q kᵀ / √d + mask) v`, with dropout on the
/// probabilities while training: q, k, v `[B, heads, L, d]`, mask `[B, 1, 1, L]` additive.
/// The one place attention is computed: the fused op, which never stores the score matrix
/// (under autocast q, k, v run in the low dtype, the softmax accumulates in F32).
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    dropout_p: f64,
    training: bool,
    rng: &mut Generator,
) -> Result<Tensor> {
    let p = if training { dropout_p } else { 0.0 };
    let rng = if p > 0.0 { Some(rng) } else { None };
    q.scaled_dot_product_attention(k, v, mask, p, rng, None)
}

/// `embeddings.*`: word + position + token-type embeddings, LayerNorm, dropout.
pub struct BertEmbeddings {
    /// `word_embeddings`: `[vocab_size, H]`, one row per token id.
    pub word_embeddings: Embedding,
    /// `position_embeddings`: `[max_position_embeddings, H]`, one row per position.
    pub position_embeddings: Embedding,
    /// `token_type_embeddings`: `[type_vocab_size, H]`, one row per segment id.
    pub token_type_embeddings: Embedding,
    /// `LayerNorm` over the summed embeddings.
    pub layer_norm: LayerNorm,
    dropout: Dropout,
}

impl BertEmbeddings {
    fn new(cfg: &BertConfig, rng: &mut Generator) -> Result<Self> {
        Ok(BertEmbeddings {
            word_embeddings: embedding(cfg, cfg.vocab_size, cfg.pad_token_id, rng)?,
            position_embeddings: embedding(cfg, cfg.max_position_embeddings, None, rng)?,
            token_type_embeddings: embedding(cfg, cfg.type_vocab_size, None, rng)?,
            layer_norm: layer_norm(cfg)?,
            dropout: dropout(cfg.hidden_dropout_prob, rng)?,
        })
    }

    /// ids, types `[B, L]` I64 -> `[B, L, H]`; positions are `0..L`.
    fn forward(&self, ids: &Tensor, types: &Tensor) -> Result<Tensor> {
        let l = ids.shape()[1];
        let max = self.position_embeddings.weight.shape()[0];
        if l > max {
            return Err(Error::shape(
                "BERT embeddings",
                format!("sequence length {l} exceeds max_position_embeddings {max}"),
            ));
        }
        let positions = Tensor::arange(0.0, l as f64, 1.0, DType::I64)?.to_device(ids.device())?;
        let x = self
            .word_embeddings
            .forward(ids)?
            .add(&self.token_type_embeddings.forward(types)?)?
            .add(&self.position_embeddings.forward(&positions)?)?;
        self.dropout.forward(&self.layer_norm.forward(&x)?)
    }
}

impl Visit for BertEmbeddings {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("word_embeddings", &self.word_embeddings);
        v.child("position_embeddings", &self.position_embeddings);
        v.child("token_type_embeddings", &self.token_type_embeddings);
        v.child("LayerNorm", &self.layer_norm);
        v.child("dropout", &self.dropout);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("word_embeddings", &mut self.word_embeddings);
        v.child("position_embeddings", &mut self.position_embeddings);
        v.child("token_type_embeddings", &mut self.token_type_embeddings);
        v.child("LayerNorm", &mut self.layer_norm);
        v.child("dropout", &mut self.dropout);
    }
}

/// `encoder.layer.N.*`: self-attention with its output projection and LayerNorm, then the
/// feed-forward block with its LayerNorm.
pub struct BertLayer {
    /// `attention.self.query`: H → H.
    pub query: Linear,
    /// `attention.self.key`: H → H.
    pub key: Linear,
    /// `attention.self.value`: H → H.
    pub value: Linear,
    /// `attention.output.dense`.
    pub attention_output: Linear,
    /// `attention.output.LayerNorm`.
    pub attention_norm: LayerNorm,
    /// `intermediate.dense`.
    pub intermediate: Linear,
    /// `output.dense`.
    pub output: Linear,
    /// `output.LayerNorm`.
    pub output_norm: LayerNorm,
    heads: usize,
    act: HiddenAct,
    attention_dropout_p: f64,
    /// Shared with the layer's replicas (activation checkpointing).
    attention_rng: Arc<Mutex<Generator>>,
    attention_output_dropout: Dropout,
    output_dropout: Dropout,
    training: AtomicBool,
}

impl BertLayer {
    fn new(cfg: &BertConfig, rng: &mut Generator) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(BertLayer {
            query: linear(cfg, h, h, rng)?,
            key: linear(cfg, h, h, rng)?,
            value: linear(cfg, h, h, rng)?,
            attention_output: linear(cfg, h, h, rng)?,
            attention_norm: layer_norm(cfg)?,
            intermediate: linear(cfg, h, cfg.intermediate_size, rng)?,
            output: linear(cfg, cfg.intermediate_size, h, rng)?,
            output_norm: layer_norm(cfg)?,
            heads: cfg.num_attention_heads,
            act: cfg.hidden_act,
            attention_dropout_p: cfg.attention_probs_dropout_prob,
            attention_rng: Arc::new(Mutex::new(Generator::new(rng.next_u64()))),
            attention_output_dropout: dropout(cfg.hidden_dropout_prob, rng)?,
            output_dropout: dropout(cfg.hidden_dropout_prob, rng)?,
            training: AtomicBool::new(true),
        })
    }

    /// h `[B, L, H]`, mask `[B, 1, 1, L]` additive -> `[B, L, H]`.
    fn forward(&self, h: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, l, hs) = (h.shape()[0], h.shape()[1], h.shape()[2]);
        let d = hs / self.heads;
        // [B, L, H] -> [B, heads, L, d]
        let split = |x: Tensor| x.reshape(&[b, l, self.heads, d])?.permute(&[0, 2, 1, 3]);
        let q = split(self.query.forward(h)?)?;
        let k = split(self.key.forward(h)?)?;
        let v = split(self.value.forward(h)?)?;
        let ctx = {
            let _scope = crate::ops::scope::enter("attention.self");
            let mut rng = self
                .attention_rng
                .lock()
                .map_err(|_| Error::Msg("BERT attention: generator lock poisoned".into()))?;
            attention(
                &q,
                &k,
                &v,
                mask,
                self.attention_dropout_p,
                self.training.load(Ordering::Relaxed),
                &mut rng,
            )?
        };
        let ctx = ctx.permute(&[0, 2, 1, 3])?.reshape(&[b, l, hs])?;
        let a = self
            .attention_output_dropout
            .forward(&self.attention_output.forward(&ctx)?)?;
        let a = self.attention_norm.forward(&a.add(h)?)?;
        let f = self.act.after(&self.intermediate, &a)?;
        let f = self.output_dropout.forward(&self.output.forward(&f)?)?;
        self.output_norm.forward(&f.add(&a)?)
    }
}

impl BertLayer {
    /// A copy for activation checkpointing to run again in the backward (`nn::Replicate`):
    /// the same parameters, generators and hooks, the training flag's current value.
    fn replica(&self) -> BertLayer {
        BertLayer {
            query: self.query.replica(),
            key: self.key.replica(),
            value: self.value.replica(),
            attention_output: self.attention_output.replica(),
            attention_norm: self.attention_norm.replica(),
            intermediate: self.intermediate.replica(),
            output: self.output.replica(),
            output_norm: self.output_norm.replica(),
            heads: self.heads,
            act: self.act,
            attention_dropout_p: self.attention_dropout_p,
            attention_rng: self.attention_rng.clone(),
            attention_output_dropout: self.attention_output_dropout.replica(),
            output_dropout: self.output_dropout.replica(),
            training: AtomicBool::new(self.training.load(Ordering::Relaxed)),
        }
    }
}

/// A layer (a replica) as a checkpointed segment: inputs `h` and the additive mask.
impl Segment for BertLayer {
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor> {
        BertLayer::forward(self, &inputs[0], inputs.get(1))
    }
    fn generators(&self) -> Vec<&Mutex<Generator>> {
        crate::nn::generators(self)
    }
}

/// transformers' names (`attention.self.query`...); the attention's own dropout (its
/// generator and training flag) and the two dropout layers have no tensors.
impl Visit for BertLayer {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("attention.self.query", &self.query);
        v.child("attention.self.key", &self.key);
        v.child("attention.self.value", &self.value);
        v.child("attention.output.dense", &self.attention_output);
        v.child("attention.output.LayerNorm", &self.attention_norm);
        v.child("intermediate.dense", &self.intermediate);
        v.child("output.dense", &self.output);
        v.child("output.LayerNorm", &self.output_norm);
        v.generator(&self.attention_rng);
        v.training(&self.training);
        v.child("attention.output.dropout", &self.attention_output_dropout);
        v.child("output.dropout", &self.output_dropout);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("attention.self.query", &mut self.query);
        v.child("attention.self.key", &mut self.key);
        v.child("attention.self.value", &mut self.value);
        v.child("attention.output.dense", &mut self.attention_output);
        v.child("attention.output.LayerNorm", &mut self.attention_norm);
        v.child("intermediate.dense", &mut self.intermediate);
        v.child("output.dense", &mut self.output);
        v.child("output.LayerNorm", &mut self.output_norm);
        v.child(
            "attention.output.dropout",
            &mut self.attention_output_dropout,
        );
        v.child("output.dropout", &mut self.output_dropout);
    }
}

/// transformers' `BertModel`: embeddings, encoder and (optionally) the pooler.
pub struct BertModel {
    /// The model's configuration (written back by `save_pretrained`).
    pub config: BertConfig,
    /// `embeddings.*`: word, position and token-type embeddings with their LayerNorm.
    pub embeddings: BertEmbeddings,
    /// `encoder.layer.N`.
    pub layers: Vec<BertLayer>,
    /// `pooler.dense`: absent for `add_pooling_layer=False` (the masked-LM model).
    pub pooler: Option<Linear>,
    /// Activation checkpointing of the encoder layers in training (default off): each
    /// layer keeps only its input for the backward and runs its forward again there, but
    /// the last, with which the backward starts (recomputing it would hold the same
    /// activations at the same moment, one forward of it later).
    pub checkpoint_layers: bool,
}

/// The granularities BERT's `set_activation_checkpointing` takes.
const BERT_CHECKPOINT: [&str; 1] = ["layers"];

/// `BertModel::checkpoint_layers` for `set_activation_checkpointing(granularity)`.
fn bert_checkpoint(granularity: Option<&str>) -> Result<bool> {
    match granularity {
        None => Ok(false),
        Some("layers") => Ok(true),
        Some(other) => Err(Error::arg(
            "activation checkpointing",
            format!("BERT checkpoints its encoder \"layers\", not {other:?}"),
        )),
    }
}

/// Checks the three `[B, L]` I64 inputs.
fn check_text(ids: &Tensor, mask: &Tensor, types: &Tensor) -> Result<()> {
    for (name, t) in [
        ("input_ids", ids),
        ("attention_mask", mask),
        ("token_type_ids", types),
    ] {
        if t.dtype() != DType::I64 {
            return Err(Error::dtype(
                "BERT",
                t.dtype(),
                format!("{name} must be I64"),
            ));
        }
        if t.rank() != 2 || t.shape() != ids.shape() {
            return Err(Error::shape(
                "BERT",
                format!(
                    "{name} is {:?}; input_ids is {:?} (all must be [B, L])",
                    t.shape(),
                    ids.shape()
                ),
            ));
        }
    }
    if ids.shape()[1] == 0 {
        return Err(Error::shape("BERT", "input_ids has no tokens (L = 0)"));
    }
    Ok(())
}

impl BertModel {
    /// A freshly initialised model; `add_pooling_layer` as transformers'.
    pub fn new(config: &BertConfig, add_pooling_layer: bool, rng: &mut Generator) -> Result<Self> {
        config.validate().map_err(|m| Error::arg("BertModel", m))?;
        let embeddings = BertEmbeddings::new(config, rng)?;
        let layers = (0..config.num_hidden_layers)
            .map(|_| BertLayer::new(config, rng))
            .collect::<Result<_>>()?;
        let pooler = if add_pooling_layer {
            Some(linear(config, config.hidden_size, config.hidden_size, rng)?)
        } else {
            None
        };
        Ok(BertModel {
            config: config.clone(),
            embeddings,
            layers,
            pooler,
            checkpoint_layers: false,
        })
    }

    /// Reads `dir/config.json` and `dir/model.safetensors` (with its pooler when the file
    /// holds one).
    pub fn from_pretrained(dir: &Path, rng: &mut Generator) -> Result<Self> {
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let state = read_checkpoint(&dir.join("model.safetensors"))?;
        let has_pooler = state
            .iter()
            .any(|(n, _)| n.ends_with("pooler.dense.weight"));
        let mut model = BertModel::new(&config, has_pooler, rng)?;
        load_pretrained_state(
            &mut model,
            state,
            &dir.join("model.safetensors").display().to_string(),
        )?;
        Ok(model)
    }

    /// `input_ids`, `attention_mask`, `token_type_ids` `[B, L]` I64 ->
    /// (last_hidden_state `[B, L, H]`, pooler output `[B, H]` when the model has a pooler).
    pub fn forward_text(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        token_type_ids: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        check_text(input_ids, attention_mask, token_type_ids)?;
        let mut h = self.embeddings.forward(input_ids, token_type_ids)?;
        // Built once in the dtype the attention scores will have (the autocast dtype for
        // F32/half weights in an autocast region, else the weights' dtype); `attention`
        // casts if they differ.
        let wdt = self.embeddings.word_embeddings.weight.dtype();
        let score_dtype = match crate::ops::autocast::autocast_dtype() {
            Some(dt) if wdt != DType::F64 => dt,
            _ => wdt,
        };
        let mask = extended_attention_mask(attention_mask, score_dtype)?;
        let checkpoint = self.checkpoint_layers && crate::autograd::is_grad_enabled();
        let n = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            let _scope = crate::ops::scope::enter_index("encoder.layer", i);
            // The last layer runs as usual: the backward starts with it (see
            // `checkpoint_layers`).
            h = if checkpoint && i + 1 < n {
                crate::autograd::checkpoint(Arc::new(layer.replica()), &[&h, &mask])?
            } else {
                layer.forward(&h, Some(&mask))?
            };
        }
        let _scope = crate::ops::scope::enter("pooler");
        let pooled = match &self.pooler {
            Some(p) => Some(p.forward(&h.narrow(1, 0, 1)?.squeeze(1)?)?.tanh()?),
            None => None,
        };
        Ok((h, pooled))
    }

    /// `forward_text` of a batch's `Inputs::Text`.
    pub fn forward_batch(&self, inputs: &Inputs) -> Result<(Tensor, Option<Tensor>)> {
        let t = inputs.text()?;
        self.forward_text(&t.input_ids, &t.attention_mask, &t.token_type_ids)
    }

    /// `forward_text` with every token attended and token type 0.
    fn forward_ids(&self, ids: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if ids.dtype() != DType::I64 || ids.rank() != 2 {
            return Err(Error::shape(
                "BERT",
                format!(
                    "forward takes input_ids [B, L] I64, got {:?} {:?}",
                    ids.shape(),
                    ids.dtype()
                ),
            ));
        }
        let ones = Tensor::ones(ids.shape(), DType::I64)?.to_device(ids.device())?;
        let zeros = Tensor::zeros(ids.shape(), DType::I64)?.to_device(ids.device())?;
        self.forward_text(ids, &ones, &zeros)
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (see `save_pretrained`).
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        save_pretrained(self, &self.config, "BertModel", dir)
    }
}

impl Module for BertModel {
    /// input_ids `[B, L]` I64 -> last_hidden_state.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_ids(x)?.0)
    }
    fn forward_inputs(&self, inputs: &Inputs) -> Result<Tensor> {
        Ok(self.forward_batch(inputs)?.0)
    }

    fn set_activation_checkpointing(&mut self, granularity: Option<&str>) -> Result<()> {
        self.checkpoint_layers = bert_checkpoint(granularity)?;
        Ok(())
    }
    fn checkpoint_granularities(&self) -> &'static [&'static str] {
        &BERT_CHECKPOINT
    }
}

/// `embeddings`, `encoder.layer.{i}`, `pooler.dense`.
impl Visit for BertModel {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("embeddings", &self.embeddings);
        for (i, l) in self.layers.iter().enumerate() {
            v.child(&format!("encoder.layer.{i}"), l);
        }
        if let Some(p) = &self.pooler {
            v.child("pooler.dense", p);
        }
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("embeddings", &mut self.embeddings);
        for (i, l) in self.layers.iter_mut().enumerate() {
            v.child(&format!("encoder.layer.{i}"), l);
        }
        if let Some(p) = &mut self.pooler {
            v.child("pooler.dense", p);
        }
    }
}

/// transformers' `BertForSequenceClassification`: `bert.` (with pooler), dropout,
/// `classifier` -> logits `[B, num_labels]`.
pub struct BertForSequenceClassification {
    /// The encoder and its pooler, under the `bert.` prefix.
    pub bert: BertModel,
    /// `classifier`: H → `num_labels`, applied to the pooled `[CLS]` state.
    pub classifier: Linear,
    dropout: Dropout,
}

impl BertForSequenceClassification {
    /// A freshly initialised classifier (transformers' initialisation); `config.id2label`
    /// must name at least one class, else [`Error::Arg`].
    pub fn new(config: &BertConfig, rng: &mut Generator) -> Result<Self> {
        if config.num_labels() == 0 {
            return Err(Error::arg(
                "BertForSequenceClassification",
                "num_labels (id2label) must be > 0",
            ));
        }
        let bert = BertModel::new(config, true, rng)?;
        let classifier = linear(config, config.hidden_size, config.num_labels(), rng)?;
        let p = config
            .classifier_dropout
            .unwrap_or(config.hidden_dropout_prob);
        Ok(BertForSequenceClassification {
            bert,
            classifier,
            dropout: dropout(p, rng)?,
        })
    }

    /// Reads `dir/config.json` and `dir/model.safetensors`: a classifier checkpoint, or a
    /// base-model one (names without `bert.`, as all-MiniLM-L6-v2), which loads the
    /// encoder and pooler and leaves the classifier freshly initialised. `num_labels`
    /// overrides the config's labels (a new task on a pretrained encoder).
    pub fn from_pretrained(
        dir: &Path,
        num_labels: Option<usize>,
        rng: &mut Generator,
    ) -> Result<Self> {
        let mut config = BertConfig::from_file(&dir.join("config.json"))?;
        if let Some(n) = num_labels {
            config = config.with_num_labels(n);
        }
        let mut model = Self::new(&config, rng)?;
        load_pretrained(&mut model, &dir.join("model.safetensors"))?;
        Ok(model)
    }

    /// Logits `[B, num_labels]`.
    pub fn forward_text(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        token_type_ids: &Tensor,
    ) -> Result<Tensor> {
        let (_, pooled) = {
            let _scope = crate::ops::scope::enter("bert");
            self.bert
                .forward_text(input_ids, attention_mask, token_type_ids)?
        };
        let pooled = pooled.ok_or_else(|| Error::Msg("BERT classifier without a pooler".into()))?;
        self.classifier.forward(&self.dropout.forward(&pooled)?)
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` for transformers'
    /// `BertForSequenceClassification.from_pretrained(dir)` (see [`save_pretrained`]).
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        save_pretrained(
            self,
            &self.bert.config,
            "BertForSequenceClassification",
            dir,
        )
    }
}

impl Module for BertForSequenceClassification {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ones = Tensor::ones(x.shape(), DType::I64)?.to_device(x.device())?;
        let zeros = Tensor::zeros(x.shape(), DType::I64)?.to_device(x.device())?;
        self.forward_text(x, &ones, &zeros)
    }
    fn forward_inputs(&self, inputs: &Inputs) -> Result<Tensor> {
        let t = inputs.text()?;
        self.forward_text(&t.input_ids, &t.attention_mask, &t.token_type_ids)
    }

    fn set_activation_checkpointing(&mut self, granularity: Option<&str>) -> Result<()> {
        self.bert.checkpoint_layers = bert_checkpoint(granularity)?;
        Ok(())
    }
    fn checkpoint_granularities(&self) -> &'static [&'static str] {
        &BERT_CHECKPOINT
    }
}

impl Visit for BertForSequenceClassification {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("bert", &self.bert);
        v.child("classifier", &self.classifier);
        v.child("dropout", &self.dropout);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("bert", &mut self.bert);
        v.child("classifier", &mut self.classifier);
        v.child("dropout", &mut self.dropout);
    }
}

/// transformers' `BertForMaskedLM`: `bert.` (no pooler) and `cls.predictions`: dense,
/// activation, LayerNorm, then the decoder tied to the word embeddings plus
/// `cls.predictions.bias` -> logits `[B, L, vocab]`.
pub struct BertForMaskedLM {
    /// The encoder without pooler, under the `bert.` prefix; its word embeddings double as
    /// the decoder weight.
    pub bert: BertModel,
    /// `cls.predictions.transform.dense`.
    pub transform: Linear,
    /// `cls.predictions.transform.LayerNorm`.
    pub transform_norm: LayerNorm,
    /// `cls.predictions.bias` `[vocab]`.
    pub bias: Tensor,
}

impl BertForMaskedLM {
    /// A freshly initialised masked-LM model (transformers' initialisation), without
    /// pooler, its decoder tied to the word embeddings.
    pub fn new(config: &BertConfig, rng: &mut Generator) -> Result<Self> {
        let bert = BertModel::new(config, false, rng)?;
        let transform = linear(config, config.hidden_size, config.hidden_size, rng)?;
        Ok(BertForMaskedLM {
            bert,
            transform,
            transform_norm: layer_norm(config)?,
            bias: param(Tensor::zeros(&[config.vocab_size], DType::F32)?)?,
        })
    }

    /// Reads `dir/config.json` and `dir/model.safetensors`: a masked-LM checkpoint, or a
    /// base-model one (its pooler ignored, as transformers does), leaving the head fresh.
    pub fn from_pretrained(dir: &Path, rng: &mut Generator) -> Result<Self> {
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let mut model = Self::new(&config, rng)?;
        load_pretrained(&mut model, &dir.join("model.safetensors"))?;
        Ok(model)
    }

    /// Logits `[B, L, vocab]`.
    pub fn forward_text(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        token_type_ids: &Tensor,
    ) -> Result<Tensor> {
        let (h, _) = {
            let _scope = crate::ops::scope::enter("bert");
            self.bert
                .forward_text(input_ids, attention_mask, token_type_ids)?
        };
        let t = self
            .bert
            .config
            .hidden_act
            .apply(&self.transform.forward(&h)?)?;
        let t = self.transform_norm.forward(&t)?;
        // The decoder: the word-embedding matrix itself ([vocab, H]), as `linear`'s weight.
        t.linear(
            &self.bert.embeddings.word_embeddings.weight,
            Some(&self.bias),
        )
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` for transformers'
    /// `BertForMaskedLM.from_pretrained(dir)` (see [`save_pretrained`]).
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        save_pretrained(self, &self.bert.config, "BertForMaskedLM", dir)
    }
}

impl Module for BertForMaskedLM {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ones = Tensor::ones(x.shape(), DType::I64)?.to_device(x.device())?;
        let zeros = Tensor::zeros(x.shape(), DType::I64)?.to_device(x.device())?;
        self.forward_text(x, &ones, &zeros)
    }
    fn forward_inputs(&self, inputs: &Inputs) -> Result<Tensor> {
        let t = inputs.text()?;
        self.forward_text(&t.input_ids, &t.attention_mask, &t.token_type_ids)
    }

    fn set_activation_checkpointing(&mut self, granularity: Option<&str>) -> Result<()> {
        self.bert.checkpoint_layers = bert_checkpoint(granularity)?;
        Ok(())
    }
    fn checkpoint_granularities(&self) -> &'static [&'static str] {
        &BERT_CHECKPOINT
    }
}

/// transformers' order: `bert.*`, then `cls.predictions.bias` (the head's own parameter),
/// then its transform. The tied decoder is not listed (see the module doc); it is the
/// word-embedding table, so `layers_mut` lists the encoder's layers and the transform only.
impl Visit for BertForMaskedLM {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.child("bert", &self.bert);
        v.param("cls.predictions.bias", &self.bias);
        v.child("cls.predictions.transform.dense", &self.transform);
        v.child("cls.predictions.transform.LayerNorm", &self.transform_norm);
    }
    fn visit_mut<'a>(&'a mut self, v: &mut dyn VisitorMut<'a>) {
        v.child("bert", &mut self.bert);
        v.param("cls.predictions.bias", &mut self.bias);
        v.child("cls.predictions.transform.dense", &mut self.transform);
        v.child(
            "cls.predictions.transform.LayerNorm",
            &mut self.transform_norm,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Checkpoints.

/// Names in transformers' BERT files that hemi does not hold: the position-id and
/// token-type-id buffers (saved by older versions) and the masked-LM decoder tied to the
/// word embeddings and `cls.predictions.bias`.
fn is_ignored_name(name: &str) -> bool {
    name.ends_with("embeddings.position_ids")
        || name.ends_with("embeddings.token_type_ids")
        || name == "cls.predictions.decoder.weight"
        || name == "cls.predictions.decoder.bias"
}

/// A checkpoint's tensors without the names hemi ignores.
fn read_checkpoint(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let (tensors, _) = crate::io::load_safetensors(path)?;
    Ok(tensors
        .into_iter()
        .filter(|(n, _)| !is_ignored_name(n))
        .collect())
}

/// Loads a transformers BERT checkpoint (`model.safetensors`) into `model` (a `BertModel`
/// or a head model whose encoder is under `bert.`).
///
/// The file may be the model's own checkpoint (every name of the model, nothing else); for
/// a head model, a base-model checkpoint without the `bert.` prefix: then the file must
/// cover every `bert.*` tensor (its pooler is ignored when the model has none, as
/// transformers' masked-LM does) and the head keeps its fresh values; for a `BertModel`,
/// a head model's checkpoint, whose `bert.*` tensors are loaded and the rest ignored. Buffers hemi does not
/// hold and tied names are ignored (see `is_ignored_name`). Any other missing, unexpected
/// or mis-shaped name is an error listing all of them, and then nothing is loaded. Values
/// are cast to each tensor's dtype.
pub fn load_pretrained<M: Module + ?Sized>(model: &mut M, path: &Path) -> Result<()> {
    let state = read_checkpoint(path)?;
    load_pretrained_state(model, state, &path.display().to_string())
}

/// `load_pretrained` from tensors already read; `what` names the source in errors.
pub fn load_pretrained_state<M: Module + ?Sized>(
    model: &mut M,
    mut state: Vec<(String, Tensor)>,
    what: &str,
) -> Result<()> {
    let ours: HashMap<String, Vec<usize>> = model
        .tensors()
        .into_iter()
        .map(|(n, t, _, _)| (n, t.shape().to_vec()))
        .collect();
    let is_head = ours.keys().any(|n| n.starts_with("bert."));
    let file_is_head = state.iter().any(|(n, _)| n.starts_with("bert."));
    if !is_head && file_is_head {
        // A head model's checkpoint into a `BertModel`: its encoder, without the head (the
        // head's weights go unused, as in transformers' `BertModel.from_pretrained`).
        state = state
            .into_iter()
            .filter_map(|(n, t)| n.strip_prefix("bert.").map(|n| (n.to_string(), t)))
            .collect();
    }
    let base_checkpoint = is_head && !file_is_head;
    if base_checkpoint {
        let has_pooler = ours.contains_key("bert.pooler.dense.weight");
        state.retain(|(n, _)| has_pooler || !n.starts_with("pooler."));
        for (n, _) in &mut state {
            *n = format!("bert.{n}");
        }
    }
    // Required: every name, or only the encoder's for a base checkpoint.
    let required = |n: &str| !base_checkpoint || n.starts_with("bert.");
    let mut m = StateDictMismatch::default();
    let mut seen = HashSet::new();
    for (name, t) in &state {
        if !seen.insert(name.as_str()) {
            m.duplicated.push(name.clone());
            continue;
        }
        match ours.get(name) {
            None => m.unexpected.push(name.clone()),
            Some(s) if s.as_slice() != t.shape() => {
                m.shapes.push((name.clone(), t.shape().to_vec(), s.clone()))
            }
            Some(_) => {}
        }
    }
    m.missing = model
        .tensors()
        .into_iter()
        .map(|(n, ..)| n)
        .filter(|n| required(n) && !seen.contains(n.as_str()))
        .collect();
    if !m.is_empty() {
        let kind = if base_checkpoint {
            " (a base-model checkpoint, loaded under `bert.`)"
        } else {
            ""
        };
        return Err(Error::Data {
            path: what.to_string(),
            msg: format!("BERT checkpoint does not fit the model{kind}: {m}"),
        });
    }
    // Cast everything first, so that a failing cast leaves the model as it was.
    let by_name: HashMap<&str, &Tensor> = state.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut slots = model.tensors_mut();
    let mut values = Vec::with_capacity(slots.len());
    for slot in &slots {
        values.push(match by_name.get(slot.name.as_str()) {
            Some(v) => Some(v.detach().to_dtype(slot.tensor.dtype())?),
            None => None,
        });
    }
    for (slot, v) in slots.iter_mut().zip(&values) {
        if let Some(v) = v {
            slot.tensor.set_data(v)?;
        }
    }
    Ok(())
}

/// Writes `dir/config.json` (transformers' `BertConfig`, `architectures` = `[architecture]`)
/// and `dir/model.safetensors` (the model's `state_dict`, whose names are transformers';
/// metadata `format: pt`, which transformers requires), so that
/// `<architecture>.from_pretrained(dir)` loads with no missing or unexpected keys.
pub fn save_pretrained<M: Module + ?Sized>(
    model: &M,
    config: &BertConfig,
    architecture: &str,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let cfg = serde_json::to_string_pretty(&config.to_json(architecture))
        .map_err(|e| Error::Msg(format!("config.json: {e}")))?;
    crate::io::atomic_write(&dir.join("config.json"), cfg.as_bytes())?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::io::save_safetensors(
        &dir.join("model.safetensors"),
        &model.state_dict(),
        Some(meta),
    )
}

/// sentence-transformers' sentence embedding: the mean of `hidden` `[B, L, H]` over the
/// tokens where `attention_mask` `[B, L]` is 1 (clamped to at least 1e-9 tokens), then
/// L2-normalised (norm clamped to at least 1e-12) -> `[B, H]`.
pub fn sentence_embedding(hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
    let [b, l, _] = hidden.shape() else {
        return Err(Error::shape(
            "sentence_embedding",
            format!("hidden must be [B, L, H], got {:?}", hidden.shape()),
        ));
    };
    if attention_mask.shape() != [*b, *l] {
        return Err(Error::shape(
            "sentence_embedding",
            format!(
                "attention_mask is {:?}, hidden is {:?}",
                attention_mask.shape(),
                hidden.shape()
            ),
        ));
    }
    let m = attention_mask.to_dtype(hidden.dtype())?.unsqueeze(-1)?;
    let summed = hidden.mul(&m)?.sum(&[1], false)?;
    let count = m.sum(&[1], false)?.clamp(1e-9, f64::INFINITY)?;
    let mean = summed.div(&count)?;
    let norm = mean
        .square()?
        .sum(&[-1], true)?
        .sqrt()?
        .clamp(1e-12, f64::INFINITY)?;
    mean.div(&norm)
}
