//! Splits made once for several jobs of a share group on this worker. The dispatcher hands one
//! production of a split to each member job's producer here (`Assigned::shared`): the first to
//! claim it makes its rows as usual and keeps a copy of them (the tensors' bytes are shared,
//! not copied), the others take that copy, skipping the read and every transform, and shuffle
//! and batch it for their own consumers.
//!
//! What is kept is held in the worker's memory budget, without waiting: a copy that does not
//! fit is not kept, and its takers make the split themselves (counted as made again). It
//! counts with the engines' rows, which never wait for it: its takers are producers here, and
//! one stopped mid-split for room would never come to take what frees it. So is
//! one whose maker failed, and one no taker came for within [`KEPT_AT_MOST`] (the dispatcher
//! gave the split back to that job meanwhile).
//!
//! Each chunk of a copy is recorded as soon as the maker's pool has transformed it
//! ([`Maker::chunk`]), not when the maker's batcher takes it: the batcher goes at the pace of
//! the maker's own consumer, and a fast job taking a slow one's production waited for that
//! pace (14% of its time in a sweep of 224-px images). A split in one chunk (up to 64
//! elements a thread) is thus complete once transformed; a longer one still grows only as
//! the maker lands its chunks. So a slow, stopped or CPU-starved maker must not hold the
//! others: a taker whose copy has not grown for [`STILL_FOR`] (or is not complete after
//! [`TAKE_PATIENCE`]) takes the rows made so far and makes only the rest. A maker that got on
//! without a row to record yet (it read a columnar split) says so ([`Maker::stir`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::stack::Row;
use crate::budget::{MemoryBudget, Rows};

/// How long a taker waits for a production that is still being made before taking what there
/// is and making the rest.
pub const TAKE_PATIENCE: Duration = Duration::from_secs(5);
/// How long a copy may go without growing before its takers stop waiting for it: a maker
/// lands a chunk (its threads' 64 elements each) every fraction of a second while its
/// consumer keeps up.
pub const STILL_FOR: Duration = Duration::from_millis(750);
/// How long a copy waits for its takers: longer than the dispatcher's patience with them
/// (`share::PATIENCE`, 10 s), after which it gives the split back to their queues.
pub const KEPT_AT_MOST: Duration = Duration::from_secs(20);
/// Productions remembered as gone (dropped, failed, evicted), so a late taker knows to make
/// the split rather than to wait for a maker.
const GONE_REMEMBERED: usize = 4096;

/// A production: the dispatcher's incarnation and the production's id there.
pub type ProductionKey = (u64, u64);

/// One production of a split for `takers` jobs, as one of them is handed it (see the proto's
/// SharedProduction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shared {
    pub key: ProductionKey,
    pub takers: u32,
}

#[derive(Default)]
struct Entry {
    rows: Vec<(u64, Row)>,
    complete: bool,
    /// Takers (the maker aside) that have not taken it (or given up on it) yet.
    takers_left: u32,
    /// Its maker claimed it.
    made: bool,
    /// What `rows` hold of the budget, released with the entry.
    kept: Option<Rows>,
    since: Option<Instant>,
    /// Chunks recorded, and how many the split has once its maker knows.
    chunks_recorded: usize,
    chunks: Option<usize>,
    /// Times its maker said it got on without recording rows ([`Maker::stir`]).
    stirred: u64,
}

