//! Reading: a split's records, from the source (parsed in its format) or from its chunk file
//! in the cache, one split ahead of the one being transformed.

use std::sync::atomic::Ordering;

use futures::StreamExt;
use stoker_api::{Filter, OnError, SourceFormat, Transform, order};

use super::hints::SplitPlan;
use super::{Assigned, Engine, EngineError, Split};
use crate::cache::chunk;
use crate::cache::store::LeaseKind;
use crate::cached::SplitCache;
use crate::element::Element;
use crate::formats::parquet::{ParquetReadError, RowGroupsRead};
use crate::formats::{self, Corrupt, CorruptReason, image_folder};
use crate::source::SourceError;
use crate::table::Table;

/// A split's read, before its records are parsed.
pub(super) enum Fetched {
    Source(SourceRead),
    Cached(std::io::Result<bytes::Bytes>),
}

/// What a split read from its source: its files whole, or a Parquet file's row groups, decoded.
pub(super) enum SourceRead {
    Files(Vec<Result<bytes::Bytes, SourceError>>),
    RowGroups(Result<RowGroupsRead, ParquetReadError>),
}

/// The splits to run, each read while the one before it is transformed: yields a split with
/// what it does with the cache and its finished read.
pub(super) struct Prefetch<'e, I> {
    engine: &'e Engine,
    splits: I,
    next: Option<Started>,
}

/// A split whose read started.
type Started = (tokio::task::JoinHandle<Fetched>, Assigned);

impl<'e, I: Iterator<Item = Assigned>> Prefetch<'e, I> {
    /// Starts reading the first split.
    pub(super) fn new(engine: &'e Engine, splits: I) -> Self {
        let mut prefetch = Prefetch { engine, splits, next: None };
        prefetch.next = prefetch.start();
        prefetch
    }

    fn start(&mut self) -> Option<Started> {
        let mut assigned = self.splits.next()?;
        assigned.cache = self.engine.usable(assigned.cache);
        let fetching = self.engine.fetch(&assigned.split, &assigned.cache);
        Some((fetching, assigned))
    }
}

impl<I: Iterator<Item = Assigned>> Iterator for Prefetch<'_, I> {
    type Item = (Assigned, Fetched);

    /// The next split and its read (a shared production's taker keeps it for what the copy
    /// lacks). A shared production is claimed by the caller, when it can begin it at once.
    fn next(&mut self) -> Option<Self::Item> {
        let (fetching, assigned) = self.next.take()?;
        let fetched = self.engine.runtime.block_on(fetching).expect("the fetch task runs to completion");
        self.next = self.start();
        Some((assigned, fetched))
    }
}

