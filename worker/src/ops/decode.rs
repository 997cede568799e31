//! decodeImage: JPEG or PNG bytes to a uint8 HWC image with 1, 3 or 4 channels.
//!
//! JPEG goes through libjpeg-turbo (`jpeg`), with damage an error rather than a silently
//! grey-filled image, as with tf.io.decode_jpeg and Pillow's defaults. Channel conversion follows Pillow's `convert`: grey is replicated,
//! alpha is dropped or set opaque, and colour to grey uses the ITU-R 601-2 luma weights.

use std::io::Cursor;
use std::panic::{AssertUnwindSafe, catch_unwind};

use stoker_api::Tensor;

use super::OpError;
use super::image::{check_decoded_size, image_tensor};
use super::jpeg::{Decoded, Jpeg, MAX_SIDE};

pub fn decode_image(bytes: &[u8], channels: u8) -> Result<Tensor, OpError> {
    let channels = usize::from(channels);
    if !matches!(channels, 1 | 3 | 4) {
        return Err(OpError::InvalidParameter(format!("channels must be 1, 3 or 4, got {channels}")));
    }
    // Both decoders are fuzzed, but a panic in one must still cost one element, not the worker.
    let decoded = catch_unwind(AssertUnwindSafe(|| match sniff(bytes) {
        Format::Jpeg => decode_jpeg(bytes, channels),
        Format::Png => decode_png(bytes),
        Format::Other(name) => Err(OpError::UnsupportedImage(format!("{name} is not decoded"))),
        Format::Unknown => Err(OpError::CorruptImage("neither a JPEG nor a PNG signature".into())),
    }))
    .map_err(|_| OpError::CorruptImage("the decoder panicked".into()))?;
    let (h, w, c, pixels) = decoded?;
    Ok(image_tensor(h, w, channels, convert_channels(pixels, c, channels)))
}

pub(super) enum Format {
    Jpeg,
    Png,
    Other(&'static str),
    Unknown,
}

pub(super) fn sniff(bytes: &[u8]) -> Format {
    match bytes {
        [0xFF, 0xD8, 0xFF, ..] => Format::Jpeg,
        [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A, ..] => Format::Png,
        [b'G', b'I', b'F', b'8', ..] => Format::Other("GIF"),
        [b'B', b'M', ..] => Format::Other("BMP"),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => Format::Other("WebP"),
        _ => Format::Unknown,
    }
}

/// Whether `bytes` start as a JPEG does (what decodeImage decodes as one).
pub fn is_jpeg(bytes: &[u8]) -> bool {
    matches!(sniff(bytes), Format::Jpeg)
}

fn decode_jpeg(bytes: &[u8], channels: usize) -> Result<Decoded, OpError> {
    Jpeg::open(bytes)?.decode(channels)
}

fn decode_png(bytes: &[u8]) -> Result<Decoded, OpError> {
    let corrupt = |e: png::DecodingError| OpError::CorruptImage(format!("PNG: {e}"));
    let mut decoder = png::Decoder::new(Cursor::new(bytes));
    // Palette and tRNS expand to RGB(A), 16-bit keeps its high byte, as Pillow does.
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().map_err(corrupt)?;
    let (h, w) = (reader.info().height as usize, reader.info().width as usize);
    if h > MAX_SIDE || w > MAX_SIDE {
        return Err(OpError::UnsupportedImage(format!("PNG of {h}x{w} is too large")));
    }
    let size = reader.output_buffer_size().ok_or_else(|| OpError::UnsupportedImage("PNG: size overflows".into()))?;
    check_decoded_size(h, w, size / (h * w).max(1))?;
    let mut pixels = vec![0; size];
    let frame = reader.next_frame(&mut pixels).map_err(corrupt)?;
    let c = frame.color_type.samples();
    pixels.truncate(frame.buffer_size());
    if frame.bit_depth != png::BitDepth::Eight || pixels.len() != h * w * c {
        return Err(OpError::UnsupportedImage(format!("PNG: {:?} {:?}", frame.color_type, frame.bit_depth)));
    }
    Ok((h, w, c, pixels))
}

/// Pillow's L = (19595 R + 38470 G + 7471 B + 2^15) >> 16, i.e. 0.299/0.587/0.114 in 16-bit
/// fixed point with weights summing to exactly 2^16, so white stays 255.
fn luma(r: u8, g: u8, b: u8) -> u8 {
    ((19595 * u32::from(r) + 38470 * u32::from(g) + 7471 * u32::from(b) + 0x8000) >> 16) as u8
}

/// From 1 (L), 2 (LA), 3 (RGB) or 4 (RGBA) channels to 1, 3 or 4.
pub(crate) fn convert_channels(pixels: Vec<u8>, from: usize, to: usize) -> Vec<u8> {
    if from == to {
        return pixels;
    }
    let n = pixels.len() / from;
    let mut out = Vec::with_capacity(n * to);
    for p in pixels.chunks_exact(from) {
        let (rgb, alpha) = match from {
            1 => ([p[0]; 3], 255),
            2 => ([p[0]; 3], p[1]),
            3 => ([p[0], p[1], p[2]], 255),
            _ => ([p[0], p[1], p[2]], p[3]),
        };
        match to {
            1 if from <= 2 => out.push(p[0]),
            1 => out.push(luma(rgb[0], rgb[1], rgb[2])),
            3 => out.extend_from_slice(&rgb),
            _ => out.extend_from_slice(&[rgb[0], rgb[1], rgb[2], alpha]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_conversions_follow_pillow() {
        assert_eq!(convert_channels(vec![7, 9], 1, 3), vec![7, 7, 7, 9, 9, 9]);
        assert_eq!(convert_channels(vec![7, 100], 2, 4), vec![7, 7, 7, 100]);
        assert_eq!(convert_channels(vec![1, 2, 3, 4], 4, 3), vec![1, 2, 3]);
        assert_eq!(convert_channels(vec![255, 255, 255], 3, 1), vec![255]);
        assert_eq!(convert_channels(vec![255, 0, 0], 3, 1), vec![76]);
        assert_eq!(convert_channels(vec![1, 2, 3], 3, 4), vec![1, 2, 3, 255]);
    }

    #[test]
    fn unknown_and_unsupported_formats_are_typed_errors() {
        assert!(matches!(decode_image(b"", 3), Err(OpError::CorruptImage(_))));
        assert!(matches!(decode_image(b"GIF89a....", 3), Err(OpError::UnsupportedImage(_))));
        assert!(matches!(decode_image(b"\xFF\xD8\xFF", 2), Err(OpError::InvalidParameter(_))));
    }
}
