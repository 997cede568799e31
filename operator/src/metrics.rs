//! Prometheus metrics of the operator.

use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use stoker_api::{DataPipeline, Phase};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    reconciles: IntCounter,
    failures: IntCounterVec,
    duration: Histogram,
    pipelines: IntGaugeVec,
    pub leader: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let reconciles = IntCounter::new("stoker_reconciles_total", "DataPipeline reconciles").unwrap();
        let failures = IntCounterVec::new(
            Opts::new("stoker_reconcile_failures_total", "Failed DataPipeline reconciles by error kind"),
            &["error"],
        )
        .unwrap();
        let duration = Histogram::with_opts(
            HistogramOpts::new("stoker_reconcile_duration_seconds", "Time to reconcile one DataPipeline")
                .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
        )
        .unwrap();
        let pipelines =
            IntGaugeVec::new(Opts::new("stoker_pipelines", "DataPipelines by phase"), &["phase"]).unwrap();
        let leader = IntGauge::new("stoker_leader", "1 while this operator process holds the leader lease").unwrap();
        let registry = Registry::new();
        registry.register(Box::new(reconciles.clone())).unwrap();
        registry.register(Box::new(failures.clone())).unwrap();
        registry.register(Box::new(duration.clone())).unwrap();
        registry.register(Box::new(pipelines.clone())).unwrap();
        registry.register(Box::new(leader.clone())).unwrap();
        Metrics { registry, reconciles, failures, duration, pipelines, leader }
    }
}

impl Metrics {
    pub fn reconciled(&self, took: Duration) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
    }

    pub fn failed(&self, kind: &str) {
        self.failures.with_label_values(&[kind]).inc();
    }

    /// Recounts pipelines by phase from the controller's cache, so deleted pipelines drop out.
    pub fn count_phases<'a>(&self, pipelines: impl IntoIterator<Item = &'a DataPipeline>) {
        self.pipelines.reset();
        for dp in pipelines {
            let phase = dp.status.as_ref().and_then(|s| s.phase).map_or("Unknown".to_string(), |p: Phase| format!("{p:?}"));
            self.pipelines.with_label_values(&[&phase]).inc();
        }
    }

    pub fn render(&self) -> String {
        prometheus::TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_default()
    }
}
