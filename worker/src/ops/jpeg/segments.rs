//! Cutting a rectangle out of a JPEG with restart markers, before decoding anything.
//!
//! Entropy decoding is sequential: to reach a crop's window libjpeg must decode every MCU
//! above it and beside it, and that is most of the time a large image takes. A restart marker
//! resets the decoder (the DC predictions start again at zero), so the entropy-coded data
//! between two markers, a segment, decodes on its own. When every row of MCUs is whole
//! segments (as `stoker-worker restart-jpegs` writes them), the segments covering a rectangle
//! of MCUs are themselves a JPEG: the same tables, a frame the rectangle's size, the same
//! restart interval, and those segments with their markers renumbered. Decoding that JPEG
//! entropy-decodes only the rectangle.
//!
//! The rectangle keeps one MCU beyond the window on every side the image goes on, because
//! libjpeg's chroma upsampling reads one sample past what it outputs: so the window's pixels
//! are exactly those of the whole image.

use super::Window;

/// A JPEG's frame, and where each of its segments is.
pub struct Segments<'a> {
    bytes: &'a [u8],
    /// Where the frame header (SOF0 or SOF1) starts.
    frame: usize,
    /// Where the header (everything up to the entropy-coded data) ends.
    header_end: usize,
    /// Each segment's entropy-coded bytes, without the marker after it.
    spans: Vec<(usize, usize)>,
    height: usize,
    width: usize,
    /// An MCU's height and width in pixels.
    mcu: [usize; 2],
    /// MCU rows and columns.
    grid: [usize; 2],
    /// A segment's height and width in MCUs: part of one row, or whole rows.
    segment: [usize; 2],
}

/// A rectangle of the image as a JPEG of its own, and where it starts in the image, in pixels.
pub struct Cut {
    pub jpeg: Vec<u8>,
    pub top: usize,
    pub left: usize,
}

const SOI: u8 = 0xD8;
const EOI: u8 = 0xD9;
const SOS: u8 = 0xDA;
const DRI: u8 = 0xDD;
const RST0: u8 = 0xD0;

impl<'a> Segments<'a> {
    /// The segments of a sequential JPEG with one scan of all its components and a restart
    /// interval that fits its rows of MCUs; `None` for any other JPEG, which is decoded the
    /// usual way (so is a damaged one: this only looks, and libjpeg reports the damage).
    pub fn find(bytes: &'a [u8]) -> Option<Self> {
        let u16_at =
            |i: usize| -> Option<usize> { Some(usize::from(*bytes.get(i)?) << 8 | usize::from(*bytes.get(i + 1)?)) };
        if bytes.get(..2)? != [0xFF, SOI] {
            return None;
        }
        let (mut at, mut frame, mut interval) = (2, None, 0);
        let (header_end, components) = loop {
            if bytes.get(at)? != &0xFF {
                return None;
            }
            let marker = *bytes.get(at + 1)?;
            if marker == 0xFF {
                at += 1; // a fill byte
                continue;
            }
            let end = at + 2 + u16_at(at + 2)?;
            match marker {
                // Baseline and extended sequential, Huffman-coded: every other frame (progressive,
                // lossless, arithmetic) is decoded the usual way.
                0xC0 | 0xC1 => frame = Some(at),
                0xC2 | 0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => return None,
                DRI => interval = u16_at(at + 4)?,
                SOS => break (end, usize::from(*bytes.get(at + 4)?)),
                0xD0..=0xD9 | 0x01 => return None,
                _ => {}
            }
            at = end;
        };
        let frame = frame?;
        let (height, width) = (u16_at(frame + 5)?, u16_at(frame + 7)?);
        let count = usize::from(*bytes.get(frame + 9)?);
        if interval == 0 || height == 0 || width == 0 || count == 0 || components != count {
            return None;
        }
        let factors: Vec<(usize, usize)> = (0..count)
            .map(|c| bytes.get(frame + 11 + 3 * c).map(|f| (usize::from(f >> 4), usize::from(f & 15))))
            .collect::<Option<_>>()?;
        let h_max = factors.iter().map(|f| f.0).max()?;
        let v_max = factors.iter().map(|f| f.1).max()?;
        if factors.iter().any(|&(h, v)| h == 0 || v == 0) {
            return None;
        }
        // One component is coded a block at a time whatever its factors; several, an MCU at a time.
        let mcu = if count == 1 { [8, 8] } else { [8 * v_max, 8 * h_max] };
        let grid = [height.div_ceil(mcu[0]), width.div_ceil(mcu[1])];
        let segment = if grid[1] % interval == 0 {
            [1, interval]
        } else if interval % grid[1] == 0 {
            [interval / grid[1], grid[1]]
        } else {
            return None;
        };
        let spans = spans(bytes, header_end, (grid[0] * grid[1]).div_ceil(interval))?;
        Some(Segments { bytes, frame, header_end, spans, height, width, mcu, grid, segment })
    }

