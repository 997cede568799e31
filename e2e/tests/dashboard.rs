//! Every query of the chart's Grafana dashboard names metrics the operator or a worker exports:
//! both render their metrics here with every labelled family given a value, as they would in
//! a cluster after a rescale, a refusal and a skipped record, and each name the dashboard uses
//! must be among theirs. (The e2e scenario `dashboard_queries_have_data` then runs the queries
//! against a real Prometheus scraping a real operator and workers.)

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use stoker_api::{DataPipeline, DataPipelineStatus, DataWaitStatus, DeliveryStatus, JobStatus, WorkersStatus};
use stoker_e2e::dashboard;
use stoker_operator::access::denials::Denials;
use stoker_operator::autoscaling::{Rescale, ScalingRecord};
use stoker_operator::key::PipelineKey;
use stoker_operator::metrics::Metrics;
use stoker_worker::budget::MemoryBudget;
use stoker_worker::engine::Stats;
use stoker_worker::metrics::WorkerMetrics;
use stoker_worker::op_tally::OpTally;

fn operator_exposition() -> String {
    let metrics = Metrics::default();
    let denials = Denials::default();
    metrics.registry.register(Box::new(denials.counter())).unwrap();
    denials.counter().with_label_values(&["RegisterClient", "unauthenticated"]).inc();
    let key = PipelineKey { namespace: "ml".into(), name: "imagenet".into() };
    let record =
        ScalingRecord { workers: 2, batch_time_ms: Some(80.0), wait_fraction: Some(0.3), ..Default::default() };
    let rescale = Rescale { pipeline: key.clone(), from: 1, to: 2, reason: "faster".into() };
    metrics.scaling(&[(key.clone(), record)].into(), &[rescale]);
    metrics.deliveries(&[(key.clone(), DeliveryStatus::default())].into());
    metrics.data_waits(&[(key.clone(), DataWaitStatus::default())].into());
    let job = JobStatus { name: "train".into(), consumers: 1, ..JobStatus::default() };
    metrics.jobs(&[(key.clone(), vec![job])].into());
    let mut dp = DataPipeline::new(
        &key.name,
        stoker_api::from_yaml("source: {uri: 'file:///d', format: jsonl}\nbatchSize: 4\n").unwrap(),
    );
    dp.metadata.namespace = Some(key.namespace.clone());
    dp.status = Some(DataPipelineStatus { workers: Some(WorkersStatus::new(2, 2)), ..Default::default() });
    metrics.count_phases([&dp]);
    metrics.reconciled(Duration::from_millis(3));
    metrics.render()
}

fn worker_exposition() -> String {
    let stats = Arc::new(Stats::default());
    *stats.ops.lock().unwrap() = vec![OpTally { time: Duration::from_millis(5), elements_in: 3, elements_out: 3 }];
    stats.skipped.lock().unwrap().insert("bad_json", 1);
    *stats.source_rows.lock().unwrap() = vec![3];
    let budget = Arc::new(MemoryBudget::new(1 << 20));
    WorkerMetrics::new(stats, budget, "ml".into(), "imagenet".into(), vec!["cast"]).render()
}

#[test]
fn every_query_names_metrics_that_are_exported() {
    let mut exported: BTreeSet<String> = dashboard::exported_names(&operator_exposition());
    exported.extend(dashboard::exported_names(&worker_exposition()));
    let queries = dashboard::queries().unwrap();
    assert!(queries.len() >= 15, "the dashboard has its panels: {} queries", queries.len());
    let mut used = BTreeSet::new();
    for q in &queries {
        let names = dashboard::metric_names(&q.expr);
        assert!(!names.is_empty(), "{:?} selects no Stoker metric: {}", q.panel, q.expr);
        for name in names {
            assert!(exported.contains(&name), "{:?} uses {name}, which nothing exports: {}", q.panel, q.expr);
            used.insert(name);
        }
    }
    // What the issue asks the dashboard to show, by the metric that shows it.
    for needed in [
        "stoker_pipeline_consumer_seconds",     // data-stall fraction, accelerator time lost
        "stoker_pipeline_workers",              // workers desired and ready
        "stoker_autoscaler_rescales_total",     // the decisions
        "stoker_autoscaler_batch_time_seconds", // batch time
        "stoker_worker_op_seconds_total",       // per-op cost
        "stoker_worker_cache_elements_read_total", // cache hit rate
        "stoker_worker_memory_used_bytes",      // memory
        "stoker_access_refused_total",          // refusals
        "stoker_worker_skipped_total",          // corrupt records
    ] {
        assert!(used.contains(needed), "no panel shows {needed}");
    }
}
