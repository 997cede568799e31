//! Cutting a batch into BatchChunk messages that each fit the client's message limit.
//!
//! The payload is the tensors' bytes in header order. A message holds at most one piece of
//! each tensor, so that a client can view a tensor that arrives in one message without
//! copying it. A piece within one buffer is a slice of it (`Bytes::slice`), no copy; a piece
//! of a worker's stacked tensor (its rows' buffers, [`crate::Stacked`]) that spans rows is
//! joined, the one copy of the batch a message stream makes besides its encoding (a
//! shared-memory stream makes none). The size arithmetic is exact protobuf encoding arithmetic, so every
//! chunk is within the limit by construction (the tests check it against prost's `encoded_len`).

use bytes::Bytes;
use prost::Message;
use prost::encoding::encoded_len_varint;

use crate::proto::{self, BatchChunk, BatchHeader, TensorMeta};
use crate::{Batch, Payload};

/// Bytes kept free in every message besides the fields counted exactly, for framing slack.
const SLACK: usize = 16;
/// Encoded size of `last = true`: a one-byte key and a one-byte value.
const LAST_FIELD: usize = 2;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("the batch header alone needs {header} bytes, over the {limit}-byte message limit")]
    HeaderTooLarge { header: usize, limit: usize },
}

/// The header describing a batch: where it came from and its tensors in payload order.
pub fn header<T: Payload>(batch: &Batch<T>) -> BatchHeader {
    BatchHeader {
        epoch: batch.epoch,
        split: batch.split,
        sequence: batch.sequence,
        completes: batch.completes.clone(),
        rows: batch.rows.clone(),
        incarnation: batch.incarnation,
        round: batch.round.clone(),
        stream_seq: batch.stream_seq,
        echo: batch.echo,
        tensors: batch
            .tensors
            .iter()
            .map(|(name, t)| TensorMeta {
                name: name.clone(),
                dtype: proto::Dtype::from(t.dtype()) as i32,
                shape: t.shape().iter().map(|&d| d as u64).collect(),
                byte_length: t.byte_len() as u64,
                layout: proto::Layout::from(t.layout()) as i32,
            })
            .collect(),
    }
}

/// The chunks of `batch`, each encoding to at most `max_message_bytes`.
pub fn chunk_batch<T: Payload>(batch: &Batch<T>, max_message_bytes: usize) -> Result<Chunks, ChunkError> {
    let header = header(batch);
    let header_len = header.encoded_len();
    let header_field = 1 + encoded_len_varint(header_len as u64) + header_len;
    // The first chunk must hold the header and at least a one-byte piece, or a batch with
    // payload could never make progress.
    let room = max_message_bytes.saturating_sub(SLACK + LAST_FIELD);
    if header_field + MIN_PIECE > room {
        return Err(ChunkError::HeaderTooLarge { header: header_field, limit: max_message_bytes });
    }
    let tensors: Vec<Vec<Bytes>> = batch
        .tensors
        .values()
        .map(|t| t.parts().iter().filter(|p| !p.is_empty()).cloned().collect::<Vec<_>>())
        .filter(|parts| !parts.is_empty())
        .collect();
    let left = tensors.first().map_or(0, |parts| parts.iter().map(Bytes::len).sum());
    Ok(Chunks { header: Some(header), header_field, room, tensors, tensor: 0, part: 0, offset: 0, left, done: false })
}

/// Smallest useful piece: key, one-byte length, one byte.
const MIN_PIECE: usize = 3;

/// Iterator over a batch's chunks; cheap to hold (the tensors are reference-counted).
#[derive(Debug)]
pub struct Chunks {
    header: Option<BatchHeader>,
    header_field: usize,
    /// Bytes a chunk may use for its header and pieces.
    room: usize,
    /// Each tensor's buffers (none empty), tensors without bytes left out.
    tensors: Vec<Vec<Bytes>>,
    /// Where the next piece starts: its tensor, the buffer of it and where in that; and what
    /// is left of the tensor from there.
    tensor: usize,
    part: usize,
    offset: usize,
    left: usize,
    done: bool,
}

impl Chunks {
    /// The batch's header, for a sender that carries the payload another way (a shared-memory
    /// file) once the header was checked to fit a message.
    pub fn into_header(self) -> Option<BatchHeader> {
        self.header
    }

