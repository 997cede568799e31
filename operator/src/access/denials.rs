//! Refused calls, counted for Prometheus and tallied per pipeline and caller until the Events
//! loop takes them: a tenant probing another's pipeline shows up on that pipeline as a
//! Warning Event with a count, not as one Event per call.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus::{IntCounterVec, Opts};

use super::Refusal;
use crate::key::PipelineKey;

/// Distinct (pipeline, caller) pairs kept between two takes; more are only counted.
const MAX_TALLIED: usize = 10_000;

/// Refusals of one caller on one pipeline since the last take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tally {
    pub pipeline: PipelineKey,
    /// The caller's username, or `(no valid token)`.
    pub caller: String,
    pub count: u64,
    /// The last refusal's message.
    pub last: String,
}

pub struct Denials {
    refused: IntCounterVec,
    tally: Mutex<BTreeMap<(PipelineKey, String), (u64, String)>>,
}

impl Default for Denials {
    fn default() -> Self {
        let refused = IntCounterVec::new(
            Opts::new("stoker_access_refused_total", "Dispatcher calls refused, by RPC and reason"),
            &["rpc", "reason"],
        )
        .expect("valid metric");
        Denials { refused, tally: Mutex::new(BTreeMap::new()) }
    }
}

impl Denials {
    /// The counter, for the operator's registry.
    pub fn counter(&self) -> IntCounterVec {
        self.refused.clone()
    }

    /// Counts a refusal of `rpc`; one naming a pipeline is tallied for its Events (an
    /// unavailable API server is nobody's fault and makes none).
    pub fn record(&self, rpc: &str, pipeline: Option<&PipelineKey>, refusal: &Refusal) {
        let caller = refusal.caller();
        self.refused.with_label_values(&[rpc, refusal.kind()]).inc();
        tracing::warn!(rpc, pipeline = ?pipeline.map(ToString::to_string), caller, reason = %refusal, "call refused");
        let Some(pipeline) = pipeline.filter(|_| !matches!(refusal, Refusal::Unavailable(_))) else { return };
        let caller = caller.unwrap_or("(no valid token)").to_string();
        let mut tally = self.tally.lock().unwrap();
        let key = (pipeline.clone(), caller);
        if tally.len() >= MAX_TALLIED && !tally.contains_key(&key) {
            return;
        }
        let entry = tally.entry(key).or_default();
        entry.0 += 1;
        entry.1 = refusal.to_string();
    }

    /// What was refused since the last take.
    pub fn take(&self) -> Vec<Tally> {
        std::mem::take(&mut *self.tally.lock().unwrap())
            .into_iter()
            .map(|((pipeline, caller), (count, last))| Tally { pipeline, caller, count, last })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_and_tallied_per_pipeline_and_caller() {
        let denials = Denials::default();
        let p = PipelineKey::new("a", "train");
        let denied = Refusal::Denied { who: "system:serviceaccount:b:reader".into(), why: "nope".into() };
        denials.record("RegisterClient", Some(&p), &denied);
        denials.record("WatchWorkers", Some(&p), &denied);
        denials.record("RegisterClient", Some(&p), &Refusal::BadToken("expired".into()));
        denials.record("RegisterClient", Some(&p), &Refusal::Unavailable("down".into()));
        denials.record("NextSplit", None, &Refusal::BadToken("expired".into()));
        let counter = denials.counter();
        assert_eq!(counter.with_label_values(&["RegisterClient", "permission_denied"]).get(), 1);
        assert_eq!(counter.with_label_values(&["RegisterClient", "unauthenticated"]).get(), 1);
        assert_eq!(counter.with_label_values(&["RegisterClient", "unavailable"]).get(), 1);
        let tally = denials.take();
        assert_eq!(tally.len(), 2, "{tally:?}");
        assert_eq!(tally[0].caller, "(no valid token)");
        assert_eq!((tally[1].caller.as_str(), tally[1].count), ("system:serviceaccount:b:reader", 2));
        assert!(denials.take().is_empty(), "taken");
    }
}
