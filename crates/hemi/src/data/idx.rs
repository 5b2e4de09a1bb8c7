//! MNIST and Fashion-MNIST in the IDX format, raw or gzipped.
//!
//! An IDX file is a big-endian header — a magic number whose low byte is the number of
//! dimensions and whose third byte is the element type (0x08 = unsigned byte), then one u32
//! per dimension — followed by the elements. Images are magic 2051 (0x00000803: u8, 3 dims
//! count x rows x cols), labels 2049 (0x00000801: u8, 1 dim count). A gzipped file is
//! recognised by its content (the gzip magic 1f 8b), not its name.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::dataset::{data_error, read_file, InMemoryDataset, Split};
use crate::error::Result;

/// Magic number of an IDX file of unsigned-byte images (3 dimensions).
pub const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of unsigned-byte labels (1 dimension).
pub const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

/// The images of an IDX image file: `count` single-channel `rows x cols` images back to back.
#[derive(Clone, Debug)]
pub struct IdxImages {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub pixels: Vec<u8>,
}

/// Which of the two IDX data sets of 28x28 grey images in 10 classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MnistKind {
    /// Handwritten digits; class k is the digit k.
    Mnist,
    /// Zalando's clothing images (Fashion-MNIST).
    FashionMnist,
}

impl MnistKind {
    pub fn name(self) -> &'static str {
        match self {
            MnistKind::Mnist => "MNIST",
            MnistKind::FashionMnist => "Fashion-MNIST",
        }
    }

    /// The class names in label order.
    pub fn class_names(self) -> Vec<String> {
        let names: &[&str] = match self {
            MnistKind::Mnist => &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"],
            MnistKind::FashionMnist => &[
                "T-shirt/top",
                "Trouser",
                "Pullover",
                "Dress",
                "Coat",
                "Sandal",
                "Shirt",
                "Sneaker",
                "Bag",
                "Ankle boot",
            ],
        };
        names.iter().map(|s| s.to_string()).collect()
    }

    /// The file stems of `split` (images, labels); each may also exist with `.gz` appended.
    pub fn file_stems(split: Split) -> (&'static str, &'static str) {
        match split {
            Split::Train => ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            Split::Test => ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        }
    }

    /// Loads `split` from `dir`, which holds the four standard files, raw or gzipped.
    pub fn load(self, dir: &Path, split: Split) -> Result<InMemoryDataset> {
        if !dir.is_dir() {
            return Err(data_error(
                dir,
                format!(
                    "directory not found: expected {} IDX files here \
                     (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], \
                     t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])",
                    self.name()
                ),
            ));
        }
        let (images, labels) = Self::file_stems(split);
        let images = locate(
            dir,
            images,
            &format!("{} {} images", self.name(), split.name()),
        )?;
        let labels = locate(
            dir,
            labels,
            &format!("{} {} labels", self.name(), split.name()),
        )?;
        load_idx(&images, &labels, self.class_names())
    }
}

/// `dir/stem` if it exists, else `dir/stem.gz`; neither is an error naming both.
fn locate(dir: &Path, stem: &str, what: &str) -> Result<PathBuf> {
    let raw = dir.join(stem);
    let gz = dir.join(format!("{stem}.gz"));
    if raw.is_file() {
        Ok(raw)
    } else if gz.is_file() {
        Ok(gz)
    } else {
        Err(data_error(
            &raw,
            format!(
                "file not found (nor {}): expected the {what} as an IDX file, raw or gzipped",
                gz.display()
            ),
        ))
    }
}

