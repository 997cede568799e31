//! What the simulated workers and clients saw: NextSplit and Acknowledge latencies and call
//! counts while the measurement runs, every split handed out and every completion a client
//! took (to check each split of an epoch reached the job exactly once), and when each member
//! was back with a new dispatcher.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Counted calls, by kind.
#[derive(Clone, Copy, Debug)]
pub enum Call {
    /// NextSplit answered with a split.
    Split,
    /// NextSplit answered draining or finished.
    Idle,
    Heartbeat,
    Report,
    Acknowledge,
    /// Any call answered with an error (retried).
    Error,
}

const CALLS: usize = 6;

#[derive(Default)]
pub struct Tally {
    /// Splits of each pipeline's epoch.
    splits: u64,
    measuring: AtomicBool,
    calls: [AtomicU64; CALLS],
    /// Splits acknowledged (completions sent) while measuring.
    acked_splits: AtomicU64,
    /// Microseconds, while measuring.
    next_split: Mutex<Vec<u32>>,
    acknowledge: Mutex<Vec<u32>>,
    /// By (pipeline, epoch): how often each split was handed out by each dispatcher, and
    /// taken by a client.
    epochs: Mutex<HashMap<(usize, u64), Epoch>>,
    /// Epochs every split of which was taken, by pipeline.
    complete: Mutex<HashMap<usize, u64>>,
    /// By dispatcher incarnation: when each worker and client was first back with it.
    backs: Mutex<HashMap<u64, Backs>>,
}

/// Counts by split (saturating at 255: one is all that is right).
#[derive(Default)]
struct Epoch {
    handed: HashMap<u64, Vec<u8>>,
    taken: Vec<u8>,
    /// Splits taken at least once.
    distinct: u64,
}

impl Epoch {
    fn new(splits: u64) -> Epoch {
        Epoch { handed: HashMap::new(), taken: vec![0; splits as usize], distinct: 0 }
    }
}

fn bump(counts: &mut [u8], split: u64) {
    if let Some(n) = counts.get_mut(split as usize) {
        *n = n.saturating_add(1);
    }
}

/// Counts beyond the first.
fn twice(counts: &[u8]) -> u64 {
    counts.iter().map(|&n| u64::from(n.saturating_sub(1))).sum()
}

/// Members that registered with one dispatcher (clients: and had its worker list), and when
/// the last of each did.
#[derive(Clone, Debug, Default)]
pub struct Backs {
    pub workers: usize,
    pub clients: usize,
    pub last_worker: Option<Instant>,
    pub last_client: Option<Instant>,
    /// When the first split of each pipeline went out.
    pub first_split: HashMap<usize, Instant>,
}

/// The latencies and counts of one measurement.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub calls: [u64; CALLS],
    pub acked_splits: u64,
    pub next_split: Vec<u32>,
    pub acknowledge: Vec<u32>,
}

impl Measured {
    pub fn count(&self, call: Call) -> u64 {
        self.calls[call as usize]
    }
}

/// What the job got of each epoch, over every pipeline.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delivery {
    /// Epochs every split of which a client took.
    pub complete_epochs: u64,
    /// Splits one dispatcher handed out twice in an epoch.
    pub handed_twice: u64,
    /// Splits of an epoch clients took twice: a row repeated.
    pub taken_twice: u64,
    /// Splits missing from epochs after which a later epoch completed.
    pub skipped: u64,
}

impl Tally {
    /// A tally of pipelines whose epochs have `splits` splits.
    pub fn new(splits: u64) -> Tally {
        Tally { splits, ..Tally::default() }
    }

    pub fn start_measuring(&self) {
        for c in &self.calls {
            c.store(0, Ordering::Relaxed);
        }
        self.acked_splits.store(0, Ordering::Relaxed);
        self.next_split.lock().unwrap().clear();
        self.acknowledge.lock().unwrap().clear();
        self.measuring.store(true, Ordering::Relaxed);
    }

    pub fn stop_measuring(&self) -> Measured {
        self.measuring.store(false, Ordering::Relaxed);
        Measured {
            calls: std::array::from_fn(|i| self.calls[i].load(Ordering::Relaxed)),
            acked_splits: self.acked_splits.load(Ordering::Relaxed),
            next_split: std::mem::take(&mut self.next_split.lock().unwrap()),
            acknowledge: std::mem::take(&mut self.acknowledge.lock().unwrap()),
        }
    }

