//! decodeImage followed by randomResizedCrop, decoding only what the crop needs: the crop
//! window is drawn from the JPEG's header, and only the window is decoded (libjpeg skips the
//! IDCT and colour work outside it and stops after its last row), at a reduced DCT scale when
//! the window is at least twice the output on both sides. The draws are those of the two ops
//! one after the other; at full scale so are the pixels, and at a reduced scale they differ as
//! a smaller source for the same resize does.
//!
//! Two steps, so the engine times each as its op: [`decode_for_crop`] (the decode) and
//! [`resize_crop`] (the crop, with any flip and normalize folded into it: [`Finish`]).

use bytes::Bytes;
use rand::Rng;
use stoker_api::{DType, Layout, RandomResizedCrop, Tensor};

use super::OpError;
use super::crop::random_resized_crop_box;
use super::decode::{Format, decode_image, sniff};
use super::flip::{Flips, extend_row};
use super::image::{Dims, image_tensor};
use super::jpeg::{Jpeg, Window};
use super::normalize::Tables;
use super::resize::resize_region_rows;

/// The decoded image, or only the crop's window of it, and the region of that to resize.
pub struct ForCrop {
    image: Tensor,
    region: [usize; 4],
}

/// Decodes `bytes` as decodeImage would with `channels`, and draws `op`'s window as
/// randomResizedCrop would on the result, decoding only that window where it can.
pub fn decode_for_crop(
    bytes: &[u8],
    channels: u8,
    op: &RandomResizedCrop,
    rng: &mut impl Rng,
) -> Result<ForCrop, OpError> {
    let jpeg = match sniff(bytes) {
        Format::Jpeg if matches!(channels, 1 | 3 | 4) => Some(Jpeg::open(bytes)?),
        _ => None,
    };
    let Some(jpeg) = jpeg.filter(Jpeg::windows) else {
        let image = decode_image(bytes, channels)?;
        let d = Dims::of(&image)?;
        let b = random_resized_crop_box([d.h, d.w], op.scale, op.ratio, rng)?;
        return Ok(ForCrop { image, region: [b.top, b.left, b.height, b.width] });
    };
    let b = random_resized_crop_box([jpeg.height, jpeg.width], op.scale, op.ratio, rng)?;
    if b.height == 0 || b.width == 0 {
        return Err(OpError::TooSmall { have: [jpeg.height, jpeg.width], want: [1, 1] });
    }
    let denom = scale_for([b.height, b.width], op.size.map(|s| s as usize));
    // The window in scaled pixels: every scaled pixel the crop touches.
    let [height, width] = jpeg.scaled(denom);
    let (top, left) = (b.top / denom, b.left / denom);
    let bottom = (b.top + b.height).div_ceil(denom).min(height);
    let right = (b.left + b.width).div_ceil(denom).min(width);
    let window = Window { top, left, height: bottom - top, width: right - left };
    let channels = usize::from(channels);
    let rows = jpeg.window(channels, denom, window)?;
    // The rows as libjpeg wrote them, a little wider than the window: the resize reads the
    // window's region of them.
    let image = image_tensor(window.height, rows.row_width, channels, rows.pixels);
    Ok(ForCrop { image, region: [0, rows.left, window.height, window.width] })
}

/// What the ops right after the crop do to its output (a flip, a normalize), done as the
/// resize writes each row, so that the image is written once, in its final form.
#[derive(Default)]
pub struct Finish {
    pub flips: Flips,
    pub normalize: Option<Tables>,
}

impl ForCrop {
    pub fn channels(&self) -> usize {
        self.image.shape.get(2).copied().unwrap_or(0)
    }
}

