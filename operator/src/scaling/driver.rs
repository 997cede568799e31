//! One scaling round, without I/O: the clients' windows of every (pipeline, job) go to that
//! job's policy, a pipeline wishes for the most any of its jobs wants, the cluster-wide budget
//! is shared out by marginal gain, and the result is a list of rescales with their reasons.
//! The async loop around it (`run`) only moves data in and out.

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_api::{AutoscalingPolicy, ScalingStep};

use super::ScalingRecord;
use crate::autoscaler::{self, Decision, Limits, Policy, Window};
use crate::dispatcher::{ClientWindow, JobWindows, PipelineKey};

/// A pipeline the autoscaler is responsible for (mode BatchTime, valid spec).
#[derive(Clone, Debug, PartialEq)]
pub struct Scaled {
    pub key: PipelineKey,
    pub min: u32,
    pub max: u32,
    pub policy: AutoscalingPolicy,
    /// Workers it runs now.
    pub workers: u32,
}

/// A change to make.
#[derive(Clone, Debug, PartialEq)]
pub struct Rescale {
    pub pipeline: PipelineKey,
    pub from: u32,
    pub to: u32,
    pub reason: String,
}

struct JobPolicy {
    policy: Box<dyn Policy + Send>,
    /// The policy's last wish.
    wants: u32,
    last: Option<Window>,
    model: autoscaler::budget::Model,
}

/// Policies per (pipeline, job) and idle clocks per pipeline, across rounds.
#[derive(Default)]
pub struct Driver {
    jobs: BTreeMap<(PipelineKey, String), JobPolicy>,
    /// Time without any attached client, per pipeline.
    detached: BTreeMap<PipelineKey, Duration>,
    /// Windows reported since the pipeline's last judgement, per (pipeline, job).
    pending: BTreeMap<(PipelineKey, String), Vec<ClientWindow>>,
    /// Time since each pipeline was last judged.
    since: BTreeMap<PipelineKey, Duration>,
}

impl Driver {
    /// One round: `elapsed` since the last one, the windows taken from the dispatcher, the
    /// pipelines in scope, and the cluster-wide budget (None: unlimited). Returns the rescales
    /// and each pipeline's new record.
    pub fn round(
        &mut self,
        elapsed: Duration,
        now: &str,
        windows: Vec<JobWindows>,
        pipelines: &[Scaled],
        budget: Option<u32>,
        previous: &BTreeMap<PipelineKey, ScalingRecord>,
    ) -> (Vec<Rescale>, BTreeMap<PipelineKey, ScalingRecord>) {
        let in_scope: BTreeMap<&PipelineKey, &Scaled> = pipelines.iter().map(|p| (&p.key, p)).collect();
        self.jobs.retain(|(key, _), _| in_scope.contains_key(key));
        self.detached.retain(|key, _| in_scope.contains_key(key));
        self.pending.retain(|(key, _), _| in_scope.contains_key(key));
        self.since.retain(|key, _| in_scope.contains_key(key));

        let mut attached: BTreeMap<PipelineKey, bool> = BTreeMap::new();
        for jw in windows {
            if !in_scope.contains_key(&jw.pipeline) {
                continue;
            }
            attached.insert(jw.pipeline.clone(), true);
            self.pending.entry((jw.pipeline, jw.job)).or_default().extend(jw.windows);
        }
        // Each pipeline is judged once per its own window.
        let mut due: Vec<&PipelineKey> = Vec::new();
        for p in pipelines {
            let since = self.since.entry(p.key.clone()).or_default();
            *since += elapsed;
            if *since >= Duration::from_secs(u64::from(p.policy.window_seconds.max(1))) {
                *since = Duration::ZERO;
                due.push(&p.key);
            }
        }

        let mut reasons: BTreeMap<PipelineKey, String> = BTreeMap::new();
        for (key, job_name) in self.pending.keys().cloned().collect::<Vec<_>>() {
            if !due.contains(&&key) {
                continue;
            }
            let p = in_scope[&key];
            let windows = self.pending.remove(&(key.clone(), job_name.clone())).unwrap_or_default();
            let Some(window) = combine(&windows, p.workers) else { continue };
            let job = self.jobs.entry((key.clone(), job_name.clone())).or_insert_with(|| JobPolicy {
                policy: autoscaler::ours(Limits { min: p.min.max(1), max: p.max }, &p.policy, p.workers),
                wants: p.workers,
                last: None,
                model: Default::default(),
            });
            job.model.update(&window);
            job.last = Some(window.clone());
            if let Decision::Scale { to, reason } = job.policy.observe(&window) {
                job.wants = to;
                reasons.insert(key.clone(), format!("job {job_name}: {reason}"));
            }
        }

        // Wishes: the most any job wants; min when no client has been attached for a while.
        let mut wishes: BTreeMap<PipelineKey, u32> = BTreeMap::new();
        for p in pipelines {
            let is_attached = attached.get(&p.key).copied().unwrap_or(false);
            let idle_for = self.detached.entry(p.key.clone()).or_default();
            *idle_for = if is_attached { Duration::ZERO } else { *idle_for + elapsed };
            let idle = !is_attached && *idle_for >= Duration::from_secs(u64::from(p.policy.idle_after_seconds));
            let wish = if idle {
                for (_, job) in self.jobs.iter_mut().filter(|((k, _), _)| k == &p.key) {
                    if let Decision::Scale { to, .. } = job.policy.idle() {
                        job.wants = to;
                    }
                }
                if p.workers != p.min {
                    reasons
                        .entry(p.key.clone())
                        .or_insert_with(|| format!("no client attached for {} s: scaling to min", idle_for.as_secs()));
                }
                p.min
            } else {
                self.jobs.iter().filter(|((k, _), _)| k == &p.key).map(|(_, j)| j.wants).max().unwrap_or(p.workers)
            };
            // Attached clients need at least one worker to measure anything (min may be 0).
            let wish = if is_attached { wish.max(1) } else { wish };
            wishes.insert(p.key.clone(), wish.clamp(p.min, p.max.max(p.min)).max(u32::from(is_attached)));
        }

        let grants = autoscaler::budget::share(
            pipelines
                .iter()
                .map(|p| autoscaler::budget::Wish {
                    key: p.key.to_string(),
                    min: p.min,
                    wants: wishes[&p.key],
                    current: p.workers,
                    model: self.model(&p.key),
                })
                .collect(),
            budget,
        );

        let mut rescales = Vec::new();
        let mut records = BTreeMap::new();
        for p in pipelines {
            let grant = grants
                .get(&p.key.to_string())
                .copied()
                .unwrap_or(autoscaler::budget::Grant { granted: wishes[&p.key], held_back: 0 });
            let held_back = wishes[&p.key].saturating_sub(grant.granted);
            let mut record = previous.get(&p.key).cloned().unwrap_or_default();
            let last = self.last_window(&p.key);
            record.workers = grant.granted;
            record.attached = attached.get(&p.key).copied().unwrap_or(false);
            record.held_back = held_back;
            record.batch_time_ms = last.as_ref().map(|w| w.mean_s * 1e3).or(record.batch_time_ms);
            record.wait_fraction = last.as_ref().map(|w| w.wait_fraction).or(record.wait_fraction);
            let states: Vec<autoscaler::PolicyState> =
                self.jobs.iter().filter(|((k, _), _)| k == &p.key).map(|(_, j)| j.policy.state()).collect();
            record.converged = !states.is_empty() && states.iter().all(|s| s.converged());
            record.state = states.iter().map(|s| s.name()).max().unwrap_or(super::IDLE).to_string();
            if grant.granted != p.workers {
                let mut reason = reasons.remove(&p.key).unwrap_or_else(|| "following the policy".into());
                if held_back > 0 {
                    reason.push_str(&format!(" (held back by {held_back} by the cluster-wide worker budget)"));
                }
                record.history.push(ScalingStep {
                    time: now.to_string(),
                    workers: grant.granted as i32,
                    batch_time_ms: record.batch_time_ms,
                    reason: reason.clone(),
                });
                rescales.push(Rescale { pipeline: p.key.clone(), from: p.workers, to: grant.granted, reason });
            }
            records.insert(p.key.clone(), record);
        }
        (rescales, records)
    }

