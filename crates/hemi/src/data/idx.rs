//! MNIST and Fashion-MNIST in the IDX format, raw or gzipped.
//!
//! An IDX file is a big-endian header — a magic number whose low byte is the number of
//! dimensions and whose third byte is the element type (0x08 = unsigned byte), then one u32
//! per dimension — followed by the elements. Images are magic 2051 (0x00000803: u8, 3 dims
//! count x rows x cols), labels 2049 (0x00000801: u8, 1 dim count). A gzipped file is
//! recognised by its content (the gzip magic 1f 8b), not its name.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::dataset::{check_regular_file, data_error, read_file, InMemoryDataset, Split};
use crate::error::{Error, Result};

/// Magic number of an IDX file of unsigned-byte images (3 dimensions).
pub const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of unsigned-byte labels (1 dimension).
pub const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

/// The images of an IDX image file: `count` single-channel `rows x cols` images back to back.
#[derive(Clone, Debug)]
pub struct IdxImages {
    /// Number of images.
    pub count: usize,
    /// Height of every image in pixels (28 for MNIST).
    pub rows: usize,
    /// Width of every image in pixels (28 for MNIST).
    pub cols: usize,
    /// The pixels, `count * rows * cols` bytes, image after image, row-major.
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
    /// The data set's usual name (`"MNIST"`, `"Fashion-MNIST"`), for messages.
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
    if raw.exists() {
        check_regular_file(&raw, &format!("the {what} as an IDX file"))?;
        Ok(raw)
    } else if gz.exists() {
        check_regular_file(&gz, &format!("the {what} as a gzipped IDX file"))?;
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
    imgs.into_dataset(labs, classes).map_err(|e| match e {
        // Name both files when the counts disagree.
        Error::Data { path, msg } if path == MEMORY => Error::Data {
            path: labels.display().to_string(),
            msg: format!("{msg} (image file {})", images.display()),
        },
        e => e,
    })
}

impl IdxImages {
    /// The images with `labels` (one per image, each below `classes.len()`) as a data set
    /// of `[1, rows, cols]` images.
    pub fn into_dataset(self, labels: Vec<u8>, classes: Vec<String>) -> Result<InMemoryDataset> {
        let src = Path::new(MEMORY);
        if self.count != labels.len() {
            return Err(data_error(
                src,
                format!(
                    "{} labels, but the image file holds {} images",
                    labels.len(),
                    self.count
                ),
            ));
        }
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes.len()) {
            return Err(data_error(
                src,
                format!(
                    "label {} at index {i} out of range 0..={}",
                    labels[i],
                    classes.len().saturating_sub(1)
                ),
            ));
        }
        let labels = labels.into_iter().map(u32::from).collect();
        InMemoryDataset::new([1, self.rows, self.cols], self.pixels, labels, classes)
    }
}

/// The name errors of the in-memory parsers give as their source.
const MEMORY: &str = "<bytes>";

/// Reads and checks an IDX image file (magic 2051), raw or gzipped.
pub fn read_idx_images(path: &Path) -> Result<IdxImages> {
    let bytes = read_file(path, "an IDX image file (magic 2051)")?;
    images_from(path, &bytes)
}

/// Reads and checks an IDX label file (magic 2049), raw or gzipped.
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    let bytes = read_file(path, "an IDX label file (magic 2049)")?;
    labels_from(path, &bytes)
}

/// The bytes of an IDX image file (raw or gzipped) as `read_idx_images` checks them;
/// errors name the source `<bytes>`.
pub fn parse_idx_images(bytes: &[u8]) -> Result<IdxImages> {
    images_from(Path::new(MEMORY), bytes)
}

/// The bytes of an IDX label file (raw or gzipped) as `read_idx_labels` checks them.
pub fn parse_idx_labels(bytes: &[u8]) -> Result<Vec<u8>> {
    labels_from(Path::new(MEMORY), bytes)
}

