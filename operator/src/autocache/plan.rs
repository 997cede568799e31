//! One pipeline's cache plan, pure: what its workers report in, the directive for each split
//! out.
//!
//! - `Never`, no cache volume, or no hint: compute.
//! - A complete entry for one of the pipeline's hints (made by this pipeline, an earlier run,
//!   or another pipeline with the same prefix): read it, at the latest such hint.
//! - `Always`: write at the last hint from the first split.
//! - `Auto`: the first epoch writes at the last hint while it is measured (so a cache worth
//!   having is complete after one epoch, not two); once enough splits are measured and the
//!   volume is probed, [`decide`] keeps that, moves to another hint from the next split, or
//!   stops writing (the partial entry is never read and is cleaned up later).
//! - A corrupt entry: compute, and never use that entry again.

use stoker_api::proto::HintBytes;
use stoker_api::{CacheDecision, CacheMode, CacheStatus, EpochSeconds};

use super::{Choice, Decision, HintProfile, Profile, decide};

/// An `autocache` item of the pipeline and the fingerprint of the data there.
#[derive(Clone, Debug, PartialEq)]
pub struct Hint {
    pub at: u32,
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Directive {
    Compute,
    Put(Hint),
    Get(Hint),
}

/// The pipeline's workers' measurements so far, summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Splits whose elements were measured at the hints.
    pub splits: u64,
    pub elements: u64,
    /// Thread seconds per transform, in pipeline order.
    pub op_seconds: Vec<f64>,
    /// Elements and their encoded bytes per hint.
    pub hint_bytes: Vec<HintBytes>,
    pub write_bytes_per_second: f64,
    pub read_bytes_per_second: f64,
    pub workers: u32,
    pub threads: u32,
}

