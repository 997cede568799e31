//! Automatic echo with real processes: one one-thread worker (`workers.max: 1`) decoding large
//! JPEGs for a trainer that never has to compute (so it always waits), the pipeline's `echo`
//! with `maxFactor: 4` after the decode. The scaling loop, held at `workers.max` with the
//! client waiting, raises the factor a step per window; the dispatcher hands it out with the
//! splits, the worker decodes each image once and crops it four times, and the client gets more
//! rows a second than the same worker without echo. With the client gone the pipeline goes
//! idle and the echo back to 1.

use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions};
use stoker_local::mode::{Local, LocalOptions};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_worker::corpus::{CorpusSpec, generate};

const MAX_FACTOR: u32 = 4;

/// Local mode on `corpus` with the pipeline's echo op written as `echo`.
async fn start(corpus: &std::path::Path, logs: &std::path::Path, echo: &str) -> Local {
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\n\
         transforms:\n\
         - decodeImage: {{channels: 3}}\n\
         - echo: {echo}\n\
         - randomResizedCrop: {{size: [32, 32]}}\n\
         shuffle: {{bufferSize: 64}}\n\
         batchSize: 8\n\
         workers: {{min: 1, max: 1}}\n\
         autoscaling: {{policy: {{idleAfterSeconds: 3}}}}\n",
        corpus.display()
    );
    let workers = LocalWorkerConfig { max_batch_rate: None, ..LocalWorkerConfig::rate_capped(1.0, logs.to_path_buf()) };
    Local::start(LocalOptions {
        namespace: "ns".into(),
        name: "echo".into(),
        spec: stoker_api::from_yaml(&manifest).unwrap(),
        listen: "127.0.0.1:0".parse().unwrap(),
        workers,
        window: Some(Duration::from_secs(1)),
        budget: None,
        tls_dir: None,
    })
    .await
    .unwrap()
}

/// Rows a second `client` gets over `seconds`, and the highest copy number among them.
async fn read_for(client: &mut Client, seconds: f64) -> (f64, u32) {
    let (start, mut rows, mut top_copy) = (Instant::now(), 0u64, 0u32);
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        let batch = client.next().await.expect("the stream goes on").expect("no error");
        rows += batch.rows.len() as u64;
        top_copy = top_copy.max(batch.echo_copies().max().unwrap_or(0));
    }
    (rows as f64 / start.elapsed().as_secs_f64(), top_copy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_at_max_with_the_client_waiting_the_echo_rises_and_the_rows_come_faster() {
    assert!(
        worker_binary().is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        worker_binary().display()
    );
    let (data, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Large images: decoding dominates, and it is what the echo does once for four rows. Few
    // of them (the stream reads on across epochs): making them takes a debug build 0.25 s each.
    let corpus = CorpusSpec { images: 48, classes: 2, min_side: 700, max_side: 800, ..Default::default() };
    generate(data.path(), &corpus).unwrap();

    // Without echo (a fixed factor 1): the rows a second one worker makes.
    let plain = start(data.path(), logs.path(), "{factor: 1}").await;
    let mut client = Client::from_dispatcher(&plain.url, ClientOptions::new("ns", "echo")).await.unwrap();
    read_for(&mut client, 1.0).await;
    let (before, copies) = read_for(&mut client, 4.0).await;
    assert_eq!(copies, 0);
    drop(client);
    plain.shutdown().await;

    let local = start(data.path(), logs.path(), &format!("{{maxFactor: {MAX_FACTOR}}}")).await;
    let key = local.key.clone();
    let echo = || local.book.get(&key).and_then(|r| r.echo);
    let mut client = Client::from_dispatcher(&local.url, ClientOptions::new("ns", "echo")).await.unwrap();
    let began = Instant::now();
    // Three raises, one per judged 1 s window: 6 s here. When the client counted only the
    // streams open at each report, an epoch of 48 images (shorter than a window) left most
    // windows at 0 workers; they were dropped and this took 19-35 s.
    let deadline = began + Duration::from_secs(12);
    while echo().is_none_or(|e| e.factor < MAX_FACTOR) {
        assert!(Instant::now() < deadline, "the echo never reached {MAX_FACTOR}: {:?}", echo());
        read_for(&mut client, 0.5).await;
    }
    let reached = began.elapsed();
    let status = echo().unwrap();
    assert!(status.reason.contains("workers.max (1)"), "{status:?}");
    // Splits handed out before the last raise drain first.
    read_for(&mut client, 4.0).await;
    let (after, copies) = read_for(&mut client, 4.0).await;
    eprintln!(
        "rows/s {before:.0} without echo, {after:.0} at echo {MAX_FACTOR}, reached after {reached:.1?}; {status:?}"
    );
    assert_eq!(copies, MAX_FACTOR - 1, "rows of every copy arrive");
    assert!(after > 1.5 * before, "echo {MAX_FACTOR} gave {after:.0} rows/s against {before:.0} without");

    // The client leaves: once idle the pipeline has no echo.
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while echo().is_none_or(|e| e.factor != 1) {
        assert!(Instant::now() < deadline, "the echo stayed up without clients: {:?}", echo());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(echo().unwrap().reason, "no client attached: no echo");
    local.shutdown().await;
}
