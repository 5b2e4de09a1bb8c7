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

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::dataset::Dataset;
use super::inputs::Inputs;
use super::synthetic::mix_seed;
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
    pub inputs: Inputs,
    pub labels: Tensor,
    /// The data set indices of the batch's samples, in batch order.
    pub indices: Vec<usize>,
}

impl Batch {
    /// The images of an image batch; an error for text.
    pub fn images(&self) -> Result<&Tensor> {
        self.inputs.images()
    }
    pub fn len(&self) -> usize {
        self.indices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// A batch as a worker builds it: plain vectors, made into tensors by the consumer.
struct RawBatch {
    images: Vec<f32>,
    labels: Vec<i64>,
    indices: Vec<usize>,
}

/// Batches of a data set, epoch by epoch (see the module docs for the guarantees).
#[derive(Clone)]
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    config: LoaderConfig,
    /// `[C, H, W]` of every sample after the transform.
    sample_shape: [usize; 3],
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
            dataset,
            config,
            sample_shape,
        })
    }

    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// `[C, H, W]` of the batches' images.
    pub fn sample_shape(&self) -> [usize; 3] {
        self.sample_shape
    }

    /// Batches per epoch.
    pub fn num_batches(&self) -> usize {
        let (n, b) = (self.dataset.len(), self.config.batch_size);
        if self.config.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Samples per epoch (fewer than the data set's when `drop_last` drops some).
    pub fn samples_per_epoch(&self) -> usize {
        self.dataset
            .len()
            .min(self.num_batches() * self.config.batch_size)
    }

    /// The order of the data set's indices in `epoch`, a function of (seed, epoch) only.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        if self.config.shuffle {
            let mut rng = Generator::new(mix_seed(&[self.config.seed, SHUFFLE_TAG, epoch]));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
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
        let job = Arc::new(Job {
            dataset: self.dataset.clone(),
            transform: self.config.transform.clone(),
            table: self.config.transform.float_table(self.sample_shape[0]),
            sample_shape: self.sample_shape,
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
    dataset: Arc<dyn Dataset>,
    transform: Transform,
    table: Vec<[f32; 256]>,
    sample_shape: [usize; 3],
    order: Vec<usize>,
    batch_size: usize,
    seed: u64,
    epoch: u64,
    stop: AtomicBool,
}

impl Job {
    fn range(&self, k: usize) -> Range<usize> {
        k * self.batch_size..((k + 1) * self.batch_size).min(self.order.len())
    }

    /// Loads, transforms and collates batch `k`.
    fn build(&self, k: usize) -> Result<RawBatch> {
        let indices = self.order[self.range(k)].to_vec();
        let per: usize = self.sample_shape.iter().product();
        let mut images = vec![0f32; per * indices.len()];
        let mut labels = Vec::with_capacity(indices.len());
        for (&i, out) in indices.iter().zip(images.chunks_exact_mut(per)) {
            let sample = self.dataset.get(i)?;
            if sample.label >= self.dataset.num_classes() {
                return Err(Error::Index {
                    op: "DataLoader: sample label",
                    index: sample.label as i64,
                    size: self.dataset.num_classes(),
                });
            }
            let mut rng = Generator::new(mix_seed(&[self.seed, AUGMENT_TAG, self.epoch, i as u64]));
            let shape = self.transform.output_shape(sample.image.shape())?;
            if shape != self.sample_shape {
                return Err(Error::shape(
                    "DataLoader",
                    format!(
                        "sample {i} is {:?} after the transform, the batch's samples are {:?}",
                        shape, self.sample_shape
                    ),
                ));
            }
            self.transform
                .apply_into(&sample.image, &mut rng, &self.table, out)?;
            labels.push(sample.label as i64);
        }
        Ok(RawBatch {
            images,
            labels,
            indices,
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
            let b = raw.labels.len();
            let [c, h, w] = self.job.sample_shape;
            Ok(Batch {
                inputs: Inputs::Images(Tensor::from_f32_vec(
                    raw.images,
                    &[b, c, h, w],
                    DType::F32,
                )?),
                labels: Tensor::from_vec(raw.labels, &[b])?,
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
