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
        _ => Err(OpError::InvalidParameter("resize needs exactly one of size and shorterSide".into())),
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
    resize_region(image, d, [0, 0, d.h, d.w], shorter_side_size([d.h, d.w], side))
}

/// torchvision's output size: the longer side becomes int(long * side / short). Integer floor
/// division equals Python's int() of the float quotient here, since a non-integer quotient of
/// integers this small is never within a float ulp of the next integer.
pub fn shorter_side_size([h, w]: [usize; 2], side: usize) -> [usize; 2] {
    if h <= w { [side, w * side / h.max(1)] } else { [h * side / w.max(1), side] }
}

/// Resizes the sub-image [top, left, height, width] as if it had been cropped out first (taps
/// never reach outside it), which is how torchvision's resized crops are defined.
pub(crate) fn resize_region(
    image: &Tensor,
    d: Dims,
    [top, left, rh, rw]: [usize; 4],
    [oh, ow]: [usize; 2],
) -> Result<Tensor, OpError> {
    let mut out = Vec::new();
    resize_region_rows(image, d, [top, left, rh, rw], [oh, ow], false, &mut |row| {
        // Sized on the first row: only after the checks has the output a size that may be allocated.
        out.reserve_exact(oh * ow * d.c - out.len());
        out.extend_from_slice(row)
    })?;
    Ok(image_tensor(oh, ow, d.c, out))
}

/// [`resize_region`]'s checks and passes, each output row handed to `row` as it is made
/// instead of kept: bottom row first when `bottom_up`. For ops that finish the image on its
/// way out (a flip, a normalize), so that nothing image-sized is written twice.
pub(crate) fn resize_region_rows(
    image: &Tensor,
    d: Dims,
    [top, left, rh, rw]: [usize; 4],
    [oh, ow]: [usize; 2],
    bottom_up: bool,
    row: &mut dyn FnMut(&[u8]),
) -> Result<(), OpError> {
    check_region(d, [top, left, rh, rw], [oh, ow])?;
    filter_dispatch(&image.data, d, [top, left, rh, rw], [oh, ow], bottom_up, row);
    Ok(())
}

fn check_region(d: Dims, [top, left, rh, rw]: [usize; 4], [oh, ow]: [usize; 2]) -> Result<(), OpError> {
    if oh == 0 || ow == 0 {
        return Err(OpError::InvalidParameter(format!("cannot resize to {oh}x{ow}")));
    }
    // Validation bounds the sizes a spec names; this catches those that follow the data (a
    // shorterSide resize of a very long, thin image) before their output is allocated.
    let limit = stoker_api::bounds::MAX_IMAGE_SIDE;
    if oh.max(ow) > limit as usize {
        return Err(OpError::TooLarge { want: [oh, ow], limit });
    }
    if rh == 0 || rw == 0 || top + rh > d.h || left + rw > d.w {
        return Err(OpError::TooSmall { have: [d.h, d.w], want: [top + rh, left + rw] });
    }
    Ok(())
}

/// Output rows, one at a time, to the row sink of [`filter`].
type Rows<'a> = &'a mut dyn FnMut(&[u8]);

crate::avx2::dispatch! {
    /// The filter compiled for AVX2 where the CPU has it (`crate::avx2`): the same integer
    /// arithmetic, so the same result.
    fn filter_dispatch(src: &[u8], d: Dims, region: [usize; 4], size: [usize; 2], bottom_up: bool, rows: Rows) = filter;
}

/// Both passes over the checked region; inlined into each instruction-set variant.
///
/// The horizontal pass runs as a vertical one on the transposed region: filtering whole rows
/// tap by tap is a contiguous multiply-add the compiler vectorises, where filtering along a
/// row is a short dot product per pixel. Each output value is still HALF plus the same
/// products, clipped once, so the result is the same as the direct pass (Pillow's).
#[inline(always)]
fn filter(src: &[u8], d: Dims, [top, left, rh, rw]: [usize; 4], [oh, ow]: [usize; 2], bottom_up: bool, rows: Rows) {
    let c = d.c;
    // Horizontal pass into a [rh, ow, c] buffer.
    let mid: Vec<u8>;
    let (mid_rows, mid_stride, mid_origin): (&[u8], usize, usize) = if ow == rw {
        (src, d.row_len(), top * d.row_len() + left * c)
    } else {
        // [rw, rh, c] -> filtered [ow, rh, c] -> transposed back.
        let columns = transpose(src, d.row_len(), top * d.row_len() + left * c, rh, rw, c);
        let mut filtered = Vec::with_capacity(ow * rh * c);
        filter_rows(&columns, rh * c, 0, rh * c, &Taps::new(rw, ow), false, &mut |row| filtered.extend_from_slice(row));
        mid = transpose(&filtered, rh * c, 0, ow, rh, c);
        (&mid, ow * c, 0)
    };
    if oh == rh {
        let row_len = ow * c;
        for i in 0..oh {
            let y = if bottom_up { oh - 1 - i } else { i };
            let start = mid_origin + y * mid_stride;
            rows(&mid_rows[start..start + row_len]);
        }
    } else {
        filter_rows(mid_rows, mid_stride, mid_origin, ow * c, &Taps::new(rh, oh), bottom_up, rows)
    }
}

