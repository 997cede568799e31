//! Transforming: the elements of the splits, in the order they are read, in chunks on the
//! rayon pool, each chunk's results in the chunk's order, turned into rows for the batcher.
//! Two chunks are in flight: the next is handed to the pool before the one before it is
//! collected, across split boundaries too, so no core waits for a chunk's last element or for
//! the next split to start: on a 1000-image folder (splits of 16 files) the cores idled a
//! tenth of the time with one chunk in flight, a twentieth with two.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use stoker_api::OnError;
use stoker_api::proto::HintBytes;

use super::batcher::Batcher;
use super::hints::{AtHints, SplitAtHints, SplitPlan};
use super::pack::{self, Packer};
use super::shared::Maker;
use super::stack::Row;
use super::stages::InFlight;
use super::{Engine, EngineError, Ready, Split};
use crate::apply;
use crate::budget::Rows;
use crate::element::Element;
use crate::op_tally::OpTally;
use crate::table::{self, Table};

type Transformed = Result<(Vec<(u64, Row)>, AtHints), EngineError>;

/// The chunks on the pool and the splits they belong to, landed into the batcher in order.
pub(super) struct Flow<'scope, 'env> {
    engine: &'env Engine,
    scope: &'scope Scope<'scope, 'env>,
    epoch: u64,
    /// What is still to land, oldest first: chunks being transformed and split ends.
    steps: VecDeque<Step<'scope>>,
    /// The splits with steps still to land, oldest first.
    open: VecDeque<Open<'env>>,
}

/// The maker of the split opened last, if it records its chunks where they are transformed
/// (unless packing makes the rows at landing).
fn recording<'a>(open: &'a VecDeque<Open<'_>>) -> Option<&'a Maker> {
    open.back().and_then(|o| o.maker.as_ref().filter(|_| o.packing.is_none()))
}

/// What a split is made of here.
pub(super) struct SplitInput {
    /// Rows of it another job's producer of a share group made (see `shared`).
    pub(super) taken: Vec<(u64, Row)>,
    /// Its elements to transform.
    pub(super) elements: Vec<(u64, Element)>,
    /// Or, on the columnar path, its rows to transform as a table.
    pub(super) table: Option<Table>,
}

/// Rows of a table per chunk on the columnar path: its ops cost tens of nanoseconds a row, so
/// a chunk is large enough to amortise handing it to the pool, and cut in one piece per
/// thread there.
const TABLE_CHUNK_ROWS: usize = 16_384;

/// Rows a piece of a table chunk has at least: below it, a thread's share costs less than
/// handing it over.
const TABLE_PIECE_ROWS: usize = 1024;

enum Step<'scope> {
    Chunk {
        transforming: ScopedJoinHandle<'scope, Transformed>,
        reserved: Rows,
    },
    /// Rows made by another job's producer of a share group (see `shared`).
    Taken {
        rows: Vec<(u64, Row)>,
        reserved: Rows,
    },
    End,
}

/// A split whose chunks are not all landed yet.
struct Open<'env> {
    split: u64,
    source: usize,
    plan: Arc<SplitPlan>,
    at_hints: SplitAtHints,
    packing: Option<Packing<'env>>,
    /// Making a shared production: what lands is kept for its other takers too.
    maker: Option<Maker>,
}

impl<'scope, 'env> Flow<'scope, 'env> {
    pub(super) fn new(engine: &'env Engine, scope: &'scope Scope<'scope, 'env>, epoch: u64) -> Self {
        Flow { engine, scope, epoch, steps: VecDeque::new(), open: VecDeque::new() }
    }

