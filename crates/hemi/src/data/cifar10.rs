//! CIFAR-10 in its official binary layout (cifar-10-binary.tar.gz): `data_batch_1.bin` ..
//! `data_batch_5.bin` are the training set, `test_batch.bin` the test set. Each file is a
//! run of 3073-byte records: one label byte (0..9), then the 32x32 image as 1024 red, 1024
//! green and 1024 blue bytes, each plane row-major — already the CHW layout of `Image`.

use std::path::{Path, PathBuf};

use super::dataset::{check_regular_file, data_error, file_kind, io_error, InMemoryDataset, Split};
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
    /// `test_batch.bin` (so a caller can fall back to other data). Prefer `probe`, which
    /// also tells a partial copy from no copy.
    pub fn locate(data_dir: &Path) -> Option<PathBuf> {
        [
            data_dir.to_path_buf(),
            data_dir.join("cifar-10-batches-bin"),
        ]
        .into_iter()
        .find(|d| d.join("test_batch.bin").is_file())
    }

    /// Like `locate`, but strict about partial copies: `Ok(Some(dir))` when `data_dir` or
    /// its `cifar-10-batches-bin/` holds all six batch files (`data_batch_1..5.bin`,
    /// `test_batch.bin`), `Ok(None)` when neither holds any of them (the caller may fall
    /// back to other data), and an error naming the directory and the missing files when
    /// some but not all are there, or when one is not a regular file — a half-copied or
    /// half-extracted data set must not silently turn into a run on other data.
    pub fn probe(data_dir: &Path) -> Result<Option<PathBuf>> {
        let all: Vec<&str> = Self::file_names(Split::Train)
            .iter()
            .chain(Self::file_names(Split::Test))
            .copied()
            .collect();
        for dir in [
            data_dir.to_path_buf(),
            data_dir.join("cifar-10-batches-bin"),
        ] {
            let mut present = Vec::new();
            let mut missing = Vec::new();
            for name in &all {
                let path = dir.join(name);
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => present.push(*name),
                    Ok(m) => {
                        return Err(data_error(
                            &path,
                            format!(
                                "not a regular file ({}): expected a CIFAR-10 batch file",
                                file_kind(&m.file_type())
                            ),
                        ))
                    }
                    Err(_) => missing.push(*name),
                }
            }
            if missing.is_empty() {
                return Ok(Some(dir));
            }
            if !present.is_empty() {
                return Err(data_error(
                    &dir,
                    format!(
                        "incomplete CIFAR-10 binary data set: missing {} (found {}); \
                         expected all of {}",
                        missing.join(", "),
                        present.join(", "),
                        all.join(", ")
                    ),
                ));
            }
        }
        Ok(None)
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
            let len = check_regular_file(
                &path,
                &format!(
                    "CIFAR-10 {} batch {name}: records of {} bytes (1 label byte + 1024 R, \
                     1024 G, 1024 B bytes)",
                    split.name(),
                    Self::RECORD_BYTES
                ),
            )?;
            // Refuse an oversized file before reading it into memory.
            let max = (Self::RECORDS_PER_FILE * Self::RECORD_BYTES) as u64;
            if len > max {
                return Err(data_error(
                    &path,
                    format!(
                        "size {len} ({} records of {} bytes and {} bytes more) is more than \
                         the {max} bytes ({} records) of a CIFAR-10 batch file",
                        len / Self::RECORD_BYTES as u64,
                        Self::RECORD_BYTES,
                        len % Self::RECORD_BYTES as u64,
                        Self::RECORDS_PER_FILE,
                    ),
                ));
            }
            let bytes = std::fs::read(&path).map_err(|e| io_error(&path, e))?;
            Self::parse_batch(&path, &bytes, &mut pixels, &mut labels)?;
        }
        InMemoryDataset::new([3, 32, 32], pixels, labels, classes)
    }

    /// One batch file's bytes as a data set with CIFAR-10's class names (the in-memory
    /// entry point of `parse_batch`; errors name the source `<bytes>`).
    pub fn parse(bytes: &[u8]) -> Result<InMemoryDataset> {
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        Self::parse_batch(Path::new("<bytes>"), bytes, &mut pixels, &mut labels)?;
        let classes = CIFAR10_CLASSES.iter().map(|s| s.to_string()).collect();
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
        // n <= RECORDS_PER_FILE, so this cannot overflow; checked all the same.
        let need = n
            .checked_mul(Self::IMAGE_BYTES)
            .ok_or_else(|| data_error(path, format!("{n} records of {} bytes overflow", rec)))?;
        pixels.reserve(need);
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
        if !meta.exists() {
            return Ok(CIFAR10_CLASSES.iter().map(|s| s.to_string()).collect());
        }
        let len = check_regular_file(&meta, "CIFAR-10's class names, one per line")?;
        if len > 4096 {
            return Err(data_error(
                &meta,
                format!("size {len}: too large for 10 class names, one per line"),
            ));
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