/// A vertical pass over rows of `row_len` bytes, `stride` apart from `origin`: output row y
/// is HALF plus input rows first..first+n times their weights, clipped. Accumulating whole
/// rows tap by tap keeps the inner loop a contiguous multiply-add. Each output row goes to
/// `rows` from one small buffer that stays in cache.
#[inline(always)]
fn filter_rows(src: &[u8], stride: usize, origin: usize, row_len: usize, taps: &Taps, bottom_up: bool, rows: Rows) {
    let mut out_row = vec![0u8; row_len];
    let mut acc = vec![0i32; row_len];
    let out_rows = taps.first.len();
    for i in 0..out_rows {
        let y = if bottom_up { out_rows - 1 - i } else { i };
        acc.fill(HALF);
        let (first, weights) = taps.of(y);
        for (k, &wk) in weights.iter().enumerate() {
            let start = origin + (first + k) * stride;
            let in_row = &src[start..start + row_len];
            for (a, &p) in acc.iter_mut().zip(in_row) {
                *a += i32::from(p) * wk;
            }
        }
        for (o, &a) in out_row.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
        rows(&out_row);
    }
}

/// Transposes the [h, w, c] block at `origin` (rows `stride` apart) into a packed [w, h, c].
#[inline(always)]
fn transpose(src: &[u8], stride: usize, origin: usize, h: usize, w: usize, c: usize) -> Vec<u8> {
    match c {
        1 => transpose_c::<1>(src, stride, origin, h, w),
        2 => transpose_c::<2>(src, stride, origin, h, w),
        3 => transpose_c::<3>(src, stride, origin, h, w),
        _ => transpose_c::<4>(src, stride, origin, h, w),
    }
}

#[inline(always)]
fn transpose_c<const C: usize>(src: &[u8], stride: usize, origin: usize, h: usize, w: usize) -> Vec<u8> {
    let mut out = vec![0u8; w * h * C];
    let (dst, _) = out.as_chunks_mut::<C>();
    // Blocks of 16 rows keep both sides in cache.
    for y0 in (0..h).step_by(16) {
        let y1 = (y0 + 16).min(h);
        for y in y0..y1 {
            let row = &src[origin + y * stride..origin + y * stride + w * C];
            let (pixels, _) = row.as_chunks::<C>();
            for (x, px) in pixels.iter().enumerate() {
                dst[x * h + y] = *px;
            }
        }
    }
    out
}

#[inline(always)]
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
        // Pillow multiplies by the reciprocal, and so do we, for the same weights to the last
        // bit.
        let inverse_scale = 1.0 / filter_scale;
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
                let t = ((i + lo) as f64 - center + 0.5) * inverse_scale;
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

    #[inline(always)]
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
        Tensor::new(DType::Uint8, vec![h, w, c], Bytes::from((0..h * w * c).map(f).collect::<Vec<_>>())).unwrap()
    }

    /// The passes as written before the transposed horizontal pass (and as Pillow writes
    /// them): along each row, then down the columns.
    fn reference(img: &Tensor, [top, left, rh, rw]: [usize; 4], [oh, ow]: [usize; 2]) -> Vec<u8> {
        let d = Dims::of(img).unwrap();
        let c = d.c;
        let px = |y: usize, x: usize, ch: usize| i32::from(img.data[(top + y) * d.row_len() + (left + x) * c + ch]);
        let (htaps, vtaps) = (Taps::new(rw, ow), Taps::new(rh, oh));
        let mut mid = vec![0u8; rh * ow * c];
        for y in 0..rh {
            for x in 0..ow {
                let (first, w) = htaps.of(x);
                for ch in 0..c {
                    let sum = w.iter().enumerate().fold(HALF, |s, (k, &wk)| s + px(y, first + k, ch) * wk);
                    mid[(y * ow + x) * c + ch] = if ow == rw { px(y, x, ch) as u8 } else { clip8(sum) };
                }
            }
        }
        let mut out = vec![0u8; oh * ow * c];
        for y in 0..oh {
            let (first, w) = vtaps.of(y);
            for i in 0..ow * c {
                let sum =
                    w.iter().enumerate().fold(HALF, |s, (k, &wk)| s + i32::from(mid[(first + k) * ow * c + i]) * wk);
                out[y * ow * c + i] = if oh == rh { mid[y * ow * c + i] } else { clip8(sum) };
            }
        }
        out
    }

    #[test]
    fn the_transposed_passes_equal_the_direct_ones() {
        let mut state = 12345u64;
        let mut next = |n: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        for case in 0..300 {
            let c = 1 + case % 4;
            let (h, w) = (1 + next(60), 1 + next(60));
            let img = image(h, w, c, |i| (i * 131 % 251) as u8 ^ (i / 7) as u8);
            let (rh, rw) = (1 + next(h), 1 + next(w));
            let (top, left) = (next(h - rh + 1), next(w - rw + 1));
            let size = [1 + next(70), 1 + next(70)];
            let d = Dims::of(&img).unwrap();
            let got = resize_region(&img, d, [top, left, rh, rw], size).unwrap();
            assert_eq!(
                got.data.to_vec(),
                reference(&img, [top, left, rh, rw], size),
                "case {case}: {h}x{w}x{c} [{top}, {left}, {rh}, {rw}] -> {size:?}"
            );
        }
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
        assert!(matches!(resize_exact(&img, [0, 3]), Err(OpError::InvalidParameter(_))));
        let both = Resize { size: Some([2, 2]), shorter_side: Some(2), field: "image".into() };
        assert!(resize(&img, &both).is_err());
    }

    #[test]
    fn a_data_dependent_output_above_the_side_limit_is_refused_before_allocating() {
        // 1 x 100 scaled so the shorter side is 100: the longer side would be 10000 px.
        let thin = image(1, 100, 3, |_| 9);
        let err = resize_shorter_side(&thin, 100).unwrap_err();
        assert_eq!(err, OpError::TooLarge { want: [100, 10000], limit: 8192 });
        assert_eq!(err.reason(), "too_large");
        assert_eq!(resize_shorter_side(&thin, 81).unwrap().shape, [81, 8100, 3], "within the limit");
    }
}
