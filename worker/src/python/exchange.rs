//! What crosses to a Python process and back: an element's fields laid out in the shared
//! memory file, described by small JSON messages (the protocol is stated in
//! worker/src/python/runtime.py). Arrays are written once into the shared memory,
//! viewed there by numpy without a copy, and the function's output is copied once out of it.

use std::fs::File;

use bytes::Bytes;
use memmap2::MmapMut;
use serde::{Deserialize, Serialize};
use stoker_api::{ArrayLayout, DType, Tensor};

use crate::apply::to_tensor;
use crate::element::{Element, Field};

/// Offsets in the shared memory are multiples of this (numpy and SIMD like aligned arrays;
/// the Python side aligns the same way).
const ALIGN: usize = 64;

fn aligned(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// One field's place in the shared memory.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Placed {
    Array {
        name: String,
        dtype: String,
        shape: Vec<usize>,
        offset: usize,
        length: usize,
        /// numpy's strides in bytes, when not C order (a planar image).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strides: Option<Vec<usize>>,
    },
    Bytes {
        name: String,
        offset: usize,
        length: usize,
    },
    /// Byte strings one after another.
    List {
        name: String,
        offset: usize,
        lengths: Vec<usize>,
    },
}

#[derive(Serialize, Debug)]
pub struct Request {
    pub op: usize,
    /// (seed, epoch, element, op): what the function's generator is seeded from.
    pub rng: [u64; 4],
    /// The shared memory file's size.
    pub size: usize,
    /// Where the output may start: past the input.
    pub out: usize,
    pub fields: Vec<Placed>,
}

/// A batched op's call: elements one after another in the shared memory.
#[derive(Serialize, Debug)]
pub struct BatchRequest {
    pub op: usize,
    pub rngs: Vec<[u64; 4]>,
    pub size: usize,
    pub out: usize,
    pub elements: Vec<Vec<Placed>>,
}

#[derive(Deserialize, Debug)]
#[serde(tag = "status", rename_all = "lowercase")]
pub enum Reply {
    Ready,
    Fatal {
        error: String,
    },
    /// `fields` for one element; `elements` for a batched call (None: dropped).
    Ok {
        size: usize,
        #[serde(default)]
        fields: Vec<Placed>,
        #[serde(default)]
        elements: Option<Vec<Option<Vec<Placed>>>>,
    },
    Drop,
    Error {
        error: String,
        traceback: String,
    },
}

/// The memory file both sides map. Either side may grow it; the other maps it again.
pub struct Shared {
    file: File,
    map: MmapMut,
}

impl Shared {
    /// An anonymous memory file (memfd) of `size` bytes; the child inherits it as fd 3.
    pub fn new(size: usize) -> std::io::Result<Shared> {
        // SAFETY: a plain syscall with a valid C string; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(c"stoker-python".as_ptr(), 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(size as u64)?;
        // SAFETY: the file is ours and the child's; neither truncates it below a size the
        // other has mapped (both only grow it).
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Shared { file, map })
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.file)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Grows the file (if it is smaller) and maps `size` bytes of it.
    pub fn ensure(&mut self, size: usize) -> std::io::Result<()> {
        if size <= self.map.len() {
            return Ok(());
        }
        if self.file.metadata()?.len() < size as u64 {
            self.file.set_len(size as u64)?;
        }
        // SAFETY: as in `new`.
        self.map = unsafe { MmapMut::map_mut(&self.file)? };
        Ok(())
    }
}

/// Writes `element` into `shared` from `start` (aligned), its images as `layout` says: the
/// request's fields and where the next element or the output may start.
pub fn place(
    element: Element,
    shared: &mut Shared,
    start: usize,
    layout: ArrayLayout,
) -> std::io::Result<(Vec<Placed>, usize)> {
    enum Payload {
        Array(Tensor),
        Bytes(Bytes),
        List(Vec<Bytes>),
    }
    let fields: Vec<(String, Payload)> = element
        .into_iter()
        .map(|(name, field)| {
            let payload = match field {
                Field::Bytes(b) => Payload::Bytes(b),
                Field::BytesList(list) => Payload::List(list),
                // Text: one string as bytes, more as a list (flattened, row-major).
                Field::Tensor(t) if t.dtype == DType::Bytes => {
                    let strings: Vec<Bytes> = t.string_values().map(|s| t.data.slice_ref(s)).collect();
                    match t.shape.is_empty() {
                        true => Payload::Bytes(strings.into_iter().next().unwrap_or_default()),
                        false => Payload::List(strings),
                    }
                }
                numeric => Payload::Array(to_tensor(numeric)),
            };
            (name, payload)
        })
        .collect();
    let size = |p: &Payload| match p {
        Payload::Array(t) => t.data.len(),
        Payload::Bytes(b) => b.len(),
        Payload::List(list) => list.iter().map(Bytes::len).sum(),
    };
    let end = fields.iter().fold(aligned(start), |end, (_, p)| aligned(end) + size(p));
    shared.ensure(aligned(end).max(ALIGN))?;
    let mut placed = Vec::with_capacity(fields.len());
    let mut offset = start;
    for (name, payload) in fields {
        offset = aligned(offset);
        let length = size(&payload);
        let out = &mut shared.map[offset..offset + length];
        placed.push(match payload {
            Payload::Array(t) => {
                let strides = match (layout, t.shape.as_slice()) {
                    (ArrayLayout::Planar, &[h, w, c]) => {
                        write_planar(&t.data, h * w, c, t.dtype.size(), out);
                        let item = t.dtype.size();
                        Some(vec![w * item, item, h * w * item])
                    }
                    _ => {
                        out.copy_from_slice(&t.data);
                        None
                    }
                };
                Placed::Array { name, dtype: t.dtype.numpy_name().into(), shape: t.shape, offset, length, strides }
            }
            Payload::Bytes(b) => {
                out.copy_from_slice(&b);
                Placed::Bytes { name, offset, length }
            }
            Payload::List(list) => {
                let mut at = 0;
                for b in &list {
                    out[at..at + b.len()].copy_from_slice(b);
                    at += b.len();
                }
                Placed::List { name, offset, lengths: list.iter().map(Bytes::len).collect() }
            }
        });
        offset += length;
    }
    Ok((placed, aligned(end)))
}