    /// Batches the rows of `input` taken from a copy as they are, then hands its elements to
    /// the pool chunk by chunk under `plan`, landing what came before each chunk meanwhile.
    /// False when nobody listens.
    pub(super) fn split(
        &mut self,
        split: &Split,
        SplitInput { taken, elements, table }: SplitInput,
        mut plan: SplitPlan,
        packing: Option<Packing<'env>>,
        maker: Option<Maker>,
        batcher: &mut Batcher<impl FnMut(Ready) -> bool>,
    ) -> Result<bool, EngineError> {
        let engine = self.engine;
        // Elements per chunk; with `echo`, fewer, so a chunk's rows stay as many.
        let factor = engine.pipeline.data_plane.echo().map_or(1, |(_, e)| e.most().max(1) as usize);
        let window = ((engine.config.threads * 64).max(64) / factor).max(1);
        let at_hints = engine.start_hints(split.id, &mut plan);
        let plan = Arc::new(plan);
        self.open.push_back(Open {
            split: split.id,
            source: split.source,
            plan: plan.clone(),
            at_hints,
            packing,
            maker,
        });
        if !taken.is_empty() {
            if !batcher.batch_queued()? {
                return Ok(false);
            }
            let bytes: usize = taken.iter().map(|(_, row)| row.cost()).sum();
            let reserved = batcher.reserve(bytes);
            self.steps.push_back(Step::Taken { rows: taken, reserved });
        }
        if let Some(table) = table {
            return self.table_chunks(split.id, table, batcher);
        }
        let mut elements = elements.into_iter();
        // A production's chunks are kept for its takers where they are transformed, unless
        // packing makes the rows at landing.
        let mut chunks = 0;
        loop {
            let chunk: Vec<(u64, Element)> = elements.by_ref().take(batcher.chunk_len(window, factor)).collect();
            if chunk.is_empty() {
                if let Some(maker) = recording(&self.open) {
                    maker.chunks(chunks);
                }
                self.steps.push_back(Step::End);
                return Ok(true);
            }
            // Batching the chunk landed last first: the reservation below then waits while
            // its batches, in flight, leave no room.
            if !batcher.batch_queued()? {
                return Ok(false);
            }
            // The chunk's output is held from before it exists until it is sent: reserve
            // what the last chunk's rows weighed, wait while batches in flight leave no
            // room, then correct to the actual size.
            let reserved = batcher.reserve(batcher.row_estimate() * chunk.len() * factor);
            let (epoch, id, plan) = (self.epoch, split.id, plan.clone());
            chunks += 1;
            if !self.hand_over(move || engine.transform(epoch, id, chunk, &plan), reserved, batcher)? {
                return Ok(false);
            }
        }
    }

    /// The columnar path's `split`: hands the split's table to the pool in chunks of rows,
    /// landing what came before each chunk meanwhile.
    fn table_chunks(
        &mut self,
        split: u64,
        table: Table,
        batcher: &mut Batcher<impl FnMut(Ready) -> bool>,
    ) -> Result<bool, EngineError> {
        let engine = self.engine;
        // A split made for other jobs too lands in chunks of one piece a thread: its takers
        // wait while their copy grows (`shared::STILL_FOR`), and a chunk of 16,384 rows took
        // 0.6-0.75 s in a debug build on two busy cores, which made a third of such splits
        // twice in local/tests/parquet_faults.rs.
        let most = match recording(&self.open) {
            Some(_) => TABLE_PIECE_ROWS * engine.config.threads.max(1),
            None => TABLE_CHUNK_ROWS,
        };
        let (mut offset, mut chunks) = (0, 0);
        while offset < table.len() {
            let len = batcher.chunk_len(most, 1).min(table.len() - offset);
            let chunk = table.slice(offset, len);
            offset += len;
            if !batcher.batch_queued()? {
                return Ok(false);
            }
            let reserved = batcher.reserve(batcher.row_estimate() * len);
            chunks += 1;
            if !self.hand_over(move || engine.transform_table(split, chunk), reserved, batcher)? {
                return Ok(false);
            }
        }
        if let Some(maker) = recording(&self.open) {
            maker.chunks(chunks);
        }
        self.steps.push_back(Step::End);
        Ok(true)
    }

    /// Runs `transform` (a chunk's) on its own thread, its rows recorded there for a shared
    /// production's takers, and lands everything before it meanwhile. False when nobody
    /// listens.
    fn hand_over(
        &mut self,
        transform: impl FnOnce() -> Transformed + Send + 'scope,
        reserved: Rows,
        batcher: &mut Batcher<impl FnMut(Ready) -> bool>,
    ) -> Result<bool, EngineError> {
        let recorder = recording(&self.open).map(Maker::chunk);
        let transforming = self.scope.spawn(move || {
            let transformed = transform();
            if let (Ok((rows, _)), Some(recorder)) = (&transformed, recorder) {
                recorder.record(rows);
            }
            transformed
        });
        self.steps.push_back(Step::Chunk { transforming, reserved });
        self.land(1, batcher)
    }

