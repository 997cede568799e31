//! TFRecord framing: each record is `u64 length (LE) | u32 masked crc32c(length) | data |
//! u32 masked crc32c(data)`. A bad data CRC skips just that record, since its checked length
//! still locates the next one; a bad or truncated length leaves nothing to resync on, so the
//! shard stops there.

use bytes::Bytes;

use super::{Corrupt, CorruptReason, example};
use crate::element::Element;

const HEADER: usize = 12;
const FOOTER: usize = 4;

/// TFRecord's CRC masking: rotating and offsetting keeps a CRC of data that itself contains
/// CRCs from being trivially zero.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one framed record to `out`.
pub fn write_record(out: &mut Vec<u8>, payload: &[u8]) {
    let len = (payload.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
}

/// The framed payloads of a shard, as slices of `data`.
pub fn records(data: Bytes, shard: &str) -> impl Iterator<Item = Result<Bytes, Corrupt>> + use<> {
    Records::new(data, shard).map(|r| r.map(|(_, payload)| payload))
}

/// The shard's records decoded as tf.train.Examples (see [`example::decode`]).
pub fn read(data: Bytes, shard: &str) -> impl Iterator<Item = Result<Element, Corrupt>> + use<> {
    let shard = shard.to_owned();
    Records::new(data, &shard).map(move |record| {
        let (at, payload) = record?;
        example::decode(payload).map_err(|detail| Corrupt::new(&shard, at, CorruptReason::BadExample, detail))
    })
}

struct Records {
    data: Bytes,
    pos: usize,
    shard: String,
    done: bool,
}

impl Records {
    fn new(data: Bytes, shard: &str) -> Self {
        Records { data, pos: 0, shard: shard.to_owned(), done: false }
    }

    fn stop(&mut self, reason: CorruptReason, detail: String) -> Option<<Self as Iterator>::Item> {
        self.done = true;
        Some(Err(Corrupt::new(&self.shard, self.pos, reason, detail)))
    }
}

/// Yields each record's offset with its payload.
impl Iterator for Records {
    type Item = Result<(usize, Bytes), Corrupt>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.pos >= self.data.len() {
            return None;
        }
        let rest = &self.data[self.pos..];
        if rest.len() < HEADER {
            let detail = format!("{} bytes left, a record header needs {HEADER}", rest.len());
            return self.stop(CorruptReason::TruncatedLength, detail);
        }
        let len_bytes: [u8; 8] = rest[..8].try_into().unwrap_or_default();
        let stored = u32::from_le_bytes(rest[8..12].try_into().unwrap_or_default());
        if masked_crc(&len_bytes) != stored {
            return self.stop(CorruptReason::BadLengthCrc, "length CRC mismatch".into());
        }
        let len = u64::from_le_bytes(len_bytes);
        let body = rest.len() - HEADER;
        if (body as u64) < len.saturating_add(FOOTER as u64) {
            let detail = format!("record of {len} bytes, {body} bytes left in the shard");
            return self.stop(CorruptReason::TruncatedData, detail);
        }
        // Cannot truncate: len is below the buffer's length.
        let len = len as usize;
        let start = self.pos + HEADER;
        let payload = self.data.slice(start..start + len);
        let crc_at = start + len;
        let stored = u32::from_le_bytes(self.data[crc_at..crc_at + FOOTER].try_into().unwrap_or_default());
        let at = self.pos;
        self.pos = crc_at + FOOTER;
        if masked_crc(&payload) != stored {
            let detail = format!("data CRC mismatch in a record of {len} bytes");
            return Some(Err(Corrupt::new(&self.shard, at, CorruptReason::BadDataCrc, detail)));
        }
        Some(Ok((at, payload)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The standard CRC-32C check value (RFC 3720 / the Castagnoli catalogue entry).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // Masked values as computed by the Python `tfrecord` package's writer.
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc(b""), 0xa282_ead8);
    }
}
