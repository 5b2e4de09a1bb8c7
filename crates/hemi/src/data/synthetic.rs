//! The built-in synthetic data set: 32x32 RGB images in 10 classes, generated from a seed,
//! so that training runs on a fresh machine with no data.
//!
//! A class is a shape or texture — stripes at four orientations, concentric rings, a disc,
//! a square, a cross, a checkerboard, a triangle — drawn large, at a random position, size,
//! rotation (within its class), phase and period, in random foreground and background
//! colours over a random gradient, with 0-2 small distractor blobs, sometimes a distractor
//! line, and pixel noise on top. Colour and brightness carry no class information and
//! stripes of random phase average out, so no linear function of the pixels separates the
//! classes well: a CNN has to learn oriented edges and shapes.
//!
//! Measured with PyTorch on the documents' recipe (CifarNet, SGD lr 0.001 momentum 0.9,
//! batch 128, Normalize 0.5/0.5) on the default 10,000 training images: test accuracy
//! 11 / 17 / 46 / 70 / 81 % after epochs 1 / 3 / 5 / 7 / 10 — a plateau of a few epochs,
//! then steady learning — while a linear classifier on the pixels (Adam, 20 epochs) stays
//! at 17-20 %. The patterns are large because with only ~80 small SGD steps per epoch,
//! smaller ones left the network on its initial plateau for all ten epochs (20-27 %).
//!
//! Image `i` of a split is drawn from its own generator seeded by (seed, split, i), so the
//! set is generated in parallel and is the same whatever the thread count; labels are
//! `i % 10`, so every class has `len / 10` images (the first `len % 10` classes one more).

use std::f32::consts::PI;

use crate::cpu::chunked::for_each_chunk;

use super::dataset::{Image, InMemoryDataset, Sample, Split};
use crate::error::{Error, Result};
use crate::rng::Generator;

/// The class names in label order.
pub const SYNTHETIC_CLASSES: [&str; 10] = [
    "horizontal stripes",
    "vertical stripes",
    "diagonal stripes",
    "antidiagonal stripes",
    "rings",
    "disc",
    "square",
    "cross",
    "checkerboard",
    "triangle",
];

/// Generator of the synthetic data set.
pub struct Synthetic;

impl Synthetic {
    /// Default training-set size: 10 epochs of CifarNet are 100,000 images, under 2 minutes
    /// at the ~1,000 images/s of PyTorch on 2 cores (about 3 minutes at 600 images/s), and
    /// 780 SGD steps, enough at lr 0.001 to get well past the initial plateau.
    pub const DEFAULT_TRAIN_LEN: usize = 10_000;
    /// Default test-set size.
    pub const DEFAULT_TEST_LEN: usize = 1_000;
    /// Image side in pixels.
    pub const SIZE: usize = 32;

    /// The most images `try_generate` makes: 2,000,000 are 6.1 GB of pixels, 40 times
    /// CIFAR-10's training set; a larger request is a mistake, not a plan.
    pub const MAX_LEN: usize = 2_000_000;

    /// `len` images of `split` from `seed`, checking `len` (user input, e.g.
    /// `--synthetic-size`): 0 or more than `MAX_LEN` is an error naming the size.
    pub fn try_generate(seed: u64, split: Split, len: usize) -> Result<InMemoryDataset> {
        if len == 0 || len > Self::MAX_LEN {
            return Err(Error::arg(
                "Synthetic::try_generate",
                format!(
                    "synthetic data set size {len}: must be 1..={} images ({} bytes each)",
                    Self::MAX_LEN,
                    3 * Self::SIZE * Self::SIZE
                ),
            ));
        }
        Ok(Self::generate(seed, split, len))
    }

