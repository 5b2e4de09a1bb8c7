//! The text pipeline: the tokenizer against `transformers` (fixtures written by
//! `bench/tokenizer_fixtures.py`), CSV/TSV and line-corpus readers with their error
//! messages, and text batches from the DataLoader (dynamic padding, masked-LM statistics,
//! bucketing, worker-count independence).
//!
//! The tokenizer and SST-2 come from `../shared` beside the checkout (all-MiniLM-L6-v2's
//! tokenizer.json, GLUE SST-2's TSVs).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hemi::data::*;
use hemi::Error;

// ----- helpers ---------------------------------------------------------------------------

/// A file of `../shared` beside the checkout (GLUE SST-2), for the tests run with
/// `--ignored` where it is there (CI's `.ci/run` runs them: `shared_data_` tests).
fn shared(rel: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel);
    assert!(
        p.exists(),
        "{} is missing: the shared_data_ tests need GLUE SST-2 in ../shared/data/sst2 beside \
         this repository",
        p.display()
    );
    p
}

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let p = crate::common::minilm_dir().join("tokenizer.json");
        Arc::new(
            Tokenizer::from_file(&p)
                .unwrap_or_else(|e| panic!("cannot load the test tokenizer {}: {e}", p.display())),
        )
    })
    .clone()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::File::create(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

/// The message of an `Error::Data`, checking that it names `path`.
fn data_error_naming(err: Error, path: &Path) -> String {
    match err {
        Error::Data { path: p, msg } => {
            assert_eq!(Path::new(&p), path, "error names the wrong file: {msg}");
            msg
        }
        other => panic!(
            "expected Error::Data naming {}, got {other:?}",
            path.display()
        ),
    }
}

fn loader_config(batch: usize, workers: usize, seed: u64) -> LoaderConfig {
    LoaderConfig {
        batch_size: batch,
        shuffle: true,
        drop_last: false,
        seed,
        workers,
        prefetch: 2,
        transform: Transform::new(),
    }
}

/// One batch as plain vectors: ids, mask, types, labels, label shape, indices, seq len.
type Flat = (
    Vec<i64>,
    Vec<i64>,
    Vec<i64>,
    Vec<i64>,
    Vec<usize>,
    Vec<usize>,
    usize,
);

fn flatten(b: &Batch) -> Flat {
    let t = b.inputs.text().unwrap();
    let shape = t.input_ids.shape().to_vec();
    assert_eq!(shape.len(), 2);
    for x in [&t.input_ids, &t.attention_mask, &t.token_type_ids] {
        assert_eq!(x.dtype(), hemi::DType::I64);
        assert_eq!(x.shape(), &shape[..]);
    }
    assert_eq!(b.labels.dtype(), hemi::DType::I64);
    (
        t.input_ids.to_vec_i64(),
        t.attention_mask.to_vec_i64(),
        t.token_type_ids.to_vec_i64(),
        b.labels.to_vec_i64(),
        b.labels.shape().to_vec(),
        b.indices.clone(),
        shape[1],
    )
}

fn collect(loader: &DataLoader, epoch: u64) -> Vec<Flat> {
    loader.epoch(epoch).map(|b| flatten(&b.unwrap())).collect()
}

/// Sentences of varied length from a fixed word list (a deterministic LCG picks them).
fn sentences(n: usize, min_words: usize, max_words: usize) -> Vec<String> {
    const WORDS: [&str; 16] = [
        "the",
        "film",
        "is",
        "a",
        "charming",
        "and",
        "often",
        "affecting",
        "journey",
        "bleak",
        "desperate",
        "story",
        "of",
        "unbelievably",
        "good",
        "acting",
    ];
    let mut s = 12345u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as usize
    };
    (0..n)
        .map(|_| {
            let len = min_words + next() % (max_words - min_words + 1);
            (0..len)
                .map(|_| WORDS[next() % WORDS.len()])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

// ----- tokenizer -------------------------------------------------------------------------

#[test]
fn tokenizer_matches_transformers() {
    let tok = tokenizer();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/tokens.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 50, "{} cases", cases.len());
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (mut pairs, mut truncated) = (0, 0);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let max_length = case["max_length"].as_u64().unwrap() as usize;
        let enc = match case.get("pair").and_then(|p| p.as_str()) {
            Some(pair) => {
                pairs += 1;
                tok.encode_pair(text, pair, max_length).unwrap()
            }
            None => tok.encode(text, max_length).unwrap(),
        };
        let want_ids = ids(&case["input_ids"]);
        assert_eq!(
            enc.ids, want_ids,
            "input_ids of {text:?} (max_length {max_length})"
        );
        assert_eq!(
            enc.type_ids,
            ids(&case["token_type_ids"]),
            "token_type_ids of {text:?}"
        );
        assert_eq!(
            ids(&case["attention_mask"]),
            vec![1; enc.len()],
            "transformers' mask of an unpadded {text:?}"
        );
        let special: Vec<u32> = enc.special.iter().map(|&s| s as u32).collect();
        assert_eq!(
            special,
            ids(&case["special_tokens_mask"]),
            "special tokens of {text:?}"
        );
        assert!(enc.len() <= max_length);
        truncated += (enc.len() == max_length) as usize;
    }
    assert!(pairs >= 2, "the fixture has {pairs} sentence pairs");
    assert!(
        truncated >= 3,
        "only {truncated} cases reach max_length: truncation untested"
    );
}

#[test]
fn tokenizer_ids_and_errors() {
    let tok = tokenizer();
    assert_eq!(tok.pad_id(), 0);
    assert_eq!(tok.cls_id().unwrap(), 101);
    assert_eq!(tok.sep_id().unwrap(), 102);
    assert_eq!(tok.mask_id().unwrap(), 103);
    assert_eq!(tok.vocab_size(), 30522);
    assert_eq!(tok.token_to_id("the"), Some(1996));
    assert_eq!(tok.id_to_token(2009).as_deref(), Some("it"));
    assert!(tok.is_special(100) && !tok.is_special(1996));
    // from_dir reads dir/tokenizer.json, the same tokenizer.
    let dir = Tokenizer::from_dir(crate::common::minilm_dir()).unwrap();
    assert_eq!(
        dir.encode("a charming journey", 16).unwrap(),
        tok.encode("a charming journey", 16).unwrap()
    );
    // tokenizer.json pads to 128; hemi leaves padding to the loader.
    assert_eq!(tok.encode("hello", 128).unwrap().ids, vec![101, 7592, 102]);
    // max_length may equal the special tokens (as in transformers), not be below them.
    assert_eq!(tok.encode("hello world", 2).unwrap().ids, vec![101, 102]);
    let e = tok.encode("hello", 1).unwrap_err().to_string();
    assert!(
        e.contains("max_length 1") && e.contains("2 special tokens"),
        "{e}"
    );
    let e = tok.encode_pair("a", "b", 2).unwrap_err().to_string();
    assert!(
        e.contains("max_length 2") && e.contains("3 special tokens"),
        "{e}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("tokenizer.json");
    let msg = data_error_naming(Tokenizer::from_dir(tmp.path()).unwrap_err(), &missing);
    assert!(msg.contains("file not found"), "{msg}");
    write(&missing, b"{\"version\": \"1.0\", \"model\": 3}");
    let msg = data_error_naming(Tokenizer::from_file(&missing).unwrap_err(), &missing);
    assert!(
        msg.contains("not a readable Hugging Face tokenizer.json"),
        "{msg}"
    );
}

// ----- data sets -------------------------------------------------------------------------

#[test]
#[ignore = "needs GLUE SST-2 in ../shared/data/sst2 (CI runs it: .ci/run)"]
fn shared_data_sst2_loads_every_row_and_tokenises() {
    let cols = || TextColumns::named("sentence", "label");
    let t0 = Instant::now();
    let train = TextClassificationDataset::open(shared("data/sst2/train.tsv"), cols()).unwrap();
    let read = t0.elapsed();
    let dev = TextClassificationDataset::open(shared("data/sst2/dev.tsv"), cols()).unwrap();
    assert_eq!(train.len(), 67_349);
    assert_eq!(dev.len(), 872);
    assert_eq!(train.class_names(), &["0", "1"]);
    assert_eq!(dev.class_names(), &["0", "1"]);
    assert_eq!(train.class_counts(), vec![29_780, 37_569]);
    let first = dev.get(0).unwrap();
    assert_eq!(
        first.text,
        "it 's a charming and often affecting journey . "
    );
    assert_eq!(first.label, Some(1));

    let t1 = Instant::now();
    let loader = DataLoader::text(
        Arc::new(train),
        tokenizer(),
        loader_config(32, 0, 0),
        TextConfig::default(),
    )
    .unwrap();
    let tokenise = t1.elapsed();
    eprintln!(
        "SST-2 train: read {:.3} s, tokenised {:.3} s ({} sentences)",
        read.as_secs_f64(),
        tokenise.as_secs_f64(),
        loader.len()
    );
    assert_eq!(loader.len(), 67_349);
    assert_eq!(loader.num_batches(), 67_349usize.div_ceil(32));
    assert_eq!(loader.num_classes(), 2);
    assert!(loader.is_text() && !loader.is_mlm());
    assert!(loader.dataset().is_none() && loader.sample_shape().is_none());
    let longest = loader
        .encodings()
        .unwrap()
        .iter()
        .map(|e| e.len())
        .max()
        .unwrap();
    assert!(
        (40..=128).contains(&longest),
        "longest SST-2 sentence {longest} tokens"
    );
}

#[test]
fn csv_quoting_pairs_and_string_labels() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("pairs.csv");
    write(
        &path,
        b"id,premise,hypothesis,label\n\
          1,\"A man, a plan\",\"He said \"\"hi\"\"\",neutral\n\
          2,\"two\nlines\",b,entailment\n\
          \n\
          3,c,d,contradiction\n\
          4,e,f,entailment\n",
    );
    let cols = TextColumns {
        text: Column::Name("premise".into()),
        text_pair: Some(Column::Name("hypothesis".into())),
        label: Column::Name("label".into()),
        header: true,
        delimiter: None,
        num_classes: None,
    };
    let ds = TextClassificationDataset::open(&path, cols).unwrap();
    assert_eq!(ds.len(), 4);
    assert_eq!(
        ds.class_names(),
        &["contradiction", "entailment", "neutral"]
    );
    let s = ds.get(0).unwrap();
    assert_eq!(
        (s.text, s.text_pair, s.label),
        ("A man, a plan", Some("He said \"hi\""), Some(2))
    );
    assert_eq!(ds.get(1).unwrap().text, "two\nlines");
    assert_eq!(ds.labels(), &[2, 1, 0, 1]);
    assert!(matches!(
        ds.get(4),
        Err(Error::Index {
            index: 4,
            size: 4,
            ..
        })
    ));

    // In a TSV a quote is text, not quoting: an unbalanced one does not swallow lines.
    let path = tmp.path().join("quotes.tsv");
    write(
        &path,
        b"sentence\tlabel\n\" the greatest \"musicians\tpos\nhe said \"no\tneg\nfine\tpos\n",
    );
    let ds =
        TextClassificationDataset::open(&path, TextColumns::named("sentence", "label")).unwrap();
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.get(0).unwrap().text, "\" the greatest \"musicians");
    assert_eq!(ds.get(1).unwrap().text, "he said \"no");
    assert_eq!(ds.labels(), &[1, 0, 1]);

    // No header, columns by index, a delimiter set explicitly on an unknown extension, and
    // a declared class count (labels 0 and 3 of 4 classes).
    let path = tmp.path().join("plain.txt");
    write(&path, b"3;first\n0;second\n");
    let cols = TextColumns {
        text: Column::Index(1),
        text_pair: None,
        label: Column::Index(0),
        header: false,
        delimiter: Some(b';'),
        num_classes: Some(4),
    };
    let ds = TextClassificationDataset::open(&path, cols).unwrap();
    assert_eq!(ds.class_names(), &["0", "1", "2", "3"]);
    assert_eq!(ds.labels(), &[3, 0]);
    assert_eq!(ds.get(1).unwrap().text, "second");
}

