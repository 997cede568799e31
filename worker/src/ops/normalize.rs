//! normalize: (x / 255 - mean[c]) / std[c] per channel, to float32 or float16; uint8 passes
//! through unchanged.
//!
//! A uint8 input has only 256 values per channel, so the op precomputes each channel's 256
//! outputs (in f64, rounded once to the output type) and the per-pixel work is a table
//! lookup: exact to the output type's rounding and faster than any arithmetic.

use bytes::Bytes;
use half::f16;
use stoker_api::{DType, Layout, Normalize, Tensor};

use super::OpError;
use super::image::Dims;

pub fn normalize(image: &Tensor, op: &Normalize) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    match Tables::new(op, d.c)? {
        None => Ok(image.clone()),
        Some(tables) => {
            let mut out = Vec::with_capacity(tables.out_len(image.data.len()));
            tables.extend(&image.data, false, &mut out);
            Ok(Tensor { dtype: op.dtype, shape: image.shape.clone(), data: Bytes::from(out), layout: Layout::Dense })
        }
    }
}

/// Each channel's 256 outputs, as little-endian bytes of the output type; None for a uint8
/// output, which is the input unchanged.
pub enum Tables {
    Float32(Vec<[[u8; 4]; 256]>),
    Float16(Vec<[[u8; 2]; 256]>),
}

impl Tables {
    /// The tables of `op` for images of `channels` channels, or why `op` cannot apply.
    pub fn new(op: &Normalize, channels: usize) -> Result<Option<Tables>, OpError> {
        for values in [&op.mean, &op.std] {
            if values.len() != channels {
                return Err(OpError::ChannelMismatch { expected: channels, actual: values.len() });
            }
        }
        if op.std.iter().any(|&s| s == 0.0 || !s.is_finite()) || op.mean.iter().any(|m| !m.is_finite()) {
            return Err(OpError::InvalidParameter(format!("std {:?} must be finite and non-zero", op.std)));
        }
        let value = |c: usize, x: usize| (x as f64 / 255.0 - op.mean[c]) / op.std[c];
        fn tables<const N: usize>(channels: usize, f: impl Fn(usize, usize) -> [u8; N]) -> Vec<[[u8; N]; 256]> {
            (0..channels).map(|c| std::array::from_fn(|x| f(c, x))).collect()
        }
        match op.dtype {
            DType::Uint8 => Ok(None),
            DType::Float32 => Ok(Some(Tables::Float32(tables(channels, |c, x| (value(c, x) as f32).to_le_bytes())))),
            DType::Float16 => {
                Ok(Some(Tables::Float16(tables(channels, |c, x| f16::from_f64(value(c, x)).to_le_bytes()))))
            }
            other => Err(OpError::InvalidParameter(format!("normalize cannot output {other:?}"))),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Tables::Float32(_) => DType::Float32,
            Tables::Float16(_) => DType::Float16,
        }
    }

    /// Bytes out for `pixels_len` bytes in.
    pub fn out_len(&self, pixels_len: usize) -> usize {
        pixels_len
            * match self {
                Tables::Float32(_) => 4,
                Tables::Float16(_) => 2,
            }
    }

    /// Appends the outputs of `pixels` (whole pixels of the tables' channels) to `out`, the
    /// pixels in reverse order when `mirrored` (a row flipped left-right).
    pub fn extend(&self, pixels: &[u8], mirrored: bool, out: &mut Vec<u8>) {
        match self {
            Tables::Float32(t) => extend_values(t, pixels, mirrored, out),
            Tables::Float16(t) => extend_values(t, pixels, mirrored, out),
        }
    }
}

fn extend_values<const N: usize>(tables: &[[[u8; N]; 256]], pixels: &[u8], mirrored: bool, out: &mut Vec<u8>) {
    match (tables.len(), mirrored) {
        (1, false) => lookup::<1, N, false>(pixels, out, tables),
        (1, true) => lookup::<1, N, true>(pixels, out, tables),
        (2, false) => lookup::<2, N, false>(pixels, out, tables),
        (2, true) => lookup::<2, N, true>(pixels, out, tables),
        (3, false) => lookup::<3, N, false>(pixels, out, tables),
        (3, true) => lookup::<3, N, true>(pixels, out, tables),
        (_, false) => lookup::<4, N, false>(pixels, out, tables),
        (_, true) => lookup::<4, N, true>(pixels, out, tables),
    }
}

