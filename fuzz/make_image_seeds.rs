//! Writes the image fuzz target's seeds: tiny PNGs and JPEGs of each colour type the image
//! folder converts. Run from fuzz/ as a throwaway crate depending on image 0.25 (jpeg, png):
//! `cargo run -- seeds/image`.
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::{ExtendedColorType, ImageEncoder};

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("output dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let px = |n: usize| (0..n).map(|i| (i * 37 % 256) as u8).collect::<Vec<u8>>();
    let png = |name: &str, w: u32, h: u32, t: ExtendedColorType, ch: usize| {
        let mut out = Vec::new();
        PngEncoder::new_with_quality(&mut out, CompressionType::Fast, FilterType::Paeth)
            .write_image(&px(w as usize * h as usize * ch), w, h, t)
            .unwrap();
        std::fs::write(dir.join(name), out).unwrap();
    };
    png("rgb.png", 4, 3, ExtendedColorType::Rgb8, 3);
    png("grey.png", 5, 2, ExtendedColorType::L8, 1);
    png("grey_alpha.png", 2, 2, ExtendedColorType::La8, 2);
    png("rgba.png", 3, 3, ExtendedColorType::Rgba8, 4);
    png("deep.png", 2, 3, ExtendedColorType::Rgb16, 6);
    let jpg = |name: &str, w: u32, h: u32, t: ExtendedColorType, ch: usize| {
        let mut out = Vec::new();
        JpegEncoder::new_with_quality(&mut out, 75)
            .write_image(&px(w as usize * h as usize * ch), w, h, t)
            .unwrap();
        std::fs::write(dir.join(name), out).unwrap();
    };
    jpg("rgb.jpg", 8, 8, ExtendedColorType::Rgb8, 3);
    jpg("odd.jpg", 9, 7, ExtendedColorType::Rgb8, 3);
    jpg("grey.jpg", 8, 8, ExtendedColorType::L8, 1);
    jpg("wide.jpg", 17, 2, ExtendedColorType::Rgb8, 3);
}
