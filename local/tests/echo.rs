//! Automatic echo with real processes: one one-thread worker (`workers.max: 1`) decoding large
//! JPEGs for a trainer that never has to compute (so it always waits), the pipeline's `echo`
//! with `maxFactor: 4` after the decode. The scaling loop, held at `workers.max` with the
//! client waiting, raises the factor a step per window; the dispatcher hands it out with the
//! splits, the worker decodes each image once and crops it four times, and the client gets more
//! rows a second. With the client gone the pipeline goes idle and the echo back to 1.

use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions};
use stoker_local::mode::{Local, LocalOptions};
use stoker_local::workers::{LocalWorkerConfig, worker_binary};
use stoker_worker::corpus::{CorpusSpec, generate};

const MAX_FACTOR: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_at_max_with_the_client_waiting_the_echo_rises_and_the_rows_come_faster() {
    assert!(
        worker_binary().is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        worker_binary().display()
    );
    let (data, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Large images: decoding dominates, and it is what the echo does once for four rows.
    let corpus = CorpusSpec { images: 240, classes: 2, min_side: 700, max_side: 800, ..Default::default() };
    generate(data.path(), &corpus).unwrap();
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\n\
         transforms:\n\
         - decodeImage: {{channels: 3}}\n\
         - echo: {{maxFactor: {MAX_FACTOR}}}\n\
         - randomResizedCrop: {{size: [32, 32]}}\n\
         shuffle: {{bufferSize: 64}}\n\
         batchSize: 8\n\
         workers: {{min: 1, max: 1}}\n\
         autoscaling: {{policy: {{idleAfterSeconds: 3}}}}\n",
        data.path().display()
    );
    let workers =
        LocalWorkerConfig { max_batch_rate: None, ..LocalWorkerConfig::rate_capped(1.0, logs.path().to_path_buf()) };
    let local = Local::start(LocalOptions {
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
    .unwrap();
    let key = local.key.clone();
    let echo = || local.book.get(&key).and_then(|r| r.echo);
    let mut client = Client::from_dispatcher(&local.url, ClientOptions::new("ns", "echo")).await.unwrap();

    // Rows a second over each stretch of reading, and the highest copy number seen in it.
    let mut read_for = async |seconds: u64| {
        let (start, mut rows, mut top_copy) = (Instant::now(), 0u64, 0u32);
        while start.elapsed() < Duration::from_secs(seconds) {
            let batch = client.next().await.expect("the stream goes on").expect("no error");
            rows += batch.rows.len() as u64;
            top_copy = top_copy.max(batch.echo_copies().max().unwrap_or(0));
        }
        (rows as f64 / start.elapsed().as_secs_f64(), top_copy)
    };
    let began = Instant::now();
    let (before, first_copies) = read_for(4).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while echo().is_none_or(|e| e.factor < MAX_FACTOR) {
        assert!(Instant::now() < deadline, "the echo never reached {MAX_FACTOR}: {:?}", echo());
        read_for(1).await;
    }
    let reached = began.elapsed();
    let status = echo().unwrap();
    assert!(status.reason.contains("workers.max (1)"), "{status:?}");
    // Splits handed out before the last raise drain first.
    read_for(6).await;
    let (after, copies) = read_for(6).await;
    eprintln!(
        "rows/s {before:.0} in the first 4 s (copies up to {first_copies}), {after:.0} at echo {MAX_FACTOR}, \
         reached after {reached:.1?}; {status:?}"
    );
    assert_eq!(copies, MAX_FACTOR - 1, "rows of every copy arrive");
    assert!(after > 1.5 * before, "echo {MAX_FACTOR} gave {after:.0} rows/s against {before:.0}");

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
