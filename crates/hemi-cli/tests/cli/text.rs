//! The CLI on text: a tiny BERT trains on a TSV directory and its checkpoint evaluates to
//! the same accuracy, `--save-pretrained` writes transformers' layout, masked-LM reports a
//! falling held-out perplexity, `hemi embed` matches sentence-transformers' embeddings, and
//! bad text input is an error that names it.
//!
//! The tokenizer and the pretrained model come from `../shared` beside the checkout or
//! hemi's cache (`common::minilm_dir`); the sentences embedded are the fixture's.

use crate::common;
use common::{hemi, ok};
use std::path::Path;
use std::process::Output;

fn err(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn minilm() -> String {
    common::minilm_dir()
        .canonicalize()
        .unwrap()
        .display()
        .to_string()
}

/// A two-layer BERT over the MiniLM vocabulary.
fn tiny_config(dir: &Path) -> String {
    tiny_config_with_dropout(dir, 0.1)
}

/// [`tiny_config`] with dropout probability `p` everywhere.
fn tiny_config_with_dropout(dir: &Path, p: f64) -> String {
    let cfg = serde_json::json!({
        "model_type": "bert", "vocab_size": 30522, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "hidden_act": "gelu", "hidden_dropout_prob": p,
        "attention_probs_dropout_prob": p, "max_position_embeddings": 64,
        "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
        "pad_token_id": 0
    });
    let p = dir.join(format!("tiny-{p}.json"));
    std::fs::write(&p, cfg.to_string()).unwrap();
    p.display().to_string()
}

/// `train.tsv` / `dev.tsv`: a sentiment word among filler words decides the label.
fn sentiment_dir(dir: &Path) -> String {
    let pos = ["good", "great", "lovely", "superb"];
    let neg = ["bad", "awful", "poor", "dull"];
    let filler = ["the", "movie", "was", "plot", "really", "and", "story"];
    let d = dir.join("sent");
    std::fs::create_dir_all(&d).unwrap();
    for (name, n, off) in [("train.tsv", 256usize, 0usize), ("dev.tsv", 64, 7)] {
        let mut s = String::from("sentence\tlabel\n");
        for i in 0..n {
            let k = i * 7 + off;
            let label = (k / 3) % 2;
            let word = if label == 1 { pos[k % 4] } else { neg[k % 4] };
            let mut words: Vec<&str> = (0..4 + k % 3).map(|j| filler[(k + j) % 7]).collect();
            words.insert(k % words.len(), word);
            s += &format!("{}\t{label}\n", words.join(" "));
        }
        std::fs::write(d.join(name), s).unwrap();
    }
    d.display().to_string()
}

#[test]
fn a_tiny_bert_trains_on_tsv_saves_for_transformers_and_its_checkpoint_evaluates() {
    let t = tempfile::tempdir().unwrap();
    let cfg = tiny_config(t.path());
    let data = sentiment_dir(t.path());
    let tok = minilm();
    let out = ok(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "bert-classifier",
            "--config",
            &cfg,
            "--tokenizer",
            &tok,
            "--dataset",
            "text",
            "--data-dir",
            &data,
            // A 0.02-initialised BERT sits on a plateau for about 2.5 epochs of this set
            // (loss 0.69), then learns it in one: 6 epochs leave the linear decay room.
            "--epochs",
            "6",
            "--lr",
            "0.003",
            "--batch-size",
            "16",
            "--precision",
            "amp-bf16",
            "--threads",
            "1",
            "--checkpoint-dir",
            "ck",
            "--metrics",
            "m.jsonl",
            "--save-pretrained",
            "hf",
        ],
    ));
    assert!(
        out.contains("recipe bert-finetune: adamw") && out.contains("max length 64"),
        "{out}"
    );
    let metrics = std::fs::read_to_string(t.path().join("m.jsonl")).unwrap();
    let last: serde_json::Value = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|v| v["kind"] == "epoch")
        .unwrap();
    let acc = 100.0 * last["test_accuracy"].as_f64().unwrap();
    assert!(acc >= 90.0, "the tiny BERT did not learn: {acc} %\n{out}");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(t.path().join("hf").join(f).is_file(), "hf/{f} missing");
    }
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("hf/config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["architectures"][0], "BertForSequenceClassification");
    assert_eq!(saved["hidden_size"], 32);
    let ev = ok(&hemi(t.path(), &["eval", "--checkpoint", "ck"]));
    assert!(
        ev.contains(&format!("64 test texts: {acc:.2} %")),
        "{acc}\n{ev}"
    );
    // The saved directory is a pretrained model in its own right.
    let again = ok(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "bert-classifier",
            "--pretrained",
            "hf",
            "--dataset",
            "text",
            "--data-dir",
            &data,
            "--epochs",
            "1",
            "--lr",
            "0",
            "--batch-size",
            "16",
            "--precision",
            "fp32",
            "--threads",
            "1",
        ],
    ));
    assert!(
        again.contains("weights: ") && again.contains("hf/model.safetensors"),
        "{again}"
    );
    let acc2 = again
        .lines()
        .find_map(|l| l.strip_prefix("Accuracy of the network on the 64 test texts: "))
        .unwrap();
    assert!(
        acc2.trim_end_matches(" %").parse::<f64>().unwrap() >= 85.0,
        "reloaded weights lost what was learnt: {again}"
    );
}

