//! The chunk file: `MAGIC`, then records `u32 len | u32 crc32c(payload) | payload`, all
//! little-endian. A payload is the element's position in its split and its fields, each
//! `u16 name len | name | u8 kind | data`. Reading slices bytes and tensors out of the file's
//! buffer instead of copying them.

use bytes::Bytes;
use stoker_api::{DType, Tensor};

use crate::element::{Element, Field};

pub const MAGIC: &[u8; 8] = b"STKCHNK1";

const RECORD_HEADER: usize = 8;

const BYTES: u8 = 0;
const BYTES_LIST: u8 = 1;
const INT64: u8 = 2;
const FLOAT32: u8 = 3;
const FLOAT64: u8 = 4;
const TENSOR: u8 = 5;

/// Why a chunk cannot be served; offsets are into the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorruptChunk {
    #[error("not a chunk file (bad magic)")]
    BadMagic,
    #[error("truncated record at byte {offset}")]
    Truncated { offset: usize },
    #[error("checksum mismatch in the record at byte {offset}")]
    Checksum { offset: usize },
    #[error("malformed record at byte {offset}: {detail}")]
    Malformed { offset: usize, detail: String },
}

/// Appends one record for `element` at `position` in its split.
pub fn encode_record(position: u64, element: &Element, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; RECORD_HEADER]);
    out.extend_from_slice(&position.to_le_bytes());
    out.extend_from_slice(&(element.len() as u32).to_le_bytes());
    for (name, field) in element {
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        match field {
            Field::Bytes(b) => {
                out.push(BYTES);
                put_bytes(out, b);
            }
            Field::BytesList(list) => {
                out.push(BYTES_LIST);
                out.extend_from_slice(&(list.len() as u64).to_le_bytes());
                list.iter().for_each(|b| put_bytes(out, b));
            }
            Field::Int64(v) => put_numbers(out, INT64, v.iter().map(|x| x.to_le_bytes())),
            Field::Float32(v) => put_numbers(out, FLOAT32, v.iter().map(|x| x.to_le_bytes())),
            Field::Float64(v) => put_numbers(out, FLOAT64, v.iter().map(|x| x.to_le_bytes())),
            Field::Tensor(t) => {
                out.push(TENSOR);
                out.push(dtype_code(t.dtype));
                out.push(t.shape.len() as u8);
                t.shape.iter().for_each(|d| out.extend_from_slice(&(*d as u64).to_le_bytes()));
                put_bytes(out, &t.data);
            }
        }
    }
    let payload = &out[start + RECORD_HEADER..];
    let (len, crc) = (payload.len() as u32, crc32c::crc32c(payload));
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// The bytes `encode_record` appends for `element`: what caching it costs on the volume.
pub fn encoded_len(element: &Element) -> usize {
    let fields: usize = element
        .iter()
        .map(|(name, field)| {
            2 + name.len()
                + 1
                + match field {
                    Field::Bytes(b) => 8 + b.len(),
                    Field::BytesList(list) => 8 + list.iter().map(|b| 8 + b.len()).sum::<usize>(),
                    Field::Int64(v) => 8 + 8 * v.len(),
                    Field::Float32(v) => 8 + 4 * v.len(),
                    Field::Float64(v) => 8 + 8 * v.len(),
                    Field::Tensor(t) => 2 + 8 * t.shape.len() + 8 + t.data.len(),
                }
        })
        .sum();
    RECORD_HEADER + 8 + 4 + fields
}

/// The records of a chunk file, in order, as (position in the split, element). The first
/// error ends the iteration: nothing after a bad record can be trusted.
pub fn read_records(file: Bytes) -> impl Iterator<Item = Result<(u64, Element), CorruptChunk>> {
    let mut offset = MAGIC.len();
    let mut failed = false;
    if !file.starts_with(MAGIC) {
        failed = true;
    }
    let mut bad_magic = failed;
    std::iter::from_fn(move || {
        if bad_magic {
            bad_magic = false;
            return Some(Err(CorruptChunk::BadMagic));
        }
        if failed || offset == file.len() {
            return None;
        }
        let record = read_record(&file, offset);
        match &record {
            Ok((_, next)) => offset = *next,
            Err(_) => failed = true,
        }
        Some(record.map(|(element, _)| element))
    })
}

