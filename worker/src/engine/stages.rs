//! Stages: a chunk's elements through the transforms on every pool thread, element by element,
//! except at a batched `python` op (`batch: n`), where the chunk's surviving elements meet and
//! go to the op n at a time, one call per group, the groups in parallel. A pipeline without
//! batched ops is one stage.

use std::time::{Duration, Instant};

use rayon::prelude::*;
use stoker_api::Transform;

use super::Engine;
use super::hints::{self, AtHints, SplitPlan, Transformed};
use crate::apply::{self, ElementError, ElementKey};
use crate::element::Element;

/// One element of a chunk on its way through the stages.
pub(super) struct InFlight {
    pub(super) position: u64,
    key: ElementKey,
    pub(super) result: Transformed,
    /// Time per transform index.
    pub(super) timings: Vec<Duration>,
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
                timings: vec![Duration::ZERO; list.len()],
                at_hints: AtHints::default(),
            })
            .collect();
        let batched = list.iter().enumerate().skip(plan.from).filter_map(|(index, t)| match t {
            Transform::Python(op) => op.batched().map(|n| (index, Some(n))),
            _ => None,
        });
        let mut from = plan.from;
        for (stop, batch) in batched.chain([(list.len(), None)]) {
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
                            &mut f.timings,
                            &mut f.at_hints,
                        );
                    }
                })
            });
            if let Some(n) = batch {
                self.call_batched(stop, n, &mut flights);
            }
            from = stop + 1;
        }
        flights
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
                    f.timings[index] += share;
                    f.result =
                        result.map_err(|failure| ElementError::Python { index, function: function.clone(), failure });
                }
            })
        });
    }
}
