//! Batching: transformed rows, through the shuffle buffer, into batches of the batch size,
//! each naming the splits it completes. A split completes once it is read and its last row
//! has left the engine (in a batch, or dropped as the remainder), so the dispatcher hears a
//! split is done only once all its data is on its way to a client.

use std::collections::{BTreeMap, BTreeSet};

use stoker_api::WorkerPipeline;

use super::Ready;
use super::stack::{self, BatchError, Row};
use crate::budget::{self, Rows};
use crate::shuffle::ShuffleBuffer;

/// Makes one epoch's batches and hands each to `send`, which says whether anyone still
/// listens.
///
/// The engine queues each transformed chunk and batches it while the next one is transformed
/// (`batch_queued`), so when a split has been read its last chunk may still be queued.
pub(super) struct Batcher<S> {
    size: usize,
    pad: Option<f64>,
    drop_remainder: bool,
    epoch: u64,
    shuffle: Option<ShuffleBuffer<(u64, Row)>>,
    queued: Option<Chunk>,
    /// The rows of the batch being filled, and the split each came from.
    rows: Vec<Row>,
    splits: Vec<u64>,
    track: SplitTracker,
    /// The budget share of every transformed row the batcher holds: queued, in the shuffle
    /// buffer and pending. Dropped rows (a remainder, an early return) release it with the
    /// batcher.
    held: Rows,
    /// Bytes per row of the last chunk that had rows.
    row_estimate: usize,
    sequence: u64,
    /// The split read last: the one the batches made at the end say they come from.
    last_split: u64,
    send: S,
}

/// A transformed chunk waiting to be batched.
struct Chunk {
    split: u64,
    rows: Vec<Row>,
    /// The last chunk of its split: the split is read once these rows are in.
    completes_split: bool,
}

fn row_bytes(row: &Row) -> usize {
    row.values().map(|t| t.data.len()).sum()
}

impl<S: FnMut(Ready) -> bool> Batcher<S> {
    pub(super) fn new(pipeline: &WorkerPipeline, epoch: u64, held: Rows, send: S) -> Self {
        let seed = pipeline.seed.unwrap_or(0);
        let size = pipeline.batch_size as usize;
        Batcher {
            size,
            pad: pipeline.pad_value,
            drop_remainder: pipeline.drop_remainder,
            epoch,
            shuffle: pipeline
                .shuffle
                .as_ref()
                .map(|s| ShuffleBuffer::new(s.buffer_size as usize, s.seed.unwrap_or(seed), epoch)),
            queued: None,
            rows: Vec::with_capacity(size),
            splits: Vec::with_capacity(size),
            track: SplitTracker::default(),
            held,
            row_estimate: 0,
            sequence: 0,
            last_split: 0,
            send,
        }
    }

    /// What a row weighed in the last chunk that had any: what to reserve for the next
    /// chunk's rows before they exist.
    pub(super) fn row_estimate(&self) -> usize {
        self.row_estimate
    }

    /// Queues a split's transformed chunk with its budget reservation, corrected to what its
    /// rows weigh. The chunk queued before must have been batched.
    pub(super) fn queue(&mut self, split: u64, rows: Vec<Row>, mut reserved: Rows) {
        debug_assert!(self.queued.is_none(), "the queued chunk is batched before the next is queued");
        let bytes: usize = rows.iter().map(row_bytes).sum();
        if !rows.is_empty() {
            self.row_estimate = bytes / rows.len();
        }
        reserved.resize(bytes);
        self.held.merge(reserved);
        self.queued = Some(Chunk { split, rows, completes_split: false });
    }

    /// The split is read: it completes once its last chunk is batched, or now when that chunk
    /// has been batched already (or it had none).
    pub(super) fn split_read(&mut self, split: u64) {
        self.last_split = split;
        match self.queued.as_mut() {
            Some(chunk) if chunk.split == split => chunk.completes_split = true,
            _ => self.track.parsed(split),
        }
    }

