//! Bilinear resize with Pillow's definition (`Image.resize(size, Image.BILINEAR)`), which is
//! also what torchvision's Resize and RandomResizedCrop compute on PIL images, i.e. the
//! reference ResNet training pipelines.
//!
//! The definition: each output pixel x samples the input at center (x + 0.5) * scale with a
//! triangle filter whose support is widened by the scale when downscaling (so downscaling
//! antialiases, unlike OpenCV or tf.image without antialias); edge taps are clamped to the
//! image and weights renormalised. Weights are rounded to 22-bit fixed point, the horizontal
//! pass runs first and its result is rounded to uint8 before the vertical pass. Doing the
//! same rounding in the same order is what lets the output match Pillow to the last bit;
//! tests/ops_reference.rs checks that (max abs difference 0 on its fixtures).

use stoker_api::{Resize, Tensor};

use super::OpError;
use super::image::{Dims, image_tensor};

/// Pillow's fixed-point precision for 8-bit images: 32 bits minus 8 for the pixel and 2 for
/// headroom.
const PRECISION_BITS: u32 = 22;
const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// The `resize` op: exactly one of `size` and `shorterSide`.
pub fn resize(image: &Tensor, op: &Resize) -> Result<Tensor, OpError> {
    match (op.size, op.shorter_side) {
        (Some([h, w]), None) => resize_exact(image, [h as usize, w as usize]),
        (None, Some(s)) => resize_shorter_side(image, s as usize),
        _ => Err(OpError::InvalidParameter(
            "resize needs exactly one of size and shorterSide".into(),
        )),
    }
}

/// Resizes to exactly [height, width].
pub fn resize_exact(image: &Tensor, size: [usize; 2]) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    resize_region(image, d, [0, 0, d.h, d.w], size)
}

/// Resizes so the shorter side becomes `side`, keeping the aspect ratio.
pub fn resize_shorter_side(image: &Tensor, side: usize) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    resize_region(
        image,
        d,
        [0, 0, d.h, d.w],
        shorter_side_size([d.h, d.w], side),
    )
}

/// torchvision's output size: the longer side becomes int(long * side / short). Integer floor
/// division equals Python's int() of the float quotient here, since a non-integer quotient of
/// integers this small is never within a float ulp of the next integer.
pub fn shorter_side_size([h, w]: [usize; 2], side: usize) -> [usize; 2] {
    if h <= w {
        [side, w * side / h.max(1)]
    } else {
        [h * side / w.max(1), side]
    }
}

