//! What a spec or a reader can make a real `stoker-worker` do, bounded: a `shuffle.bufferSize`
//! far beyond the memory budget is capped at the buffer's share of the budget (instead of an
//! out-of-memory kill) and reported as a status warning; streams naming endless jobs stop at the
//! worker's producer cap.

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
        let warnings = s.report().warnings;
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

/// A reader naming ever new jobs (a thread and queues each on the worker) gets
/// RESOURCE_EXHAUSTED past the worker's cap, not a thread per name; a job name no thread could
/// be named after (a NUL in it) is no crash; and the worker serves a real client afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_naming_endless_jobs_is_refused_past_the_producer_cap() {
    use stoker_api::proto::batch_stream_client::BatchStreamClient;
    use stoker_api::proto::{PipelineRef, StreamRequest};
    use stoker_worker::dispatched::MAX_EPOCH_PRODUCERS;

    let data = tempfile::tempdir().unwrap();
    let pipeline = support::padded_records(data.path(), 2, 100);
    let s = support::dispatched(pipeline, Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let address = loop {
        if let Some(a) =
            s.dispatcher.with_state(|st| st.listing(&s.key)).workers.first().map(|(address, _)| address.clone())
        {
            break a;
        }
        assert!(Instant::now() < deadline, "the worker never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}")).unwrap().connect_lazy();
    let mut worker = BatchStreamClient::new(channel);
    let request = |job: String| StreamRequest {
        pipeline: Some(PipelineRef { namespace: "ns".into(), name: "records".into() }),
        job,
        epoch: Some(0),
        ..Default::default()
    };
    // Streams held open: each keeps its job's epoch in production.
    let mut held = Vec::new();
    let mut refused = None;
    for n in 0..MAX_EPOCH_PRODUCERS + 8 {
        let job = if n == 0 { "nul\0job".to_string() } else { format!("job-{n}") };
        match worker.stream(request(job)).await {
            Ok(stream) => held.push(stream),
            Err(status) => {
                refused = Some((n, status));
                break;
            }
        }
    }
    let (n, status) = refused.expect("refused at some point");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(n <= MAX_EPOCH_PRODUCERS, "refused only after {n} streams");
    drop(held);

    // The worker lives on and serves a real client of a job it produces (a new job would wait
    // for the abandoned ones to stop, a minute after their readers left).
    let mut options = ClientOptions::new("ns", "records");
    options.job = "job-1".into();
    let mut client = Client::from_dispatcher(&s.url, options).await.unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(30), client.next()).await;
    batch.expect("a batch within 30 s").expect("the stream goes on").expect("no error");
    assert_eq!(s.workers.running(&s.key), 1, "the worker still runs");
    s.workers.stop_all().await;
}
