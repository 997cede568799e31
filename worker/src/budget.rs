//! The memory budget: the engine reserves bytes for every transformed element it holds (in
//! the shuffle buffer or the batch being filled) and every batch it has made, until the batch
//! has been handed to the transport, so a slow client stops production instead of growing
//! memory.
//!
//! Two kinds of holders share the budget. *Rows* are elements a producer (one job's epoch on
//! this worker) holds itself: they only become free by becoming a batch. *Batches* are
//! released by whoever drops them: the reservation travels inside the tensors' bytes
//! ([`attach`]), so every queue between the engine and the socket (channels, the stream, the
//! chunker, the batches a stream keeps to send again after a broken connection) is counted.
//!
//! Over the limit, a producer's rows wait only for its own batches that no stream has let go
//! yet ([`Unsent`]): those drain as its own clients read, whatever the rows of this or any
//! other producer. A stream lets a batch go when it takes it, or, resumable, once the batch
//! it keeps from before is released by this one's bytes (`stream::resume`), which needs no
//! more rows. A producer is one job's epoch on this worker, over all its runs, or in a
//! standalone worker every epoch in turn (one stream reads them in order). Waiting on
//! anything else can be circular: on its own rows (they free only by becoming batches); on
//! batches its stream keeps to resume a broken connection beyond that (they go only as the
//! stream sends more, which needs rows: six streams' kept windows held a worker's 64 MiB for
//! good); on another epoch's batches read ahead under the dispatcher (they drain only once
//! the client has read this epoch to its end); on another job's (a sweep trial that stops
//! reading would stop every other). A share group's *kept copies* count with rows and never
//! make a producer wait: they become free when other producers of this worker take them.
//!
//! So the limit is where producers stop running ahead of their clients, not a hard cap:
//! over it, each producer still holds its own rows (its shuffle buffer and the batch being
//! filled, bounded by the spec and `shuffle_share`, and a chunk of at most a sixteenth of
//! the budget in flight), one batch its client has not taken, and each stream the batch it
//! sends and what its connection may have in flight.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;
use stoker_api::{Batch, Stacked};

pub struct MemoryBudget {
    limit: usize,
    used: Mutex<Used>,
    freed: Condvar,
}

#[derive(Default, Clone, Copy)]
struct Used {
    /// Everything reserved: rows and batches.
    total: usize,
    /// What the engines hold themselves (rows, kept copies), part of `total`.
    rows: usize,
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Self {
        MemoryBudget { limit: limit.max(1), used: Mutex::new(Used::default()), freed: Condvar::new() }
    }

    /// Reserves `bytes` of a copy kept for other producers (a share group's, see
    /// `engine::shared`) only if they fit under the limit now, however little else is held:
    /// the engine can do without it. Counted with rows, which never wait for it; released when
    /// the share returned is dropped.
    pub fn try_reserve_kept(self: &Arc<Self>, bytes: usize) -> Option<Rows> {
        let mut used = self.used.lock().unwrap();
        if used.total + bytes > self.limit {
            return None;
        }
        used.total += bytes;
        used.rows += bytes;
        Some(Rows { budget: self.clone(), bytes, output: Arc::default() })
    }

    /// A new producer's reservation, empty: its rows and batches are reserved through it
    /// ([`Rows::reserve_more`], [`Rows::into_batch`]).
    pub fn producer(self: &Arc<Self>) -> Rows {
        Rows { budget: self.clone(), bytes: 0, output: Arc::default() }
    }

    /// Reserves `bytes` of rows for the producer whose untaken batches `output` counts:
    /// blocks while those leave no room under the limit, never for anything else.
    fn reserve_rows(self: &Arc<Self>, bytes: usize, output: &Arc<Output>) -> Rows {
        let mut used = self.used.lock().unwrap();
        let waits = |used: &Used| bytes > 0 && output.unsent() > 0 && used.total + bytes > self.limit;
        if waits(&used) {
            tracing::debug!(
                bytes,
                used = used.total,
                rows = used.rows,
                unsent = output.unsent(),
                limit = self.limit,
                "rows wait for the producer's batches no stream has taken"
            );
        }
        while waits(&used) {
            used = self.freed.wait(used).unwrap();
        }
        used.total += bytes;
        used.rows += bytes;
        Rows { budget: self.clone(), bytes, output: output.clone() }
    }