impl Entry {
    /// Complete once every chunk is recorded.
    fn count(&mut self) {
        if self.chunks == Some(self.chunks_recorded) {
            self.complete = true;
        }
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<ProductionKey, Entry>,
    gone: VecDeque<ProductionKey>,
}

impl Inner {
    /// Forgets production `key` (and frees its copy).
    fn remove(&mut self, key: ProductionKey) {
        self.entries.remove(&key);
        if !self.gone.contains(&key) {
            self.gone.push_back(key);
            if self.gone.len() > GONE_REMEMBERED {
                self.gone.pop_front();
            }
        }
    }
}

/// Counters of the sharing, for heartbeats and logs.
#[derive(Default, Debug)]
pub struct SharedStats {
    /// Productions made here for more than one job.
    pub made: AtomicU64,
    /// Rows taken from another job's production instead of made.
    pub rows_taken: AtomicU64,
    /// Productions a taker made itself, whole or the rest of what it took (the copy was gone,
    /// or its maker was held up).
    pub made_again: AtomicU64,
}

pub struct SharedSplits {
    inner: Mutex<Inner>,
    changed: Condvar,
    budget: Arc<MemoryBudget>,
    pub stats: SharedStats,
}

/// What a taker got of a production.
#[derive(Debug)]
pub enum Taken {
    /// Every row.
    All(Vec<(u64, Row)>),
    /// The rows made so far (maybe none): the maker is held up, or the copy is gone. Make the
    /// split's other positions.
    Part(Vec<(u64, Row)>),
}

/// What a producer handed a shared production does with it.
pub enum Claim {
    /// Make the split, keeping its rows for the other takers.
    Make(Maker),
    /// Take the rows another producer makes.
    Take(Taker),
    /// Make it for this job alone: the only taker, or the copy is gone.
    Alone,
}

impl SharedSplits {
    pub fn new(budget: Arc<MemoryBudget>) -> Arc<Self> {
        Arc::new(SharedSplits {
            inner: Mutex::default(),
            changed: Condvar::new(),
            budget,
            stats: SharedStats::default(),
        })
    }

    /// A producer handed `shared`: the first to come makes it, the others take it. (A maker
    /// named in advance may be busy with what waited for it before; nobody should wait for a
    /// producer that has not started.)
    pub fn claim(self: &Arc<Self>, shared: Shared) -> Claim {
        let mut inner = self.inner.lock().unwrap();
        self.evict_old(&mut inner);
        if shared.takers <= 1 {
            return Claim::Alone;
        }
        if !inner.entries.contains_key(&shared.key) {
            if inner.gone.contains(&shared.key) {
                self.stats.made_again.fetch_add(1, Ordering::Relaxed);
                return Claim::Alone;
            }
            let entry = Entry { takers_left: shared.takers - 1, since: Some(Instant::now()), ..Entry::default() };
            inner.entries.insert(shared.key, entry);
        }
        let entry = inner.entries.get_mut(&shared.key).expect("there now");
        if !entry.made {
            entry.made = true;
            self.stats.made.fetch_add(1, Ordering::Relaxed);
            return Claim::Make(Maker { splits: self.clone(), key: shared.key, finished: false });
        }
        Claim::Take(Taker { splits: self.clone(), key: shared.key })
    }

    fn evict_old(&self, inner: &mut Inner) {
        let old: Vec<ProductionKey> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.since.is_some_and(|t| t.elapsed() > KEPT_AT_MOST))
            .map(|(k, _)| *k)
            .collect();
        for key in old {
            inner.remove(key);
        }
    }

    /// Keeps a copy of `rows` of production `key` if the budget has room now; otherwise the
    /// copy is dropped and its takers make the split themselves. `chunk`: they are a whole
    /// chunk, counted toward the split's completion.
    fn record(&self, key: ProductionKey, rows: &[(u64, Row)], chunk: bool) {
        let bytes: usize = rows.iter().map(|(_, row)| row.bytes()).sum();
        let mut inner = self.inner.lock().unwrap();
        let Some(entry) = inner.entries.get_mut(&key) else { return };
        let Some(share) = self.budget.try_reserve_kept(bytes) else {
            tracing::debug!(production = ?key, bytes, "no room in the memory budget for a shared split's copy: its takers make it");
            inner.remove(key);
            drop(inner);
            self.changed.notify_all();
            return;
        };
        match &mut entry.kept {
            Some(kept) => kept.merge(share),
            None => entry.kept = Some(share),
        }
        entry.rows.extend(rows.iter().cloned());
        if chunk {
            entry.chunks_recorded += 1;
            entry.count();
        }
        drop(inner);
        // A taker waits as long as the copy grows.
        self.changed.notify_all();
    }

