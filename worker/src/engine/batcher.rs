//! Batching: transformed rows, through the shuffle buffer, into batches of the batch size,
//! each naming the splits it completes and where each of its rows came from. A split completes once it is read and its last row
//! has left the engine (in a batch, or dropped as the remainder), so the dispatcher hears a
//! split is done only once all its data is on its way to a client.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use stoker_api::WorkerPipeline;

use super::stack::{self, BatchError, Row};
use super::{Ready, ShuffleCap, Stats};
use crate::budget::{self, Rows};
use crate::shuffle::ShuffleBuffer;

/// Makes one epoch's batches and hands each to `send`, which says whether anyone still
/// listens.
///
/// The engine queues each transformed chunk and batches it while the next one is transformed
/// (`batch_queued`), so when a split has been read its last chunk may still be queued.
pub(super) struct Batcher<S> {
    size: usize,
    shaping: stack::Shaping,
    drop_remainder: bool,
    /// The pipeline echoes: its batches say so (`Batch::echo`).
    echo: bool,
    epoch: u64,
    /// Rows with their provenance (`stoker_api::row`).
    shuffle: Option<ShuffleBuffer<(u64, Row)>>,
    /// What the rows in the shuffle buffer cost (`row_cost`), and the most they may cost
    /// before the buffer stops growing.
    shuffle_bytes: usize,
    shuffle_share: usize,
    /// The tables whose rows are in the shuffle buffer.
    tables: TablesHeld,
    /// `shuffle.bufferSize`.
    requested: usize,
    stats: Arc<Stats>,
    queued: Option<Chunk>,
    /// The rows of the batch being filled, and the provenance of each.
    rows: Vec<Row>,
    origins: Vec<u64>,
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
    /// Each row with its position in the split.
    rows: Vec<(u64, Row)>,
    /// The last chunk of its split: the split is read once these rows are in.
    completes_split: bool,
}

/// The share of the memory budget the shuffle buffer may fill before it stops growing. The
/// other half is for the rest the engine holds at once: the chunk being transformed, the
/// chunk queued, the batch being filled and the batches in flight to the client.
pub(super) fn shuffle_share(budget_limit: usize) -> usize {
    budget_limit / 2
}

impl<S: FnMut(Ready) -> bool> Batcher<S> {
    /// The shuffle buffer's capacity is `shuffle.bufferSize`, or the cap an earlier epoch of
    /// the engine hit (in `stats`) when smaller.
    pub(super) fn new(pipeline: &WorkerPipeline, epoch: u64, held: Rows, stats: Arc<Stats>, send: S) -> Self {
        let seed = pipeline.data_plane.seed.unwrap_or(0);
        let size = pipeline.data_plane.batch_size as usize;
        let capped = stats.shuffle_cap.lock().unwrap().map(|c| c.elements);
        let row_estimate = stats.row_bytes.load(Ordering::Relaxed) as usize;
        Batcher {
            size,
            shaping: stack::Shaping::of(&pipeline.data_plane),
            drop_remainder: pipeline.data_plane.drop_remainder,
            echo: pipeline.data_plane.echo().is_some(),
            epoch,
            shuffle: pipeline.data_plane.shuffle.as_ref().map(|s| {
                let capacity = capped.map_or(s.buffer_size as usize, |c| c.min(s.buffer_size as usize));
                ShuffleBuffer::new(capacity, s.seed.unwrap_or(seed), epoch)
            }),
            shuffle_bytes: 0,
            tables: TablesHeld::default(),
            shuffle_share: shuffle_share(held.limit()),
            requested: pipeline.data_plane.shuffle.as_ref().map_or(0, |s| s.buffer_size as usize),
            stats,
            queued: None,
            rows: Vec::with_capacity(size),
            origins: Vec::with_capacity(size),
            track: SplitTracker::default(),
            held,
            row_estimate,
            sequence: 0,
            last_split: 0,
            send,
        }
    }

