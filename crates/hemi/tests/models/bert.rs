//! BERT against PyTorch + transformers: the pretrained all-MiniLM-L6-v2 (hidden states,
//! pooler, sentence embeddings), a tiny random classifier and masked LM saved by
//! transformers (logits, names), checkpoints both ways, bad input, autocast, a short
//! training run and a finite-difference gradient check in F64.
//!
//! Fixtures: `tests/fixtures/bert/` (made by `bench/bert_fixtures.py`, see its README).
//! The pretrained model is read from `../shared/models/all-MiniLM-L6-v2` beside the
//! checkout, or hemi's cache (fetched there once: `common::minilm_dir`), never copied into
//! the repository.

use crate::common;

use std::path::{Path, PathBuf};

use hemi::amp::autocast;
use hemi::data::{Inputs, TextInputs};
use hemi::io::load_safetensors;
use hemi::models::{
    load_pretrained, sentence_embedding, BertConfig, BertForMaskedLM,
    BertForSequenceClassification, BertModel,
};
use hemi::nn::Module;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::optim::{AdamW, AdamWConfig, Optimizer};
use hemi::{DType, Generator, Tensor};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bert");

fn minilm_dir() -> PathBuf {
    common::minilm_dir()
}

fn fixture(rel: &str) -> Vec<(String, Tensor)> {
    load_safetensors(&Path::new(FIXTURES).join(rel))
        .unwrap_or_else(|e| panic!("fixture {rel}: {e}"))
        .0
}

fn get<'a>(ts: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &ts.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("fixture has no tensor {name}"))
        .1
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// F32 agreement bound between two implementations of the same F32 network:
/// `C · eps_f32 · √depth · max|reference|`.
///
/// Each layer's outputs carry the rounding error of F32 sums of up to K terms (K = 1536
/// in the feed-forward of MiniLM); summed in different orders by hemi and PyTorch, their
/// difference behaves as a random walk of about √K·u relative to the scale of the terms
/// (√1536 ≈ 39, u = eps/2), and the LayerNorm after each block brings errors back to the
/// scale of its output. Layers add independent errors, hence √depth. C = 64 allows that
/// √K·u with a factor ~3 for the softmax/GELU/LayerNorm steps and both implementations.
/// A wrong op (a missing mask, a wrong scale, the wrong GELU, a transposed weight) errs by
/// O(1) of the scale.
const C_F32: f64 = 64.0;

fn f32_bound(depth: usize, reference: &[f64]) -> f64 {
    C_F32 * f32::EPSILON as f64 * (depth as f64).sqrt() * max_abs(reference)
}