    /// Lands every step still in flight, and goes on. False when nobody listens.
    pub(super) fn land_all(&mut self, batcher: &mut Batcher<impl FnMut(Ready) -> bool>) -> Result<bool, EngineError> {
        self.land(0, batcher)
    }

    /// Lands every step still in flight. False when nobody listens.
    pub(super) fn finish(mut self, batcher: &mut Batcher<impl FnMut(Ready) -> bool>) -> Result<bool, EngineError> {
        self.land(0, batcher)
    }

    /// Lands steps in order until `keep` are left. False when nobody listens.
    fn land(&mut self, keep: usize, batcher: &mut Batcher<impl FnMut(Ready) -> bool>) -> Result<bool, EngineError> {
        while self.steps.len() > keep {
            match self.steps.pop_front().expect("more than kept") {
                Step::Chunk { transforming, reserved } => {
                    if !batcher.batch_queued()? {
                        return Ok(false);
                    }
                    let (rows, chunk_at_hints) = transforming.join().expect("the transform thread does not panic")?;
                    let open = self.open.front_mut().expect("a chunk's split is open");
                    open.at_hints.record(chunk_at_hints);
                    let rows = match open.packing.as_mut() {
                        Some(packing) => packing.pack(rows).map_err(EngineError::Pack)?,
                        None => rows,
                    };
                    // Without packing, recorded where it was transformed.
                    if let Some(maker) = open.maker.as_ref().filter(|_| open.packing.is_some()) {
                        maker.record(&rows);
                    }
                    self.engine.stats.produced(open.source, rows.len());
                    batcher.queue(open.split, rows, reserved);
                }
                Step::Taken { rows, reserved } => {
                    if !batcher.batch_queued()? {
                        return Ok(false);
                    }
                    let open = self.open.front().expect("a taken split is open");
                    self.engine.stats.produced(open.source, rows.len());
                    batcher.queue(open.split, rows, reserved);
                }
                Step::End => {
                    let mut open = self.open.pop_front().expect("an ending split is open");
                    // Packing: the split's last, padded row.
                    if let Some(last) = open.packing.as_mut().and_then(Packing::finish) {
                        if !batcher.batch_queued()? {
                            return Ok(false);
                        }
                        let reserved = batcher.reserve(batcher.row_estimate() * last.len());
                        if let Some(maker) = &open.maker {
                            maker.record(&last);
                        }
                        self.engine.stats.produced(open.source, last.len());
                        batcher.queue(open.split, last, reserved);
                    }
                    if let Some(maker) = open.maker.take() {
                        maker.finish();
                    }
                    self.engine.finish_hints(&open.plan, open.at_hints);
                    batcher.split_read(open.split);
                }
            }
        }
        Ok(true)
    }
}

impl Engine {
    /// Runs the transforms of `plan` on a chunk on every pool thread (`stages`), keeping the
    /// chunk's order; what passed the autocache hints is measured and, for a put, encoded.
    fn transform(
        &self,
        epoch: u64,
        split: u64,
        chunk: Vec<(u64, Element)>,
        plan: &SplitPlan,
    ) -> Result<(Vec<(u64, Row)>, AtHints), EngineError> {
        let p = &self.pipeline;
        let results = self.run_stages(epoch, split, chunk, plan);
        let mut rows = Vec::with_capacity(results.len());
        let mut ops = OpTally::for_ops(p.data_plane.transforms.len());
        let mut all_hints = AtHints::default();
        for InFlight { position, result, tally, at_hints, .. } in results {
            OpTally::add_all(&mut ops, &tally);
            all_hints.merge(at_hints);
            match result {
                Ok(Some(element)) => {
                    self.stats.elements.fetch_add(1, Ordering::Relaxed);
                    rows.push((position, to_row(element)));
                }
                Ok(None) => {
                    self.stats.filtered.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) if p.data_plane.on_error == OnError::Skip && !error.is_fatal() => {
                    tracing::warn!(split, element = position, %error, "skipping an element");
                    self.stats.skip(error.reason());
                    self.stats.python_failed(&error);
                }
                Err(error) => {
                    self.stats.python_failed(&error);
                    return Err(EngineError::Element { split, element: position, error });
                }
            }
        }
        OpTally::add_all(&mut self.stats.ops.lock().unwrap(), &ops);
        Ok((rows, all_hints))
    }
}