    /// Moves the queued chunk's rows through the shuffle buffer into batches, sending each
    /// full one; false when nobody listens.
    pub(super) fn batch_queued(&mut self) -> Result<bool, BatchError> {
        let Some(chunk) = self.queued.take() else { return Ok(true) };
        let last = chunk.rows.len();
        for (i, row) in chunk.rows.into_iter().enumerate() {
            self.track.entered(chunk.split);
            // Read to the end before its last row can fill a batch, so that batch carries the
            // split's completion: the client reports the split only once it has the batch.
            if chunk.completes_split && i + 1 == last {
                self.track.parsed(chunk.split);
            }
            let row = match self.shuffle.as_mut() {
                Some(buffer) => buffer.push((chunk.split, row)),
                None => Some((chunk.split, row)),
            };
            if let Some(row) = row {
                self.push(row);
                if self.rows.len() == self.size && !self.emit(chunk.split)? {
                    return Ok(false);
                }
            }
        }
        if chunk.completes_split && last == 0 {
            self.track.parsed(chunk.split);
        }
        Ok(true)
    }

    /// Every split is read: batches the rest (the remainder unless it is dropped) and returns
    /// the splits that completed with no batch left to carry them; none when nobody listens.
    pub(super) fn finish(mut self) -> Result<Vec<u64>, BatchError> {
        if !self.batch_queued()? {
            return Ok(Vec::new());
        }
        if let Some(mut buffer) = self.shuffle.take() {
            for row in buffer.drain() {
                self.push(row);
                if self.rows.len() == self.size && !self.emit(self.last_split)? {
                    return Ok(Vec::new());
                }
            }
        }
        if !self.rows.is_empty() && !self.drop_remainder {
            self.emit(self.last_split)?;
        }
        // Rows dropped as the remainder leave their splits complete too.
        self.drop_rows();
        Ok(std::mem::take(&mut self.track.completed))
    }

    fn push(&mut self, (split, row): (u64, Row)) {
        self.splits.push(split);
        self.rows.push(row);
    }

    /// Makes a batch of the pending rows and sends it; false when nobody listens.
    fn emit(&mut self, split: u64) -> Result<bool, BatchError> {
        let rows_bytes = self.rows.iter().map(row_bytes).sum();
        let batch = stack::make_batch(&mut self.rows, self.pad, self.epoch, split, self.sequence)?;
        self.drop_rows();
        let completes = std::mem::take(&mut self.track.completed);
        self.sequence += 1;
        let bytes = batch.payload_bytes();
        // The rows' reservation passes to the batch, and leaves with it.
        let batch = budget::attach(batch, self.held.into_batch(rows_bytes, bytes));
        Ok((self.send)(Ready { batch, completes }))
    }

    /// The pending rows are gone (batched or dropped): their splits may be complete now.
    fn drop_rows(&mut self) {
        self.rows.clear();
        for split in self.splits.drain(..) {
            self.track.left(split);
        }
    }
}

/// Knows when a split's last row has left the engine.
#[derive(Default)]
struct SplitTracker {
    /// Rows of each split still in the shuffle buffer or the batch being filled.
    inside: BTreeMap<u64, u64>,
    /// Splits still being parsed and transformed.
    reading: BTreeSet<u64>,
    completed: Vec<u64>,
}

impl SplitTracker {
    fn entered(&mut self, split: u64) {
        self.reading.insert(split);
        *self.inside.entry(split).or_default() += 1;
    }

    fn left(&mut self, split: u64) {
        let n = self.inside.get_mut(&split).expect("a row that entered");
        *n -= 1;
        if *n == 0 {
            self.inside.remove(&split);
            if !self.reading.contains(&split) {
                self.completed.push(split);
            }
        }
    }

    fn parsed(&mut self, split: u64) {
        self.reading.remove(&split);
        if !self.inside.contains_key(&split) {
            self.completed.push(split);
        }
    }
}
