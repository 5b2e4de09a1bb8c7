//! The `DataLoader`: batches of a data set in a seeded order, assembled by worker threads
//! ahead of the training loop.
//!
//! Determinism is by construction, not by luck of scheduling:
//! - epoch `e`'s sample order is a Fisher-Yates shuffle from a generator seeded by
//!   (seed, e) alone, so a run resumed at epoch `e` sees the same order;
//! - each sample's augmentation draws from a generator seeded by (seed, e, sample index),
//!   so it does not matter which worker builds it;
//! - batch `k` is built by worker `k % workers` and read back from that worker's queue in
//!   order `k = 0, 1, 2...`, so batches arrive in order whatever the thread timing.
//!
//! Hence the batches are bit-identical for any worker count (0 = build in the calling
//! thread, as PyTorch's `num_workers=0`). Each worker's queue holds at most `prefetch`
//! finished batches, which bounds memory and lets workers decode and transform while the
//! model trains. A worker's error arrives as an `Err` item in its batch's place (and ends
//! the epoch); a worker that panics is reported as an error too.
//!
//! `Epoch::to_device` puts the batches on a GPU: a thread uploads batch `k + 1` while the
//! training step on batch `k` runs, the batches bit-identical to uploading each in turn.
//!
//! Text loaders (`DataLoader::text`) keep all of this. Their samples are tokenised when the
//! loader is made; a batch is padded to its longest sequence (dynamic padding), and its
//! masked-LM draws (if any) come from (seed, epoch, sample index) like augmentations. With
//! `TextConfig::bucket` the epoch's order is rearranged into length buckets, still a
//! function of (seed, epoch) alone (see `order`). `LoaderConfig::transform` applies to
//! images only.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::dataset::Dataset;
use super::inputs::{Inputs, TextInputs};
use super::synthetic::mix_seed;
use super::text::TextDataset;
use super::text_batch::{RawText, TextConfig, TextSource};
use super::tokenizer::{Encoding, Tokenizer};
use super::transforms::Transform;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// How a `DataLoader` batches, orders, transforms and prefetches.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Shuffle every epoch (else the data set's order).
    pub shuffle: bool,
    /// Drop the last batch when it would be smaller than `batch_size`.
    pub drop_last: bool,
    /// Seeds the shuffle and the augmentations.
    pub seed: u64,
    /// Worker threads building batches; 0 builds them in the calling thread.
    pub workers: usize,
    /// Finished batches each worker may hold ahead of the consumer (at least 1).
    pub prefetch: usize,
    /// Applied to every sample.
    pub transform: Transform,
}

impl Default for LoaderConfig {
    /// Batch 128, shuffled, seed 0, 2 workers prefetching 2 batches each, `ToTensor` only.
    fn default() -> Self {
        LoaderConfig {
            batch_size: 128,
            shuffle: true,
            drop_last: false,
            seed: 0,
            workers: 2,
            prefetch: 2,
            transform: Transform::new(),
        }
    }
}

/// One batch: the model's inputs (images `[B, C, H, W]` F32, or text), the labels (`[B]`
/// I64 class indices; `[B, L]` I64 for masked-LM targets, -100 where no loss is taken), and
/// which samples they are.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The model's inputs.
    pub inputs: Inputs,
    /// The targets: class indices `[B]` I64, or `[B, L]` token ids for masked-LM (-100: no
    /// target).
    pub labels: Tensor,
    /// The data set indices of the batch's samples, in batch order.
    pub indices: Vec<usize>,
}