/// The crop's region resized to `op.size`, then finished by `finish`.
pub fn resize_crop(decoded: &ForCrop, op: &RandomResizedCrop, finish: &Finish) -> Result<Tensor, OpError> {
    let [_, _, h, w] = decoded.region;
    let d = Dims::of(&decoded.image)?;
    if h == 0 || w == 0 {
        return Err(OpError::TooSmall { have: [d.h, d.w], want: [1, 1] });
    }
    let [oh, ow] = op.size.map(|s| s as usize);
    let pixels = oh * ow * d.c;
    let bytes = finish.normalize.as_ref().map_or(pixels, |t| t.out_len(pixels));
    let mut out = Vec::new();
    let Flips { horizontal, vertical } = finish.flips;
    // The resize hands its rows bottom-up for a vertical flip; a row is mirrored as written.
    resize_region_rows(&decoded.image, d, decoded.region, [oh, ow], vertical, &mut |row| {
        // Sized on the first row: only after the resize's checks may the output be allocated.
        out.reserve_exact(bytes - out.len());
        match &finish.normalize {
            Some(tables) => tables.extend(row, horizontal, &mut out),
            None => extend_row(row, d.c, horizontal, &mut out),
        }
    })?;
    let dtype = finish.normalize.as_ref().map_or(DType::Uint8, Tables::dtype);
    Ok(Tensor { dtype, shape: vec![oh, ow, d.c], data: Bytes::from(out), layout: Layout::Dense })
}

/// The largest of 1/8, 1/4 and 1/2 at which the crop is still at least the output size on
/// both sides (so the resize still only shrinks), else 1.
pub fn scale_for(crop: [usize; 2], size: [usize; 2]) -> usize {
    [8, 4, 2].into_iter().find(|d| crop[0] >= d * size[0] && crop[1] >= d * size[1]).unwrap_or(1)
}

#[cfg(test)]
pub(crate) mod tests {
    use jpeg_encoder::{ColorType, Encoder, SamplingFactor};
    use stoker_api::RandomResizedCrop;

    use super::*;
    use crate::ops::{crop, element_rng, random_resized_crop};
    use crate::shuffle::SplitMix64;

    /// A smooth picture with grain, so every block has detail, as `color` (3 or 4 channels of
    /// RGB or CMYK, or 1 of grey).
    pub(crate) fn jpeg(w: usize, h: usize, color: ColorType, sampling: SamplingFactor, progressive: bool) -> Vec<u8> {
        jpeg_restarting(w, h, color, sampling, progressive, 0)
    }

    /// [`jpeg`] with a restart marker every `interval` MCUs (0: none).
    pub(crate) fn jpeg_restarting(
        w: usize,
        h: usize,
        color: ColorType,
        sampling: SamplingFactor,
        progressive: bool,
        interval: u16,
    ) -> Vec<u8> {
        let channels = match color {
            ColorType::Luma => 1,
            ColorType::Rgb => 3,
            _ => 4,
        };
        let mut grain = SplitMix64::new(7);
        let pixels: Vec<u8> = (0..h * w * channels)
            .map(|i| {
                let (y, x, c) = (i / (w * channels), i / channels % w, i % channels);
                ((x * 3 + y * 2 + c * 60) % 256) as u8 ^ (grain.below(16) as u8)
            })
            .collect();
        let mut out = Vec::new();
        let mut encoder = Encoder::new(&mut out, 90);
        encoder.set_sampling_factor(sampling);
        encoder.set_progressive(progressive);
        encoder.set_restart_interval(interval);
        encoder.encode(&pixels, w as u16, h as u16, color).unwrap();
        out
    }

    fn rrc(size: u32) -> RandomResizedCrop {
        RandomResizedCrop { size: [size, size], scale: [0.08, 1.0], ratio: [0.75, 4.0 / 3.0], field: "image".into() }
    }

