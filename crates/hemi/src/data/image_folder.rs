//! Image folders as torchvision's `ImageFolder` reads them: `root/<class>/**/*.{jpg,jpeg,png}`,
//! one subdirectory per class, classes sorted by name (label k is the k-th name), files
//! sorted by name within each class. Every image is decoded to RGB (grey and RGBA files
//! are converted) and must have the folder's one size: the model's input size is fixed,
//! so a stray image of another size is reported by name rather than silently resized.
//!
//! `ImageFolder` is itself a lazy `Dataset` (each `get` reads and decodes one file, so the
//! loader's workers do the decoding); `load` decodes everything up front, in parallel.

use std::path::{Path, PathBuf};

use crate::cpu::chunked::{map_chunks, map_collect};

use super::dataset::{
    check_regular_file, data_error, io_error, Dataset, Image, InMemoryDataset, Sample,
};
use super::decode;
use crate::error::{Error, Result};

/// File extensions read as images (compared case-insensitively).
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// The largest image side decoded, and the most memory one decode may allocate: image
/// headers are outside input, and a 60-byte PNG can claim 4 billion pixels.
pub const MAX_IMAGE_SIDE: u32 = 16_384;
const MAX_DECODE_BYTES: u64 = 256 << 20;

/// A scanned image folder: its classes and its files with their labels.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    files: Vec<(PathBuf, u32)>,
    skipped: Vec<PathBuf>,
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

    /// Opens a training folder and its test folder together, as a training run must:
    /// both must have the same class list (a test folder missing a class would shift every
    /// later label by one; an extra one would be an out-of-range label an epoch later),
    /// neither may be empty, and every image of both must have one size. The size is the
    /// one most training images have, and every image's header is read up front, so an odd
    /// image is reported by name before training starts rather than in the middle of it.
    pub fn open_pair(train: &Path, test: &Path) -> Result<(ImageFolder, ImageFolder)> {
        let mut train_set = Self::open(train)?;
        let test_set = Self::open(test)?;
        if train_set.classes != test_set.classes {
            let only = |a: &ImageFolder, b: &ImageFolder| -> String {
                let v: Vec<&str> = a
                    .classes
                    .iter()
                    .filter(|c| !b.classes.contains(c))
                    .map(String::as_str)
                    .collect();
                if v.is_empty() {
                    "none".into()
                } else {
                    v.join(", ")
                }
            };
            return Err(data_error(
                train,
                format!(
                    "the class folders differ from those of the test folder {}: only in \
                     train: {}; only in test: {} (train has {} classes, test {}; labels are \
                     the positions in the sorted class list, so both must have the same)",
                    test.display(),
                    only(&train_set, &test_set),
                    only(&test_set, &train_set),
                    train_set.classes.len(),
                    test_set.classes.len()
                ),
            ));
        }
        let (height, width) = train_set.common_size()?;
        train_set.height = height;
        train_set.width = width;
        let test_set = ImageFolder {
            height,
            width,
            ..test_set
        };
        train_set.check_sizes()?;
        test_set.check_sizes()?;
        Ok((train_set, test_set))
    }

    /// Symbolic links to directories (and broken links) that the scan did not follow.
    pub fn skipped(&self) -> &[PathBuf] {
        &self.skipped
    }

    /// Reads every image's header (not its pixels) and checks that it is the folder's
    /// size; an odd image is an error naming it and both sizes.
    pub fn check_sizes(&self) -> Result<()> {
        let want = (self.width, self.height);
        // Every header is read; the first odd image in folder order is the error.
        map_collect(
            self.files.len(),
            1,
            || (),
            |_, i| {
                let path = &self.files[i].0;
                let got = read_dimensions(path)?;
                if got != want {
                    return Err(odd_size(path, got, want));
                }
                Ok(())
            },
        )
        .into_iter()
        .collect()
    }

    /// The (width, height) most of the images have, from their headers.
    fn common_size(&self) -> Result<(usize, usize)> {
        let sizes: Vec<(usize, usize)> = map_collect(
            self.files.len(),
            1,
            || (),
            |_, i| read_dimensions(&self.files[i].0),
        )
        .into_iter()
        .collect::<Result<_>>()?;
        let mut counts = std::collections::BTreeMap::new();
        for s in sizes {
            *counts.entry(s).or_insert(0usize) += 1;
        }
        let ((w, h), _) = counts
            .into_iter()
            .max_by_key(|&(_, n)| n)
            .expect("a scanned folder has files");
        Ok((h, w))
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
        let mut skipped = Vec::new();
        for entry in std::fs::read_dir(root).map_err(|e| io_error(root, e))? {
            let entry = entry.map_err(|e| io_error(root, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let kind = entry.file_type().map_err(|e| io_error(&entry.path(), e))?;
            if kind.is_dir() {
                classes.push(name);
            } else if kind.is_symlink() && entry.path().is_dir() {
                skipped.push(entry.path());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(data_error(
                root,
                format!(
                    "no class subdirectories: expected {expected}{}",
                    skipped_note(&skipped)
                ),
            ));
        }
        let mut files = Vec::new();
        let mut empty = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let before = files.len();
            walk(&root.join(class), label as u32, &mut files, &mut skipped)?;
            if files.len() == before {
                empty.push(class.as_str());
            }
        }
        skipped.sort();
        if !empty.is_empty() {
            return Err(data_error(
                root,
                format!(
                    "no .jpg/.jpeg/.png files in the class folder(s) {}{}",
                    empty.join(", "),
                    skipped_note(&skipped)
                ),
            ));
        }
        if !skipped.is_empty() {
            // The library cannot know whether its caller reports this, and a silently
            // smaller data set is the failure this guards against, so say it here.
            eprintln!(
                "hemi: warning: {}: {}",
                root.display(),
                skipped_note(&skipped).trim_start_matches("; ")
            );
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
            skipped,
            height,
            width,
        })
    }

    /// The directory the set was read from (holding one sub-directory per class).
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
            return Err(odd_size(
                path,
                (image.width(), image.height()),
                (self.width, self.height),
            ));
        }
        Ok(image)
    }

    /// Decodes every image, in parallel on rayon's pool, into an in-memory data set.
    pub fn load(&self) -> Result<InMemoryDataset> {
        let too_big = || {
            data_error(
                &self.root,
                format!(
                    "{} images of 3x{}x{} do not fit in memory",
                    self.files.len(),
                    self.height,
                    self.width
                ),
            )
        };
        let per = (3 * self.height)
            .checked_mul(self.width)
            .ok_or_else(too_big)?;
        let total = per.checked_mul(self.files.len()).ok_or_else(too_big)?;
        let mut pixels = vec![0u8; total];
        // Every image is decoded; the first that fails in folder order is the error.
        map_chunks(&mut pixels, per, || (), &|_, i, dst| -> Result<()> {
            dst.copy_from_slice(self.decode(i)?.data());
            Ok(())
        })
        .into_iter()
        .collect::<Result<()>>()?;
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

fn odd_size(path: &Path, got: (usize, usize), want: (usize, usize)) -> Error {
    data_error(
        path,
        format!(
            "image is {}x{} (width x height), but the folder's images are {}x{}",
            got.0, got.1, want.0, want.1
        ),
    )
}

fn skipped_note(skipped: &[PathBuf]) -> String {
    if skipped.is_empty() {
        return String::new();
    }
    let names: Vec<String> = skipped.iter().map(|p| p.display().to_string()).collect();
    format!(
        "; skipped {} symbolic link(s) to directories or to nothing (never followed, so a \
         link loop cannot multiply the data set): {}",
        skipped.len(),
        names.join(", ")
    )
}

/// Appends `dir`'s image files (sorted by name), then those of its subdirectories (sorted).
/// Symbolic links are never recursed into: a link to a regular file is read as that file;
/// a link to a directory, or a broken one, is added to `skipped`.
fn walk(
    dir: &Path,
    label: u32,
    files: &mut Vec<(PathBuf, u32)>,
    skipped: &mut Vec<PathBuf>,
) -> Result<()> {
    let mut images = Vec::new();
    let mut subdirs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        // The entry's own type: a symlink is a symlink here, not its target.
        let kind = entry.file_type().map_err(|e| io_error(&path, e))?;
        if kind.is_dir() {
            subdirs.push(path);
        } else if kind.is_symlink() {
            match std::fs::metadata(&path) {
                Ok(m) if m.is_dir() => skipped.push(path),
                Ok(_) if has_image_extension(&path) => images.push(path),
                Ok(_) => {}
                Err(_) if has_image_extension(&path) => skipped.push(path),
                Err(_) => {}
            }
        } else if has_image_extension(&path) {
            images.push(path);
        }
    }
    images.sort();
    subdirs.sort();
    files.extend(images.into_iter().map(|p| (p, label)));
    for sub in subdirs {
        walk(&sub, label, files, skipped)?;
    }
    Ok(())
}

fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// Reads an image file after checking it is a regular file of a sane size.
fn read_image_file(path: &Path) -> Result<Vec<u8>> {
    let len = check_regular_file(path, "a .jpg/.jpeg/.png image")?;
    if len > MAX_DECODE_BYTES {
        return Err(data_error(
            path,
            format!("size {len} bytes: larger than the {MAX_DECODE_BYTES}-byte image limit"),
        ));
    }
    std::fs::read(path).map_err(|e| io_error(path, e))
}

const LIMITS: decode::Limits = decode::Limits {
    max_side: MAX_IMAGE_SIDE,
    max_bytes: MAX_DECODE_BYTES,
};

/// A decoder failure as the data error naming `path`.
fn decode_error(path: &Path, e: decode::DecodeError) -> Error {
    match e {
        decode::DecodeError::Unrecognised => data_error(
            path,
            "cannot decode image: not a JPEG or PNG file (unrecognised content)",
        ),
        decode::DecodeError::TooLarge(m) | decode::DecodeError::Invalid(m) => {
            data_error(path, format!("cannot decode image: {m}"))
        }
    }
}

/// An image's (width, height) from its header alone.
fn read_dimensions(path: &Path) -> Result<(usize, usize)> {
    let bytes = read_image_file(path)?;
    let (w, h) = decode::dimensions(&bytes, LIMITS).map_err(|e| decode_error(path, e))?;
    Ok((w as usize, h as usize))
}

/// Reads `path` and decodes it (format from the content) to an RGB image.
fn decode_rgb(path: &Path) -> Result<Image> {
    decode_bytes(path, &read_image_file(path)?)
}

/// Decodes JPEG or PNG bytes to an RGB image as the image folder does (grey and RGBA are
/// converted); errors name the source `<bytes>`. The in-memory entry point of the folder's
/// decoder.
pub fn parse_image(bytes: &[u8]) -> Result<Image> {
    decode_bytes(Path::new("<bytes>"), bytes)
}

fn decode_bytes(path: &Path, bytes: &[u8]) -> Result<Image> {
    let (w, h, rgb) = decode::decode_rgb8(bytes, LIMITS).map_err(|e| decode_error(path, e))?;
    Image::from_hwc(3, h as usize, w as usize, &rgb)
}
