//! The dispatcher's cache bookkeeping: each pipeline's plan, and which entries are complete in
//! each namespace (a cache is shared by every pipeline of the namespace with the same prefix).
//! Workers tell it what they found and measured; nothing here touches a volume.

use std::collections::{BTreeMap, BTreeSet};

use stoker_api::proto::HintBytes;
use stoker_api::{CacheDecision, CacheMode, CacheStatus};

use crate::autocache::plan::{CachePlan, Directive, Hint, Measured};
use crate::key::PipelineKey;

/// A worker's cumulative cache report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheProgress {
    /// Elements and their encoded bytes per hint, for the splits computed from the source.
    pub hints: Vec<HintBytes>,
    /// Splits computed from the source with the hints measured.
    pub splits_measured: u64,
    pub write_bytes_per_second: f64,
    pub read_bytes_per_second: f64,
    /// Entries the worker found or made complete.
    pub complete: Vec<String>,
    /// (fingerprint, what was wrong) of an entry the worker dropped as corrupt.
    pub corrupt: Option<(String, String)>,
    pub splits_written: u64,
    pub splits_read: u64,
    pub elements_read: u64,
}

/// A worker's view of the pipeline's hints at registration.
#[derive(Clone, Debug, PartialEq)]
pub struct HintSeen {
    pub at: u32,
    pub fingerprint: String,
    pub complete: bool,
}

#[derive(Default)]
pub struct Caches {
    complete: BTreeMap<String, BTreeSet<String>>,
    plans: BTreeMap<PipelineKey, CachePlan>,
}

impl Caches {
    /// The first worker of a pipeline makes its plan; every worker tells what it found.
    pub fn register(&mut self, key: &PipelineKey, mode: CacheMode, hints: &[HintSeen], splits: u64) {
        let complete = self.complete.entry(key.namespace.clone()).or_default();
        complete.extend(hints.iter().filter(|h| h.complete).map(|h| h.fingerprint.clone()));
        let plan = self.plans.entry(key.clone()).or_insert_with(|| {
            let hints = hints.iter().map(|h| Hint { at: h.at, fingerprint: h.fingerprint.clone() }).collect();
            CachePlan::new(mode, hints, splits)
        });
        plan.complete(complete);
    }

    /// The pipeline's source changed: its next worker plans afresh.
    pub fn forget(&mut self, key: &PipelineKey) {
        self.plans.remove(key);
    }

    /// A worker's report, and the pipeline's measurements summed over its workers (asked for
    /// only while the plan measures).
    pub fn reported(&mut self, key: &PipelineKey, progress: &CacheProgress, measured: impl FnOnce() -> Measured) {
        let complete = self.complete.entry(key.namespace.clone()).or_default();
        complete.extend(progress.complete.iter().cloned());
        if let Some((fingerprint, detail)) = &progress.corrupt {
            complete.remove(fingerprint);
            for (other, plan) in self.plans.iter_mut().filter(|(k, _)| k.namespace == key.namespace) {
                tracing::warn!(pipeline = %other, %fingerprint, %detail, "a cache entry was corrupt; computing instead");
                plan.corrupt(fingerprint, detail);
            }
        }
        if let Some(plan) = self.plans.get_mut(key) {
            if plan.profiling() {
                plan.measured(&measured());
            }
            plan.complete(complete);
        }
    }

    pub fn directive(&self, key: &PipelineKey) -> Directive {
        self.plans.get(key).map_or(Directive::Compute, CachePlan::directive)
    }

    pub fn epoch(&mut self, key: &PipelineKey, action: CacheDecision, seconds: f64) {
        if let Some(plan) = self.plans.get_mut(key) {
            plan.epoch(action, seconds);
        }
    }

    pub fn status(&self, key: &PipelineKey, bytes: Option<i64>) -> Option<CacheStatus> {
        self.plans.get(key).map(|p| p.status(bytes))
    }
}
