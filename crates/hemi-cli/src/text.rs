//! The text side of the CLI: where a BERT's config, weights and vocabulary come from, the
//! text data sets `hemi train --dataset text` reads, and `hemi embed`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use hemi::data::{
    DataLoader, LoaderConfig, MlmConfig, TextClassificationDataset, TextColumns, TextConfig,
    TextCorpus, TextDataset, Tokenizer,
};
use hemi::models::registry::ModelSpec;
use hemi::models::{self as bert, BertConfig, BertModel};
use hemi::nn::Module;
use hemi::{Error, Generator, Result, Tensor};

/// Where a text model's size (config.json), weights and tokenizer come from.
#[derive(Clone, Debug)]
pub struct TextSources {
    pub config: PathBuf,
    /// `model.safetensors` of `--pretrained DIR`.
    pub weights: Option<PathBuf>,
    pub tokenizer: PathBuf,
}

/// `p` made absolute, without `..` where the file exists (paths recorded in checkpoints).
fn absolute(p: &Path) -> Result<PathBuf> {
    if let Ok(c) = std::fs::canonicalize(p) {
        return Ok(c);
    }
    std::path::absolute(p).map_err(|source| Error::Io {
        path: p.display().to_string(),
        source,
    })
}

impl TextSources {
    /// `--pretrained DIR` gives all three (`DIR/config.json`, `DIR/model.safetensors`,
    /// `DIR/tokenizer.json`); `--config FILE` and `--tokenizer PATH` (a `tokenizer.json` or
    /// a directory holding one) override or replace them for a freshly initialised model.
    pub fn resolve(
        model: &str,
        pretrained: Option<&Path>,
        config: Option<&Path>,
        tokenizer: Option<&Path>,
    ) -> Result<TextSources> {
        let config = match (config, pretrained) {
            (Some(c), _) => c.to_path_buf(),
            (None, Some(d)) => d.join("config.json"),
            (None, None) => {
                return Err(Error::arg(
                    "train",
                    format!(
                        "{model} needs --pretrained DIR (a Hugging Face model directory: \
                         config.json, model.safetensors, tokenizer.json) or --config FILE \
                         (a BERT config.json, for a freshly initialised model) with \
                         --tokenizer PATH"
                    ),
                ))
            }
        };
        let tokenizer = match (tokenizer, pretrained) {
            (Some(t), _) if t.is_dir() => t.join("tokenizer.json"),
            (Some(t), _) => t.to_path_buf(),
            (None, Some(d)) => d.join("tokenizer.json"),
            (None, None) => {
                return Err(Error::arg(
                    "train",
                    format!("{model} with --config needs --tokenizer PATH (a tokenizer.json)"),
                ))
            }
        };
        let weights = pretrained.map(|d| d.join("model.safetensors"));
        if let Some(w) = &weights {
            if !w.is_file() {
                return Err(Error::Msg(format!(
                    "--pretrained {}: no model.safetensors there",
                    pretrained.unwrap_or(w).display()
                )));
            }
        }
        Ok(TextSources {
            config: absolute(&config)?,
            weights: weights.as_deref().map(absolute).transpose()?,
            tokenizer: absolute(&tokenizer)?,
        })
    }

    /// Recorded in a checkpoint's settings, so that `hemi eval` and `--resume` rebuild the
    /// same model and tokenisation.
    pub fn record(&self, settings: &mut std::collections::BTreeMap<String, String>) {
        settings.insert("config".into(), self.config.display().to_string());
        settings.insert("tokenizer".into(), self.tokenizer.display().to_string());
        if let Some(w) = &self.weights {
            settings.insert("pretrained".into(), w.display().to_string());
        }
    }

    pub fn tokenizer(&self) -> Result<Arc<Tokenizer>> {
        Ok(Arc::new(Tokenizer::from_file(&self.tokenizer)?))
    }

    /// The model's config as its `save_pretrained` writes it.
    pub fn bert_config(&self, spec: &ModelSpec, classes: usize) -> Result<BertConfig> {
        let cfg = BertConfig::from_file(&self.config)?;
        Ok(if spec.task == "classification" {
            cfg.with_num_labels(classes)
        } else {
            cfg
        })
    }