impl Measured {
    /// What the measurements say at the hints `at` (those measured), for an epoch of `splits`.
    pub fn profile(&self, at: impl Iterator<Item = u32>, splits: u64) -> Profile {
        let per_element = |seconds: f64| seconds / self.elements.max(1) as f64;
        let hints = at
            .filter_map(|at| {
                let &HintBytes { elements, bytes, .. } = self.hint_bytes.iter().find(|b| b.at == at)?;
                let prefix: f64 = self.op_seconds.iter().take(at as usize).sum();
                Some(HintProfile {
                    at,
                    prefix_seconds: per_element(prefix),
                    bytes: bytes as f64 / elements.max(1) as f64,
                })
            })
            .collect();
        Profile {
            elements: self.elements as f64 / self.splits.max(1) as f64 * splits as f64,
            total_seconds: per_element(self.op_seconds.iter().sum()),
            hints,
            workers: self.workers,
            threads: self.threads,
            write_bytes_per_second: self.write_bytes_per_second,
            read_bytes_per_second: self.read_bytes_per_second,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    Compute,
    /// Auto, first epoch: writing at the hint while measuring.
    Profiling(Hint),
    Put(Hint),
    Get(Hint),
}

#[derive(Clone, Debug)]
pub struct CachePlan {
    mode: CacheMode,
    hints: Vec<Hint>,
    splits: u64,
    phase: Phase,
    reason: String,
    decision: Option<Decision>,
    /// Fingerprints found corrupt: never read or written again.
    broken: Vec<String>,
    measured: EpochSeconds,
}

impl CachePlan {
    /// `hints` is empty when the workers have no cache volume.
    pub fn new(mode: CacheMode, hints: Vec<Hint>, splits: u64) -> CachePlan {
        let last = hints.iter().max_by_key(|h| h.at).cloned();
        let (phase, reason) = match (mode, last) {
            (CacheMode::Never, _) => (Phase::Compute, "cache mode Never".to_string()),
            (_, None) => {
                (Phase::Compute, "the pipeline has no autocache hint, or its workers no cache volume".to_string())
            }
            (CacheMode::Always, Some(h)) => {
                let reason = format!("cache mode Always: writing at the last hint, transform {}", h.at);
                (Phase::Put(h), reason)
            }
            (CacheMode::Auto, Some(h)) => {
                let reason =
                    format!("profiling the first epoch, writing at transform {} until the measurements decide", h.at);
                (Phase::Profiling(h), reason)
            }
        };
        CachePlan {
            mode,
            hints,
            splits,
            phase,
            reason,
            decision: None,
            broken: Vec::new(),
            measured: EpochSeconds::default(),
        }
    }

    pub fn directive(&self) -> Directive {
        match &self.phase {
            Phase::Compute => Directive::Compute,
            Phase::Profiling(h) | Phase::Put(h) => Directive::Put(h.clone()),
            Phase::Get(h) => Directive::Get(h.clone()),
        }
    }

    /// Entries known complete in the namespace: read the latest hint that has one.
    pub fn complete(&mut self, complete: &std::collections::BTreeSet<String>) {
        if self.mode == CacheMode::Never || matches!(self.phase, Phase::Get(_)) {
            return;
        }
        let usable =
            self.hints.iter().filter(|h| complete.contains(&h.fingerprint) && !self.broken.contains(&h.fingerprint));
        if let Some(h) = usable.max_by_key(|h| h.at) {
            self.reason = format!("a complete cache entry exists at transform {}: reading it", h.at);
            self.phase = Phase::Get(h.clone());
        }
    }

    /// A worker found the entry `fingerprint` corrupt and dropped it.
    pub fn corrupt(&mut self, fingerprint: &str, detail: &str) {
        if !self.hints.iter().any(|h| h.fingerprint == fingerprint) || self.broken.iter().any(|b| b == fingerprint) {
            return;
        }
        self.broken.push(fingerprint.to_string());
        self.phase = Phase::Compute;
        self.reason = format!("the cache entry {fingerprint} was corrupt ({detail}); computing instead");
    }

    /// Makes the Auto decision once a twentieth of the splits (at least one) is measured and
    /// the volume is probed.
    /// Whether the plan still measures (`measured` does nothing otherwise).
    pub fn profiling(&self) -> bool {
        matches!(self.phase, Phase::Profiling(_))
    }

    pub fn measured(&mut self, m: &Measured) {
        let Phase::Profiling(writing) = &self.phase else { return };
        let enough = m.splits >= (self.splits / 20).max(1) && m.elements > 0;
        if !enough || m.write_bytes_per_second <= 0.0 || m.read_bytes_per_second <= 0.0 {
            return;
        }
        let profile = m.profile(self.hints.iter().map(|h| h.at), self.splits);
        let decision = decide(self.mode, &profile);
        let writing = writing.clone();
        self.phase = match decision.choice {
            Choice::Compute => Phase::Compute,
            Choice::Put { at } => Phase::Put(self.hints.iter().find(|h| h.at == at).cloned().unwrap_or(writing)),
        };
        self.reason = decision.reason.clone();
        self.decision = Some(decision);
    }

    /// An epoch finished in `seconds`, with `action` the directive most of its splits had.
    pub fn epoch(&mut self, action: CacheDecision, seconds: f64) {
        match action {
            CacheDecision::Put => self.measured.put = Some(seconds),
            CacheDecision::Get => self.measured.get = Some(seconds),
            _ => self.measured.compute = Some(seconds),
        }
    }

    /// What status shows.
    pub fn status(&self, bytes: Option<i64>) -> CacheStatus {
        let (decision, hint) = match &self.phase {
            Phase::Compute => (CacheDecision::Compute, None),
            Phase::Profiling(h) => (CacheDecision::Undecided, Some(h)),
            Phase::Put(h) => (CacheDecision::Put, Some(h)),
            Phase::Get(h) => (CacheDecision::Get, Some(h)),
        };
        let predicted = self.decision.as_ref().map(|d| EpochSeconds {
            compute: Some(d.compute_epoch_seconds),
            put: d.write_epoch_seconds,
            get: d.read_epoch_seconds,
        });
        let measured = self.measured.clone();
        let any = measured.compute.is_some() || measured.put.is_some() || measured.get.is_some();
        CacheStatus {
            decision,
            at: hint.map(|h| h.at),
            fingerprint: hint.map(|h| h.fingerprint.clone()),
            bytes,
            complete: decision == CacheDecision::Get,
            reason: Some(self.reason.clone()),
            predicted,
            measured: any.then_some(measured),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn hints() -> Vec<Hint> {
        vec![Hint { at: 1, fingerprint: "sha256:a".into() }, Hint { at: 3, fingerprint: "sha256:b".into() }]
    }

    fn measured(prefix: f64, bytes: u64, bandwidth: f64) -> Measured {
        // 100 elements over 5 splits; transform 0 costs `prefix` s each, 2 and 4 0.5 ms.
        Measured {
            splits: 5,
            elements: 100,
            op_seconds: vec![prefix * 100.0, 0.0, 0.05, 0.0, 0.05],
            hint_bytes: vec![
                HintBytes { at: 1, elements: 100, bytes: bytes * 100 },
                HintBytes { at: 3, elements: 100, bytes: bytes * 100 },
            ],
            write_bytes_per_second: bandwidth,
            read_bytes_per_second: bandwidth,
            workers: 2,
            threads: 2,
        }
    }

    #[test]
    fn auto_writes_at_the_last_hint_while_profiling_then_keeps_a_cache_worth_having() {
        let mut p = CachePlan::new(CacheMode::Auto, hints(), 100);
        assert_eq!(p.directive(), Directive::Put(hints()[1].clone()));
        assert_eq!(p.status(None).decision, CacheDecision::Undecided);
        p.measured(&Measured { splits: 4, ..measured(0.004, 100_000, 1e9) });
        assert_eq!(p.status(None).decision, CacheDecision::Undecided, "4 of 100 splits are too few");
        p.measured(&measured(0.004, 100_000, 1e9));
        assert_eq!(p.directive(), Directive::Put(hints()[1].clone()));
        let status = p.status(None);
        assert_eq!((status.decision, status.at), (CacheDecision::Put, Some(3)));
        let predicted = status.predicted.unwrap();
        assert!(predicted.get.unwrap() < predicted.compute.unwrap() / 3.0, "{predicted:?}");
    }

    #[test]
    fn auto_stops_writing_when_reading_would_not_pay() {
        let mut p = CachePlan::new(CacheMode::Auto, hints(), 100);
        // A cheap prefix, 2 MB per element, a 50 MB/s volume.
        p.measured(&measured(0.0001, 2_000_000, 50e6));
        assert_eq!(p.directive(), Directive::Compute);
        assert!(p.status(None).reason.unwrap().contains("beats reading"));
    }

    #[test]
    fn a_complete_entry_is_read_at_the_latest_hint_and_a_corrupt_one_never_again() {
        let mut p = CachePlan::new(CacheMode::Auto, hints(), 100);
        p.complete(&BTreeSet::from(["sha256:a".to_string(), "sha256:other".to_string()]));
        assert_eq!(p.directive(), Directive::Get(hints()[0].clone()));
        p.complete(&BTreeSet::from(["sha256:a".to_string(), "sha256:b".to_string()]));
        assert_eq!(p.directive(), Directive::Get(hints()[0].clone()), "a Get stays on its entry");
        p.corrupt("sha256:a", "bad checksum at offset 8");
        assert_eq!(p.directive(), Directive::Compute);
        p.complete(&BTreeSet::from(["sha256:a".to_string()]));
        assert_eq!(p.directive(), Directive::Compute, "the corrupt entry is not read again");
        p.complete(&BTreeSet::from(["sha256:b".to_string()]));
        assert_eq!(p.directive(), Directive::Get(hints()[1].clone()));
    }

    #[test]
    fn never_and_no_volume_compute_and_always_writes_from_the_start() {
        let mut never = CachePlan::new(CacheMode::Never, hints(), 10);
        never.complete(&BTreeSet::from(["sha256:b".to_string()]));
        assert_eq!(never.directive(), Directive::Compute);
        assert_eq!(CachePlan::new(CacheMode::Auto, vec![], 10).directive(), Directive::Compute);
        let mut always = CachePlan::new(CacheMode::Always, hints(), 10);
        assert_eq!(always.directive(), Directive::Put(hints()[1].clone()));
        always.measured(&measured(0.0001, 2_000_000, 50e6));
        assert_eq!(always.directive(), Directive::Put(hints()[1].clone()), "Always ignores the numbers");
    }

    #[test]
    fn measured_epochs_go_to_status_by_kind() {
        let mut p = CachePlan::new(CacheMode::Always, hints(), 10);
        p.epoch(CacheDecision::Put, 12.0);
        p.epoch(CacheDecision::Get, 3.0);
        let m = p.status(None).measured.unwrap();
        assert_eq!((m.compute, m.put, m.get), (None, Some(12.0), Some(3.0)));
    }
}
