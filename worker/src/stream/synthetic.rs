//! A batch source that makes up deterministic batches: for tests, benchmarks, and exercising
//! clients without a real pipeline.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::{StreamExt, stream};
use stoker_api::{Batch, DType, Stacked};
use tonic::Status;

use super::{BatchSource, Batches, Subscription};

/// Batches per split, so split and sequence both vary.
const BATCHES_PER_SPLIT: u64 = 10;

#[derive(Clone)]
pub struct SyntheticSource {
    tensors: Vec<(String, DType, Vec<usize>)>,
    batches: Option<u64>,
    /// When set, every batch reuses these buffers (one per tensor): no per-batch generation
    /// cost, as when serving from a cache.
    shared: Option<Arc<Vec<Bytes>>>,
    /// Whether batches name their rows' origins, as the engine's do (the default).
    rows: bool,
    produced: Arc<AtomicU64>,
}

impl SyntheticSource {
    /// Endless batches of these tensors (name, dtype, shape).
    pub fn new(tensors: Vec<(String, DType, Vec<usize>)>) -> Self {
        SyntheticSource { tensors, batches: None, shared: None, rows: true, produced: Arc::default() }
    }

    /// Ends each consumer's stream after `n` batches.
    pub fn batches(mut self, n: u64) -> Self {
        self.batches = Some(n);
        self
    }

    /// Makes every batch share one payload, generated once.
    pub fn shared_payload(mut self) -> Self {
        let data = self.tensors.iter().map(|(_, dtype, shape)| pattern(0, byte_len(*dtype, shape))).collect();
        self.shared = Some(Arc::new(data));
        self
    }

    /// Batches without their rows' origins: the stream as it was before provenance, for
    /// measuring what provenance costs.
    pub fn without_rows(mut self) -> Self {
        self.rows = false;
        self
    }

    /// Batches handed out so far, across all consumers.
    pub fn produced(&self) -> u64 {
        self.produced.load(Ordering::Relaxed)
    }

    /// The `index`-th batch of a consumer starting at `epoch`.
    pub fn batch(&self, epoch: u64, index: u64) -> Batch<Stacked> {
        let tensors = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, (name, dtype, shape))| {
                let data = match &self.shared {
                    Some(shared) => shared[i].clone(),
                    None => pattern(index * 31 + i as u64, byte_len(*dtype, shape)),
                };
                (name.clone(), Stacked::dense(*dtype, shape.clone(), vec![data]))
            })
            .collect();
        // Provenance as the engine gives it, so benchmarks carry (and clients track) it too.
        let (split, sequence) = (index / BATCHES_PER_SPLIT, index % BATCHES_PER_SPLIT);
        // Rows are the first axis of a tensor of two or more; a flat payload has none.
        let rows_per_batch = self
            .tensors
            .first()
            .filter(|(_, _, shape)| self.rows && shape.len() >= 2)
            .map_or(0, |(_, _, shape)| shape[0]) as u64;
        let rows = (0..rows_per_batch).map(|r| stoker_api::row(split, sequence * rows_per_batch + r)).collect();
        Batch {
            tensors,
            epoch,
            split,
            sequence,
            completes: Vec::new(),
            rows,
            incarnation: 0,
            round: None,
            stream_seq: 0,
            echo: false,
        }
    }
}

fn byte_len(dtype: DType, shape: &[usize]) -> usize {
    shape.iter().product::<usize>() * dtype.size()
}

/// Bytes that differ per seed and position, so a misplaced or dropped piece shows.
fn pattern(seed: u64, len: usize) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        // xorshift64: cheap, and every 8-byte word differs.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

impl BatchSource for SyntheticSource {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        let epoch = subscription.start_epoch.unwrap_or(0);
        let this = self.clone();
        let indices = 0..self.batches.unwrap_or(u64::MAX);
        // `map` runs when the stream is polled: a batch is made only when the server can send.
        Ok(Box::pin(stream::iter(indices).map(move |i| {
            this.produced.fetch_add(1, Ordering::Relaxed);
            Ok(this.batch(epoch, i).into())
        })))
    }
}
