//! Stream throughput by hand (ignored in normal runs): two loopback workers serving ready
//! ~4 MiB batches, one Rust client, GB/s of tensor payload.
//!
//!     cargo test --release -p stoker-worker --test stream_bench -- --ignored --nocapture

mod stream_support;

use std::time::{Duration, Instant};

use stoker_api::DType;
use stoker_client::ClientOptions;
use stoker_worker::stream::SyntheticSource;
use stream_support::{connect, options, start};

/// 14 float16 HWC 224x224 images (4.02 MiB) and their labels: an ImageNet batch after normalize.
fn ready_batches() -> SyntheticSource {
    SyntheticSource::new(vec![
        ("image".into(), DType::Float16, vec![14, 224, 224, 3]),
        ("label".into(), DType::Int64, vec![14]),
    ])
    .shared_payload()
}

async fn measure(name: &str, opts: ClientOptions) {
    let a = start(ready_batches()).await;
    let b = start(ready_batches()).await;
    let mut client = connect(&[&a, &b], opts).await;
    for _ in 0..50 {
        client.next().await.unwrap().unwrap();
    }
    let (mut bytes, mut batches) = (0usize, 0u64);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let batch = client.next().await.unwrap().unwrap();
        bytes += batch.payload_bytes();
        batches += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let w = client.window();
    println!(
        "{name}: {:.2} GB/s ({batches} batches, {:.0} batches/s), median batch time {:?}, wait fraction {:.2}",
        bytes as f64 / secs / 1e9,
        batches as f64 / secs,
        w.median,
        w.wait_fraction
    );
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark: run by hand in release"]
async fn two_workers_to_one_client() {
    measure("defaults (4 MiB messages, 4 MiB window)", options()).await;
    let mut big = options();
    big.max_message_bytes = 16 << 20;
    big.stream_window_bytes = 16 << 20;
    measure("16 MiB messages, 16 MiB window", big).await;
}