/// Pairs an image file and a label file into a data set of `[1, rows, cols]` images; the
/// counts must match and every label must be below `classes.len()`.
pub fn load_idx(images: &Path, labels: &Path, classes: Vec<String>) -> Result<InMemoryDataset> {
    let imgs = read_idx_images(images)?;
    let labs = read_idx_labels(labels)?;
    if imgs.count != labs.len() {
        return Err(data_error(
            labels,
            format!(
                "{} labels, but the image file {} holds {} images",
                labs.len(),
                images.display(),
                imgs.count
            ),
        ));
    }
    if let Some(i) = labs.iter().position(|&l| l as usize >= classes.len()) {
        return Err(data_error(
            labels,
            format!(
                "label {} at index {i} out of range 0..={}",
                labs[i],
                classes.len() - 1
            ),
        ));
    }
    let labs = labs.into_iter().map(u32::from).collect();
    InMemoryDataset::new([1, imgs.rows, imgs.cols], imgs.pixels, labs, classes)
}

/// Reads and checks an IDX image file (magic 2051).
pub fn read_idx_images(path: &Path) -> Result<IdxImages> {
    let bytes = read_maybe_gz(path, "an IDX image file (magic 2051)")?;
    let dims = header(path, &bytes, IDX_IMAGES_MAGIC, 3, "images")?;
    let (count, rows, cols) = (dims[0], dims[1], dims[2]);
    if rows == 0 || cols == 0 {
        return Err(data_error(
            path,
            format!("images of {rows}x{cols}: empty images"),
        ));
    }
    let body = expect_body(path, &bytes, 16, &[count, rows, cols], "images")?;
    Ok(IdxImages {
        count,
        rows,
        cols,
        pixels: body.to_vec(),
    })
}

/// Reads and checks an IDX label file (magic 2049).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    let bytes = read_maybe_gz(path, "an IDX label file (magic 2049)")?;
    let dims = header(path, &bytes, IDX_LABELS_MAGIC, 1, "labels")?;
    Ok(expect_body(path, &bytes, 8, &dims, "labels")?.to_vec())
}

/// The file's bytes, gunzipped when they start with the gzip magic.
fn read_maybe_gz(path: &Path, expected: &str) -> Result<Vec<u8>> {
    let bytes = read_file(path, expected)?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| data_error(path, format!("corrupt gzip data: {e}")))?;
        Ok(out)
    } else {
        Ok(bytes)
    }
}

/// Checks the magic number and returns the `ndim` dimensions.
fn header(path: &Path, bytes: &[u8], magic: u32, ndim: usize, what: &str) -> Result<Vec<usize>> {
    let short = |len: usize| {
        data_error(
            path,
            format!(
                "size {} is shorter than the {len}-byte IDX {what} header",
                bytes.len()
            ),
        )
    };
    let word = |i: usize| u32::from_be_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    let len = 4 + 4 * ndim;
    if bytes.len() < 4 {
        return Err(short(len));
    }
    let found = word(0);
    if found != magic {
        let hint = match found {
            IDX_IMAGES_MAGIC => " (this is an image file)",
            IDX_LABELS_MAGIC => " (this is a label file)",
            _ => "",
        };
        return Err(data_error(
            path,
            format!(
                "magic number {found} (0x{found:08x}) is not {magic} (0x{magic:08x}, IDX \
                 unsigned-byte {what} with {ndim} dimension{}){hint}",
                if ndim == 1 { "" } else { "s" }
            ),
        ));
    }
    if bytes.len() < len {
        return Err(short(len));
    }
    Ok((1..=ndim).map(|i| word(i) as usize).collect())
}

/// The elements after a `header_len`-byte header, which must be exactly `dims`' product.
fn expect_body<'a>(
    path: &Path,
    bytes: &'a [u8],
    header_len: usize,
    dims: &[usize],
    what: &str,
) -> Result<&'a [u8]> {
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let body = bytes.len() - header_len;
    if n != Some(body) {
        let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        return Err(data_error(
            path,
            format!(
                "size {} does not match the header's {what} of {} ({} bytes after the \
                 {header_len}-byte header, found {body}): {}",
                bytes.len(),
                dims.join("x"),
                n.map_or("overflowing".to_string(), |n| n.to_string()),
                if n.is_some_and(|n| body < n) {
                    "truncated"
                } else {
                    "trailing bytes"
                }
            ),
        ));
    }
    Ok(&bytes[header_len..])
}