    /// What a row weighed in the last chunk that had any, in this run or (for its first
    /// chunk) the engine's last: what to reserve for the next chunk's rows before they exist.
    pub(super) fn row_estimate(&self) -> usize {
        self.row_estimate
    }

    /// How many elements of `most` the next chunk takes, making `factor` rows each: fewer when
    /// their rows would weigh more than a sixteenth of the budget. A chunk's rows are reserved
    /// while the chunk before lands, before the batch that one completes is queued, so over
    /// the limit a producer still holds a chunk beyond its batches: with 128 rows of 602 KB
    /// (224-px float32 images) that was 77 MB a chunk, and a worker with a 256 MiB budget held
    /// two 154 MB batches and half a third. Only the worker's first chunk, before anything
    /// told a row's weight (a run's first takes the engine's last, `Stats::row_bytes`), is
    /// reserved at nothing: nothing else is held then.
    pub(super) fn chunk_len(&self, most: usize, factor: usize) -> usize {
        match self.row_estimate * factor {
            0 => most,
            row => most.min(self.held.limit() / 16 / row).max(1),
        }
    }

    /// Reserves `bytes` for rows about to be made: waits, over the budget, while a batch this
    /// batcher made waits for a stream to take it.
    pub(super) fn reserve(&self, bytes: usize) -> Rows {
        self.held.reserve_more(bytes)
    }