fn text(ts: &[(String, Tensor)], rows: usize) -> (Tensor, Tensor, Tensor) {
    let n = |name: &str| {
        get(ts, name)
            .narrow(0, 0, rows)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    (n("input_ids"), n("attention_mask"), n("token_type_ids"))
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn minilm_matches_transformers() {
    let dir = minilm_dir();
    let mut model = BertModel::from_pretrained(&dir, &mut Generator::new(0)).unwrap();
    model.set_training(false);
    let fx = fixture("minilm_sst2.safetensors");
    let (ids, mask, types) = text(&fx, 32);
    let (h, pooled) = {
        let _g = hemi::no_grad();
        model.forward_text(&ids, &mask, &types).unwrap()
    };
    let depth = model.config.num_hidden_layers;

    // Hidden states of the first 4 sentences (padding positions included: transformers
    // computes them too).
    let want = get(&fx, "last_hidden_state").to_vec_f64();
    let got = h.narrow(0, 0, 4).unwrap().to_vec_f64();
    let (d, bound) = (max_abs_diff(&got, &want), f32_bound(depth, &want));
    eprintln!(
        "minilm last_hidden_state: max|d| {d:.3e}, bound {bound:.3e}, max|h| {:.3}",
        max_abs(&want)
    );
    assert!(
        d <= bound,
        "last_hidden_state: max|d| {d:.3e} > bound {bound:.3e}"
    );

    let want = get(&fx, "pooler_output").to_vec_f64();
    let got = pooled.expect("MiniLM has a pooler").to_vec_f64();
    let (d, bound) = (max_abs_diff(&got, &want), f32_bound(depth + 1, &want));
    eprintln!("minilm pooler_output: max|d| {d:.3e}, bound {bound:.3e}");
    assert!(
        d <= bound,
        "pooler_output: max|d| {d:.3e} > bound {bound:.3e}"
    );

    let want = get(&fx, "sentence_embedding").to_vec_f64();
    let got = sentence_embedding(&h, &mask).unwrap();
    assert_eq!(got.shape(), &[32, 384]);
    let got = got.to_vec_f64();
    let min_cos = (0..32)
        .map(|i| cosine(&got[i * 384..(i + 1) * 384], &want[i * 384..(i + 1) * 384]))
        .fold(f64::INFINITY, f64::min);
    eprintln!("minilm sentence embeddings: min cosine {min_cos:.9}");
    assert!(min_cos >= 0.99999, "min cosine {min_cos}");
}

/// Logits of the tiny transformers models on the fixed padded batch.
fn tiny_logits_match(kind: &str) {
    let dir = Path::new(FIXTURES).join("tiny").join(kind);
    let batch = fixture("tiny/batch.safetensors");
    let (ids, mask, types) = text(&batch, 3);
    let inputs = Inputs::Text(TextInputs {
        input_ids: ids,
        attention_mask: mask,
        token_type_ids: types,
    });
    let mut rng = Generator::new(0);
    let got = match kind {
        "cls" => {
            let mut m =
                BertForSequenceClassification::from_pretrained(&dir, None, &mut rng).unwrap();
            m.set_training(false);
            m.forward_inputs(&inputs).unwrap()
        }
        _ => {
            let mut m = BertForMaskedLM::from_pretrained(&dir, &mut rng).unwrap();
            m.set_training(false);
            m.forward_inputs(&inputs).unwrap()
        }
    };
    let want_t = get(&batch, &format!("{kind}_logits"));
    assert_eq!(got.shape(), want_t.shape(), "{kind} logits shape");
    let want = want_t.to_vec_f64();
    let (d, bound) = (max_abs_diff(&got.to_vec_f64(), &want), f32_bound(3, &want));
    eprintln!("tiny {kind} logits: max|d| {d:.3e}, bound {bound:.3e}");
    assert!(
        d <= bound,
        "{kind} logits: max|d| {d:.3e} > bound {bound:.3e}"
    );
}

#[test]
fn tiny_classifier_logits_match_transformers() {
    tiny_logits_match("cls");
}

#[test]
fn tiny_masked_lm_logits_match_transformers() {
    tiny_logits_match("mlm");
}

/// (name, shape) pairs, sorted by name.
fn names_shapes<'a>(it: impl Iterator<Item = (String, &'a Tensor)>) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<_> = it.map(|(n, t)| (n, t.shape().to_vec())).collect();
    v.sort();
    v
}