    /// The model `spec` with `classes` outputs, from the config, with the pretrained
    /// weights when there are any (a base checkpoint leaves the head freshly initialised);
    /// checks that every token id of `tokenizer` has an embedding.
    pub fn build(
        &self,
        spec: &ModelSpec,
        classes: usize,
        tokenizer: &Tokenizer,
        seed: u64,
    ) -> Result<Box<dyn Module>> {
        let cfg = BertConfig::from_file(&self.config)?;
        if tokenizer.vocab_size() > cfg.vocab_size {
            return Err(Error::Msg(format!(
                "{}: vocab_size {} is smaller than the tokenizer's {} tokens ({})",
                self.config.display(),
                cfg.vocab_size,
                tokenizer.vocab_size(),
                self.tokenizer.display()
            )));
        }
        let mut model = spec.build_text(&self.config, classes, seed)?;
        if let Some(w) = &self.weights {
            bert::load_pretrained(model.as_mut(), w)?;
        }
        Ok(model)
    }
}

/// Training and held-out texts.
pub struct TextData {
    /// `text` (train.tsv + dev.tsv) or `text-corpus` (one file, its last lines held out).
    pub name: &'static str,
    pub train: Arc<dyn TextDataset>,
    pub test: Arc<dyn TextDataset>,
    pub description: String,
}

/// The first of `names` that exists in `dir`.
fn first_file(dir: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

/// Lines of a corpus held out for the perplexity: one in twenty, at least one.
fn held_out(n: usize) -> usize {
    (n / 20).max(1)
}

/// `path` is a directory with `train.tsv` (or `.csv`) and `dev.tsv` (or `test.tsv`, or
/// `.csv`), labelled texts in `columns` (GLUE's layout); or, for masked-LM only, one plain
/// text file with an example per line, whose last twentieth is held out.
pub fn load_text_data(path: &Path, mlm: bool, columns: &TextColumns) -> Result<TextData> {
    let t0 = std::time::Instant::now();
    if path.is_file() {
        if !mlm {
            return Err(Error::Msg(format!(
                "{}: text classification reads a directory with train.tsv and dev.tsv \
                 (a single file is a masked-LM corpus)",
                path.display()
            )));
        }
        let corpus = TextCorpus::open(path)?;
        let lines: Vec<String> = (0..corpus.len())
            .map(|i| corpus.get(i).map(|s| s.text.to_string()))
            .collect::<Result<_>>()?;
        if lines.len() < 2 {
            return Err(Error::Msg(format!(
                "{}: {} non-blank lines; masked-LM needs at least 2 (one is held out)",
                path.display(),
                lines.len()
            )));
        }
        let cut = lines.len() - held_out(lines.len());
        let (train, test) = (lines[..cut].to_vec(), lines[cut..].to_vec());
        return Ok(TextData {
            name: "text-corpus",
            description: format!(
                "text corpus {} ({} training lines, the last {} held out)",
                path.display(),
                train.len(),
                test.len()
            ),
            train: Arc::new(TextCorpus::from_lines(train)),
            test: Arc::new(TextCorpus::from_lines(test)),
        });
    }
    if !path.is_dir() {
        return Err(Error::Msg(format!(
            "{}: no such directory or file (text data: a directory with train.tsv and \
             dev.tsv, or a text file for masked-LM)",
            path.display()
        )));
    }
    let train = first_file(path, &["train.tsv", "train.csv"])
        .ok_or_else(|| Error::Msg(format!("{}: no train.tsv or train.csv", path.display())))?;
    let test =
        first_file(path, &["dev.tsv", "test.tsv", "dev.csv", "test.csv"]).ok_or_else(|| {
            Error::Msg(format!(
                "{}: no dev.tsv or test.tsv (nor .csv) for held-out evaluation",
                path.display()
            ))
        })?;
    let train = TextClassificationDataset::open(&train, columns.clone())?;
    let test = TextClassificationDataset::open(&test, columns.clone())?;
    if !mlm && train.class_names() != test.class_names() {
        return Err(Error::Msg(format!(
            "{}: the held-out file's classes {:?} differ from train's {:?}",
            test.path().display(),
            test.class_names(),
            train.class_names()
        )));
    }
    Ok(TextData {
        name: "text",
        description: format!(
            "{} ({} texts) and {} ({} texts), read in {:.1} s",
            train.path().display(),
            train.len(),
            test.path().display(),
            test.len(),
            t0.elapsed().as_secs_f64()
        ),
        train: Arc::new(train),
        test: Arc::new(test),
    })
}

/// How `hemi train` tokenises and batches text.
#[derive(Clone, Debug)]
pub struct TextLoading {
    pub batch_size: usize,
    pub max_length: usize,
    pub bucket: bool,
    /// Shuffle the training texts every epoch (else file order).
    pub shuffle: bool,
    pub mlm: Option<MlmConfig>,
    pub seed: u64,
    pub workers: usize,
}

/// Training batches (shuffled unless `l.shuffle` is off) and ordered held-out batches (the held-out masks of
/// masked-LM are the same every epoch: they depend on the seed and the sample only).
pub fn text_loaders(
    data: &TextData,
    tokenizer: &Arc<Tokenizer>,
    l: &TextLoading,
) -> Result<(DataLoader, DataLoader)> {
    let text = TextConfig {
        max_length: l.max_length,
        bucket: l.bucket,
        mlm: l.mlm,
    };
    let train = DataLoader::text(
        data.train.clone(),
        tokenizer.clone(),
        LoaderConfig {
            batch_size: l.batch_size,
            shuffle: l.shuffle,
            seed: l.seed,
            workers: l.workers,
            ..Default::default()
        },
        text.clone(),
    )?;
    let test = DataLoader::text(
        data.test.clone(),
        tokenizer.clone(),
        LoaderConfig {
            batch_size: l.batch_size.max(64),
            shuffle: false,
            seed: l.seed,
            workers: l.workers,
            ..Default::default()
        },
        TextConfig {
            bucket: false,
            ..text
        },
    )?;
    Ok((train, test))
}

#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// A sentence-transformers / Hugging Face model directory (config.json,
    /// model.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// A UTF-8 text file, one sentence per line (blank lines are skipped); `-` reads stdin.
    file: PathBuf,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Tokens per sentence at most; default: the model's `sentence_bert_config.json`
    /// `max_seq_length`, else its `max_position_embeddings`.
    #[arg(long)]
    max_length: Option<usize>,
}