#[test]
fn csv_tsv_errors_name_file_line_and_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let sst = || TextColumns::named("sentence", "label");
    let case = |name: &str, body: &[u8], cols: TextColumns| -> String {
        let path = tmp.path().join(name);
        write(&path, body);
        data_error_naming(
            TextClassificationDataset::open(&path, cols).unwrap_err(),
            &path,
        )
    };
    let m = case("a.tsv", b"sentence\tlabel\ngood\t1\nbad\t0\textra\n", sst());
    assert!(
        m.contains("line 3") && m.contains("3 fields, expected 2"),
        "{m}"
    );
    let m = case("b.tsv", b"sentance\tlabel\ngood\t1\n", sst());
    assert!(
        m.contains("line 1")
            && m.contains("no column named \"sentence\"")
            && m.contains("sentance"),
        "{m}"
    );
    let m = case("c.tsv", b"sentence\tlabel\ngood\t1\nbad\tpositive\n", sst());
    assert!(
        m.contains("line 3") && m.contains("bad label \"positive\""),
        "{m}"
    );
    let m = case("d.tsv", b"sentence\tlabel\ngood\t1\nbad\t-1\n", sst());
    assert!(
        m.contains("line 3") && m.contains("bad label \"-1\""),
        "{m}"
    );
    let m = case("e.tsv", b"sentence\tlabel\ngood\t1\nbad\t \n", sst());
    assert!(m.contains("line 3") && m.contains("empty label"), "{m}");
    let cols = TextColumns {
        text: Column::Index(0),
        text_pair: None,
        label: Column::Index(2),
        header: false,
        delimiter: None,
        num_classes: None,
    };
    let m = case("f.tsv", b"good\t1\n", cols.clone());
    assert!(
        m.contains("line 1") && m.contains("no column 2 (0-based)") && m.contains("2 fields"),
        "{m}"
    );
    let m = case(
        "g.tsv",
        b"good\t1\n",
        TextColumns {
            header: false,
            ..sst()
        },
    );
    assert!(
        m.contains("no header line") && m.contains("Column::Index"),
        "{m}"
    );
    let m = case("h.json", b"{}", sst());
    assert!(m.contains("extension"), "{m}");
    let m = case("i.tsv", b"sentence\tlabel\ngood\t1\nbad \xff\t0\n", sst());
    assert!(m.contains("line 3") && m.contains("UTF-8"), "{m}");
    let m = case("j.csv", b"", sst());
    assert!(m.contains("empty") && m.contains("header"), "{m}");
    let m = case("k.tsv", b"sentence\tlabel\nx\t99999999\n", sst());
    assert!(m.contains("line 2") && m.contains("too large"), "{m}");
    let missing = tmp.path().join("missing.tsv");
    let m = data_error_naming(
        TextClassificationDataset::open(&missing, sst()).unwrap_err(),
        &missing,
    );
    assert!(m.contains("file not found"), "{m}");
}