/// The record at `offset` and the offset after it.
fn read_record(file: &Bytes, offset: usize) -> Result<((u64, Element), usize), CorruptChunk> {
    let header = file.get(offset..offset + RECORD_HEADER).ok_or(CorruptChunk::Truncated { offset })?;
    let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
    let crc = u32::from_le_bytes(header[4..].try_into().unwrap());
    let start = offset + RECORD_HEADER;
    let end = start.checked_add(len).filter(|&end| end <= file.len()).ok_or(CorruptChunk::Truncated { offset })?;
    if crc32c::crc32c(&file[start..end]) != crc {
        return Err(CorruptChunk::Checksum { offset });
    }
    let mut r = Reader { file, at: start, end };
    let malformed = |detail: String| CorruptChunk::Malformed { offset, detail };
    let record = r.record().map_err(malformed)?;
    if r.at != end {
        return Err(malformed(format!("{} bytes left over", end - r.at)));
    }
    Ok((record, end))
}

/// A cursor over one record's checksummed payload.
struct Reader<'a> {
    file: &'a Bytes,
    at: usize,
    end: usize,
}

impl Reader<'_> {
    fn record(&mut self) -> Result<(u64, Element), String> {
        let position = self.u64()?;
        let fields = self.u32()?;
        let mut element = Element::new();
        for _ in 0..fields {
            let name_len = u16::from_le_bytes(self.array()?) as usize;
            let name = std::str::from_utf8(&self.take(name_len)?)
                .map_err(|_| "a field name is not UTF-8".to_string())?
                .to_string();
            let field = match self.u8()? {
                BYTES => Field::Bytes(self.bytes()?),
                BYTES_LIST => {
                    let n = self.count(8)?;
                    Field::BytesList((0..n).map(|_| self.bytes()).collect::<Result<_, _>>()?)
                }
                INT64 => Field::Int64(self.numbers(i64::from_le_bytes)?),
                FLOAT32 => Field::Float32(self.numbers(f32::from_le_bytes)?),
                FLOAT64 => Field::Float64(self.numbers(f64::from_le_bytes)?),
                TENSOR => {
                    let dtype = dtype_from_code(self.u8()?)?;
                    let ndim = self.u8()? as usize;
                    let shape = (0..ndim).map(|_| self.u64().map(|d| d as usize)).collect::<Result<Vec<_>, _>>()?;
                    let data = self.bytes()?;
                    Field::Tensor(Tensor::new(dtype, shape, data).map_err(|e| e.to_string())?)
                }
                kind => return Err(format!("unknown field kind {kind}")),
            };
            element.insert(name, field);
        }
        Ok((position, element))
    }

    fn take(&mut self, n: usize) -> Result<Bytes, String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.end)
            .ok_or_else(|| format!("a field runs past the record ({n} bytes)"))?;
        let bytes = self.file.slice(self.at..end);
        self.at = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?[..].try_into().unwrap())
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items of at least `min_size` bytes each, checked against what is left so a
    /// bad count cannot make us allocate more than the record holds.
    fn count(&mut self, min_size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        if n.saturating_mul(min_size as u64) > (self.end - self.at) as u64 {
            return Err(format!("a count of {n} runs past the record"));
        }
        Ok(n as usize)
    }

    fn bytes(&mut self) -> Result<Bytes, String> {
        let n = self.count(1)?;
        self.take(n)
    }

    fn numbers<T, const N: usize>(&mut self, from: fn([u8; N]) -> T) -> Result<Vec<T>, String> {
        let n = self.count(N)?;
        let data = self.take(n * N)?;
        Ok(data.chunks_exact(N).map(|c| from(c.try_into().unwrap())).collect())
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_numbers<const N: usize>(out: &mut Vec<u8>, kind: u8, values: impl ExactSizeIterator<Item = [u8; N]>) {
    out.push(kind);
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    values.for_each(|v| out.extend_from_slice(&v));
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::Uint8 => 0,
        DType::Int32 => 1,
        DType::Int64 => 2,
        DType::Float16 => 3,
        DType::Float32 => 4,
        DType::Float64 => 5,
        DType::Bytes => 6,
    }
}

