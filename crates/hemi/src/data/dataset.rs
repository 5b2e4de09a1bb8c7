//! The `Dataset` trait, the `Image` and `Sample` values it hands out, and `InMemoryDataset`,
//! the decoded form every reader produces.
//!
//! Images stay `u8` from the file to the transform step: a decoded CIFAR-10 train set is
//! 150 MiB as bytes and would be 600 MiB as f32, and the loader converts each batch to
//! float on the fly. Pixels are stored planar, CHW (all of channel 0, then channel 1...),
//! because that is both CIFAR-10's on-disk layout and the layout of the batch tensor
//! `[B, C, H, W]` the model reads, so the last step is a straight per-plane copy.

use std::path::Path;

use crate::error::{Error, Result};

/// Which half of a data set: the training images or the held-out test images.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training images.
    Train,
    /// The held-out test images.
    Test,
}

impl Split {
    /// `"train"` or `"test"`, as in file and directory names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }
}

/// An image of `u8` pixels, planar CHW: value (c, y, x) is `data[(c * height + y) * width + x]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    channels: usize,
    height: usize,
    width: usize,
    data: Vec<u8>,
}

impl Image {
    /// An image over planar CHW `data`, which must hold exactly `channels * height * width` bytes.
    pub fn new(channels: usize, height: usize, width: usize, data: Vec<u8>) -> Result<Image> {
        let n = channels
            .checked_mul(height)
            .and_then(|n| n.checked_mul(width));
        if n != Some(data.len()) {
            let n = n.map_or("an overflowing number of".to_string(), |n| n.to_string());
            return Err(Error::shape(
                "Image::new",
                format!(
                    "{} bytes do not fill a {channels}x{height}x{width} (CHW) image of {n}",
                    data.len()
                ),
            ));
        }
        Ok(Image {
            channels,
            height,
            width,
            data,
        })
    }

    /// An all-zero (black) image.
    pub fn zeros(channels: usize, height: usize, width: usize) -> Image {
        Image {
            channels,
            height,
            width,
            data: vec![0; channels * height * width],
        }
    }

    /// An image from interleaved HWC bytes (RGBRGB..., as image decoders produce them).
    pub fn from_hwc(channels: usize, height: usize, width: usize, hwc: &[u8]) -> Result<Image> {
        let n = height
            .checked_mul(width)
            .and_then(|p| p.checked_mul(channels));
        if channels == 0 || n != Some(hwc.len()) {
            return Err(Error::shape(
                "Image::from_hwc",
                format!(
                    "{} bytes do not fill a {height}x{width}x{channels} (HWC) image",
                    hwc.len()
                ),
            ));
        }
        let plane = height * width;
        let mut data = vec![0u8; hwc.len()];
        for (p, px) in hwc.chunks_exact(channels).enumerate() {
            for (c, &v) in px.iter().enumerate() {
                data[c * plane + p] = v;
            }
        }
        Image::new(channels, height, width, data)
    }

    /// The pixels as interleaved HWC bytes.
    pub fn to_hwc(&self) -> Vec<u8> {
        let plane = self.height * self.width;
        let mut out = vec![0u8; self.data.len()];
        for c in 0..self.channels {
            for p in 0..plane {
                out[p * self.channels + c] = self.data[c * plane + p];
            }
        }
        out
    }

    /// Number of channels (3 for RGB, 1 for grey).
    pub fn channels(&self) -> usize {
        self.channels
    }
    /// Height in pixels.
    pub fn height(&self) -> usize {
        self.height
    }
    /// Width in pixels.
    pub fn width(&self) -> usize {
        self.width
    }
    /// `[channels, height, width]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.channels, self.height, self.width]
    }
    /// The planar CHW bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
    /// The planar CHW bytes, by value.
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }
    /// One channel's `height * width` bytes, row-major.
    pub fn plane(&self, c: usize) -> &[u8] {
        let plane = self.height * self.width;
        &self.data[c * plane..(c + 1) * plane]
    }
    /// The value at channel `c`, row `y`, column `x` (panics when out of range, like indexing).
    pub fn get(&self, c: usize, y: usize, x: usize) -> u8 {
        assert!(c < self.channels && y < self.height && x < self.width);
        self.data[(c * self.height + y) * self.width + x]
    }
}

/// One labelled example: an image and its class index in `0..num_classes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// The image, `u8` pixels in CHW order.
    pub image: Image,
    /// Its class index, in `0..num_classes`.
    pub label: usize,
}

