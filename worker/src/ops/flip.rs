//! randomFlip and the deterministic flips under it.

use rand::{Rng, RngExt};
use stoker_api::{RandomFlip, Tensor};

use super::OpError;
use super::image::{Dims, image_tensor};

/// Mirrors left-right.
pub fn flip_horizontal(image: &Tensor) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    let mut out = Vec::with_capacity(image.data.len());
    for row in image.data.chunks_exact(d.row_len()) {
        extend_row(row, d.c, true, &mut out);
    }
    Ok(image_tensor(d.h, d.w, d.c, out))
}

fn mirror<const C: usize>(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks_exact(C).rev().zip(dst.chunks_exact_mut(C)) {
        d.copy_from_slice(s);
    }
}

/// Mirrors top-bottom.
pub fn flip_vertical(image: &Tensor) -> Result<Tensor, OpError> {
    let d = Dims::of(image)?;
    let mut out = Vec::with_capacity(image.data.len());
    for row in image.data.chunks_exact(d.row_len()).rev() {
        out.extend_from_slice(row);
    }
    Ok(image_tensor(d.h, d.w, d.c, out))
}

/// Which axes an image is flipped along.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flips {
    pub horizontal: bool,
    pub vertical: bool,
}

/// randomFlip's draws, horizontal first; only enabled axes draw.
pub fn flips(op: &RandomFlip, rng: &mut impl Rng) -> Flips {
    let horizontal = op.horizontal && rng.random_bool(0.5);
    let vertical = op.vertical && rng.random_bool(0.5);
    Flips { horizontal, vertical }
}

/// Appends a row of `c`-channel pixels to `out`, the pixels in reverse order when `mirrored`.
pub(crate) fn extend_row(row: &[u8], c: usize, mirrored: bool, out: &mut Vec<u8>) {
    if !mirrored {
        out.extend_from_slice(row);
        return;
    }
    let start = out.len();
    out.resize(start + row.len(), 0);
    let dst = &mut out[start..];
    match c {
        1 => mirror::<1>(row, dst),
        2 => mirror::<2>(row, dst),
        3 => mirror::<3>(row, dst),
        _ => mirror::<4>(row, dst),
    }
}

/// Flips each enabled axis with probability 1/2, horizontal drawn first. Only enabled axes
/// draw, and an unflipped image is returned without copying its pixels.
pub fn random_flip(image: &Tensor, op: &RandomFlip, rng: &mut impl Rng) -> Result<Tensor, OpError> {
    Dims::of(image)?;
    let Flips { horizontal, vertical } = flips(op, rng);
    let mut out = image.clone();
    if horizontal {
        out = flip_horizontal(&out)?;
    }
    if vertical {
        out = flip_vertical(&out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use stoker_api::DType;

    use super::*;
    use crate::ops::element_rng;

    fn image(h: usize, w: usize, c: usize) -> Tensor {
        let data: Vec<u8> = (0..h * w * c).map(|i| (i * 7 % 256) as u8).collect();
        Tensor::new(DType::Uint8, vec![h, w, c], Bytes::from(data)).unwrap()
    }

    #[test]
    fn flips_move_pixels_and_twice_is_identity() {
        let img = image(2, 3, 3);
        let h = flip_horizontal(&img).unwrap();
        assert_eq!(&h.data[..3], &img.data[6..9]);
        assert_eq!(&h.data[6..9], &img.data[..3]);
        let v = flip_vertical(&img).unwrap();
        assert_eq!(&v.data[..9], &img.data[9..]);
        for c in 1..=4 {
            let img = image(5, 7, c);
            assert_eq!(flip_horizontal(&flip_horizontal(&img).unwrap()).unwrap(), img);
            assert_eq!(flip_vertical(&flip_vertical(&img).unwrap()).unwrap(), img);
            assert_ne!(flip_horizontal(&img).unwrap(), img);
        }
    }

    #[test]
    fn random_flip_is_seeded_and_flips_about_half() {
        let img = image(4, 5, 3);
        let op = RandomFlip { horizontal: true, vertical: false, field: "image".into() };
        let run = |e| random_flip(&img, &op, &mut element_rng(3, 0, e, 1)).unwrap();
        assert_eq!(run(11), run(11));
        let flipped = (0..1000).filter(|&e| run(e) != img).count();
        assert!((400..600).contains(&flipped), "{flipped} of 1000 flipped");
        let none = RandomFlip { horizontal: false, vertical: false, field: "image".into() };
        assert_eq!(random_flip(&img, &none, &mut element_rng(0, 0, 0, 0)).unwrap(), img);
    }
}
