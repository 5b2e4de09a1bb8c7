//! Seeded per-sample transforms, as torchvision's `RandomCrop`, `RandomHorizontalFlip`,
//! `ToTensor` and `Normalize`.
//!
//! A `Transform` is a list of geometric augmentations applied to the `u8` image in order,
//! then the conversion to float: `x / 255`, then `(x - mean[c]) / std[c]` when a Normalize
//! is set. The conversion and Normalize are fused into one 256-entry table per channel
//! (each entry computed with exactly the unfused f32 formula), so turning a batch into
//! floats is one table lookup per pixel. Randomness comes from the `Generator` the caller
//! passes for the sample; the loader derives it from (seed, epoch, sample index) so a
//! sample's augmentation does not depend on which worker thread handles it.

use super::dataset::Image;
use crate::error::{Error, Result};
use crate::rng::Generator;

/// A random geometric augmentation of a `u8` image.
#[derive(Clone, Debug, PartialEq)]
pub enum Augment {
    /// Pad every side with `padding` zero pixels, then crop a `size x size` window at a
    /// uniformly drawn position (torchvision's `RandomCrop(size, padding)`).
    RandomCrop {
        /// Side of the square crop, in pixels (32 for CIFAR).
        size: usize,
        /// Zero pixels added on every side before cropping (4 for CIFAR).
        padding: usize,
    },
    /// Mirror left-right with probability `p`.
    RandomHorizontalFlip {
        /// Probability of the flip, in `[0, 1]` (0.5 usually).
        p: f64,
    },
}

/// Augmentations, then the conversion to float with an optional Normalize.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Transform {
    augments: Vec<Augment>,
    normalize: Option<(Vec<f32>, Vec<f32>)>,
}

impl Transform {
    /// Only the conversion to float, `x / 255` (torchvision's `ToTensor`).
    pub fn new() -> Transform {
        Transform::default()
    }

    /// Appends a `RandomCrop(size, padding)`.
    pub fn random_crop(mut self, size: usize, padding: usize) -> Transform {
        self.augments.push(Augment::RandomCrop { size, padding });
        self
    }

    /// Appends a `RandomHorizontalFlip(p)`.
    pub fn random_horizontal_flip(mut self, p: f64) -> Transform {
        self.augments.push(Augment::RandomHorizontalFlip { p });
        self
    }

    /// Sets `Normalize(mean, std)` after the scaling to [0, 1]: one value per channel, or one
    /// value for all channels (`normalize(&[0.5], &[0.5])` maps [0, 1] to [-1, 1]).
    pub fn normalize(mut self, mean: &[f32], std: &[f32]) -> Transform {
        self.normalize = Some((mean.to_vec(), std.to_vec()));
        self
    }

    /// The documents' recipe: `ToTensor()` then `Normalize((0.5,)*3, (0.5,)*3)`.
    pub fn to_tensor_normalize_half() -> Transform {
        Transform::new().normalize(&[0.5], &[0.5])
    }

    /// The common CIFAR training augmentation: `RandomCrop(32, padding=4)`,
    /// `RandomHorizontalFlip()`, then the recipe's Normalize(0.5, 0.5).
    pub fn cifar_train_augment() -> Transform {
        Transform::new()
            .random_crop(32, 4)
            .random_horizontal_flip(0.5)
            .normalize(&[0.5], &[0.5])
    }

    /// The augmentations, in the order they are applied.
    pub fn augments(&self) -> &[Augment] {
        &self.augments
    }

