//! Turning a worker's chunk stream back into batches (the inverse of `stoker_api::chunk`).
//!
//! A pure state machine, so every broken sequence is testable without a network. Zero-copy
//! where the wire allows it: a tensor whose bytes arrive as one piece keeps that piece (a slice
//! of the received message); one split across pieces is joined once into a buffer allocated at
//! its final size.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use stoker_api::proto::{self, BatchChunk, BatchHeader, Dtype};
use stoker_api::{Batch, Layout, Tensor};

use crate::error::ProtocolError;

pub struct Reassembler {
    max_batch_bytes: u64,
    /// The shared-memory directory the stream asked for batches through, if it did.
    shared_memory: Option<std::path::PathBuf>,
    partial: Option<Partial>,
}

struct Partial {
    epoch: u64,
    split: u64,
    sequence: u64,
    completes: Vec<u64>,
    rows: Vec<u64>,
    incarnation: u64,
    round: Option<stoker_api::proto::RoundRef>,
    stream_seq: u64,
    echo: bool,
    tensors: Vec<PartialTensor>,
    /// First tensor still missing bytes.
    current: usize,
    declared: u64,
    received: u64,
}

struct PartialTensor {
    name: String,
    dtype: stoker_api::DType,
    layout: Layout,
    shape: Vec<usize>,
    len: usize,
    data: Acc,
}

enum Acc {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Acc {
    fn len(&self) -> usize {
        match self {
            Acc::Empty => 0,
            Acc::One(b) => b.len(),
            Acc::Many(b) => b.len(),
        }
    }

    fn push(&mut self, part: Bytes, total: usize) {
        *self = match std::mem::replace(self, Acc::Empty) {
            Acc::Empty if part.len() == total => Acc::One(part),
            Acc::Empty => {
                let mut buf = BytesMut::with_capacity(total);
                buf.extend_from_slice(&part);
                Acc::Many(buf)
            }
            Acc::Many(mut buf) => {
                buf.extend_from_slice(&part);
                Acc::Many(buf)
            }
            // A full tensor never takes more bytes: the caller moves to the next one.
            Acc::One(_) => unreachable!("push into a complete tensor"),
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Acc::Empty => Bytes::new(),
            Acc::One(b) => b,
            Acc::Many(b) => b.freeze(),
        }
    }
}

impl Reassembler {
    /// `max_batch_bytes` bounds what a header may make the client allocate.
    pub fn new(max_batch_bytes: u64) -> Self {
        Reassembler { max_batch_bytes, shared_memory: None, partial: None }
    }

    /// For a stream that asked for batches through the shared-memory directory `dir`.
    pub fn with_shared_memory(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.shared_memory = dir;
        self
    }

    /// Whether a batch is partly received.
    pub fn in_batch(&self) -> bool {
        self.partial.is_some()
    }

    /// Takes the next chunk; returns the batch it completes, if any. After an error the
    /// reassembler is reset, but the stream that produced the error should be dropped.
    pub fn push(&mut self, chunk: BatchChunk) -> Result<Option<Batch>, ProtocolError> {
        let result = self.push_inner(chunk);
        if result.is_err() {
            self.partial = None;
        }
        result
    }

    /// The stream ended: fine between batches, an error inside one.
    pub fn finish(&self) -> Result<(), ProtocolError> {
        if self.in_batch() { Err(ProtocolError::EndedMidBatch) } else { Ok(()) }
    }