    /// Queues a split's transformed chunk with its budget reservation, corrected to what its
    /// rows weigh. The chunk queued before must have been batched.
    pub(super) fn queue(&mut self, split: u64, rows: Vec<(u64, Row)>, mut reserved: Rows) {
        debug_assert!(self.queued.is_none(), "the queued chunk is batched before the next is queued");
        let bytes: usize = rows.iter().map(|(_, row)| row.bytes()).sum();
        if !rows.is_empty() {
            self.row_estimate = bytes / rows.len();
            self.stats.row_bytes.store(self.row_estimate as u64, Ordering::Relaxed);
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
        // The chunk's rows enter their split at once, not a row at a time (a DLRM epoch's
        // CPU fell 3%): the split is read to its end before its last row can fill a batch,
        // so that batch carries the split's completion, and the client reports the split
        // only once it has the batch.
        self.track.entered(chunk.split, chunk.rows.len() as u64);
        if chunk.completes_split {
            self.track.parsed(chunk.split);
        }
        for (position, row) in chunk.rows {
            let origin = stoker_api::row(chunk.split, position);
            let row = if self.shuffle.is_some() { self.shuffle_push((origin, row)) } else { Some((origin, row)) };
            if let Some(row) = row {
                self.push(row);
                if self.rows.len() == self.size && !self.emit(chunk.split)? {
                    return Ok(false);
                }
            }
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
                self.shuffle_bytes -= self.tables.left(&row.1);
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

    /// Puts a row into the shuffle buffer, counting what it holds; once that reaches the
    /// buffer's share of the memory budget the buffer stops growing (ever after, for this
    /// engine), so a huge bufferSize costs a bounded amount of memory instead of an OOM kill.
    fn shuffle_push(&mut self, row: (u64, Row)) -> Option<(u64, Row)> {
        let buffer = self.shuffle.as_mut().expect("called with a shuffle buffer");
        self.shuffle_bytes += self.tables.entered(&row.1);
        let out = buffer.push(row);
        if let Some((_, r)) = &out {
            self.shuffle_bytes -= self.tables.left(r);
        }
        self.stats.shuffle_peak_bytes.fetch_max(self.shuffle_bytes as u64, Ordering::Relaxed);
        if buffer.is_growing() && self.shuffle_bytes >= self.shuffle_share {
            buffer.stop_growing();
            let cap = ShuffleCap { elements: buffer.len(), bytes: self.shuffle_bytes, requested: self.requested };
            let mut known = self.stats.shuffle_cap.lock().unwrap();
            if known.is_none_or(|k| k.elements > cap.elements) {
                tracing::warn!(
                    elements = cap.elements,
                    bytes = cap.bytes,
                    budget = self.held.limit(),
                    "{cap}: raise the worker's memory budget (--memory-budget) for a larger buffer"
                );
                *known = Some(cap);
            }
        }
        out
    }

    fn push(&mut self, (origin, row): (u64, Row)) {
        self.origins.push(origin);
        self.rows.push(row);
    }

    /// Makes a batch of the pending rows and sends it; false when nobody listens.
    fn emit(&mut self, split: u64) -> Result<bool, BatchError> {
        let rows_bytes = self.rows.iter().map(Row::bytes).sum();
        let mut batch = stack::make_batch(&mut self.rows, &self.shaping, self.epoch, split, self.sequence)?;
        batch.rows = self.origins.clone();
        batch.echo = self.echo;
        self.drop_rows();
        let completes = std::mem::take(&mut self.track.completed);
        self.sequence += 1;
        let bytes = batch.payload_bytes();
        // The rows' reservation passes to the batch, and leaves with it.
        let (share, unsent) = self.held.into_batch(rows_bytes, bytes);
        let batch = budget::attach(batch, share);
        Ok((self.send)(Ready { batch, completes, unsent }))
    }

    /// The pending rows are gone (batched or dropped): their splits may be complete now.
    fn drop_rows(&mut self) {
        self.rows.clear();
        // A batch's rows come in runs of one split: counted out a run at a time.
        let mut splits = self.origins.drain(..).map(|origin| stoker_api::row_origin(origin).0).peekable();
        while let Some(split) = splits.next() {
            let mut rows = 1;
            while splits.next_if_eq(&split).is_some() {
                rows += 1;
            }
            self.track.left(split, rows);
        }
    }
}

/// The tables rows in the shuffle buffer keep alive. One row of a table keeps all of it: a
/// shuffle buffer that takes a row or two of many tables holds them all, so it counts each
/// table whole while any of its rows is in (a row of fields counts its own cost).
#[derive(Default)]
struct TablesHeld {
    /// By the table's address: its rows in the buffer.
    rows: std::collections::HashMap<usize, usize>,
}

impl TablesHeld {
    /// What `row` entering adds to the buffer's cost.
    fn entered(&mut self, row: &Row) -> usize {
        match row {
            Row::Fields(_) => row.cost(),
            Row::Table(t) => {
                let rows = self.rows.entry(Arc::as_ptr(&t.table) as usize).or_default();
                *rows += 1;
                if *rows == 1 { 32 + t.share * t.table.len() } else { 32 }
            }
        }
    }

    /// What `row` leaving takes from the buffer's cost.
    fn left(&mut self, row: &Row) -> usize {
        match row {
            Row::Fields(_) => row.cost(),
            Row::Table(t) => {
                let key = Arc::as_ptr(&t.table) as usize;
                let rows = self.rows.get_mut(&key).expect("a row that entered");
                *rows -= 1;
                if *rows == 0 {
                    self.rows.remove(&key);
                    32 + t.share * t.table.len()
                } else {
                    32
                }
            }
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
    fn entered(&mut self, split: u64, rows: u64) {
        self.reading.insert(split);
        if rows > 0 {
            *self.inside.entry(split).or_default() += rows;
        }
    }

    fn left(&mut self, split: u64, rows: u64) {
        let n = self.inside.get_mut(&split).expect("rows that entered");
        *n -= rows;
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

#[cfg(test)]
mod tests {
    //! The batcher driven as the engine drives it: for each chunk, `batch_queued` (batching
    //! the chunk before it) then `queue`; `split_read` once a split's chunks are all queued;
    //! `finish` at the end.

    use std::sync::Arc;
    use std::sync::mpsc::{Receiver, channel};

    use bytes::Bytes;
    use stoker_api::{DType, Tensor};

    use super::*;
    use crate::budget::MemoryBudget;

    fn pipeline(yaml_tail: &str) -> WorkerPipeline {
        let spec =
            stoker_api::from_yaml(&format!("source: {{uri: 'file:///d/', format: jsonl}}\n{yaml_tail}")).unwrap();
        WorkerPipeline::new("ns", "batcher", &spec)
    }

    type TestBatcher = Batcher<Box<dyn FnMut(Ready) -> bool>>;

    /// A batcher sending to a channel the test reads, and the budget its rows are held in.
    fn batcher(pipeline: &WorkerPipeline) -> (TestBatcher, Receiver<Ready>, Arc<MemoryBudget>) {
        let budget = Arc::new(MemoryBudget::new(1 << 30));
        let (tx, rx) = channel();
        let send: Box<dyn FnMut(Ready) -> bool> = Box::new(move |ready| tx.send(ready).is_ok());
        (Batcher::new(pipeline, 3, budget.producer(), Arc::default(), send), rx, budget)
    }

    /// A chunk's rows, reserved before they exist, are at most a sixteenth of the budget; a new
    /// run's first chunk weighs its rows as the engine's last run did.
    #[test]
    fn a_chunk_holds_at_most_a_sixteenth_of_the_budget() {
        let p = pipeline("batchSize: 4\n");
        let budget = Arc::new(MemoryBudget::new(1 << 20));
        let (tx, _rx) = channel();
        let send: Box<dyn FnMut(Ready) -> bool> = Box::new(move |ready| tx.send(ready).is_ok());
        let mut b = Batcher::new(&p, 0, budget.producer(), Arc::default(), send);
        assert_eq!(b.chunk_len(128, 1), 128, "nothing weighed yet: the worker's first chunk");
        // 4 KiB rows: 16 make a sixteenth of 1 MiB; with an echo factor of 2, 8 elements.
        b.queue(0, vec![(0, row(&[0; 1024]))], budget.producer());
        assert_eq!((b.chunk_len(128, 1), b.chunk_len(128, 2), b.chunk_len(8, 1)), (16, 8, 8));
        let (tx, _rx) = channel();
        let send: Box<dyn FnMut(Ready) -> bool> = Box::new(move |ready| tx.send(ready).is_ok());
        let next_run = Batcher::new(&p, 1, budget.producer(), b.stats.clone(), send);
        assert_eq!(next_run.chunk_len(128, 1), 16, "the next run starts from the last weight");
    }

    /// A row with one int32 field `x` of `values` (shape `[values.len()]`).
    fn row(values: &[i32]) -> Row {
        let data = Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
        Row::Fields([("x".to_string(), Tensor::new(DType::Int32, vec![values.len()], data).unwrap())].into())
    }

    /// Element `i` of split `split`, recognisable in a batch as the value `100 * split + i`.
    fn element(split: u64, i: usize) -> Row {
        row(&[100 * split as i32 + i as i32])
    }

    /// Feeds a split as the engine does: its chunks of the given sizes, then `split_read`.
    fn read_split(batcher: &mut TestBatcher, budget: &Arc<MemoryBudget>, split: u64, chunks: &[usize]) -> bool {
        let mut next = 0;
        for &n in chunks {
            if !batcher.batch_queued().unwrap() {
                return false;
            }
            let rows = (next..next + n).map(|i| (i as u64, element(split, i))).collect();
            batcher.queue(split, rows, budget.producer());
            next += n;
        }
        batcher.split_read(split);
        true
    }

    fn values(ready: &Ready) -> Vec<i32> {
        ready.batch.tensors["x"].join().data.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn splits_in(ready: &Ready) -> BTreeSet<u64> {
        values(ready).iter().map(|v| *v as u64 / 100).collect()
    }

    #[test]
    fn rows_fill_batches_of_the_batch_size_in_order_then_the_remainder() {
        let p = pipeline("batchSize: 3\n");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[2, 2]);
        read_split(&mut b, &budget, 1, &[3]);
        let leftover = b.finish().unwrap();
        let ready: Vec<Ready> = rx.try_iter().collect();
        assert_eq!(ready.iter().map(values).collect::<Vec<_>>(), [vec![0, 1, 2], vec![3, 100, 101], vec![102]]);
        let headers: Vec<_> = ready.iter().map(|r| (r.batch.epoch, r.batch.split, r.batch.sequence)).collect();
        assert_eq!(headers, [(3, 0, 0), (3, 1, 1), (3, 1, 2)], "a batch says the split that filled it");
        assert_eq!(ready[1].batch.tensors["x"].shape, [3, 1]);
        let completes: Vec<_> = ready.iter().map(|r| r.completes.clone()).collect();
        assert_eq!(completes, [vec![], vec![0], vec![1]]);
        assert!(leftover.is_empty());
        let rows: Vec<Vec<(u64, u32)>> =
            ready.iter().map(|r| r.batch.rows.iter().map(|&o| stoker_api::row_origin(o)).collect()).collect();
        assert_eq!(
            rows,
            [vec![(0, 0), (0, 1), (0, 2)], vec![(0, 3), (1, 0), (1, 1)], vec![(1, 2)]],
            "each row's origin"
        );
    }

    #[test]
    fn a_chunk_is_batched_only_once_the_next_is_transformed_or_the_input_ends() {
        let p = pipeline("batchSize: 2\n");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[2]);
        assert_eq!(rx.try_iter().count(), 0, "the split's only chunk is still queued");
        read_split(&mut b, &budget, 1, &[2]);
        assert_eq!(rx.try_iter().map(|r| (values(&r), r.completes)).collect::<Vec<_>>(), [(vec![0, 1], vec![0])]);
        b.finish().unwrap();
        assert_eq!(rx.try_iter().map(|r| (values(&r), r.completes)).collect::<Vec<_>>(), [(vec![100, 101], vec![1])]);
    }

    #[test]
    fn a_split_ending_on_a_batch_boundary_completes_with_that_batch() {
        let p = pipeline("batchSize: 3\n");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[1, 2]);
        read_split(&mut b, &budget, 1, &[1]);
        let leftover = b.finish().unwrap();
        let ready: Vec<Ready> = rx.try_iter().collect();
        assert_eq!((values(&ready[0]), ready[0].completes.clone()), (vec![0, 1, 2], vec![0]));
        assert_eq!((values(&ready[1]), ready[1].completes.clone()), (vec![100], vec![1]));
        assert!(leftover.is_empty());
    }

    #[test]
    fn a_dropped_remainder_completes_its_splits_as_leftovers_and_releases_its_budget() {
        let p = pipeline("batchSize: 3\ndropRemainder: true\n");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[2]);
        read_split(&mut b, &budget, 1, &[3]);
        assert_eq!(budget.used(), 5 * 4, "five queued int32 rows");
        let leftover = b.finish().unwrap();
        let ready: Vec<Ready> = rx.try_iter().collect();
        assert_eq!(ready.iter().map(values).collect::<Vec<_>>(), [vec![0, 1, 100]]);
        assert_eq!(ready[0].completes, [0], "split 1's last elements were dropped, so no batch carries it");
        assert_eq!(leftover, [1]);
        assert_eq!(budget.used(), 3 * 4, "only the batch in flight is held");
        drop(ready);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_split_without_elements_completes_with_the_next_batch_made_or_as_a_leftover() {
        let p = pipeline("batchSize: 2\n");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[2]);
        // Split 1 had no records; split 2's were all filtered out.
        read_split(&mut b, &budget, 1, &[]);
        read_split(&mut b, &budget, 2, &[0]);
        let leftover = b.finish().unwrap();
        let ready: Vec<Ready> = rx.try_iter().collect();
        assert_eq!(
            ready.iter().map(|r| (values(r), r.completes.clone())).collect::<Vec<_>>(),
            [(vec![0, 1], vec![1, 0])]
        );
        assert_eq!(leftover, [2], "read after the last batch: nothing carries it");
    }

    #[test]
    fn rows_of_different_shapes_pad_with_the_pipelines_pad_value_or_fail() {
        let p = pipeline("batchSize: 2\npadValue: -1\n");
        let (mut b, rx, budget) = batcher(&p);
        b.queue(0, vec![(0, row(&[1])), (1, row(&[2, 3]))], budget.producer());
        b.split_read(0);
        b.finish().unwrap();
        let ready = rx.try_recv().unwrap();
        assert_eq!(ready.batch.tensors["x"].shape, [2, 2]);
        assert_eq!(values(&ready), [1, -1, 2, 3]);

        let p = pipeline("batchSize: 2\n");
        let (mut b, _rx, budget) = batcher(&p);
        b.queue(0, vec![(0, row(&[1])), (1, row(&[2, 3]))], budget.producer());
        b.split_read(0);
        assert!(matches!(b.finish(), Err(BatchError::ShapeMismatch { .. })));
    }

    #[test]
    fn nobody_listening_stops_batching_and_reports_no_completions() {
        let p = pipeline("batchSize: 1\n");
        let (mut b, rx, budget) = batcher(&p);
        drop(rx);
        read_split(&mut b, &budget, 0, &[1]);
        assert!(!read_split(&mut b, &budget, 1, &[1]), "sending split 0's batch found nobody");
        let (mut b, rx, budget) = batcher(&p);
        read_split(&mut b, &budget, 0, &[1]);
        drop(rx);
        assert_eq!(b.finish().unwrap(), Vec::<u64>::new());
    }

    /// A bufferSize far beyond the budget: the buffer stops growing at half the budget, says
    /// so in the stats, shuffles exactly as a buffer of the capped size would, and keeps the
    /// cap in the next epoch.
    #[test]
    fn a_huge_shuffle_buffer_stops_growing_at_its_share_of_the_budget() {
        let p = pipeline("batchSize: 7\nshuffle: {bufferSize: 4000000000, seed: 9}\n");
        // Each one-int32 row costs 1024 + 4 + 128 bytes: 28 rows stay under the 32 KiB share,
        // the 29th reaches it.
        let budget = Arc::new(MemoryBudget::new(64 << 10));
        let stats = Arc::new(Stats::default());
        let run = |epoch: u64| {
            let (tx, rx) = channel();
            let send: Box<dyn FnMut(Ready) -> bool> = Box::new(move |ready| tx.send(ready).is_ok());
            let mut b = Batcher::new(&p, epoch, budget.producer(), stats.clone(), send);
            for split in 0..10 {
                read_split(&mut b, &budget, split, &[50]);
            }
            b.finish().unwrap();
            rx.try_iter().flat_map(|r| values(&r)).collect::<Vec<i32>>()
        };
        let out = run(3);
        let cap = stats.shuffle_cap.lock().unwrap().expect("capped");
        assert_eq!(cap, ShuffleCap { elements: 29, bytes: 29 * 1156, requested: 4_000_000_000 });
        assert_eq!(
            cap.to_string(),
            "shuffle buffer capped at 29 elements (33524 bytes) by the memory budget; shuffle.bufferSize asks for 4000000000"
        );
        assert!(stats.shuffle_peak_bytes.load(Ordering::Relaxed) <= 29 * 1156);

        let mut sorted = out.clone();
        sorted.sort();
        let all: Vec<i32> = (0..10).flat_map(|s| (0..50).map(move |i| 100 * s + i)).collect();
        assert_eq!(sorted, all, "every row exactly once");
        let mut reference = ShuffleBuffer::new(29, 9, 3);
        let mut expected: Vec<i32> = all.iter().filter_map(|v| reference.push(*v)).collect();
        expected.extend(reference.drain());
        assert_eq!(out, expected, "the same shuffle as a buffer made with the cap");

        // The next epoch starts at the cap: the same shuffle as a buffer of 29 for epoch 4.
        let next = run(4);
        let mut reference = ShuffleBuffer::new(29, 9, 4);
        let mut expected: Vec<i32> = all.iter().filter_map(|v| reference.push(*v)).collect();
        expected.extend(reference.drain());
        assert_eq!(next, expected);
        assert_eq!(budget.used(), 0, "every row's reservation released");
    }

    /// Through a shuffle buffer rows leave in random order, yet every split completes exactly
    /// once: with the batch holding its last row, or (no rows, or the last dropped) after.
    #[test]
    fn shuffled_splits_complete_with_the_batch_holding_their_last_row() {
        let splits: [&[usize]; 6] = [&[3], &[1, 2], &[0], &[4], &[], &[2, 5]];
        for (buffer, drop_remainder, seed) in [(5, false, 1), (5, true, 2), (1, false, 3), (64, true, 4), (3, true, 5)]
        {
            let p = pipeline(&format!(
                "batchSize: 4\ndropRemainder: {drop_remainder}\nshuffle: {{bufferSize: {buffer}, seed: {seed}}}\n"
            ));
            let (mut b, rx, budget) = batcher(&p);
            for (split, chunks) in splits.iter().enumerate() {
                read_split(&mut b, &budget, split as u64, chunks);
            }
            let leftover = b.finish().unwrap();
            let ready: Vec<Ready> = rx.try_iter().collect();
            let case = format!("buffer {buffer}, dropRemainder {drop_remainder}");

            let mut delivered: Vec<i32> = ready.iter().flat_map(values).collect();
            let in_order: Vec<i32> = delivered.clone();
            delivered.sort();
            let mut all: Vec<i32> = (0..splits.len())
                .flat_map(|s| (0..splits[s].iter().sum::<usize>()).map(move |i| 100 * s as i32 + i as i32))
                .collect();
            if buffer > 1 {
                assert_ne!(in_order, all[..in_order.len()], "{case}: shuffled");
            }
            assert_eq!(delivered.len(), if drop_remainder { 16 } else { 17 }, "{case}");
            all.retain(|v| delivered.contains(v));
            assert_eq!(delivered, all, "{case}: each row at most once");
            // Provenance follows each row through the shuffle: value 100 * split + position.
            for r in &ready {
                let origins: Vec<i32> = r
                    .batch
                    .rows
                    .iter()
                    .map(|&o| stoker_api::row_origin(o))
                    .map(|(s, p)| 100 * s as i32 + p as i32)
                    .collect();
                assert_eq!(origins, values(r), "{case}: provenance");
            }

            let mut reported: Vec<u64> =
                ready.iter().flat_map(|r| r.completes.clone()).chain(leftover.clone()).collect();
            reported.sort();
            assert_eq!(reported, [0, 1, 2, 3, 4, 5], "{case}: each split exactly once");
            for split in 0..splits.len() as u64 {
                let last_batch = ready.iter().rposition(|r| splits_in(r).contains(&split));
                let carrier = ready.iter().position(|r| r.completes.contains(&split));
                let rows = splits[split as usize].iter().sum::<usize>();
                let all_delivered = delivered.iter().filter(|v| **v as u64 / 100 == split).count() == rows;
                match (rows, all_delivered) {
                    (0, _) => assert!(carrier.is_some() || leftover.contains(&split), "{case}: split {split}"),
                    (_, true) => assert_eq!(carrier, last_batch, "{case}: split {split}"),
                    (_, false) => {
                        assert_eq!(carrier, None, "{case}: split {split} lost rows, so no batch carries it");
                        assert!(leftover.contains(&split), "{case}: split {split}");
                    }
                }
            }
        }
    }
}
