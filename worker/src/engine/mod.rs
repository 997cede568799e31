//! The pipeline engine: plans splits from the source's listing, reads them, runs the
//! transforms on all cores, shuffles and batches, and hands ready batches to the stream under
//! a memory budget. The stages, in the order data flows through them: `plan` (with `mix`), `read`,
//! `transform` (with `stages`, and `hints`, the autocache hints), `batcher` (with `stack`, a batch's tensors).
//!
//! Order: within a split, elements keep their record order through the parallel transform
//! stage (results are collected in order), so with no shuffle the output is deterministic.

mod batcher;
mod hints;
mod mix;
mod pack;
mod plan;
mod read;
mod shared;
mod stack;
mod stages;
mod transform;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoker_api::{Batch, MAX_ECHO_SPLIT_ELEMENTS, SourceFormat, Stacked, WorkerPipeline, echo_position};

use crate::apply::ElementError;
use crate::budget::{MemoryBudget, Rows, Unsent};
use crate::cached::{CacheConfig, EngineCache, SplitCache};
use crate::formats::Corrupt;
use crate::loaded::Loaded;
use crate::op_tally::OpTally;
use crate::source::{DataSource, SourceError};
use batcher::Batcher;
pub use mix::Mix;
pub use plan::Split;
use read::Prefetch;
use shared::{Claim, Taken};
pub use shared::{Shared, SharedSplits, TAKE_PATIENCE};
pub use stack::{BatchError, Shaping};

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

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("corrupt record (onError: fail): {0}")]
    Corrupt(Corrupt),
    #[error(transparent)]
    Parquet(#[from] crate::formats::parquet::ParquetReadError),
    // The inner errors are part of the message, not `source`s: a `{:#}` chain would say them
    // twice.
    #[error("element {element} of split {split} (onError: fail): {error}")]
    Element { split: u64, element: u64, error: ElementError },
    #[error("split {split} (the ops run column at a time): {error}")]
    Table { split: u64, error: crate::table::apply::TableError },
    #[error("split {split}: {message}")]
    Columns { split: u64, message: String },
    #[error("batching: {0}")]
    Batch(BatchError),
    #[error("building the transform pool: {0}")]
    Pool(String),
    #[error("opening the cache volume: {0}")]
    Cache(std::io::Error),
    #[error("{0}")]
    Load(String),
    #[error("{0}")]
    Pack(String),
    #[error(
        "split {split} holds {elements} elements; a pipeline with `echo` takes at most \
         {MAX_ECHO_SPLIT_ELEMENTS} per split (a row's position holds the copy above them): use smaller shards"
    )]
    EchoSplit { split: u64, elements: usize },
}

impl From<BatchError> for EngineError {
    fn from(e: BatchError) -> Self {
        EngineError::Batch(e)
    }
}

/// Counters of everything the engine did, for logs, metrics and heartbeats.
#[derive(Default, Debug)]
pub struct Stats {
    pub records: AtomicU64,
    pub elements: AtomicU64,
    pub filtered: AtomicU64,
    /// Elements left out of a split produced again because an earlier attempt delivered them
    /// or they were taken from a shared production's copy.
    pub redelivery_skipped: AtomicU64,
    /// Rows `echo` made beyond each element's first (copies left out as delivered included).
    pub echoed: AtomicU64,
    pub batches: AtomicU64,
    pub batch_bytes: AtomicU64,
    /// Skipped records and elements by reason.
    pub skipped: Mutex<BTreeMap<&'static str, u64>>,
    /// Time and elements per transform index, summed over threads.
    pub ops: Mutex<Vec<OpTally>>,
    /// Set once the memory budget has capped the shuffle buffer below `shuffle.bufferSize`.
    pub shuffle_cap: Mutex<Option<ShuffleCap>>,
    /// The most bytes the shuffle buffer held (as `batcher::row_cost` counts them).
    pub shuffle_peak_bytes: AtomicU64,
    /// Elements `python` ops failed on, by op index.
    pub python_failures: Mutex<BTreeMap<usize, PythonFailures>>,
    /// Rows batched from each source of the mix (elements, or packed rows after `pack`).
    pub source_rows: Mutex<Vec<u64>>,
    /// What a row weighed in the last chunk with rows, in any run: a new run reserves its
    /// first chunk's rows at it (`Batcher::chunk_len`).
    pub row_bytes: AtomicU64,
    /// Elements and their encoded bytes after each op, while `Engine::measure_op_sizes` is on.
    pub op_bytes: Mutex<Vec<stoker_api::proto::HintBytes>>,
}

