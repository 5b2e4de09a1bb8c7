//! Text batches for the `DataLoader`: tokenising a `TextDataset`, ordering it into length
//! buckets, padding each batch to its longest sequence, and BERT's masked-LM masking.
//!
//! Every sample is tokenised once, when the loader is made (`DataLoader::text`), on all
//! cores: SST-2's 67,349 training sentences take about a second, and knowing every length
//! up front is what lets bucketing sort by length. Workers then only pad, copy and mask.
//!
//! Masked-LM follows BERT and `transformers`' `DataCollatorForLanguageModeling`: each
//! position that is neither special nor padding is chosen with probability `probability`
//! (15 %); a chosen token becomes `[MASK]` with probability `mask` (80 %), a uniformly
//! random id of the vocabulary with probability `random` (10 %), else stays (10 %). The
//! labels hold the original id at chosen positions and -100 (no loss) elsewhere. One
//! difference: a sequence where no position was chosen gets one chosen uniformly, so no
//! sequence (and no batch) is without targets, unless it has no maskable token at all
//! (an empty text). The draws come from a generator seeded by (seed, epoch, sample index).

use std::sync::Arc;

use super::synthetic::mix_seed;
use super::text::TextDataset;
use super::tokenizer::{Encoding, Tokenizer};
use crate::error::{Error, Result};
use crate::rng::Generator;

/// How a text `DataLoader` tokenises, orders and masks.
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    /// Tokens per sequence at most, special tokens included (longer texts are truncated).
    pub max_length: usize,
    /// Put samples of similar length into the same batch (less padding); see
    /// `DataLoader::order`.
    pub bucket: bool,
    /// Masked-LM targets instead of class labels.
    pub mlm: Option<MlmConfig>,
}

impl Default for TextConfig {
    /// `max_length` 128, no bucketing, classification labels.
    fn default() -> Self {
        TextConfig {
            max_length: 128,
            bucket: false,
            mlm: None,
        }
    }
}

/// BERT's masking (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlmConfig {
    /// Share of maskable positions chosen as targets.
    pub probability: f64,
    /// Share of targets replaced by `[MASK]`.
    pub mask: f64,
    /// Share of targets replaced by a random token (the rest stay unchanged).
    pub random: f64,
}

impl Default for MlmConfig {
    /// BERT's 15 % with 80/10/10.
    fn default() -> Self {
        MlmConfig {
            probability: 0.15,
            mask: 0.8,
            random: 0.1,
        }
    }
}

impl MlmConfig {
    fn check(&self) -> Result<()> {
        let ok = |p: f64| p.is_finite() && (0.0..=1.0).contains(&p);
        let valid = ok(self.probability)
            && self.probability > 0.0
            && ok(self.mask)
            && ok(self.random)
            && self.mask + self.random <= 1.0 + 1e-12;
        if !valid {
            return Err(Error::arg(
                "MlmConfig",
                format!(
                    "probability must be in (0, 1], mask and random in [0, 1] with mask + random \
                     <= 1; got probability {}, mask {}, random {}",
                    self.probability, self.mask, self.random
                ),
            ));
        }
        Ok(())
    }
}

/// A tokenised text data set: what a text loader's workers read.
pub(crate) struct TextSource {
    pub dataset: Arc<dyn TextDataset>,
    pub tokenizer: Arc<Tokenizer>,
    pub config: TextConfig,
    pub encodings: Vec<Encoding>,
    /// Class index of each sample (classification only).
    pub labels: Vec<i64>,
    pub pad_id: u32,
    /// `[MASK]`'s id (masked-LM only).
    pub mask_id: u32,
}

/// A text batch as a worker builds it: `[B, L]` row-major vectors.
pub(crate) struct RawText {
    pub seq_len: usize,
    /// Whether `labels` are `[B, L]` masked-LM targets (else `[B]` classes).
    pub mlm: bool,
    pub input_ids: Vec<i64>,
    pub attention_mask: Vec<i64>,
    pub token_type_ids: Vec<i64>,
    /// `[B]` classes, or `[B, L]` masked-LM targets.
    pub labels: Vec<i64>,
}

pub(crate) const MLM_TAG: u64 = 0x4d4c_4d21; // "MLM!"
pub(crate) const BUCKET_TAG: u64 = 0x4255_434b; // "BUCK"
/// Bucketing sorts by length inside runs of this many batches.
pub const BUCKET_CHUNK_BATCHES: usize = 50;

