//! JPEG and PNG bytes to 8-bit RGB, with `zune-jpeg` and `png` (the decoders the `image`
//! crate itself wraps, without its colour-management and format machinery, which took a
//! third of the first build's dependency time).
//!
//! The result is what `image`'s `decode().into_rgb8()` gives, checked on all 10,000 CIFAR-10
//! test JPEGs and a PNG of every colour type and depth (see `tests/io/data.rs`):
//! - JPEG: grey, grey+alpha, RGB and RGBA are decoded as such, anything else (YCbCr, CMYK,
//!   YCCK) as RGB; grey is copied to the three channels and alpha dropped.
//! - PNG: palettes and tRNS expanded, depths below 8 scaled up (the `png` crate's EXPAND),
//!   16-bit samples rounded to 8 bits as `(v + 128) / 257` (= round(v·255/65535)); grey
//!   copied to three channels and alpha dropped.
//!
//! No EXIF orientation or ICC profile is applied (neither did hemi's earlier decoder).

use std::io::Cursor;

/// What the bytes are, from their first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Jpeg,
    Png,
}

/// Why a decode failed: `Unrecognised` (neither JPEG nor PNG), `TooLarge` (a side or the
/// decoded size over the limits; the message says which), or the decoder's message.
#[derive(Debug)]
pub(crate) enum DecodeError {
    Unrecognised,
    TooLarge(String),
    Invalid(String),
}

/// Limits: the longest side in pixels, and the most bytes a decoded image may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_side: u32,
    pub max_bytes: u64,
}

pub(crate) fn format(bytes: &[u8]) -> Option<Format> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(Format::Png)
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(Format::Jpeg)
    } else {
        None
    }
}

fn check_size(w: u64, h: u64, channels: u64, limits: Limits) -> Result<(), DecodeError> {
    let side = u64::from(limits.max_side);
    if w > side || h > side {
        return Err(DecodeError::TooLarge(format!(
            "{w}x{h} pixels: a side is longer than the {side}-pixel limit"
        )));
    }
    let bytes = w * h * channels;
    if bytes > limits.max_bytes {
        return Err(DecodeError::TooLarge(format!(
            "{w}x{h} pixels decode to {bytes} bytes, more than the {}-byte limit",
            limits.max_bytes
        )));
    }
    Ok(())
}

/// (width, height) from the header alone.
pub(crate) fn dimensions(bytes: &[u8], limits: Limits) -> Result<(u32, u32), DecodeError> {
    match format(bytes).ok_or(DecodeError::Unrecognised)? {
        Format::Jpeg => {
            let mut d = jpeg_decoder(bytes, limits);
            d.decode_headers().map_err(jpeg_error)?;
            let (w, h) = d.dimensions().ok_or_else(|| invalid("no frame header"))?;
            Ok((w as u32, h as u32))
        }
        Format::Png => {
            let mut d = png_decoder(bytes, limits);
            let info = d.read_header_info().map_err(png_error)?;
            Ok((info.width, info.height))
        }
    }
}

/// Decodes to (width, height, RGB bytes row-major, three per pixel).
pub(crate) fn decode_rgb8(
    bytes: &[u8],
    limits: Limits,
) -> Result<(u32, u32, Vec<u8>), DecodeError> {
    match format(bytes).ok_or(DecodeError::Unrecognised)? {
        Format::Jpeg => decode_jpeg(bytes, limits),
        Format::Png => decode_png(bytes, limits),
    }
}

fn invalid(msg: impl Into<String>) -> DecodeError {
    DecodeError::Invalid(msg.into())
}

fn jpeg_error(e: zune_jpeg::errors::DecodeErrors) -> DecodeError {
    DecodeError::Invalid(format!("JPEG: {e}"))
}

fn png_error(e: png::DecodingError) -> DecodeError {
    match e {
        png::DecodingError::LimitsExceeded => DecodeError::TooLarge(
            "the PNG needs more memory to decode than the decoding limit".into(),
        ),
        e => DecodeError::Invalid(format!("PNG: {e}")),
    }
}

fn jpeg_decoder(
    bytes: &[u8],
    limits: Limits,
) -> zune_jpeg::JpegDecoder<zune_core::bytestream::ZCursor<&[u8]>> {
    let options = zune_core::options::DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(limits.max_side as usize)
        .set_max_height(limits.max_side as usize);
    zune_jpeg::JpegDecoder::new_with_options(zune_core::bytestream::ZCursor::new(bytes), options)
}