crate::avx2::dispatch! {
    /// Interleaved pixels (`channels` values of `item` bytes each) to one plane per channel;
    /// with AVX2 the byte loop is a few shuffles per 32 pixels (75 µs a 224x224 image as
    /// built, 6-11 µs with AVX2, measured apart).
    fn write_planar(src: &[u8], pixels: usize, channels: usize, item: usize, out: &mut [u8]) = planar;
}

#[inline(always)]
fn planar(src: &[u8], pixels: usize, channels: usize, item: usize, out: &mut [u8]) {
    let plane = pixels * item;
    // Images are nearly always uint8 RGB: one pass per channel over pixels of a size the
    // compiler knows, which it vectorises (a runtime channel count it does not).
    match (item, channels) {
        (1, 3) => return byte_planes::<3>(src, pixels, out),
        (1, 1) => return out[..pixels].copy_from_slice(&src[..pixels]),
        (1, 4) => return byte_planes::<4>(src, pixels, out),
        _ => {}
    }
    for (p, pixel) in src.chunks_exact(channels * item).enumerate() {
        for (c, value) in pixel.chunks_exact(item).enumerate() {
            let at = c * plane + p * item;
            out[at..at + item].copy_from_slice(value);
        }
    }
}

#[inline(always)]
fn byte_planes<const C: usize>(src: &[u8], pixels: usize, out: &mut [u8]) {
    let (src, _) = src.as_chunks::<C>();
    for (c, plane) in out.chunks_exact_mut(pixels).enumerate() {
        for (o, pixel) in plane.iter_mut().zip(src) {
            *o = pixel[c];
        }
    }
}