impl Engine {
    /// Starts reading a split on the runtime: its shards, many at once (image folders are
    /// many small files), or its chunk file in the cache.
    fn fetch(&self, split: &Split, cache: &SplitCache) -> tokio::task::JoinHandle<Fetched> {
        if let (SplitCache::Get { fingerprint, .. }, Some(engine_cache)) = (cache, &self.cache) {
            let entry = engine_cache.entry(fingerprint);
            engine_cache.lease(&entry, LeaseKind::Reader);
            let id = split.id;
            return self.runtime.spawn_blocking(move || Fetched::Cached(entry.read_split(id)));
        }
        let source = self.sources[split.source].clone();
        if !split.row_groups.is_empty() {
            let footers = &self.footers[split.source];
            let files: Vec<_> = (split.shards.iter())
                .map(|shard| {
                    let file = source.parquet(shard).with_footer(footers.get(&shard.path).cloned());
                    file.with_decoders(self.config.threads)
                })
                .collect();
            let ranges: Vec<_> = split.row_groups.iter().map(|g| g.range.clone()).collect();
            let columns = self.pipeline.data_plane.columns_read().unwrap_or_default();
            // The ops before any other drop rows by a column's value: row groups whose
            // statistics rule every row out are not read.
            let filters: Vec<Filter> = (self.pipeline.data_plane.transforms.iter())
                .map_while(|t| match t {
                    Transform::Filter(f) => Some(f.clone()),
                    _ => None,
                })
                .collect();
            return self.runtime.spawn(async move {
                let columns = (!columns.is_empty()).then_some(columns.as_slice());
                let reads = files.iter().zip(ranges).map(|(file, range)| file.read(range, columns, &filters));
                let read = futures::future::try_join_all(reads).await.map(|reads| RowGroupsRead {
                    skipped_rows: reads.iter().map(|r| r.skipped_rows).sum(),
                    batches: reads.into_iter().flat_map(|r| r.batches).collect(),
                });
                Fetched::Source(SourceRead::RowGroups(read))
            });
        }
        let shards = split.shards.clone();
        let reads = shards.into_iter().map(move |shard| {
            let source = source.clone();
            async move { source.read(&shard).await }
        });
        self.runtime.spawn(async move {
            Fetched::Source(SourceRead::Files(futures::stream::iter(reads).buffered(32).collect().await))
        })
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
                    .is_some_and(|m| m.splits == self.mix.slots());
                if fits { cache } else { SplitCache::Compute }
            }
            _ => cache,
        }
    }

    /// A split's elements with their positions in the split, and how to run them: from the
    /// source, or from the cache after the hint. A corrupt chunk falls back to the source.
    pub(super) fn elements(
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
        let measure = if self.measure_ops.load(Ordering::Relaxed) {
            (0..self.pipeline.data_plane.transforms.len() as u32).collect()
        } else {
            self.cache.as_ref().map(|c| c.hints.iter().map(|(at, _)| *at).collect()).unwrap_or_default()
        };
        let put = match cache {
            SplitCache::Put { at, fingerprint } => Some((*at, fingerprint.clone())),
            _ => None,
        };
        Ok((elements, SplitPlan { from: 0, measure, put, ..SplitPlan::default() }))
    }

    /// With `shuffle`, a split's elements are taken in an order of their own each epoch, before
    /// the shuffle buffer mixes them with other splits'. Ordered by their positions in the
    /// split, so a split read back from the cache (where a filter may have dropped some) comes
    /// out in the order computing it gives.
    ///
    /// Elements at `skip` (sorted positions already delivered by an earlier attempt at the
    /// split) are left out first, before any transform spends time on them.
    /// Each element left out counts `rows` rows (its echo copies).
    pub(super) fn read_order<T>(&self, epoch: u64, split: u64, skip: &[u32], rows: u64, elements: &mut Vec<(u64, T)>) {
        if !skip.is_empty() {
            let before = elements.len();
            elements.retain(|(position, _)| skip.binary_search(&(*position as u32)).is_err());
            self.stats.redelivery_skipped.fetch_add((before - elements.len()) as u64 * rows, Ordering::Relaxed);
        }
        if let Some(seed) = self.pipeline.data_plane.shuffle_seed() {
            order::shuffle(elements, seed, epoch, |(position, _)| (split << 32) | position);
        }
    }

    /// A split's elements as read, before any transform (`stoker-worker profile`'s what-ifs).
    /// Blocks: call it off the runtime's threads.
    pub fn read_split(&self, split: &Split) -> Result<Vec<Element>, EngineError> {
        match self.runtime.block_on(self.fetch(split, &SplitCache::Compute)).expect("the fetch task runs to completion")
        {
            Fetched::Source(data) => self.parse(split, data),
            Fetched::Cached(_) => unreachable!("a compute fetch reads the source"),
        }
    }

    /// Parses a split's records; corrupt ones are counted and skipped, or fatal.
    fn parse(&self, split: &Split, read: SourceRead) -> Result<Vec<Element>, EngineError> {
        let data = match read {
            SourceRead::Files(data) => data,
            SourceRead::RowGroups(read) => return self.rows(split, read),
        };
        let source = &self.sources[split.source];
        let mut elements = Vec::new();
        for (shard, bytes) in split.shards.iter().zip(data) {
            let bytes = bytes?;
            let name = source.relative(shard);
            let parsed: Box<dyn Iterator<Item = Result<Element, Corrupt>>> =
                match self.pipeline.data_plane.source.format {
                    // Planning kept only labelled images, so every shard here makes an element.
                    SourceFormat::ImageFolder => {
                        Box::new(image_folder::element(name, bytes, &self.labels).map(Ok).into_iter())
                    }
                    SourceFormat::Tfrecord => Box::new(formats::tfrecord::read(bytes, name)),
                    SourceFormat::Jsonl => Box::new(formats::jsonl::read(bytes, name)),
                    SourceFormat::Webdataset => Box::new(formats::tar::read(bytes, name)),
                    SourceFormat::Parquet => unreachable!("a Parquet split reads row groups"),
                };
            for record in parsed {
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                match record {
                    Ok(element) => elements.push(element),
                    Err(corrupt) if self.pipeline.data_plane.on_error == OnError::Skip => {
                        tracing::warn!(shard = %corrupt.shard, offset = corrupt.offset, reason = %corrupt.reason, detail = %corrupt.detail, "skipping a corrupt record");
                        self.stats.skip(corrupt.reason.as_str());
                    }
                    Err(corrupt) => return Err(EngineError::Corrupt(corrupt)),
                }
            }
        }
        Ok(elements)
    }

    /// A Parquet split's rows as elements.
    fn rows(&self, split: &Split, read: Result<RowGroupsRead, ParquetReadError>) -> Result<Vec<Element>, EngineError> {
        self.row_groups(
            split,
            read,
            |batches| Ok(batches.iter().flat_map(formats::parquet::elements).collect()),
            Vec::len,
        )
    }

    /// A Parquet split's rows as a table, in the order the split is read (`read_order`): the
    /// columnar path's `elements`.
    pub(super) fn table(
        &self,
        epoch: u64,
        split: &Split,
        skip: &[u32],
        fetched: Fetched,
    ) -> Result<Table, EngineError> {
        let Fetched::Source(SourceRead::RowGroups(read)) = fetched else {
            unreachable!("a columnar split reads row groups from its source (no autocache hint)")
        };
        let table = self.row_groups(
            split,
            read,
            |batches| {
                Table::from_batches(&batches).map_err(|message| EngineError::Columns { split: split.id, message })
            },
            Table::len,
        )?;
        let mut order: Vec<(u64, u32)> = table.positions.iter().enumerate().map(|(i, p)| (*p, i as u32)).collect();
        self.read_order(epoch, split.id, skip, 1, &mut order);
        let indices: Vec<u32> = order.into_iter().map(|(_, i)| i).collect();
        let unchanged = indices.len() == table.len() && indices.iter().enumerate().all(|(i, j)| i as u32 == *j);
        Ok(if unchanged { table } else { table.take(&indices) })
    }

    /// A Parquet split's rows, made by `make` of its record batches (`rows` of them). A file
    /// that cannot be decoded (a corrupt page, a file that is not Parquet) is a corrupt record
    /// of the split, skipped whole or fatal per `onError`; a column the spec names that the
    /// file lacks, or cannot be read, is fatal either way.
    fn row_groups<T: Default>(
        &self,
        split: &Split,
        read: Result<RowGroupsRead, ParquetReadError>,
        make: impl FnOnce(Vec<arrow_array::RecordBatch>) -> Result<T, EngineError>,
        rows: impl Fn(&T) -> usize,
    ) -> Result<T, EngineError> {
        match read {
            Ok(RowGroupsRead { batches, skipped_rows }) => {
                let made = make(batches)?;
                self.stats.records.fetch_add(rows(&made) as u64 + skipped_rows, Ordering::Relaxed);
                // Counted as the filter would have counted them.
                self.stats.filtered.fetch_add(skipped_rows, Ordering::Relaxed);
                Ok(made)
            }
            Err(ParquetReadError::Parquet { file, source }) => {
                let corrupt =
                    Corrupt::new(&file, 0, CorruptReason::BadParquet, format!("split {}: {source}", split.id));
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                if self.pipeline.data_plane.on_error == OnError::Skip {
                    tracing::warn!(shard = %corrupt.shard, split = split.id, detail = %corrupt.detail, "skipping a Parquet split that cannot be decoded");
                    self.stats.skip(corrupt.reason.as_str());
                    Ok(T::default())
                } else {
                    Err(EngineError::Corrupt(corrupt))
                }
            }
            Err(e) => Err(e.into()),
        }
    }
}
