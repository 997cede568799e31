//! zune-jpeg, for the JPEGs libjpeg cannot give as RGB or grey (CMYK and YCCK), in strict
//! mode so damage is an error rather than grey.

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use super::MAX_SIDE;
use crate::ops::OpError;

/// (height, width, channels, pixels) with 1 (grey), 3 or 4 channels as `channels` asks.
pub fn decode(bytes: &[u8], channels: usize) -> Result<(usize, usize, usize, Vec<u8>), OpError> {
    let out = match channels {
        1 => ColorSpace::Luma,
        4 => ColorSpace::RGBA,
        _ => ColorSpace::RGB,
    };
    let options = DecoderOptions::new_fast()
        .set_strict_mode(true)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE)
        .jpeg_set_out_colorspace(out);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    // Valid but unimplemented codings (arithmetic, 12-bit, ...) count apart from damage.
    let corrupt = |e: zune_jpeg::errors::DecodeErrors| match e {
        zune_jpeg::errors::DecodeErrors::Unsupported(u) => OpError::UnsupportedImage(format!("JPEG: {u:?}")),
        e => OpError::CorruptImage(format!("JPEG: {e:?}")),
    };
    let pixels = decoder.decode().map_err(corrupt)?;
    let info = decoder.info().ok_or_else(|| OpError::CorruptImage("JPEG: no header".into()))?;
    let c = decoder.output_colorspace().map_or(0, |cs| cs.num_components());
    let (h, w) = (usize::from(info.height), usize::from(info.width));
    if h == 0 || w == 0 || !(1..=4).contains(&c) || pixels.len() != h * w * c {
        return Err(OpError::CorruptImage(format!("JPEG: {} bytes for {h}x{w}x{c}", pixels.len())));
    }
    Ok((h, w, c, pixels))
}
