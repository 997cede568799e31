//! What the operator reports about a DataPipeline.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataPipelineStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkersStatus>,
    /// Mean client batch time of the last observation window (1 / training speed), in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_time_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaler: Option<AutoscalerStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliveryStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_wait: Option<DataWaitStatus>,
    /// The jobs reading the pipeline now (those with live clients), by name: each one's share
    /// group, what it waited, what the autoscaler's policy for it wants, and what it took from
    /// its group's productions. At most `MAX_JOBS_LISTED`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<JobStatus>,
    /// What the workers changed of the spec to stay within their bounds, e.g. a shuffle buffer
    /// capped by the memory budget (see docs/security.md#bounds). Empty when they run it as
    /// written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// With spec.source.mix: each source's weight beside its realised share of the rows the
    /// live workers produced, in spec order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mix: Vec<MixStatus>,
    /// Where the live workers' time goes, op by op: each op's share of their thread time, its
    /// cost per element, and the op that dominates (docs/observability.md#the-profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<crate::ProfileStatus>,
    /// Ready, Progressing and Degraded, each with a reason and a message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Workers are being created or are not ready yet.
    Pending,
    /// Workers run; the first epoch is measured for the cache decision.
    Profiling,
    /// The autoscaler is searching for the worker count.
    Scaling,
    /// The autoscaler found the worker count where batch time stops improving.
    Converged,
    /// Workers are ready and no client is attached.
    Idle,
    /// The spec cannot run; the Ready condition's message says what to fix.
    Invalid,
    /// Something failed after the spec was accepted; see the Degraded condition.
    Degraded,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkersStatus {
    pub desired: i32,
    pub ready: i32,
    /// "ready/desired", for `kubectl get`.
    pub summary: String,
}

impl WorkersStatus {
    pub fn new(desired: i32, ready: i32) -> Self {
        WorkersStatus { desired, ready, summary: format!("{ready}/{desired}") }
    }
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalerStatus {
    pub converged: bool,
    /// Where the search is: Growing, Bisecting, Converged, Idle...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Workers this pipeline wanted beyond its share of the cluster-wide worker budget or its
    /// namespace's worker cap.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_back_by_budget: u32,
    /// Set while the pipeline is converged and its clients still wait for data: when growth
    /// will be tried again, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<String>,
    /// With an automatic `echo` (`maxFactor`): the factor in force and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<EchoStatus>,
    /// Newest last; bounded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<ScalingStep>,
}

/// The echo factor the operator set for a pipeline's automatic `echo`.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EchoStatus {
    /// Rows per element for splits handed out from now on (1: no repeats).
    pub factor: u32,
    pub reason: String,
}

/// One scaling decision and the observation behind it.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingStep {
    /// RFC 3339 time of the decision.
    pub time: String,
    pub workers: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_time_ms: Option<f64>,
    pub reason: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheStatus {
    pub decision: CacheDecision,
    /// Index in spec.transforms of the autocache hint the decision is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<i64>,
    #[serde(default)]
    pub complete: bool,
    /// Why: the numbers behind the decision, or what made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Epoch times the decision predicted from the first epoch's measurements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<EpochSeconds>,
    /// Epoch times measured, the latest of each kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<EpochSeconds>,
}

/// How long the pipeline's training consumers waited for its batches: the accelerator time
/// lost to input, from the windows they report (time in `next()` against time between
/// batches), summed over consumers since the leading operator started (its dispatcher keeps
/// no history across a leader change).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataWaitStatus {
    /// Of the consumers' time in the latest windows, the fraction spent waiting for data.
    pub fraction: f64,
    /// Consumer time spent waiting for data, in seconds.
    pub waiting_seconds: f64,
    /// Consumer time in all (each batch's time, waiting included), in seconds.
    pub total_seconds: f64,
}

