//! Just enough of the protobuf wire format for tf.train.Example: decoding over a `Bytes` so
//! length-delimited payloads come out as slices of the record, not copies, and encoding for
//! tests and corpus generation. Hand-rolled because the schema is fixed and tiny, so codegen
//! would cost more than it saves.

use bytes::Bytes;

/// A decoded field value, by wire type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Varint(u64),
    Fixed64(u64),
    Len(Bytes),
    Fixed32(u32),
}

/// Reads `(field number, value)` pairs from one message's bytes.
pub(crate) struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    pub(crate) fn new(buf: Bytes) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// The next field, `None` at the end of the message.
    pub(crate) fn field(&mut self) -> Result<Option<(u32, Value)>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let number = u32::try_from(tag >> 3).map_err(|_| format!("field number {} too large", tag >> 3))?;
        if number == 0 {
            return Err("field number 0".into());
        }
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => Value::Fixed64(u64::from_le_bytes(self.take::<8>()?)),
            2 => {
                let len = self.varint()?;
                let len = usize::try_from(len).map_err(|_| "length overflows".to_string())?;
                if len > self.buf.len() - self.pos {
                    return Err(format!("length {len} runs past the end of the message"));
                }
                let value = self.buf.slice(self.pos..self.pos + len);
                self.pos += len;
                Value::Len(value)
            }
            5 => Value::Fixed32(u32::from_le_bytes(self.take::<4>()?)),
            // Groups (3, 4) are deprecated and never appear in Example; 6 and 7 are invalid.
            wire => return Err(format!("unsupported wire type {wire} for field {number}")),
        };
        Ok(Some((number, value)))
    }

    pub(crate) fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&byte) = self.buf.get(self.pos) else {
                return Err("varint runs past the end of the message".into());
            };
            self.pos += 1;
            // The tenth byte holds only the top bit of a u64; anything more is overflow.
            if i == 9 && byte > 1 {
                return Err("varint overflows 64 bits".into());
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes".into())
    }

    pub(crate) fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let end = self.pos.checked_add(N).filter(|&end| end <= self.buf.len());
        let Some(end) = end else {
            return Err(format!("{N}-byte value runs past the end of the message"));
        };
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.pos..end]);
        self.pos = end;
        Ok(out)
    }
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub(crate) fn put_tag(out: &mut Vec<u8>, number: u32, wire: u8) {
    put_varint(out, (u64::from(number) << 3) | u64::from(wire));
}

pub(crate) fn put_len(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
    put_tag(out, number, 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint_of(bytes: &[u8]) -> Result<u64, String> {
        Reader::new(Bytes::copy_from_slice(bytes)).varint()
    }

    #[test]
    fn varints_match_the_protobuf_spec_examples() {
        // From the encoding guide: 150 is 96 01, and -1 as int64 takes ten bytes.
        assert_eq!(varint_of(&[0x96, 0x01]), Ok(150));
        assert_eq!(varint_of(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]), Ok(u64::MAX));
        let mut out = Vec::new();
        put_varint(&mut out, 150);
        assert_eq!(out, [0x96, 0x01]);
        out.clear();
        put_varint(&mut out, u64::MAX);
        assert_eq!(out.len(), 10);
        assert_eq!(varint_of(&out), Ok(u64::MAX));
    }

    #[test]
    fn overlong_and_truncated_varints_are_errors() {
        assert!(varint_of(&[0xff; 10]).is_err());
        assert!(varint_of(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]).is_err());
        assert!(varint_of(&[0x80]).is_err());
        assert!(varint_of(&[]).is_err());
    }

    #[test]
    fn fields_decode_by_wire_type() {
        let mut msg = Vec::new();
        put_tag(&mut msg, 1, 0);
        put_varint(&mut msg, 7);
        put_len(&mut msg, 2, b"abc");
        put_tag(&mut msg, 3, 5);
        msg.extend_from_slice(&1.5f32.to_le_bytes());
        put_tag(&mut msg, 4, 1);
        msg.extend_from_slice(&9u64.to_le_bytes());
        let mut r = Reader::new(Bytes::from(msg));
        assert_eq!(r.field(), Ok(Some((1, Value::Varint(7)))));
        assert_eq!(r.field(), Ok(Some((2, Value::Len(Bytes::from_static(b"abc"))))));
        assert_eq!(r.field(), Ok(Some((3, Value::Fixed32(1.5f32.to_bits())))));
        assert_eq!(r.field(), Ok(Some((4, Value::Fixed64(9)))));
        assert_eq!(r.field(), Ok(None));
    }

    #[test]
    fn bad_lengths_and_wire_types_are_errors() {
        // Length 5 with only 2 bytes behind it.
        assert!(Reader::new(Bytes::from_static(&[0x0a, 0x05, 1, 2])).field().is_err());
        // Wire type 3 (start group).
        assert!(Reader::new(Bytes::from_static(&[0x0b])).field().is_err());
        // Field number 0.
        assert!(Reader::new(Bytes::from_static(&[0x00, 0x01])).field().is_err());
        // Fixed32 cut short.
        assert!(Reader::new(Bytes::from_static(&[0x0d, 1, 2])).field().is_err());
    }
}
