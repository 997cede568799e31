//! The pipeline engine: reads splits, parses records, runs the transforms on all cores, shuffles
//! and batches, and hands ready batches to the stream under a memory budget.
//!
//! Order: within a split, elements keep their record order through the parallel transform
//! stage (results are collected in order), so with no shuffle the output is deterministic.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use rayon::prelude::*;
use stoker_api::{Batch, OnError, SourceFormat, WorkerPipeline};

use crate::apply::{self, ElementError, ElementKey};
use crate::batch::{self, BatchError, Row};
use crate::budget::{self, MemoryBudget, Rows};
use crate::element::Element;
use crate::formats::{self, Corrupt, image_folder};
use crate::shuffle::ShuffleBuffer;
use crate::source::{DataSource, Shard, SourceError};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Threads of the transform pool (default: every core).
    pub threads: usize,
    /// Bytes of transformed elements and batches not yet sent held before production pauses
    /// (see budget.rs).
    pub memory_budget: usize,
    /// Most image-folder files per split (other formats split by shard file). Small folders
    /// get smaller splits, down to 8 files, so there are enough to share among workers.
    pub files_per_split: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_budget: 512 << 20,
            files_per_split: 256,
        }
    }
}

/// A unit of work: whole shard files of one format, handed out by the dispatcher later.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    pub id: u64,
    pub shards: Vec<Shard>,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("corrupt record (onError: fail): {0}")]
    Corrupt(Corrupt),
    #[error("element {element} of split {split} (onError: fail): {source}")]
    Element { split: u64, element: u64, source: ElementError },
    #[error("batching: {0}")]
    Batch(#[from] BatchError),
    #[error("building the transform pool: {0}")]
    Pool(String),
}

/// Counters of everything the engine did, for logs, metrics and heartbeats.
#[derive(Default, Debug)]
pub struct Stats {
    pub records: AtomicU64,
    pub elements: AtomicU64,
    pub filtered: AtomicU64,
    pub batches: AtomicU64,
    pub batch_bytes: AtomicU64,
    /// Skipped records and elements by reason.
    pub skipped: Mutex<BTreeMap<&'static str, u64>>,
    /// Time per transform index, summed over threads.
    pub op_time: Mutex<Vec<Duration>>,
}

impl Stats {
    fn skip(&self, reason: &'static str) {
        *self.skipped.lock().unwrap().entry(reason).or_default() += 1;
    }

    pub fn skipped(&self) -> BTreeMap<&'static str, u64> {
        self.skipped.lock().unwrap().clone()
    }
}

/// A ready batch. Its tensors' bytes hold the batch's share of the memory budget: it is
/// released once they are dropped (after the stream has sent the last chunk), wherever the
/// batch travels meanwhile.
pub struct Ready {
    pub batch: Batch,
    /// Splits (of the batch's epoch) whose last element is in this batch or was dropped.
    pub completes: Vec<u64>,
}

impl Ready {
    pub fn into_batch(self) -> Batch {
        self.batch
    }
}

pub struct Engine {
    pipeline: WorkerPipeline,
    source: DataSource,
    splits: Vec<Split>,
    labels: BTreeMap<String, i64>,
    config: EngineConfig,
    pool: rayon::ThreadPool,
    budget: Arc<MemoryBudget>,
    runtime: tokio::runtime::Handle,
    pub stats: Arc<Stats>,
}

impl Engine {
    /// Lists the source and plans its splits. Must be called inside a tokio runtime.
    pub async fn open(pipeline: WorkerPipeline, config: EngineConfig) -> Result<Engine, EngineError> {
        let source = DataSource::open(&pipeline.source.uri)?;
        let shards = source.list().await?;
        let (splits, labels) = plan(&source, pipeline.source.format, shards, config.files_per_split);
        if splits.is_empty() {
            return Err(SourceError::NotFound { uri: pipeline.source.uri.clone() }.into());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads.max(1))
            .thread_name(|i| format!("stoker-transform-{i}"))
            .build()
            .map_err(|e| EngineError::Pool(e.to_string()))?;
        let stats = Arc::new(Stats::default());
        *stats.op_time.lock().unwrap() = vec![Duration::ZERO; pipeline.transforms.len()];
        Ok(Engine {
            budget: Arc::new(MemoryBudget::new(config.memory_budget)),
            runtime: tokio::runtime::Handle::current(),
            pipeline,
            source,
            splits,
            labels,
            config,
            pool,
            stats,
        })
    }

