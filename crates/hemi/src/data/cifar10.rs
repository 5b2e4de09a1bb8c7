//! CIFAR-10 in its official binary layout (cifar-10-binary.tar.gz): `data_batch_1.bin` ..
//! `data_batch_5.bin` are the training set, `test_batch.bin` the test set. Each file is a
//! run of 3073-byte records: one label byte (0..9), then the 32x32 image as 1024 red, 1024
//! green and 1024 blue bytes, each plane row-major — already the CHW layout of `Image`.

use std::path::{Path, PathBuf};

use super::dataset::{data_error, io_error, read_file, InMemoryDataset, Split};
use crate::error::Result;

/// CIFAR-10's class names in label order 0..9.
pub const CIFAR10_CLASSES: [&str; 10] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
];

/// The loader of CIFAR-10's binary batch files.
pub struct Cifar10;

impl Cifar10 {
    /// Bytes of one image: 3 planes of 32x32.
    pub const IMAGE_BYTES: usize = 3 * 32 * 32;
    /// Bytes of one record: the label byte and the image.
    pub const RECORD_BYTES: usize = 1 + Self::IMAGE_BYTES;
    /// Records in one official batch file; a file holding more is not CIFAR-10.
    pub const RECORDS_PER_FILE: usize = 10_000;

    /// The batch files of `split`, in the order their records are concatenated.
    pub fn file_names(split: Split) -> &'static [&'static str] {
        match split {
            Split::Train => &[
                "data_batch_1.bin",
                "data_batch_2.bin",
                "data_batch_3.bin",
                "data_batch_4.bin",
                "data_batch_5.bin",
            ],
            Split::Test => &["test_batch.bin"],
        }
    }

    /// The directory holding the batch files under `data_dir`: `data_dir` itself, or the
    /// official archive's `cifar-10-batches-bin/` inside it. `None` when neither has
    /// `test_batch.bin` (so a caller can fall back to other data).
    pub fn locate(data_dir: &Path) -> Option<PathBuf> {
        [
            data_dir.to_path_buf(),
            data_dir.join("cifar-10-batches-bin"),
        ]
        .into_iter()
        .find(|d| d.join("test_batch.bin").is_file())
    }

    /// Loads `split` from the batch files in `dir` (see `locate`). Class names come from
    /// `batches.meta.txt` when the directory has one (the official archive does), else
    /// `CIFAR10_CLASSES`.
    pub fn load(dir: &Path, split: Split) -> Result<InMemoryDataset> {
        if !dir.is_dir() {
            return Err(data_error(
                dir,
                format!(
                    "directory not found: expected CIFAR-10's binary batches ({}) here",
                    Self::file_names(Split::Train)
                        .iter()
                        .chain(Self::file_names(Split::Test))
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let classes = Self::class_names(dir)?;
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
        for name in Self::file_names(split) {
            let path = dir.join(name);
            let bytes = read_file(
                &path,
                &format!(
                    "CIFAR-10 {} batch {name}: records of {} bytes (1 label byte + 1024 R, \
                     1024 G, 1024 B bytes)",
                    split.name(),
                    Self::RECORD_BYTES
                ),
            )?;
            Self::parse_batch(&path, &bytes, &mut pixels, &mut labels)?;
        }
        InMemoryDataset::new([3, 32, 32], pixels, labels, classes)
    }

    /// Checks one batch file's bytes and appends its images and labels.
    pub fn parse_batch(
        path: &Path,
        bytes: &[u8],
        pixels: &mut Vec<u8>,
        labels: &mut Vec<u32>,
    ) -> Result<()> {
        let rec = Self::RECORD_BYTES;
        if bytes.is_empty() {
            return Err(data_error(
                path,
                format!("empty file: expected records of {rec} bytes"),
            ));
        }
        if !bytes.len().is_multiple_of(rec) {
            return Err(data_error(
                path,
                format!(
                    "size {} is not a multiple of the {rec}-byte record (1 label byte + 3072 \
                     pixel bytes): truncated or not a CIFAR-10 batch ({} whole records and {} \
                     extra bytes)",
                    bytes.len(),
                    bytes.len() / rec,
                    bytes.len() % rec
                ),
            ));
        }
        let n = bytes.len() / rec;
        if n > Self::RECORDS_PER_FILE {
            return Err(data_error(
                path,
                format!(
                    "size {} holds {n} records, more than the {} of a CIFAR-10 batch file",
                    bytes.len(),
                    Self::RECORDS_PER_FILE
                ),
            ));
        }
        pixels.reserve(n * Self::IMAGE_BYTES);
        labels.reserve(n);
        for (i, record) in bytes.chunks_exact(rec).enumerate() {
            let label = record[0];
            if label as usize >= CIFAR10_CLASSES.len() {
                return Err(data_error(
                    path,
                    format!(
                        "record {i} (byte offset {}): label {label} out of range 0..=9",
                        i * rec
                    ),
                ));
            }
            labels.push(label as u32);
            pixels.extend_from_slice(&record[1..]);
        }
        Ok(())
    }

    fn class_names(dir: &Path) -> Result<Vec<String>> {
        let meta = dir.join("batches.meta.txt");
        if !meta.is_file() {
            return Ok(CIFAR10_CLASSES.iter().map(|s| s.to_string()).collect());
        }
        let text = std::fs::read_to_string(&meta).map_err(|e| io_error(&meta, e))?;
        let names: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
        if names.len() != CIFAR10_CLASSES.len() {
            return Err(data_error(
                &meta,
                format!("{} class names, expected 10 (one per line)", names.len()),
            ));
        }
        Ok(names)
    }
}
