//! Stream throughput by hand (ignored in normal runs): two loopback workers serving ready
//! ~4 MiB batches, one Rust client, GB/s of tensor payload.
//!
//!     cargo test --release -p stoker-worker --test worker stream_bench:: -- --ignored --nocapture

use std::time::{Duration, Instant};

use crate::stream_support::{connect, options, start};
use stoker_api::DType;
use stoker_client::ClientOptions;
use stoker_worker::stream::SyntheticSource;

/// 14 float16 HWC 224x224 images (4.02 MiB) and their labels: an ImageNet batch after normalize.
fn ready_batches() -> SyntheticSource {
    images(14, 224)
}

/// `n` float16 HWC images of `side` x `side` and their labels, each row naming its origin.
fn images(n: usize, side: usize) -> SyntheticSource {
    SyntheticSource::new(vec![
        ("image".into(), DType::Float16, vec![n, side, side, 3]),
        ("label".into(), DType::Int64, vec![n]),
    ])
    .shared_payload()
}

/// GB/s of tensor payload from two workers serving `source` to one client for 5 s.
async fn measure(name: &str, opts: ClientOptions) -> f64 {
    measure_source(name, opts, ready_batches).await.0
}

/// CPU time this process (workers and client alike) has used, from /proc: the cost of a
/// stream, which a shared 2-core machine measures far more steadily than its throughput.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    // utime and stime, fields 14 and 15 of the line: 12 and 13 after the command's ')'.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_secs_f64(ticks as f64 / 100.0)
}

/// GB/s, and CPU seconds spent per GB.
async fn measure_source(name: &str, opts: ClientOptions, source: impl Fn() -> SyntheticSource) -> (f64, f64) {
    let a = start(source()).await;
    let b = start(source()).await;
    let mut client = connect(&[&a, &b], opts).await;
    for _ in 0..50 {
        client.next().await.unwrap().unwrap();
    }
    let (mut bytes, mut batches) = (0usize, 0u64);
    let cpu = cpu_time();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let batch = client.next().await.unwrap().unwrap();
        bytes += batch.payload_bytes();
        batches += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu_per_gb = (cpu_time() - cpu).as_secs_f64() / (bytes as f64 / 1e9);
    let w = client.window();
    let gbps = bytes as f64 / secs / 1e9;
    println!(
        "{name}: {gbps:.2} GB/s ({batches} batches, {:.0} batches/s), {cpu_per_gb:.3} CPU s/GB, median batch time {:?}, wait fraction {:.2}",
        batches as f64 / secs,
        w.median,
        w.wait_fraction
    );
    (gbps, cpu_per_gb)
}

/// What naming each row's origin costs the stream, alternating rounds in one run: ImageNet
/// batches (14 rows of 301 KB) and small ones (256 rows of 3 KB, the most rows per byte a
/// vision pipeline sends).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark: run by hand in release"]
async fn provenance_overhead() {
    for (shape, n, side) in [("14 x 224x224x3", 14, 224), ("256 x 32x32x3", 256, 32)] {
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for round in 0..5 {
            without.push(
                measure_source(&format!("{shape}, round {round}, no rows"), options(), || {
                    images(n, side).without_rows()
                })
                .await,
            );
            with.push(measure_source(&format!("{shape}, round {round}, rows"), options(), || images(n, side)).await);
        }
        let median = |v: &[(f64, f64)], cpu: bool| {
            let mut v: Vec<f64> = v.iter().map(|&(gbps, s)| if cpu { s } else { gbps }).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (gbps, cpu) =
            ((median(&without, false), median(&with, false)), (median(&without, true), median(&with, true)));
        println!(
            "{shape}: median of 5 without rows {:.2} GB/s and {:.3} CPU s/GB, with rows {:.2} GB/s ({:+.1}%) and {:.3} CPU s/GB ({:+.1}%)",
            gbps.0,
            cpu.0,
            gbps.1,
            (gbps.1 / gbps.0 - 1.0) * 100.0,
            cpu.1,
            (cpu.1 / cpu.0 - 1.0) * 100.0
        );
    }
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