impl DataWaitStatus {
    /// Adds the windows of one round; the fraction becomes theirs. False if they hold no batch.
    pub fn add(&mut self, windows: &[crate::window::Window]) -> bool {
        let (mut waiting, mut total) = (0.0, 0.0);
        for w in windows {
            let seconds = w.batches as f64 * w.mean_s;
            total += seconds;
            waiting += seconds * w.wait_fraction.clamp(0.0, 1.0);
        }
        if total <= 0.0 {
            return false;
        }
        self.fraction = waiting / total;
        self.waiting_seconds += waiting;
        self.total_seconds += total;
        true
    }
}

/// Jobs listed in `status.jobs` at most (a status is one object: it must stay small); the
/// rest are summed in the pipeline's figures as always.
pub const MAX_JOBS_LISTED: usize = 64;

/// One job reading the pipeline, as the leading operator sees it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobStatus {
    pub name: crate::JobName,
    /// The share group its clients named (docs/reuse.md), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<crate::ShareName>,
    /// Its live clients.
    pub consumers: u32,
    /// The epoch it reads.
    pub epoch: u64,
    /// How long its consumers waited for data, since they first reported to this leader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_wait: Option<DataWaitStatus>,
    /// The workers the autoscaler's policy for this job wants (the pipeline runs the most any
    /// of its jobs wants, within the caps); none before its first judged window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_wanted: Option<u32>,
    /// Splits it got from its group's productions (made once for several jobs).
    #[serde(default)]
    pub shared_taken: u64,
    /// Productions of its group it waited for but had no room for (it read more slowly than
    /// the others): each a split made again for it.
    #[serde(default)]
    pub shared_missed: u64,
}

/// How the pipeline's elements reached its training jobs, summed over jobs since the leading
/// operator started (its dispatcher keeps no history across a leader change).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryStatus {
    /// Splits handed out again: those in flight on a worker that died, and a job's in-flight
    /// splits when a client of it left holding batches it had not read (a trial closing with
    /// the next epoch on its way).
    pub splits_produced_again: u64,
    /// Elements those splits left out because a client already had them: re-deliveries
    /// avoided.
    pub redeliveries_skipped: u64,
    /// Splits reported done twice: some of their elements may have reached a job twice (a
    /// client went silent holding them, or never acknowledged a dead worker's rows).
    pub splits_repeated: u64,
    /// Dead workers' splits produced again without waiting for a client's acknowledgement
    /// (it never came within the client timeout).
    pub recoveries_unacknowledged: u64,
    /// Rows jobs read by ranks received beyond an epoch's equal count per rank and dropped
    /// (each rank yields the same number of batches; the remainder is not spread).
    #[serde(default)]
    pub rows_dropped_for_equal_ranks: u64,
    /// Share groups (docs/reuse.md): splits made once for several jobs, summed over groups.
    #[serde(default)]
    pub shared_productions: u64,
    /// The (job, split) deliveries those productions were for: with `sharedProductions`, how
    /// many jobs a production served on average.
    #[serde(default)]
    pub shared_deliveries: u64,
    /// Productions a job of a group waited for but had no room for on that worker (it read
    /// more slowly): each a split made again for it later.
    #[serde(default)]
    pub shared_missed: u64,
    /// Productions a taker on a worker made itself: the maker's copy was gone (no room in the
    /// memory budget, its maker stopped) or late.
    #[serde(default)]
    pub shared_made_again: u64,
    /// Bytes the live workers hold now in copies waiting for their takers (inside their memory
    /// budgets).
    #[serde(default)]
    pub shared_kept_bytes: u64,
}

/// Seconds per epoch computing everything, writing the cache, and reading it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EpochSeconds {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub put: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub get: Option<f64>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CacheDecision {
    /// Not measured yet.
    #[default]
    Undecided,
    /// Recompute everything (also the decision when cache.mode is Never).
    Compute,
    /// Write the elements at `at` to the cache this epoch.
    Put,
    /// Read the elements at `at` from a complete cache entry.
    Get,
}