/// What one `python` op failed on: counts by reason and the last failure's message.
#[derive(Default, Debug, Clone)]
pub struct PythonFailures {
    pub by_reason: BTreeMap<&'static str, u64>,
    pub last: String,
}

/// The shuffle buffer stopped growing at `elements`, holding `bytes`, its share of the memory
/// budget, though `shuffle.bufferSize` asked for `requested`. Later epochs of the engine keep
/// the cap, so the shuffle stays the same for a given seed and cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShuffleCap {
    pub elements: usize,
    pub bytes: usize,
    pub requested: usize,
}

impl std::fmt::Display for ShuffleCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "shuffle buffer capped at {} elements ({} bytes) by the memory budget; shuffle.bufferSize asks for {}",
            self.elements, self.bytes, self.requested
        )
    }
}

impl Stats {
    /// What this engine changed of the spec to stay within its bounds, for the status.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings: Vec<String> = self.shuffle_cap.lock().unwrap().iter().map(ToString::to_string).collect();
        for (index, f) in self.python_failures.lock().unwrap().iter() {
            let total: u64 = f.by_reason.values().sum();
            let reasons: Vec<String> = f.by_reason.iter().map(|(r, n)| format!("{n} {r}")).collect();
            warnings.push(format!(
                "transforms[{index}].python failed on {total} elements ({}); last: {}",
                reasons.join(", "),
                f.last
            ));
        }
        warnings
    }

    fn python_failed(&self, error: &ElementError) {
        if let ElementError::Python { index, failure, .. } = error {
            let mut failures = self.python_failures.lock().unwrap();
            let f = failures.entry(*index).or_default();
            *f.by_reason.entry(failure.reason()).or_default() += 1;
            f.last = error.to_string();
        }
    }

    /// Op `index` took `elements_in` and passed on `elements_out` outside the per-element
    /// tallies (`echo` and `pack` work on a chunk's or a split's rows).
    fn count_op(&self, index: usize, elements_in: u64, elements_out: u64) {
        self.count_op_time(index, Duration::ZERO, elements_in, elements_out);
    }

    fn count_op_time(&self, index: usize, time: Duration, elements_in: u64, elements_out: u64) {
        let mut ops = self.ops.lock().unwrap();
        if let Some(op) = ops.get_mut(index) {
            op.time += time;
            op.elements_in += elements_in;
            op.elements_out += elements_out;
        }
    }

    fn produced(&self, source: usize, rows: usize) {
        self.source_rows.lock().unwrap()[source] += rows as u64;
    }

    fn skip(&self, reason: &'static str) {
        self.skip_many(reason, 1);
    }

    fn skip_many(&self, reason: &'static str, count: u64) {
        *self.skipped.lock().unwrap().entry(reason).or_default() += count;
    }

    pub fn skipped(&self) -> BTreeMap<&'static str, u64> {
        self.skipped.lock().unwrap().clone()
    }
}

/// A split to produce, as the dispatcher (or a standalone worker's own plan) assigned it.
#[derive(Clone, Debug)]
pub struct Assigned {
    pub split: Split,
    /// What it does with the cache.
    pub cache: SplitCache,
    /// Positions already delivered by an earlier attempt (whose worker died), sorted: every
    /// other element is produced, not these.
    pub skip: Vec<u32>,
    /// With `echo`: the split's factor as the dispatcher set it; None: the pipeline's own
    /// (`Echo::initial`).
    pub echo: Option<u32>,
    /// A job of a share group: the production of the split it is part of. The first of its
    /// takers here makes the split, the others take its rows (see `shared`).
    pub shared: Option<Shared>,
}