/// Fixed-size pixels and 256-entry tables indexed by a u8 leave the loop free of bounds
/// checks. The output grows a block of pixels at a time: zeroing a block that is about to be
/// written stays in cache, where zeroing the whole output first would not.
fn lookup<const C: usize, const N: usize, const MIRRORED: bool>(
    src: &[u8],
    out: &mut Vec<u8>,
    tables: &[[[u8; N]; 256]],
) {
    const BLOCK: usize = 1024;
    let tables: &[[[u8; N]; 256]; C] = tables.try_into().expect("one table per channel");
    let (pixels, _) = src.as_chunks::<C>();
    out.reserve(pixels.len() * C * N);
    if MIRRORED {
        for block in pixels.rchunks(BLOCK) {
            write_block(block.iter().rev(), block.len(), out, tables);
        }
    } else {
        for block in pixels.chunks(BLOCK) {
            write_block(block.iter(), block.len(), out, tables);
        }
    }
}

#[inline(always)]
fn write_block<'a, const C: usize, const N: usize>(
    pixels: impl Iterator<Item = &'a [u8; C]>,
    n: usize,
    out: &mut Vec<u8>,
    tables: &[[[u8; N]; 256]; C],
) {
    let start = out.len();
    out.resize(start + n * C * N, 0);
    let (values, _) = out[start..].as_chunks_mut::<N>();
    for (px, dst) in pixels.zip(values.chunks_exact_mut(C)) {
        for c in 0..C {
            dst[c] = tables[c][usize::from(px[c])];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(dtype: DType, mean: Vec<f64>, std: Vec<f64>) -> Normalize {
        Normalize { mean, std, dtype, field: "image".into() }
    }

    fn image() -> Tensor {
        let data: Vec<u8> = (0..=255).flat_map(|v| [v, 255 - v, v / 2]).collect();
        Tensor::new(DType::Uint8, vec![16, 16, 3], Bytes::from(data)).unwrap()
    }

    const MEAN: [f64; 3] = [0.485, 0.456, 0.406];
    const STD: [f64; 3] = [0.229, 0.224, 0.225];

    #[test]
    fn float32_matches_the_formula() {
        let out = normalize(&image(), &op(DType::Float32, MEAN.to_vec(), STD.to_vec())).unwrap();
        assert_eq!((out.dtype, out.shape.clone()), (DType::Float32, vec![16, 16, 3]));
        let got: Vec<f32> = out.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        for (i, (&x, g)) in image().data.iter().zip(got).enumerate() {
            let want = (f64::from(x) / 255.0 - MEAN[i % 3]) / STD[i % 3];
            // Rounded once from f64: within half an f32 ulp (~1.2e-7 relative).
            assert!((f64::from(g) - want).abs() <= want.abs() * 1.2e-7, "{i}: {g} vs {want}");
        }
    }

    #[test]
    fn float16_agrees_with_float32_within_f16_precision() {
        let f32s = normalize(&image(), &op(DType::Float32, MEAN.to_vec(), STD.to_vec())).unwrap();
        let f16s = normalize(&image(), &op(DType::Float16, MEAN.to_vec(), STD.to_vec())).unwrap();
        assert_eq!(f16s.data.len() * 2, f32s.data.len());
        let a = f32s.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()));
        let b = f16s.data.chunks_exact(2).map(|b| f16::from_le_bytes(b.try_into().unwrap()).to_f32());
        for (x, y) in a.zip(b) {
            // f16 keeps 11 significant bits: half an ulp is 2^-11 relative, plus a floor for
            // the subnormal range near zero.
            assert!((x - y).abs() <= x.abs() * 2f32.powi(-11) + 2f32.powi(-24), "{x} vs {y}");
        }
    }

    #[test]
    fn uint8_passes_through_and_bad_parameters_fail() {
        let img = image();
        assert_eq!(normalize(&img, &op(DType::Uint8, MEAN.to_vec(), STD.to_vec())).unwrap(), img);
        let short = normalize(&img, &op(DType::Float32, vec![0.5], STD.to_vec())).unwrap_err();
        assert_eq!(short, OpError::ChannelMismatch { expected: 3, actual: 1 });
        assert!(normalize(&img, &op(DType::Float32, MEAN.to_vec(), vec![1.0, 0.0, 1.0])).is_err());
        assert!(normalize(&img, &op(DType::Int32, MEAN.to_vec(), STD.to_vec())).is_err());
    }
}