    fn kinds() -> Vec<(&'static str, Vec<u8>)> {
        let (w, h) = (123, 77);
        vec![
            ("4:4:4", jpeg(w, h, ColorType::Rgb, SamplingFactor::F_1_1, false)),
            ("4:2:2", jpeg(w, h, ColorType::Rgb, SamplingFactor::F_2_1, false)),
            ("4:2:0", jpeg(w, h, ColorType::Rgb, SamplingFactor::F_2_2, false)),
            ("4:2:0 progressive", jpeg(w, h, ColorType::Rgb, SamplingFactor::F_2_2, true)),
            ("grey", jpeg(w, h, ColorType::Luma, SamplingFactor::F_1_1, false)),
            // Windows cut from the segments around them (jpeg/segments.rs).
            ("4:2:0 restart markers", jpeg_restarting(w, h, ColorType::Rgb, SamplingFactor::F_2_2, false, 2)),
        ]
    }

    #[test]
    fn a_window_is_the_whole_image_cropped() {
        let mut rng = SplitMix64::new(3);
        for (kind, bytes) in kinds() {
            let jpeg = Jpeg::open(&bytes).unwrap();
            assert!(jpeg.windows(), "{kind}");
            for channels in [1, 3, 4] {
                let whole = decode_image(&bytes, channels as u8).unwrap();
                for n in 0..60 {
                    // Edges and corners first, then one pixel wide (libjpeg upsamples a decode
                    // of at most 4 px differently) at both edges and inside, then anywhere.
                    let (top, left) = match n {
                        0 | 2 => (0, 0),
                        1 => (jpeg.height - 1, jpeg.width - 1),
                        3 => (0, jpeg.width - 1),
                        4 => (rng.below(jpeg.height), 1 + rng.below(jpeg.width - 2)),
                        _ => (rng.below(jpeg.height), rng.below(jpeg.width)),
                    };
                    let height = 1 + rng.below(jpeg.height - top);
                    let width = if (2..5).contains(&n) { 1 } else { 1 + rng.below(jpeg.width - left) };
                    let window = Window { top, left, height, width };
                    let rows = Jpeg::open(&bytes).unwrap().window(channels, 1, window).unwrap();
                    let decoded = image_tensor(height, rows.row_width, channels, rows.pixels);
                    let got = crop(&decoded, 0, rows.left, height, width).unwrap();
                    let want = crop(&whole, top, left, height, width).unwrap();
                    let first = got.data.iter().zip(want.data.iter()).position(|(a, b)| a != b);
                    assert!(first.is_none(), "{kind}, {channels} channels, {window:?}: first difference at {first:?}");
                }
            }
        }
    }

    #[test]
    fn at_full_scale_the_fused_op_is_the_two_ops() {
        for (kind, bytes) in kinds() {
            let whole = decode_image(&bytes, 3).unwrap();
            // 70 px: no crop of a 77-px-high image is twice that, so the scale stays 1.
            let op = rrc(70);
            for element in 0..40 {
                let want = random_resized_crop(&whole, &op, &mut element_rng(1, 0, element, 1)).unwrap();
                let fused = decode_for_crop(&bytes, 3, &op, &mut element_rng(1, 0, element, 1)).unwrap();
                assert!(resize_crop(&fused, &op, &Finish::default()).unwrap() == want, "{kind}, element {element}");
            }
        }
    }