#[test]
fn corpus_reads_non_blank_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("corpus.txt");
    write(&path, b"first line\r\n\n   \nsecond  line \nthird");
    let c = TextCorpus::open(&path).unwrap();
    assert_eq!(c.len(), 3);
    assert_eq!(c.get(1).unwrap().text, "second  line ");
    assert_eq!(c.get(2).unwrap().label, None);
    assert_eq!(c.get(0).unwrap().text, "first line");
    assert!(c.class_names().is_empty());
    write(&path, b"ok\nfine\nbad \xc3\x28 here\n");
    let m = data_error_naming(TextCorpus::open(&path).unwrap_err(), &path);
    assert!(m.contains("line 3") && m.contains("UTF-8"), "{m}");
}

// ----- loader ----------------------------------------------------------------------------

#[test]
fn batches_are_padded_to_their_longest_sequence() {
    let tok = tokenizer();
    let texts = vec![
        "a".to_string(),
        "a charming and often affecting journey".to_string(),
        "bleak".to_string(),
        "the film".to_string(),
        "story".to_string(),
    ];
    let pairs = vec![
        "x".into(),
        "y".into(),
        "a longer second text".into(),
        "z".into(),
        "w".into(),
    ];
    let ds = TextClassificationDataset::new(
        texts.clone(),
        Some(pairs.clone()),
        vec![0, 1, 1, 0, 1],
        vec!["neg".into(), "pos".into()],
    )
    .unwrap();
    let mut cfg = loader_config(2, 0, 7);
    cfg.shuffle = false;
    let loader = DataLoader::text(Arc::new(ds), tok.clone(), cfg, TextConfig::default()).unwrap();
    assert_eq!(loader.class_names(), &["neg", "pos"]);
    let batches = collect(&loader, 0);
    assert_eq!(batches.len(), 3);
    for (ids, mask, types, labels, label_shape, indices, l) in &batches {
        let b = indices.len();
        assert_eq!(label_shape, &vec![b]);
        let encs: Vec<Encoding> = indices
            .iter()
            .map(|&i| tok.encode_pair(&texts[i], &pairs[i], 128).unwrap())
            .collect();
        assert_eq!(
            *l,
            encs.iter().map(|e| e.len()).max().unwrap(),
            "padded to the longest"
        );
        for (row, e) in encs.iter().enumerate() {
            let r = row * l..(row + 1) * l;
            let n = e.len();
            let want_ids: Vec<i64> = e
                .ids
                .iter()
                .map(|&x| x as i64)
                .chain(std::iter::repeat_n(0, l - n))
                .collect();
            assert_eq!(ids[r.clone()], want_ids[..]);
            let want_mask: Vec<i64> = (0..*l).map(|p| (p < n) as i64).collect();
            assert_eq!(mask[r.clone()], want_mask[..]);
            let want_types: Vec<i64> = e
                .type_ids
                .iter()
                .map(|&x| x as i64)
                .chain(std::iter::repeat_n(0, l - n))
                .collect();
            assert_eq!(types[r.clone()], want_types[..]);
            assert!(types[r].contains(&1), "pair tokens have type 1");
        }
        let want: Vec<i64> = indices.iter().map(|&i| [0, 1, 1, 0, 1][i]).collect();
        assert_eq!(labels, &want);
    }
    // The batch with the long pair is longer than the others: padding is per batch.
    let lens: Vec<usize> = batches.iter().map(|b| b.6).collect();
    assert!(lens.iter().max() > lens.iter().min(), "{lens:?}");
}