    /// The smallest rectangle of whole segments holding `window` (in pixels of the whole
    /// image) and one MCU more on each side the image goes on, as a JPEG; `None` when that is
    /// the whole image.
    pub fn cut(&self, window: Window) -> Option<Cut> {
        let [mcu_h, mcu_w] = self.mcu;
        let [seg_h, seg_w] = self.segment;
        let rows = span(window.top, window.height, mcu_h, seg_h, self.grid[0]);
        let columns = span(window.left, window.width, mcu_w, seg_w, self.grid[1]);
        if rows == (0, self.grid[0]) && columns == (0, self.grid[1]) {
            return None;
        }
        let (top, left) = (rows.0 * mcu_h, columns.0 * mcu_w);
        let height = (rows.1 * mcu_h).min(self.height) - top;
        let width = (columns.1 * mcu_w).min(self.width) - left;
        let mut jpeg = Vec::with_capacity(self.header_end + 2 * self.bytes.len() / 3);
        jpeg.extend_from_slice(&self.bytes[..self.header_end]);
        // Both fit: the rectangle is no larger than the frame they replace.
        jpeg[self.frame + 5..self.frame + 9].copy_from_slice(&[
            (height >> 8) as u8,
            height as u8,
            (width >> 8) as u8,
            width as u8,
        ]);
        let per_row = self.grid[1] / seg_w;
        let mut n = 0;
        for segment_row in rows.0 / seg_h..rows.1.div_ceil(seg_h) {
            for segment_column in columns.0 / seg_w..columns.1 / seg_w {
                if n > 0 {
                    jpeg.extend_from_slice(&[0xFF, RST0 + ((n - 1) % 8) as u8]);
                }
                let (start, end) = self.spans[segment_row * per_row + segment_column];
                jpeg.extend_from_slice(&self.bytes[start..end]);
                n += 1;
            }
        }
        jpeg.extend_from_slice(&[0xFF, EOI]);
        Some(Cut { jpeg, top, left })
    }
}

/// The MCUs [first, end) holding pixels [start, start + len) and one MCU more on each side
/// (within `total` MCUs), widened to whole segments of `segment` MCUs.
fn span(start: usize, len: usize, mcu: usize, segment: usize, total: usize) -> (usize, usize) {
    let first = (start / mcu).saturating_sub(1) / segment * segment;
    let end = ((start + len).div_ceil(mcu) + 1).min(total);
    (first, end.div_ceil(segment).saturating_mul(segment).min(total))
}