#[test]
fn state_dict_names_are_transformers_names() {
    for kind in ["cls", "mlm"] {
        let dir = Path::new(FIXTURES).join("tiny").join(kind);
        let cfg = BertConfig::from_file(&dir.join("config.json")).unwrap();
        let mut rng = Generator::new(0);
        let ours = match kind {
            "cls" => names_shapes(
                BertForSequenceClassification::new(&cfg, &mut rng)
                    .unwrap()
                    .state_dict()
                    .iter()
                    .map(|(n, t)| (n.clone(), t)),
            ),
            _ => names_shapes(
                BertForMaskedLM::new(&cfg, &mut rng)
                    .unwrap()
                    .state_dict()
                    .iter()
                    .map(|(n, t)| (n.clone(), t)),
            ),
        };
        let file = fixture(&format!("tiny/{kind}/model.safetensors"));
        let theirs = names_shapes(
            file.iter()
                .filter(|(n, _)| !n.ends_with("position_ids"))
                .map(|(n, t)| (n.clone(), t)),
        );
        assert_eq!(ours, theirs, "{kind}: state_dict names and shapes");
    }
    // The base model: the pretrained file's names minus the position-id buffer.
    let dir = minilm_dir();
    let cfg = BertConfig::from_file(&dir.join("config.json")).unwrap();
    let m = BertModel::new(&cfg, true, &mut Generator::new(0)).unwrap();
    let ours = names_shapes(m.state_dict().iter().map(|(n, t)| (n.clone(), t)));
    let file = load_safetensors(&dir.join("model.safetensors")).unwrap().0;
    let theirs = names_shapes(
        file.iter()
            .filter(|(n, _)| n != "embeddings.position_ids")
            .map(|(n, t)| (n.clone(), t)),
    );
    assert_eq!(ours, theirs, "BertModel names vs all-MiniLM-L6-v2");
    // LayerNorm parameters, and only they, are flagged as norms (kept F32 by presets).
    for (name, _, _, is_norm) in m.tensors() {
        assert_eq!(is_norm, name.contains("LayerNorm"), "{name}: is_norm");
    }
}

#[test]
fn base_checkpoint_loads_into_head_models() {
    let dir = minilm_dir();
    let file = load_safetensors(&dir.join("model.safetensors")).unwrap().0;
    let mut rng = Generator::new(3);
    let cls = BertForSequenceClassification::from_pretrained(&dir, Some(2), &mut rng).unwrap();
    let sd = cls.state_dict();
    for (name, t) in &file {
        if name == "embeddings.position_ids" {
            continue;
        }
        let ours = get(&sd, &format!("bert.{name}"));
        assert_eq!(ours.to_vec_f32(), t.to_vec_f32(), "bert.{name} loaded");
    }
    // The classifier is fresh: N(0, 0.02) weights, zero bias.
    let w = get(&sd, "classifier.weight").to_vec_f64();
    assert_eq!(get(&sd, "classifier.weight").shape(), &[2, 384]);
    let std = (w.iter().map(|x| x * x).sum::<f64>() / w.len() as f64).sqrt();
    assert!((0.015..0.025).contains(&std), "classifier init std {std}");
    assert!(get(&sd, "classifier.bias")
        .to_vec_f64()
        .iter()
        .all(|&b| b == 0.0));

    // The masked LM takes the encoder and ignores the pooler; its decoder is the
    // (pretrained) word-embedding matrix.
    let mlm = BertForMaskedLM::from_pretrained(&dir, &mut rng).unwrap();
    // And a head model's checkpoint loads into a BertModel (its encoder; the head unused).
    let tiny = Path::new(FIXTURES).join("tiny/mlm");
    let base = BertModel::from_pretrained(&tiny, &mut rng).unwrap();
    assert!(
        base.pooler.is_none(),
        "the masked LM's checkpoint has no pooler"
    );
    let tiny_file = fixture("tiny/mlm/model.safetensors");
    for (name, t) in base.state_dict() {
        assert_eq!(
            t.to_vec_f32(),
            get(&tiny_file, &format!("bert.{name}")).to_vec_f32(),
            "{name}"
        );
    }
    let sd = mlm.state_dict();
    assert!(sd.iter().all(|(n, _)| !n.contains("pooler")));
    assert_eq!(
        get(&sd, "bert.embeddings.word_embeddings.weight").to_vec_f32(),
        get(&file, "embeddings.word_embeddings.weight").to_vec_f32()
    );
}