impl Assigned {
    /// The whole split, computed from the source.
    pub fn whole(split: Split) -> Assigned {
        Assigned { split, cache: SplitCache::Compute, skip: Vec::new(), echo: None, shared: None }
    }
}

/// A ready batch. Its tensors' bytes hold the batch's share of the memory budget: it is
/// released once they are dropped (after the stream has sent the last chunk), wherever the
/// batch travels meanwhile.
pub struct Ready {
    pub batch: Batch<Stacked>,
    /// Splits (of the batch's epoch) whose last element is in this batch or was dropped.
    pub completes: Vec<u64>,
    /// Until a stream lets the batch go, its producer's rows wait for it over the budget: keep
    /// it with the batch in every queue on the way to the stream.
    pub unsent: Unsent,
}

impl Ready {
    /// The batch as a stream takes it.
    pub fn into_outgoing(self) -> crate::stream::Outgoing {
        crate::stream::Outgoing { batch: self.batch, unsent: Some(self.unsent) }
    }
}

pub struct Engine {
    pipeline: WorkerPipeline,
    /// Each source of the mix (one when the spec names a single uri).
    sources: Vec<DataSource>,
    /// Which split of which source each slot of an epoch reads.
    mix: Mix,
    /// Each Parquet source's footers, as planning read them.
    footers: Vec<plan::Footers>,
    labels: BTreeMap<String, i64>,
    config: EngineConfig,
    pool: rayon::ThreadPool,
    /// What the pipeline's ops loaded: Python processes, tokenizers.
    loaded: Loaded,
    budget: Arc<MemoryBudget>,
    runtime: tokio::runtime::Handle,
    pub stats: Arc<Stats>,
    pub cache: Option<Arc<EngineCache>>,
    /// Splits made here for several jobs of a share group.
    pub shared: Arc<SharedSplits>,
    /// Splits read from now on measure their elements after every op (`stoker-worker
    /// profile`): the ops then run one at a time, unfused.
    measure_ops: std::sync::atomic::AtomicBool,
}