    fn last_window(&self, key: &PipelineKey) -> Option<Window> {
        self.jobs
            .iter()
            .filter(|((k, _), _)| k == key)
            .filter_map(|(_, j)| j.last.clone())
            .max_by(|a, b| a.mean_s.total_cmp(&b.mean_s))
    }

    /// What the budget needs to predict the gain of one more worker: the model of the
    /// pipeline's slowest job.
    fn model(&self, key: &PipelineKey) -> Option<autoscaler::budget::Model> {
        self.jobs
            .iter()
            .filter(|((k, _), j)| k == key && j.last.is_some())
            .map(|(_, j)| j.model)
            .max_by(|a, b| a.batch_time(1).total_cmp(&b.batch_time(1)))
    }
}

/// The windows of one job's consumers since its last judgement as one observation at
/// `workers`: batch-weighted medians of the reported medians and p90s (robust to one odd
/// window), and the batch-weighted mean batch time and wait fraction (exact).
///
/// Only windows during which the client streamed from exactly `workers` workers count: others
/// were taken while workers started, stopped or died, and say nothing about `workers`.
pub fn combine(windows: &[ClientWindow], workers: u32) -> Option<Window> {
    let counted: Vec<&ClientWindow> = windows.iter().filter(|w| w.batches > 0 && w.workers == workers).collect();
    let batches: u64 = counted.iter().map(|w| w.batches).sum();
    if batches == 0 {
        return None;
    }
    let weighted_median = |f: fn(&ClientWindow) -> f64| {
        let mut values: Vec<(f64, u64)> = counted.iter().map(|w| (f(w), w.batches)).collect();
        values.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut seen = 0;
        for (value, n) in &values {
            seen += n;
            if seen * 2 >= batches {
                return *value;
            }
        }
        values.last().map_or(0.0, |v| v.0)
    };
    let wait = counted.iter().map(|w| w.wait_fraction * w.batches as f64).sum::<f64>() / batches as f64;
    Some(Window {
        workers,
        batches,
        median_s: weighted_median(|w| w.median_seconds),
        p90_s: weighted_median(|w| w.p90_seconds),
        mean_s: counted.iter().map(|w| w.mean_seconds * w.batches as f64).sum::<f64>() / batches as f64,
        wait_fraction: wait,
    })
}