#[test]
fn mlm_masks_like_bert() {
    let tok = tokenizer();
    let mut lines = sentences(3000, 10, 40);
    // [UNK] (emoji) and a literal [MASK] are special: never chosen.
    for (i, l) in lines.iter_mut().enumerate().step_by(7) {
        l.push_str(if i % 2 == 0 {
            " 😀 end"
        } else {
            " [MASK] end"
        });
    }
    let n_seq = lines.len();
    let corpus: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(lines));
    let mlm = MlmConfig::default();
    let text = TextConfig {
        max_length: 64,
        bucket: false,
        mlm: Some(mlm),
    };
    let loader = DataLoader::text(corpus, tok.clone(), loader_config(64, 2, 3), text).unwrap();
    assert!(loader.is_mlm() && loader.class_names().is_empty());
    assert_eq!(loader.num_classes(), 30522);
    let encs = loader.encodings().unwrap().to_vec();
    let mask_id = tok.mask_id().unwrap() as i64;
    let (mut maskable, mut chosen, mut expected, mut var) = (0usize, 0usize, 0f64, 0f64);
    let (mut masked, mut kept, mut randomised) = (0usize, 0usize, 0usize);
    let mut seen = 0;
    for b in loader.epoch(0) {
        let (ids, mask, _, labels, label_shape, indices, l) = flatten(&b.unwrap());
        assert_eq!(label_shape, vec![indices.len(), l]);
        for (row, &i) in indices.iter().enumerate() {
            seen += 1;
            let e = &encs[i];
            let mut targets = 0;
            for p in 0..l {
                let (id, label) = (ids[row * l + p], labels[row * l + p]);
                if p >= e.len() {
                    assert_eq!(mask[row * l + p], 0);
                    assert_eq!((id, label), (0, -100), "padding is never a target");
                    continue;
                }
                let original = e.ids[p] as i64;
                if e.special[p] {
                    assert_eq!(
                        (id, label),
                        (original, -100),
                        "special token {original} chosen"
                    );
                    continue;
                }
                if label == -100 {
                    assert_eq!(id, original, "a token changed without a target");
                    continue;
                }
                assert_eq!(label, original, "the label is the original token");
                targets += 1;
                if id == mask_id {
                    masked += 1;
                } else if id == original {
                    kept += 1;
                } else {
                    assert!((0..30522).contains(&id));
                    randomised += 1;
                }
            }
            let n = e.special.iter().filter(|&&s| !s).count();
            assert!(targets >= 1 || n == 0, "sequence {i} has no target");
            maskable += n;
            chosen += targets;
            // Each position Bernoulli(p); a sequence with none gets one more.
            let q = (1.0 - mlm.probability).powi(n as i32);
            expected += n as f64 * mlm.probability + q;
            var += n as f64 * mlm.probability * (1.0 - mlm.probability) + q * (1.0 - q);
        }
    }
    assert_eq!(seen, n_seq);
    assert!(maskable > 50_000, "{maskable} maskable tokens");
    let sd = var.sqrt();
    assert!(
        (chosen as f64 - expected).abs() < 5.0 * sd,
        "{chosen} targets of {maskable} maskable, expected {expected:.0} ± {sd:.0}"
    );
    // 80/10/10: a random replacement equal to the original counts as kept (1 in 30522).
    let c = chosen as f64;
    for (what, count, p) in [
        ("[MASK]", masked, 0.8),
        ("random", randomised, 0.1),
        ("kept", kept, 0.1),
    ] {
        let tol = 5.0 * (c * p * (1.0 - p)).sqrt();
        assert!(
            (count as f64 - c * p).abs() < tol,
            "{what}: {count} of {chosen} targets, expected {:.0} ± {tol:.0}",
            c * p
        );
    }

    // Another epoch masks differently; the same epoch again identically.
    let a = collect(&loader, 1);
    assert_ne!(a, collect(&loader, 0));
    assert_eq!(a, collect(&loader, 1));
}

