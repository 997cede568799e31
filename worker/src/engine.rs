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
use crate::cache::chunk;
use crate::cache::store::{LeaseKind, SplitWriter};
use crate::cached::{CacheConfig, EngineCache, SplitCache};
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
    /// The cache volume, when the pipeline may cache.
    pub cache: Option<CacheConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_budget: 512 << 20,
            files_per_split: 256,
            cache: None,
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
    #[error("opening the cache volume: {0}")]
    Cache(std::io::Error),
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
    pub cache: Option<Arc<EngineCache>>,
}

impl Engine {
    /// Lists the source and plans its splits. Must be called inside a tokio runtime.
    pub async fn open(pipeline: WorkerPipeline, config: EngineConfig) -> Result<Engine, EngineError> {
        let source = DataSource::open(&pipeline.source.uri)?;
        let shards = source.list().await?;
        let (splits, labels) = plan(&source, pipeline.source.format, shards.clone(), config.files_per_split);
        if splits.is_empty() {
            return Err(SourceError::NotFound { uri: pipeline.source.uri.clone() }.into());
        }
        let cache = match &config.cache {
            Some(c) => {
                let cache =
                    Arc::new(EngineCache::new(c, &pipeline, &shards, splits.len() as u64).map_err(EngineError::Cache)?);
                let probing = cache.clone();
                tokio::task::spawn_blocking(move || probing.probe());
                Some(cache)
            }
            None => None,
        };
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
            cache,
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
    pub fn run_epoch(
        &self,
        epoch: u64,
        splits: &[Split],
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<(), EngineError> {
        self.run_splits(epoch, splits.iter().cloned().map(|s| (s, SplitCache::Compute)), out).map(drop)
    }

    /// Like `run_epoch`, pulling splits one at a time (from the dispatcher) until `splits` ends,
    /// each with what it does with the cache. Each ready batch names the splits it completes
    /// (`Ready::completes`); the splits that completed with no batch left to carry them are
    /// returned.
    pub fn run_splits(
        &self,
        epoch: u64,
        splits: impl IntoIterator<Item = (Split, SplitCache)>,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<Vec<u64>, EngineError> {
        let p = &self.pipeline;
        let seed = p.seed.unwrap_or(0);
        let mut shuffle =
            p.shuffle.as_ref().map(|s| ShuffleBuffer::new(s.buffer_size as usize, s.seed.unwrap_or(seed), epoch));
        let mut batch = Pending::new(p.batch_size as usize, self.budget.reserve_rows(0));
        let mut sequence = 0u64;
        let mut last_split = 0;
        let window = (self.config.threads * 64).max(64);
        let mut row_estimate = 0;
        let mut splits = splits.into_iter();
        // Reading the next split overlaps transforming this one, and transforming a chunk (on
        // the pool, from a scoped thread) overlaps batching the one before it here.
        let mut fetch_next = || {
            splits.next().map(|(s, c)| {
                let c = self.usable(c);
                (self.fetch(&s, &c), s, c)
            })
        };
        let mut next = fetch_next();
        let mut deferred: Option<Chunk> = None;
        let stopped = std::thread::scope(|scope| -> Result<bool, EngineError> {
            while let Some((fetching, split, cache)) = next.take() {
                let fetched = self.runtime.block_on(fetching).expect("the fetch task runs to completion");
                next = fetch_next();
                last_split = split.id;
                let (records, mut plan) = self.elements(&split, &cache, fetched)?;
                let mut writing = self.writer(&split, &plan);
                if writing.is_none() {
                    plan.put = None;
                }
                let plan = Arc::new(plan);
                let mut measured: Vec<(u32, u64, u64)> = Vec::new();
                let mut records = records.into_iter();
                loop {
                    let chunk: Vec<(u64, Element)> = records.by_ref().take(window).collect();
                    if chunk.is_empty() {
                        break;
                    }
                    // The chunk's output is held from before it exists until it is sent:
                    // reserve what the last chunk's rows weighed, wait while batches in flight
                    // leave no room, then correct to the actual size.
                    let mut reserved = self.budget.reserve_rows(row_estimate * chunk.len());
                    let id = split.id;
                    let chunk_plan = plan.clone();
                    let transforming = scope.spawn(move || self.transform(epoch, id, chunk, &chunk_plan));
                    if let Some(done) = deferred.take()
                        && !self.take_chunk(done, &mut shuffle, &mut batch, epoch, &mut sequence, out)?
                    {
                        return Ok(true);
                    }
                    let (rows, at_hints) = transforming.join().expect("the transform thread does not panic")?;
                    at_hints.record(&mut writing, &mut measured);
                    let bytes: usize = rows.iter().map(row_bytes).sum();
                    if !rows.is_empty() {
                        row_estimate = bytes / rows.len();
                    }
                    reserved.resize(bytes);
                    batch.held.merge(reserved);
                    deferred = Some(Chunk { split: split.id, rows, completes_split: false });
                }
                self.split_done(&plan, writing, &measured);
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
                if batch.len() == p.batch_size as usize
                    && !self.emit(&mut batch, epoch, last_split, &mut sequence, out)?
                {
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

    /// Starts reading a split on the runtime: its shards, many at once (image folders are
    /// many small files), or its chunk file in the cache.
    fn fetch(&self, split: &Split, cache: &SplitCache) -> tokio::task::JoinHandle<Fetched> {
        if let (SplitCache::Get { fingerprint, .. }, Some(engine_cache)) = (cache, &self.cache) {
            let entry = engine_cache.entry(fingerprint);
            engine_cache.lease(&entry, LeaseKind::Reader);
            let id = split.id;
            return self.runtime.spawn_blocking(move || Fetched::Cached(entry.read_split(id)));
        }
        let source = self.source.clone();
        let shards = split.shards.clone();
        let reads = shards.into_iter().map(move |shard| {
            let source = source.clone();
            async move { source.read(&shard).await }
        });
        self.runtime.spawn(async move { Fetched::Source(futures::stream::iter(reads).buffered(32).collect().await) })
    }

    /// What a split may do with the cache here: nothing without a volume, and no read from
    /// an entry that is not (or no longer) complete.
    fn usable(&self, cache: SplitCache) -> SplitCache {
        let Some(engine_cache) = &self.cache else { return SplitCache::Compute };
        match &cache {
            SplitCache::Get { fingerprint, .. } => {
                let fits = engine_cache
                    .entry(fingerprint)
                    .manifest()
                    .ok()
                    .flatten()
                    .is_some_and(|m| m.splits == self.splits.len() as u64);
                if fits { cache } else { SplitCache::Compute }
            }
            _ => cache,
        }
    }

    /// A split's elements with their positions in the split, and how to run them: from the
    /// source, or from the cache after the hint. A corrupt chunk falls back to the source.
    fn elements(
        &self,
        split: &Split,
        cache: &SplitCache,
        fetched: Fetched,
    ) -> Result<(Vec<(u64, Element)>, SplitPlan), EngineError> {
        let data = match (fetched, cache, &self.cache) {
            (Fetched::Cached(read), SplitCache::Get { at, fingerprint }, Some(engine_cache)) => {
                // A file that cannot be read (an entry evicted since it was checked) is not a
                // corrupt one: only a bad record drops the entry.
                let records = read.map_err(|e| tracing::warn!(split = split.id, error = %e, "reading the cache failed; computing the split")).and_then(|bytes| {
                    chunk::read_records(bytes)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| engine_cache.corrupt(fingerprint, format!("split {}: {e}", split.id)))
                });
                match records {
                    Ok(records) => {
                        engine_cache.read(records.len() as u64);
                        let plan = SplitPlan { from: *at as usize + 1, ..SplitPlan::default() };
                        return Ok((records, plan));
                    }
                    Err(()) => match self
                        .runtime
                        .block_on(self.fetch(split, &SplitCache::Compute))
                        .expect("the fetch task runs to completion")
                    {
                        Fetched::Source(data) => data,
                        Fetched::Cached(_) => unreachable!("a compute fetch reads the source"),
                    },
                }
            }
            (Fetched::Source(data), _, _) => data,
            (Fetched::Cached(_), _, _) => unreachable!("only a Get with a cache reads the cache"),
        };
        let elements = self.parse(split, data)?.into_iter().enumerate().map(|(i, e)| (i as u64, e)).collect();
        let measure = self.cache.as_ref().map(|c| c.hints.iter().map(|(at, _)| *at).collect()).unwrap_or_default();
        let put = match cache {
            SplitCache::Put { at, fingerprint } => Some((*at, fingerprint.clone())),
            _ => None,
        };
        Ok((elements, SplitPlan { from: 0, measure, put }))
    }

    /// A writer for the split's chunk file when it is to be put and is not in the entry yet.
    fn writer(&self, split: &Split, plan: &SplitPlan) -> Option<(SplitWriter, u64)> {
        let (engine_cache, (_, fingerprint)) = (self.cache.as_ref()?, plan.put.as_ref()?);
        let entry = engine_cache.entry(fingerprint);
        if entry.has_split(split.id) || entry.is_complete() {
            return None;
        }
        engine_cache.lease(&entry, LeaseKind::Writer);
        match entry.write_split(split.id, engine_cache.holder()) {
            Ok(w) => Some((w, 0)),
            Err(e) => {
                tracing::warn!(split = split.id, error = %e, "cannot write to the cache; computing without it");
                None
            }
        }
    }

    /// A split went through: its chunk file goes in place, and its measurements are counted.
    fn split_done(&self, plan: &SplitPlan, writing: Option<(SplitWriter, u64)>, measured: &[(u32, u64, u64)]) {
        let Some(engine_cache) = &self.cache else { return };
        if let (Some((writer, _)), Some((at, fingerprint))) = (writing, &plan.put) {
            match writer.finish() {
                Ok(_) => engine_cache.written(fingerprint, *at),
                Err(e) => tracing::warn!(error = %e, "writing a cache chunk failed"),
            }
        }
        if plan.from == 0 && !plan.measure.is_empty() {
            engine_cache.measured(measured);
        }
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
                SourceFormat::ImageFolder => {
                    Box::new(image_folder::element(name, bytes, &self.labels).map(Ok).into_iter())
                }
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

    /// Runs the transforms of `plan` on a chunk on every pool thread, keeping the chunk's
    /// order; what passed the autocache hints is measured and, for a put, encoded.
    fn transform(
        &self,
        epoch: u64,
        split: u64,
        chunk: Vec<(u64, Element)>,
        plan: &SplitPlan,
    ) -> Result<(Vec<Row>, AtHints), EngineError> {
        let p = &self.pipeline;
        let seed = p.seed.unwrap_or(0);
        let results: Vec<(u64, Transformed, Vec<Duration>, AtHints)> = self.pool.install(|| {
            chunk
                .into_par_iter()
                .map(|(position, element)| {
                    // Element ids are stable per (split, position) whatever thread runs them,
                    // and whether the prefix ran now or before the element was cached.
                    let key = ElementKey { seed, epoch, element: (split << 32) | position };
                    let mut timings = vec![Duration::ZERO; p.transforms.len()];
                    let mut at_hints = AtHints::default();
                    let result = run_plan(&p.transforms, plan, position, element, key, &mut timings, &mut at_hints);
                    (position, result, timings, at_hints)
                })
                .collect()
        });
        let mut rows = Vec::with_capacity(results.len());
        let mut op_time = vec![Duration::ZERO; p.transforms.len()];
        let mut all_hints = AtHints::default();
        for (position, result, timings, at_hints) in results {
            for (total, t) in op_time.iter_mut().zip(timings) {
                *total += t;
            }
            all_hints.merge(at_hints);
            match result {
                Ok(Some(element)) => {
                    self.stats.elements.fetch_add(1, Ordering::Relaxed);
                    rows.push(self.to_row(element)?);
                }
                Ok(None) => {
                    self.stats.filtered.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) if p.on_error == OnError::Skip => {
                    tracing::warn!(split, element = position, %error, "skipping an element");
                    self.stats.skip(error.reason());
                }
                Err(source) => return Err(EngineError::Element { split, element: position, source }),
            }
        }
        for (total, t) in self.stats.op_time.lock().unwrap().iter_mut().zip(op_time) {
            *total += t;
        }
        Ok((rows, all_hints))
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
        let last = chunk.rows.len();
        for (i, row) in chunk.rows.into_iter().enumerate() {
            batch.track.entered(chunk.split);
            // Read to the end before its last row can fill a batch, so that batch carries the
            // split's completion: a completion without a carrier is reported by the worker
            // itself, possibly before that batch reaches the client.
            if chunk.completes_split && i + 1 == last {
                batch.track.parsed(chunk.split);
            }
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
        if chunk.completes_split && last == 0 {
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

/// A split's read, before its records are parsed.
enum Fetched {
    Source(Vec<Result<bytes::Bytes, SourceError>>),
    Cached(std::io::Result<bytes::Bytes>),
}

type Transformed = Result<Option<Element>, ElementError>;

/// How a split's elements run: the transforms from `from` on, measuring the elements at the
/// hints in `measure` and writing those at `put`'s hint to its entry.
#[derive(Default)]
struct SplitPlan {
    from: usize,
    measure: Vec<u32>,
    put: Option<(u32, String)>,
}

/// What passed the autocache hints in a chunk: (hint, elements, bytes) and, for a put, the
/// encoded records in chunk order.
#[derive(Default)]
struct AtHints {
    sizes: Vec<(u32, u64, u64)>,
    records: Vec<u8>,
    count: u64,
}

impl AtHints {
    fn add_size(&mut self, at: u32, bytes: u64) {
        match self.sizes.iter_mut().find(|s| s.0 == at) {
            Some(s) => (s.1, s.2) = (s.1 + 1, s.2 + bytes),
            None => self.sizes.push((at, 1, bytes)),
        }
    }

    fn merge(&mut self, other: AtHints) {
        for (at, elements, bytes) in other.sizes {
            match self.sizes.iter_mut().find(|s| s.0 == at) {
                Some(s) => (s.1, s.2) = (s.1 + elements, s.2 + bytes),
                None => self.sizes.push((at, elements, bytes)),
            }
        }
        self.records.extend_from_slice(&other.records);
        self.count += other.count;
    }

    /// Appends the records to the split's chunk file (a failed write abandons the file) and
    /// the sizes to the split's measurements.
    fn record(self, writing: &mut Option<(SplitWriter, u64)>, measured: &mut Vec<(u32, u64, u64)>) {
        if let Some((writer, count)) = writing.as_mut() {
            *count += self.count;
            writer.records(self.count);
            if let Err(e) = writer.append(&self.records) {
                tracing::warn!(error = %e, "writing a cache chunk failed; the split stays uncached");
                *writing = None;
            }
        }
        let mut all = AtHints { sizes: std::mem::take(measured), ..AtHints::default() };
        all.merge(AtHints { sizes: self.sizes, ..AtHints::default() });
        *measured = all.sizes;
    }
}

/// Runs one element through `plan`: the segments between the hints, measuring (and for a put,
/// encoding) the element at each.
fn run_plan(
    transforms: &[stoker_api::Transform],
    plan: &SplitPlan,
    position: u64,
    mut element: Element,
    key: ElementKey,
    timings: &mut [Duration],
    at_hints: &mut AtHints,
) -> Transformed {
    let mut from = plan.from;
    for &at in plan.measure.iter().filter(|&&at| at as usize >= plan.from) {
        let to = at as usize + 1;
        element = match apply::apply_range(transforms, from..to, element, key, timings)? {
            Some(e) => e,
            None => return Ok(None),
        };
        from = to;
        at_hints.add_size(at, chunk::encoded_len(&element) as u64);
        if plan.put.as_ref().is_some_and(|(put, _)| *put == at) {
            chunk::encode_record(position, &element, &mut at_hints.records);
            at_hints.count += 1;
        }
    }
    apply::apply_range(transforms, from..transforms.len(), element, key, timings)
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
fn plan(
    source: &DataSource,
    format: SourceFormat,
    shards: Vec<Shard>,
    files_per_split: usize,
) -> (Vec<Split>, BTreeMap<String, i64>) {
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