/// A finite, indexable set of labelled images, as PyTorch's map-style `Dataset`.
///
/// `get` takes `&self` and the trait requires `Send + Sync` so that the loader's worker
/// threads can read (and, for lazy sources like an image folder, decode) samples
/// concurrently from one shared `Arc<dyn Dataset>`.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when the set holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`0..len()`); an index out of range or an unreadable source is an error.
    fn get(&self, index: usize) -> Result<Sample>;

    /// The class names; label `k` is `class_names()[k]`.
    fn class_names(&self) -> &[String];

    /// Number of classes (the length of `class_names`).
    fn num_classes(&self) -> usize {
        self.class_names().len()
    }

    /// `[channels, height, width]` of every image (a model derives its input size from it).
    fn image_shape(&self) -> [usize; 3];
}

/// A data set held decoded in memory: one contiguous buffer of CHW images and a label each.
#[derive(Clone, Debug)]
pub struct InMemoryDataset {
    shape: [usize; 3],
    pixels: Vec<u8>,
    labels: Vec<u32>,
    classes: Vec<String>,
}

impl InMemoryDataset {
    /// `pixels` holds `labels.len()` images of `shape` back to back; every label must be
    /// below `classes.len()`.
    pub fn new(
        shape: [usize; 3],
        pixels: Vec<u8>,
        labels: Vec<u32>,
        classes: Vec<String>,
    ) -> Result<InMemoryDataset> {
        let per = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let total = per.and_then(|p| p.checked_mul(labels.len()));
        if per == Some(0) || total != Some(pixels.len()) {
            return Err(Error::shape(
                "InMemoryDataset::new",
                format!(
                    "{} pixel bytes for {} images of shape {shape:?}",
                    pixels.len(),
                    labels.len()
                ),
            ));
        }
        if classes.is_empty() {
            return Err(Error::arg("InMemoryDataset::new", "no class names"));
        }
        if let Some(i) = labels.iter().position(|&l| l as usize >= classes.len()) {
            return Err(Error::Index {
                op: "InMemoryDataset::new",
                index: labels[i] as i64,
                size: classes.len(),
            });
        }
        Ok(InMemoryDataset {
            shape,
            pixels,
            labels,
            classes,
        })
    }

    /// The labels, one per image.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// All images' bytes, back to back.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// Image `index`'s CHW bytes without a copy.
    pub fn image_bytes(&self, index: usize) -> &[u8] {
        let per: usize = self.shape.iter().product();
        &self.pixels[index * per..(index + 1) * per]
    }

    /// How many images each class has.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes.len()];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }
}

impl Dataset for InMemoryDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> Result<Sample> {
        if index >= self.labels.len() {
            return Err(Error::Index {
                op: "Dataset::get",
                index: index as i64,
                size: self.labels.len(),
            });
        }
        let [c, h, w] = self.shape;
        Ok(Sample {
            image: Image::new(c, h, w, self.image_bytes(index).to_vec())?,
            label: self.labels[index] as usize,
        })
    }

    fn class_names(&self) -> &[String] {
        &self.classes
    }

    fn image_shape(&self) -> [usize; 3] {
        self.shape
    }
}

/// `Error::Data` naming `path`.
pub(crate) fn data_error(path: &Path, msg: impl Into<String>) -> Error {
    Error::Data {
        path: path.display().to_string(),
        msg: msg.into(),
    }
}

/// `Error::Io` naming `path`.
pub(crate) fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Checks that `path` (after symlinks) is a regular file and returns its length. Every
/// reader calls this before opening a file: opening a FIFO blocks until a writer appears
/// (a hang, not an error), and a directory or device is not data. A missing file is an
/// `Error::Data` that says what belongs there.
pub(crate) fn check_regular_file(path: &Path, expected: &str) -> Result<u64> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(m.len()),
        Ok(m) => Err(data_error(
            path,
            format!(
                "not a regular file ({}): expected {expected} here",
                file_kind(&m.file_type())
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(data_error(
            path,
            format!("file not found: expected {expected} here"),
        )),
        Err(e) => Err(io_error(path, e)),
    }
}

/// What a non-regular file is, in words.
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
}

/// Reads a whole regular file (see `check_regular_file`).
pub(crate) fn read_file(path: &Path, expected: &str) -> Result<Vec<u8>> {
    check_regular_file(path, expected)?;
    std::fs::read(path).map_err(|e| io_error(path, e))
}
