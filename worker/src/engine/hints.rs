//! The autocache hints on the way through the transforms: elements are measured at each hint
//! (the cache chooses where to cache from the sizes), and for a put, encoded at the put's
//! hint into the split's chunk file. A split read from the cache starts after its hint.

use stoker_api::proto::HintBytes;

use super::Engine;
use crate::apply::{self, ElementError, ElementKey};
use crate::cache::chunk;
use crate::cache::store::{LeaseKind, SplitWriter};
use crate::element::Element;
use crate::op_tally::OpTally;

/// One element's outcome: kept, filtered out, or failed.
pub(super) type Transformed = Result<Option<Element>, ElementError>;

/// Elements and their encoded bytes, per hint.
type Sizes = Vec<HintBytes>;

/// How a split's elements run: the transforms from `from` on, measuring the elements at the
/// hints in `measure` and writing those at `put`'s hint to its entry.
#[derive(Default)]
pub(super) struct SplitPlan {
    pub(super) from: usize,
    pub(super) measure: Vec<u32>,
    pub(super) put: Option<(u32, String)>,
    /// With `echo`: the copies an earlier attempt at the split delivered (sorted positions,
    /// `echo_position`), left out where the echo makes them.
    pub(super) delivered: Vec<u32>,
    /// With `echo`: the split's echo factor.
    pub(super) echo: u32,
}

/// What passed the autocache hints in a chunk: the sizes and, for a put, the encoded records
/// in chunk order.
#[derive(Default)]
pub(super) struct AtHints {
    sizes: Sizes,
    records: Vec<u8>,
    count: u64,
}

impl AtHints {
    pub(super) fn merge(&mut self, other: AtHints) {
        for size in &other.sizes {
            HintBytes::add_into(&mut self.sizes, size);
        }
        self.records.extend_from_slice(&other.records);
        self.count += other.count;
    }
}

/// Runs one element through the transforms in `range` of `plan`: the segments between the
/// hints, measuring (and for a put, encoding) the element at each.
#[allow(clippy::too_many_arguments)] // one element's whole context; a struct would only rename it
pub(super) fn run_plan(
    transforms: apply::Transforms<'_>,
    plan: &SplitPlan,
    range: std::ops::Range<usize>,
    position: u64,
    mut element: Element,
    key: ElementKey,
    tally: &mut [OpTally],
    at_hints: &mut AtHints,
) -> Transformed {
    let mut from = range.start;
    for &at in plan.measure.iter().filter(|&&at| range.contains(&(at as usize))) {
        let to = at as usize + 1;
        element = match apply::apply_range(transforms, from..to, element, key, tally)? {
            Some(e) => e,
            None => return Ok(None),
        };
        from = to;
        let size = HintBytes { at, elements: 1, bytes: chunk::encoded_len(&element) as u64 };
        HintBytes::add_into(&mut at_hints.sizes, &size);
        if plan.put.as_ref().is_some_and(|(put, _)| *put == at) {
            chunk::encode_record(position, &element, &mut at_hints.records);
            at_hints.count += 1;
        }
    }
    apply::apply_range(transforms, from..range.end, element, key, tally)
}

/// What a split's chunks left at the hints so far: its chunk file being written (for a put)
/// and the sizes measured.
#[derive(Default)]
pub(super) struct SplitAtHints {
    writing: Option<SplitWriter>,
    measured: Sizes,
}

impl SplitAtHints {
    /// Appends a chunk's records to the chunk file (a failed write abandons the file) and its
    /// sizes to the measurements.
    pub(super) fn record(&mut self, chunk: AtHints) {
        if let Some(writer) = self.writing.as_mut() {
            writer.records(chunk.count);
            if let Err(e) = writer.append(&chunk.records) {
                tracing::warn!(error = %e, "writing a cache chunk failed; the split stays uncached");
                self.writing = None;
            }
        }
        for size in &chunk.sizes {
            HintBytes::add_into(&mut self.measured, size);
        }
    }
}

impl Engine {
    /// Opens the split's chunk file when it is to be put and is not in the entry yet; without
    /// one, the split is not put.
    pub(super) fn start_hints(&self, split: u64, plan: &mut SplitPlan) -> SplitAtHints {
        let writing = self.writer(split, plan);
        if writing.is_none() {
            plan.put = None;
        }
        SplitAtHints { writing, measured: Vec::new() }
    }

    fn writer(&self, split: u64, plan: &SplitPlan) -> Option<SplitWriter> {
        let (engine_cache, (_, fingerprint)) = (self.cache.as_ref()?, plan.put.as_ref()?);
        let entry = engine_cache.entry(fingerprint);
        if entry.has_split(split) || entry.is_complete() {
            return None;
        }
        engine_cache.lease(&entry, LeaseKind::Writer);
        match entry.write_split(split, engine_cache.holder()) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(split, error = %e, "cannot write to the cache; computing without it");
                None
            }
        }
    }

    /// A split went through: its chunk file goes in place, and its measurements are counted.
    pub(super) fn finish_hints(&self, plan: &SplitPlan, at_hints: SplitAtHints) {
        if plan.from == 0 && self.measure_ops.load(std::sync::atomic::Ordering::Relaxed) {
            let mut op_bytes = self.stats.op_bytes.lock().unwrap();
            for size in &at_hints.measured {
                HintBytes::add_into(&mut op_bytes, size);
            }
        }
        let Some(engine_cache) = &self.cache else { return };
        if let (Some(writer), Some((at, fingerprint))) = (at_hints.writing, &plan.put) {
            match writer.finish() {
                Ok(_) => engine_cache.written(fingerprint, *at),
                Err(e) => tracing::warn!(error = %e, "writing a cache chunk failed"),
            }
        }
        if plan.from == 0 && !plan.measure.is_empty() {
            engine_cache.measured(&at_hints.measured);
        }
    }
}
