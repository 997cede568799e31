//! The worker's Prometheus metrics on `/metrics` (docs/observability.md lists them): read from
//! the engine's own counters when scraped, so producing costs nothing more than it counts
//! already. Every series carries the pipeline's namespace and name; the other labels are
//! bounded by the spec (op index and name, source index, skip reason), never per element,
//! split or client.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use prometheus::{Encoder, IntGauge, Opts, Registry};

use crate::budget::MemoryBudget;
use crate::cached::EngineCache;
use crate::engine::{Engine, Stats};
use crate::python::PythonCounts;
use crate::source_reads::SourceReads;
use crate::stream::SentByJob;

/// The batches each epoch in production holds that no stream took yet: (job, epoch, batches).
pub type QueueDepths = Box<dyn Fn() -> Vec<(stoker_api::JobName, u64, usize)> + Send + Sync>;

/// What a scrape reads: the engine's counters, its memory budget, its cache and Python pool,
/// what the streams sent, and (under the dispatcher) the epochs' queues.
#[derive(Clone)]
pub struct WorkerMetrics {
    stats: Arc<Stats>,
    budget: Arc<MemoryBudget>,
    cache: Option<Arc<EngineCache>>,
    python: Option<Arc<PythonCounts>>,
    /// What was read from each source of the mix, in spec order.
    reads: Vec<Arc<SourceReads>>,
    sent: Arc<SentByJob>,
    /// Set once the batch source exists (after the endpoint is up).
    queues: Arc<OnceLock<QueueDepths>>,
    namespace: String,
    pipeline: String,
    /// Each transform's name, by index.
    ops: Vec<&'static str>,
}

impl WorkerMetrics {
    pub fn of(engine: &Engine) -> Self {
        let pipeline = engine.pipeline();
        let ops = pipeline.data_plane.transforms.iter().map(|t| t.name()).collect();
        let (namespace, name) = (pipeline.namespace.clone(), pipeline.name.clone());
        let mut metrics = Self::new(engine.stats.clone(), engine.budget().clone(), namespace, name, ops);
        metrics.cache = engine.cache.clone();
        metrics.python = engine.python_counts();
        metrics.reads = engine.source_reads();
        metrics
    }

    /// The metrics of these counters, under the pipeline's labels (`ops`: each transform's
    /// name, by index).
    pub fn new(
        stats: Arc<Stats>,
        budget: Arc<MemoryBudget>,
        namespace: String,
        pipeline: String,
        ops: Vec<&'static str>,
    ) -> Self {
        WorkerMetrics {
            stats,
            budget,
            cache: None,
            python: None,
            reads: Vec::new(),
            sent: Arc::default(),
            queues: Arc::default(),
            namespace,
            pipeline,
            ops,
        }
    }

    /// The counters the stream service counts what it sends into (`StreamService::with_sent`).
    pub fn sent(&self) -> Arc<SentByJob> {
        self.sent.clone()
    }

    /// Where the epochs' queue depths come from, once the batch source exists; every clone of
    /// these metrics (the endpoint's) sees it. Only the first call counts.
    pub fn set_queues(&self, depths: QueueDepths) {
        let _ = self.queues.set(depths);
    }

