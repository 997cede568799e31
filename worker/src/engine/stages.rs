//! Stages: a chunk's elements through the transforms on every pool thread, element by element,
//! except at a batched `python` op (`batch: n`), where the chunk's surviving elements meet and
//! go to the op n at a time, one call per group, the groups in parallel. A pipeline without
//! batched ops is one stage.

use std::sync::atomic::Ordering;
use std::time::Instant;

use rayon::prelude::*;
use stoker_api::{Transform, echo_position, row};

use super::Engine;
use super::hints::{self, AtHints, SplitPlan, Transformed};
use crate::apply::{self, ElementError, ElementKey};
use crate::element::Element;
use crate::op_tally::OpTally;

/// Where a chunk's elements meet between runs of per-element ops.
enum Stop {
    /// A batched python op: `n` elements per call.
    Batched(usize),
    /// `echo`: each element becomes its copies.
    Echo(u32),
    /// The end of the transforms.
    End,
}

/// One element of a chunk on its way through the stages.
pub(super) struct InFlight {
    pub(super) position: u64,
    key: ElementKey,
    pub(super) result: Transformed,
    /// Time and elements per transform index.
    pub(super) tally: Vec<OpTally>,
    pub(super) at_hints: AtHints,
}

impl Engine {
    /// Runs the transforms of `plan` on `chunk`, keeping the chunk's order.
    pub(super) fn run_stages(
        &self,
        epoch: u64,
        split: u64,
        chunk: Vec<(u64, Element)>,
        plan: &SplitPlan,
    ) -> Vec<InFlight> {
        let list = &self.pipeline.data_plane.transforms;
        let transforms = apply::Transforms { list, loaded: &self.loaded };
        let seed = self.pipeline.data_plane.seed.unwrap_or(0);
        let mut flights: Vec<InFlight> = chunk
            .into_iter()
            .map(|(position, element)| InFlight {
                position,
                // Element ids are stable per (split, position) whatever thread runs them, and
                // whether the prefix ran now or before the element was cached.
                key: ElementKey { seed, epoch, element: (split << 32) | position },
                result: Ok(Some(element)),
                tally: OpTally::for_ops(list.len()),
                at_hints: AtHints::default(),
            })
            .collect();
        // Where the elements of the chunk meet between two runs of per-element ops: at a batched
        // python op, and at `echo`, where each becomes its copies.
        let stops = list.iter().enumerate().skip(plan.from).filter_map(|(index, t)| match t {
            Transform::Python(op) => op.batched().map(|n| (index, Stop::Batched(n))),
            Transform::Echo(_) => Some((index, Stop::Echo(plan.echo))),
            _ => None,
        });
        let mut from = plan.from;
        for (stop, at) in stops.chain([(list.len(), Stop::End)]) {
            self.pool.install(|| {
                flights.par_iter_mut().for_each(|f| {
                    if let Ok(Some(element)) = &mut f.result {
                        let element = std::mem::take(element);
                        f.result = hints::run_plan(
                            transforms,
                            plan,
                            from..stop,
                            f.position,
                            element,
                            f.key,
                            &mut f.tally,
                            &mut f.at_hints,
                        );
                    }
                })
            });
            match at {
                Stop::Batched(n) => self.call_batched(stop, n, &mut flights),
                Stop::Echo(factor) => flights = self.echo(split, stop, factor, &plan.delivered, flights),
                Stop::End => {}
            }
            from = stop + 1;
        }
        flights
    }

    /// Each live element of the chunk as `factor` copies, copy-major (every element's copy 0,
    /// then every copy 1, ...), so the copies of an element are a chunk apart before the shuffle
    /// buffer mixes them. A copy's position (`echo_position`) is its provenance and the key of
    /// its random draws (copy 0 keeps the element's own); copies at `delivered` (an earlier
    /// attempt at the split sent them) are left out. Failed and filtered elements pass once.
    /// The echo op (`index`) counts the live elements in and their copies out, those left out
    /// included.
    fn echo(&self, split: u64, index: usize, factor: u32, delivered: &[u32], flights: Vec<InFlight>) -> Vec<InFlight> {
        let ops = self.pipeline.data_plane.transforms.len();
        let sent = |position: u64| delivered.binary_search(&(position as u32)).is_ok();
        let mut out = Vec::with_capacity(flights.len() * factor as usize);
        let mut live = Vec::new();
        let mut skipped = 0;
        let mut alive = 0;
        for f in flights {
            if let Ok(Some(element)) = &f.result {
                alive += 1;
                if factor > 1 {
                    live.push((f.position, f.key, element.clone()));
                }
                if sent(f.position) {
                    skipped += 1;
                    continue;
                }
            }
            out.push(f);
        }
        for copy in 1..factor {
            for (position, key, element) in &live {
                let position = echo_position(*position, copy);
                if sent(position) {
                    skipped += 1;
                    continue;
                }
                out.push(InFlight {
                    position,
                    key: ElementKey { element: row(split, position), ..*key },
                    result: Ok(Some(element.clone())),
                    // The ops before the echo ran once, on copy 0.
                    tally: OpTally::for_ops(ops),
                    at_hints: AtHints::default(),
                });
            }
        }
        self.stats.count_op(index, alive, alive * u64::from(factor.max(1)));
        self.stats.redelivery_skipped.fetch_add(skipped, Ordering::Relaxed);
        self.stats.echoed.fetch_add(live.len() as u64 * u64::from(factor.saturating_sub(1)), Ordering::Relaxed);
        out
    }

    /// Batched `python` op `index` on the elements of `flights` still alive, `n` per call. A
    /// call's failure is each of its elements' (counted and skipped or fatal per onError).
    fn call_batched(&self, index: usize, n: usize, flights: &mut [InFlight]) {
        let pool = self.loaded.python.as_ref().expect("loaded for a pipeline with python ops");
        let Transform::Python(op) = &self.pipeline.data_plane.transforms[index] else {
            unreachable!("a batched stop is a python op")
        };
        let function = format!("{}.{}", op.module, op.function);
        let mut alive: Vec<&mut InFlight> = flights.iter_mut().filter(|f| matches!(f.result, Ok(Some(_)))).collect();
        self.pool.install(|| {
            alive.par_chunks_mut(n).for_each(|group| {
                let started = Instant::now();
                let elements = group
                    .iter_mut()
                    .map(|f| match &mut f.result {
                        Ok(Some(element)) => (f.key, std::mem::take(element)),
                        _ => unreachable!("only live elements are grouped"),
                    })
                    .collect();
                let results = pool.call_batch(index, elements);
                let share = started.elapsed() / group.len() as u32;
                for (f, result) in group.iter_mut().zip(results) {
                    f.tally[index].time += share;
                    f.tally[index].elements_in += 1;
                    f.tally[index].elements_out += u64::from(matches!(result, Ok(Some(_))));
                    f.result =
                        result.map_err(|failure| ElementError::Python { index, function: function.clone(), failure });
                }
            })
        });
    }
}