    fn measuring(&self) -> bool {
        self.measuring.load(Ordering::Relaxed)
    }

    pub fn call(&self, call: Call) {
        if self.measuring() {
            self.calls[call as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn next_split(&self, took: Duration) {
        if self.measuring() {
            self.next_split.lock().unwrap().push(micros(took));
        }
    }

    pub fn acknowledged(&self, splits: usize, took: Duration) {
        if self.measuring() {
            self.calls[Call::Acknowledge as usize].fetch_add(1, Ordering::Relaxed);
            self.acked_splits.fetch_add(splits as u64, Ordering::Relaxed);
            self.acknowledge.lock().unwrap().push(micros(took));
        }
    }

    /// Dispatcher `incarnation` handed split (epoch, split) of `pipeline` out.
    pub fn handed(&self, pipeline: usize, incarnation: u64, epoch: u64, split: u64, at: Instant) {
        let mut epochs = self.epochs.lock().unwrap();
        let e = epochs.entry((pipeline, epoch)).or_insert_with(|| Epoch::new(self.splits));
        bump(e.handed.entry(incarnation).or_insert_with(|| vec![0; self.splits as usize]), split);
        drop(epochs);
        self.backs.lock().unwrap().entry(incarnation).or_default().first_split.entry(pipeline).or_insert(at);
    }

    /// A client of `pipeline` took the completion of (epoch, split): its rows reached the job.
    pub fn taken(&self, pipeline: usize, epoch: u64, split: u64) {
        let mut epochs = self.epochs.lock().unwrap();
        let e = epochs.entry((pipeline, epoch)).or_insert_with(|| Epoch::new(self.splits));
        if e.taken.get(split as usize) == Some(&0) {
            e.distinct += 1;
            if e.distinct == self.splits {
                *self.complete.lock().unwrap().entry(pipeline).or_default() += 1;
            }
        }
        bump(&mut e.taken, split);
    }

    /// A worker (or client) registered with dispatcher `incarnation` for the first time.
    pub fn back(&self, incarnation: u64, worker: bool, at: Instant) {
        let mut backs = self.backs.lock().unwrap();
        let b = backs.entry(incarnation).or_default();
        let (count, last) =
            if worker { (&mut b.workers, &mut b.last_worker) } else { (&mut b.clients, &mut b.last_client) };
        *count += 1;
        *last = Some(last.map_or(at, |l| l.max(at)));
    }

    /// The fewest complete epochs any of `pipelines` has.
    pub fn fewest_complete(&self, pipelines: usize) -> u64 {
        let complete = self.complete.lock().unwrap();
        (0..pipelines).map(|p| complete.get(&p).copied().unwrap_or(0)).min().unwrap_or(0)
    }

    pub fn backs(&self, incarnation: u64) -> Backs {
        self.backs.lock().unwrap().get(&incarnation).cloned().unwrap_or_default()
    }

    /// Checks every epoch of every pipeline: none handed out twice by a dispatcher or taken
    /// twice, and none missing from an epoch a later one of which completed.
    pub fn delivery(&self) -> Delivery {
        let epochs = self.epochs.lock().unwrap();
        let mut d = Delivery::default();
        let mut last_complete: HashMap<usize, u64> = HashMap::new();
        for (&(pipeline, epoch), e) in epochs.iter() {
            d.handed_twice += e.handed.values().map(|h| twice(h)).sum::<u64>();
            d.taken_twice += twice(&e.taken);
            if e.distinct == self.splits {
                d.complete_epochs += 1;
                let last = last_complete.entry(pipeline).or_insert(epoch);
                *last = (*last).max(epoch);
            }
        }
        for (&(pipeline, epoch), e) in epochs.iter() {
            if last_complete.get(&pipeline).is_some_and(|&last| epoch < last) {
                d.skipped += self.splits - e.distinct;
            }
        }
        d
    }
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}

/// The `q` quantile (0..=1) of `samples`, sorting them.
pub fn quantile(samples: &mut [u32], q: f64) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    Some(Duration::from_micros(u64::from(samples[i])))
}