impl TextSource {
    /// Tokenises every sample of `dataset` (in parallel) and checks the labels.
    pub fn new(
        dataset: Arc<dyn TextDataset>,
        tokenizer: Arc<Tokenizer>,
        config: TextConfig,
    ) -> Result<TextSource> {
        let op = "DataLoader::text";
        let mask_id = match &config.mlm {
            Some(m) => {
                m.check()?;
                tokenizer.mask_id()?
            }
            None => 0,
        };
        let num_classes = dataset.num_classes();
        let encoded: Vec<Result<(Encoding, i64)>> = crate::cpu::chunked::map_collect(
            dataset.len(),
            1,
            || (),
            |_, i| {
                let s = dataset.get(i)?;
                let enc = tokenizer.encode_opt(s.text, s.text_pair, config.max_length)?;
                let label = match (s.label, &config.mlm) {
                    (_, Some(_)) => -100,
                    (Some(l), None) if l < num_classes => l as i64,
                    (Some(l), None) => {
                        return Err(Error::Index {
                            op: "DataLoader::text: sample label",
                            index: l as i64,
                            size: num_classes,
                        })
                    }
                    (None, None) => {
                        return Err(Error::arg(
                            op,
                            format!(
                                "sample {i} has no label: a classification loader needs \
                                 labelled text (set TextConfig.mlm for masked-LM on \
                                 unlabelled text)"
                            ),
                        ))
                    }
                };
                Ok((enc, label))
            },
        );
        let mut encodings = Vec::with_capacity(encoded.len());
        let mut labels = Vec::with_capacity(encoded.len());
        for r in encoded {
            let (e, l) = r?;
            encodings.push(e);
            labels.push(l);
        }
        Ok(TextSource {
            pad_id: tokenizer.pad_id(),
            dataset,
            tokenizer,
            config,
            encodings,
            labels,
            mask_id,
        })
    }

    /// Reorders a shuffled (or plain) `order` into length buckets: sorted by token count
    /// inside runs of `BUCKET_CHUNK_BATCHES` batches, then the full batches put in an order
    /// drawn from (seed, epoch); a last, smaller batch stays last (so `drop_last` drops
    /// it). Every index stays exactly once.
    pub fn bucket(
        &self,
        order: &mut [usize],
        batch_size: usize,
        seed: u64,
        epoch: u64,
        shuffle: bool,
    ) {
        let run = batch_size.saturating_mul(BUCKET_CHUNK_BATCHES).max(1);
        for chunk in order.chunks_mut(run) {
            chunk.sort_by_key(|&i| self.encodings[i].len());
        }
        if !shuffle {
            return;
        }
        let full = order.len() / batch_size;
        let mut rng = Generator::new(mix_seed(&[seed, BUCKET_TAG, epoch]));
        let mut perm: Vec<usize> = (0..full).collect();
        for i in (1..full).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            perm.swap(i, j);
        }
        let old = order[..full * batch_size].to_vec();
        for (dst, &src) in perm.iter().enumerate() {
            order[dst * batch_size..(dst + 1) * batch_size]
                .copy_from_slice(&old[src * batch_size..(src + 1) * batch_size]);
        }
    }

    /// Pads (and masks) the samples `indices` into one batch.
    pub fn build(&self, indices: &[usize], seed: u64, epoch: u64) -> Result<RawText> {
        let b = indices.len();
        let seq_len = indices
            .iter()
            .map(|&i| self.encodings[i].len())
            .max()
            .unwrap_or(0);
        let n = b * seq_len;
        let mut input_ids = vec![self.pad_id as i64; n];
        let mut attention_mask = vec![0i64; n];
        let mut token_type_ids = vec![0i64; n];
        let mut labels = match self.config.mlm {
            Some(_) => vec![-100i64; n],
            None => indices.iter().map(|&i| self.labels[i]).collect(),
        };
        for (row, &i) in indices.iter().enumerate() {
            let enc = &self.encodings[i];
            let at = row * seq_len;
            let len = enc.len();
            for (dst, &id) in input_ids[at..at + len].iter_mut().zip(&enc.ids) {
                *dst = id as i64;
            }
            attention_mask[at..at + len].fill(1);
            for (dst, &t) in token_type_ids[at..at + len].iter_mut().zip(&enc.type_ids) {
                *dst = t as i64;
            }
            if let Some(mlm) = &self.config.mlm {
                let mut rng = Generator::new(mix_seed(&[seed, MLM_TAG, epoch, i as u64]));
                mask_tokens(
                    enc,
                    mlm,
                    self.mask_id,
                    self.tokenizer.vocab_size(),
                    &mut rng,
                    &mut input_ids[at..at + len],
                    &mut labels[at..at + len],
                );
            }
        }
        Ok(RawText {
            seq_len,
            mlm: self.config.mlm.is_some(),
            input_ids,
            attention_mask,
            token_type_ids,
            labels,
        })
    }
}

/// BERT's masking of one sequence (see the module docs): `ids` and `labels` are its row of
/// the batch, `ids` already holding the tokens and `labels` -100.
fn mask_tokens(
    enc: &Encoding,
    mlm: &MlmConfig,
    mask_id: u32,
    vocab_size: usize,
    rng: &mut Generator,
    ids: &mut [i64],
    labels: &mut [i64],
) {
    let maskable: Vec<usize> = (0..enc.len()).filter(|&p| !enc.special[p]).collect();
    let mut chosen: Vec<usize> = maskable
        .iter()
        .copied()
        .filter(|_| rng.uniform_f64() < mlm.probability)
        .collect();
    if chosen.is_empty() && !maskable.is_empty() {
        chosen.push(maskable[rng.below(maskable.len() as u64) as usize]);
    }
    for p in chosen {
        labels[p] = ids[p];
        let u = rng.uniform_f64();
        if u < mlm.mask {
            ids[p] = mask_id as i64;
        } else if u < mlm.mask + mlm.random {
            ids[p] = rng.below(vocab_size as u64) as i64;
        }
    }
}