#[test]
fn text_batches_identical_for_any_worker_count() {
    let tok = tokenizer();
    let texts = sentences(203, 1, 30);
    let labels: Vec<usize> = (0..texts.len()).map(|i| i % 3).collect();
    let ds: Arc<dyn TextDataset> = Arc::new(
        TextClassificationDataset::new(
            texts.clone(),
            None,
            labels,
            vec!["a".into(), "b".into(), "c".into()],
        )
        .unwrap(),
    );
    let corpus: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(texts));
    for (name, ds, mlm, bucket) in [
        ("classification", ds.clone(), None, false),
        ("classification, bucketed", ds, None, true),
        (
            "masked-LM, bucketed",
            corpus,
            Some(MlmConfig::default()),
            true,
        ),
    ] {
        let make = |workers| {
            let text = TextConfig {
                max_length: 24,
                bucket,
                mlm,
            };
            DataLoader::text(
                ds.clone(),
                tok.clone(),
                loader_config(16, workers, 99),
                text,
            )
            .unwrap()
        };
        let reference = make(0);
        for epoch in 0..2 {
            let want = collect(&reference, epoch);
            assert_eq!(want.len(), 13);
            for workers in [1, 3] {
                assert_eq!(
                    collect(&make(workers), epoch),
                    want,
                    "{name}: {workers} workers, epoch {epoch}"
                );
            }
            // A run resumed at batch 5 sees the rest of the same epoch.
            let rest: Vec<Flat> = make(3)
                .epoch_from(epoch, 5)
                .map(|b| flatten(&b.unwrap()))
                .collect();
            assert_eq!(rest, want[5..], "{name}: resumed epoch {epoch}");
        }
        assert_ne!(
            collect(&reference, 0),
            collect(&reference, 1),
            "{name}: epochs differ"
        );
    }
}

