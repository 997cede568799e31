//! Transforming: a split's elements in chunks on the rayon pool, each chunk's results in the
//! chunk's order, turned into rows for the batcher.

use std::sync::atomic::Ordering;
use std::time::Duration;

use stoker_api::OnError;

use super::batcher::Batcher;
use super::hints::{AtHints, SplitPlan};
use super::pack::{self, Packer};
use super::stack::Row;
use super::stages::InFlight;
use super::{Engine, EngineError, Ready, Split};
use crate::apply;
use crate::element::Element;

impl Engine {
    /// Runs a split's elements through `plan` chunk by chunk into `batcher`: transforming a
    /// chunk (on the pool, from a scoped thread) overlaps batching the one before it. False
    /// when nobody listens.
    pub(super) fn transform_split(
        &self,
        epoch: u64,
        split: &Split,
        elements: Vec<(u64, Element)>,
        mut plan: SplitPlan,
        packing: Option<Packing<'_>>,
        batcher: &mut Batcher<impl FnMut(Ready) -> bool>,
    ) -> Result<bool, EngineError> {
        let (source, split) = (split.source, split.id);
        let window = (self.config.threads * 64).max(64);
        let mut at_hints = self.start_hints(split, &mut plan);
        let plan = &plan;
        let mut elements = elements.into_iter();
        let mut packing = packing;
        let listening = std::thread::scope(|scope| -> Result<bool, EngineError> {
            loop {
                let chunk: Vec<(u64, Element)> = elements.by_ref().take(window).collect();
                if chunk.is_empty() {
                    // Packing: the split's last, padded row.
                    let Some(last) = packing.as_mut().and_then(Packing::finish) else { return Ok(true) };
                    if !batcher.batch_queued()? {
                        return Ok(false);
                    }
                    let reserved = self.budget.reserve_rows(batcher.row_estimate() * last.len());
                    self.stats.produced(source, last.len());
                    batcher.queue(split, last, reserved);
                    return Ok(true);
                }
                // The chunk's output is held from before it exists until it is sent: reserve
                // what the last chunk's rows weighed, wait while batches in flight leave no
                // room, then correct to the actual size.
                let reserved = self.budget.reserve_rows(batcher.row_estimate() * chunk.len());
                let transforming = scope.spawn(move || self.transform(epoch, split, chunk, plan));
                if !batcher.batch_queued()? {
                    return Ok(false);
                }
                let (rows, chunk_at_hints) = transforming.join().expect("the transform thread does not panic")?;
                at_hints.record(chunk_at_hints);
                let rows = match packing.as_mut() {
                    Some(packing) => packing.pack(rows).map_err(EngineError::Pack)?,
                    None => rows,
                };
                self.stats.produced(source, rows.len());
                batcher.queue(split, rows, reserved);
            }
        })?;
        if listening {
            self.finish_hints(plan, at_hints);
        }
        Ok(listening)
    }

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
        let mut op_time = vec![Duration::ZERO; p.data_plane.transforms.len()];
        let mut all_hints = AtHints::default();
        for InFlight { position, result, timings, at_hints, .. } in results {
            for (total, t) in op_time.iter_mut().zip(timings) {
                *total += t;
            }
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
        for (total, t) in self.stats.op_time.lock().unwrap().iter_mut().zip(op_time) {
            *total += t;
        }
        Ok((rows, all_hints))
    }
}

/// A split's packing: its packer, the next packed row's position, and the positions an earlier
/// attempt delivered (packed rows are numbered in the split's order, so a split produced again
/// packs the same rows under the same positions).
pub(super) struct Packing<'a> {
    pub(super) packer: Packer,
    pub(super) next: u64,
    pub(super) skip: &'a [u32],
    pub(super) stats: &'a super::Stats,
}

impl Packing<'_> {
    fn pack(&mut self, rows: Vec<(u64, Row)>) -> Result<Vec<(u64, Row)>, String> {
        let mut packed = Vec::new();
        for (_, row) in rows {
            let tokens = pack::tokens(&row, self.packer.field())?;
            for row in self.packer.push(&tokens) {
                self.keep(row, &mut packed);
            }
        }
        Ok(packed)
    }

    fn finish(&mut self) -> Option<Vec<(u64, Row)>> {
        let row = self.packer.finish()?;
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
    element.into_iter().map(|(name, field)| (name, apply::to_tensor(field))).collect()
}
