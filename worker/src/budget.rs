//! The memory budget: the engine reserves bytes for every transformed element it holds (in
//! the shuffle buffer or the batch being filled) and every batch it has made, until the batch
//! has been handed to the transport, so a slow client stops production instead of growing
//! memory.
//!
//! Two kinds of holders share the budget. *Rows* are elements the engine itself holds: they
//! only become free by becoming a batch, so the engine waits for room only while batches are
//! in flight (waiting on its own rows would deadlock). A share group's *kept copies* count
//! with rows: they become free when other producers of this worker take them, and a taker
//! waiting for room its own take would free never takes. *Batches* are released by whoever
//! drops them: the reservation travels inside the tensors' bytes ([`attach`]), so every queue
//! between the engine and the socket (channels, the stream, the chunker) is counted.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

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

    /// Blocks until `bytes` fit under the limit. A single reservation larger than the whole
    /// budget is let through when nothing else is held, so one huge batch cannot deadlock.
    pub fn reserve(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        while used.total > 0 && used.total + bytes > self.limit {
            used = self.freed.wait(used).unwrap();
        }
        used.total += bytes;
    }

    /// Reserves `bytes` of a copy kept for other producers (a share group's, see
    /// `engine::shared`) only if they fit under the limit now, however little else is held:
    /// the engine can do without it. Counted with rows, which never wait for it.
    pub fn try_reserve_kept(&self, bytes: usize) -> bool {
        let mut used = self.used.lock().unwrap();
        if used.total + bytes > self.limit {
            return false;
        }
        used.total += bytes;
        used.rows += bytes;
        true
    }

    /// Releases what `try_reserve_kept` reserved.
    pub fn release_kept(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        used.rows = used.rows.saturating_sub(bytes);
        used.total = used.total.saturating_sub(bytes);
        self.freed.notify_all();
    }

    /// Like `reserve`, giving up after `timeout`; returns whether it reserved.
    pub fn reserve_timeout(&self, bytes: usize, timeout: Duration) -> bool {
        let used = self.used.lock().unwrap();
        let (mut used, result) = self
            .freed
            .wait_timeout_while(used, timeout, |used| used.total > 0 && used.total + bytes > self.limit)
            .unwrap();
        if result.timed_out() {
            return false;
        }
        used.total += bytes;
        true
    }

    pub fn release(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        used.total = used.total.saturating_sub(bytes);
        self.freed.notify_all();
    }

    /// Reserves `bytes` of rows the engine has just transformed: blocks while batches in
    /// flight leave no room for them, never for the engines' own rows alone.
    pub fn reserve_rows(self: &Arc<Self>, bytes: usize) -> Rows {
        let mut used = self.used.lock().unwrap();
        if used.total > used.rows && used.total + bytes > self.limit {
            tracing::debug!(
                bytes,
                used = used.total,
                rows = used.rows,
                limit = self.limit,
                "rows wait for batches in flight"
            );
        }
        while used.total > used.rows && used.total + bytes > self.limit {
            used = self.freed.wait(used).unwrap();
        }
        used.total += bytes;
        used.rows += bytes;
        Rows { budget: self.clone(), bytes }
    }

    pub fn used(&self) -> usize {
        self.used.lock().unwrap().total
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// Rows' share of the budget, released when dropped.
pub struct Rows {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Rows {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The whole budget's limit.
    pub fn limit(&self) -> usize {
        self.budget.limit
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
    /// without waiting: the batch replaces the rows it was made of.
    pub fn into_batch(&mut self, rows: usize, bytes: usize) -> BatchShare {
        let rows = rows.min(self.bytes);
        self.bytes -= rows;
        let mut used = self.budget.used.lock().unwrap();
        used.rows -= rows;
        used.total = used.total - rows + bytes;
        if bytes < rows {
            self.budget.freed.notify_all();
        }
        BatchShare { budget: self.budget.clone(), bytes }
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

/// A batch's share of the budget, released when the last of its tensors' bytes is dropped.
pub struct BatchShare {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Drop for BatchShare {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
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

    #[test]
    fn reservations_block_at_the_limit_until_released() {
        let budget = Arc::new(MemoryBudget::new(100));
        budget.reserve(60);
        assert!(!budget.reserve_timeout(50, Duration::from_millis(20)), "60 + 50 exceeds 100");
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve(50))
        };
        budget.release(60);
        waiter.join().unwrap();
        assert_eq!(budget.used(), 50);
    }

    #[test]
    fn an_oversized_reservation_passes_only_alone() {
        let budget = MemoryBudget::new(10);
        assert!(budget.reserve_timeout(1000, Duration::from_millis(10)), "nothing held: let it through");
        assert!(!budget.reserve_timeout(1, Duration::from_millis(10)), "now the budget is exhausted");
        budget.release(1000);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn rows_wait_only_for_batches_in_flight() {
        let budget = Arc::new(MemoryBudget::new(100));
        let mut rows = budget.reserve_rows(80);
        // Only rows are held: more rows pass even over the limit, or the engine would wait
        // on itself.
        rows.merge(budget.reserve_rows(40));
        assert_eq!((budget.used(), rows.bytes()), (120, 120));
        let batch = rows.into_batch(120, 120);
        assert_eq!(rows.bytes(), 0);
        // Now a batch is in flight and the budget is full: new rows wait for it.
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve_rows(10).bytes())
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished());
        drop(batch);
        assert_eq!(waiter.join().unwrap(), 10);
        assert_eq!(budget.used(), 0, "the waiter's rows were dropped with its thread");
    }

    #[test]
    fn rows_never_wait_for_copies_kept_for_other_producers() {
        let budget = Arc::new(MemoryBudget::new(100));
        assert!(budget.try_reserve_kept(90));
        assert!(!budget.try_reserve_kept(20), "a copy is kept only if it fits");
        // The copies' takers are producers of this worker: rows they need to finish their
        // splits (and come to take the copies) must not wait for the copies to go.
        let rows = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve_rows(30))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !rows.is_finished() {
            assert!(std::time::Instant::now() < deadline, "rows waited for a kept copy");
            std::thread::sleep(Duration::from_millis(5));
        }
        let rows = rows.join().unwrap();
        assert_eq!(budget.used(), 120);
        // Batches still wait for room, the kept copies' too.
        assert!(!budget.reserve_timeout(1, Duration::from_millis(10)), "over the limit");
        budget.release_kept(90);
        drop(rows);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_batch_share_lives_as_long_as_any_slice_of_its_tensors() {
        use stoker_api::{DType, Tensor};
        let budget = Arc::new(MemoryBudget::new(1000));
        let mut rows = budget.reserve_rows(8);
        let mut batch = Batch::default();
        let x = Tensor::new(DType::Uint8, vec![8], Bytes::from(vec![7u8; 8])).unwrap();
        batch.tensors.insert("x".into(), Stacked::from(x));
        let batch = attach(batch, rows.into_batch(8, 8));
        drop(rows);
        assert_eq!(budget.used(), 8);
        let slice = batch.tensors["x"].parts[0].slice(2..4);
        drop(batch);
        assert_eq!((budget.used(), &slice[..]), (8, &[7u8, 7][..]));
        drop(slice);
        assert_eq!(budget.used(), 0);
    }
}