/// The element a reply describes, copied out of `shared`; an error says what is wrong with
/// the reply (out of bounds, an unknown dtype, a size the shape does not match, or more than
/// `limit` bytes in all).
pub fn take(fields: &[Placed], shared: &Shared, limit: usize) -> Result<Element, String> {
    let mut total = 0usize;
    let mut slice = |name: &str, offset: usize, length: usize| -> Result<&[u8], String> {
        total = total.saturating_add(length);
        if total > limit {
            return Err(format!("the returned element is larger than the limit of {limit} bytes"));
        }
        offset
            .checked_add(length)
            .filter(|end| *end <= shared.map.len())
            .map(|end| &shared.map[offset..end])
            .ok_or_else(|| format!("field {name:?} lies outside the shared memory"))
    };
    let mut element = Element::new();
    for placed in fields {
        let (name, field) = match placed {
            Placed::Array { name, dtype, shape, offset, length, strides } => {
                if strides.is_some() {
                    return Err(format!("field {name:?}: an output array must be in C order"));
                }
                let dtype = DType::from_numpy_name(dtype).ok_or_else(|| format!("field {name:?}: dtype {dtype}"))?;
                let data = Bytes::copy_from_slice(slice(name, *offset, *length)?);
                let tensor = Tensor::new(dtype, shape.clone(), data).map_err(|e| format!("field {name:?}: {e}"))?;
                (name, Field::Tensor(tensor))
            }
            Placed::Bytes { name, offset, length } => {
                (name, Field::Bytes(Bytes::copy_from_slice(slice(name, *offset, *length)?)))
            }
            Placed::List { name, offset, lengths } => {
                let whole = slice(
                    name,
                    *offset,
                    lengths.iter().try_fold(0usize, |a, l| a.checked_add(*l)).unwrap_or(usize::MAX),
                )?;
                let whole = Bytes::copy_from_slice(whole);
                let mut at = 0;
                let list = lengths
                    .iter()
                    .map(|l| {
                        let b = whole.slice(at..at + l);
                        at += l;
                        b
                    })
                    .collect();
                (name, Field::BytesList(list))
            }
        };
        element.insert(name.clone(), field);
    }
    Ok(element)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_element_round_trips_through_the_shared_memory() {
        let mut shared = Shared::new(ALIGN).unwrap();
        let image = Tensor::new(DType::Float16, vec![2, 3], Bytes::from(vec![7u8; 12])).unwrap();
        let element: Element = [
            ("image".to_string(), Field::Tensor(image.clone())),
            ("label".to_string(), Field::Int64(vec![3])),
            ("text".to_string(), Field::Bytes(Bytes::from_static(b"hello"))),
            ("tags".to_string(), Field::BytesList(vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")])),
        ]
        .into();
        let (placed, out) = place(element.clone(), &mut shared, 0, ArrayLayout::Interleaved).unwrap();
        assert!(out.is_multiple_of(ALIGN) && shared.len() >= out, "the file grew to hold the input");
        assert!(placed.iter().all(|p| match p {
            Placed::Array { offset, .. } | Placed::Bytes { offset, .. } | Placed::List { offset, .. } =>
                offset.is_multiple_of(ALIGN),
        }));
        let back = take(&placed, &shared, 1 << 20).unwrap();
        assert_eq!(back["image"], Field::Tensor(image));
        let Field::Tensor(label) = &back["label"] else { panic!("a number becomes an array") };
        assert_eq!((label.dtype, label.shape.clone()), (DType::Int64, vec![]), "one value is a scalar, as in a batch");
        assert_eq!(back["text"], Field::Bytes(Bytes::from_static(b"hello")));
        assert_eq!(back["tags"], Field::BytesList(vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")]));
        // A batched call's next element goes after it, aligned, and leaves the first intact.
        let (second, end) = place(element, &mut shared, out + 1, ArrayLayout::Interleaved).unwrap();
        assert!(end > out && end.is_multiple_of(ALIGN));
        assert_eq!(take(&second, &shared, 1 << 20).unwrap(), back);
        assert_eq!(take(&placed, &shared, 1 << 20).unwrap(), back);
    }

    #[test]
    fn a_planar_image_is_the_same_values_one_channel_after_another() {
        // uint8 with 1, 3 and 4 channels take their own loops; the rest the general one.
        for (dtype, c) in [1, 2, 3, 4].into_iter().flat_map(|c| [(DType::Uint8, c), (DType::Float32, c)]) {
            let (h, w, item) = (3, 37, dtype.size());
            let data: Vec<u8> = (0..h * w * c * item).map(|i| i as u8).collect();
            let image = Tensor::new(dtype, vec![h, w, c], Bytes::from(data.clone())).unwrap();
            let label = Tensor::new(DType::Int64, vec![2], Bytes::from(vec![1u8; 16])).unwrap();
            let element: Element =
                [("image".to_string(), Field::Tensor(image)), ("label".to_string(), Field::Tensor(label))].into();
            let mut shared = Shared::new(ALIGN).unwrap();
            let (placed, _) = place(element, &mut shared, 0, ArrayLayout::Planar).unwrap();
            let Placed::Array { offset, strides: Some(strides), .. } = &placed[0] else {
                panic!("the image is planar: {placed:?}")
            };
            assert_eq!(strides, &vec![w * item, item, h * w * item]);
            // Value [y, x, ch] at offset y * strides[0] + x * strides[1] + ch * strides[2].
            for (y, x, ch) in (0..h).flat_map(|y| (0..w).flat_map(move |x| (0..c).map(move |ch| (y, x, ch)))) {
                let at = offset + y * strides[0] + x * strides[1] + ch * strides[2];
                let want = ((y * w + x) * c + ch) * item;
                assert_eq!(&shared.map[at..at + item], &data[want..want + item], "{dtype:?} x{c} [{y}, {x}, {ch}]");
            }
            assert!(matches!(&placed[1], Placed::Array { strides: None, .. }), "only images are planar");
        }
    }

    #[test]
    fn a_bad_reply_is_an_error_not_a_crash() {
        let shared = Shared::new(4096).unwrap();
        let array = |dtype: &str, shape: Vec<usize>, offset, length| Placed::Array {
            name: "x".into(),
            dtype: dtype.into(),
            shape,
            offset,
            length,
            strides: None,
        };
        let outside = take(&[array("uint8", vec![10], 4090, 10)], &shared, 1 << 20).unwrap_err();
        assert!(outside.contains("outside"), "{outside}");
        assert!(take(&[array("uint8", vec![usize::MAX], usize::MAX, 2)], &shared, 1 << 20).is_err());
        assert!(take(&[array("complex64", vec![1], 0, 8)], &shared, 1 << 20).unwrap_err().contains("complex64"));
        assert!(take(&[array("int32", vec![3], 0, 8)], &shared, 1 << 20).unwrap_err().contains("needs 12 bytes"));
        assert!(take(&[array("uint8", vec![100], 0, 100)], &shared, 64).unwrap_err().contains("limit"));
        let list = Placed::List { name: "l".into(), offset: 0, lengths: vec![usize::MAX, 2] };
        assert!(take(&[list], &shared, 1 << 20).is_err());
    }
}
