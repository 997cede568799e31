//! The libjpeg-turbo shim (turbo.c): a JPEG's header, and a window of it decoded at a scale.

use std::ffi::{c_char, c_int, c_uchar, c_ulong};

use super::Window;

/// The shim's message buffer (MESSAGE_BYTES in turbo.c).
const MESSAGE_BYTES: usize = 200;
/// What libjpeg may allocate for one image beyond the output (a progressive image keeps all
/// its coefficients: 2 bytes a sample).
const MAX_MEMORY: c_ulong = 1 << 30;

unsafe extern "C" {
    fn stoker_jpeg_header(
        data: *const c_uchar,
        size: c_ulong,
        height: *mut c_ulong,
        width: *mut c_ulong,
        rgb_or_grey: *mut c_int,
        message: *mut c_char,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn stoker_jpeg_decode(
        data: *const c_uchar,
        size: c_ulong,
        channels: c_int,
        denom: c_int,
        top: c_ulong,
        left: c_ulong,
        height: c_ulong,
        width: c_ulong,
        max_memory: c_ulong,
        out: *mut c_uchar,
        message: *mut c_char,
    ) -> c_int;
}

fn message(buffer: &[u8]) -> String {
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

/// (height, width, whether libjpeg gives it as RGB or grey), or libjpeg's error message.
pub fn header(bytes: &[u8]) -> Result<(usize, usize, bool), String> {
    let (mut height, mut width, mut rgb_or_grey) = (0, 0, 0);
    let mut buffer = [0u8; MESSAGE_BYTES];
    // SAFETY: the shim reads `bytes` within its length, writes the three outputs and at most
    // MESSAGE_BYTES (NUL included) into `buffer`, and keeps no pointer after returning.
    let failed = unsafe {
        stoker_jpeg_header(
            bytes.as_ptr(),
            bytes.len() as c_ulong,
            &mut height,
            &mut width,
            &mut rgb_or_grey,
            buffer.as_mut_ptr().cast(),
        )
    };
    if failed != 0 {
        return Err(message(&buffer));
    }
    Ok((height as usize, width as usize, rgb_or_grey != 0))
}

/// The window of the image scaled by 1/`denom` (1, 2, 4 or 8), as `channels` (1, 3 or 4),
/// row after row; the window is in scaled pixels and must lie inside the scaled image.
pub fn decode(bytes: &[u8], channels: usize, denom: usize, window: Window) -> Result<Vec<u8>, String> {
    assert!(matches!(channels, 1 | 3 | 4) && matches!(denom, 1 | 2 | 4 | 8));
    let len = window.height.checked_mul(window.width).and_then(|n| n.checked_mul(channels));
    let len = len.ok_or("the window's size overflows")?;
    // Not zeroed first: the shim writes every byte before the length is set.
    let mut out = Vec::<u8>::with_capacity(len);
    let mut buffer = [0u8; MESSAGE_BYTES];
    // SAFETY: the shim writes exactly height * width * channels bytes to `out` (it checks the
    // window against the image and the channel count against its output first), at most
    // MESSAGE_BYTES into `buffer`, reads `bytes` within its length, and keeps no pointer.
    let failed = unsafe {
        stoker_jpeg_decode(
            bytes.as_ptr(),
            bytes.len() as c_ulong,
            channels as c_int,
            denom as c_int,
            window.top as c_ulong,
            window.left as c_ulong,
            window.height as c_ulong,
            window.width as c_ulong,
            MAX_MEMORY,
            out.as_mut_ptr(),
            buffer.as_mut_ptr().cast(),
        )
    };
    if failed != 0 {
        return Err(message(&buffer));
    }
    // SAFETY: on success the shim wrote all `len` bytes (above).
    unsafe { out.set_len(len) };
    Ok(out)
}
