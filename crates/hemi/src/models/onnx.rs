//! ONNX export of the ready-made models: each describes its eval-mode forward with the graph
//! builder of `crate::io::onnx`, from its own layers (so the file's initializers are its
//! `state_dict` tensors under their `state_dict` names; BatchNorm's `num_batches_tracked`
//! counters, which the forward does not read, are left out).
//!
//! Inputs and outputs: image models take `input` `[batch, C, H, W]` F32 (normalised as the
//! training recipe normalised, which the file's metadata records when the exporter knows it)
//! and give `logits` `[batch, classes]`. BERT models take `input_ids`, `attention_mask` (1
//! keep, 0 padding) and `token_type_ids`, int64 `[batch, sequence]`, and give `logits`
//! (`[batch, num_labels]`, or `[batch, sequence, vocab]` for the masked-LM head).

use std::any::Any;

use crate::error::{Error, Result};
use crate::io::onnx::proto::{data_type, ModelProto};
use crate::io::onnx::{attr_int, attr_ints, build_model, Dim, ExportOptions, Graph, OnnxExport};
use crate::models::bert::{BertForMaskedLM, BertForSequenceClassification, BertModel, HiddenAct};
use crate::models::resnet::{Block, ResNet, Shortcut};
use crate::models::{CifarNet, Mlp};
use crate::nn::{MaxPool2d, Module};

