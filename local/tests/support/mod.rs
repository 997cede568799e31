//! What the real-process tests share: a dispatcher on loopback and one pipeline's
//! `stoker-worker` processes attached to it.

use std::sync::Arc;
use std::time::Duration;

use stoker_api::{Batch, WorkerPipeline};
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

/// `files` JSONL files of `lines` records each, `{"id": n, "pad": [...]}` with ids 0.. in file
/// order, as a pipeline of batches of 10 with a seeded shuffle. The padding makes a batch
/// (~25 KB) a good part of a client's flow-control window, so a worker cannot run far ahead of
/// what its clients have read: killed, it still holds some of its split, and they the rest.
#[allow(dead_code)] // not every test uses it
pub fn padded_records(dir: &std::path::Path, files: i64, lines: i64) -> WorkerPipeline {
    let pad = vec!["0.5"; 500].join(",");
    for file in 0..files {
        let records: String =
            (0..lines).map(|i| format!("{{\"id\": {}, \"pad\": [{pad}]}}\n", file * lines + i)).collect();
        std::fs::write(dir.join(format!("{file}.jsonl")), records).unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nshuffle: {{bufferSize: 64, seed: 1}}\n",
        dir.display()
    );
    WorkerPipeline::new("ns", "records", &stoker_api::from_yaml(&manifest).unwrap())
}

/// The `id`s of a batch of [`padded_records`].
#[allow(dead_code)]
pub fn ids(batch: &Batch) -> Vec<i64> {
    batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}
