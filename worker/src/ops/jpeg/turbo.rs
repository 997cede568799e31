//! The libjpeg-turbo shim (turbo.c): a JPEG opened once for its header, then a window of it
//! decoded at a scale, straight into the output; and a JPEG rewritten with restart markers.

use std::ffi::{CStr, c_char, c_int, c_uchar, c_ulong};
use std::ptr::NonNull;

use super::Window;

/// What libjpeg may allocate for one image beyond the output (a progressive image keeps all
/// its coefficients: 2 bytes a sample).
const MAX_MEMORY: c_ulong = 1 << 30;

/// turbo.c's `struct stoker_jpeg`, opaque here.
#[repr(C)]
struct Handle {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn stoker_jpeg_open(
        data: *const c_uchar,
        size: c_ulong,
        max_memory: c_ulong,
        height: *mut c_ulong,
        width: *mut c_ulong,
        rgb_or_grey: *mut c_int,
        failed: *mut c_int,
    ) -> *mut Handle;
    fn stoker_jpeg_message(j: *const Handle) -> *const c_char;
    #[allow(clippy::too_many_arguments)]
    fn stoker_jpeg_start(
        j: *mut Handle,
        channels: c_int,
        denom: c_int,
        top: c_ulong,
        left: c_ulong,
        height: c_ulong,
        width: c_ulong,
        row_width: *mut c_ulong,
        shift: *mut c_ulong,
    ) -> c_int;
    fn stoker_jpeg_read(j: *mut Handle, out: *mut c_uchar, rows: c_ulong, stride: c_ulong) -> c_int;
    fn stoker_jpeg_free(j: *mut Handle);
    #[allow(clippy::too_many_arguments)]
    fn stoker_jpeg_restart(
        data: *const c_uchar,
        size: c_ulong,
        max_memory: c_ulong,
        segment_px: c_ulong,
        out: *mut *mut c_uchar,
        out_size: *mut c_ulong,
        interval: *mut c_ulong,
        message: *mut c_char,
    ) -> c_int;
    fn stoker_jpeg_free_bytes(bytes: *mut c_uchar);
}

/// turbo.c's MESSAGE_BYTES.
const MESSAGE_BYTES: usize = 200;

/// `bytes` rewritten without loss as one sequential scan with a restart marker every
/// `interval` MCUs, each segment at most `segment_px` pixels wide and every row of MCUs whole
/// segments (turbo.c's `stoker_jpeg_restart`): (the JPEG, interval).
pub fn with_restarts(bytes: &[u8], segment_px: usize) -> Result<(Vec<u8>, usize), String> {
    let (mut out, mut out_size, mut interval) = (std::ptr::null_mut(), 0, 0);
    let mut message: [c_char; MESSAGE_BYTES] = [0; MESSAGE_BYTES];
    // SAFETY: the shim reads `bytes` within its length, writes at most MESSAGE_BYTES of
    // message, and on success hands over a malloc'd buffer of `out_size` bytes, freed below.
    let failed = unsafe {
        stoker_jpeg_restart(
            bytes.as_ptr(),
            bytes.len() as c_ulong,
            MAX_MEMORY,
            segment_px as c_ulong,
            &mut out,
            &mut out_size,
            &mut interval,
            message.as_mut_ptr(),
        )
    };
    if failed != 0 {
        // SAFETY: the shim wrote a NUL-terminated message.
        return Err(unsafe { CStr::from_ptr(message.as_ptr()) }.to_string_lossy().into_owned());
    }
    // SAFETY: on success `out` holds `out_size` bytes, copied out before it is freed.
    let jpeg = unsafe { std::slice::from_raw_parts(out, out_size as usize) }.to_vec();
    // SAFETY: `out` came from the shim's malloc and is freed once.
    unsafe { stoker_jpeg_free_bytes(out) };
    Ok((jpeg, interval as usize))
}