impl Batch {
    /// The images of an image batch; an error for text.
    pub fn images(&self) -> Result<&Tensor> {
        self.inputs.images()
    }
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }
    /// True when the batch holds no samples.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The same batch on `device` (its inputs and labels uploaded; itself when there
    /// already): what a training step on a GPU model reads.
    pub fn to_device(&self, device: crate::Device) -> Result<Batch> {
        Ok(Batch {
            inputs: self.inputs.to_device(device)?,
            labels: self.labels.to_device(device)?,
            indices: self.indices.clone(),
        })
    }

    /// The samples at `rows` of this batch, in that order (a micro-batch for gradient
    /// accumulation). A text batch keeps its padded length.
    pub fn select_rows(&self, rows: &[usize]) -> Result<Batch> {
        if let Some(&r) = rows.iter().find(|&&r| r >= self.len()) {
            return Err(Error::Index {
                op: "Batch::select_rows",
                index: r as i64,
                size: self.len(),
            });
        }
        let idx = Tensor::from_vec(rows.iter().map(|&r| r as i64).collect(), &[rows.len()])?
            .to_device(self.labels.device())?;
        let pick = |t: &Tensor| t.index_select(0, &idx);
        let inputs = match &self.inputs {
            Inputs::Images(x) => Inputs::Images(pick(x)?),
            Inputs::Text(t) => Inputs::Text(TextInputs {
                input_ids: pick(&t.input_ids)?,
                attention_mask: pick(&t.attention_mask)?,
                token_type_ids: pick(&t.token_type_ids)?,
            }),
        };
        Ok(Batch {
            inputs,
            labels: pick(&self.labels)?,
            indices: rows.iter().map(|&r| self.indices[r]).collect(),
        })
    }
}

/// A batch as a worker builds it: plain vectors, made into tensors by the consumer.
struct RawBatch {
    data: RawData,
    indices: Vec<usize>,
}

enum RawData {
    Images {
        images: Vec<f32>,
        labels: Vec<i64>,
        /// `[C, H, W]`.
        shape: [usize; 3],
    },
    Text(RawText),
}

/// Batches of a data set, epoch by epoch (see the module docs for the guarantees).
#[derive(Clone)]
pub struct DataLoader {
    source: Source,
    config: LoaderConfig,
    shard: Shard,
}

/// Which share of every epoch a loader yields ([`DataLoader::sharded`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// The number of ranks sharing the data.
    pub world: usize,
    /// Pad the epoch's order (repeating its start) to a multiple of `world`, so that every
    /// rank gets the same number of samples and batches (training); without it, rank r gets
    /// the samples r, r + world, ... of the order and nothing twice (evaluation).
    pub pad: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            rank: 0,
            world: 1,
            pad: false,
        }
    }
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("DataLoader");
        d.field("samples", &self.len())
            .field("batch_size", &self.config.batch_size)
            .field("num_batches", &self.num_batches());
        match &self.source {
            Source::Images { sample_shape, .. } => d.field("sample_shape", sample_shape),
            Source::Text(t) => d.field("text", &t.config),
        };
        d.finish()
    }
}

/// What a loader batches.
#[derive(Clone)]
enum Source {
    Images {
        dataset: Arc<dyn Dataset>,
        /// `[C, H, W]` of every sample after the transform.
        sample_shape: [usize; 3],
    },
    Text(Arc<TextSource>),
}

impl DataLoader {
    /// Checks the configuration against the data set (batch size, the transform on its
    /// image shape).
    pub fn new(dataset: Arc<dyn Dataset>, config: LoaderConfig) -> Result<DataLoader> {
        if config.batch_size == 0 {
            return Err(Error::arg("DataLoader", "batch_size 0"));
        }
        let sample_shape = config.transform.output_shape(dataset.image_shape())?;
        Ok(DataLoader {
            source: Source::Images {
                dataset,
                sample_shape,
            },
            config,
            shard: Shard::default(),
        })
    }

    /// Batches of tokenised text: every sample of `dataset` is tokenised here (on all
    /// cores), so a text the tokenizer rejects, a label out of range or a missing label
    /// (classification without `text.mlm`) is an error now, not mid-epoch. Batches hold
    /// `Inputs::Text` (`[B, L]` I64, L the longest sequence of the batch, padded with the
    /// pad id) and `[B]` class labels, or `[B, L]` masked-LM targets with `text.mlm`.
    pub fn text(
        dataset: Arc<dyn TextDataset>,
        tokenizer: Arc<Tokenizer>,
        config: LoaderConfig,
        text: TextConfig,
    ) -> Result<DataLoader> {
        if config.batch_size == 0 {
            return Err(Error::arg("DataLoader", "batch_size 0"));
        }
        let source = TextSource::new(dataset, tokenizer, text)?;
        Ok(DataLoader {
            source: Source::Text(Arc::new(source)),
            config,
            shard: Shard::default(),
        })
    }