    /// The `[channels, height, width]` an input of `input` shape comes out as; an error when
    /// the transform cannot apply (a crop larger than the padded image, a Normalize with
    /// the wrong number of channels or a zero std, a probability outside [0, 1]).
    pub fn output_shape(&self, input: [usize; 3]) -> Result<[usize; 3]> {
        let [c, mut h, mut w] = input;
        for a in &self.augments {
            match *a {
                Augment::RandomCrop { size, padding } => {
                    if size == 0 || size > h + 2 * padding || size > w + 2 * padding {
                        return Err(Error::arg(
                            "RandomCrop",
                            format!(
                                "crop {size}x{size} does not fit a {h}x{w} image padded by \
                                 {padding}"
                            ),
                        ));
                    }
                    (h, w) = (size, size);
                }
                Augment::RandomHorizontalFlip { p } => {
                    if !(0.0..=1.0).contains(&p) {
                        return Err(Error::arg(
                            "RandomHorizontalFlip",
                            format!("probability {p} outside [0, 1]"),
                        ));
                    }
                }
            }
        }
        if let Some((mean, std)) = &self.normalize {
            let fits = |v: &[f32]| v.len() == 1 || v.len() == c;
            if !fits(mean) || !fits(std) {
                return Err(Error::arg(
                    "Normalize",
                    format!(
                        "{} means and {} stds for {c} channels (give 1 or {c} of each)",
                        mean.len(),
                        std.len()
                    ),
                ));
            }
            if std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
                return Err(Error::arg("Normalize", format!("std {std:?} has a zero")));
            }
        }
        Ok([c, h, w])
    }

    /// Applies the augmentations in order, drawing from `rng`.
    pub fn augment(&self, image: &Image, rng: &mut Generator) -> Result<Image> {
        self.output_shape(image.shape())?;
        let mut image = image.clone();
        for a in &self.augments {
            image = match *a {
                Augment::RandomCrop { size, padding } => random_crop(&image, size, padding, rng)?,
                Augment::RandomHorizontalFlip { p } => {
                    if rng.uniform_f64() < p {
                        hflip(&image)
                    } else {
                        image
                    }
                }
            };
        }
        Ok(image)
    }

    /// Per channel, the float value of each of the 256 byte values.
    pub fn float_table(&self, channels: usize) -> Vec<[f32; 256]> {
        (0..channels)
            .map(|c| {
                let mut t = [0f32; 256];
                for (v, out) in t.iter_mut().enumerate() {
                    let x = v as f32 / 255.0;
                    *out = match &self.normalize {
                        Some((mean, std)) => {
                            let pick = |s: &[f32]| if s.len() == 1 { s[0] } else { s[c] };
                            (x - pick(mean)) / pick(std)
                        }
                        None => x,
                    };
                }
                t
            })
            .collect()
    }

    /// Augments `image` and writes its float CHW values into `out` (of the output size),
    /// using `table` from `float_table`.
    pub fn apply_into(
        &self,
        image: &Image,
        rng: &mut Generator,
        table: &[[f32; 256]],
        out: &mut [f32],
    ) -> Result<()> {
        let image = self.augment(image, rng)?;
        if out.len() != image.data().len() || table.len() != image.channels() {
            return Err(Error::shape(
                "Transform::apply_into",
                format!(
                    "a {:?} image into {} floats with {} channel tables",
                    image.shape(),
                    out.len(),
                    table.len()
                ),
            ));
        }
        let plane = image.height() * image.width();
        for (c, t) in table.iter().enumerate() {
            let dst = &mut out[c * plane..(c + 1) * plane];
            for (d, &v) in dst.iter_mut().zip(image.plane(c)) {
                *d = t[v as usize];
            }
        }
        Ok(())
    }

    /// Augments and converts one image: its float CHW values and shape.
    pub fn apply(&self, image: &Image, rng: &mut Generator) -> Result<(Vec<f32>, [usize; 3])> {
        let shape = self.output_shape(image.shape())?;
        let mut out = vec![0f32; shape.iter().product()];
        self.apply_into(image, rng, &self.float_table(shape[0]), &mut out)?;
        Ok((out, shape))
    }
}

/// The `size x size` window at (`top`, `left`) of `image` padded by `padding` zeros on
/// every side (so `top = padding, left = padding` is the unpadded image's corner).
pub fn crop_padded(
    image: &Image,
    size: usize,
    padding: usize,
    top: usize,
    left: usize,
) -> Result<Image> {
    let [c, h, w] = image.shape();
    if top + size > h + 2 * padding || left + size > w + 2 * padding {
        return Err(Error::arg(
            "RandomCrop",
            format!(
                "window {size}x{size} at ({top}, {left}) leaves a {h}x{w} image padded by \
                 {padding}"
            ),
        ));
    }
    let mut out = vec![0u8; c * size * size];
    for ch in 0..c {
        let src = image.plane(ch);
        for y in 0..size {
            // Row y of the window is source row top + y - padding, when that row exists.
            let Some(sy) = (top + y).checked_sub(padding).filter(|&sy| sy < h) else {
                continue;
            };
            let row = &mut out[(ch * size + y) * size..(ch * size + y + 1) * size];
            // Window columns x with 0 <= left + x - padding < w.
            let x0 = padding.saturating_sub(left);
            let x1 = (w + padding).saturating_sub(left).min(size);
            if x0 < x1 {
                let sx0 = left + x0 - padding;
                row[x0..x1].copy_from_slice(&src[sy * w + sx0..sy * w + sx0 + (x1 - x0)]);
            }
        }
    }
    Image::new(c, size, size, out)
}

/// `RandomCrop(size, padding)`: the window position is uniform over the `(h + 2p - size + 1)
/// x (w + 2p - size + 1)` possible ones, top drawn first.
pub fn random_crop(
    image: &Image,
    size: usize,
    padding: usize,
    rng: &mut Generator,
) -> Result<Image> {
    let [_, h, w] = image.shape();
    if size == 0 || size > h + 2 * padding || size > w + 2 * padding {
        return Err(Error::arg(
            "RandomCrop",
            format!("crop {size}x{size} does not fit a {h}x{w} image padded by {padding}"),
        ));
    }
    let top = rng.below((h + 2 * padding - size + 1) as u64) as usize;
    let left = rng.below((w + 2 * padding - size + 1) as u64) as usize;
    crop_padded(image, size, padding, top, left)
}

/// The image mirrored left-right.
pub fn hflip(image: &Image) -> Image {
    let [c, h, w] = image.shape();
    let mut out = image.data().to_vec();
    for row in out.chunks_exact_mut(w.max(1)).take(c * h) {
        row.reverse();
    }
    Image::new(c, h, w, out).expect("same size")
}
