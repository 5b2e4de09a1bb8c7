//! `Tokenizer`: Hugging Face's `tokenizers` crate reading a `tokenizer.json`, wrapped so that
//! text becomes token ids the way Python's `tokenizer(text, truncation=True, max_length=L)`
//! makes them (the same Rust code runs underneath `transformers`' fast tokenizers).
//!
//! A `tokenizer.json` may carry its own truncation and padding settings (all-MiniLM-L6-v2's
//! pads every sequence to 128). Those are switched off at load: the length is an argument
//! of each call, and the loader pads each batch to its longest sequence. Truncation keeps
//! room for the special tokens the post-processor adds (`[CLS] a [SEP]`, `[CLS] a [SEP] b
//! [SEP]`) and shortens a pair longest-first, as `transformers` does.
//!
//! Built without C code: `tokenizers` with `fancy-regex` in place of Oniguruma (only the
//! `Split` pre-tokenizer and `Replace` normaliser use a regex; BERT's normaliser,
//! pre-tokenizer, WordPiece model and template post-processor use none).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tokenizers::utils::truncation::{
    truncate_encodings, TruncationDirection, TruncationParams, TruncationStrategy,
};
use tokenizers::PostProcessor as _;

use super::dataset::{check_regular_file, data_error};
use crate::error::{Error, Result};

/// One tokenised text (or pair), special tokens included, not padded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoding {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Segment of each token: 0 for the first text and its `[CLS]`/`[SEP]`, 1 for the pair.
    pub type_ids: Vec<u32>,
    /// True for special tokens: those the post-processor added and any token of the
    /// tokenizer's special vocabulary met in the text (`[UNK]`, a literal `[MASK]`), as
    /// `transformers`' `get_special_tokens_mask(already_has_special_tokens=True)` marks them.
    /// Masked-LM never chooses these.
    pub special: Vec<bool>,
}