#[test]
fn save_pretrained_round_trips() {
    // With HEMI_BERT_EXPORT=DIR the saved models stay in DIR/cls and DIR/mlm, for
    // `bench/bert_fixtures.py --check-hemi DIR/cls --kind cls` (transformers loads them).
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var_os("HEMI_BERT_EXPORT")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let batch = fixture("tiny/batch.safetensors");
    let (ids, mask, types) = text(&batch, 3);
    for kind in ["cls", "mlm"] {
        let src = Path::new(FIXTURES).join("tiny").join(kind);
        let out = root.join(kind);
        let mut rng = Generator::new(0);
        let (a, b, file_names) = match kind {
            "cls" => {
                let mut m =
                    BertForSequenceClassification::from_pretrained(&src, None, &mut rng).unwrap();
                m.set_training(false);
                m.save_pretrained(&out).unwrap();
                let mut r =
                    BertForSequenceClassification::from_pretrained(&out, None, &mut rng).unwrap();
                r.set_training(false);
                assert_eq!(r.bert.config, m.bert.config, "config round trip");
                (
                    m.forward_text(&ids, &mask, &types).unwrap(),
                    r.forward_text(&ids, &mask, &types).unwrap(),
                    fixture(&format!("tiny/{kind}/model.safetensors")),
                )
            }
            _ => {
                let mut m = BertForMaskedLM::from_pretrained(&src, &mut rng).unwrap();
                m.set_training(false);
                m.save_pretrained(&out).unwrap();
                let mut r = BertForMaskedLM::from_pretrained(&out, &mut rng).unwrap();
                r.set_training(false);
                (
                    m.forward_text(&ids, &mask, &types).unwrap(),
                    r.forward_text(&ids, &mask, &types).unwrap(),
                    fixture(&format!("tiny/{kind}/model.safetensors")),
                )
            }
        };
        assert_eq!(
            a.to_vec_f32(),
            b.to_vec_f32(),
            "{kind}: logits after a round trip"
        );
        // hemi's file holds exactly the names transformers' own file holds (no tied decoder).
        let ours = load_safetensors(&out.join("model.safetensors")).unwrap().0;
        let mut ours: Vec<String> = ours.into_iter().map(|(n, _)| n).collect();
        let mut theirs: Vec<String> = file_names.into_iter().map(|(n, _)| n).collect();
        ours.sort();
        theirs.sort();
        assert_eq!(ours, theirs, "{kind}: saved names");
    }
}

#[test]
fn tied_decoder_in_a_file_is_accepted() {
    // Older writers keep `cls.predictions.decoder.{weight,bias}`; loading ignores them (the
    // decoder is the word-embedding matrix, as transformers re-ties it).
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(FIXTURES).join("tiny/mlm");
    let mut file = fixture("tiny/mlm/model.safetensors");
    let emb = get(&file, "bert.embeddings.word_embeddings.weight").clone();
    let bias = get(&file, "cls.predictions.bias").clone();
    file.push(("cls.predictions.decoder.weight".into(), emb));
    file.push(("cls.predictions.decoder.bias".into(), bias));
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    hemi::io::save_safetensors(&tmp.path().join("model.safetensors"), &file, None).unwrap();
    BertForMaskedLM::from_pretrained(tmp.path(), &mut Generator::new(0)).unwrap();
}

fn tiny_config() -> BertConfig {
    BertConfig {
        vocab_size: 23,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 24,
        max_position_embeddings: 12,
        ..BertConfig::default()
    }
    .with_num_labels(3)
}

#[test]
fn bad_config_names_the_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(Path::new(FIXTURES).join("tiny/cls/config.json")).unwrap();
    let cases = [
        ("\"hidden_size\": 32", "\"hidden_size\": 30", "hidden_size"),
        (
            "\"hidden_act\": \"gelu\"",
            "\"hidden_act\": \"swish\"",
            "hidden_act",
        ),
        (
            "\"vocab_size\": 101",
            "\"vocab_size\": \"many\"",
            "vocab_size",
        ),
        ("\"num_attention_heads\": 4,", "", "num_attention_heads"),
        (
            "\"layer_norm_eps\": 1e-12",
            "\"layer_norm_eps\": -1",
            "layer_norm_eps",
        ),
        (
            "\"hidden_dropout_prob\": 0.1",
            "\"hidden_dropout_prob\": 1.5",
            "hidden_dropout_prob",
        ),
        (
            "\"tie_word_embeddings\": true",
            "\"tie_word_embeddings\": false",
            "tie_word_embeddings",
        ),
    ];
    for (from, to, field) in cases {
        assert!(good.contains(from), "fixture config lacks {from}");
        let path = tmp.path().join("config.json");
        std::fs::write(&path, good.replace(from, to)).unwrap();
        let e = BertConfig::from_file(&path).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains("config.json"),
            "{field}: error does not name the field and file: {e}"
        );
    }
    let e = BertConfig::from_file(&tmp.path().join("absent.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.json"), "{e}");
    // A tiny config round-trips through its JSON.
    let c = tiny_config();
    let text = serde_json::to_string(&c.to_json("BertForSequenceClassification")).unwrap();
    assert_eq!(BertConfig::from_json_str("x", &text).unwrap(), c);
}