    /// This loader restricted to one rank's share of every epoch (PyTorch's
    /// `DistributedSampler`): the epoch's order is computed as before, from (seed, epoch)
    /// alone and so the same on every rank, then rank r takes its entries r, r + world,
    /// r + 2·world, ... With the same seed, batch `k` of the N ranks together holds exactly
    /// the samples of batch `k` of one loader with N times the batch size, rank r's being
    /// that batch's rows r, r + N, ... Augmentations still draw from (seed, epoch, sample),
    /// so a sample looks the same whichever rank loads it.
    pub fn sharded(mut self, shard: Shard) -> Result<DataLoader> {
        if shard.world == 0 || shard.rank >= shard.world {
            return Err(Error::arg(
                "DataLoader::sharded",
                format!("rank {} of {} ranks", shard.rank, shard.world),
            ));
        }
        self.shard = shard;
        Ok(self)
    }

    /// The share of the data this loader yields (rank 0 of 1 when not sharded).
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Samples this loader yields per epoch before `drop_last`: the data set's, or this
    /// rank's share of them.
    fn epoch_len(&self) -> usize {
        let (n, s) = (self.len(), self.shard);
        if s.world == 1 {
            n
        } else if s.pad {
            n.div_ceil(s.world)
        } else {
            n / s.world + usize::from(s.rank < n % s.world)
        }
    }

    /// The image data set; `None` for a text loader.
    pub fn dataset(&self) -> Option<&Arc<dyn Dataset>> {
        match &self.source {
            Source::Images { dataset, .. } => Some(dataset),
            Source::Text(_) => None,
        }
    }

    /// The text data set; `None` for an image loader.
    pub fn text_dataset(&self) -> Option<&Arc<dyn TextDataset>> {
        match &self.source {
            Source::Images { .. } => None,
            Source::Text(t) => Some(&t.dataset),
        }
    }

