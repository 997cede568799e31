//! Checks and constructors shared by the image kernels.

use bytes::Bytes;
use stoker_api::{DType, Layout, Tensor};

use super::OpError;

/// The dimensions of a uint8 HWC image tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub h: usize,
    pub w: usize,
    pub c: usize,
}

impl Dims {
    pub fn of(t: &Tensor) -> Result<Dims, OpError> {
        match (t.dtype, t.shape.as_slice()) {
            (DType::Uint8, &[h, w, c]) if (1..=4).contains(&c) && t.data.len() == h * w * c => Ok(Dims { h, w, c }),
            _ => Err(OpError::NotAnImage { dtype: t.dtype, shape: t.shape.clone() }),
        }
    }

    pub fn row_len(self) -> usize {
        self.w * self.c
    }
}

/// Wraps pixels the kernel itself sized, so the length always matches the shape.
pub(crate) fn image_tensor(h: usize, w: usize, c: usize, pixels: Vec<u8>) -> Tensor {
    debug_assert_eq!(pixels.len(), h * w * c);
    Tensor { dtype: DType::Uint8, shape: vec![h, w, c], data: Bytes::from(pixels), layout: Layout::Dense }
}

/// Refuses to decode an image whose pixels would exceed what one element may hold
/// (`bounds::MAX_ELEMENT_BYTES`): its size comes from the file's header, which a broken or
/// hostile file can set to anything up to 32768 px a side, before any pixel is read.
pub(crate) fn check_decoded_size(h: usize, w: usize, c: usize) -> Result<(), OpError> {
    let limit = stoker_api::bounds::MAX_ELEMENT_BYTES;
    let bytes = (h as u64).saturating_mul(w as u64).saturating_mul(c as u64);
    if bytes > limit {
        return Err(OpError::UnsupportedImage(format!(
            "{h}x{w} with {c} channels decodes to {} MiB, above the {} MiB an element may hold",
            bytes >> 20,
            limit >> 20
        )));
    }
    Ok(())
}
