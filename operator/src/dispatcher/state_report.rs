//! What the dispatcher reports of each pipeline for status and metrics: its jobs, its share
//! groups, its delivery counters and its workers' warnings, mix shares and per-op tallies.

use std::collections::BTreeMap;

use stoker_api::{DeliveryStatus, JobStatus, MAX_JOBS_LISTED, OpTotals, ShareName, WorkersReport};

use super::DispatcherState;
use crate::dispatcher::ledger::JobSummary;
use crate::dispatcher::pipeline::Phase;
use crate::dispatcher::share::ShareCounts;
use crate::key::PipelineKey;

impl DispatcherState {
    /// Every pipeline's jobs with live clients (at most `MAX_JOBS_LISTED` each, by name): the
    /// dispatcher's half of `status.jobs` (the autoscaler adds waits and wishes).
    pub fn job_statuses(&self) -> BTreeMap<PipelineKey, Vec<JobStatus>> {
        self.pipelines
            .iter()
            .map(|(key, p)| {
                let jobs =
                    self.members.clients_per_job(key).into_iter().take(MAX_JOBS_LISTED).map(|(name, consumers)| {
                        let entry = p.jobs.get(&name);
                        let share = entry.and_then(|e| e.share.clone());
                        let counts = share.as_ref().and_then(|s| p.shares.get(s)).map(|s| &s.counts);
                        let count = |of: fn(&ShareCounts) -> &BTreeMap<_, u64>| {
                            counts.and_then(|c| of(c).get(&name).copied()).unwrap_or(0)
                        };
                        JobStatus {
                            epoch: entry.map_or(0, |e| e.epoch()),
                            shared_taken: count(|c| &c.taken),
                            shared_missed: count(|c| &c.missed),
                            share,
                            consumers,
                            name,
                            ..JobStatus::default()
                        }
                    });
                (key.clone(), jobs.collect())
            })
            .collect()
    }

    pub fn jobs(&self, pipeline: &PipelineKey) -> Vec<JobSummary> {
        let Some(p) = self.pipelines.get(pipeline) else { return Vec::new() };
        let splits = p.ledger_plan().splits;
        p.jobs
            .iter()
            .filter_map(|(name, entry)| match &entry.phase {
                Phase::Running(job) => Some(job.summary(name, splits)),
                _ => None,
            })
            .collect()
    }

    /// The pipeline's share groups' counters.
    pub fn share_counts(&self, pipeline: &PipelineKey) -> Vec<(ShareName, ShareCounts)> {
        let Some(p) = self.pipelines.get(pipeline) else { return Vec::new() };
        p.shares.iter().map(|(name, share)| (name.clone(), share.counts.clone())).collect()
    }

    /// Every pipeline's delivery counters, summed over its jobs.
    pub fn delivery_statuses(&self) -> BTreeMap<PipelineKey, DeliveryStatus> {
        self.pipelines
            .keys()
            .map(|key| {
                let mut d = DeliveryStatus {
                    rows_dropped_for_equal_ranks: self.pipelines[key]
                        .jobs
                        .values()
                        .filter_map(|entry| Some(entry.ranks.as_ref()?.dropped_rows()))
                        .sum(),
                    ..DeliveryStatus::default()
                };
                for counts in self.pipelines[key].shares.values().map(|share| &share.counts) {
                    d.shared_productions += counts.productions;
                    d.shared_deliveries += counts.deliveries();
                    d.shared_missed += counts.missed.values().sum::<u64>();
                }
                for (_, w) in self.members.workers_of(key) {
                    // Saturating: the counts are the workers' word.
                    d.shared_made_again = d.shared_made_again.saturating_add(w.progress.sharing.made_again);
                    d.shared_kept_bytes = d.shared_kept_bytes.saturating_add(w.progress.sharing.kept_bytes);
                }
                for job in self.jobs(key) {
                    d.splits_produced_again += job.requeued;
                    d.redeliveries_skipped += job.skipped;
                    d.splits_repeated += job.repeats;
                    d.recoveries_unacknowledged += job.unacknowledged;
                }
                (key.clone(), d)
            })
            .collect()
    }

    /// Every pipeline's workers' report: their warnings, bounded as a status holds them (a
    /// pipeline whose workers have none: empty, so a cleared warning leaves the status), and
    /// the shares of the mix's sources in the elements they produced.
    pub fn reports(&self) -> BTreeMap<PipelineKey, WorkersReport> {
        // Per pipeline: warnings, rows per source, tallies per op.
        type Gathered = (Vec<String>, Vec<u64>, Vec<OpTotals>);
        let mut all: BTreeMap<PipelineKey, Gathered> = BTreeMap::new();
        for (_, w) in self.members.workers() {
            let (warnings, elements, ops) = all.entry(w.pipeline.clone()).or_default();
            OpTotals::add_into(ops, &w.progress.ops);
            // A worker that stopped producing (onError: fail) says why here too.
            warnings.extend(w.progress.error.iter().map(|e| format!("a worker stopped: {e}")));
            warnings.extend(w.progress.warnings.iter().cloned());
            if elements.len() < w.progress.source_elements.len() {
                elements.resize(w.progress.source_elements.len(), 0);
            }
            for (sum, n) in elements.iter_mut().zip(&w.progress.source_elements) {
                *sum += n;
            }
        }
        all.into_iter()
            .map(|(key, (warnings, elements, ops))| {
                let report = WorkersReport {
                    warnings: stoker_api::bounded_warnings(warnings),
                    source_shares: WorkersReport::shares(&elements),
                    ops,
                };
                (key, report)
            })
            .collect()
    }
}
