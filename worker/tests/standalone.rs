//! Two standalone worker processes serve a pipeline over gRPC and the Rust client streams from
//! both: the path a training job takes, minus the dispatcher.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions};
use stoker_worker::corpus::{CorpusSpec, generate};

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

async fn wait_listening(addr: SocketAddr, worker: &mut Worker) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(worker.0.try_wait().unwrap().is_none(), "worker on {addr} exited early");
        assert!(Instant::now() < deadline, "worker on {addr} did not listen within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_streams_one_epoch_from_two_standalone_workers() {
    let data = tempfile::tempdir().unwrap();
    generate(data.path(), &CorpusSpec { images: 12, classes: 3, min_side: 250, max_side: 280, ..Default::default() })
        .unwrap();
    let image_bytes: u64 = std::fs::read_dir(data.path())
        .unwrap()
        .flat_map(|class| std::fs::read_dir(class.unwrap().path()).unwrap())
        .map(|image| image.unwrap().metadata().unwrap().len())
        .sum();
    let manifest = data.path().join("pipeline.yaml");
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: tiny, namespace: team-a}}\nspec:\n  \
             source: {{uri: 'file://{}/', format: imageFolder}}\n  batchSize: 5\n  transforms:\n  \
             - decodeImage: {{}}\n  - randomResizedCrop: {{size: [64, 64]}}\n  - normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25], dtype: float16}}\n",
            data.path().display()
        ),
    )
    .unwrap();

    let addrs = [free_addr(), free_addr()];
    let metrics = [free_addr(), free_addr()];
    let mut workers: Vec<Worker> = addrs
        .iter()
        .zip(&metrics)
        .map(|(addr, metrics)| {
            Worker(
                Command::new(env!("CARGO_BIN_EXE_stoker-worker"))
                    .args(["--standalone", "--pipeline", manifest.to_str().unwrap(), "--epochs", "1", "--threads", "1"])
                    .args(["--listen", &addr.to_string(), "--metrics-addr", &metrics.to_string()])
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    for (addr, worker) in addrs.iter().zip(workers.iter_mut()) {
        wait_listening(*addr, worker).await;
    }

    let urls = addrs.iter().map(|a| format!("http://{a}")).collect();
    let mut client = Client::connect(urls, ClientOptions::new("team-a", "tiny")).await.unwrap();
    let (mut images, mut batches) = (0, 0);
    let read = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(batch) = client.next().await {
            let batch = batch.unwrap();
            let image = &batch.tensors["image"];
            assert_eq!(image.dtype, stoker_api::DType::Float16);
            assert_eq!(&image.shape[1..], [64, 64, 3]);
            assert_eq!(batch.tensors["label"].shape, [image.shape[0]]);
            images += image.shape[0];
            batches += 1;
        }
    });
    read.await.expect("both workers finish their epoch within 120 s");
    // Standalone, each worker serves the whole epoch (splitting it is the dispatcher's job).
    assert_eq!(images, 24, "12 images from each worker");
    assert_eq!(batches, 6, "5 + 5 + 2 per worker");
    assert_eq!(client.window().batches, 6, "the client measured every batch");

    // Each worker's /metrics counts what it made, per op, under the pipeline's labels.
    for addr in metrics {
        let text = stoker_worker::metrics::scrape(addr).await.unwrap();
        let labels = r#"namespace="team-a",pipeline="tiny""#;
        let series = |name: &str| {
            let prefix = format!("{name}{{{labels}}} ");
            text.lines().find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
        };
        assert_eq!(series("stoker_worker_batches_total"), Some(3.0), "{text}");
        assert_eq!(series("stoker_worker_records_read_total"), Some(12.0), "{text}");
        // Every series of `name`, whatever its other labels.
        let sum = |name: &str| -> f64 {
            let prefix = format!("{name}{{");
            text.lines().filter_map(|l| l.strip_prefix(&prefix)?.rsplit_once("} ")?.1.parse::<f64>().ok()).sum()
        };
        // It read each image whole, once, from its one source; and sent its three batches.
        assert_eq!(sum("stoker_worker_source_read_bytes_total"), image_bytes as f64, "{text}");
        assert!(sum("stoker_worker_source_read_seconds_total") > 0.0, "{text}");
        assert_eq!(sum("stoker_worker_sent_batches_total"), 3.0, "{text}");
        // Labels in the text format's order; normalize is folded into the crop, which it is
        // timed with (docs/observability.md).
        for (index, op, timed) in [(0, "decodeImage", true), (1, "randomResizedCrop", true), (2, "normalize", false)] {
            let op_series = format!(
                r#"stoker_worker_op_seconds_total{{namespace="team-a",op="{op}",op_index="{index}",pipeline="tiny"}} "#
            );
            let seconds = text.lines().find_map(|l| l.strip_prefix(&op_series)?.parse::<f64>().ok());
            assert!(seconds.is_some_and(|s| (s > 0.0) == timed), "{op}: {text}");
        }
    }
}
