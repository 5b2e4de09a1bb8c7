//! Image folders as torchvision's `ImageFolder` reads them: `root/<class>/**/*.{jpg,jpeg,png}`,
//! one subdirectory per class, classes sorted by name (label k is the k-th name), files
//! sorted by name within each class. Every image is decoded to RGB (grey and RGBA files
//! are converted) and must have the folder's one size: the model's input size is fixed,
//! so a stray image of another size is reported by name rather than silently resized.
//!
//! `ImageFolder` is itself a lazy `Dataset` (each `get` reads and decodes one file, so the
//! loader's workers do the decoding); `load` decodes everything up front, in parallel.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::dataset::{data_error, io_error, Dataset, Image, InMemoryDataset, Sample};
use crate::error::{Error, Result};

/// File extensions read as images (compared case-insensitively).
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// A scanned image folder: its classes and its files with their labels.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    files: Vec<(PathBuf, u32)>,
    height: usize,
    width: usize,
}

impl ImageFolder {
    /// Scans `root`; the image size is the first file's (every other file must match it).
    pub fn open(root: &Path) -> Result<ImageFolder> {
        Self::scan(root, None)
    }

    /// Scans `root`, requiring every image to be `height x width`.
    pub fn open_with_size(root: &Path, height: usize, width: usize) -> Result<ImageFolder> {
        Self::scan(root, Some((height, width)))
    }

    fn scan(root: &Path, size: Option<(usize, usize)>) -> Result<ImageFolder> {
        let expected = "an image folder: one subdirectory per class holding .jpg/.jpeg/.png files";
        if !root.is_dir() {
            return Err(data_error(
                root,
                format!("directory not found: expected {expected} here"),
            ));
        }
        let mut classes: Vec<String> = Vec::new();
        for entry in std::fs::read_dir(root).map_err(|e| io_error(root, e))? {
            let entry = entry.map_err(|e| io_error(root, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') && entry.path().is_dir() {
                classes.push(name);
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(data_error(
                root,
                format!("no class subdirectories: expected {expected}"),
            ));
        }
        let mut files = Vec::new();
        let mut empty = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let before = files.len();
            walk(&root.join(class), label as u32, &mut files)?;
            if files.len() == before {
                empty.push(class.as_str());
            }
        }
        if !empty.is_empty() {
            return Err(data_error(
                root,
                format!(
                    "no .jpg/.jpeg/.png files in the class folder(s) {}",
                    empty.join(", ")
                ),
            ));
        }
        let (height, width) = match size {
            Some(s) => s,
            None => {
                let first = decode_rgb(&files[0].0)?;
                (first.height(), first.width())
            }
        };
        Ok(ImageFolder {
            root: root.to_path_buf(),
            classes,
            files,
            height,
            width,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every image file with its label, in data set order.
    pub fn files(&self) -> &[(PathBuf, u32)] {
        &self.files
    }

    /// Reads and decodes image `index`, checking its size.
    pub fn decode(&self, index: usize) -> Result<Image> {
        let path = &self.files[index].0;
        let image = decode_rgb(path)?;
        if (image.height(), image.width()) != (self.height, self.width) {
            return Err(data_error(
                path,
                format!(
                    "image is {}x{} (width x height), but the folder's images are {}x{}",
                    image.width(),
                    image.height(),
                    self.width,
                    self.height
                ),
            ));
        }
        Ok(image)
    }

    /// Decodes every image, in parallel on rayon's pool, into an in-memory data set.
    pub fn load(&self) -> Result<InMemoryDataset> {
        let per = 3 * self.height * self.width;
        let mut pixels = vec![0u8; per * self.files.len()];
        pixels
            .par_chunks_mut(per)
            .enumerate()
            .try_for_each(|(i, dst)| -> Result<()> {
                dst.copy_from_slice(self.decode(i)?.data());
                Ok(())
            })?;
        let labels = self.files.iter().map(|(_, l)| *l).collect();
        InMemoryDataset::new(self.image_shape(), pixels, labels, self.classes.clone())
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn get(&self, index: usize) -> Result<Sample> {
        if index >= self.files.len() {
            return Err(Error::Index {
                op: "ImageFolder::get",
                index: index as i64,
                size: self.files.len(),
            });
        }
        Ok(Sample {
            image: self.decode(index)?,
            label: self.files[index].1 as usize,
        })
    }

    fn class_names(&self) -> &[String] {
        &self.classes
    }

    fn image_shape(&self) -> [usize; 3] {
        [3, self.height, self.width]
    }
}

/// Appends `dir`'s image files (sorted by name), then those of its subdirectories (sorted).
fn walk(dir: &Path, label: u32, files: &mut Vec<(PathBuf, u32)>) -> Result<()> {
    let mut images = Vec::new();
    let mut subdirs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            subdirs.push(path);
        } else if has_image_extension(&path) {
            images.push(path);
        }
    }
    images.sort();
    subdirs.sort();
    files.extend(images.into_iter().map(|p| (p, label)));
    for sub in subdirs {
        walk(&sub, label, files)?;
    }
    Ok(())
}

fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// Reads `path` and decodes it (format from the content) to an RGB image.
fn decode_rgb(path: &Path) -> Result<Image> {
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    let decoded = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| io_error(path, e))?
        .decode()
        .map_err(|e| data_error(path, format!("cannot decode image: {e}")))?;
    let rgb = decoded.into_rgb8();
    let (w, h) = rgb.dimensions();
    Image::from_hwc(3, h as usize, w as usize, rgb.as_raw())
}