/// A JPEG whose header libjpeg has read; it borrows the bytes libjpeg reads from.
pub struct Opened<'a> {
    handle: NonNull<Handle>,
    _bytes: std::marker::PhantomData<&'a [u8]>,
    pub height: usize,
    pub width: usize,
    /// libjpeg gives it as RGB or grey (not CMYK or YCCK).
    pub rgb_or_grey: bool,
}

/// Decoded rows of a window: each `row_width` pixels wide (libjpeg decodes whole iMCU
/// columns), the window's own columns starting at `left`.
pub struct Rows {
    pub pixels: Vec<u8>,
    pub row_width: usize,
    pub left: usize,
}

impl Drop for Opened<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from stoker_jpeg_open and is freed once, here.
        unsafe { stoker_jpeg_free(self.handle.as_ptr()) }
    }
}

// SAFETY: the handle is owned (no other pointer to it) and libjpeg's state is not tied to a
// thread; only `&mut self` methods use it.
unsafe impl Send for Opened<'_> {}

impl<'a> Opened<'a> {
    /// Reads the header of `bytes`, or gives libjpeg's error message.
    pub fn open(bytes: &'a [u8]) -> Result<Self, String> {
        let (mut height, mut width, mut rgb_or_grey, mut failed) = (0, 0, 0, 0);
        // SAFETY: the shim reads `bytes` within its length and keeps a pointer to them only
        // inside the handle, which borrows them for 'a; it writes the four outputs.
        let handle = unsafe {
            stoker_jpeg_open(
                bytes.as_ptr(),
                bytes.len() as c_ulong,
                MAX_MEMORY,
                &mut height,
                &mut width,
                &mut rgb_or_grey,
                &mut failed,
            )
        };
        let handle = NonNull::new(handle).ok_or("out of memory opening the JPEG")?;
        let opened = Opened {
            handle,
            _bytes: std::marker::PhantomData,
            height: height as usize,
            width: width as usize,
            rgb_or_grey: rgb_or_grey != 0,
        };
        if failed != 0 {
            return Err(opened.message());
        }
        Ok(opened)
    }

    fn message(&self) -> String {
        // SAFETY: the handle's message is a NUL-terminated buffer inside it.
        unsafe { CStr::from_ptr(stoker_jpeg_message(self.handle.as_ptr())) }.to_string_lossy().into_owned()
    }

    /// Decodes the window of the image scaled by 1/`denom` (1, 2, 4 or 8), as `channels` (1,
    /// 3 or 4); the window is in scaled pixels and must lie inside the scaled image. A handle
    /// decodes once.
    pub fn decode(self, channels: usize, denom: usize, window: Window) -> Result<Rows, String> {
        assert!(matches!(channels, 1 | 3 | 4) && matches!(denom, 1 | 2 | 4 | 8));
        let (mut row_width, mut shift) = (0, 0);
        let j = self.handle.as_ptr();
        // SAFETY: the handle is alive and owned; the shim writes the two outputs.
        let failed = unsafe {
            stoker_jpeg_start(
                j,
                channels as c_int,
                denom as c_int,
                window.top as c_ulong,
                window.left as c_ulong,
                window.height as c_ulong,
                window.width as c_ulong,
                &mut row_width,
                &mut shift,
            )
        };
        if failed != 0 {
            return Err(self.message());
        }
        let (row_width, left) = (row_width as usize, shift as usize);
        debug_assert!(left + window.width <= row_width);
        let stride = row_width * channels;
        let len = window.height.checked_mul(stride).ok_or("the window's size overflows")?;
        // Not zeroed first: the shim writes every row before the length is set.
        let mut pixels = Vec::<u8>::with_capacity(len);
        // SAFETY: the shim writes `window.height` rows of `row_width * channels` bytes (the
        // output width libjpeg reported above), `stride` apart, inside `len` bytes.
        let failed = unsafe { stoker_jpeg_read(j, pixels.as_mut_ptr(), window.height as c_ulong, stride as c_ulong) };
        if failed != 0 {
            return Err(self.message());
        }
        // SAFETY: on success every row, so all `len` bytes, was written (above).
        unsafe { pixels.set_len(len) };
        Ok(Rows { pixels, row_width, left })
    }
}