/// Condition types reported in status.conditions.
pub mod condition {
    pub const READY: &str = "Ready";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The most warnings a status (and a worker's report) holds: workers are many, and what they
/// report is their word, so it is bounded before it is kept.
pub const MAX_WARNINGS: usize = 8;
/// The longest warning kept, in bytes (longer ones are cut at a character boundary).
pub const MAX_WARNING_BYTES: usize = 512;

/// `warnings` bounded as a status holds them: each cut to `MAX_WARNING_BYTES`, duplicates
/// (the same warning from several workers) once, sorted, at most `MAX_WARNINGS`.
pub fn bounded_warnings(warnings: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut kept = std::collections::BTreeSet::new();
    for mut w in warnings {
        if w.len() > MAX_WARNING_BYTES {
            let mut end = MAX_WARNING_BYTES;
            while !w.is_char_boundary(end) {
                end -= 1;
            }
            w.truncate(end);
        }
        kept.insert(w);
    }
    kept.into_iter().take(MAX_WARNINGS).collect()
}

#[cfg(test)]
mod warnings_tests {
    use super::*;

    #[test]
    fn warnings_are_cut_deduplicated_and_capped() {
        let long = "é".repeat(MAX_WARNING_BYTES); // 2 bytes each: cut inside a character
        let many = (0..20).map(|i| format!("w{i:02}"));
        let bounded = bounded_warnings(many.chain([long, "w00".into()]));
        assert_eq!(bounded.len(), MAX_WARNINGS);
        assert_eq!(bounded[0], "w00");
        assert_eq!(bounded.iter().filter(|w| *w == "w00").count(), 1);
        let cut = bounded_warnings(["é".repeat(MAX_WARNING_BYTES)]);
        assert_eq!(cut[0].len(), MAX_WARNING_BYTES);
        assert!(cut[0].chars().all(|c| c == 'é'));
    }
}

/// One source of a mix: its share of the weights beside its share of what was produced.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MixStatus {
    pub uri: String,
    /// Its weight over the sum of the weights.
    pub weight: f64,
    /// Its rows (elements, or packed rows after `pack`) over all the mix's rows, as the live
    /// workers counted them since they started, rounded to 0.001; absent until they produced any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub realised: Option<f64>,
}

/// What a pipeline's live workers report for its status, gathered by the dispatcher.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkersReport {
    /// What they changed of the spec to stay within bounds, and why any stopped.
    pub warnings: Vec<String>,
    /// Each source's share of the rows they produced, in spec.source.mix order, rounded to
    /// 0.001 so that the status changes only when a share does; empty before any element.
    pub source_shares: Vec<f64>,
    /// Each transform's thread time and elements in and out, summed over them, in spec order.
    pub ops: Vec<crate::OpTotals>,
}

impl WorkersReport {
    /// Shares of `counts` (rows per source), rounded to 0.001.
    pub fn shares(counts: &[u64]) -> Vec<f64> {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return Vec::new();
        }
        counts.iter().map(|&n| (n as f64 / total as f64 * 1000.0).round() / 1000.0).collect()
    }
}

#[cfg(test)]
mod data_wait_tests {
    use super::*;
    use crate::window::Window;

    fn window(batches: u64, mean_s: f64, wait_fraction: f64) -> Window {
        Window { workers: 1, batches, median_s: mean_s, p90_s: mean_s, mean_s, wait_fraction }
    }

    #[test]
    fn waits_add_up_over_consumers_and_rounds() {
        let mut wait = DataWaitStatus::default();
        // Two consumers: 10 batches of 0.2 s waiting half the time, 30 of 0.1 s never waiting.
        assert!(wait.add(&[window(10, 0.2, 0.5), window(30, 0.1, 0.0)]));
        assert!((wait.total_seconds - 5.0).abs() < 1e-9 && (wait.waiting_seconds - 1.0).abs() < 1e-9);
        assert!((wait.fraction - 0.2).abs() < 1e-9);
        // A round without batches changes nothing; a later one adds and sets the fraction.
        assert!(!wait.add(&[window(0, 0.0, 0.0)]));
        assert!(wait.add(&[window(10, 0.1, 1.5)]));
        assert!((wait.total_seconds - 6.0).abs() < 1e-9 && (wait.waiting_seconds - 2.0).abs() < 1e-9);
        assert_eq!(wait.fraction, 1.0, "a fraction over 1 counts as 1");
    }
}