    pub fn used(&self) -> usize {
        self.used.lock().unwrap().total
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// A producer's batches that no stream has taken yet, in bytes; changed under the budget's
/// lock, so a waiter sees every change.
#[derive(Default)]
struct Output(AtomicUsize);

impl Output {
    fn unsent(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// Rows' share of the budget, released when dropped, and whose producer they are.
pub struct Rows {
    budget: Arc<MemoryBudget>,
    bytes: usize,
    output: Arc<Output>,
}

impl Rows {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Reserves `bytes` more rows for the same producer: waits while its batches that no
    /// stream has taken leave no room.
    pub fn reserve_more(&self, bytes: usize) -> Rows {
        self.budget.reserve_rows(bytes, &self.output)
    }

    /// The whole budget's limit.
    pub fn limit(&self) -> usize {
        self.budget.limit
    }

    /// Bytes of the producer's batches that it waits for over the limit.
    #[cfg(test)]
    pub fn unsent(&self) -> usize {
        self.output.unsent()
    }

    /// Corrects the reservation to `bytes` without waiting (an estimate made before the rows
    /// existed).
    pub fn resize(&mut self, bytes: usize) {
        let mut used = self.budget.used.lock().unwrap();
        used.rows = used.rows - self.bytes + bytes;
        used.total = used.total - self.bytes + bytes;
        if bytes < self.bytes {
            self.budget.freed.notify_all();
        }
        self.bytes = bytes;
    }

    /// Adds another reservation's rows to this one.
    pub fn merge(&mut self, mut other: Rows) {
        self.bytes += std::mem::take(&mut other.bytes);
    }

    /// Turns `rows` bytes of this share into a batch's share of `bytes` (more with padding),
    /// without waiting: the batch replaces the rows it was made of. The batch is the
    /// producer's to wait for until the [`Unsent`] is dropped (a stream took it).
    pub fn into_batch(&mut self, rows: usize, bytes: usize) -> (BatchShare, Unsent) {
        let rows = rows.min(self.bytes);
        self.bytes -= rows;
        let mut used = self.budget.used.lock().unwrap();
        used.rows -= rows;
        used.total = used.total - rows + bytes;
        self.output.0.fetch_add(bytes, Ordering::Relaxed);
        if bytes < rows {
            self.budget.freed.notify_all();
        }
        let unsent = Unsent { budget: self.budget.clone(), output: self.output.clone(), bytes };
        (BatchShare { budget: self.budget.clone(), bytes }, unsent)
    }
}

impl Drop for Rows {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let mut used = self.budget.used.lock().unwrap();
            used.rows = used.rows.saturating_sub(self.bytes);
            used.total = used.total.saturating_sub(self.bytes);
            self.budget.freed.notify_all();
        }
    }
}

/// A batch its producer made and no stream has taken yet: the producer's rows wait for it over
/// the limit. Dropped when a stream takes the batch (or nobody will).
pub struct Unsent {
    budget: Arc<MemoryBudget>,
    output: Arc<Output>,
    bytes: usize,
}

impl std::fmt::Debug for Unsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unsent").field("bytes", &self.bytes).finish()
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        let _used = self.budget.used.lock().unwrap();
        self.output.0.fetch_sub(self.bytes, Ordering::Relaxed);
        self.budget.freed.notify_all();
    }
}

/// A batch's share of the budget, released when the last of its tensors' bytes is dropped.
pub struct BatchShare {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Drop for BatchShare {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap();
        used.total = used.total.saturating_sub(self.bytes);
        self.budget.freed.notify_all();
    }
}