    #[test]
    fn at_reduced_scales_the_fused_op_stays_close() {
        // A photograph-like image (the benchmark corpus's), 500 px square.
        let spec = crate::corpus::CorpusSpec { min_side: 500, max_side: 500, ..Default::default() };
        let bytes = crate::corpus::image_jpeg(&spec, 0, 0).unwrap();
        let whole = decode_image(&bytes, 3).unwrap();
        let op = rrc(48);
        let (mut reduced, mut worst) = (0, 0.0f64);
        for element in 0..60 {
            let b =
                random_resized_crop_box([500, 500], op.scale, op.ratio, &mut element_rng(2, 0, element, 1)).unwrap();
            reduced += usize::from(scale_for([b.height, b.width], [48, 48]) > 1);
            let want = random_resized_crop(&whole, &op, &mut element_rng(2, 0, element, 1)).unwrap();
            let fused = decode_for_crop(&bytes, 3, &op, &mut element_rng(2, 0, element, 1)).unwrap();
            let got = resize_crop(&fused, &op, &Finish::default()).unwrap();
            assert_eq!(got.shape, want.shape);
            let mean = got.data.iter().zip(want.data.iter()).map(|(a, b)| f64::from(a.abs_diff(*b))).sum::<f64>()
                / got.data.len() as f64;
            worst = worst.max(mean);
        }
        assert!(reduced > 30, "most windows of 8-100% of 500x500 are twice 48 px: {reduced} of 60");
        println!("reduced scales: {reduced} of 60 windows, worst mean difference {worst:.2}");
        assert!(worst < 3.0, "mean difference per value at most {worst}");
    }

    #[test]
    fn scales_keep_the_crop_at_least_the_output() {
        assert_eq!(scale_for([447, 447], [224, 224]), 1);
        assert_eq!(scale_for([448, 448], [224, 224]), 2);
        assert_eq!(scale_for([448, 2000], [224, 224]), 2);
        assert_eq!(scale_for([900, 1800], [224, 224]), 4);
        assert_eq!(scale_for([1792, 1792], [224, 224]), 8);
        assert_eq!(scale_for([5000, 5000], [224, 224]), 8);
    }

    #[test]
    fn cmyk_falls_back_to_the_whole_image() {
        let bytes = jpeg(60, 50, ColorType::Cmyk, SamplingFactor::F_1_1, false);
        assert!(!Jpeg::open(&bytes).unwrap().windows());
        let op = rrc(20);
        let want = random_resized_crop(&decode_image(&bytes, 3).unwrap(), &op, &mut element_rng(0, 0, 0, 1)).unwrap();
        let fused = decode_for_crop(&bytes, 3, &op, &mut element_rng(0, 0, 0, 1)).unwrap();
        assert!(resize_crop(&fused, &op, &Finish::default()).unwrap() == want);
    }

    #[test]
    fn a_header_claiming_a_huge_image_is_refused_before_its_pixels_are_allocated() {
        let mut bytes = jpeg(123, 77, ColorType::Rgb, SamplingFactor::F_2_2, false);
        // The baseline frame header (FFC0): length, precision, then height and width.
        let sof = bytes.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        bytes[sof + 5..sof + 9].copy_from_slice(&[0x4E, 0x20, 0x4E, 0x20]); // 20000 x 20000
        let err = decode_image(&bytes, 3).unwrap_err();
        assert!(matches!(&err, OpError::UnsupportedImage(m) if m.contains("above the 256 MiB")), "{err}");
        // A crop's window of it is decoded at 1/8 scale: small enough to try, and the data
        // (far too little for such an image) is then an error.
        assert!(decode_for_crop(&bytes, 3, &rrc(224), &mut element_rng(0, 0, 0, 1)).is_err());
    }

    #[test]
    fn damage_is_an_error_not_a_panic() {
        let bytes = jpeg(123, 77, ColorType::Rgb, SamplingFactor::F_2_2, false);
        let op = rrc(20);
        for len in (0..bytes.len()).step_by(13) {
            let result = decode_for_crop(&bytes[..len], 3, &op, &mut element_rng(0, 0, 0, 1));
            assert!(result.is_err(), "cut at {len}");
        }
        let mut grain = SplitMix64::new(9);
        for _ in 0..300 {
            let mut damaged = bytes.clone();
            for _ in 0..4 {
                let i = 2 + grain.below(damaged.len() - 2);
                damaged[i] = grain.below(256) as u8;
            }
            if let Ok(fused) = decode_for_crop(&damaged, 3, &op, &mut element_rng(0, 0, 0, 1)) {
                let _ = resize_crop(&fused, &op, &Finish::default());
            }
        }
    }
}