#[test]
fn missing_and_unexpected_weights_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(FIXTURES).join("tiny/cls");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let mut file = fixture("tiny/cls/model.safetensors");
    file.retain(|(n, _)| n != "bert.encoder.layer.1.attention.self.key.weight");
    let extra = get(&file, "classifier.bias").clone();
    file.push(("classifier.extra".into(), extra));
    hemi::io::save_safetensors(&tmp.path().join("model.safetensors"), &file, None).unwrap();
    let e =
        BertForSequenceClassification::from_pretrained(tmp.path(), None, &mut Generator::new(0))
            .err()
            .expect("a checkpoint with a missing weight must not load")
            .to_string();
    assert!(
        e.contains("bert.encoder.layer.1.attention.self.key.weight"),
        "{e}"
    );
    assert!(e.contains("classifier.extra"), "{e}");
    assert!(e.contains("model.safetensors"), "{e}");

    // A base checkpoint missing an encoder weight is refused; nothing is loaded.
    let mut m = BertForSequenceClassification::new(&tiny_config(), &mut Generator::new(0)).unwrap();
    let before = m.state_dict();
    let base: Vec<(String, Tensor)> = BertModel::new(&tiny_config(), true, &mut Generator::new(1))
        .unwrap()
        .state_dict()
        .into_iter()
        .filter(|(n, _)| n != "embeddings.LayerNorm.bias")
        .collect();
    let e = hemi::models::load_pretrained_state(&mut m, base, "base")
        .unwrap_err()
        .to_string();
    assert!(e.contains("bert.embeddings.LayerNorm.bias"), "{e}");
    for ((n, a), (_, b)) in before.iter().zip(m.state_dict()) {
        assert_eq!(
            a.to_vec_f32(),
            b.to_vec_f32(),
            "{n} changed by a failed load"
        );
    }

    // Wrong input shapes and dtypes are errors.
    let ids = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3]).unwrap();
    let short = Tensor::from_vec(vec![1i64, 1], &[1, 2]).unwrap();
    assert!(m.forward_text(&ids, &short, &short).is_err());
    let long = Tensor::zeros(&[1, 13], DType::I64).unwrap();
    let e = m.forward(&long).unwrap_err().to_string();
    assert!(e.contains("max_position_embeddings"), "{e}");
    let bad_id = Tensor::from_vec(vec![1i64, 99], &[1, 2]).unwrap();
    assert!(m.forward(&bad_id).is_err());
    assert!(m
        .forward(&Tensor::zeros(&[1, 3], DType::F32).unwrap())
        .is_err());
    assert!(load_pretrained(&mut m, &tmp.path().join("absent.safetensors")).is_err());
}

