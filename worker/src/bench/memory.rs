//! `stoker-worker bench memory`: a real standalone worker process under a memory budget, read
//! by a deliberately slow client; its peak RSS must stay under the budget plus 200 MB.
//!
//! The worker runs the ResNet-50 training transforms with large float32 batches, so a few
//! batches exceed the budget and the budget is what bounds memory. The peak is the kernel's
//! high-water mark (`VmHWM` in /proc/<pid>/status), so spikes between samples count too.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions};

/// What the worker may use beyond its budget: binary, runtime, file reads, the elements being
/// transformed and the gRPC send buffers.
pub const ALLOWANCE_BYTES: u64 = 200_000_000;

#[derive(Debug, Clone)]
pub struct MemoryBench {
    pub corpus: PathBuf,
    pub memory_budget: u64,
    pub client_delay: Duration,
    pub duration: Duration,
    pub batch_size: u32,
    pub threads: Option<usize>,
}

#[derive(Debug)]
pub struct MemoryReport {
    pub peak_rss: u64,
    /// Largest VmRSS seen by sampling (the high-water mark is the one that counts).
    pub sampled_rss: u64,
    pub batches: u64,
    pub payload_bytes: u64,
    pub seconds: f64,
    pub limit: u64,
}

impl MemoryReport {
    pub fn passed(&self) -> bool {
        self.peak_rss <= self.limit
    }
}

/// Kills the worker however the bench ends.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (VmHWM, VmRSS) in bytes from /proc/<pid>/status.
pub fn rss_of(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or_else(|| anyhow::anyhow!("no {name} in /proc/{pid}/status"))?;
        let kb: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

fn manifest(corpus: &Path, batch_size: u32) -> String {
    format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: memory, namespace: bench}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: imageFolder}}\n  batchSize: {batch_size}\n  seed: 1\n  transforms:\n  \
         - decodeImage: {{}}\n  - randomResizedCrop: {{size: [224, 224]}}\n  - randomFlip: {{}}\n  \
         - normalize: {{mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], dtype: float32}}\n",
        corpus.display()
    )
}

pub async fn run(bench: &MemoryBench) -> anyhow::Result<MemoryReport> {
    let corpus = bench.corpus.canonicalize()?;
    let dir = std::env::temp_dir().join(format!("stoker-bench-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pipeline = dir.join("pipeline.yaml");
    std::fs::write(&pipeline, manifest(&corpus, bench.batch_size))?;
    let log = dir.join("worker.log");
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;

    let mut command = Command::new(std::env::current_exe()?);
    command
        .args(["--standalone", "--pipeline"])
        .arg(&pipeline)
        .args(["--listen", &addr.to_string(), "--metrics-addr", "127.0.0.1:0"])
        .args(["--memory-budget", &bench.memory_budget.to_string()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    if let Some(threads) = bench.threads {
        command.args(["--threads", &threads.to_string()]);
    }
    let mut worker = Worker(command.spawn()?);
    let pid = worker.0.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        anyhow::ensure!(worker.0.try_wait()?.is_none(), "the worker exited early; see {}", log.display());
        anyhow::ensure!(Instant::now() < deadline, "the worker did not listen within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A slow trainer: one batch ahead at most, a fixed pause per batch.
    let mut options = ClientOptions::new("bench", "memory");
    options.prefetch = 1;
    let mut client = Client::connect(vec![format!("http://{addr}")], options).await?;
    let sampler = tokio::spawn(async move {
        let mut max = 0;
        while let Ok((_, rss)) = rss_of(pid) {
            max = max.max(rss);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        max
    });
    let started = Instant::now();
    let (mut batches, mut payload_bytes) = (0u64, 0u64);
    while started.elapsed() < bench.duration {
        let batch = match tokio::time::timeout(Duration::from_secs(60), client.next()).await {
            Ok(Some(batch)) => batch?,
            Ok(None) => anyhow::bail!("the worker's stream ended early; see {}", log.display()),
            Err(_) => anyhow::bail!("no batch within 60 s; see {}", log.display()),
        };
        batches += 1;
        payload_bytes += batch.tensors.values().map(|t| t.data.len() as u64).sum::<u64>();
        drop(batch);
        tokio::time::sleep(bench.client_delay).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (peak_rss, _) = rss_of(pid)?;
    drop(client);
    drop(worker);
    let sampled_rss = sampler.await?;
    let report = MemoryReport {
        peak_rss,
        sampled_rss,
        batches,
        payload_bytes,
        seconds,
        limit: bench.memory_budget + ALLOWANCE_BYTES,
    };
    if report.passed() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        println!("the worker's log: {}", log.display());
    }
    Ok(report)
}

/// Runs the bench and prints its report; an error when the peak is over the limit.
pub async fn command(bench: &MemoryBench) -> anyhow::Result<()> {
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "worker: budget {:.0} MB ({} bytes), batches of {} float32 224x224x3 ({:.0} MB); client: prefetch 1, {} ms per batch, {} s",
        mb(bench.memory_budget),
        bench.memory_budget,
        bench.batch_size,
        mb(u64::from(bench.batch_size) * 224 * 224 * 3 * 4),
        bench.client_delay.as_millis(),
        bench.duration.as_secs()
    );
    let r = run(bench).await?;
    println!(
        "client read {} batches ({:.0} MB) in {:.1} s: {:.1} MB/s",
        r.batches,
        mb(r.payload_bytes),
        r.seconds,
        mb(r.payload_bytes) / r.seconds
    );
    println!(
        "worker peak RSS (VmHWM) {:.0} MB (largest sampled VmRSS {:.0} MB); limit: budget + {:.0} MB = {:.0} MB",
        mb(r.peak_rss),
        mb(r.sampled_rss),
        mb(ALLOWANCE_BYTES),
        mb(r.limit)
    );
    if r.passed() {
        println!("PASS: peak RSS {:.0} MB <= {:.0} MB", mb(r.peak_rss), mb(r.limit));
        Ok(())
    } else {
        println!("FAIL: peak RSS {:.0} MB > {:.0} MB", mb(r.peak_rss), mb(r.limit));
        std::process::exit(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_rss() {
        let (hwm, rss) = rss_of(std::process::id()).unwrap();
        assert!(hwm >= rss && rss > 0, "{hwm} {rss}");
    }
}