    /// The metrics in Prometheus's text format.
    pub fn render(&self) -> String {
        let families = Families::new(&self.namespace, &self.pipeline);
        let stats = &self.stats;
        families.counter("records_read_total", "Records read from the sources", &[], stats.records.load(Relaxed));
        families.counter(
            "elements_total",
            "Elements (rows, on the columnar path) the ops produced, after filters",
            &[],
            stats.elements.load(Relaxed),
        );
        families.counter("filtered_total", "Elements a filter op dropped", &[], stats.filtered.load(Relaxed));
        for (reason, count) in stats.skipped() {
            families.counter(
                "skipped_total",
                "Records and elements skipped (onError: skip), by reason",
                &[("reason", reason)],
                count,
            );
        }
        for (index, tally) in stats.ops.lock().unwrap().iter().enumerate() {
            let name = self.ops.get(index).copied().unwrap_or("unknown");
            let op_index = index.to_string();
            families.counter_f(
                "op_seconds_total",
                "Thread time spent in each op of the pipeline, summed over the worker's threads",
                &[("op_index", &op_index), ("op", name)],
                tally.time.as_secs_f64(),
            );
            let elements = "Elements (rows on the columnar path) into and out of each op";
            for (direction, count) in [("in", tally.elements_in), ("out", tally.elements_out)] {
                let labels = [("op_index", op_index.as_str()), ("op", name), ("direction", direction)];
                families.counter("op_elements_total", elements, &labels, count);
            }
        }
        families.counter("batches_total", "Batches made", &[], stats.batches.load(Relaxed));
        families.counter(
            "batch_bytes_total",
            "Bytes of the tensors of the batches made",
            &[],
            stats.batch_bytes.load(Relaxed),
        );
        families.counter(
            "echoed_rows_total",
            "Rows the echo op made beyond each element's first",
            &[],
            stats.echoed.load(Relaxed),
        );
        families.counter(
            "redelivery_skipped_total",
            "Elements left out of a split produced again because they were delivered already",
            &[],
            stats.redelivery_skipped.load(Relaxed),
        );
        for (source, rows) in stats.source_rows.lock().unwrap().iter().enumerate() {
            families.counter(
                "source_rows_total",
                "Rows batched from each source of the mix",
                &[("source", &source.to_string())],
                *rows,
            );
        }
        for (source, reads) in self.reads.iter().enumerate() {
            let index = source.to_string();
            let labels = [("source", index.as_str())];
            let bytes = "Bytes read from each source of the mix (whole objects, or a Parquet file's ranges)";
            families.counter("source_read_bytes_total", bytes, &labels, reads.bytes.load(Relaxed));
            let seconds = "Time the reads from each source took, summed over the requests (concurrent ones each count)";
            families.counter_f("source_read_seconds_total", seconds, &labels, reads.nanos.load(Relaxed) as f64 / 1e9);
        }
        for (index, failures) in stats.python_failures.lock().unwrap().iter() {
            for (reason, count) in &failures.by_reason {
                families.counter(
                    "python_failures_total",
                    "Elements a python op failed on, by reason",
                    &[("op_index", &index.to_string()), ("reason", reason)],
                    *count,
                );
            }
        }
        families.gauge("memory_budget_bytes", "The worker's memory budget", self.budget.limit() as i64);
        families.gauge(
            "memory_used_bytes",
            "Bytes of rows and batches held under the memory budget",
            self.budget.used() as i64,
        );
        families.gauge(
            "shuffle_peak_bytes",
            "The most bytes the shuffle buffer held",
            stats.shuffle_peak_bytes.load(Relaxed) as i64,
        );
        if let Some(python) = &self.python {
            for (index, calls) in python.calls.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let calls_help = "Calls of each python op (a batched call counts once)";
                families.counter("python_calls_total", calls_help, &[("op_index", &index.to_string())], *calls);
            }
            let started = "Python processes started: the first, one per thread that found none idle, and replacements";
            families.counter("python_processes_started_total", started, &[], python.started.load(Relaxed));
            let lost = "Python processes a call killed (timeout, memory limit, crash), each replaced by the next call";
            families.counter("python_restarts_total", lost, &[], python.lost.load(Relaxed));
        }
        for (job, sent) in self.sent.snapshot() {
            let help = "Batches the worker's streams sent to each job's clients";
            families.counter("sent_batches_total", help, &[("job", &job)], sent.batches);
            let help = "Bytes of the tensors of the batches sent to each job's clients";
            families.counter("sent_bytes_total", help, &[("job", &job)], sent.bytes);
        }
        if let Some(depths) = self.queues.get() {
            for (job, epoch, batches) in depths() {
                families.gauge_with(
                    "queued_batches",
                    "Batches made for each job's epoch in production and not yet taken by a stream",
                    &[("job", job.as_str()), ("epoch", &epoch.to_string())],
                    batches as i64,
                );
            }
        }
        // Without a cache, zeros: a dashboard's hit rate is then 0, not missing.
        let progress = self.cache.as_ref().map(|c| c.progress()).unwrap_or_default();
        let splits = "Splits written to and read from the cache volume";
        families.counter("cache_splits_total", splits, &[("direction", "write")], progress.splits_written);
        families.counter("cache_splits_total", splits, &[("direction", "read")], progress.splits_read);
        families.counter(
            "cache_elements_read_total",
            "Elements read from the cache volume instead of computed",
            &[],
            progress.elements_read,
        );
        families.encode()
    }
}