/// Resizes the sub-image [top, left, height, width] as if it had been cropped out first (taps
/// never reach outside it), which is how torchvision's resized crops are defined.
pub(crate) fn resize_region(
    image: &Tensor,
    d: Dims,
    [top, left, rh, rw]: [usize; 4],
    [oh, ow]: [usize; 2],
) -> Result<Tensor, OpError> {
    if oh == 0 || ow == 0 {
        return Err(OpError::InvalidParameter(format!(
            "cannot resize to {oh}x{ow}"
        )));
    }
    if rh == 0 || rw == 0 || top + rh > d.h || left + rw > d.w {
        return Err(OpError::TooSmall {
            have: [d.h, d.w],
            want: [top + rh, left + rw],
        });
    }
    let src = &image.data[..];
    let c = d.c;
    // Horizontal pass over the region's rows into a [rh, ow, c] buffer.
    let mut mid: Vec<u8>;
    let (mid_rows, mid_stride, mid_origin): (&[u8], usize, usize) = if ow == rw {
        (src, d.row_len(), top * d.row_len() + left * c)
    } else {
        let taps = Taps::new(rw, ow);
        mid = vec![0; rh * ow * c];
        for (y, out_row) in mid.chunks_exact_mut(ow * c).enumerate() {
            let row_start = (top + y) * d.row_len() + left * c;
            let row = &src[row_start..row_start + rw * c];
            match c {
                1 => horizontal::<1>(row, out_row, &taps),
                2 => horizontal::<2>(row, out_row, &taps),
                3 => horizontal::<3>(row, out_row, &taps),
                _ => horizontal::<4>(row, out_row, &taps),
            }
        }
        (&mid, ow * c, 0)
    };
    let row_len = ow * c;
    let mut out = vec![0u8; oh * row_len];
    if oh == rh {
        for (y, out_row) in out.chunks_exact_mut(row_len).enumerate() {
            let start = mid_origin + y * mid_stride;
            out_row.copy_from_slice(&mid_rows[start..start + row_len]);
        }
    } else {
        let taps = Taps::new(rh, oh);
        // Accumulating whole rows tap by tap keeps the inner loop a contiguous multiply-add
        // that the compiler vectorises.
        let mut acc = vec![0i32; row_len];
        for (y, out_row) in out.chunks_exact_mut(row_len).enumerate() {
            acc.fill(HALF);
            let (first, weights) = taps.of(y);
            for (k, &wk) in weights.iter().enumerate() {
                let start = mid_origin + (first + k) * mid_stride;
                let in_row = &mid_rows[start..start + row_len];
                for (a, &p) in acc.iter_mut().zip(in_row) {
                    *a += i32::from(p) * wk;
                }
            }
            for (o, &a) in out_row.iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
    }
    Ok(image_tensor(oh, ow, c, out))
}

fn horizontal<const C: usize>(row: &[u8], out: &mut [u8], taps: &Taps) {
    let (pixels, _) = row.as_chunks::<C>();
    let (out, _) = out.as_chunks_mut::<C>();
    for (x, px) in out.iter_mut().enumerate() {
        let (first, weights) = taps.of(x);
        let mut sum = [HALF; C];
        for (p, &wk) in pixels[first..first + weights.len()].iter().zip(weights) {
            for ch in 0..C {
                sum[ch] += i32::from(p[ch]) * wk;
            }
        }
        *px = sum.map(clip8);
    }
}

fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// For each output index: the first input index and the fixed-point weights of a run of
/// consecutive inputs. Runs are stored padded to the widest so lookups are one multiply.
struct Taps {
    first: Vec<usize>,
    count: Vec<usize>,
    width: usize,
    weights: Vec<i32>,
}

impl Taps {
    fn new(in_size: usize, out_size: usize) -> Taps {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = filter_scale; // the triangle's support is 1 input pixel at scale 1
        let width = support.ceil() as usize * 2 + 1;
        let mut taps = Taps {
            first: Vec::with_capacity(out_size),
            count: Vec::with_capacity(out_size),
            width,
            weights: vec![0; out_size * width],
        };
        let mut w = vec![0f64; width];
        for x in 0..out_size {
            let center = (x as f64 + 0.5) * scale;
            // Truncation as in C's (int) cast; negatives clamp to 0 either way.
            let lo = ((center - support + 0.5) as isize).max(0) as usize;
            let hi = ((center + support + 0.5) as isize).clamp(0, in_size as isize) as usize;
            let n = hi.saturating_sub(lo).min(width);
            let mut total = 0.0;
            for (i, wi) in w[..n].iter_mut().enumerate() {
                let t = ((i + lo) as f64 - center + 0.5) / filter_scale;
                *wi = (1.0 - t.abs()).max(0.0);
                total += *wi;
            }
            let row = &mut taps.weights[x * width..x * width + n];
            for (fixed, &wi) in row.iter_mut().zip(&w[..n]) {
                let v = if total != 0.0 { wi / total } else { 0.0 };
                *fixed = (v * f64::from(1u32 << PRECISION_BITS) + 0.5 * v.signum()) as i32;
            }
            taps.first.push(lo);
            taps.count.push(n);
        }
        taps
    }

    fn of(&self, x: usize) -> (usize, &[i32]) {
        let start = x * self.width;
        (self.first[x], &self.weights[start..start + self.count[x]])
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use stoker_api::DType;

    use super::*;

    fn image(h: usize, w: usize, c: usize, f: impl Fn(usize) -> u8) -> Tensor {
        Tensor::new(
            DType::Uint8,
            vec![h, w, c],
            Bytes::from((0..h * w * c).map(f).collect::<Vec<_>>()),
        )
        .unwrap()
    }

    #[test]
    fn same_size_is_identity() {
        let img = image(5, 7, 3, |i| (i * 37 % 256) as u8);
        assert_eq!(resize_exact(&img, [5, 7]).unwrap(), img);
    }

    #[test]
    fn constant_images_stay_constant() {
        for size in [[3, 4], [20, 9], [1, 1], [11, 30]] {
            let out = resize_exact(&image(7, 13, 4, |_| 201), size).unwrap();
            assert_eq!(out.shape, vec![size[0], size[1], 4]);
            assert!(out.data.iter().all(|&v| v == 201), "{size:?}");
        }
    }

    #[test]
    fn shorter_side_rounds_down_the_longer_side() {
        assert_eq!(shorter_side_size([375, 500], 256), [256, 341]);
        assert_eq!(shorter_side_size([500, 375], 256), [341, 256]);
        assert_eq!(shorter_side_size([10, 10], 4), [4, 4]);
    }

    #[test]
    fn bad_sizes_are_errors() {
        let img = image(4, 4, 1, |_| 0);
        assert!(matches!(
            resize_exact(&img, [0, 3]),
            Err(OpError::InvalidParameter(_))
        ));
        let both = Resize {
            size: Some([2, 2]),
            shorter_side: Some(2),
            field: "image".into(),
        };
        assert!(resize(&img, &both).is_err());
    }
}
