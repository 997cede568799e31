//! What the real-process tests share: a dispatcher on loopback and one pipeline's
//! `stoker-worker` processes attached to it.

use std::sync::Arc;
use std::time::Duration;

use stoker_api::WorkerPipeline;
use stoker_local::workers::{LocalWorkerConfig, LocalWorkers, worker_binary};
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};
use stoker_operator::key::PipelineKey;

pub struct Dispatched {
    pub dispatcher: Arc<Dispatcher>,
    pub workers: LocalWorkers,
    pub key: PipelineKey,
    pub url: String,
    _logs: tempfile::TempDir,
}

/// A dispatcher declaring workers dead after `worker_timeout`, and `pipeline`'s workers
/// (one transform thread each, each sending at most `max_batch_rate` batches a second, none
/// started yet: scale them).
pub async fn dispatched(pipeline: WorkerPipeline, worker_timeout: Duration, max_batch_rate: Option<f64>) -> Dispatched {
    let dispatcher = Dispatcher::new(
        Timeouts { worker: worker_timeout, client: Duration::from_secs(30) },
        Duration::from_millis(500),
    );
    dispatcher.spawn_expiry();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(dispatcher::serve(listener, dispatcher.clone(), std::future::pending()));
    let binary = worker_binary();
    assert!(binary.is_file(), "{} is missing: run `cargo build --workspace --bins` first", binary.display());
    // Not in the data directory: the logs would become shards of the source.
    let logs = tempfile::tempdir().unwrap();
    let workers = LocalWorkers::new(LocalWorkerConfig {
        binary,
        dispatcher_url: url.clone(),
        threads: 1,
        memory_budget: 64 << 20,
        max_batch_rate,
        log_dir: Some(logs.path().to_path_buf()),
        cache_dir: None,
    });
    let key = PipelineKey::new(&pipeline.namespace, &pipeline.name);
    workers.add(pipeline, None);
    Dispatched { dispatcher, workers, key, url, _logs: logs }
}