    /// Bytes the kept copies hold.
    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap().entries.values().map(|e| e.kept.as_ref().map_or(0, Rows::bytes)).sum()
    }

    /// The counters, for heartbeats.
    pub fn progress(&self) -> stoker_api::proto::SharingProgress {
        let s = &self.stats;
        stoker_api::proto::SharingProgress {
            made: s.made.load(Ordering::Relaxed),
            rows_taken: s.rows_taken.load(Ordering::Relaxed),
            made_again: s.made_again.load(Ordering::Relaxed),
            kept_bytes: self.bytes() as u64,
        }
    }
}

/// The producer making a shared production: what it lands goes to the takers too.
pub struct Maker {
    splits: Arc<SharedSplits>,
    key: ProductionKey,
    finished: bool,
}

impl Maker {
    /// Keeps a copy of `rows` (cheap: the tensors' bytes are shared) if the budget has room now;
    /// otherwise the copy is dropped and the takers make the split themselves.
    pub fn record(&self, rows: &[(u64, Row)]) {
        self.splits.record(self.key, rows, false);
    }

    /// Tells the takers the maker got on (it read the split) though no row is recorded yet:
    /// their copy counts as growing.
    pub fn stir(&self) {
        if let Some(entry) = self.splits.inner.lock().unwrap().entries.get_mut(&self.key) {
            entry.stirred += 1;
        }
        self.splits.changed.notify_all();
    }

    /// What records one chunk's rows where it is transformed; the split is complete once
    /// [`Maker::chunks`] of them are recorded.
    pub fn chunk(&self) -> ChunkRecorder {
        ChunkRecorder { splits: self.splits.clone(), key: self.key }
    }

    /// The split has `chunks` chunks, each recorded through a [`ChunkRecorder`].
    pub fn chunks(&self, chunks: usize) {
        let mut inner = self.splits.inner.lock().unwrap();
        if let Some(entry) = inner.entries.get_mut(&self.key) {
            entry.chunks = Some(chunks);
            entry.count();
        }
        drop(inner);
        self.splits.changed.notify_all();
    }

    /// Every row is recorded: the takers may have them.
    pub fn finish(mut self) {
        self.finished = true;
        let mut inner = self.splits.inner.lock().unwrap();
        if let Some(entry) = inner.entries.get_mut(&self.key) {
            entry.complete = true;
        }
        drop(inner);
        self.splits.changed.notify_all();
    }
}

impl Drop for Maker {
    /// Not finished (the run failed or stopped) nor complete: the takers make the split
    /// themselves.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut inner = self.splits.inner.lock().unwrap();
        if inner.entries.get(&self.key).is_some_and(|e| !e.complete) {
            inner.remove(self.key);
        }
        drop(inner);
        self.splits.changed.notify_all();
    }
}

/// Records one chunk of a production, from the thread that transformed it.
pub struct ChunkRecorder {
    splits: Arc<SharedSplits>,
    key: ProductionKey,
}

impl ChunkRecorder {
    pub fn record(self, rows: &[(u64, Row)]) {
        self.splits.record(self.key, rows, true);
    }
}

/// A producer taking another's production.
pub struct Taker {
    splits: Arc<SharedSplits>,
    key: ProductionKey,
}