impl Engine {
    /// Lists the sources and plans their splits. Must be called inside a tokio runtime.
    pub async fn open(pipeline: WorkerPipeline, config: EngineConfig) -> Result<Engine, EngineError> {
        let format = pipeline.data_plane.source.format;
        let listing_order = plan::listing_order(format, pipeline.data_plane.shuffle_seed());
        let weighted = pipeline.data_plane.source.weighted();
        let mut sources = Vec::with_capacity(weighted.len());
        let mut planned = Vec::with_capacity(weighted.len());
        let mut shards = Vec::new();
        let mut classes = std::collections::BTreeSet::new();
        let mut footers = Vec::new();
        for (index, mixed) in weighted.iter().enumerate() {
            let source = DataSource::open(&mixed.uri)?;
            let listed = source.list().await?;
            shards.extend(listed.iter().cloned());
            let (mut splits, labels) = match format {
                SourceFormat::Parquet => {
                    let (splits, source_footers) = plan::parquet(&source, listed).await?;
                    footers.push(source_footers);
                    (splits, BTreeMap::new())
                }
                _ => plan::plan(&source, format, listed, config.files_per_split, listing_order),
            };
            if splits.is_empty() {
                return Err(SourceError::NotFound { uri: mixed.uri.clone() }.into());
            }
            splits.iter_mut().for_each(|s| s.source = index);
            classes.extend(labels.into_keys());
            sources.push(source);
            planned.push((splits, mixed));
        }
        // Labels index the sorted class folders of every source, so a mix agrees on them.
        let labels: BTreeMap<String, i64> = classes.into_iter().enumerate().map(|(i, c)| (c, i as i64)).collect();
        let mix = Mix::new(planned, pipeline.data_plane.seed.unwrap_or(0));
        let cache = match &config.cache {
            Some(c) => {
                let cache = Arc::new(
                    EngineCache::new(c, &pipeline, &shards, listing_order, mix.slots()).map_err(EngineError::Cache)?,
                );
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
        let transforms = pipeline.data_plane.transforms.clone();
        let fetched = Loaded::fetch(&transforms).await.map_err(EngineError::Load)?;
        let loaded = tokio::task::spawn_blocking(move || Loaded::load(&transforms, &fetched))
            .await
            .map_err(|e| EngineError::Load(e.to_string()))?
            .map_err(EngineError::Load)?;
        let stats = Arc::new(Stats::default());
        *stats.ops.lock().unwrap() = OpTally::for_ops(pipeline.data_plane.transforms.len());
        *stats.source_rows.lock().unwrap() = vec![0; sources.len()];
        let budget = Arc::new(MemoryBudget::new(config.memory_budget));
        Ok(Engine {
            shared: SharedSplits::new(budget.clone()),
            budget,
            runtime: tokio::runtime::Handle::current(),
            pipeline,
            sources,
            mix,
            footers,
            labels,
            config,
            pool,
            loaded,
            stats,
            cache,
            measure_ops: Default::default(),
        })
    }

    /// From the next split read, whether elements are measured after every op (into
    /// `stats.op_bytes`) instead of at the autocache hints only.
    pub fn measure_op_sizes(&self, on: bool) {
        self.measure_ops.store(on, Ordering::Relaxed);
    }

    /// The pipeline's transforms with what its ops loaded, to run on elements directly.
    pub fn transforms(&self) -> crate::apply::Transforms<'_> {
        crate::apply::Transforms { list: &self.pipeline.data_plane.transforms, loaded: &self.loaded }
    }

    /// Which splits each epoch reads.
    pub fn mix(&self) -> &Mix {
        &self.mix
    }

    pub fn pipeline(&self) -> &WorkerPipeline {
        &self.pipeline
    }

    /// What was read from each source of the mix, in spec order.
    pub fn source_reads(&self) -> Vec<Arc<crate::source_reads::SourceReads>> {
        self.sources.iter().map(|s| s.reads().clone()).collect()
    }

    /// The counters of its `python` ops' process pool, if it has any.
    pub fn python_counts(&self) -> Option<Arc<crate::python::PythonCounts>> {
        self.loaded.python.as_ref().map(|p| p.counts())
    }

    /// The memory budget its rows and batches are held under.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    pub fn threads(&self) -> usize {
        self.config.threads
    }

    /// Every split of `epoch` in slot order, each doing `cache` (benchmarks and tests that
    /// play the dispatcher).
    pub fn assigned(&self, epoch: u64, cache: &SplitCache) -> Vec<Assigned> {
        self.mix.epoch(epoch).into_iter().map(|s| Assigned { cache: cache.clone(), ..Assigned::whole(s) }).collect()
    }

    /// Produces one epoch's batches into `out`, blocking (run it on its own thread): with
    /// `shuffle`, in the epoch's seeded order of the splits, as the dispatcher hands them out.
    /// Returns early, without error, when the receiver is gone.
    pub fn run_epoch(&self, epoch: u64, out: &std::sync::mpsc::SyncSender<Ready>) -> Result<(), EngineError> {
        self.run_epoch_as(&self.producer(), epoch, out)
    }