#[test]
fn autocast_stays_close_to_f32() {
    let dir = minilm_dir();
    let mut model = BertModel::from_pretrained(&dir, &mut Generator::new(0)).unwrap();
    model.set_training(false);
    let fx = fixture("minilm_sst2.safetensors");
    let (ids, mask, types) = text(&fx, 8);
    let _g = hemi::no_grad();
    let (h32, _) = model.forward_text(&ids, &mask, &types).unwrap();
    let want = h32.to_vec_f64();
    let emb32 = sentence_embedding(&h32, &mask).unwrap().to_vec_f64();
    for dt in [DType::BF16, DType::F16] {
        let (h, _) = {
            let _ac = autocast(dt);
            model.forward_text(&ids, &mask, &types).unwrap()
        };
        let got = h.to_vec_f64();
        assert!(
            got.iter().all(|x| x.is_finite()),
            "{dt:?}: non-finite hidden states"
        );
        // Under autocast every GEMM rounds its inputs into `dt` (relative error u(dt) per
        // operand) and LayerNorm/softmax/GELU run in F32; per layer the error is a few
        // u(dt) of the activations' scale, layers add it, hence √depth. The constant 4
        // (8 u) covers the two rounded operands, the output rounding and the softmax and
        // LayerNorm steps; a wrong mask or scale errs by O(max|h|).
        let eps = dt.finfo().unwrap().epsilon;
        let bound = 4.0 * eps * 6f64.sqrt() * max_abs(&want);
        let d = max_abs_diff(&got, &want);
        eprintln!("autocast {dt:?}: max|d| {d:.3e}, bound {bound:.3e}");
        assert!(d <= bound, "{dt:?}: max|d| {d:.3e} > bound {bound:.3e}");
        let emb = sentence_embedding(&h.to_dtype(DType::F32).unwrap(), &mask)
            .unwrap()
            .to_vec_f64();
        let min_cos = (0..8)
            .map(|i| cosine(&emb[i * 384..(i + 1) * 384], &emb32[i * 384..(i + 1) * 384]))
            .fold(f64::INFINITY, f64::min);
        eprintln!("autocast {dt:?}: min cosine of sentence embeddings {min_cos:.6}");
        // 1 - cos θ ≈ θ²/2 for the angle θ between them; a relative error of r rotates a
        // vector by at most r, and r of 2 eps allows 1 - cos up to 2 eps².
        assert!(min_cos >= 1.0 - 2.0 * eps * eps, "{dt:?}: cosine {min_cos}");
    }
}

#[test]
fn tiny_classifier_loss_falls_with_adamw() {
    let mut rng = Generator::new(7);
    let mut model = BertForSequenceClassification::new(&tiny_config(), &mut rng).unwrap();
    model.set_training(true);
    let ids = Tensor::randint(&[8, 10], 23, &mut rng).unwrap();
    let mut m = vec![1i64; 80];
    for v in &mut m[8 * 10 - 4..] {
        *v = 0;
    }
    let mask = Tensor::from_vec(m, &[8, 10]).unwrap();
    let types = Tensor::zeros(&[8, 10], DType::I64).unwrap();
    let labels = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], &[8]).unwrap();
    let mut opt = AdamW::new(
        model.parameters(),
        AdamWConfig {
            lr: 5e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let mut losses = Vec::new();
    for _ in 0..30 {
        opt.zero_grad();
        let logits = model.forward_text(&ids, &mask, &types).unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropyOptions::default()).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        losses.push(loss.to_scalar().unwrap());
    }
    eprintln!("losses: first {:.4}, last {:.4}", losses[0], losses[29]);
    assert!(losses.iter().all(|l| l.is_finite()));
    // Starts near ln 3 (small random init) and must fit 8 samples well below it.
    assert!(
        (losses[0] - 3f64.ln()).abs() < 0.2,
        "initial loss {}",
        losses[0]
    );
    assert!(
        losses[29] < 0.5 * losses[0],
        "loss {} -> {}",
        losses[0],
        losses[29]
    );
}