/// `--no-shuffle` feeds the training texts in file order: from a saved classifier without
/// dropout, the seed then changes nothing (it only draws the order), while shuffled runs of
/// two seeds see different batches. This is what lets a run be compared step by step with
/// `bench/torch_bert_sst2.py --no-shuffle` from the same checkpoint.
#[test]
fn no_shuffle_trains_in_file_order_whatever_the_seed() {
    let t = tempfile::tempdir().unwrap();
    let cfg = tiny_config_with_dropout(t.path(), 0.0);
    let data = sentiment_dir(t.path());
    let tok = minilm();
    // A classifier checkpoint (head included): one epoch at lr 0 changes no weight.
    let common = [
        "train",
        "--model",
        "bert-classifier",
        "--dataset",
        "text",
        "--data-dir",
        &data,
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--precision",
        "fp32",
        "--threads",
        "1",
        "--log-every",
        "1",
    ];
    let mut init = common.to_vec();
    init.extend(["--config", &cfg, "--tokenizer", &tok, "--lr", "0"]);
    init.extend(["--save-pretrained", "init"]);
    ok(&hemi(t.path(), &init));
    let losses = |seed: &str, shuffle: bool| -> Vec<f64> {
        let metrics = format!("m-{seed}-{shuffle}.jsonl");
        let mut args = common.to_vec();
        args.extend(["--pretrained", "init", "--lr", "0.003", "--seed", seed]);
        args.extend(["--metrics", &metrics]);
        if !shuffle {
            args.push("--no-shuffle");
        }
        ok(&hemi(t.path(), &args));
        std::fs::read_to_string(t.path().join(&metrics))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["kind"] == "step")
            .map(|v| v["loss"].as_f64().unwrap())
            .collect()
    };
    let (a, b) = (losses("1", false), losses("2", false));
    assert_eq!(a.len(), 8, "256 texts in batches of 32: {a:?}");
    assert_eq!(a, b, "in file order the seed must not matter");
    let (c, d) = (losses("1", true), losses("2", true));
    assert_ne!(c, d, "shuffled runs of two seeds saw the same batches");
    assert_ne!(a, c, "the shuffled run saw the batches in file order");
}

#[test]
fn masked_lm_on_a_text_file_reports_a_falling_held_out_perplexity() {
    let t = tempfile::tempdir().unwrap();
    let cfg = tiny_config(t.path());
    let words = ["the", "film", "is", "a", "good", "story", "about", "people"];
    let text: String = (0..400)
        .map(|i| {
            let n = 5 + i % 4;
            (0..n)
                .map(|j| words[(i + j) % words.len()])
                .collect::<Vec<_>>()
                .join(" ")
                + "\n"
        })
        .collect();
    std::fs::write(t.path().join("corpus.txt"), text).unwrap();
    let tok = minilm();
    let out = ok(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "bert-mlm",
            "--config",
            &cfg,
            "--tokenizer",
            &tok,
            "--data-dir",
            "corpus.txt",
            "--epochs",
            "2",
            "--lr",
            "0.003",
            "--batch-size",
            "16",
            "--precision",
            "amp-fp16",
            "--threads",
            "1",
        ],
    ));
    let ppl = |prefix: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| {
                panic!("no line starting {prefix:?} in:\n{out}");
            });
        let at = line.find("perplexity ").unwrap() + "perplexity ".len();
        line[at..].split(',').next().unwrap().parse().unwrap()
    };
    let (before, after) = (ppl("before training"), ppl("Held-out masked-LM loss"));
    assert!(
        before > 1000.0 && after < before / 20.0,
        "{before} -> {after}\n{out}"
    );
    assert!(out.contains("the last 20 held out"), "{out}");
}

