//! Prometheus metrics of the operator.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::autoscaling::{Rescale, ScalingRecord};
use stoker_api::{DataPipeline, DataWaitStatus, DeliveryStatus, JobStatus, Phase};

use crate::key::PipelineKey;

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    reconciles: IntCounter,
    failures: IntCounterVec,
    duration: Histogram,
    pipelines: IntGaugeVec,
    pipeline_workers: IntGaugeVec,
    pub leader: IntGauge,
    workers: IntGaugeVec,
    batch_time: GaugeVec,
    wait: GaugeVec,
    converged: IntGaugeVec,
    held_back: IntGaugeVec,
    rescales: IntCounterVec,
    delivery: IntGaugeVec,
    consumer_seconds: GaugeVec,
    job_seconds: GaugeVec,
    job_wants: IntGaugeVec,
    job_shared: IntGaugeVec,
    /// The job label sets exported last, so a job that left is removed.
    jobs_exported: Arc<Mutex<BTreeSet<[String; 4]>>>,
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
        let pipeline_workers = IntGaugeVec::new(
            Opts::new(
                "stoker_pipeline_workers",
                "Each pipeline's worker pods as its status shows them: desired, ready",
            ),
            &["namespace", "pipeline", "state"],
        )
        .unwrap();
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
                 worker died, or a client left holding unread batches), redeliveries_skipped (elements a client already had), splits_repeated, \
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
        let job_labels = &["namespace", "pipeline", "job", "share"];
        let job_seconds = GaugeVec::new(
            Opts::new(
                "stoker_job_consumer_seconds",
                "Each job's consumers' time while it has live clients (share: its share group, or \
                 empty): waiting_for_data and in_all",
            ),
            &["namespace", "pipeline", "job", "share", "spent"],
        )
        .unwrap();
        let job_wants = IntGaugeVec::new(
            Opts::new(
                "stoker_job_workers_wanted",
                "Workers the autoscaler's policy for each job wants (the pipeline runs the most of them)",
            ),
            job_labels,
        )
        .unwrap();
        let job_shared = IntGaugeVec::new(
            Opts::new(
                "stoker_job_shared_splits",
                "Each job of a share group: splits it took from the group's productions (taken) and \
                 productions it had no room for, each made again for it (missed)",
            ),
            &["namespace", "pipeline", "job", "share", "outcome"],
        )
        .unwrap();
        let registry = Registry::new();
        registry.register(Box::new(job_seconds.clone())).unwrap();
        registry.register(Box::new(job_wants.clone())).unwrap();
        registry.register(Box::new(job_shared.clone())).unwrap();
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
        registry.register(Box::new(pipeline_workers.clone())).unwrap();
        registry.register(Box::new(leader.clone())).unwrap();
        Metrics {
            registry,
            reconciles,
            failures,
            duration,
            pipelines,
            pipeline_workers,
            leader,
            workers,
            batch_time,
            wait,
            converged,
            held_back,
            rescales,
            delivery,
            consumer_seconds,
            job_seconds,
            job_wants,
            job_shared,
            jobs_exported: Arc::default(),
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

    /// Recounts pipelines by phase, and each one's desired and ready workers, from the
    /// controller's cache, so deleted pipelines drop out.
    pub fn count_phases<'a>(&self, pipelines: impl IntoIterator<Item = &'a DataPipeline>) {
        self.pipelines.reset();
        self.pipeline_workers.reset();
        for dp in pipelines {
            let phase =
                dp.status.as_ref().and_then(|s| s.phase).map_or("Unknown".to_string(), |p: Phase| format!("{p:?}"));
            self.pipelines.with_label_values(&[&phase]).inc();
            if let Some(w) = dp.status.as_ref().and_then(|s| s.workers.as_ref()) {
                let key = PipelineKey::of(dp);
                for (state, n) in [("desired", w.desired), ("ready", w.ready)] {
                    let labels = [key.namespace.as_str(), key.name.as_str(), state];
                    self.pipeline_workers.with_label_values(&labels).set(i64::from(n));
                }
            }
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
        for key in records.keys() {
            // At 0 from the first round, so increase() over it has data before the first rescale.
            self.rescales.with_label_values(&[key.namespace.as_str(), key.name.as_str()]);
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

    /// Each job with live clients: its consumers' time, what its policy wants, what it took
    /// from its share group. The series of a job that left are removed, so the label sets are
    /// bounded by the jobs reading now.
    pub fn jobs(&self, jobs: &BTreeMap<PipelineKey, Vec<JobStatus>>) {
        let mut now = BTreeSet::new();
        for (key, list) in jobs {
            for j in list {
                let share = j.share.as_ref().map_or("", |s| s.as_str());
                let labels = [key.namespace.as_str(), key.name.as_str(), j.name.as_str(), share];
                let wait = j.data_wait.clone().unwrap_or_default();
                for (spent, seconds) in [("waiting_for_data", wait.waiting_seconds), ("in_all", wait.total_seconds)] {
                    self.job_seconds.with_label_values(&[&labels[..], &[spent]].concat()).set(seconds);
                }
                self.job_wants.with_label_values(&labels).set(j.workers_wanted.map_or(0, i64::from));
                for (outcome, n) in [("taken", j.shared_taken), ("missed", j.shared_missed)] {
                    self.job_shared.with_label_values(&[&labels[..], &[outcome]].concat()).set(n as i64);
                }
                now.insert(labels.map(str::to_string));
            }
        }
        let mut exported = self.jobs_exported.lock().unwrap();
        for gone in exported.difference(&now) {
            let labels: Vec<&str> = gone.iter().map(String::as_str).collect();
            for extra in ["waiting_for_data", "in_all"] {
                let _ = self.job_seconds.remove_label_values(&[&labels[..], &[extra]].concat());
            }
            let _ = self.job_wants.remove_label_values(&labels);
            for extra in ["taken", "missed"] {
                let _ = self.job_shared.remove_label_values(&[&labels[..], &[extra]].concat());
            }
        }
        *exported = now;
    }

    pub fn render(&self) -> String {
        prometheus::TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pipelines_workers_are_recounted_from_the_cache() {
        let metrics = Metrics::default();
        let mut dp = DataPipeline::new(
            "imagenet",
            stoker_api::from_yaml("source: {uri: 'file:///d', format: jsonl}\nbatchSize: 4\n").unwrap(),
        );
        dp.metadata.namespace = Some("team-a".into());
        dp.status = Some(stoker_api::DataPipelineStatus {
            workers: Some(stoker_api::WorkersStatus::new(3, 2)),
            ..Default::default()
        });
        metrics.count_phases([&dp]);
        let text = metrics.render();
        let line = r#"stoker_pipeline_workers{namespace="team-a",pipeline="imagenet",state="ready"} 2"#;
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        metrics.count_phases([]);
        assert!(!metrics.render().contains("stoker_pipeline_workers{"), "a deleted pipeline drops out");
    }

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

    #[test]
    fn each_job_is_exported_while_it_reads_and_removed_once_it_left() {
        let metrics = Metrics::default();
        let key = PipelineKey { namespace: "ml".into(), name: "sweep".into() };
        let job = |name: &str| JobStatus {
            name: name.into(),
            share: Some("s".into()),
            consumers: 1,
            data_wait: Some(DataWaitStatus { fraction: 0.5, waiting_seconds: 2.0, total_seconds: 4.0 }),
            workers_wanted: Some(3),
            shared_taken: 7,
            shared_missed: 1,
            ..JobStatus::default()
        };
        metrics.jobs(&[(key.clone(), vec![job("t0"), job("t1")])].into());
        let text = metrics.render();
        for line in [
            r#"stoker_job_consumer_seconds{job="t1",namespace="ml",pipeline="sweep",share="s",spent="waiting_for_data"} 2"#,
            r#"stoker_job_workers_wanted{job="t0",namespace="ml",pipeline="sweep",share="s"} 3"#,
            r#"stoker_job_shared_splits{job="t0",namespace="ml",outcome="missed",pipeline="sweep",share="s"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        metrics.jobs(&[(key, vec![job("t0")])].into());
        let text = metrics.render();
        assert!(text.contains(r#"job="t0""#) && !text.contains(r#"job="t1""#), "{text}");
    }
}