#[test]
fn bucketing_keeps_every_sample_once_and_groups_lengths() {
    let tok = tokenizer();
    let texts = sentences(2000, 1, 60);
    let n = texts.len();
    let corpus: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(texts));
    let make = |bucket, drop_last| {
        let mut cfg = loader_config(8, 2, 5);
        cfg.drop_last = drop_last;
        let text = TextConfig {
            max_length: 64,
            bucket,
            mlm: Some(MlmConfig::default()),
        };
        DataLoader::text(corpus.clone(), tok.clone(), cfg, text).unwrap()
    };
    let padding = |batches: &[Flat]| -> f64 {
        let (pad, all): (usize, usize) = batches.iter().fold((0, 0), |(p, a), b| {
            (p + b.1.iter().filter(|&&m| m == 0).count(), a + b.1.len())
        });
        pad as f64 / all as f64
    };
    let plain = make(false, false);
    let bucketed = make(true, false);
    let lens = bucketed
        .encodings()
        .unwrap()
        .iter()
        .map(|e| e.len())
        .collect::<Vec<_>>();
    for epoch in 0..2 {
        let batches = collect(&bucketed, epoch);
        let mut seen: Vec<usize> = batches.iter().flat_map(|b| b.5.clone()).collect();
        assert_eq!(bucketed.order(epoch).len(), n);
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..n).collect::<Vec<_>>(),
            "every sample exactly once"
        );
        // Inside a batch the lengths are close (sorted runs of 400 samples).
        for b in &batches {
            let l: Vec<usize> = b.5.iter().map(|&i| lens[i]).collect();
            let spread = l.iter().max().unwrap() - l.iter().min().unwrap();
            assert!(spread <= 4, "batch lengths {l:?}");
        }
        let (p_plain, p_bucket) = (padding(&collect(&plain, epoch)), padding(&batches));
        assert!(
            p_bucket < 0.25 * p_plain,
            "padding {p_bucket:.3} bucketed vs {p_plain:.3} without"
        );
        // Batches are not in length order: short and long alternate.
        let l: Vec<usize> = batches.iter().map(|b| b.6).collect();
        assert!(l.windows(2).any(|w| w[0] > w[1]) && l.windows(2).any(|w| w[0] < w[1]));
    }
    assert_ne!(bucketed.order(0), bucketed.order(1));
    // drop_last drops exactly the short last batch; the rest is still distinct.
    let dropped = make(true, true);
    let batches = collect(&dropped, 0);
    assert_eq!(batches.len(), n / 8);
    assert!(batches.iter().all(|b| b.5.len() == 8));
    let mut seen: Vec<usize> = batches.iter().flat_map(|b| b.5.clone()).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), n / 8 * 8);
}

