//! `stoker-worker bench read`: the Rust client reading running workers (`bench serve`) as fast
//! as it can, the same measurement `worker/bench/python_read.py` makes of the Python client, so
//! the two are compared on the same stream (`worker/bench/stream-clients.sh`).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use stoker_client::{Client, ClientOptions};

pub struct ReadBench {
    pub workers: Vec<String>,
    pub seconds: f64,
    pub max_message_bytes: usize,
    pub shared_memory: bool,
}

/// Batches taken before the clock starts: connections up, queues full.
const WARM_UP: usize = 50;

pub async fn command(bench: &ReadBench) -> anyhow::Result<()> {
    let mut options = ClientOptions::new("bench", "synthetic");
    options.max_message_bytes = bench.max_message_bytes;
    options.shared_memory = bench.shared_memory.then(|| stoker_client::shared::DIRECTORY.into());
    let mut client = Client::connect(bench.workers.clone(), options).await.context("connecting to the workers")?;
    for _ in 0..WARM_UP {
        client.next().await.context("the workers' streams ended")??;
    }
    let cpu = crate::cpu_time::process_cpu();
    let start = Instant::now();
    let (mut bytes, mut batches) = (0u64, 0u64);
    while start.elapsed() < Duration::from_secs_f64(bench.seconds) {
        let batch = client.next().await.context("the workers' streams ended")??;
        bytes += batch.payload_bytes() as u64;
        batches += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = crate::cpu_time::process_cpu() - cpu;
    let how = if bench.shared_memory {
        "shared memory".to_string()
    } else {
        format!("{} MiB messages", bench.max_message_bytes >> 20)
    };
    println!(
        "rust client, {} workers, {how}: {:.2} GB/s ({:.0} batches/s); this process: {:.3} s of CPU per GB",
        bench.workers.len(),
        bytes as f64 / seconds / 1e9,
        batches as f64 / seconds,
        cpu / (bytes as f64 / 1e9),
    );
    Ok(())
}