impl Taker {
    /// The production's rows once made, waiting while the copy grows, at most `patience` in
    /// all; what was made so far when it stops growing for `still` or the patience runs out,
    /// or none if it is gone. The last taker frees the copy.
    pub fn take(self, patience: Duration, still: Duration) -> Taken {
        let splits = &self.splits;
        let started = Instant::now();
        let mut inner = splits.inner.lock().unwrap();
        let mut seen = (0, 0);
        let mut grew = started;
        while let Some(entry) = inner.entries.get(&self.key) {
            if entry.complete {
                break;
            }
            if (entry.rows.len(), entry.stirred) != seen {
                (seen, grew) = ((entry.rows.len(), entry.stirred), Instant::now());
            }
            let until = (grew + still).min(started + patience);
            let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else { break };
            inner = splits.changed.wait_timeout(inner, left).unwrap().0;
        }
        let Some(entry) = inner.entries.get_mut(&self.key) else {
            splits.stats.made_again.fetch_add(1, Ordering::Relaxed);
            return Taken::Part(Vec::new());
        };
        entry.takers_left = entry.takers_left.saturating_sub(1);
        let (complete, last) = (entry.complete, entry.takers_left == 0);
        let rows = if last { std::mem::take(&mut entry.rows) } else { entry.rows.clone() };
        if last {
            inner.remove(self.key);
        }
        splits.stats.rows_taken.fetch_add(rows.len() as u64, Ordering::Relaxed);
        tracing::debug!(production = ?self.key, rows = rows.len(), complete, waited = ?started.elapsed(), "taken");
        if complete {
            Taken::All(rows)
        } else {
            splits.stats.made_again.fetch_add(1, Ordering::Relaxed);
            Taken::Part(rows)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use stoker_api::{DType, Tensor};

    fn rows(n: u64, bytes: usize) -> Vec<(u64, Row)> {
        (0..n)
            .map(|i| {
                let t = Tensor::new(DType::Uint8, vec![bytes], Bytes::from(vec![i as u8; bytes])).unwrap();
                (i, Row::Fields([("x".to_string(), t)].into()))
            })
            .collect()
    }

    /// Production `id` for three jobs.
    fn production(id: u64) -> Shared {
        Shared { key: (1, id), takers: 3 }
    }

    #[test]
    fn the_first_makes_the_others_take_and_the_last_frees_the_copy() {
        let budget = Arc::new(MemoryBudget::new(1 << 20));
        let splits = SharedSplits::new(budget.clone());
        let Claim::Make(maker) = splits.claim(production(0)) else { panic!("the first to come makes it") };
        let Claim::Take(second) = splits.claim(production(0)) else { panic!("the second takes it") };
        let waiting = std::thread::spawn(move || second.take(Duration::from_secs(10), Duration::from_secs(10)));
        maker.record(&rows(4, 100));
        assert_eq!(budget.used(), 400);
        maker.finish();
        assert_eq!(all(waiting.join().unwrap()).len(), 4);
        let Claim::Take(last) = splits.claim(production(0)) else { panic!("the third takes") };
        assert_eq!(all(last.take(Duration::ZERO, Duration::ZERO))[3].0, 3);
        assert_eq!((budget.used(), splits.bytes()), (0, 0), "the last taker freed it");
        assert!(matches!(splits.claim(production(0)), Claim::Alone), "a taker after the copy is freed makes it alone");
        assert_eq!(splits.stats.rows_taken.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_copy_without_room_or_a_failed_maker_leaves_the_takers_to_make_it() {
        let budget = Arc::new(MemoryBudget::new(100));
        let splits = SharedSplits::new(budget.clone());
        let Claim::Make(making) = splits.claim(production(1)) else { panic!() };
        let Claim::Take(taking) = splits.claim(production(1)) else { panic!() };
        making.record(&rows(4, 100));
        assert_eq!(budget.used(), 0, "nothing kept beyond the budget");
        making.finish();
        assert!(part(taking.take(Duration::from_secs(1), Duration::from_secs(1))).is_empty());
        assert!(matches!(splits.claim(production(1)), Claim::Alone));

        let Claim::Make(making) = splits.claim(production(2)) else { panic!() };
        let Claim::Take(taking) = splits.claim(production(2)) else { panic!() };
        drop(making);
        let waited = Instant::now();
        assert!(part(taking.take(Duration::from_secs(10), Duration::from_secs(10))).is_empty(), "a maker that stopped");
        assert!(waited.elapsed() < Duration::from_secs(1), "its takers hear of it at once");
        assert_eq!(splits.stats.made_again.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_taker_takes_what_a_held_up_maker_made_and_waits_while_it_grows() {
        let splits = SharedSplits::new(Arc::new(MemoryBudget::new(1 << 20)));
        let Claim::Make(making) = splits.claim(production(3)) else { panic!() };
        let Claim::Take(taking) = splits.claim(production(3)) else { panic!() };
        making.record(&rows(1, 10));
        // The copy stops growing: the taker takes the row there is after `still`, not after
        // its patience.
        let started = Instant::now();
        let taken = part(taking.take(Duration::from_secs(30), Duration::from_millis(200)));
        let waited = started.elapsed();
        assert_eq!(taken.len(), 1);
        assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(5), "{waited:?}");

        // A copy that keeps growing is waited for, past `still`, until it is complete; a maker
        // that says it got on (it read its split) counts as growing too.
        let Claim::Take(taking) = splits.claim(production(3)) else { panic!() };
        let grows = std::thread::spawn(move || {
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(200));
                making.stir();
            }
            for _ in 0..5 {
                std::thread::sleep(Duration::from_millis(100));
                making.record(&rows(1, 10));
            }
            making.finish();
        });
        assert_eq!(all(taking.take(Duration::from_secs(30), Duration::from_millis(300))).len(), 6);
        grows.join().unwrap();
        // Patience bounds the wait even while the copy grows.
        let Claim::Make(making) = splits.claim(production(4)) else { panic!() };
        let Claim::Take(taking) = splits.claim(production(4)) else { panic!() };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let grows = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                    making.record(&rows(1, 10));
                }
            })
        };
        let started = Instant::now();
        assert!(!part(taking.take(Duration::from_millis(300), Duration::from_secs(10))).is_empty());
        assert!(started.elapsed() < Duration::from_secs(5));
        stop.store(true, Ordering::Relaxed);
        grows.join().unwrap();
    }

    #[test]
    fn a_copy_recorded_chunk_by_chunk_is_complete_before_its_maker_lands_it() {
        let budget = Arc::new(MemoryBudget::new(1 << 20));
        let splits = SharedSplits::new(budget.clone());
        let Claim::Make(maker) = splits.claim(production(5)) else { panic!() };
        let Claim::Take(taking) = splits.claim(production(5)) else { panic!() };
        // The pool's threads record the chunks in any order; the maker learns the count last.
        let (first, second) = (maker.chunk(), maker.chunk());
        std::thread::spawn(move || second.record(&rows(2, 10))).join().unwrap();
        first.record(&rows(3, 10));
        maker.chunks(2);
        // Taken whole at once, though the maker's own batcher (held by its slow consumer) has
        // not landed a row of it, and it stops before it does: the copy stays whole.
        let started = Instant::now();
        drop(maker);
        assert_eq!(all(taking.take(Duration::from_secs(30), Duration::from_secs(30))).len(), 5);
        assert!(started.elapsed() < Duration::from_secs(1));
        let Claim::Take(last) = splits.claim(production(5)) else { panic!("the third takes") };
        assert_eq!(all(last.take(Duration::ZERO, Duration::ZERO)).len(), 5);
        assert_eq!(budget.used(), 0);
    }

    fn all(taken: Taken) -> Vec<(u64, Row)> {
        match taken {
            Taken::All(rows) => rows,
            Taken::Part(rows) => panic!("{} rows of an incomplete copy", rows.len()),
        }
    }

    fn part(taken: Taken) -> Vec<(u64, Row)> {
        match taken {
            Taken::Part(rows) => rows,
            Taken::All(rows) => panic!("all {} rows, where part was expected", rows.len()),
        }
    }
}