/// One scrape's metric families, each registered the first time it is given a value.
struct Families {
    registry: Registry,
    counters: std::cell::RefCell<std::collections::BTreeMap<&'static str, prometheus::CounterVec>>,
    gauges: std::cell::RefCell<std::collections::BTreeMap<&'static str, prometheus::IntGaugeVec>>,
    const_labels: std::collections::HashMap<String, String>,
}

impl Families {
    fn new(namespace: &str, pipeline: &str) -> Self {
        let const_labels = [("namespace", namespace), ("pipeline", pipeline)];
        Families {
            registry: Registry::new(),
            counters: Default::default(),
            gauges: Default::default(),
            const_labels: const_labels.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    fn opts(&self, name: &str, help: &str) -> Opts {
        Opts::new(format!("stoker_worker_{name}"), help).const_labels(self.const_labels.clone())
    }

    fn counter(&self, name: &'static str, help: &str, labels: &[(&str, &str)], value: u64) {
        self.counter_f(name, help, labels, value as f64);
    }

    fn counter_f(&self, name: &'static str, help: &str, labels: &[(&str, &str)], value: f64) {
        let mut counters = self.counters.borrow_mut();
        let vec = counters.entry(name).or_insert_with(|| {
            let names: Vec<&str> = labels.iter().map(|(k, _)| *k).collect();
            let vec = prometheus::CounterVec::new(self.opts(name, help), &names).expect("a valid metric");
            self.registry.register(Box::new(vec.clone())).expect("registered once");
            vec
        });
        let values: Vec<&str> = labels.iter().map(|(_, v)| *v).collect();
        vec.with_label_values(&values).inc_by(value);
    }

    fn gauge(&self, name: &str, help: &str, value: i64) {
        let gauge = IntGauge::with_opts(self.opts(name, help)).expect("a valid metric");
        self.registry.register(Box::new(gauge.clone())).expect("registered once");
        gauge.set(value);
    }

    fn gauge_with(&self, name: &'static str, help: &str, labels: &[(&str, &str)], value: i64) {
        let mut gauges = self.gauges.borrow_mut();
        let vec = gauges.entry(name).or_insert_with(|| {
            let names: Vec<&str> = labels.iter().map(|(k, _)| *k).collect();
            let vec = prometheus::IntGaugeVec::new(self.opts(name, help), &names).expect("a valid metric");
            self.registry.register(Box::new(vec.clone())).expect("registered once");
            vec
        });
        let values: Vec<&str> = labels.iter().map(|(_, v)| *v).collect();
        vec.with_label_values(&values).set(value);
    }

    fn encode(&self) -> String {
        let mut text = Vec::new();
        prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut text).expect("text encoding");
        String::from_utf8(text).expect("the text format is UTF-8")
    }
}

/// Serves `/metrics` (and `/healthz`) on `addr` until `shutdown`; the bound address is logged,
/// and returned once bound, so port 0 works.
pub async fn serve(
    addr: SocketAddr,
    metrics: WorkerMetrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<SocketAddr> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the metrics port {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/metrics", get(move || std::future::ready(metrics.render())))
        .route("/healthz", get(|| std::future::ready("ok")));
    tracing::info!(metrics = %bound, "serving /metrics");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
            tracing::warn!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

/// The body of `GET /metrics` from a worker at `addr`: what the tests, and tools without an
/// HTTP client, read.
pub async fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: worker\r\n\r\n").await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    anyhow::ensure!(head.split_whitespace().nth(1) == Some("200"), "GET /metrics from {addr}: {head}");
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::op_tally::OpTally;

    use super::*;

    /// The value of the series `name` with the pipeline's labels and `labels` in `text`.
    fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut wanted: Vec<String> = [("namespace", "team-a"), ("pipeline", "imagenet")]
            .iter()
            .chain(labels)
            .map(|(k, v)| format!("{k}=\"{v}\""))
            .collect();
        wanted.sort();
        let series = format!("{name}{{{}}} ", wanted.join(","));
        text.lines().find_map(|l| l.strip_prefix(&series)?.parse().ok())
    }

    #[test]
    fn a_scrape_reads_the_engines_counters_under_the_pipelines_labels() {
        let stats = Arc::new(Stats::default());
        stats.records.store(120, Relaxed);
        stats.batches.store(7, Relaxed);
        stats.skipped.lock().unwrap().insert("bad_json", 3);
        *stats.ops.lock().unwrap() = vec![
            OpTally { time: Duration::from_millis(1500), elements_in: 120, elements_out: 118 },
            OpTally { time: Duration::from_millis(250), elements_in: 118, elements_out: 118 },
        ];
        let budget = Arc::new(MemoryBudget::new(1 << 20));
        let metrics = WorkerMetrics::new(
            stats.clone(),
            budget,
            "team-a".into(),
            "imagenet".into(),
            vec!["decodeImage", "normalize"],
        );
        metrics.sent().count(&"train".into(), 4096);
        metrics.set_queues(Box::new(|| vec![("train".into(), 3, 2)]));
        let text = metrics.render();
        assert_eq!(value(&text, "stoker_worker_records_read_total", &[]), Some(120.0), "{text}");
        assert_eq!(value(&text, "stoker_worker_batches_total", &[]), Some(7.0));
        assert_eq!(value(&text, "stoker_worker_skipped_total", &[("reason", "bad_json")]), Some(3.0));
        let op = [("op", "normalize"), ("op_index", "1")];
        assert_eq!(value(&text, "stoker_worker_op_seconds_total", &op), Some(0.25));
        let decode_out = [("direction", "out"), ("op", "decodeImage"), ("op_index", "0")];
        assert_eq!(value(&text, "stoker_worker_op_elements_total", &decode_out), Some(118.0));
        let decode_in = [("direction", "in"), ("op", "decodeImage"), ("op_index", "0")];
        assert_eq!(value(&text, "stoker_worker_op_elements_total", &decode_in), Some(120.0));
        assert_eq!(value(&text, "stoker_worker_memory_budget_bytes", &[]), Some(1048576.0));
        assert!(text.contains("# TYPE stoker_worker_op_seconds_total counter"), "{text}");
        assert_eq!(value(&text, "stoker_worker_sent_bytes_total", &[("job", "train")]), Some(4096.0));
        assert_eq!(value(&text, "stoker_worker_queued_batches", &[("epoch", "3"), ("job", "train")]), Some(2.0));
        let written = [("direction", "write")];
        assert_eq!(value(&text, "stoker_worker_cache_splits_total", &written), Some(0.0), "no cache: zeros");
        // Counted on, the next scrape sees the new values: nothing is cached between scrapes.
        stats.batches.store(9, Relaxed);
        assert_eq!(value(&metrics.render(), "stoker_worker_batches_total", &[]), Some(9.0));
    }
}