/// The exporter of `model` when its type has one (CifarNet, Mlp, ResNet, the BERT
/// classifier and masked-LM models).
pub fn onnx_exporter<'a>(model: &'a (dyn Module + 'static)) -> Option<&'a dyn OnnxExport> {
    let any: &dyn Any = model;
    macro_rules! first_of {
        ($($t:ty),*) => {
            $(if let Some(m) = any.downcast_ref::<$t>() {
                return Some(m);
            })*
        };
    }
    first_of!(
        CifarNet,
        Mlp,
        ResNet,
        BertForSequenceClassification,
        BertForMaskedLM
    );
    None
}

/// The ONNX model of `model` (registered as `name`), or an error when its type has no
/// exporter or `opts` do not fit it.
pub fn export_onnx(
    name: &str,
    model: &(dyn Module + 'static),
    opts: &ExportOptions,
) -> Result<ModelProto> {
    let e = onnx_exporter(model).ok_or_else(|| {
        Error::arg(
            "onnx export",
            format!(
                "model {name} has no ONNX export (exported: cifar-net, mlp, the ResNets, \
                 bert-classifier, bert-mlm)"
            ),
        )
    })?;
    build_model(name, e, opts)
}

fn batch() -> Dim {
    Dim::symbol("batch")
}

/// Declares the F32 image input `[batch, C, H, W]`, checking its channels against the
/// model's first layer (`channels`) when it has one.
fn image_input(
    g: &mut Graph,
    model: &str,
    opts: &ExportOptions,
    channels: Option<usize>,
) -> Result<(String, [usize; 3])> {
    let shape = opts.image_shape(model)?;
    if let Some(c) = channels {
        if shape[0] != c {
            return Err(Error::shape(
                "onnx export",
                format!("{model} takes {c}-channel images, the input shape is {shape:?}"),
            ));
        }
    }
    let [c, h, w] = shape;
    let x = g.input(
        "input",
        data_type::FLOAT,
        &[batch(), Dim::Fixed(c), Dim::Fixed(h), Dim::Fixed(w)],
    )?;
    Ok((x, shape))
}

fn logits_output(g: &mut Graph, value: &str, classes: usize) -> Result<()> {
    g.output(
        value,
        "logits",
        data_type::FLOAT,
        &[batch(), Dim::Fixed(classes)],
    )
}

fn flatten(g: &mut Graph, x: &str) -> String {
    g.node("Flatten", "flatten", &[x], vec![attr_int("axis", 1)])
}

/// Checks that a Linear layer taking `features` inputs fits the flattened activations.
fn check_features(model: &str, layer: &str, want: usize, got: usize) -> Result<()> {
    if want != got {
        return Err(Error::shape(
            "onnx export",
            format!(
                "{model}: {layer} takes {want} features, the input shape gives {got} \
                 (export with the input shape the model was built for)"
            ),
        ));
    }
    Ok(())
}

impl OnnxExport for CifarNet {
    fn build_onnx(&self, g: &mut Graph, opts: &ExportOptions) -> Result<()> {
        let (x, [_, h, w]) = image_input(g, "cifar-net", opts, Some(self.conv1.weight.shape()[1]))?;
        let after = |s: usize| (s.saturating_sub(2) / 2).saturating_sub(2) / 2;
        check_features(
            "cifar-net",
            "fc1",
            self.fc1.weight.shape()[1],
            self.conv2.weight.shape()[0] * after(h) * after(w),
        )?;
        let pool = MaxPool2d::new(2);
        let mut x = x;
        for (name, conv) in [("conv1", &self.conv1), ("conv2", &self.conv2)] {
            x = g.conv2d(name, conv, &x)?;
            x = g.relu(&format!("{name}.relu"), &x);
            x = g.max_pool2d(&format!("{name}.pool"), &pool, &x)?;
        }
        let x = flatten(g, &x);
        let x = g.gemm("fc1", &self.fc1, &x)?;
        let x = g.relu("fc1.relu", &x);
        let x = g.gemm("fc2", &self.fc2, &x)?;
        logits_output(g, &x, self.fc2.weight.shape()[0])
    }
}

impl OnnxExport for Mlp {
    fn build_onnx(&self, g: &mut Graph, opts: &ExportOptions) -> Result<()> {
        let (x, shape) = image_input(g, "mlp", opts, None)?;
        check_features(
            "mlp",
            "fc1",
            self.fc1.weight.shape()[1],
            shape.iter().product(),
        )?;
        let x = flatten(g, &x);
        let x = g.gemm("fc1", &self.fc1, &x)?;
        let x = g.relu("fc1.relu", &x);
        let x = g.gemm("fc2", &self.fc2, &x)?;
        logits_output(g, &x, self.fc2.weight.shape()[0])
    }
}

/// A residual block: `relu(bn_k(conv_k(…relu(bn1(conv1(x)))…)) + shortcut(x))`.
fn block(g: &mut Graph, prefix: &str, b: &Block, x: &str) -> Result<String> {
    let mut out = x.to_string();
    let last = b.layers.len().saturating_sub(1);
    for (i, (conv, bn)) in b.layers.iter().enumerate() {
        out = g.conv2d(&format!("{prefix}.conv{}", i + 1), conv, &out)?;
        out = g.batch_norm2d(&format!("{prefix}.bn{}", i + 1), bn, &out)?;
        if i < last {
            out = g.relu(&format!("{prefix}.relu{}", i + 1), &out);
        }
    }
    let shortcut = match &b.shortcut {
        Shortcut::Identity => x.to_string(),
        Shortcut::Projection { conv, bn } => {
            let s = g.conv2d(&format!("{prefix}.downsample.0"), conv, x)?;
            g.batch_norm2d(&format!("{prefix}.downsample.1"), bn, &s)?
        }
        Shortcut::Pad {
            stride,
            extra_channels,
        } => {
            // Option A: x[:, :, ::s, ::s] ...
            let mut s = x.to_string();
            if *stride > 1 {
                let st = *stride as i64;
                let starts = g.const_i64(&format!("{prefix}.shortcut.starts"), &[0, 0], &[2]);
                let ends = g.const_i64(
                    &format!("{prefix}.shortcut.ends"),
                    &[i64::MAX, i64::MAX],
                    &[2],
                );
                let axes = g.const_i64(&format!("{prefix}.shortcut.axes"), &[2, 3], &[2]);
                let steps = g.const_i64(&format!("{prefix}.shortcut.steps"), &[st, st], &[2]);
                s = g.node(
                    "Slice",
                    &format!("{prefix}.shortcut.subsample"),
                    &[&s, &starts, &ends, &axes, &steps],
                    vec![],
                );
            }
            // ... between zero channels: extra/2 before, the rest after.
            if *extra_channels > 0 {
                let before = (*extra_channels / 2) as i64;
                let after = *extra_channels as i64 - before;
                let pads = g.const_i64(
                    &format!("{prefix}.shortcut.pads"),
                    &[0, before, 0, 0, 0, after, 0, 0],
                    &[8],
                );
                s = g.node("Pad", &format!("{prefix}.shortcut"), &[&s, &pads], vec![]);
            }
            s
        }
    };
    let sum = g.node("Add", &format!("{prefix}.add"), &[&out, &shortcut], vec![]);
    Ok(g.relu(&format!("{prefix}.relu"), &sum))
}

impl OnnxExport for ResNet {
    fn build_onnx(&self, g: &mut Graph, opts: &ExportOptions) -> Result<()> {
        let (x, _) = image_input(g, "ResNet", opts, Some(self.conv1.weight.shape()[1]))?;
        let x = g.conv2d("conv1", &self.conv1, &x)?;
        let x = g.batch_norm2d("bn1", &self.bn1, &x)?;
        let mut x = g.relu("relu", &x);
        if let Some(pool) = &self.maxpool {
            x = g.max_pool2d("maxpool", pool, &x)?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            for (j, b) in layer.iter().enumerate() {
                x = block(g, &format!("layer{}.{j}", i + 1), b, &x)?;
            }
        }
        let x = g.node("GlobalAveragePool", "avgpool", &[&x], vec![]);
        let x = flatten(g, &x);
        let x = g.gemm("fc", &self.fc, &x)?;
        logits_output(g, &x, self.fc.weight.shape()[0])
    }
}

/// The three int64 `[batch, sequence]` inputs of a BERT model.
fn text_inputs(g: &mut Graph) -> Result<[String; 3]> {
    let dims = [batch(), Dim::symbol("sequence")];
    Ok([
        g.input("input_ids", data_type::INT64, &dims)?,
        g.input("attention_mask", data_type::INT64, &dims)?,
        g.input("token_type_ids", data_type::INT64, &dims)?,
    ])
}

/// The feed-forward activation; the exact GELU is `x · ½ · (1 + erf(x / √2))`.
fn activation(g: &mut Graph, prefix: &str, act: HiddenAct, x: &str) -> String {
    let c = |g: &mut Graph, hint: &str, v: f32| g.const_f32(&format!("{prefix}.{hint}"), &[v], &[]);
    match act {
        HiddenAct::Relu => g.relu(&format!("{prefix}.relu"), x),
        HiddenAct::Gelu => {
            let inv_sqrt2 = c(g, "inv_sqrt2", std::f32::consts::FRAC_1_SQRT_2);
            let (one, half) = (c(g, "one", 1.0), c(g, "half", 0.5));
            let t = g.node(
                "Mul",
                &format!("{prefix}.gelu.scaled"),
                &[x, &inv_sqrt2],
                vec![],
            );
            let t = g.node("Erf", &format!("{prefix}.gelu.erf"), &[&t], vec![]);
            let t = g.node("Add", &format!("{prefix}.gelu.erf1"), &[&t, &one], vec![]);
            let t = g.node("Mul", &format!("{prefix}.gelu.x_erf1"), &[x, &t], vec![]);
            g.node("Mul", &format!("{prefix}.gelu"), &[&t, &half], vec![])
        }
        HiddenAct::GeluNew | HiddenAct::GeluPytorchTanh => {
            // ½ · x · (1 + tanh(√(2/π) · (x + 0.044715 x³)))
            let k = c(
                g,
                "sqrt_2_over_pi",
                (2.0f64 / std::f64::consts::PI).sqrt() as f32,
            );
            let a = c(g, "coef", 0.044715);
            let (one, half) = (c(g, "one", 1.0), c(g, "half", 0.5));
            let x2 = g.node("Mul", &format!("{prefix}.gelu.x2"), &[x, x], vec![]);
            let x3 = g.node("Mul", &format!("{prefix}.gelu.x3"), &[&x2, x], vec![]);
            let t = g.node("Mul", &format!("{prefix}.gelu.ax3"), &[&x3, &a], vec![]);
            let t = g.node("Add", &format!("{prefix}.gelu.inner"), &[x, &t], vec![]);
            let t = g.node("Mul", &format!("{prefix}.gelu.scaled"), &[&t, &k], vec![]);
            let t = g.node("Tanh", &format!("{prefix}.gelu.tanh"), &[&t], vec![]);
            let t = g.node("Add", &format!("{prefix}.gelu.tanh1"), &[&t, &one], vec![]);
            let t = g.node("Mul", &format!("{prefix}.gelu.x_tanh1"), &[x, &t], vec![]);
            g.node("Mul", &format!("{prefix}.gelu"), &[&t, &half], vec![])
        }
    }
}

/// What the encoder gives the heads.
struct Encoded {
    /// The final hidden states `[batch, sequence, H]`.
    hidden: String,
    /// The pooler's output `[batch, H]`, when the model has a pooler.
    pooled: Option<String>,
    /// The F32 word-embedding matrix `[vocab, H]` (the masked-LM decoder's weight).
    word_embeddings: String,
}

/// `BertModel::forward_text` under `prefix` (`bert`).
fn bert_encoder(
    g: &mut Graph,
    prefix: &str,
    m: &BertModel,
    inputs: &[String; 3],
) -> Result<Encoded> {
    let [ids, mask, types] = inputs;
    let cfg = &m.config;
    let e = &m.embeddings;
    let p = format!("{prefix}.embeddings");
    // word + token type + position (positions 0..L: the first L rows of the table).
    let word_weight = g.param(
        &format!("{p}.word_embeddings.weight"),
        &e.word_embeddings.weight,
        false,
    )?;
    let words = g.node(
        "Gather",
        &format!("{p}.word_embeddings"),
        &[&word_weight, ids],
        vec![attr_int("axis", 0)],
    );
    let types = g.embedding(
        &format!("{p}.token_type_embeddings"),
        &e.token_type_embeddings,
        types,
    )?;
    let pos_weight = g.param(
        &format!("{p}.position_embeddings.weight"),
        &e.position_embeddings.weight,
        false,
    )?;
    let shape = g.node("Shape", &format!("{p}.ids_shape"), &[ids], vec![]);
    let (one, two, zero) = (
        g.const_i64(&format!("{p}.one"), &[1], &[1]),
        g.const_i64(&format!("{p}.two"), &[2], &[1]),
        g.const_i64(&format!("{p}.zero"), &[0], &[1]),
    );
    let len = g.node(
        "Slice",
        &format!("{p}.length"),
        &[&shape, &one, &two],
        vec![],
    );
    let positions = g.node(
        "Slice",
        &format!("{p}.position_embeddings"),
        &[&pos_weight, &zero, &len, &zero],
        vec![],
    );
    let x = g.node("Add", &format!("{p}.word_type"), &[&words, &types], vec![]);
    let x = g.node("Add", &format!("{p}.sum"), &[&x, &positions], vec![]);
    let mut h = g.layer_norm(&format!("{p}.LayerNorm"), &e.layer_norm, &x)?;

    // The additive mask [batch, 1, 1, sequence]: 0 where kept, -f32::MAX/2 where padded (the
    // value `extended_attention_mask` uses).
    let m_f = g.node(
        "Cast",
        &format!("{prefix}.mask.float"),
        &[mask],
        vec![attr_int("to", data_type::FLOAT as i64)],
    );
    let one_f = g.const_f32(&format!("{prefix}.mask.one"), &[1.0], &[]);
    let neg = g.const_f32(&format!("{prefix}.mask.large"), &[-f32::MAX / 2.0], &[]);
    let inv = g.node(
        "Sub",
        &format!("{prefix}.mask.inverted"),
        &[&one_f, &m_f],
        vec![],
    );
    let add = g.node(
        "Mul",
        &format!("{prefix}.mask.additive"),
        &[&inv, &neg],
        vec![],
    );
    let axes = g.const_i64(&format!("{prefix}.mask.axes"), &[1, 2], &[2]);
    let ext = g.node(
        "Unsqueeze",
        &format!("{prefix}.mask"),
        &[&add, &axes],
        vec![],
    );

    let (hs, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let d = cfg.head_dim();
    let split = g.const_i64(
        &format!("{prefix}.heads_shape"),
        &[0, 0, heads as i64, d as i64],
        &[4],
    );
    let merge = g.const_i64(&format!("{prefix}.hidden_shape"), &[0, 0, hs as i64], &[3]);
    let scale = g.const_f32(&format!("{prefix}.scale"), &[1.0 / (d as f32).sqrt()], &[]);
    for (i, layer) in m.layers.iter().enumerate() {
        let p = format!("{prefix}.encoder.layer.{i}");
        // [B, L, H] -> [B, heads, L, d] (keys -> [B, heads, d, L]).
        let heads_of = |g: &mut Graph, name: &str, l, perm: &[i64]| -> Result<String> {
            let y = g.linear(&format!("{p}.attention.self.{name}"), l, &h)?;
            let y = g.node(
                "Reshape",
                &format!("{p}.{name}.split"),
                &[&y, &split],
                vec![],
            );
            Ok(g.node(
                "Transpose",
                &format!("{p}.{name}.heads"),
                &[&y],
                vec![attr_ints("perm", perm)],
            ))
        };
        let q = heads_of(g, "query", &layer.query, &[0, 2, 1, 3])?;
        let k = heads_of(g, "key", &layer.key, &[0, 2, 3, 1])?;
        let v = heads_of(g, "value", &layer.value, &[0, 2, 1, 3])?;
        let s = g.node("MatMul", &format!("{p}.scores"), &[&q, &k], vec![]);
        let s = g.node("Mul", &format!("{p}.scores_scaled"), &[&s, &scale], vec![]);
        let s = g.node("Add", &format!("{p}.scores_masked"), &[&s, &ext], vec![]);
        let probs = g.node(
            "Softmax",
            &format!("{p}.probs"),
            &[&s],
            vec![attr_int("axis", -1)],
        );
        let ctx = g.node("MatMul", &format!("{p}.context"), &[&probs, &v], vec![]);
        let ctx = g.node(
            "Transpose",
            &format!("{p}.context_t"),
            &[&ctx],
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        );
        let ctx = g.node(
            "Reshape",
            &format!("{p}.context_merged"),
            &[&ctx, &merge],
            vec![],
        );
        let a = g.linear(
            &format!("{p}.attention.output.dense"),
            &layer.attention_output,
            &ctx,
        )?;
        let a = g.node("Add", &format!("{p}.attention.residual"), &[&a, &h], vec![]);
        let a = g.layer_norm(
            &format!("{p}.attention.output.LayerNorm"),
            &layer.attention_norm,
            &a,
        )?;
        let f = g.linear(&format!("{p}.intermediate.dense"), &layer.intermediate, &a)?;
        let f = activation(g, &format!("{p}.intermediate"), cfg.hidden_act, &f);
        let f = g.linear(&format!("{p}.output.dense"), &layer.output, &f)?;
        let f = g.node("Add", &format!("{p}.output.residual"), &[&f, &a], vec![]);
        h = g.layer_norm(&format!("{p}.output.LayerNorm"), &layer.output_norm, &f)?;
    }
    let pooled = match &m.pooler {
        Some(pooler) => {
            let first = g.const_i64(&format!("{prefix}.pooler.first"), &[0], &[]);
            let cls = g.node(
                "Gather",
                &format!("{prefix}.pooler.cls"),
                &[&h, &first],
                vec![attr_int("axis", 1)],
            );
            let y = g.gemm(&format!("{prefix}.pooler.dense"), pooler, &cls)?;
            Some(g.node("Tanh", &format!("{prefix}.pooler"), &[&y], vec![]))
        }
        None => None,
    };
    Ok(Encoded {
        hidden: h,
        pooled,
        word_embeddings: word_weight,
    })
}

impl OnnxExport for BertForSequenceClassification {
    fn build_onnx(&self, g: &mut Graph, _opts: &ExportOptions) -> Result<()> {
        let inputs = text_inputs(g)?;
        let enc = bert_encoder(g, "bert", &self.bert, &inputs)?;
        let pooled = enc
            .pooled
            .ok_or_else(|| Error::Msg("BERT classifier without a pooler".into()))?;
        let x = g.gemm("classifier", &self.classifier, &pooled)?;
        logits_output(g, &x, self.classifier.weight.shape()[0])
    }
}

impl OnnxExport for BertForMaskedLM {
    fn build_onnx(&self, g: &mut Graph, _opts: &ExportOptions) -> Result<()> {
        let inputs = text_inputs(g)?;
        let enc = bert_encoder(g, "bert", &self.bert, &inputs)?;
        let p = "cls.predictions";
        let t = g.linear(
            &format!("{p}.transform.dense"),
            &self.transform,
            &enc.hidden,
        )?;
        let t = activation(
            g,
            &format!("{p}.transform"),
            self.bert.config.hidden_act,
            &t,
        );
        let t = g.layer_norm(
            &format!("{p}.transform.LayerNorm"),
            &self.transform_norm,
            &t,
        )?;
        // The decoder is the word-embedding matrix itself (tied), plus `cls.predictions.bias`.
        let wt = g.node(
            "Transpose",
            &format!("{p}.decoder.weight_t"),
            &[&enc.word_embeddings],
            vec![attr_ints("perm", &[1, 0])],
        );
        let y = g.node("MatMul", &format!("{p}.decoder.matmul"), &[&t, &wt], vec![]);
        let bias = g.param(&format!("{p}.bias"), &self.bias, false)?;
        let y = g.node("Add", &format!("{p}.decoder"), &[&y, &bias], vec![]);
        g.output(
            &y,
            "logits",
            data_type::FLOAT,
            &[
                batch(),
                Dim::symbol("sequence"),
                Dim::Fixed(self.bert.config.vocab_size),
            ],
        )
    }
}
