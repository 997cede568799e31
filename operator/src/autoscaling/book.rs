//! What the autoscaler decided, per pipeline, shared with whoever makes it real and reports it:
//! the controller (replicas and status) in a cluster, the terminal view in local mode.

use std::collections::BTreeMap;
use std::sync::Mutex;

use stoker_api::{
    CacheStatus, DataWaitStatus, DeliveryStatus, EchoStatus, JobName, JobStatus, ScalingStep, WorkersReport,
};

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
    /// What each job's policy wants (the pipeline wishes for the most of them, so a share
    /// group is sized for the job that gains from the most workers: its fastest).
    pub job_wants: BTreeMap<JobName, u32>,
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
    /// The same, per job (kept while the job has live clients).
    job_waits: Mutex<BTreeMap<(PipelineKey, JobName), DataWaitStatus>>,
    /// Each pipeline's jobs with live clients, with their waits and wishes.
    jobs: Mutex<BTreeMap<PipelineKey, Vec<JobStatus>>>,
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
        let mut job_waits = self.job_waits.lock().unwrap();
        let mut changed = false;
        for jw in windows {
            changed |= waits.entry(jw.pipeline.clone()).or_default().add(&jw.windows);
            job_waits.entry((jw.pipeline.clone(), jw.job.clone())).or_default().add(&jw.windows);
        }
        changed
    }

    /// The pipeline's jobs with live clients; None if the dispatcher does not know it.
    pub fn job_list(&self, pipeline: &PipelineKey) -> Option<Vec<JobStatus>> {
        self.jobs.lock().unwrap().get(pipeline).cloned()
    }

    pub fn all_jobs(&self) -> BTreeMap<PipelineKey, Vec<JobStatus>> {
        self.jobs.lock().unwrap().clone()
    }

    /// Replaces the jobs (the dispatcher's list) with each one's wait and what its policy
    /// wants added; forgets the waits of jobs no longer listed. Returns whether anything
    /// changed.
    pub fn set_jobs(&self, mut jobs: BTreeMap<PipelineKey, Vec<JobStatus>>) -> bool {
        let records = self.records.lock().unwrap();
        let mut job_waits = self.job_waits.lock().unwrap();
        job_waits.retain(|(key, name), _| jobs.get(key).is_some_and(|js| js.iter().any(|j| j.name == *name)));
        for (key, list) in &mut jobs {
            for job in list {
                job.data_wait = job_waits.get(&(key.clone(), job.name.clone())).cloned();
                job.workers_wanted = records.get(key).and_then(|r| r.job_wants.get(&job.name).copied());
            }
        }
        drop((records, job_waits));
        replace(&self.jobs, jobs)
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
        self.jobs.lock().unwrap().remove(pipeline);
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
    fn waits_are_summed_per_pipeline_and_per_job_over_rounds() {
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

        // Per job: each job's own waits and what its policy wants, while it is listed.
        book.update(&key("a"), |r| r.job_wants = BTreeMap::from([("j".into(), 5), ("k".into(), 2)]));
        let listed = |names: &[&str]| {
            let jobs = names.iter().map(|&n| JobStatus { name: n.into(), consumers: 1, ..JobStatus::default() });
            BTreeMap::from([(key("a"), jobs.collect::<Vec<_>>())])
        };
        assert!(book.set_jobs(listed(&["j", "k"])));
        let jobs = book.job_list(&key("a")).unwrap();
        let j = jobs[0].data_wait.as_ref().unwrap();
        assert_eq!((j.waiting_seconds, j.total_seconds, jobs[0].workers_wanted), (2.0, 3.0, Some(5)));
        let k = jobs[1].data_wait.as_ref().unwrap();
        assert_eq!((k.waiting_seconds, k.total_seconds, jobs[1].workers_wanted), (0.0, 2.0, Some(2)));
        assert!(!book.set_jobs(listed(&["j", "k"])), "nothing new");
        // k's clients left: it is not listed, and its waits are forgotten (a job of that name
        // later is another trial).
        assert!(book.set_jobs(listed(&["j"])));
        assert!(book.set_jobs(listed(&["j", "k"])));
        assert_eq!(book.job_list(&key("a")).unwrap()[1].data_wait, None);
        assert_eq!(book.job_list(&key("b")), None, "a pipeline the dispatcher does not know");
    }
}
