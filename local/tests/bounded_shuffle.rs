//! A `shuffle.bufferSize` far beyond the memory budget, with a real `stoker-worker`: the
//! worker caps the buffer at its share of the budget (instead of being killed for memory),
//! keeps serving batches, and says so in its heartbeats, which the dispatcher keeps as the
//! warnings the DataPipeline status shows.

mod support;

use std::time::{Duration, Instant};

use stoker_api::WorkerPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_shuffle_buffer_is_capped_and_the_status_says_so() {
    let data = tempfile::tempdir().unwrap();
    // 8000 rows of ~4 KB each (500 float64 values): ~32 MB transformed, half of the test
    // workers' 64 MiB budget, which is the shuffle buffer's share.
    let pad = vec!["0.5"; 500].join(",");
    for file in 0..4 {
        let rows: String = (0..2000).map(|i| format!("{{\"id\": {}, \"pad\": [{pad}]}}\n", file * 2000 + i)).collect();
        std::fs::write(data.path().join(format!("{file}.jsonl")), rows).unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nshuffle: {{bufferSize: 4000000000, seed: 1}}\n",
        data.path().display()
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let s = support::dispatched(WorkerPipeline::new("ns", "huge", &spec), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "huge")).await.unwrap();

    // Reading keeps the worker producing; the warning comes with a heartbeat (every second).
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut batches = 0u64;
    let warnings = loop {
        let warnings = s.dispatcher.with_state(|st| st.warnings()).remove(&s.key).unwrap_or_default();
        if !warnings.is_empty() {
            break warnings;
        }
        assert!(Instant::now() < deadline, "no warning within 90 s after {batches} batches");
        let batch = tokio::time::timeout(Duration::from_secs(30), client.next()).await;
        batch.expect("a batch within 30 s").expect("the stream goes on").expect("no error");
        batches += 1;
    };
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = &warnings[0];
    assert!(w.contains("shuffle buffer capped") && w.contains("asks for 4000000000"), "{w}");
    // Capped, not killed: the worker goes on serving.
    for _ in 0..20 {
        let batch = tokio::time::timeout(Duration::from_secs(30), client.next()).await;
        batch.expect("a batch within 30 s after the cap").expect("the stream goes on").expect("no error");
    }
    assert_eq!(s.workers.running(&s.key), 1, "the worker still runs");
    s.workers.stop_all().await;
}