fn decode_jpeg(bytes: &[u8], limits: Limits) -> Result<(u32, u32, Vec<u8>), DecodeError> {
    use zune_core::colorspace::ColorSpace;
    let mut d = jpeg_decoder(bytes, limits);
    d.decode_headers().map_err(jpeg_error)?;
    let (w, h) = d.dimensions().ok_or_else(|| invalid("no frame header"))?;
    let input = d
        .input_colorspace()
        .ok_or_else(|| invalid("no colour space"))?;
    let out = match input {
        ColorSpace::RGB | ColorSpace::RGBA | ColorSpace::Luma | ColorSpace::LumaA => input,
        _ => ColorSpace::RGB,
    };
    let channels = out.num_components();
    check_size(w as u64, h as u64, channels as u64, limits)?;
    d.set_options(d.options().jpeg_set_out_colorspace(out));
    let pixels = d.decode().map_err(jpeg_error)?;
    if pixels.len() != w * h * channels {
        return Err(invalid(format!(
            "JPEG: {} decoded bytes for {w}x{h} pixels of {channels} channels",
            pixels.len()
        )));
    }
    Ok((w as u32, h as u32, to_rgb8(&pixels, channels, false)))
}

fn png_decoder(bytes: &[u8], limits: Limits) -> png::Decoder<Cursor<&[u8]>> {
    let max = usize::try_from(limits.max_bytes).unwrap_or(usize::MAX);
    png::Decoder::new_with_limits(Cursor::new(bytes), png::Limits { bytes: max })
}

fn decode_png(bytes: &[u8], limits: Limits) -> Result<(u32, u32, Vec<u8>), DecodeError> {
    let mut d = png_decoder(bytes, limits);
    let info = d.read_header_info().map_err(png_error)?;
    let (w, h) = (info.width, info.height);
    check_size(u64::from(w), u64::from(h), 1, limits)?;
    d.set_transformations(png::Transformations::EXPAND);
    let mut reader = d.read_info().map_err(png_error)?;
    let (color, depth) = reader.output_color_type();
    let channels = match color {
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Indexed => return Err(invalid("PNG: palette not expanded")),
    };
    let wide = match depth {
        png::BitDepth::Eight => false,
        png::BitDepth::Sixteen => true,
        d => return Err(invalid(format!("PNG: {d:?}-bit samples not expanded"))),
    };
    let sample = if wide { 2 } else { 1 };
    check_size(u64::from(w), u64::from(h), channels as u64 * sample, limits)?;
    let len = reader.output_buffer_size().ok_or_else(|| {
        DecodeError::TooLarge(format!("{w}x{h} pixels overflow the address space"))
    })?;
    let mut buf = vec![0u8; len];
    let frame = reader.next_frame(&mut buf).map_err(png_error)?;
    buf.truncate(frame.buffer_size());
    let (w_us, h_us) = (w as usize, h as usize);
    if buf.len() != w_us * h_us * channels * sample as usize {
        return Err(invalid(format!(
            "PNG: {} decoded bytes for {w}x{h} pixels of {channels} channels",
            buf.len()
        )));
    }
    Ok((w, h, to_rgb8(&buf, channels, wide)))
}

/// Interleaved samples of 1–4 channels (grey, grey+alpha, RGB, RGBA), 8-bit or 16-bit
/// big-endian, to 8-bit RGB.
fn to_rgb8(src: &[u8], channels: usize, wide: bool) -> Vec<u8> {
    if channels == 3 && !wide {
        return src.to_vec();
    }
    let sample = if wide { 2 } else { 1 };
    let px = src.len() / (channels * sample);
    let at = |i: usize| -> u8 {
        if wide {
            let v = u32::from(u16::from_be_bytes([src[2 * i], src[2 * i + 1]]));
            ((v + 128) / 257) as u8
        } else {
            src[i]
        }
    };
    let mut out = Vec::with_capacity(px * 3);
    for p in 0..px {
        let base = p * channels;
        if channels < 3 {
            let g = at(base);
            out.extend_from_slice(&[g, g, g]);
        } else {
            out.extend_from_slice(&[at(base), at(base + 1), at(base + 2)]);
        }
    }
    out
}
