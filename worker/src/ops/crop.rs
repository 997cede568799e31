//! centerCrop and randomResizedCrop, both with torchvision's arithmetic (including Python's
//! round-half-to-even), so the same draws give the same boxes as torchvision.

use rand::{Rng, RngExt};
use stoker_api::{CenterCrop, RandomResizedCrop, Tensor};

use super::OpError;
use super::image::{Dims, image_tensor};
use super::resize::resize_region;

/// A crop window in pixels, plus whether it came from the fallback rather than a draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    pub top: usize,
    pub left: usize,
    pub height: usize,
    pub width: usize,
    pub fallback: bool,
}

/// Copies out [top, left, height, width]; errors if the window leaves the image.
pub fn crop(image: &Tensor, top: usize, left: usize, height: usize, width: usize) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    if top + height > d.h || left + width > d.w {
        return Err(OpError::TooSmall { have: [d.h, d.w], want: [top + height, left + width] });
    }
    let row = width * d.c;
    let mut out = Vec::with_capacity(height * row);
    for y in top..top + height {
        let start = y * d.row_len() + left * d.c;
        out.extend_from_slice(&image.data[start..start + row]);
    }
    Ok(image_tensor(height, width, d.c, out))
}

/// The centered [height, width] window; an image smaller than that is an error, not padded.
pub fn center_crop(image: &Tensor, op: &CenterCrop) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    let [h, w] = op.size.map(|s| s as usize);
    if h > d.h || w > d.w {
        return Err(OpError::TooSmall { have: [d.h, d.w], want: [h, w] });
    }
    crop(image, half_even(d.h - h), half_even(d.w - w), h, w)
}

/// Python's int(round(n / 2)): halves go to the even neighbour.
fn half_even(n: usize) -> usize {
    let k = n / 2;
    if n % 2 == 1 && k % 2 == 1 { k + 1 } else { k }
}

/// Draws a window of the image and resizes it (bilinear, see resize.rs) to `op.size`.
pub fn random_resized_crop(image: &Tensor, op: &RandomResizedCrop, rng: &mut impl Rng) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    let b = random_resized_crop_box([d.h, d.w], op.scale, op.ratio, rng)?;
    let size = op.size.map(|s| s as usize);
    if b.height == 0 || b.width == 0 {
        return Err(OpError::TooSmall { have: [d.h, d.w], want: [1, 1] });
    }
    resize_region(image, d, [b.top, b.left, b.height, b.width], size)
}