    /// The tokenizer of a text loader.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        match &self.source {
            Source::Images { .. } => None,
            Source::Text(t) => Some(&t.tokenizer),
        }
    }

    /// The text settings of a text loader.
    pub fn text_config(&self) -> Option<&TextConfig> {
        match &self.source {
            Source::Images { .. } => None,
            Source::Text(t) => Some(&t.config),
        }
    }

    /// Every sample's tokens (text loaders), index = data set index.
    pub fn encodings(&self) -> Option<&[Encoding]> {
        match &self.source {
            Source::Images { .. } => None,
            Source::Text(t) => Some(&t.encodings),
        }
    }

    /// True for a loader over a text data set (batches of `Inputs::Text`).
    pub fn is_text(&self) -> bool {
        matches!(self.source, Source::Text(_))
    }

    /// Whether the loader produces masked-LM targets.
    pub fn is_mlm(&self) -> bool {
        matches!(&self.source, Source::Text(t) if t.config.mlm.is_some())
    }

    /// The loader's settings (batch size, shuffling, seed, workers, transform).
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Samples in the data set.
    pub fn len(&self) -> usize {
        match &self.source {
            Source::Images { dataset, .. } => dataset.len(),
            Source::Text(t) => t.encodings.len(),
        }
    }

    /// True when the data set holds no samples (the loader then yields no batches).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The range of the batches' labels: the data set's classes, or for masked-LM the
    /// vocabulary (targets are token ids; -100 marks no target).
    pub fn num_classes(&self) -> usize {
        match &self.source {
            Source::Images { dataset, .. } => dataset.num_classes(),
            Source::Text(t) if t.config.mlm.is_some() => t.tokenizer.vocab_size(),
            Source::Text(t) => t.dataset.num_classes(),
        }
    }

    /// The data set's class names (empty for masked-LM, whose targets are token ids).
    pub fn class_names(&self) -> &[String] {
        match &self.source {
            Source::Images { dataset, .. } => dataset.class_names(),
            Source::Text(t) if t.config.mlm.is_some() => &[],
            Source::Text(t) => t.dataset.class_names(),
        }
    }

    /// `[C, H, W]` of the batches' images; `None` for text.
    pub fn sample_shape(&self) -> Option<[usize; 3]> {
        match &self.source {
            Source::Images { sample_shape, .. } => Some(*sample_shape),
            Source::Text(_) => None,
        }
    }

    /// Batches per epoch.
    pub fn num_batches(&self) -> usize {
        let (n, b) = (self.epoch_len(), self.config.batch_size);
        if self.config.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Samples per epoch (fewer than the data set's when `drop_last` drops some).
    pub fn samples_per_epoch(&self) -> usize {
        self.epoch_len()
            .min(self.num_batches() * self.config.batch_size)
    }

    /// The order of the data set's indices in `epoch`, a function of (seed, epoch) only;
    /// batch `k` is `order[k * batch_size..]`, `batch_size` long (the last may be shorter).
    ///
    /// With `TextConfig::bucket`, the shuffled order is then sorted by token count inside
    /// runs of `BUCKET_CHUNK_BATCHES` batches, and the full batches are shuffled again so
    /// that short and long batches alternate; the last, smaller batch stays last.
    ///
    /// A sharded loader takes its rank's entries of that order (bucketed in runs of the
    /// global batch, `batch_size · world`), after padding it when the shard pads.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        if self.config.shuffle {
            let mut rng = Generator::new(mix_seed(&[self.config.seed, SHUFFLE_TAG, epoch]));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        if let Source::Text(t) = &self.source {
            if t.config.bucket {
                t.bucket(
                    &mut order,
                    self.config.batch_size * self.shard.world,
                    self.config.seed,
                    epoch,
                    self.config.shuffle,
                );
            }
        }
        let s = self.shard;
        if s.world > 1 {
            if s.pad && !order.is_empty() {
                let total = self.epoch_len() * s.world;
                let mut i = 0;
                while order.len() < total {
                    order.push(order[i]);
                    i += 1;
                }
            }
            order = order.into_iter().skip(s.rank).step_by(s.world).collect();
        }
        order
    }

    /// The batches of `epoch` (0-based), as an iterator of `Result<Batch>`.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        self.epoch_from(epoch, 0)
    }

    /// The batches of `epoch` from batch `first` on: what a run resumed in the middle of
    /// an epoch still has to see, identical to the rest of an uninterrupted epoch.
    pub fn epoch_from(&self, epoch: u64, first: usize) -> Epoch {
        let kind = match &self.source {
            Source::Images {
                dataset,
                sample_shape,
            } => Kind::Images {
                dataset: dataset.clone(),
                transform: self.config.transform.clone(),
                table: self.config.transform.float_table(sample_shape[0]),
                sample_shape: *sample_shape,
            },
            Source::Text(t) => Kind::Text(t.clone()),
        };
        let job = Arc::new(Job {
            kind,
            order: self.order(epoch),
            batch_size: self.config.batch_size,
            seed: self.config.seed,
            epoch,
            stop: AtomicBool::new(false),
        });
        let end = self.num_batches();
        let first = first.min(end);
        let workers = self.config.workers.min(end - first);
        let mut queues = Vec::with_capacity(workers);
        let mut handles = Vec::with_capacity(workers);
        let mut spawn_error = None;
        for w in 0..workers {
            let (tx, rx) = sync_channel(self.config.prefetch.max(1));
            let job = job.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("hemi-loader-{w}"))
                .spawn(move || {
                    for k in (first + w..end).step_by(workers) {
                        if job.stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let batch = job.build(k);
                        let failed = batch.is_err();
                        // A send fails only when the consumer has gone: nothing left to do.
                        if tx.send(batch).is_err() || failed {
                            break;
                        }
                    }
                });
            match spawned {
                Ok(h) => {
                    queues.push(rx);
                    handles.push(Some(h));
                }
                Err(e) => {
                    spawn_error = Some(Error::Msg(format!(
                        "DataLoader: cannot start worker thread {w}: {e}"
                    )));
                    break;
                }
            }
        }
        Epoch {
            job,
            first,
            next: first,
            end,
            queues,
            handles,
            error: spawn_error,
            done: false,
        }
    }
}

const SHUFFLE_TAG: u64 = 0x5348_5546; // "SHUF"
const AUGMENT_TAG: u64 = 0x4155_474d; // "AUGM"

/// What every worker of one epoch shares.
struct Job {
    kind: Kind,
    order: Vec<usize>,
    batch_size: usize,
    seed: u64,
    epoch: u64,
    stop: AtomicBool,
}

