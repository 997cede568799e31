//! JPEG decoding. libjpeg-turbo (through the shim in turbo.c) decodes every JPEG it can give
//! as RGB or grey, which is nearly all of them, either whole or only a window of it at a
//! reduced scale (what tf.data's `decode_and_crop_jpeg` does), from only the segments around
//! the window when the JPEG has restart markers (segments.rs); zune-jpeg decodes the rest
//! (CMYK, YCCK). Both treat damage as an error, never as grey-filled pixels. The shim also
//! adds restart markers to a JPEG without loss ([`add_restart_markers`]).

mod segments;
mod turbo;
mod zune;

pub use turbo::Rows;

use super::OpError;
use super::image::check_decoded_size;

/// Larger sides than this are treated as corrupt headers rather than allocated.
pub(super) const MAX_SIDE: usize = 1 << 15;

/// A window of an image, in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub top: usize,
    pub left: usize,
    pub height: usize,
    pub width: usize,
}

/// (height, width, channels, pixels).
pub type Decoded = (usize, usize, usize, Vec<u8>);

/// A JPEG whose header has been read (once: the window is chosen from it before decoding).
pub struct Jpeg<'a> {
    bytes: &'a [u8],
    pub height: usize,
    pub width: usize,
    /// Open in libjpeg when it gives the image as RGB or grey: windows and scales are possible.
    turbo: Option<turbo::Opened<'a>>,
}

impl<'a> Jpeg<'a> {
    /// Reads the header. A stream whose last scan is not followed by its end marker is refused
    /// here: a window decode stops early and would never see the cut.
    pub fn open(bytes: &'a [u8]) -> Result<Self, OpError> {
        if !ends_scans(bytes) {
            return Err(OpError::CorruptImage("JPEG: truncated (no end-of-image marker after the last scan)".into()));
        }
        let opened = turbo::Opened::open(bytes).map_err(libjpeg_error)?;
        let (height, width) = (opened.height, opened.width);
        if height == 0 || width == 0 || height > MAX_SIDE || width > MAX_SIDE {
            return Err(OpError::UnsupportedImage(format!("JPEG of {height}x{width} (at most {MAX_SIDE} a side)")));
        }
        let turbo = opened.rgb_or_grey.then_some(opened);
        Ok(Jpeg { bytes, height, width, turbo })
    }

    /// Whether [`Jpeg::window`] can decode part of it.
    pub fn windows(&self) -> bool {
        self.turbo.is_some()
    }

    /// The whole image as `channels` (1, 3 or 4).
    pub fn decode(self, channels: usize) -> Result<Decoded, OpError> {
        check_decoded_size(self.height, self.width, channels)?;
        let Some(opened) = self.turbo else { return zune::decode(self.bytes, channels) };
        let whole = Window { top: 0, left: 0, height: self.height, width: self.width };
        let rows = opened.decode(channels, 1, whole).map_err(libjpeg_error)?;
        debug_assert!(rows.left == 0 && rows.row_width == self.width);
        Ok((self.height, self.width, channels, rows.pixels))
    }

    /// The size of the image decoded at 1/`denom` (libjpeg rounds up).
    pub fn scaled(&self, denom: usize) -> [usize; 2] {
        [self.height.div_ceil(denom), self.width.div_ceil(denom)]
    }

    /// `window` (in pixels of the image scaled by 1/`denom`: 1, 2, 4 or 8) as `channels`:
    /// rows a little wider than the window (whole iMCU columns), the window's columns from
    /// [`Rows::left`]. Only the rows and columns it covers are transformed, and nothing below
    /// it is read; with restart markers, only the segments around it ([`segments`]). Only
    /// where [`Jpeg::windows`].
    pub fn window(self, channels: usize, denom: usize, window: Window) -> Result<Rows, OpError> {
        let opened = self.turbo.expect("only libjpeg decodes windows");
        check_decoded_size(window.height, window.width, channels)?;
        let whole = Window {
            top: window.top * denom,
            left: window.left * denom,
            height: (window.height * denom).min(self.height.saturating_sub(window.top * denom)),
            width: (window.width * denom).min(self.width.saturating_sub(window.left * denom)),
        };
        let Some(cut) = segments::Segments::find(self.bytes).and_then(|s| s.cut(whole)) else {
            return opened.decode(channels, denom, window).map_err(libjpeg_error);
        };
        drop(opened);
        // The cut starts on an MCU, so on a whole scaled pixel.
        let within = Window { top: window.top - cut.top / denom, left: window.left - cut.left / denom, ..window };
        turbo::Opened::open(&cut.jpeg).and_then(|o| o.decode(channels, denom, within)).map_err(libjpeg_error)
    }
}

/// `bytes` rewritten without loss (the same DCT coefficients, so the same pixels) with a
/// restart marker every few MCUs, at most `segment_px` pixels apart along a row, so that a
/// window is decoded from the segments around it alone ([`segments`]): (the JPEG, MCUs
/// between markers).
pub fn add_restart_markers(bytes: &[u8], segment_px: usize) -> Result<(Vec<u8>, usize), OpError> {
    Jpeg::open(bytes)?;
    turbo::with_restarts(bytes, segment_px).map_err(libjpeg_error)
}

/// libjpeg's message as an error: unsupported codings apart from damage.
fn libjpeg_error(message: String) -> OpError {
    let lower = message.to_ascii_lowercase();
    if lower.contains("unsupported") || lower.contains("not supported") {
        OpError::UnsupportedImage(format!("JPEG: {message}"))
    } else {
        OpError::CorruptImage(format!("JPEG: {message}"))
    }
}

/// Whether the stream ends its scans: scan data byte-stuffs 0xFF, so markers are
/// unambiguous, and the last of SOS (FFDA) and EOI (FFD9) must be EOI. Searching from the end
/// finds it in a few bytes.
fn ends_scans(bytes: &[u8]) -> bool {
    let last = bytes.windows(2).rev().find(|w| w[0] == 0xFF && (w[1] == 0xD9 || w[1] == 0xDA));
    last.is_some_and(|w| w[1] == 0xD9)
}
