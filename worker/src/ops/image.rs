//! Checks and constructors shared by the image kernels.

use bytes::Bytes;
use stoker_api::{DType, Tensor};

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
    Tensor { dtype: DType::Uint8, shape: vec![h, w, c], data: Bytes::from(pixels) }
}