enum Kind {
    Images {
        dataset: Arc<dyn Dataset>,
        transform: Transform,
        table: Vec<[f32; 256]>,
        sample_shape: [usize; 3],
    },
    Text(Arc<TextSource>),
}

impl Job {
    fn range(&self, k: usize) -> Range<usize> {
        k * self.batch_size..((k + 1) * self.batch_size).min(self.order.len())
    }

    /// Loads, transforms and collates batch `k`.
    fn build(&self, k: usize) -> Result<RawBatch> {
        let indices = self.order[self.range(k)].to_vec();
        let data = match &self.kind {
            Kind::Images {
                dataset,
                transform,
                table,
                sample_shape,
            } => self.build_images(&indices, dataset, transform, table, *sample_shape)?,
            Kind::Text(t) => RawData::Text(t.build(&indices, self.seed, self.epoch)?),
        };
        Ok(RawBatch { data, indices })
    }

    fn build_images(
        &self,
        indices: &[usize],
        dataset: &Arc<dyn Dataset>,
        transform: &Transform,
        table: &[[f32; 256]],
        sample_shape: [usize; 3],
    ) -> Result<RawData> {
        let per: usize = sample_shape.iter().product();
        let mut images = vec![0f32; per * indices.len()];
        let mut labels = Vec::with_capacity(indices.len());
        for (&i, out) in indices.iter().zip(images.chunks_exact_mut(per)) {
            let sample = dataset.get(i)?;
            if sample.label >= dataset.num_classes() {
                return Err(Error::Index {
                    op: "DataLoader: sample label",
                    index: sample.label as i64,
                    size: dataset.num_classes(),
                });
            }
            let mut rng = Generator::new(mix_seed(&[self.seed, AUGMENT_TAG, self.epoch, i as u64]));
            let shape = transform.output_shape(sample.image.shape())?;
            if shape != sample_shape {
                return Err(Error::shape(
                    "DataLoader",
                    format!(
                        "sample {i} is {:?} after the transform, the batch's samples are {:?}",
                        shape, sample_shape
                    ),
                ));
            }
            transform.apply_into(&sample.image, &mut rng, table, out)?;
            labels.push(sample.label as i64);
        }
        Ok(RawData::Images {
            images,
            labels,
            shape: sample_shape,
        })
    }
}

/// The batches of one epoch, in order. Dropping it early stops and joins its workers.
pub struct Epoch {
    job: Arc<Job>,
    first: usize,
    next: usize,
    end: usize,
    queues: Vec<Receiver<Result<RawBatch>>>,
    handles: Vec<Option<JoinHandle<()>>>,
    error: Option<Error>,
    done: bool,
}

impl Epoch {
    /// Batches not yet returned.
    pub fn remaining(&self) -> usize {
        if self.done {
            0
        } else {
            self.end - self.next
        }
    }

    fn next_raw(&mut self) -> Result<RawBatch> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let k = self.next;
        if self.queues.is_empty() {
            return self.job.build(k);
        }
        // Workers were dealt batches first, first + 1, ... round-robin.
        let w = (k - self.first) % self.queues.len();
        match self.queues[w].recv() {
            Ok(batch) => batch,
            Err(_) => {
                // The worker hung up without sending batch k: it panicked.
                let why = match self.handles[w].take().map(JoinHandle::join) {
                    Some(Err(panic)) => panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "unknown panic".to_string()),
                    _ => "stopped early".to_string(),
                };
                Err(Error::Msg(format!(
                    "DataLoader: worker {w} failed before batch {k}: {why}"
                )))
            }
        }
    }
}