    /// The next `n` bytes of the current tensor (at most what is left of it): a slice of its
    /// buffer, or those of several buffers joined.
    fn take(&mut self, n: usize) -> Bytes {
        let parts = &self.tensors[self.tensor];
        let piece = if parts[self.part].len() - self.offset >= n {
            let piece = parts[self.part].slice(self.offset..self.offset + n);
            self.offset += n;
            piece
        } else {
            let mut joined = bytes::BytesMut::with_capacity(n);
            while joined.len() < n {
                if self.offset == parts[self.part].len() {
                    (self.part, self.offset) = (self.part + 1, 0);
                }
                let buffer = &parts[self.part];
                let k = (buffer.len() - self.offset).min(n - joined.len());
                joined.extend_from_slice(&buffer[self.offset..self.offset + k]);
                self.offset += k;
            }
            joined.freeze()
        };
        if self.offset == parts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
        self.left -= n;
        if self.left == 0 {
            (self.tensor, self.part, self.offset) = (self.tensor + 1, 0, 0);
            self.left = self.tensors.get(self.tensor).map_or(0, |parts| parts.iter().map(Bytes::len).sum());
        }
        piece
    }
}

impl Iterator for Chunks {
    type Item = BatchChunk;

    fn next(&mut self) -> Option<BatchChunk> {
        if self.done {
            return None;
        }
        let header = self.header.take();
        let mut room = self.room - if header.is_some() { self.header_field } else { 0 };
        let mut pieces = Vec::new();
        while self.tensor < self.tensors.len() && room >= MIN_PIECE {
            // A piece of n bytes costs 1 (key) + varint(n) + n; bounding varint(n) by
            // varint(room) keeps the arithmetic simple and never overshoots.
            let n = self.left.min(room - 1 - encoded_len_varint(room as u64));
            if n == 0 {
                break;
            }
            pieces.push(self.take(n));
            room -= 1 + encoded_len_varint(n as u64) + n;
        }
        let last = self.tensor == self.tensors.len();
        self.done = last;
        Some(BatchChunk { header, pieces, last, shared_file: String::new(), reuse_shared_file: false })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{DType, Tensor};

    fn batch(sizes: &[usize]) -> Batch {
        let tensors = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let data: Vec<u8> = (0..n).map(|j| (i * 31 + j) as u8).collect();
                (format!("t{i}"), Tensor::new(DType::Uint8, vec![n], Bytes::from(data)).unwrap())
            })
            .collect::<BTreeMap<_, _>>();
        Batch {
            tensors,
            epoch: 3,
            split: 5,
            sequence: 7,
            completes: vec![5],
            rows: vec![5 << 32, 5 << 32 | 9],
            incarnation: 11,
            round: Some(proto::RoundRef { worker: "w-1".into(), index: 4 }),
            stream_seq: 13,
            echo: true,
        }
    }

    fn payload(b: &Batch) -> Vec<u8> {
        b.tensors.values().flat_map(|t| t.data.iter().copied()).collect()
    }

    #[test]
    fn small_batch_is_one_message() {
        let b = batch(&[100, 4]);
        let chunks: Vec<_> = chunk_batch(&b, 1 << 20).unwrap().collect();
        assert_eq!(chunks.len(), 1);
        assert!(chunks[0].last);
        assert_eq!(chunks[0].header.as_ref().unwrap().tensors.len(), 2);
        assert_eq!(chunks[0].pieces.len(), 2);
    }

    #[test]
    fn every_chunk_fits_and_the_payload_is_preserved() {
        for limit in [70_000usize, 65_536, 100_003] {
            for sizes in [vec![1_000_000], vec![65_536, 3, 0, 200_000], vec![0, 0], vec![limit]] {
                let b = batch(&sizes);
                let chunks: Vec<_> = chunk_batch(&b, limit).unwrap().collect();
                assert!(chunks[0].header.is_some());
                assert!(chunks[1..].iter().all(|c| c.header.is_none()));
                assert!(chunks.last().unwrap().last);
                assert!(chunks[..chunks.len() - 1].iter().all(|c| !c.last));
                for c in &chunks {
                    assert!(c.encoded_len() <= limit, "{} > {limit}", c.encoded_len());
                    assert!(c.pieces.iter().all(|p| !p.is_empty()));
                }
                let got: Vec<u8> = chunks.iter().flat_map(|c| c.pieces.iter().flatten().copied()).collect();
                assert_eq!(got, payload(&b), "sizes {sizes:?} limit {limit}");
                // Chunks are nearly full: no more than one extra message beyond the minimum.
                let total: usize = sizes.iter().sum();
                assert!(chunks.len() <= total / (limit - 200) + 2, "{} chunks", chunks.len());
            }
        }
    }

    #[test]
    fn pieces_are_slices_of_the_tensor_buffers() {
        let b = batch(&[300_000]);
        let base = b.tensors["t0"].data.as_ptr();
        let chunks: Vec<_> = chunk_batch(&b, 100_000).unwrap().collect();
        assert_eq!(chunks[0].pieces[0].as_ptr(), base);
        assert_eq!(chunks[1].pieces[0].as_ptr(), base.wrapping_add(chunks[0].pieces[0].len()));
    }

    #[test]
    fn a_stacked_batch_goes_out_as_its_parts_and_equals_it_joined() {
        let b = batch(&[70_000, 5, 130_000]);
        // The same tensors as rows' buffers: t0 in three parts, t2 in two, t1 in one.
        let split = |t: &Tensor, at: &[usize]| {
            let mut parts = Vec::new();
            let mut from = 0;
            for &to in at.iter().chain([&t.data.len()]) {
                parts.push(t.data.slice(from..to));
                from = to;
            }
            crate::Stacked { dtype: t.dtype, shape: t.shape.clone(), parts, layout: t.layout }
        };
        let cuts: [&[usize]; 3] = [&[1, 40_000], &[], &[65_000]];
        let stacked = Batch {
            tensors: b.tensors.iter().zip(cuts).map(|((name, t), at)| (name.clone(), split(t, at))).collect(),
            epoch: b.epoch,
            split: b.split,
            sequence: b.sequence,
            completes: b.completes.clone(),
            rows: b.rows.clone(),
            incarnation: b.incarnation,
            round: b.round.clone(),
            stream_seq: b.stream_seq,
            echo: b.echo,
        };
        assert_eq!(stacked.join(), b);
        let parts: Vec<&Bytes> = stacked.tensors.values().flat_map(|t| &t.parts).collect();
        let chunks: Vec<_> = chunk_batch(&stacked, 65_536).unwrap().collect();
        assert_eq!(chunks[0].header, Some(header(&b)), "the same header as the joined batch's");
        // One piece per tensor in each message: t0 (70,000 bytes) takes the first message and
        // part of the second, t1 and the rest of t0 and the start of t2 the second, ...
        let counts: Vec<usize> = chunks.iter().map(|c| c.pieces.len()).collect();
        assert!(counts.iter().all(|&n| n <= 3), "{counts:?}");
        // A piece within one part is a slice of it; t0's first piece spans its first two parts.
        let within = |piece: &Bytes| {
            parts.iter().any(|p| {
                let (start, end) = (p.as_ptr() as usize, p.as_ptr() as usize + p.len());
                start <= piece.as_ptr() as usize && piece.as_ptr() as usize + piece.len() <= end
            })
        };
        assert!(!within(&chunks[0].pieces[0]), "joined across t0's first parts");
        let t2_last = chunks.last().unwrap().pieces.last().unwrap();
        assert!(within(t2_last), "t2's end lies in its second part: a slice");
        let got: Vec<u8> = chunks.iter().flat_map(|c| c.pieces.iter().flatten().copied()).collect();
        assert_eq!(got, payload(&b));
    }

    #[test]
    fn a_header_over_the_limit_is_an_error() {
        let tensors = (0..5000)
            .map(|i| {
                (format!("a-rather-long-tensor-name-{i}"), Tensor::new(DType::Uint8, vec![0], Bytes::new()).unwrap())
            })
            .collect();
        let b = Batch { tensors, ..Batch::default() };
        assert!(matches!(chunk_batch(&b, 65_536), Err(ChunkError::HeaderTooLarge { .. })));
    }
}