fn images_from(path: &Path, bytes: &[u8]) -> Result<IdxImages> {
    let (dims, pixels) = decode(path, bytes, IDX_IMAGES_MAGIC, 3, "images")?;
    let (count, rows, cols) = (dims[0], dims[1], dims[2]);
    if rows == 0 || cols == 0 {
        return Err(data_error(
            path,
            format!("images of {rows}x{cols}: empty images"),
        ));
    }
    Ok(IdxImages {
        count,
        rows,
        cols,
        pixels,
    })
}

fn labels_from(path: &Path, bytes: &[u8]) -> Result<Vec<u8>> {
    Ok(decode(path, bytes, IDX_LABELS_MAGIC, 1, "labels")?.1)
}

/// Deflate expands at most about 1032:1, so a gzip file of `n` bytes holds at most this
/// many times `n` bytes; a header claiming more is corrupt and is refused before allocating.
const MAX_GZIP_RATIO: usize = 1032;

/// Checks the header (magic, `ndim` dimensions) of a raw or gzipped (by its magic 1f 8b)
/// IDX file and returns the dimensions and the elements, whose count must be exactly the
/// dimensions' product. Nothing is allocated beyond what the file can actually hold.
fn decode(
    path: &Path,
    bytes: &[u8],
    magic: u32,
    ndim: usize,
    what: &str,
) -> Result<(Vec<usize>, Vec<u8>)> {
    let header_len = 4 + 4 * ndim;
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        let dims = header(path, bytes, magic, ndim, what)?;
        let body = expect_body(path, bytes.len() - header_len, header_len, &dims, what)?;
        return Ok((dims, bytes[header_len..header_len + body].to_vec()));
    }
    let corrupt = |e: std::io::Error| data_error(path, format!("corrupt gzip data: {e}"));
    let mut gz = flate2::read::MultiGzDecoder::new(bytes);
    let mut head = Vec::with_capacity(header_len);
    (&mut gz)
        .take(header_len as u64)
        .read_to_end(&mut head)
        .map_err(corrupt)?;
    let dims = header(path, &head, magic, ndim, what)?;
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let limit = bytes.len().saturating_mul(MAX_GZIP_RATIO);
    match n {
        Some(n) if n <= limit => {
            let mut body = Vec::with_capacity(n);
            (&mut gz)
                .take(n as u64 + 1)
                .read_to_end(&mut body)
                .map_err(corrupt)?;
            expect_body(path, body.len(), header_len, &dims, what)?;
            Ok((dims, body))
        }
        _ => Err(data_error(
            path,
            format!(
                "the header's {what} of {} need {} bytes, more than a {}-byte gzip file can \
                 hold (deflate expands at most {MAX_GZIP_RATIO}:1): corrupt header",
                dims_text(&dims),
                n.map_or("an overflowing number of".to_string(), |n| n.to_string()),
                bytes.len()
            ),
        )),
    }
}

fn dims_text(dims: &[usize]) -> String {
    dims.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
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
    let word = |i: usize| u32::from_be_bytes([0, 1, 2, 3].map(|k| bytes[4 * i + k]));
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

/// Checks that `body` bytes after a `header_len`-byte header are exactly `dims`' product
/// (computed with overflow checks) and returns it.
fn expect_body(
    path: &Path,
    body: usize,
    header_len: usize,
    dims: &[usize],
    what: &str,
) -> Result<usize> {
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if n != Some(body) {
        return Err(data_error(
            path,
            format!(
                "size {} does not match the header's {what} of {} ({} bytes after the \
                 {header_len}-byte header, found {body}): {}",
                header_len + body,
                dims_text(dims),
                n.map_or("an overflowing number of".to_string(), |n| n.to_string()),
                if n.is_some_and(|n| body > n) {
                    "trailing bytes"
                } else {
                    "truncated"
                }
            ),
        ));
    }
    Ok(body)
}