    /// `len` images of `split` from `seed` (train and test are independent streams). For
    /// a size from user input use `try_generate`; this panics when `len` images cannot be
    /// allocated.
    pub fn generate(seed: u64, split: Split, len: usize) -> InMemoryDataset {
        let per = 3 * Self::SIZE * Self::SIZE;
        let mut pixels = vec![0u8; per * len];
        for_each_chunk(&mut pixels, per, &|i, dst| render(seed, split, i, dst));
        let labels = (0..len).map(|i| (i % 10) as u32).collect();
        let classes = SYNTHETIC_CLASSES.iter().map(|s| s.to_string()).collect();
        InMemoryDataset::new([3, Self::SIZE, Self::SIZE], pixels, labels, classes)
            .expect("synthetic data set is well-formed")
    }

    /// Image `index` of `split` alone (the same bytes `generate` puts at that index).
    pub fn sample(seed: u64, split: Split, index: usize) -> Sample {
        let mut data = vec![0u8; 3 * Self::SIZE * Self::SIZE];
        render(seed, split, index, &mut data);
        Sample {
            image: Image::new(3, Self::SIZE, Self::SIZE, data).expect("sized above"),
            label: index % 10,
        }
    }
}

/// A well-mixed 64-bit seed from parts (splitmix64's finaliser over a running hash).
pub(crate) fn mix_seed(parts: &[u64]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for &p in parts {
        h = (h ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    h
}

/// Coverage in [0, 1] of a pixel by a region whose signed distance (negative inside) is `d`:
/// a one-pixel ramp, so edges are anti-aliased rather than jagged.
fn cover(d: f32) -> f32 {
    (0.5 - d).clamp(0.0, 1.0)
}

/// A shape or texture of one class, with its drawn parameters, as a coverage function.
struct Pattern {
    class: usize,
    cx: f32,
    cy: f32,
    r: f32,
    cos: f32,
    sin: f32,
    period: f32,
    phase: f32,
}

impl Pattern {
    fn draw(class: usize, rng: &mut Generator) -> Pattern {
        let angle = match class {
            // Stripes: 0, 90, 45, 135 degrees of the stripe direction, +-15 degrees, so the
            // orientation classes stay 15 degrees apart at worst.
            0..=3 => [0.0f32, 90.0, 45.0, 135.0][class] + rng.uniform(-15.0, 15.0) as f32,
            _ => rng.uniform(0.0, 360.0) as f32,
        }
        .to_radians();
        Pattern {
            class,
            cx: rng.uniform(12.0, 20.0) as f32,
            cy: rng.uniform(12.0, 20.0) as f32,
            r: rng.uniform(9.0, 13.0) as f32,
            cos: angle.cos(),
            sin: angle.sin(),
            period: rng.uniform(4.0, 7.0) as f32,
            phase: rng.uniform(0.0, 2.0 * PI as f64) as f32,
        }
    }

    /// Coverage of the pixel centred at (x, y).
    fn coverage(&self, x: f32, y: f32) -> f32 {
        let (dx, dy) = (x - self.cx, y - self.cy);
        // Coordinates along (u) and across (v) the pattern's orientation.
        let u = dx * self.cos + dy * self.sin;
        let v = -dx * self.sin + dy * self.cos;
        let rho = (dx * dx + dy * dy).sqrt();
        let window = cover(rho - (self.r + 4.0));
        // A soft square wave: sharper than a sine, so stripes read as edges.
        let wave =
            |t: f32| (0.5 + 1.5 * (2.0 * PI * t / self.period + self.phase).sin()).clamp(0.0, 1.0);
        match self.class {
            // Stripes run along u, so the intensity varies with v.
            0..=3 => window * wave(v),
            4 => window * wave(rho),
            5 => cover(rho - 0.8 * self.r),
            6 => cover(u.abs().max(v.abs()) - 0.7 * self.r),
            7 => {
                let half_w = 0.22 * self.r;
                let bar = |a: f32, b: f32| (a.abs() - self.r).max(b.abs() - half_w);
                cover(bar(u, v).min(bar(v, u)))
            }
            8 => {
                let cell = 0.5 * self.period;
                let s = (PI * u / cell).sin() * (PI * v / cell).sin();
                window * (0.5 + 2.0 * s).clamp(0.0, 1.0)
            }
            _ => {
                // Equilateral triangle of circumradius r: the max of three half-plane distances.
                let inradius = 0.5 * self.r;
                let d = (0..3)
                    .map(|k| {
                        let a = 2.0 * PI * k as f32 / 3.0;
                        u * a.cos() + v * a.sin() - inradius
                    })
                    .fold(f32::MIN, f32::max);
                cover(d)
            }
        }
    }
}

fn random_colour(rng: &mut Generator) -> [f32; 3] {
    [0, 1, 2].map(|_| rng.uniform(0.0, 255.0) as f32)
}

fn luma(c: [f32; 3]) -> f32 {
    0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]
}

/// Renders image `index` of `split` into `dst` (CHW, 3x32x32).
fn render(seed: u64, split: Split, index: usize, dst: &mut [u8]) {
    const S: usize = Synthetic::SIZE;
    let split_tag = match split {
        Split::Train => 1,
        Split::Test => 2,
    };
    let mut rng = Generator::new(mix_seed(&[seed, split_tag, index as u64]));
    let class = index % 10;

    // Colours: a random background, and a foreground brighter or darker by 70-130 in every
    // channel (towards the side with more room), its hue shifted by up to +-30 per
    // channel. The shape's edges then have one sign in all three channels, as edges in
    // photographs mostly do, while colour and polarity still say nothing about the class.
    let bg = random_colour(&mut rng);
    let sign = if luma(bg) < 127.5 { 1.0 } else { -1.0 };
    let contrast = rng.uniform(70.0, 130.0) as f32;
    let fg = [0, 1, 2].map(|c| {
        let hue = rng.uniform(-30.0, 30.0) as f32;
        (bg[c] + sign * contrast + hue).clamp(0.0, 255.0)
    });
    let grad = [rng.uniform(-1.0, 1.0) as f32, rng.uniform(-1.0, 1.0) as f32];
    let pattern = Pattern::draw(class, &mut rng);

    // Distractors: 0-2 small blobs and, a third of the time, a thin line, in their own
    // colours.
    let blobs: Vec<(f32, f32, f32, [f32; 3])> = (0..rng.below(3))
        .map(|_| {
            (
                rng.uniform(0.0, S as f64) as f32,
                rng.uniform(0.0, S as f64) as f32,
                rng.uniform(1.5, 3.0) as f32,
                random_colour(&mut rng),
            )
        })
        .collect();
    let line = (rng.uniform_f64() < 1.0 / 3.0).then(|| {
        let a = rng.uniform(0.0, PI as f64) as f32;
        let (px, py) = (
            rng.uniform(0.0, S as f64) as f32,
            rng.uniform(0.0, S as f64) as f32,
        );
        (a.cos(), a.sin(), px, py, random_colour(&mut rng))
    });

    let plane = S * S;
    for y in 0..S {
        for x in 0..S {
            let (fx, fy) = (x as f32 + 0.5, y as f32 + 0.5);
            let shade = grad[0] * (fx - 16.0) + grad[1] * (fy - 16.0);
            let m = pattern.coverage(fx, fy);
            let mut px = [0, 1, 2].map(|c| bg[c] + shade + m * (fg[c] - bg[c]));
            for &(bx, by, br, col) in &blobs {
                let k = cover(((fx - bx).powi(2) + (fy - by).powi(2)).sqrt() - br);
                px = [0, 1, 2].map(|c| px[c] + k * (col[c] - px[c]));
            }
            if let Some((lc, ls, lx, ly, col)) = line {
                // Distance from the line through (lx, ly) with direction (lc, ls), 1 px wide.
                let k = cover((-(fx - lx) * ls + (fy - ly) * lc).abs() - 0.5);
                px = [0, 1, 2].map(|c| px[c] + k * (col[c] - px[c]));
            }
            for (c, &v) in px.iter().enumerate() {
                let noisy = v + 8.0 * rng.normal() as f32;
                dst[c * plane + y * S + x] = noisy.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
}
