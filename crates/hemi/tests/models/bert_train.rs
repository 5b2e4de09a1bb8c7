//! A tiny random BERT trains end to end through `train::train` (text loader, task, AMP,
//! optimizer, evaluation) in every precision preset: text classification on a synthetic
//! sentiment task a two-layer encoder learns in a few epochs, and masked-LM, whose held-out
//! loss must fall.
//!
//! The tokenizer is all-MiniLM-L6-v2's, read from `../shared` beside the checkout.

use std::path::PathBuf;
use std::sync::Arc;

use hemi::amp::Precision;
use hemi::data::{
    DataLoader, LoaderConfig, MlmConfig, TextClassificationDataset, TextColumns, TextConfig,
    TextCorpus, TextDataset, Tokenizer,
};
use hemi::models::registry;
use hemi::train::{evaluate_task, find_task, train, OptimizerKind, RunInfo, Schedule, TrainConfig};
use hemi::Generator;

fn tokenizer() -> Arc<Tokenizer> {
    let p = crate::common::minilm_dir().join("tokenizer.json");
    Arc::new(Tokenizer::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
}

/// A two-layer BERT with the MiniLM vocabulary, written as a transformers config.json.
fn tiny_config(dir: &std::path::Path) -> PathBuf {
    let cfg = serde_json::json!({
        "model_type": "bert", "architectures": ["BertForMaskedLM"],
        "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 64, "type_vocab_size": 2, "initializer_range": 0.02,
        "layer_norm_eps": 1e-12, "pad_token_id": 0
    });
    let p = dir.join("config.json");
    std::fs::write(&p, cfg.to_string()).unwrap();
    p
}

const POSITIVE: [&str; 5] = ["good", "great", "lovely", "superb", "fine"];
const NEGATIVE: [&str; 5] = ["bad", "awful", "poor", "dull", "terrible"];
const FILLER: [&str; 10] = [
    "the", "movie", "film", "was", "plot", "actors", "story", "really", "quite", "and",
];

/// Sentences of 4..8 filler words with one sentiment word somewhere: label 1 positive.
fn sentiment(n: usize, seed: u64) -> Vec<(String, usize)> {
    let mut g = Generator::new(seed);
    let mut pick = |k: usize| (g.next_u64() % k as u64) as usize;
    (0..n)
        .map(|_| {
            let len = 4 + pick(5);
            let mut words: Vec<&str> = (0..len).map(|_| FILLER[pick(FILLER.len())]).collect();
            let label = pick(2);
            let word = if label == 1 {
                POSITIVE[pick(5)]
            } else {
                NEGATIVE[pick(5)]
            };
            let at = pick(len + 1);
            words.insert(at, word);
            (words.join(" "), label)
        })
        .collect()
}

fn tsv(dir: &std::path::Path, name: &str, rows: &[(String, usize)]) -> PathBuf {
    let mut s = String::from("sentence\tlabel\n");
    for (t, l) in rows {
        s += &format!("{t}\t{l}\n");
    }
    let p = dir.join(name);
    std::fs::write(&p, s).unwrap();
    p
}

fn config(precision: Precision, task: &str, epochs: usize, lr: f64) -> TrainConfig {
    TrainConfig {
        epochs,
        optimizer: OptimizerKind::AdamW,
        lr,
        weight_decay: Some(0.01),
        no_decay_norm_bias: true,
        schedule: Schedule::Constant,
        log_every: 1000,
        precision,
        task: find_task(task).unwrap(),
        ..Default::default()
    }
}

fn info(model: &str, classes: usize, precision: Precision) -> RunInfo {
    RunInfo {
        model: model.into(),
        dataset: "text".into(),
        input_shape: [1, 1, 32],
        classes,
        precision: precision.name().into(),
        ..Default::default()
    }
}

fn loader(
    ds: Arc<dyn TextDataset>,
    tok: &Arc<Tokenizer>,
    shuffle: bool,
    mlm: Option<MlmConfig>,
) -> DataLoader {
    DataLoader::text(
        ds,
        tok.clone(),
        LoaderConfig {
            batch_size: 16,
            shuffle,
            seed: 3,
            workers: 1,
            ..Default::default()
        },
        TextConfig {
            max_length: 32,
            bucket: shuffle,
            mlm,
        },
    )
    .unwrap()
}

#[test]
fn tiny_bert_classifier_learns_in_every_precision_preset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = tiny_config(dir.path());
    let tok = tokenizer();
    let cols = || TextColumns::named("sentence", "label");
    let train_ds =
        TextClassificationDataset::open(tsv(dir.path(), "train.tsv", &sentiment(384, 1)), cols())
            .unwrap();
    let test_ds =
        TextClassificationDataset::open(tsv(dir.path(), "dev.tsv", &sentiment(96, 2)), cols())
            .unwrap();
    let train_l = loader(Arc::new(train_ds), &tok, true, None);
    let test_l = loader(Arc::new(test_ds), &tok, false, None);
    let spec = registry::find("bert-classifier").unwrap();
    for p in Precision::ALL {
        let mut model = spec.build_text(&cfg_path, 2, 7).unwrap();
        let cfg = config(p, "classification", 4, 3e-3);
        let before =
            evaluate_task(model.as_mut(), &test_l, Precision::Fp32, cfg.task.as_ref()).unwrap();
        let mut losses = Vec::new();
        let s = train(
            model.as_mut(),
            &train_l,
            &test_l,
            &cfg,
            &info("bert-classifier", 2, p),
            &mut |e| {
                if let hemi::train::Event::Epoch { train_loss, .. } = e {
                    losses.push(*train_loss);
                }
            },
        )
        .unwrap_or_else(|e| panic!("{p}: {e}"));
        eprintln!(
            "{p}: train losses {losses:?}, test accuracy {:.3} (before {:.3}), skipped {}",
            s.test_accuracy, before.accuracy, s.skipped_steps
        );
        assert!(losses.iter().all(|l| l.is_finite()), "{p}: {losses:?}");
        assert!(
            losses[losses.len() - 1] < 0.5 * losses[0].min(std::f64::consts::LN_2),
            "{p}: the training loss did not fall: {losses:?}"
        );
        assert!(
            s.test_accuracy >= 0.9,
            "{p}: test accuracy {} after training",
            s.test_accuracy
        );
        assert!(
            s.skipped_fraction() < 0.2,
            "{p}: {} skipped",
            s.skipped_steps
        );
        assert!(model.num_parameters() > 0);
    }
}