/// The `expected` segments of the entropy-coded data from `from`: each ends at a restart
/// marker numbered in turn, the last at the end-of-image marker. Any other marker, or another
/// count, and the JPEG is not cut.
fn spans(bytes: &[u8], from: usize, expected: usize) -> Option<Vec<(usize, usize)>> {
    // Each segment but the last ends with a 2-byte marker: a header claiming more segments
    // than that is refused before anything is allocated for them.
    if expected > bytes.len() / 2 {
        return None;
    }
    let mut spans = Vec::with_capacity(expected);
    let (mut start, mut at) = (from, from);
    loop {
        at += memchr::memchr(0xFF, bytes.get(at..)?)?;
        match *bytes.get(at + 1)? {
            // A stuffed 0xFF byte of data, or a fill byte before a marker.
            0x00 => at += 2,
            0xFF => at += 1,
            marker @ RST0..=0xD7 => {
                if spans.len() + 1 >= expected || usize::from(marker - RST0) != spans.len() % 8 {
                    return None;
                }
                spans.push((start, at));
                (start, at) = (at + 2, at + 2);
            }
            EOI => {
                spans.push((start, at));
                return (spans.len() == expected).then_some(spans);
            }
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use jpeg_encoder::{ColorType, SamplingFactor};

    use super::super::{Jpeg, add_restart_markers, turbo};
    use super::*;
    use crate::ops::{decode_image, jpeg_restarting};
    use crate::shuffle::SplitMix64;

    /// 156x97: neither side a whole number of MCUs; 20 or 10 MCUs a row.
    const W: usize = 156;
    const H: usize = 97;

    fn kinds() -> Vec<(&'static str, ColorType, SamplingFactor)> {
        vec![
            ("4:4:4", ColorType::Rgb, SamplingFactor::F_1_1),
            ("4:2:2", ColorType::Rgb, SamplingFactor::F_2_1),
            ("4:2:0", ColorType::Rgb, SamplingFactor::F_2_2),
            ("grey", ColorType::Luma, SamplingFactor::F_1_1),
        ]
    }

    /// The MCUs in a row of each kind.
    fn per_row(color: ColorType, sampling: SamplingFactor) -> u16 {
        let mcu = match (color, sampling) {
            (ColorType::Rgb, SamplingFactor::F_2_1 | SamplingFactor::F_2_2) => 16,
            _ => 8,
        };
        W.div_ceil(mcu) as u16
    }

    /// The window as libjpeg decodes it from the whole image, and as it decodes it from a cut.
    fn both(bytes: &[u8], channels: usize, denom: usize, window: Window) -> (Vec<u8>, Vec<u8>) {
        let pixels = |rows: crate::ops::jpeg::Rows| -> Vec<u8> {
            let stride = rows.row_width * channels;
            (0..window.height)
                .flat_map(|y| {
                    let at = y * stride + rows.left * channels;
                    rows.pixels[at..at + window.width * channels].to_vec()
                })
                .collect()
        };
        let whole = turbo::Opened::open(bytes).unwrap().decode(channels, denom, window).unwrap();
        let cut = Jpeg::open(bytes).unwrap().window(channels, denom, window).unwrap();
        (pixels(whole), pixels(cut))
    }

    #[test]
    fn a_window_from_a_cut_is_the_window_from_the_whole_image() {
        let mut rng = SplitMix64::new(11);
        for (kind, color, sampling) in kinds() {
            let row = per_row(color, sampling);
            // Part of a row, a whole row, two rows.
            for interval in [1, 2, row, 2 * row] {
                let bytes = jpeg_restarting(W, H, color, sampling, false, interval);
                assert!(Segments::find(&bytes).is_some(), "{kind}, every {interval} MCUs");
                for denom in [1, 2, 4, 8] {
                    let [height, width] = [H.div_ceil(denom), W.div_ceil(denom)];
                    for n in 0..40 {
                        let (top, left) = match n {
                            0 => (0, 0),
                            1 => (height - 1, width - 1),
                            _ => (rng.below(height), rng.below(width)),
                        };
                        let window = Window {
                            top,
                            left,
                            height: 1 + rng.below(height - top),
                            width: 1 + rng.below(width - left),
                        };
                        for channels in [1, 3] {
                            let (whole, cut) = both(&bytes, channels, denom, window);
                            let first = whole.iter().zip(&cut).position(|(a, b)| a != b);
                            assert!(
                                first.is_none() && whole.len() == cut.len(),
                                "{kind}, every {interval} MCUs, 1/{denom}, {channels} channels, {window:?}: first difference at {first:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_cut_holds_only_the_segments_around_the_window() {
        let bytes = jpeg_restarting(W, H, ColorType::Rgb, SamplingFactor::F_2_2, false, 1);
        let segments = Segments::find(&bytes).unwrap();
        assert_eq!((segments.grid, segments.segment, segments.spans.len()), ([7, 10], [1, 1], 70));
        // Pixels 40..50 x 60..70: MCU rows 2..4 and columns 3..5, one more on each side.
        let cut = segments.cut(Window { top: 40, left: 60, height: 10, width: 10 }).unwrap();
        assert_eq!((cut.top, cut.left), (16, 32));
        let inside = Jpeg::open(&cut.jpeg).unwrap();
        assert_eq!((inside.height, inside.width), (4 * 16, 4 * 16));
        assert!(cut.jpeg.len() < bytes.len() / 3, "{} of {} bytes", cut.jpeg.len(), bytes.len());
        // A window touching every edge needs every segment.
        assert!(segments.cut(Window { top: 0, left: 0, height: H, width: W }).is_none());
    }

    #[test]
    fn other_jpegs_are_not_cut() {
        let (color, sampling) = (ColorType::Rgb, SamplingFactor::F_2_2);
        let none = jpeg_restarting(W, H, color, sampling, false, 0);
        assert!(Segments::find(&none).is_none(), "no restart markers");
        // 10 MCUs a row: segments of 3 straddle rows.
        assert!(Segments::find(&jpeg_restarting(W, H, color, sampling, false, 3)).is_none());
        assert!(Segments::find(&jpeg_restarting(W, H, color, sampling, true, 1)).is_none(), "progressive");
        let bytes = jpeg_restarting(W, H, color, sampling, false, 1);
        // Markers out of turn: the first RST0 becomes RST1.
        let rst = bytes.windows(2).position(|w| w == [0xFF, RST0]).unwrap();
        let mut swapped = bytes.clone();
        swapped[rst + 1] = RST0 + 1;
        assert!(Segments::find(&swapped).is_none());
        // A frame claiming 65535x65535 px (4096x4096 MCUs, a marker after each) in a few KB:
        // refused before its 16.7 million segments are looked for.
        let mut huge = bytes.clone();
        let frame = huge.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        huge[frame + 5..frame + 9].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF]);
        assert!(Segments::find(&huge).is_none());
        // Cut anywhere: no end-of-image marker.
        for len in (0..bytes.len()).step_by(7) {
            assert!(Segments::find(&bytes[..len]).is_none(), "cut at {len}");
        }
    }

    #[test]
    fn damage_in_a_segment_is_an_error_or_pixels_never_a_panic() {
        let bytes = jpeg_restarting(W, H, ColorType::Rgb, SamplingFactor::F_2_2, false, 1);
        let mut grain = SplitMix64::new(5);
        let window = Window { top: 30, left: 40, height: 30, width: 50 };
        let mut errors = 0;
        for _ in 0..400 {
            let mut damaged = bytes.clone();
            let i = 2 + grain.below(damaged.len() - 2);
            damaged[i] = grain.below(256) as u8;
            if let Ok(jpeg) = Jpeg::open(&damaged) {
                errors += usize::from(jpeg.windows() && jpeg.window(3, 1, window).is_err());
            }
        }
        assert!(errors > 0, "some damage is reported");
    }

    #[test]
    fn restart_markers_are_added_without_loss() {
        for (kind, color, sampling) in kinds() {
            for progressive in [false, true] {
                let bytes = jpeg_restarting(W, H, color, sampling, progressive, 0);
                for segment_px in [8, 32, 10_000] {
                    let (with, interval) = add_restart_markers(&bytes, segment_px).unwrap();
                    let segments = Segments::find(&with).unwrap_or_else(|| panic!("{kind}: not cut"));
                    let mcu_w = segments.mcu[1];
                    assert!(interval * mcu_w <= segment_px.max(mcu_w), "{kind}: {interval} MCUs of {mcu_w} px");
                    assert_eq!(segments.segment, [1, interval], "{kind}");
                    for channels in [1, 3] {
                        assert!(decode_image(&with, channels).unwrap() == decode_image(&bytes, channels).unwrap());
                    }
                }
            }
        }
        let err = add_restart_markers(b"\xFF\xD8\xFF\xE0 not a JPEG", 32).unwrap_err();
        assert!(err.to_string().contains("JPEG"), "{err}");
    }
}