/// Bytes that hold their batch's share alive.
struct Held {
    data: Bytes,
    _share: Arc<BatchShare>,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// Makes `batch`'s tensors carry `share`: it is released once every part of every tensor and
/// every slice of one (the stream's chunks) is gone, wherever that happens.
pub fn attach(mut batch: Batch<Stacked>, share: BatchShare) -> Batch<Stacked> {
    let share = Arc::new(share);
    for part in batch.tensors.values_mut().flat_map(|t| t.parts.iter_mut()) {
        let data = std::mem::take(part);
        *part = Bytes::from_owner(Held { data, _share: share.clone() });
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// Whether `reserve` finishes within a second (it may wait for good).
    fn passes(reserve: impl FnOnce() -> Rows + Send + 'static) -> (bool, std::thread::JoinHandle<Rows>) {
        let waiter = std::thread::spawn(reserve);
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !waiter.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        (waiter.is_finished(), waiter)
    }

    #[test]
    fn rows_wait_only_for_their_producers_batches_no_stream_took() {
        let budget = Arc::new(MemoryBudget::new(100));
        let producer = budget.producer();
        let mut rows = producer.reserve_more(80);
        // Only rows are held: more rows pass even over the limit, or the producer would wait
        // on itself.
        rows.merge(producer.reserve_more(40));
        assert_eq!((budget.used(), rows.bytes()), (120, 120));
        let (share, unsent) = rows.into_batch(120, 120);
        assert_eq!(rows.bytes(), 0);
        // Its batch waits for a stream and the budget is full: its new rows wait for it.
        let (passed, waiter) = passes({
            let producer = producer.reserve_more(0);
            move || producer.reserve_more(10)
        });
        assert!(!passed, "rows went over the limit with their producer's batch untaken");
        // Another producer's rows do not: that batch drains as another client reads.
        let (passed, other) = passes({
            let budget = budget.clone();
            move || budget.producer().reserve_more(30)
        });
        assert!(passed, "rows waited for another producer's batch");
        drop(other.join().unwrap());
        // A stream took the batch: the rows go on, though it is still held (sent, or kept to
        // send again after a broken connection) and the budget still full.
        drop(unsent);
        assert_eq!(waiter.join().unwrap().bytes(), 10);
        assert_eq!(budget.used(), 120, "the taken batch is still counted");
        drop(share);
        assert_eq!(budget.used(), 0, "the waiter's rows were dropped with its thread");
    }

    #[test]
    fn rows_never_wait_for_copies_kept_for_other_producers() {
        let budget = Arc::new(MemoryBudget::new(100));
        let kept = budget.try_reserve_kept(90).expect("it fits");
        assert!(budget.try_reserve_kept(20).is_none(), "a copy is kept only if it fits");
        // The copies' takers are producers of this worker: rows they need to finish their
        // splits (and come to take the copies) must not wait for the copies to go.
        let producer = budget.producer();
        let (passed, rows) = passes({
            let producer = producer.reserve_more(0);
            move || producer.reserve_more(30)
        });
        assert!(passed, "rows waited for a kept copy");
        let mut rows = rows.join().unwrap();
        assert_eq!(budget.used(), 120);
        // The copies still count: a producer whose batch no stream took waits while they fill
        // the budget, and goes on once they are freed.
        let (share, _unsent) = rows.into_batch(30, 30);
        let (passed, waiter) = passes(move || producer.reserve_more(1));
        assert!(!passed, "over the limit with its own batch untaken");
        drop(kept);
        assert_eq!(waiter.join().unwrap().bytes(), 1);
        drop(share);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_batch_share_lives_as_long_as_any_slice_of_its_tensors() {
        use stoker_api::{DType, Tensor};
        let budget = Arc::new(MemoryBudget::new(1000));
        let mut rows = budget.producer().reserve_more(8);
        let mut batch = Batch::default();
        let x = Tensor::new(DType::Uint8, vec![8], Bytes::from(vec![7u8; 8])).unwrap();
        batch.tensors.insert("x".into(), Stacked::from(x));
        let batch = attach(batch, rows.into_batch(8, 8).0);
        drop(rows);
        assert_eq!(budget.used(), 8);
        let slice = batch.tensors["x"].parts[0].slice(2..4);
        drop(batch);
        assert_eq!((budget.used(), &slice[..]), (8, &[7u8, 7][..]));
        drop(slice);
        assert_eq!(budget.used(), 0);
    }
}
