//! Data sets, transforms and the DataLoader.
//!
//! Image sources, each a `Dataset` of `u8` images with class labels:
//! - `Cifar10`: CIFAR-10's official binary batches (`cifar10.rs`);
//! - `ImageFolder`: torchvision-style `root/<class>/*.jpg|png` folders (`image_folder.rs`);
//! - `MnistKind`: MNIST and Fashion-MNIST IDX files, raw or gzipped (`idx.rs`);
//! - `Synthetic`: a seeded 10-class set of 32x32 RGB images for running offline
//!   (`synthetic.rs`).
//!
//! `Transform` (`transforms.rs`) augments a sample and converts it to float; `DataLoader`
//! (`loader.rs`) turns a data set into shuffled, transformed `[B, C, H, W]` F32 batches on
//! worker threads.
//!
//! Text: `Tokenizer` (`tokenizer.rs`) wraps Hugging Face's `tokenizers` for a
//! `tokenizer.json`; `TextClassificationDataset` reads labelled CSV/TSV files and
//! `TextCorpus` one example per line (`text.rs`), both `TextDataset`s; `DataLoader::text`
//! makes padded `Inputs::Text` batches with class or masked-LM labels (`text_batch.rs`).
//!
//! Malformed files are `Error::Data` naming the file and what is wrong.
//!
//! Every reader treats its files as hostile: it opens only regular files (a FIFO would
//! block forever), checks every size product for overflow, and refuses a size the file
//! cannot hold before allocating for it. Each parser has an in-memory entry point
//! (`Cifar10::parse`, `parse_idx_images`, `parse_idx_labels`, `parse_image`) that the
//! file readers share and the fuzz targets in `fuzz/` call.

mod cifar10;
mod dataset;
mod decode;
#[doc(hidden)]
pub mod fetch;
mod idx;
mod image_folder;
mod inputs;
mod loader;
mod synthetic;
mod text;
mod text_batch;
mod tokenizer;
mod transforms;

pub use cifar10::{Cifar10, CIFAR10_CLASSES};
pub use dataset::{Dataset, Image, InMemoryDataset, Sample, Split};
pub use fetch::{
    cache_dir, fetch_archive, fetch_cifar10, fetch_minilm, fetch_minilm_from, find_or_fetch_minilm,
    is_minilm_dir, unpack_cifar10, CIFAR10_BYTES, CIFAR10_SHA256, CIFAR10_URL, MINILM_BYTES,
    MINILM_FILES, MINILM_NAME, MINILM_SHA256, MINILM_URL,
};
pub use idx::{
    load_idx, parse_idx_images, parse_idx_labels, read_idx_images, read_idx_labels, IdxImages,
    MnistKind, IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC,
};
pub use image_folder::{parse_image, ImageFolder, IMAGE_EXTENSIONS, MAX_IMAGE_SIDE};
pub use inputs::{Inputs, TextInputs};
pub use loader::{Batch, DataLoader, Epoch, LoaderConfig, OnDevice, Shard};
pub use synthetic::{Synthetic, SYNTHETIC_CLASSES};
pub use text::{
    Column, TextClassificationDataset, TextColumns, TextCorpus, TextDataset, TextSample,
};
pub use text_batch::{MlmConfig, TextConfig, BUCKET_CHUNK_BATCHES};
pub use tokenizer::{Encoding, Tokenizer};
pub use transforms::{crop_padded, hflip, random_crop, Augment, Transform};