impl Engine {
    /// Runs the pipeline's ops on a chunk of a table, in one piece per pool thread, column at
    /// a time; its rows in the chunk's order.
    fn transform_table(&self, split: u64, chunk: Table) -> Transformed {
        use rayon::prelude::*;
        let p = &self.pipeline.data_plane;
        let per = chunk.len().div_ceil(self.config.threads.max(1)).max(TABLE_PIECE_ROWS);
        let pieces: Vec<Table> =
            (0..chunk.len()).step_by(per).map(|o| chunk.slice(o, per.min(chunk.len() - o))).collect();
        let measuring = self.measure_ops.load(Ordering::Relaxed);
        let applied: Vec<_> = self.pool.install(|| {
            (pieces.into_par_iter())
                .map(|piece| {
                    let mut tally = OpTally::for_ops(p.transforms.len());
                    let mut sizes = Vec::new();
                    let measure = measuring.then_some(&mut sizes);
                    let applied =
                        table::apply::apply(&p.transforms, &self.loaded, p.on_error, piece, &mut tally, measure);
                    (applied, tally, sizes)
                })
                .collect()
        });
        let mut rows = Vec::with_capacity(chunk.len());
        let mut ops = OpTally::for_ops(p.transforms.len());
        for (applied, tally, sizes) in applied {
            OpTally::add_all(&mut ops, &tally);
            if !sizes.is_empty() {
                let mut op_bytes = self.stats.op_bytes.lock().unwrap();
                sizes.iter().for_each(|size| HintBytes::add_into(&mut op_bytes, size));
            }
            let applied = applied.map_err(|error| EngineError::Table { split, error })?;
            self.stats.filtered.fetch_add(applied.filtered, Ordering::Relaxed);
            if applied.skipped_null > 0 {
                tracing::warn!(split, rows = applied.skipped_null, "skipping rows with a null where a filter compares");
                self.stats.skip_many("missing_field", applied.skipped_null);
            }
            self.stats.elements.fetch_add(applied.table.len() as u64, Ordering::Relaxed);
            rows.extend(applied.table.into_rows().into_iter().map(|(position, row)| (position, Row::Table(row))));
        }
        OpTally::add_all(&mut self.stats.ops.lock().unwrap(), &ops);
        Ok((rows, AtHints::default()))
    }
}

/// A split's packing: its packer, the next packed row's position, and the positions an earlier
/// attempt delivered (packed rows are numbered in the split's order, so a split produced again
/// packs the same rows under the same positions).
pub(super) struct Packing<'a> {
    pub(super) packer: Packer,
    pub(super) next: u64,
    pub(super) skip: Vec<u32>,
    pub(super) stats: &'a super::Stats,
    /// The pack op's index (the last transform), for its tally.
    pub(super) index: usize,
}

impl Packing<'_> {
    fn pack(&mut self, rows: Vec<(u64, Row)>) -> Result<Vec<(u64, Row)>, String> {
        let started = Instant::now();
        let (given, made) = (rows.len() as u64, self.next);
        let mut packed = Vec::new();
        for (_, row) in rows {
            let tokens = pack::tokens(&row, self.packer.field())?;
            for row in self.packer.push(&tokens) {
                self.keep(row, &mut packed);
            }
        }
        self.stats.count_op_time(self.index, started.elapsed(), given, self.next - made);
        Ok(packed)
    }

    fn finish(&mut self) -> Option<Vec<(u64, Row)>> {
        let row = self.packer.finish()?;
        self.stats.count_op(self.index, 0, 1);
        let mut last = Vec::new();
        self.keep(row, &mut last);
        Some(last)
    }

    fn keep(&mut self, row: Row, out: &mut Vec<(u64, Row)>) {
        let position = self.next;
        self.next += 1;
        if self.skip.binary_search(&(position as u32)).is_ok() {
            self.stats.redelivery_skipped.fetch_add(1, Ordering::Relaxed);
        } else {
            out.push((position, row));
        }
    }
}

fn to_row(element: Element) -> Row {
    Row::Fields(element.into_iter().map(|(name, field)| (name, apply::to_tensor(field))).collect())
}