    /// Like `run_epoch`, as `producer`: its rows wait for the batches it made before too (a
    /// stream that reads the epochs in order).
    pub fn run_epoch_as(
        &self,
        producer: &Rows,
        epoch: u64,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<(), EngineError> {
        let mut splits = self.mix.epoch(epoch);
        if let Some(seed) = self.pipeline.data_plane.shuffle_seed() {
            stoker_api::order::shuffle(&mut splits, seed, epoch, |s| s.id);
        }
        self.run_splits_as(producer, epoch, splits.into_iter().map(Assigned::whole), out).map(drop)
    }

    /// A new producer in this engine's budget, for runs that follow one another
    /// (`run_epoch_as`, `run_splits_as`).
    pub fn producer(&self) -> Rows {
        self.budget.producer()
    }

    /// Like `run_epoch`, pulling splits one at a time (from the dispatcher) until `splits` ends,
    /// each with what it does with the cache. Each ready batch names the splits it completes
    /// (`Ready::completes`); the splits that completed with no batch left to carry them are
    /// returned.
    pub fn run_splits(
        &self,
        epoch: u64,
        splits: impl IntoIterator<Item = Assigned>,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<Vec<u64>, EngineError> {
        self.run_splits_as(&self.producer(), epoch, splits, out)
    }

    /// Like `run_splits`, as `producer` (`run_epoch_as`).
    pub fn run_splits_as(
        &self,
        producer: &Rows,
        epoch: u64,
        splits: impl IntoIterator<Item = Assigned>,
        out: &std::sync::mpsc::SyncSender<Ready>,
    ) -> Result<Vec<u64>, EngineError> {
        let send = |ready: Ready| self.send(ready, out);
        // An empty reservation (it never waits) of the same producer.
        let mut batcher = Batcher::new(&self.pipeline, epoch, producer.reserve_more(0), self.stats.clone(), send);
        let listening = std::thread::scope(|scope| -> Result<bool, EngineError> {
            let mut flow = transform::Flow::new(self, scope, epoch);
            for (Assigned { split, cache, skip, echo: assigned_echo, shared }, fetched) in
                Prefetch::new(self, splits.into_iter())
            {
                // A shared production is claimed once this producer can begin it at once: the
                // first to claim makes it, and the others wait for its copy. Everything it made
                // or took before lands and is batched first, which waits for its own consumer.
                // Claimed before, the maker's chunks queued behind that: a slow job's producer
                // held the production at its trainer's pace (a 1x trial waited 8-26% of its
                // run, taking copies 0.24 s late, in a 224-px sweep whose 0.4x trial made
                // them), and a producer with a copy of 18,000 rows still to send stalled a
                // columnar production's takers (made again: 3-5 of 10 in parquet_faults).
                // Landing first also lets a split this run makes for another job's producer
                // complete (packing records the rows as they land) before this one waits.
                let claim = match shared {
                    Some(shared) => {
                        if !flow.land_all(&mut batcher)? || !batcher.batch_queued()? {
                            return Ok(false);
                        }
                        Some(self.shared.claim(shared))
                    }
                    None => None,
                };
                let (fetched, maker, taken) = match (fetched, claim) {
                    (fetched, Some(Claim::Take(taker))) => {
                        match taker.take(shared::TAKE_PATIENCE, shared::STILL_FOR) {
                            Taken::All(rows) => {
                                let input = transform::SplitInput { taken: rows, elements: Vec::new(), table: None };
                                let plan = hints::SplitPlan::default();
                                if !flow.split(&split, input, plan, None, None, &mut batcher)? {
                                    return Ok(false);
                                }
                                continue;
                            }
                            // Gone, or its maker held up: the rest is made here, from the
                            // split's read.
                            Taken::Part(rows) => (fetched, None, rows),
                        }
                    }
                    (fetched, Some(Claim::Make(maker))) => (fetched, Some(maker), Vec::new()),
                    (fetched, _) => (fetched, None, Vec::new()),
                };
                // Positions taken from the copy are left out as if delivered before.
                let skip = with_taken(skip, &taken);
                if self.columnar() {
                    let table = self.table(epoch, &split, &skip, fetched)?;
                    if let Some(maker) = &maker {
                        maker.stir();
                    }
                    let input = transform::SplitInput { taken, elements: Vec::new(), table: Some(table) };
                    if !flow.split(&split, input, hints::SplitPlan::default(), None, maker, &mut batcher)? {
                        return Ok(false);
                    }
                    continue;
                }
                let (mut elements, mut plan) = self.elements(&split, &cache, fetched)?;
                let packer = self.packer();
                let echo = self.pipeline.data_plane.echo();
                if echo.is_some() && elements.len() as u64 > MAX_ECHO_SPLIT_ELEMENTS {
                    return Err(EngineError::EchoSplit { split: split.id, elements: elements.len() });
                }
                // The dispatcher's factor for the split, within what the spec allows.
                let factor = echo.map(|(_, e)| assigned_echo.unwrap_or(e.initial()).clamp(1, e.most()));
                plan.echo = factor.unwrap_or(1);
                let at_read = match (&packer, factor) {
                    // Packed rows, not elements, are what a split's positions number then.
                    (Some(_), _) => Vec::new(),
                    // Positions name copies: an element is left out here only when every copy
                    // of it was delivered, the others where the echo makes them.
                    (None, Some(factor)) => {
                        plan.delivered = skip.clone();
                        every_copy_delivered(&skip, factor)
                    }
                    (None, None) => skip.clone(),
                };
                let rows = u64::from(factor.unwrap_or(1));
                self.read_order(epoch, split.id, &at_read, rows, &mut elements);
                let packing = packer.map(|packer| transform::Packing {
                    packer,
                    next: 0,
                    skip,
                    stats: &self.stats,
                    index: self.pipeline.data_plane.transforms.len() - 1,
                });
                let input = transform::SplitInput { taken, elements, table: None };
                if !flow.split(&split, input, plan, packing, maker, &mut batcher)? {
                    return Ok(false);
                }
            }
            flow.finish(&mut batcher)
        })?;
        if !listening {
            return Ok(Vec::new());
        }
        Ok(batcher.finish()?)
    }

    /// Whether splits take the columnar path (`table`): a Parquet source whose pipeline has
    /// feature ops, all of its ops columnar. Other Parquet pipelines run element by element.
    fn columnar(&self) -> bool {
        let plane = &self.pipeline.data_plane;
        plane.source.format == SourceFormat::Parquet
            && plane.transforms.iter().any(|t| t.is_feature())
            && plane.transforms.iter().all(|t| t.is_columnar())
    }

    /// A packer when the pipeline ends with `pack`.
    fn packer(&self) -> Option<pack::Packer> {
        match self.pipeline.data_plane.transforms.last() {
            Some(stoker_api::Transform::Pack(op)) => Some(pack::Packer::new(op)),
            _ => None,
        }
    }

    /// Counts a ready batch and sends it; false when nobody listens.
    fn send(&self, ready: Ready, out: &std::sync::mpsc::SyncSender<Ready>) -> bool {
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.batch_bytes.fetch_add(ready.batch.payload_bytes() as u64, Ordering::Relaxed);
        out.send(ready).is_ok()
    }
}

/// `skip` (sorted positions) and the positions of `taken`, sorted.
fn with_taken(mut skip: Vec<u32>, taken: &[(u64, stack::Row)]) -> Vec<u32> {
    if taken.is_empty() {
        return skip;
    }
    skip.extend(taken.iter().map(|(position, _)| *position as u32));
    skip.sort_unstable();
    skip.dedup();
    skip
}

/// The elements (positions below `MAX_ECHO_SPLIT_ELEMENTS`) every one of whose `factor` copies
/// is at `delivered` (sorted copy positions), sorted.
fn every_copy_delivered(delivered: &[u32], factor: u32) -> Vec<u32> {
    let first_copies = delivered.iter().take_while(|&&p| u64::from(p) < MAX_ECHO_SPLIT_ELEMENTS);
    first_copies
        .filter(|&&p| {
            (1..factor).all(|copy| delivered.binary_search(&(echo_position(u64::from(p), copy) as u32)).is_ok())
        })
        .copied()
        .collect()
}