fn dtype_from_code(code: u8) -> Result<DType, String> {
    Ok(match code {
        0 => DType::Uint8,
        1 => DType::Int32,
        2 => DType::Int64,
        3 => DType::Float16,
        4 => DType::Float32,
        5 => DType::Float64,
        6 => DType::Bytes,
        _ => return Err(format!("unknown dtype {code}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn element(i: u8) -> Element {
        let mut e = Element::new();
        e.insert("label".into(), Field::Int64(vec![i as i64, -1]));
        e.insert("name".into(), Field::Bytes(Bytes::from(vec![b'a' + i; 3])));
        e.insert("tags".into(), Field::BytesList(vec![Bytes::from_static(b"x"), Bytes::new()]));
        e.insert("w".into(), Field::Float32(vec![0.5, f32::MAX]));
        e.insert("z".into(), Field::Float64(vec![-2.25]));
        let pixels = Bytes::from((0..12).map(|p| p + i).collect::<Vec<u8>>());
        e.insert("image".into(), Field::Tensor(Tensor::new(DType::Uint8, vec![2, 2, 3], pixels).unwrap()));
        e
    }

    fn file(elements: &[Element]) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        for (i, e) in elements.iter().enumerate() {
            let before = out.len();
            encode_record(i as u64 * 7, e, &mut out);
            assert_eq!(out.len() - before, encoded_len(e), "encoded_len is what encode_record appends");
        }
        out
    }

    #[test]
    fn records_round_trip_with_their_positions() {
        let elements: Vec<Element> = (0..5).map(element).collect();
        let read: Vec<(u64, Element)> = read_records(Bytes::from(file(&elements))).collect::<Result<_, _>>().unwrap();
        assert_eq!(read.len(), 5);
        for (i, (position, e)) in read.into_iter().enumerate() {
            assert_eq!(position, i as u64 * 7);
            assert_eq!(e, elements[i]);
        }
    }

    #[test]
    fn tensors_are_slices_of_the_file_buffer() {
        let bytes = Bytes::from(file(&[element(1)]));
        let range = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
        let (_, e) = read_records(bytes.clone()).next().unwrap().unwrap();
        let Field::Tensor(t) = &e["image"] else { panic!("a tensor") };
        assert!(range.contains(&(t.data.as_ptr() as usize)), "the tensor was copied");
    }

    #[test]
    fn a_flipped_bit_is_a_checksum_error_and_ends_the_reading() {
        let elements: Vec<Element> = (0..3).map(element).collect();
        let mut bytes = file(&elements);
        let second = MAGIC.len() + encoded_len(&elements[0]);
        bytes[second + RECORD_HEADER + 20] ^= 0x10;
        let read: Vec<_> = read_records(Bytes::from(bytes)).collect();
        assert_eq!(read.len(), 2, "the good record, then the error, then nothing");
        assert!(read[0].is_ok());
        assert_eq!(read[1], Err(CorruptChunk::Checksum { offset: second }));
    }

    #[test]
    fn truncation_and_bad_magic_are_reported() {
        let bytes = file(&[element(0), element(1)]);
        let cut = Bytes::from(bytes[..bytes.len() - 3].to_vec());
        let second = MAGIC.len() + encoded_len(&element(0));
        assert_eq!(read_records(cut).last(), Some(Err(CorruptChunk::Truncated { offset: second })));
        let mut other = bytes.clone();
        other[0] = b'X';
        assert_eq!(read_records(Bytes::from(other)).collect::<Vec<_>>(), vec![Err(CorruptChunk::BadMagic)]);
        assert_eq!(read_records(Bytes::from_static(MAGIC)).count(), 0, "an empty chunk has no records");
    }

    #[test]
    fn a_checksummed_but_malformed_payload_is_an_error_not_a_panic() {
        // A valid checksum over a field count that promises more than the record holds.
        let mut payload = 3u64.to_le_bytes().to_vec();
        payload.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
        bytes.extend_from_slice(&payload);
        let read: Vec<_> = read_records(Bytes::from(bytes)).collect();
        assert!(matches!(&read[..], [Err(CorruptChunk::Malformed { offset: 8, .. })]), "{read:?}");
    }
}
