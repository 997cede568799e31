//! Prometheus metrics of the operator.

use std::time::Duration;

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::autoscaling::{Rescale, ScalingRecord};
use stoker_api::{DataPipeline, DataWaitStatus, DeliveryStatus, Phase};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    reconciles: IntCounter,
    failures: IntCounterVec,
    duration: Histogram,
    pipelines: IntGaugeVec,
    pub leader: IntGauge,
    workers: IntGaugeVec,
    batch_time: GaugeVec,
    wait: GaugeVec,
    converged: IntGaugeVec,
    held_back: IntGaugeVec,
    rescales: IntCounterVec,
    delivery: IntGaugeVec,
    consumer_seconds: GaugeVec,
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
        let pipelines = IntGaugeVec::new(Opts::new("stoker_pipelines", "DataPipelines by phase"), &["phase"]).unwrap();
        let leader = IntGauge::new("stoker_leader", "1 while this operator process holds the leader lease").unwrap();
        let labels = &["namespace", "pipeline"];
        let workers = IntGaugeVec::new(
            Opts::new("stoker_autoscaler_workers", "Workers the autoscaler decided per pipeline"),
            labels,
        )
        .unwrap();
        let batch_time = GaugeVec::new(
            Opts::new(
                "stoker_autoscaler_batch_time_seconds",
                "Mean client batch time of the last window (1 / training speed)",
            ),
            labels,
        )
        .unwrap();
        let wait = GaugeVec::new(
            Opts::new("stoker_autoscaler_wait_fraction", "Clients' time waiting for data / batch time"),
            labels,
        )
        .unwrap();
        let converged = IntGaugeVec::new(
            Opts::new("stoker_autoscaler_converged", "1 when the worker count search has converged"),
            labels,
        )
        .unwrap();
        let held_back = IntGaugeVec::new(
            Opts::new("stoker_autoscaler_held_back_workers", "Workers wanted beyond the cluster-wide budget"),
            labels,
        )
        .unwrap();
        let rescales =
            IntCounterVec::new(Opts::new("stoker_autoscaler_rescales_total", "Rescale decisions per pipeline"), labels)
                .unwrap();
        let delivery = IntGaugeVec::new(
            Opts::new(
                "stoker_dispatcher_delivery",
                "Delivery counters per pipeline since this leader started: splits_produced_again (their \
                 worker died), redeliveries_skipped (elements a client already had), splits_repeated, \
                 recoveries_unacknowledged, rows_dropped_for_equal_ranks (a job read by ranks: rows \
                 beyond an epoch's equal count per rank), and for share groups shared_productions, \
                 shared_deliveries, shared_missed, shared_made_again, shared_kept_bytes",
            ),
            &["namespace", "pipeline", "counter"],
        )
        .unwrap();
        let consumer_seconds = GaugeVec::new(
            Opts::new(
                "stoker_pipeline_consumer_seconds",
                "Training consumers' time per pipeline since this leader started, from the windows \
                 they report: waiting_for_data (the accelerator time lost to input) and in_all",
            ),
            &["namespace", "pipeline", "spent"],
        )
        .unwrap();
        let registry = Registry::new();
        registry.register(Box::new(delivery.clone())).unwrap();
        registry.register(Box::new(consumer_seconds.clone())).unwrap();
        registry.register(Box::new(workers.clone())).unwrap();
        registry.register(Box::new(batch_time.clone())).unwrap();
        registry.register(Box::new(wait.clone())).unwrap();
        registry.register(Box::new(converged.clone())).unwrap();
        registry.register(Box::new(held_back.clone())).unwrap();
        registry.register(Box::new(rescales.clone())).unwrap();
        registry.register(Box::new(reconciles.clone())).unwrap();
        registry.register(Box::new(failures.clone())).unwrap();
        registry.register(Box::new(duration.clone())).unwrap();
        registry.register(Box::new(pipelines.clone())).unwrap();
        registry.register(Box::new(leader.clone())).unwrap();
        Metrics {
            registry,
            reconciles,
            failures,
            duration,
            pipelines,
            leader,
            workers,
            batch_time,
            wait,
            converged,
            held_back,
            rescales,
            delivery,
            consumer_seconds,
        }
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
            let phase =
                dp.status.as_ref().and_then(|s| s.phase).map_or("Unknown".to_string(), |p: Phase| format!("{p:?}"));
            self.pipelines.with_label_values(&[&phase]).inc();
        }
    }

    /// The autoscaler's view after a round.
    pub fn scaling(
        &self,
        records: &std::collections::BTreeMap<crate::key::PipelineKey, ScalingRecord>,
        rescales: &[Rescale],
    ) {
        for (key, r) in records {
            let labels = [key.namespace.as_str(), key.name.as_str()];
            self.workers.with_label_values(&labels).set(i64::from(r.workers));
            self.batch_time.with_label_values(&labels).set(r.batch_time_ms.unwrap_or(0.0) / 1e3);
            self.wait.with_label_values(&labels).set(r.wait_fraction.unwrap_or(0.0));
            self.converged.with_label_values(&labels).set(i64::from(r.converged));
            self.held_back.with_label_values(&labels).set(i64::from(r.held_back));
        }
        for r in rescales {
            self.rescales.with_label_values(&[r.pipeline.namespace.as_str(), r.pipeline.name.as_str()]).inc();
        }
    }

    /// The dispatcher's delivery counters.
    pub fn deliveries(&self, deliveries: &std::collections::BTreeMap<crate::key::PipelineKey, DeliveryStatus>) {
        for (key, d) in deliveries {
            for (counter, value) in [
                ("splits_produced_again", d.splits_produced_again),
                ("redeliveries_skipped", d.redeliveries_skipped),
                ("splits_repeated", d.splits_repeated),
                ("recoveries_unacknowledged", d.recoveries_unacknowledged),
                ("rows_dropped_for_equal_ranks", d.rows_dropped_for_equal_ranks),
                ("shared_productions", d.shared_productions),
                ("shared_deliveries", d.shared_deliveries),
                ("shared_missed", d.shared_missed),
                ("shared_made_again", d.shared_made_again),
                ("shared_kept_bytes", d.shared_kept_bytes),
            ] {
                let labels = [key.namespace.as_str(), key.name.as_str(), counter];
                self.delivery.with_label_values(&labels).set(value as i64);
            }
        }
    }

    /// How long each pipeline's consumers waited for data, and their time in all.
    pub fn data_waits(&self, waits: &std::collections::BTreeMap<crate::key::PipelineKey, DataWaitStatus>) {
        for (key, w) in waits {
            for (spent, seconds) in [("waiting_for_data", w.waiting_seconds), ("in_all", w.total_seconds)] {
                let labels = [key.namespace.as_str(), key.name.as_str(), spent];
                self.consumer_seconds.with_label_values(&labels).set(seconds);
            }
        }
    }

    pub fn render(&self) -> String {
        prometheus::TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::PipelineKey;

    #[test]
    fn consumers_wait_for_data_is_exported_per_pipeline() {
        let metrics = Metrics::default();
        let key = PipelineKey { namespace: "team-a".into(), name: "imagenet".into() };
        let wait = DataWaitStatus { fraction: 0.25, waiting_seconds: 3.5, total_seconds: 14.0 };
        metrics.data_waits(&[(key, wait)].into());
        let text = metrics.render();
        for line in [
            r#"stoker_pipeline_consumer_seconds{namespace="team-a",pipeline="imagenet",spent="waiting_for_data"} 3.5"#,
            r#"stoker_pipeline_consumer_seconds{namespace="team-a",pipeline="imagenet",spent="in_all"} 14"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
