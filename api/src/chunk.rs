//! Cutting a batch into BatchChunk messages that each fit the client's message limit.
//!
//! The payload is the tensors' bytes in header order. Pieces are slices of the tensors' own
//! buffers (`Bytes::slice`), so chunking copies nothing; a piece never spans two tensors, which
//! keeps it a plain slice. The size arithmetic is exact protobuf encoding arithmetic, so every
//! chunk is within the limit by construction (the tests check it against prost's `encoded_len`).

use bytes::Bytes;
use prost::Message;
use prost::encoding::encoded_len_varint;

use crate::Batch;
use crate::proto::{self, BatchChunk, BatchHeader, TensorMeta};

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
pub fn header(batch: &Batch) -> BatchHeader {
    BatchHeader {
        epoch: batch.epoch,
        split: batch.split,
        sequence: batch.sequence,
        completes: batch.completes.clone(),
        rows: batch.rows.clone(),
        incarnation: batch.incarnation,
        round: batch.round.clone(),
        tensors: batch
            .tensors
            .iter()
            .map(|(name, t)| TensorMeta {
                name: name.clone(),
                dtype: proto::Dtype::from(t.dtype) as i32,
                shape: t.shape.iter().map(|&d| d as u64).collect(),
                byte_length: t.data.len() as u64,
            })
            .collect(),
    }
}

/// The chunks of `batch`, each encoding to at most `max_message_bytes`.
pub fn chunk_batch(batch: &Batch, max_message_bytes: usize) -> Result<Chunks, ChunkError> {
    let header = header(batch);
    let header_len = header.encoded_len();
    let header_field = 1 + encoded_len_varint(header_len as u64) + header_len;
    // The first chunk must hold the header and at least a one-byte piece, or a batch with
    // payload could never make progress.
    let room = max_message_bytes.saturating_sub(SLACK + LAST_FIELD);
    if header_field + MIN_PIECE > room {
        return Err(ChunkError::HeaderTooLarge { header: header_field, limit: max_message_bytes });
    }
    Ok(Chunks {
        header: Some(header),
        header_field,
        room,
        tensors: batch.tensors.values().map(|t| t.data.clone()).filter(|d| !d.is_empty()).collect(),
        next: 0,
        offset: 0,
        done: false,
    })
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
    tensors: Vec<Bytes>,
    /// Tensor the next piece starts in, and where in it.
    next: usize,
    offset: usize,
    done: bool,
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
        while self.next < self.tensors.len() && room >= MIN_PIECE {
            let data = &self.tensors[self.next];
            let left = data.len() - self.offset;
            // A piece of n bytes costs 1 (key) + varint(n) + n; bounding varint(n) by
            // varint(room) keeps the arithmetic simple and never overshoots.
            let n = left.min(room - 1 - encoded_len_varint(room as u64));
            if n == 0 {
                break;
            }
            pieces.push(data.slice(self.offset..self.offset + n));
            room -= 1 + encoded_len_varint(n as u64) + n;
            self.offset += n;
            if self.offset == data.len() {
                self.next += 1;
                self.offset = 0;
            }
        }
        let last = self.next == self.tensors.len();
        self.done = last;
        Some(BatchChunk { header, pieces, last, shared_file: String::new() })
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