/// sentence-transformers' `max_seq_length` of `dir`, if it says.
fn sentence_max_length(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("sentence_bert_config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("max_seq_length")?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
}

/// `hemi embed`: one JSON line `{"text": ..., "embedding": [...]}` per sentence, the mean of
/// the final hidden states over the sentence's tokens, L2-normalised (sentence-transformers'
/// pooling for all-MiniLM-L6-v2), in F32.
pub fn run_embed(args: EmbedArgs) -> Result<()> {
    if args.batch_size == 0 {
        return Err(Error::arg("embed", "--batch-size must be at least 1"));
    }
    let text = if args.file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|source| {
            Error::Io {
                path: "<stdin>".into(),
                source,
            }
        })?;
        s
    } else {
        let bytes = std::fs::read(&args.file).map_err(|source| Error::Io {
            path: args.file.display().to_string(),
            source,
        })?;
        String::from_utf8(bytes).map_err(|e| {
            Error::Msg(format!(
                "{}: invalid UTF-8 at byte {}",
                args.file.display(),
                e.utf8_error().valid_up_to()
            ))
        })?
    };
    let sentences: Vec<&str> = text
        .lines()
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .filter(|l| !l.trim().is_empty())
        .collect();
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let mut model = BertModel::from_pretrained(&args.model, &mut Generator::new(0))?;
    model.set_training(false);
    let max_length = args
        .max_length
        .or_else(|| sentence_max_length(&args.model))
        .unwrap_or(model.config.max_position_embeddings)
        .min(model.config.max_position_embeddings);
    let _g = hemi::autograd::no_grad();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for chunk in sentences.chunks(args.batch_size) {
        let encs = chunk
            .iter()
            .map(|s| tokenizer.encode(s, max_length))
            .collect::<Result<Vec<_>>>()?;
        let l = encs.iter().map(|e| e.ids.len()).max().unwrap_or(0);
        let b = encs.len();
        let (mut ids, mut mask, mut types) =
            (vec![0i64; b * l], vec![0i64; b * l], vec![0i64; b * l]);
        for (r, e) in encs.iter().enumerate() {
            for (j, (&id, &t)) in e.ids.iter().zip(&e.type_ids).enumerate() {
                ids[r * l + j] = id as i64;
                types[r * l + j] = t as i64;
                mask[r * l + j] = 1;
            }
            for id in &mut ids[r * l + e.ids.len()..(r + 1) * l] {
                *id = tokenizer.pad_id() as i64;
            }
        }
        let ids = Tensor::from_vec(ids, &[b, l])?;
        let mask = Tensor::from_vec(mask, &[b, l])?;
        let types = Tensor::from_vec(types, &[b, l])?;
        let (hidden, _) = model.forward_text(&ids, &mask, &types)?;
        let emb = bert::sentence_embedding(&hidden, &mask)?.to_vec_f32();
        let h = emb.len() / b.max(1);
        for (s, row) in chunk.iter().zip(emb.chunks(h.max(1))) {
            let line = serde_json::json!({"text": s, "embedding": row});
            writeln!(out, "{line}").map_err(|source| Error::Io {
                path: "<stdout>".into(),
                source,
            })?;
        }
    }
    out.flush().map_err(|source| Error::Io {
        path: "<stdout>".into(),
        source,
    })
}