    pub fn splits(&self) -> &[Split] {
        &self.splits
    }

    pub fn pipeline(&self) -> &WorkerPipeline {
        &self.pipeline
    }

    pub fn threads(&self) -> usize {
        self.config.threads
    }

    /// Produces one epoch's batches from `splits` into `out`, blocking (run it on its own
    /// thread). Returns early, without error, when the receiver is gone.
    pub fn run_epoch(&self, epoch: u64, splits: &[Split], out: &std::sync::mpsc::SyncSender<Ready>) -> Result<(), EngineError> {
        self.run_splits(epoch, splits.iter().cloned(), out).map(drop)
    }

    /// Like `run_epoch`, pulling splits one at a time (from the dispatcher) until `splits` ends.
    /// Each ready batch names the splits it completes (`Ready::completes`); the splits that
    /// completed with no batch left to carry them are returned.
    pub fn run_splits(
        &self,
        epoch: u64,
        splits: impl IntoIterator<Item = Split>,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<Vec<u64>, EngineError> {
        let p = &self.pipeline;
        let seed = p.seed.unwrap_or(0);
        let mut shuffle = p.shuffle.as_ref().map(|s| ShuffleBuffer::new(s.buffer_size as usize, s.seed.unwrap_or(seed), epoch));
        let mut batch = Pending::new(p.batch_size as usize, self.budget.reserve_rows(0));
        let mut sequence = 0u64;
        let mut last_split = 0;
        let window = (self.config.threads * 64).max(64);
        let mut row_estimate = 0;
        let mut splits = splits.into_iter();
        // Reading the next split overlaps transforming this one, and transforming a chunk (on
        // the pool, from a scoped thread) overlaps batching the one before it here.
        let mut next = splits.next().map(|s| (self.fetch(&s), s));
        let mut deferred: Option<Chunk> = None;
        let stopped = std::thread::scope(|scope| -> Result<bool, EngineError> {
            while let Some((fetching, split)) = next.take() {
                let data = self.runtime.block_on(fetching).expect("the fetch task runs to completion");
                next = splits.next().map(|s| (self.fetch(&s), s));
                last_split = split.id;
                let mut records = self.parse(&split, data)?.into_iter();
                let mut first = 0u64;
                loop {
                    let chunk: Vec<Element> = records.by_ref().take(window).collect();
                    if chunk.is_empty() {
                        break;
                    }
                    let len = chunk.len() as u64;
                    // The chunk's output is held from before it exists until it is sent:
                    // reserve what the last chunk's rows weighed, wait while batches in flight
                    // leave no room, then correct to the actual size.
                    let mut reserved = self.budget.reserve_rows(row_estimate * chunk.len());
                    let id = split.id;
                    let transforming = scope.spawn(move || self.transform(epoch, id, first, chunk));
                    if let Some(done) = deferred.take()
                        && !self.take_chunk(done, &mut shuffle, &mut batch, epoch, &mut sequence, out)?
                    {
                        return Ok(true);
                    }
                    let rows = transforming.join().expect("the transform thread does not panic")?;
                    let bytes: usize = rows.iter().map(row_bytes).sum();
                    if !rows.is_empty() {
                        row_estimate = bytes / rows.len();
                    }
                    reserved.resize(bytes);
                    batch.held.merge(reserved);
                    first += len;
                    deferred = Some(Chunk { split: split.id, rows, completes_split: false });
                }
                // The split is read: it completes once its last chunk is batched.
                match deferred.as_mut() {
                    Some(chunk) if chunk.split == split.id => chunk.completes_split = true,
                    _ => batch.track.parsed(split.id),
                }
            }
            if let Some(done) = deferred.take()
                && !self.take_chunk(done, &mut shuffle, &mut batch, epoch, &mut sequence, out)?
            {
                return Ok(true);
            }
            Ok(false)
        })?;
        if stopped {
            return Ok(Vec::new());
        }
        if let Some(buffer) = shuffle.as_mut() {
            for row in buffer.drain() {
                batch.push(row);
                if batch.len() == p.batch_size as usize && !self.emit(&mut batch, epoch, last_split, &mut sequence, out)? {
                    return Ok(Vec::new());
                }
            }
        }
        if batch.len() > 0 && !p.drop_remainder {
            self.emit(&mut batch, epoch, last_split, &mut sequence, out)?;
        }
        // Rows dropped as the remainder leave their splits complete too.
        batch.drop_rows();
        Ok(std::mem::take(&mut batch.track.completed))
    }

    /// Starts reading a split's shards on the runtime, many at once (image folders are many
    /// small files).
    fn fetch(&self, split: &Split) -> tokio::task::JoinHandle<Vec<Result<bytes::Bytes, SourceError>>> {
        let source = self.source.clone();
        let shards = split.shards.clone();
        let reads = shards.into_iter().map(move |shard| {
            let source = source.clone();
            async move { source.read(&shard).await }
        });
        self.runtime.spawn(futures::stream::iter(reads).buffered(32).collect())
    }

    /// Parses a split's records; corrupt ones are counted and skipped, or fatal.
    fn parse(&self, split: &Split, data: Vec<Result<bytes::Bytes, SourceError>>) -> Result<Vec<Element>, EngineError> {
        let source = &self.source;
        let mut elements = Vec::new();
        for (shard, bytes) in split.shards.iter().zip(data) {
            let bytes = bytes?;
            let name = source.relative(shard);
            let parsed: Box<dyn Iterator<Item = Result<Element, Corrupt>>> = match self.pipeline.source.format {
                // Planning kept only labelled images, so every shard here makes an element.
                SourceFormat::ImageFolder => Box::new(image_folder::element(name, bytes, &self.labels).map(Ok).into_iter()),
                SourceFormat::Tfrecord => Box::new(formats::tfrecord::read(bytes, name)),
                SourceFormat::Jsonl => Box::new(formats::jsonl::read(bytes, name)),
                SourceFormat::Webdataset => Box::new(formats::tar::read(bytes, name)),
            };
            for record in parsed {
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                match record {
                    Ok(element) => elements.push(element),
                    Err(corrupt) if self.pipeline.on_error == OnError::Skip => {
                        tracing::warn!(shard = %corrupt.shard, offset = corrupt.offset, reason = %corrupt.reason, detail = %corrupt.detail, "skipping a corrupt record");
                        self.stats.skip(corrupt.reason.as_str());
                    }
                    Err(corrupt) => return Err(EngineError::Corrupt(corrupt)),
                }
            }
        }
        Ok(elements)
    }

    /// Runs the transforms on a chunk on every pool thread, keeping the chunk's order.
    fn transform(&self, epoch: u64, split: u64, first: u64, chunk: Vec<Element>) -> Result<Vec<Row>, EngineError> {
        let p = &self.pipeline;
        let seed = p.seed.unwrap_or(0);
        type Transformed = (Result<Option<Element>, ElementError>, Vec<Duration>);
        let results: Vec<Transformed> = self.pool.install(|| {
            chunk
                .into_par_iter()
                .enumerate()
                .map(|(i, element)| {
                    // Element ids are stable per (split, position) whatever thread runs them.
                    let key = ElementKey { seed, epoch, element: (split << 32) | (first + i as u64) };
                    let mut timings = vec![Duration::ZERO; p.transforms.len()];
                    (apply::apply(&p.transforms, element, key, &mut timings), timings)
                })
                .collect()
        });
        let mut rows = Vec::with_capacity(results.len());
        let mut op_time = vec![Duration::ZERO; p.transforms.len()];
        for (i, (result, timings)) in results.into_iter().enumerate() {
            for (total, t) in op_time.iter_mut().zip(timings) {
                *total += t;
            }
            match result {
                Ok(Some(element)) => {
                    self.stats.elements.fetch_add(1, Ordering::Relaxed);
                    rows.push(self.to_row(element)?);
                }
                Ok(None) => {
                    self.stats.filtered.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) if p.on_error == OnError::Skip => {
                    tracing::warn!(split, element = first + i as u64, %error, "skipping an element");
                    self.stats.skip(error.reason());
                }
                Err(source) => return Err(EngineError::Element { split, element: first + i as u64, source }),
            }
        }
        for (total, t) in self.stats.op_time.lock().unwrap().iter_mut().zip(op_time) {
            *total += t;
        }
        Ok(rows)
    }

    fn to_row(&self, element: Element) -> Result<Row, EngineError> {
        element
            .into_iter()
            .map(|(name, field)| match apply::to_tensor(field) {
                Ok(t) => Ok((name, t)),
                Err(kind) => Err(EngineError::Batch(BatchError::Unbatchable { field: name, kind })),
            })
            .collect()
    }

    /// Moves a transformed chunk's rows through the shuffle buffer into batches, sending each
    /// full one; false when nobody listens.
    fn take_chunk(
        &self,
        chunk: Chunk,
        shuffle: &mut Option<ShuffleBuffer<(u64, Row)>>,
        batch: &mut Pending,
        epoch: u64,
        sequence: &mut u64,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<bool, EngineError> {
        let size = self.pipeline.batch_size as usize;
        for row in chunk.rows {
            batch.track.entered(chunk.split);
            let row = match shuffle.as_mut() {
                Some(buffer) => buffer.push((chunk.split, row)),
                None => Some((chunk.split, row)),
            };
            if let Some(row) = row {
                batch.push(row);
                if batch.len() == size && !self.emit(batch, epoch, chunk.split, sequence, out)? {
                    return Ok(false);
                }
            }
        }
        if chunk.completes_split {
            batch.track.parsed(chunk.split);
        }
        Ok(true)
    }

    /// Makes a batch of the pending rows and sends it; false when nobody listens.
    fn emit(
        &self,
        pending: &mut Pending,
        epoch: u64,
        split: u64,
        sequence: &mut u64,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<bool, EngineError> {
        let rows_bytes = pending.rows.iter().map(row_bytes).sum();
        let batch = batch::make_batch(&mut pending.rows, self.pipeline.pad_value, epoch, split, *sequence)?;
        pending.drop_rows();
        let completes = std::mem::take(&mut pending.track.completed);
        *sequence += 1;
        let bytes = batch.payload_bytes();
        // The rows' reservation passes to the batch, and leaves with it.
        let batch = budget::attach(batch, pending.held.into_batch(rows_bytes, bytes));
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.batch_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(out.send(Ready { batch, completes }).is_ok())
    }
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

/// The rows of the batch being filled, with the split each came from.
struct Pending {
    rows: Vec<Row>,
    splits: Vec<u64>,
    track: SplitTracker,
    /// The budget share of every transformed row the engine holds: in the shuffle buffer and
    /// here. Dropped rows (a remainder, an early return) release it with `Pending`.
    held: Rows,
}

impl Pending {
    fn new(n: usize, held: Rows) -> Self {
        Pending { rows: Vec::with_capacity(n), splits: Vec::with_capacity(n), track: SplitTracker::default(), held }
    }

    fn len(&self) -> usize {
        self.rows.len()
    }

    fn push(&mut self, (split, row): (u64, Row)) {
        self.splits.push(split);
        self.rows.push(row);
    }

    /// The rows are gone (batched or dropped): their splits may be complete now.
    fn drop_rows(&mut self) {
        self.rows.clear();
        for split in self.splits.drain(..) {
            self.track.left(split);
        }
    }
}

/// Knows when a split's last element has left the engine, so the dispatcher is told a split
/// is done only once all its data is on its way to a client.
#[derive(Default)]
struct SplitTracker {
    /// Rows of each split still in the shuffle buffer or the batch being filled.
    inside: BTreeMap<u64, u64>,
    /// Splits still being parsed and transformed.
    reading: std::collections::BTreeSet<u64>,
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

/// Files per image-folder split: aim at 64 splits or more, so dynamic sharding has enough to
/// share, without going below 8 files (each split costs a dispatcher round trip) or above
/// the configured most.
fn split_size(files: usize, most: usize) -> usize {
    files.div_ceil(64).max(8).min(most.max(1))
}

/// Splits for a listing: image folders group files (the label map comes from their folders);
/// record formats take one shard file per split.
fn plan(source: &DataSource, format: SourceFormat, shards: Vec<Shard>, files_per_split: usize) -> (Vec<Split>, BTreeMap<String, i64>) {
    match format {
        SourceFormat::ImageFolder => {
            let images: Vec<Shard> =
                shards.into_iter().filter(|s| image_folder::is_image(source.relative(s))).collect();
            let names: Vec<String> = images.iter().map(|s| source.relative(s).to_string()).collect();
            let labels = image_folder::label_map(&names);
            let splits = images
                .chunks(split_size(images.len(), files_per_split))
                .enumerate()
                .map(|(i, c)| Split { id: i as u64, shards: c.to_vec() })
                .collect();
            (splits, labels)
        }
        _ => {
            let splits = shards.into_iter().enumerate().map(|(i, s)| Split { id: i as u64, shards: vec![s] }).collect();
            (splits, BTreeMap::new())
        }
    }
}