impl Encoding {
    /// Number of tokens, special tokens included.
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    /// True when the encoding holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// A `tokenizer.json` tokenizer (see the module docs).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    special_ids: HashSet<u32>,
    pad_id: u32,
    mask_id: Option<u32>,
    cls_id: Option<u32>,
    sep_id: Option<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("pad_id", &self.pad_id)
            .field("mask_id", &self.mask_id)
            .finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::read(path.as_ref())
    }

    /// `from_file`, compiled once here: a generic body would be compiled again in every
    /// crate that calls it, and `tokenizers`' JSON deserialisation with it (10 s of the
    /// `bert_dropout_spread` example's build).
    fn read(path: &Path) -> Result<Tokenizer> {
        check_regular_file(path, "a Hugging Face tokenizer.json")?;
        let bytes = std::fs::read(path).map_err(|e| super::dataset::io_error(path, e))?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            data_error(
                path,
                format!("not a readable Hugging Face tokenizer.json: {e}"),
            )
        })?;
        let padding_pad_id = inner.get_padding().map(|p| p.pad_id);
        inner
            .with_truncation(None)
            .map_err(|e| data_error(path, format!("cannot switch truncation off: {e}")))?;
        inner.with_padding(None);
        let added = inner.get_added_tokens_decoder();
        let special_ids: HashSet<u32> = added
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let id = |tok: &str| inner.token_to_id(tok);
        // The pad id: tokenizer.json's padding section if it had one, else `[PAD]`/`<pad>`.
        let pad_id = padding_pad_id
            .or_else(|| id("[PAD]"))
            .or_else(|| id("<pad>"));
        let Some(pad_id) = pad_id else {
            return Err(data_error(
                path,
                "the tokenizer has no padding token ([PAD] or <pad>) and no padding section, \
                 so batches cannot be padded",
            ));
        };
        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            mask_id: id("[MASK]").or_else(|| id("<mask>")),
            cls_id: id("[CLS]").or_else(|| id("<s>")),
            sep_id: id("[SEP]").or_else(|| id("</s>")),
            inner,
            path: path.to_path_buf(),
            special_ids,
            pad_id,
            vocab_size,
        })
    }

    /// Reads `dir/tokenizer.json` (a Hugging Face model directory).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::read(&dir.as_ref().join("tokenizer.json"))
    }

    /// The file this tokenizer was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokenises `text` into at most `max_length` tokens, special tokens included.
    pub fn encode(&self, text: &str, max_length: usize) -> Result<Encoding> {
        self.encode_impl(text, None, max_length)
    }

    /// Tokenises the pair (`a`, `b`) into at most `max_length` tokens, special tokens
    /// included, shortening the longer text first.
    pub fn encode_pair(&self, a: &str, b: &str, max_length: usize) -> Result<Encoding> {
        self.encode_impl(a, Some(b), max_length)
    }

    /// `encode` or `encode_pair`.
    pub fn encode_opt(&self, a: &str, b: Option<&str>, max_length: usize) -> Result<Encoding> {
        self.encode_impl(a, b, max_length)
    }

    fn encode_impl(&self, a: &str, b: Option<&str>, max_length: usize) -> Result<Encoding> {
        let fail = |e: tokenizers::Error| {
            data_error(&self.path, format!("tokenising {:?} failed: {e}", short(a)))
        };
        let processor = self.inner.get_post_processor();
        let added = processor.map_or(0, |p| p.added_tokens(b.is_some()));
        if max_length < added {
            return Err(Error::arg(
                "Tokenizer::encode",
                format!(
                    "max_length {max_length} is shorter than the {added} special tokens every \
                     sequence{} gets",
                    if b.is_some() { " pair" } else { "" }
                ),
            ));
        }
        let first = self.inner.encode_fast(a, false).map_err(fail)?;
        let second = match b {
            Some(b) => Some(self.inner.encode_fast(b, false).map_err(fail)?),
            None => None,
        };
        let params = TruncationParams {
            max_length: max_length - added,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        };
        let (first, second) = truncate_encodings(first, second, &params).map_err(fail)?;
        let mut enc = match processor {
            Some(p) => p.process(first, second, true).map_err(fail)?,
            None => {
                let mut first = first;
                if let Some(mut second) = second {
                    second.set_type_ids(vec![1; second.len()]);
                    first.merge_with(second, false);
                }
                first
            }
        };
        // Overflowing pieces are not used: drop them rather than carry them around.
        enc.take_overflowing();
        let ids = enc.get_ids().to_vec();
        let special = enc
            .get_special_tokens_mask()
            .iter()
            .zip(&ids)
            .map(|(&m, id)| m != 0 || self.special_ids.contains(id))
            .collect();
        Ok(Encoding {
            type_ids: enc.get_type_ids().to_vec(),
            special,
            ids,
        })
    }

    /// The id padding uses.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The `[MASK]` id; an error naming the file if the tokenizer has none.
    pub fn mask_id(&self) -> Result<u32> {
        self.mask_id.ok_or_else(|| {
            data_error(
                &self.path,
                "the tokenizer has no mask token ([MASK] or <mask>)",
            )
        })
    }

    /// The `[CLS]` id; an error naming the file if the tokenizer has none.
    pub fn cls_id(&self) -> Result<u32> {
        self.cls_id
            .ok_or_else(|| data_error(&self.path, "the tokenizer has no [CLS] (or <s>) token"))
    }

    /// The `[SEP]` id; an error naming the file if the tokenizer has none.
    pub fn sep_id(&self) -> Result<u32> {
        self.sep_id
            .ok_or_else(|| data_error(&self.path, "the tokenizer has no [SEP] (or </s>) token"))
    }

    /// Ids in the vocabulary, added tokens included: every id is below this.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of `token` in the vocabulary, if it has one.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of `id`, if `id` is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is one of the tokenizer's special tokens (`[PAD]`, `[CLS]`, `[UNK]`...).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }
}

/// The start of a long text, for error messages.
fn short(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}