/// Central differences of `sum(logits · w)` in F64 against backward, for a few elements
/// of parameters on every path (embeddings, attention, feed-forward, LayerNorm, pooler,
/// the tied decoder).
#[test]
fn gradients_match_finite_differences_f64() {
    let cfg = BertConfig {
        vocab_size: 11,
        hidden_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 6,
        max_position_embeddings: 6,
        initializer_range: 0.5,
        ..BertConfig::default()
    };
    let mut rng = Generator::new(11);
    let ids = Tensor::from_vec(vec![1i64, 4, 7, 2, 1, 9, 3, 0], &[2, 4]).unwrap();
    let mask = Tensor::from_vec(vec![1i64, 1, 1, 1, 1, 1, 1, 0], &[2, 4]).unwrap();
    let types = Tensor::from_vec(vec![0i64, 0, 1, 1, 0, 0, 0, 0], &[2, 4]).unwrap();
    let mut model = BertForMaskedLM::new(&cfg, &mut rng).unwrap();
    model.set_training(false);
    model.to_dtype(DType::F64, false).unwrap();
    // Non-trivial LayerNorm and bias values, so their gradients are not special.
    for slot in model.tensors_mut() {
        let n = slot.tensor.numel();
        let v: Vec<f64> = slot
            .tensor
            .to_vec_f64()
            .iter()
            .map(|x| x + 0.3 * rng.uniform(-1.0, 1.0))
            .collect();
        slot.tensor
            .set_data(
                &Tensor::from_f64_vec(v, &[n], DType::F64)
                    .unwrap()
                    .reshape(slot.tensor.shape())
                    .unwrap(),
            )
            .unwrap();
    }
    let out_shape = [2, 4, 11];
    let w: Vec<f64> = (0..88).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let wt = Tensor::from_f64_vec(w.clone(), &out_shape, DType::F64).unwrap();
    let objective = |m: &BertForMaskedLM| -> f64 {
        let _g = hemi::no_grad();
        let o = m.forward_text(&ids, &mask, &types).unwrap().to_vec_f64();
        o.iter().zip(&w).map(|(a, b)| a * b).sum()
    };
    let logits = model.forward_text(&ids, &mask, &types).unwrap();
    assert_eq!(logits.dtype(), DType::F64);
    logits
        .mul(&wt)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let names = [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.self.key.bias",
        "bert.encoder.layer.0.attention.self.value.weight",
        "bert.encoder.layer.0.attention.output.LayerNorm.bias",
        "bert.encoder.layer.0.intermediate.dense.weight",
        "bert.encoder.layer.0.output.dense.bias",
        "cls.predictions.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.LayerNorm.weight",
    ];
    let params: Vec<(String, Tensor)> = model.named_parameters();
    for name in names {
        let p = &params.iter().find(|(n, _)| n == name).unwrap().1;
        let analytic = p
            .grad()
            .unwrap_or_else(|| panic!("{name}: no gradient"))
            .to_vec_f64();
        let base = p.detach().to_vec_f64();
        // A few elements spread over the tensor.
        let picks: Vec<usize> = (0..3)
            .map(|k| (k * 7 + 1) * base.len() / 23 % base.len())
            .collect();
        for i in picks {
            let h = 1e-6;
            let at = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                p.set_data(&Tensor::from_f64_vec(v, p.shape(), DType::F64).unwrap())
                    .unwrap();
                objective(&model)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            p.set_data(&Tensor::from_f64_vec(base.clone(), p.shape(), DType::F64).unwrap())
                .unwrap();
            let err = (analytic[i] - numeric).abs();
            assert!(
                err <= 1e-6 + 1e-5 * numeric.abs(),
                "{name}[{i}]: backward {} vs finite difference {numeric} (|err| {err:.2e})",
                analytic[i]
            );
        }
    }
}

#[test]
fn initialisation_follows_transformers() {
    let cfg = BertConfig {
        vocab_size: 300,
        hidden_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 4,
        intermediate_size: 128,
        pad_token_id: Some(5),
        ..BertConfig::default()
    };
    let m = BertForMaskedLM::new(&cfg, &mut Generator::new(4)).unwrap();
    for (name, t) in m.state_dict() {
        let v = t.to_vec_f64();
        if name.contains("LayerNorm.weight") {
            assert!(v.iter().all(|&x| x == 1.0), "{name}: ones");
        } else if name.ends_with("bias") {
            assert!(v.iter().all(|&x| x == 0.0), "{name}: zeros");
        } else {
            // N(0, 0.02): the sample std of n draws is within 5/√(2n) of it (5 sigma).
            let rows = if name.ends_with("word_embeddings.weight") {
                let row = &v[5 * 64..6 * 64];
                assert!(
                    row.iter().all(|&x| x == 0.0),
                    "{name}: padding row 5 is zero"
                );
                v[..5 * 64].iter().chain(&v[6 * 64..]).copied().collect()
            } else {
                v
            };
            let n = rows.len() as f64;
            let std = (rows.iter().map(|x| x * x).sum::<f64>() / n).sqrt();
            let mean = rows.iter().sum::<f64>() / n;
            assert!(
                (std - 0.02).abs() <= 0.02 * 5.0 / (2.0 * n).sqrt(),
                "{name}: std {std}"
            );
            assert!(mean.abs() <= 5.0 * 0.02 / n.sqrt(), "{name}: mean {mean}");
        }
    }
}