#[test]
fn text_loader_errors() {
    let tok = tokenizer();
    let corpus: Arc<dyn TextDataset> = Arc::new(TextCorpus::from_lines(vec!["some text".into()]));
    let e = DataLoader::text(
        corpus.clone(),
        tok.clone(),
        loader_config(4, 0, 0),
        TextConfig::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no label") && e.contains("TextConfig.mlm"),
        "{e}"
    );
    for bad in [
        MlmConfig {
            probability: 0.0,
            ..Default::default()
        },
        MlmConfig {
            mask: 0.95,
            random: 0.1,
            ..Default::default()
        },
        MlmConfig {
            random: f64::NAN,
            ..Default::default()
        },
    ] {
        let text = TextConfig {
            mlm: Some(bad),
            ..Default::default()
        };
        let e = DataLoader::text(corpus.clone(), tok.clone(), loader_config(4, 0, 0), text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("MlmConfig"), "{e}");
    }
    let text = TextConfig {
        max_length: 1,
        mlm: Some(MlmConfig::default()),
        ..Default::default()
    };
    let e = DataLoader::text(corpus.clone(), tok.clone(), loader_config(4, 0, 0), text)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_length 1"), "{e}");
    let e = DataLoader::text(corpus, tok, loader_config(0, 0, 0), TextConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch_size 0"), "{e}");
    let e = TextClassificationDataset::new(
        vec!["a".into()],
        None,
        vec![2],
        vec!["x".into(), "y".into()],
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Index {
                index: 2,
                size: 2,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn integer_labels_with_gaps_are_named_unless_a_class_count_is_declared() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("gaps.tsv");
    write(
        &path,
        b"sentence\tlabel\na\t0\nb\t1\nc\t7\nd\t1\ne\t100000\nf\t7\n",
    );
    // Four distinct labels: they must be 0..3. 7 and 100000 are named with their lines.
    let msg = data_error_naming(
        TextClassificationDataset::open(&path, TextColumns::named("sentence", "label"))
            .unwrap_err(),
        &path,
    );
    assert!(
        msg.contains("7 (line 4, 7)") && msg.contains("100000 (line 6)"),
        "{msg}"
    );
    assert!(msg.contains("--num-classes"), "{msg}");
    // A declared count the labels fit: classes no line uses are allowed.
    let declared = |k| TextColumns {
        num_classes: Some(k),
        ..TextColumns::named("sentence", "label")
    };
    let ok = TextClassificationDataset::open(&path, declared(100_001)).unwrap();
    assert_eq!(ok.num_classes(), 100_001);
    assert_eq!(ok.labels(), &[0, 1, 7, 1, 100_000, 7]);
    // A declared count some label exceeds.
    let msg = data_error_naming(
        TextClassificationDataset::open(&path, declared(8)).unwrap_err(),
        &path,
    );
    assert!(
        msg.contains("100000 (line 6)") && !msg.contains("7 (line") && msg.contains("0..8"),
        "{msg}"
    );
    // Labels 0..N-1 need no declaration; a dev set with only some classes takes one.
    let path = tmp.path().join("dev.tsv");
    write(&path, b"sentence\tlabel\na\t2\nb\t0\nc\t1\n");
    assert_eq!(
        TextClassificationDataset::open(&path, TextColumns::named("sentence", "label"))
            .unwrap()
            .num_classes(),
        3
    );
    write(&path, b"sentence\tlabel\na\t0\nb\t2\n");
    assert!(
        TextClassificationDataset::open(&path, TextColumns::named("sentence", "label")).is_err()
    );
    assert_eq!(
        TextClassificationDataset::open(&path, declared(3))
            .unwrap()
            .num_classes(),
        3
    );
    // A declared count for class-name labels is an error: their classes are the names.
    let path = tmp.path().join("names.tsv");
    write(&path, b"sentence\tlabel\na\tpos\nb\tneg\n");
    let msg = data_error_naming(
        TextClassificationDataset::open(&path, declared(3)).unwrap_err(),
        &path,
    );
    assert!(msg.contains("class names"), "{msg}");
}