impl Iterator for Epoch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.done || self.next >= self.end {
            return None;
        }
        let raw = self.next_raw();
        self.next += 1;
        let batch = raw.and_then(|raw| {
            let b = raw.indices.len();
            let (inputs, labels) = match raw.data {
                RawData::Images {
                    images,
                    labels,
                    shape: [c, h, w],
                } => (
                    Inputs::Images(Tensor::from_f32_vec(images, &[b, c, h, w], DType::F32)?),
                    Tensor::from_vec(labels, &[b])?,
                ),
                RawData::Text(t) => {
                    let shape = [b, t.seq_len];
                    let labels = if t.mlm {
                        Tensor::from_vec(t.labels, &shape)?
                    } else {
                        Tensor::from_vec(t.labels, &[b])?
                    };
                    let inputs = Inputs::Text(TextInputs {
                        input_ids: Tensor::from_vec(t.input_ids, &shape)?,
                        attention_mask: Tensor::from_vec(t.attention_mask, &shape)?,
                        token_type_ids: Tensor::from_vec(t.token_type_ids, &shape)?,
                    });
                    (inputs, labels)
                }
            };
            Ok(Batch {
                inputs,
                labels,
                indices: raw.indices,
            })
        });
        if batch.is_err() {
            self.done = true;
            self.job.stop.store(true, Ordering::Relaxed);
        }
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining()))
    }
}

impl Epoch {
    /// The same batches on `device`. On the CPU they are this epoch's own; on another
    /// device one thread uploads batch `k + 1` while the caller trains on batch `k` (the
    /// hand-over is a rendezvous, so exactly one batch waits on the device). The batches
    /// are bit for bit those of `Batch::to_device` in the caller's thread: an upload copies
    /// the values, and the device's queue orders the copy before every later kernel.
    pub fn to_device(self, device: crate::Device) -> OnDevice {
        if device == crate::Device::Cpu {
            return OnDevice(Uploads::Here(self));
        }
        let (tx, rx) = sync_channel(0);
        // The thread owns the epoch: dropping `OnDevice` hangs up, the thread's next send
        // fails, and it drops the epoch (which stops and joins the loader's workers).
        let spawned = std::thread::Builder::new()
            .name("hemi-upload".into())
            .spawn(move || {
                for batch in self {
                    let batch = batch.and_then(|b| b.to_device(device));
                    let failed = batch.is_err();
                    if tx.send(batch).is_err() || failed {
                        break;
                    }
                }
            });
        OnDevice(match spawned {
            Ok(h) => Uploads::Ahead {
                rx: Some(rx),
                handle: Some(h),
                device,
            },
            Err(e) => Uploads::Failed(Some(Error::Msg(format!(
                "DataLoader: cannot start the thread uploading batches to {device}: {e}"
            )))),
        })
    }
}

/// An epoch's batches on a device (`Epoch::to_device`), in order; an error ends it.
pub struct OnDevice(Uploads);

enum Uploads {
    /// On the CPU: the epoch's own batches.
    Here(Epoch),
    /// Uploaded one batch ahead by a background thread.
    Ahead {
        rx: Option<Receiver<Result<Batch>>>,
        handle: Option<JoinHandle<()>>,
        device: crate::Device,
    },
    /// The thread could not start: this error, then nothing.
    Failed(Option<Error>),
}

impl Iterator for OnDevice {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        let (rx, handle, device) = match &mut self.0 {
            Uploads::Here(epoch) => return epoch.next(),
            Uploads::Failed(e) => return e.take().map(Err),
            Uploads::Ahead { rx, handle, device } => (rx, handle, *device),
        };
        let got = rx.as_ref()?.recv();
        match got {
            Ok(batch) => {
                if batch.is_err() {
                    rx.take();
                }
                Some(batch)
            }
            Err(_) => {
                // The thread hung up: the epoch ended, or the thread panicked.
                rx.take();
                match handle.take().map(JoinHandle::join) {
                    Some(Err(panic)) => {
                        let why = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".to_string());
                        Some(Err(Error::Msg(format!(
                            "DataLoader: the thread uploading batches to {device} failed: {why}"
                        ))))
                    }
                    _ => None,
                }
            }
        }
    }
}

impl Drop for OnDevice {
    fn drop(&mut self) {
        if let Uploads::Ahead { rx, handle, .. } = &mut self.0 {
            // Hanging up makes the thread's pending send fail; it then drops the epoch.
            drop(rx.take());
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        self.job.stop.store(true, Ordering::Relaxed);
        // Dropping the receivers makes a worker blocked on a full queue fail its send and exit.
        self.queues.clear();
        for h in self.handles.iter_mut().filter_map(Option::take) {
            let _ = h.join();
        }
    }
}