    fn push_inner(&mut self, chunk: BatchChunk) -> Result<Option<Batch>, ProtocolError> {
        if !chunk.shared_file.is_empty() {
            return self.shared(chunk).map(Some);
        }
        let partial = match (self.partial.as_mut(), chunk.header) {
            (None, Some(header)) => self.partial.insert(start(header, self.max_batch_bytes)?),
            (None, None) => return Err(ProtocolError::MissingHeader),
            (Some(_), Some(_)) => return Err(ProtocolError::UnexpectedHeader),
            (Some(p), None) => p,
        };
        for piece in chunk.pieces {
            partial.take(piece)?;
        }
        if !chunk.last {
            return Ok(None);
        }
        let partial = self.partial.take().expect("set above");
        if partial.received != partial.declared {
            return Err(ProtocolError::Truncated { received: partial.received, declared: partial.declared });
        }
        partial.finish().map(Some)
    }
}

impl Reassembler {
    /// A batch whose payload is in a file of the shared-memory directory: tensors over the
    /// file mapped read-only, no copy.
    fn shared(&mut self, chunk: BatchChunk) -> Result<Batch, ProtocolError> {
        let Some(dir) = &self.shared_memory else { return Err(ProtocolError::UnaskedSharedMemory) };
        let header = match (self.partial.is_some(), chunk.header) {
            (false, Some(header)) if chunk.pieces.is_empty() && chunk.last => header,
            (true, _) => return Err(ProtocolError::UnexpectedHeader),
            _ => return Err(ProtocolError::SharedMemoryInPieces),
        };
        let mut partial = start(header, self.max_batch_bytes)?;
        let payload = crate::shared::take(dir, &chunk.shared_file, partial.declared as usize, chunk.reuse_shared_file)?;
        partial.take(payload)?;
        partial.finish()
    }
}

fn start(header: BatchHeader, max_batch_bytes: u64) -> Result<Partial, ProtocolError> {
    let mut tensors = Vec::with_capacity(header.tensors.len());
    let mut declared = 0u64;
    let mut names = std::collections::BTreeSet::new();
    for meta in header.tensors {
        if !names.insert(meta.name.clone()) {
            return Err(ProtocolError::DuplicateTensor { tensor: meta.name });
        }
        let dtype = Dtype::try_from(meta.dtype)
            .ok()
            .and_then(Dtype::to_api)
            .ok_or_else(|| ProtocolError::UnknownDtype { tensor: meta.name.clone(), dtype: meta.dtype })?;
        let layout = proto::Layout::try_from(meta.layout)
            .map(Layout::from)
            .map_err(|_| ProtocolError::UnknownLayout { tensor: meta.name.clone(), layout: meta.layout })?;
        let mismatch = || ProtocolError::ShapeMismatch {
            tensor: meta.name.clone(),
            shape: meta.shape.clone(),
            byte_length: meta.byte_length,
        };
        // Checked arithmetic: a hostile header must not overflow its way past the checks.
        let count = meta.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(mismatch)?;
        if dtype.is_fixed() && layout == Layout::Dense {
            if count.checked_mul(dtype.size() as u64) != Some(meta.byte_length) {
                return Err(mismatch());
            }
        } else if count.checked_add(1).and_then(|n| n.checked_mul(8)).is_none_or(|offsets| offsets > meta.byte_length) {
            // Text and jagged lists: at least their offsets; the whole layout is checked once
            // it has arrived.
            return Err(mismatch());
        }
        declared = declared.saturating_add(meta.byte_length);
        if declared > max_batch_bytes {
            return Err(ProtocolError::BatchTooLarge { declared, limit: max_batch_bytes });
        }
        // Fits in memory (checked above), so every dimension fits in usize.
        let shape = meta.shape.iter().map(|&d| d as usize).collect();
        let len = meta.byte_length as usize;
        tensors.push(PartialTensor { name: meta.name, dtype, layout, shape, len, data: Acc::Empty });
    }
    let mut partial = Partial {
        epoch: header.epoch,
        split: header.split,
        sequence: header.sequence,
        completes: header.completes,
        rows: header.rows,
        incarnation: header.incarnation,
        round: header.round,
        stream_seq: header.stream_seq,
        echo: header.echo,
        tensors,
        current: 0,
        declared,
        received: 0,
    };
    partial.skip_full();
    Ok(partial)
}

impl Partial {
    /// Moves `current` past tensors that need no more bytes (including empty ones).
    fn skip_full(&mut self) {
        while self.current < self.tensors.len()
            && self.tensors[self.current].data.len() == self.tensors[self.current].len
        {
            self.current += 1;
        }
    }

    fn take(&mut self, mut piece: Bytes) -> Result<(), ProtocolError> {
        while !piece.is_empty() {
            let Some(tensor) = self.tensors.get_mut(self.current) else {
                return Err(ProtocolError::ExcessPayload { declared: self.declared });
            };
            let n = piece.len().min(tensor.len - tensor.data.len());
            tensor.data.push(piece.split_to(n), tensor.len);
            self.received += n as u64;
            self.skip_full();
        }
        Ok(())
    }

    fn finish(self) -> Result<Batch, ProtocolError> {
        let mut tensors = BTreeMap::new();
        for t in self.tensors {
            // Dense fixed-width lengths were checked against the header; offsets (text, jagged
            // lists) are checked here.
            let tensor = Tensor::with_layout(t.dtype, t.layout, t.shape, t.data.into_bytes()).map_err(|e| {
                ProtocolError::ShapeMismatch {
                    tensor: t.name.clone(),
                    shape: e.shape.iter().map(|d| *d as u64).collect(),
                    byte_length: e.actual as u64,
                }
            })?;
            tensors.insert(t.name, tensor);
        }
        let (epoch, split, sequence, completes, rows, incarnation) =
            (self.epoch, self.split, self.sequence, self.completes, self.rows, self.incarnation);
        let (round, stream_seq, echo) = (self.round, self.stream_seq, self.echo);
        Ok(Batch { tensors, epoch, split, sequence, completes, rows, incarnation, round, stream_seq, echo })
    }
}