#[test]
fn tiny_bert_mlm_lowers_held_out_loss_in_every_precision_preset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = tiny_config(dir.path());
    let tok = tokenizer();
    let lines =
        |n, seed| -> Vec<String> { sentiment(n, seed).into_iter().map(|(t, _)| t).collect() };
    let train_ds: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(lines(256, 4)));
    let test_ds: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(lines(64, 5)));
    let mlm = Some(MlmConfig::default());
    let train_l = loader(train_ds, &tok, true, mlm);
    let test_l = loader(test_ds, &tok, false, mlm);
    let spec = registry::find("bert-mlm").unwrap();
    for p in Precision::ALL {
        let mut model = spec.build_text(&cfg_path, tok.vocab_size(), 7).unwrap();
        let cfg = config(p, "masked-lm", 2, 3e-3);
        let before =
            evaluate_task(model.as_mut(), &test_l, Precision::Fp32, cfg.task.as_ref()).unwrap();
        train(
            model.as_mut(),
            &train_l,
            &test_l,
            &cfg,
            &info("bert-mlm", tok.vocab_size(), p),
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{p}: {e}"));
        let after = evaluate_task(model.as_mut(), &test_l, p, cfg.task.as_ref()).unwrap();
        eprintln!(
            "{p}: held-out MLM loss {:.6} -> {:.6} (perplexity {:.0} -> {:.2})",
            before.loss,
            after.loss,
            before.perplexity(),
            after.perplexity()
        );
        // A fresh model's loss is about ln(30522) = 10.3; 15 filler and sentiment words
        // make most targets easy, so training must cut it by far more than noise (two
        // epochs bring every preset to about 4.67, 0.45 of the start; three to 2.99).
        assert!(before.loss > 9.0, "{p}: {}", before.loss);
        assert!(
            after.loss.is_finite() && after.loss < 0.6 * before.loss,
            "{p}: held-out loss {} -> {}",
            before.loss,
            after.loss
        );
    }
}
