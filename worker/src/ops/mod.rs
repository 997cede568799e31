//! Transform kernels: pure functions from tensors to tensors. They know nothing of fields,
//! elements or pipelines, so the engine can run them on any thread and tests can check them
//! against reference implementations in isolation.
//!
//! Images are uint8 tensors of shape [height, width, channels] with 1, 3 or 4 channels.

mod cast;
mod crop;
mod decode;
mod decode_crop;
mod flip;
mod image;
mod jpeg;
mod normalize;
mod resize;
mod rng;
mod tokenize;

pub use cast::cast;
pub use crop::{CropBox, center_crop, crop, random_resized_crop, random_resized_crop_box};
pub use decode::{decode_image, is_jpeg};
pub use decode_crop::{Finish, ForCrop, decode_for_crop, resize_crop};
pub use flip::{Flips, flip_horizontal, flip_vertical, flips, random_flip};
pub use jpeg::add_restart_markers;
pub use normalize::{Tables, normalize};
pub use resize::{resize, resize_exact, resize_shorter_side, shorter_side_size};
pub use rng::{ElementRng, element_rng};
pub use tokenize::tokenize;

#[cfg(test)]
pub(crate) use decode_crop::tests::{jpeg, jpeg_restarting};

use stoker_api::DType;

/// Why an op rejected its input. Variants are coarse on purpose: the engine counts failures
/// per [`OpError::reason`], and the message carries the detail for the log.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    #[error("corrupt image: {0}")]
    CorruptImage(String),
    #[error("unsupported image: {0}")]
    UnsupportedImage(String),
    #[error("image of {have:?} (height, width) is smaller than the requested {want:?}")]
    TooSmall { have: [usize; 2], want: [usize; 2] },
    #[error("output of {want:?} (height, width) is above the limit of {limit} px per side")]
    TooLarge { want: [usize; 2], limit: u32 },
    #[error("expected {expected} channel values, got {actual}")]
    ChannelMismatch { expected: usize, actual: usize },
    #[error("expected a uint8 [height, width, channels] image, got {dtype:?} {shape:?}")]
    NotAnImage { dtype: DType, shape: Vec<usize> },
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),
    #[error("text the tokenizer cannot take: {0}")]
    InvalidText(String),
}

impl OpError {
    /// Whether the image could not be decoded, as opposed to an op refusing a decoded one.
    pub fn is_decoding(&self) -> bool {
        matches!(self, OpError::CorruptImage(_) | OpError::UnsupportedImage(_))
    }

    /// A stable label for metrics, one per variant.
    pub fn reason(&self) -> &'static str {
        match self {
            OpError::CorruptImage(_) => "corrupt_image",
            OpError::UnsupportedImage(_) => "unsupported_image",
            OpError::TooSmall { .. } => "too_small",
            OpError::TooLarge { .. } => "too_large",
            OpError::ChannelMismatch { .. } => "channel_mismatch",
            OpError::NotAnImage { .. } => "not_an_image",
            OpError::InvalidParameter(_) => "invalid_parameter",
            OpError::InvalidText(_) => "invalid_text",
        }
    }
}
