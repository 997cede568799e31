//! What the autoscaler decided, per pipeline, shared with whoever makes it real and reports it:
//! the controller (replicas and status) in a cluster, the terminal view in local mode.

use std::collections::BTreeMap;
use std::sync::Mutex;

use stoker_api::{CacheStatus, DataWaitStatus, DeliveryStatus, EchoStatus, ScalingStep, WorkersReport};

use super::policy::PolicyState;
use crate::key::PipelineKey;

/// Decisions kept in status, newest last.
pub const HISTORY: usize = 20;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScalingRecord {
    /// Workers the pipeline should run.
    pub workers: u32,
    /// Where the policy's search is (the least settled of the pipeline's jobs); None until the
    /// first round.
    pub state: Option<PolicyState>,
    pub converged: bool,
    /// Whether training clients are attached.
    pub attached: bool,
    /// Mean batch time of the last window (1 / training speed), in milliseconds.
    pub batch_time_ms: Option<f64>,
    pub wait_fraction: Option<f64>,
    /// Workers the policy wanted beyond what the cluster-wide budget granted.
    pub held_back: u32,
    /// When and why a convergence with clients waiting will be re-tried.
    pub retry: Option<String>,
    /// With an automatic `echo`: the factor in force and why.
    pub echo: Option<EchoStatus>,
    pub history: Vec<ScalingStep>,
}

#[derive(Default)]
pub struct ScalingBook {
    records: Mutex<BTreeMap<PipelineKey, ScalingRecord>>,
    /// Each pipeline's cache plan, as the dispatcher has it (kept apart from the records,
    /// which only pipelines in the autoscaler's scope have).
    caches: Mutex<BTreeMap<PipelineKey, CacheStatus>>,
    /// Each pipeline's delivery counters, as the dispatcher has them.
    deliveries: Mutex<BTreeMap<PipelineKey, DeliveryStatus>>,
    /// Each pipeline's workers' report, as the dispatcher has it.
    reports: Mutex<BTreeMap<PipelineKey, WorkersReport>>,
    /// How long each pipeline's consumers waited for data, from every window reported (all
    /// pipelines, not only those the autoscaler scales).
    waits: Mutex<BTreeMap<PipelineKey, DataWaitStatus>>,
}

impl ScalingBook {
    pub fn get(&self, pipeline: &PipelineKey) -> Option<ScalingRecord> {
        self.records.lock().unwrap().get(pipeline).cloned()
    }

    pub fn all(&self) -> BTreeMap<PipelineKey, ScalingRecord> {
        self.records.lock().unwrap().clone()
    }

    /// Changes a pipeline's record; returns whether anything changed.
    pub fn update(&self, pipeline: &PipelineKey, f: impl FnOnce(&mut ScalingRecord)) -> bool {
        let mut records = self.records.lock().unwrap();
        let record = records.entry(pipeline.clone()).or_default();
        let before = record.clone();
        f(record);
        if record.history.len() > HISTORY {
            let excess = record.history.len() - HISTORY;
            record.history.drain(..excess);
        }
        *record != before
    }

    pub fn cache(&self, pipeline: &PipelineKey) -> Option<CacheStatus> {
        self.caches.lock().unwrap().get(pipeline).cloned()
    }

    pub fn caches(&self) -> BTreeMap<PipelineKey, CacheStatus> {
        self.caches.lock().unwrap().clone()
    }

    /// Replaces the cache plans; returns whether anything changed.
    pub fn set_caches(&self, caches: BTreeMap<PipelineKey, CacheStatus>) -> bool {
        replace(&self.caches, caches)
    }

    pub fn data_wait(&self, pipeline: &PipelineKey) -> Option<DataWaitStatus> {
        self.waits.lock().unwrap().get(pipeline).cloned()
    }

    pub fn data_waits(&self) -> BTreeMap<PipelineKey, DataWaitStatus> {
        self.waits.lock().unwrap().clone()
    }

    /// Adds a round's windows to their pipelines' waits; returns whether anything changed.
    pub fn add_waits(&self, windows: &[crate::dispatcher::JobWindows]) -> bool {
        let mut waits = self.waits.lock().unwrap();
        let mut changed = false;
        for jw in windows {
            changed |= waits.entry(jw.pipeline.clone()).or_default().add(&jw.windows);
        }
        changed
    }

    pub fn delivery(&self, pipeline: &PipelineKey) -> Option<DeliveryStatus> {
        self.deliveries.lock().unwrap().get(pipeline).cloned()
    }

    pub fn deliveries(&self) -> BTreeMap<PipelineKey, DeliveryStatus> {
        self.deliveries.lock().unwrap().clone()
    }

    /// Replaces the delivery counters; returns whether anything changed.
    pub fn set_deliveries(&self, deliveries: BTreeMap<PipelineKey, DeliveryStatus>) -> bool {
        replace(&self.deliveries, deliveries)
    }

    pub fn report(&self, pipeline: &PipelineKey) -> Option<WorkersReport> {
        self.reports.lock().unwrap().get(pipeline).cloned()
    }

    /// Replaces the workers' reports; returns whether anything changed.
    pub fn set_reports(&self, reports: BTreeMap<PipelineKey, WorkersReport>) -> bool {
        replace(&self.reports, reports)
    }

    pub fn remove(&self, pipeline: &PipelineKey) {
        self.records.lock().unwrap().remove(pipeline);
    }
}

/// Puts `value` in `slot`; returns whether it differed.
fn replace<T: PartialEq>(slot: &Mutex<T>, value: T) -> bool {
    let mut current = slot.lock().unwrap();
    let changed = *current != value;
    *current = value;
    changed
}

#[cfg(test)]
mod tests {
    use stoker_api::window::Window;

    use super::*;
    use crate::dispatcher::JobWindows;

    #[test]
    fn waits_are_summed_per_pipeline_over_jobs_and_rounds() {
        let book = ScalingBook::default();
        let key = |name: &str| PipelineKey { namespace: "ns".into(), name: name.into() };
        let window = |batches, wait_fraction| Window {
            workers: 1,
            batches,
            median_s: 0.5,
            p90_s: 0.5,
            mean_s: 0.5,
            wait_fraction,
        };
        let job =
            |name: &str, job: &str, windows| JobWindows { pipeline: key(name), job: job.into(), consumers: 1, windows };
        assert!(book.add_waits(&[job("a", "j", vec![window(4, 0.5)]), job("a", "k", vec![window(4, 0.0)])]));
        assert!(!book.add_waits(&[job("b", "j", vec![])]), "no batch, no change");
        assert!(book.add_waits(&[job("a", "j", vec![window(2, 1.0)])]));
        let a = book.data_wait(&key("a")).unwrap();
        assert_eq!((a.waiting_seconds, a.total_seconds, a.fraction), (2.0, 5.0, 1.0));
        assert_eq!(book.data_wait(&key("b")).map(|b| b.total_seconds), Some(0.0));
    }
}