#[test]
fn embed_matches_sentence_transformers() {
    let t = tempfile::tempdir().unwrap();
    // The first sentences of SST-2's dev set, as the fixture recorded them.
    let fx = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hemi/tests/fixtures/bert/minilm_sst2.safetensors");
    let (tensors, meta) = hemi::io::load_safetensors(&fx).unwrap();
    let all: Vec<String> = serde_json::from_str(&meta["sentences"]).unwrap();
    let sentences: Vec<&str> = all.iter().take(6).map(String::as_str).collect();
    std::fs::write(t.path().join("s.txt"), sentences.join("\n")).unwrap();
    let out = ok(&hemi(
        t.path(),
        &["embed", "--model", &minilm(), "s.txt", "--max-length", "64"],
    ));
    let want = tensors
        .into_iter()
        .find(|(n, _)| n == "sentence_embedding")
        .unwrap()
        .1
        .to_vec_f64();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), sentences.len());
    for (i, (line, s)) in lines.iter().zip(&sentences).enumerate() {
        assert_eq!(line["text"], *s);
        let got: Vec<f64> = line["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), 384);
        let w = &want[i * 384..(i + 1) * 384];
        let dot: f64 = got.iter().zip(w).map(|(a, b)| a * b).sum();
        let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let cos = dot / (n(&got) * n(w));
        assert!(cos >= 0.99999, "sentence {i}: cosine {cos}");
    }
}

#[test]
fn bad_text_input_is_an_error_that_names_it() {
    let t = tempfile::tempdir().unwrap();
    let cfg = tiny_config(t.path());
    let data = sentiment_dir(t.path());
    let tok = minilm();
    // No config, no weights.
    let e = err(&hemi(
        t.path(),
        &["train", "--model", "bert-classifier", "--data-dir", &data],
    ));
    assert!(e.contains("--pretrained") && e.contains("--config"), "{e}");
    // A text flag on an image model.
    let e = err(&hemi(
        t.path(),
        &["train", "--model", "mlp", "--dataset", "text"],
    ));
    assert!(e.contains("--dataset text") && e.contains("mlp"), "{e}");
    let base = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            "bert-classifier",
            "--config",
            &cfg,
            "--tokenizer",
            &tok,
            "--threads",
            "1",
        ];
        a.extend_from_slice(extra);
        hemi(t.path(), &a)
    };
    // A missing column names the column and the file.
    let e = err(&base(&["--data-dir", &data, "--text-column", "review"]));
    assert!(e.contains("review") && e.contains("train.tsv"), "{e}");
    // No held-out file.
    std::fs::create_dir_all(t.path().join("only-train")).unwrap();
    std::fs::copy(
        Path::new(&data).join("train.tsv"),
        t.path().join("only-train/train.tsv"),
    )
    .unwrap();
    let e = err(&base(&["--data-dir", "only-train"]));
    assert!(e.contains("dev.tsv") && e.contains("only-train"), "{e}");
    // A label that is neither a number nor a class name throughout.
    std::fs::create_dir_all(t.path().join("mixed")).unwrap();
    std::fs::write(
        t.path().join("mixed/train.tsv"),
        "sentence\tlabel\na b\t1\nc d\tpos\n",
    )
    .unwrap();
    std::fs::write(t.path().join("mixed/dev.tsv"), "sentence\tlabel\na b\t1\n").unwrap();
    let e = err(&base(&["--data-dir", "mixed"]));
    assert!(e.contains("train.tsv") && e.contains("pos"), "{e}");
    // A config whose vocabulary is smaller than the tokenizer's.
    let small = t.path().join("small.json");
    std::fs::write(
        &small,
        std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("30522", "1000"),
    )
    .unwrap();
    let e = err(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "bert-classifier",
            "--config",
            small.to_str().unwrap(),
            "--tokenizer",
            &tok,
            "--data-dir",
            &data,
        ],
    ));
    assert!(e.contains("vocab_size 1000") && e.contains("30522"), "{e}");
    // Weights that do not fit the config: the error lists the mismatched names.
    let e = err(&hemi(
        t.path(),
        &[
            "train",
            "--model",
            "bert-classifier",
            "--pretrained",
            &minilm(),
            "--config",
            &cfg,
            "--data-dir",
            &data,
        ],
    ));
    assert!(e.contains("word_embeddings"), "{e}");
    // A single file is only a masked-LM corpus.
    let e = err(&base(&["--data-dir", &format!("{data}/train.tsv")]));
    assert!(e.contains("dev.tsv"), "{e}");
}

#[test]
fn bench_train_reports_sentences_per_second_for_a_text_model() {
    let t = tempfile::tempdir().unwrap();
    let cfg = tiny_config(t.path());
    let out = ok(&hemi(
        t.path(),
        &[
            "bench",
            "train",
            "--model",
            "bert-classifier",
            "--config",
            &cfg,
            "--precision",
            "amp-bf16",
            "--batch-size",
            "4",
            "--max-length",
            "16",
            "--steps",
            "2",
            "--json",
            "--threads",
            "1",
        ],
    ));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["sentences_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["peak_rss_mib"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["max_length"], 16);
    assert!(v["loss"].as_f64().unwrap().is_finite(), "{v}");
    let e = err(&hemi(
        t.path(),
        &[
            "bench",
            "train",
            "--model",
            "bert-classifier",
            "--max-length",
            "100",
            "--config",
            &cfg,
        ],
    ));
    assert!(e.contains("max_position_embeddings 64"), "{e}");
}