/// torchvision's `RandomResizedCrop.get_params`: up to 10 draws of an area fraction in
/// `scale` and a log-uniform aspect ratio (width / height) in `ratio`; the first window that
/// fits is placed uniformly. If none fits, the whole image cropped to the nearest allowed
/// ratio, centered.
pub fn random_resized_crop_box(
    [height, width]: [usize; 2],
    scale: [f64; 2],
    ratio: [f64; 2],
    rng: &mut impl Rng,
) -> Result<CropBox, OpError> {
    let ordered = |[a, b]: [f64; 2]| a.is_finite() && b.is_finite() && 0.0 < a && a <= b;
    if !ordered(scale) || !ordered(ratio) {
        return Err(OpError::InvalidParameter(format!("scale {scale:?} and ratio {ratio:?} need 0 < min <= max")));
    }
    let area = (height * width) as f64;
    let log_ratio = ratio.map(f64::ln);
    for _ in 0..10 {
        let target_area = area * uniform(rng, scale);
        let aspect = uniform(rng, log_ratio).exp();
        let w = (target_area * aspect).sqrt().round_ties_even() as usize;
        let h = (target_area / aspect).sqrt().round_ties_even() as usize;
        if 0 < w && w <= width && 0 < h && h <= height {
            let top = rng.random_range(0..=height - h);
            let left = rng.random_range(0..=width - w);
            return Ok(CropBox { top, left, height: h, width: w, fallback: false });
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (h, w) = if in_ratio < ratio[0] {
        ((width as f64 / ratio[0]).round_ties_even() as usize, width)
    } else if in_ratio > ratio[1] {
        (height, (height as f64 * ratio[1]).round_ties_even() as usize)
    } else {
        (height, width)
    };
    Ok(CropBox { top: (height - h) / 2, left: (width - w) / 2, height: h, width: w, fallback: true })
}

fn uniform(rng: &mut impl Rng, [lo, hi]: [f64; 2]) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use stoker_api::DType;

    use super::*;
    use crate::ops::element_rng;

    fn image(h: usize, w: usize) -> Tensor {
        let data: Vec<u8> = (0..h * w * 3).map(|i| (i % 251) as u8).collect();
        Tensor::new(DType::Uint8, vec![h, w, 3], Bytes::from(data)).unwrap()
    }

    fn rrc(size: [u32; 2]) -> RandomResizedCrop {
        RandomResizedCrop { size, scale: [0.08, 1.0], ratio: [0.75, 4.0 / 3.0], field: "image".into() }
    }

    #[test]
    fn center_crop_rounds_half_to_even_like_torchvision() {
        assert_eq!((half_even(0), half_even(1), half_even(3), half_even(5), half_even(4)), (0, 0, 2, 2, 2));
        let img = image(6, 5);
        let out = center_crop(&img, &CenterCrop { size: [3, 2], field: "image".into() }).unwrap();
        // (6-3)/2 = 1.5 -> 2 and (5-2)/2 = 1.5 -> 2.
        assert_eq!(out, crop(&img, 2, 2, 3, 2).unwrap());
        let err = center_crop(&img, &CenterCrop { size: [7, 2], field: "image".into() }).unwrap_err();
        assert!(matches!(err, OpError::TooSmall { .. }));
    }

    #[test]
    fn same_rng_same_crop_and_elements_differ() {
        let img = image(40, 60);
        let run = |element| random_resized_crop(&img, &rrc([16, 16]), &mut element_rng(7, 1, element, 0)).unwrap();
        assert_eq!(run(3), run(3));
        assert_eq!(run(3).shape, vec![16, 16, 3]);
        let boxes: Vec<_> = (0..8)
            .map(|e| random_resized_crop_box([40, 60], [0.08, 1.0], [0.75, 4.0 / 3.0], &mut element_rng(7, 1, e, 0)))
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(boxes.windows(2).any(|p| p[0] != p[1]), "{boxes:?}");
    }

    #[test]
    fn boxes_stay_inside_and_respect_scale_and_ratio() {
        let (scale, ratio) = ([0.08, 1.0], [0.75, 4.0 / 3.0]);
        for (i, (h, w)) in [(40, 60), (300, 20), (20, 300), (1, 1), (224, 224), (375, 500)].into_iter().enumerate() {
            let mut rng = element_rng(1, 0, i as u64, 0);
            let mut drawn = 0;
            for _ in 0..500 {
                let b = random_resized_crop_box([h, w], scale, ratio, &mut rng).unwrap();
                assert!(b.height > 0 && b.width > 0 && b.top + b.height <= h && b.left + b.width <= w, "{b:?}");
                if b.fallback {
                    continue;
                }
                drawn += 1;
                // Rounding each side to whole pixels moves the area and ratio by at most
                // half a pixel per side.
                let (bh, bw) = (b.height as f64, b.width as f64);
                let area = (h * w) as f64;
                assert!((bh - 0.5) * (bw - 0.5) <= area * scale[1], "{b:?}");
                assert!((bh + 0.5) * (bw + 0.5) >= area * scale[0], "{b:?}");
                assert!((bw + 0.5) / (bh - 0.5).max(0.5) >= ratio[0], "{b:?}");
                assert!((bw - 0.5) / (bh + 0.5) <= ratio[1], "{b:?}");
            }
            if h * w > 100 && h.min(w) * 2 > h.max(w) {
                assert!(drawn > 400, "{h}x{w}: only {drawn} draws fitted");
            }
        }
    }

    #[test]
    fn fallback_clamps_the_ratio() {
        // No window of a 1x100 strip has a ratio in [3/4, 4/3] and 8% of its area.
        let b = random_resized_crop_box([1, 100], [0.5, 1.0], [0.75, 4.0 / 3.0], &mut element_rng(0, 0, 0, 0)).unwrap();
        assert_eq!(b, CropBox { top: 0, left: 49, height: 1, width: 1, fallback: true });
        let bad = random_resized_crop_box([4, 4], [0.5, 0.1], [0.75, 1.0], &mut element_rng(0, 0, 0, 0));
        assert!(matches!(bad, Err(OpError::InvalidParameter(_))));
    }
}