#[test]
fn dropout_follows_set_training() {
    let dir = Path::new(FIXTURES).join("tiny/cls");
    let mut m =
        BertForSequenceClassification::from_pretrained(&dir, None, &mut Generator::new(0)).unwrap();
    let batch = fixture("tiny/batch.safetensors");
    let (ids, mask, types) = text(&batch, 3);
    let _g = hemi::no_grad();
    let run = |m: &BertForSequenceClassification| {
        m.forward_text(&ids, &mask, &types).unwrap().to_vec_f32()
    };
    // A new model trains (dropout on): two passes draw different masks.
    assert_ne!(run(&m), run(&m), "training: dropout must change the logits");
    m.set_training(false);
    let a = run(&m);
    assert_eq!(a, run(&m), "eval: deterministic");
    let want = get(&batch, "cls_logits").to_vec_f64();
    let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
    let d = max_abs_diff(&a, &want);
    assert!(
        d <= f32_bound(3, &want),
        "eval logits vs transformers: max|d| {d:.3e}"
    );
}

/// A model cast to F16 (norms kept F32, apex O2; and all F16) on a padded batch, with one
/// sequence entirely masked: the additive mask stays finite in F16, so no NaN appears.
#[test]
fn f16_model_with_padding_stays_finite() {
    let dir = Path::new(FIXTURES).join("tiny/cls");
    let batch = fixture("tiny/batch.safetensors");
    let (ids, mask, types) = text(&batch, 3);
    let mut mv = mask.to_vec_i64();
    let want = get(&batch, "cls_logits").to_vec_f64();
    for keep_norms in [true, false] {
        let mut m =
            BertForSequenceClassification::from_pretrained(&dir, None, &mut Generator::new(0))
                .unwrap();
        m.set_training(false);
        m.to_dtype(DType::F16, keep_norms).unwrap();
        let _g = hemi::no_grad();
        let got = m.forward_text(&ids, &mask, &types).unwrap().to_vec_f64();
        // Every op rounds into F16 (u = eps/2 of its output); a dot product of K terms of
        // random sign has magnitude ~√K times smaller than Σ|terms|, so the roundings of its
        // inputs reach its output amplified by ~√K (K ≤ 37 here; the fixture's weights are
        // N(0, 0.5), so the network is far from linear); layers add errors, hence √depth.
        // 4 eps·√K·√depth of max|logit|; about a quarter of it is reached.
        let k = 37f64;
        let eps = DType::F16.finfo().unwrap().epsilon;
        let bound = 4.0 * eps * k.sqrt() * 2f64.sqrt() * max_abs(&want);
        let d = max_abs_diff(&got, &want);
        eprintln!("F16 (norms F32: {keep_norms}): max|d| {d:.3e}, bound {bound:.3e}");
        assert!(
            d <= bound,
            "F16 (norms F32: {keep_norms}): max|d| {d:.3e} > {bound:.3e}"
        );
        mv[18..27].fill(0);
        let none = Tensor::from_vec(mv.clone(), &[3, 9]).unwrap();
        let out = m.forward_text(&ids, &none, &types).unwrap().to_vec_f64();
        assert!(
            out.iter().all(|x| x.is_finite()),
            "fully masked row: {out:?}"
        );
    }
}
