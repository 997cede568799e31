//! The `stoker-worker bench` subcommands: each generates its corpus when missing, runs, and
//! prints its report.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use stoker_api::DType;

use super::memory::MemoryBench;
use crate::corpus::{self, CorpusSpec};
use crate::stream::{self, ServerOptions, StreamService, SyntheticSource};

/// The ResNet-50 benchmarks' image folder and threads.
#[derive(clap::Args)]
pub struct ImageCorpus {
    /// The corpus; generated there (with --images) if it does not exist.
    #[arg(long)]
    corpus: PathBuf,
    #[arg(long, default_value_t = 2000)]
    images: usize,
    #[arg(long)]
    threads: Option<usize>,
}

/// `stoker-worker bench ...` (see docs/performance.md).
#[derive(Subcommand)]
pub enum Bench {
    /// ResNet-50 training transforms over an image folder: images/s and images/s per core.
    Preprocess {
        #[command(flatten)]
        images: ImageCorpus,
        /// Epochs to time; the best is reported.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// What serving /metrics costs: ResNet-50 epochs with the endpoint off, and on while
    /// scraped every --scrape-ms, alternating in one process; images/s of each and on/off.
    MetricsCost {
        #[command(flatten)]
        images: ImageCorpus,
        /// Rounds of one epoch off and one on.
        #[arg(long, default_value_t = 6)]
        rounds: usize,
        #[arg(long, default_value_t = 100)]
        scrape_ms: u64,
    },
    /// ResNet-50 transforms with an autocache hint after decode and resize to 256: epoch
    /// times computing everything, writing the cache, and reading it back.
    Cache {
        /// The corpus; generated there (with --images) if it does not exist.
        #[arg(long)]
        corpus: PathBuf,
        #[arg(long, default_value_t = 1000)]
        images: usize,
        /// The directory standing in for the cache volume.
        #[arg(long, default_value = "/tmp/stoker-bench-cache")]
        volume: PathBuf,
        #[arg(long)]
        threads: Option<usize>,
        /// Epochs reading the cache.
        #[arg(long, default_value_t = 2)]
        gets: usize,
    },
    /// Peak RSS of a standalone worker read by a slow client vs its budget plus 200 MB;
    /// exits nonzero when over.
    Memory {
        /// The corpus; generated there (1000 images) if it does not exist.
        #[arg(long)]
        corpus: PathBuf,
        #[arg(long, default_value_t = 256 << 20)]
        memory_budget: u64,
        /// The client's pause after each batch.
        #[arg(long, default_value_t = 500)]
        client_delay_ms: u64,
        #[arg(long, default_value_t = 30)]
        duration_s: u64,
        /// float32 224x224x3 images per batch (256: 154 MB).
        #[arg(long, default_value_t = 256)]
        batch_size: u32,
        #[arg(long)]
        threads: Option<usize>,
    },
    /// DLRM's preprocessing of a Criteo-style Parquet table (worker/bench/peers/criteo_generate.py)
    /// beside its floor, the projected columns decoded alone: rows/s and bytes read.
    Dlrm {
        /// The table's directory of .parquet files.
        #[arg(long)]
        data: PathBuf,
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, default_value_t = 2048)]
        batch_size: u32,
        /// Epochs to time, each beside a floor run.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// Serves ready synthetic batches (float16 224x224x3 images and int64 labels) as fast as a
    /// client reads them: the other end of the stream benchmarks (clients in any language).
    Serve {
        #[arg(long, default_value = "127.0.0.1:50052")]
        listen: SocketAddr,
        /// Images per batch (14: a 4 MiB batch).
        #[arg(long, default_value_t = 14)]
        images: usize,
        /// Serves batches of this many rows of 16 bytes (one uint8 tensor) instead of images:
        /// what each batch costs beyond its bytes.
        #[arg(long)]
        small_rows: Option<usize>,
        /// Hands batches to consumers on this host that ask through this shared-memory
        /// directory (as the worker's `--shared-memory-dir`); without it, messages only.
        #[arg(long)]
        shared_memory_dir: Option<std::path::PathBuf>,
    },
    /// The Rust client reading running workers (`bench serve`) as fast as it can: GB/s,
    /// batches/s and its CPU per GB, as `worker/bench/python_read.py` measures the Python one.
    Read {
        /// A worker's address (host:port); repeat for each.
        #[arg(long = "worker", required = true)]
        workers: Vec<String>,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        #[arg(long, default_value_t = 64 << 20)]
        max_message_bytes: usize,
        /// Batches through shared memory (workers on this host serving with a shared-memory
        /// directory).
        #[arg(long)]
        shared_memory: bool,
    },
}

impl Bench {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Bench::Preprocess { images: ImageCorpus { corpus, images, threads }, repeat } => {
                ensure_corpus(&corpus, images)?;
                preprocess(&corpus, all_cores(threads), repeat).await
            }
            Bench::MetricsCost { images: ImageCorpus { corpus, images, threads }, rounds, scrape_ms } => {
                ensure_corpus(&corpus, images)?;
                let scrape = Duration::from_millis(scrape_ms);
                super::metrics_cost::command(&corpus, all_cores(threads), rounds, scrape).await
            }
            Bench::Cache { corpus, images, volume, threads, gets } => {
                ensure_corpus(&corpus, images)?;
                cache(&corpus, &volume, all_cores(threads), gets).await
            }
            Bench::Memory { corpus, memory_budget, client_delay_ms, duration_s, batch_size, threads } => {
                ensure_corpus(&corpus, CorpusSpec::default().images)?;
                let client_delay = Duration::from_millis(client_delay_ms);
                let duration = Duration::from_secs(duration_s);
                super::memory::command(&MemoryBench {
                    corpus,
                    memory_budget,
                    client_delay,
                    duration,
                    batch_size,
                    threads,
                })
                .await
            }
            Bench::Dlrm { data, threads, batch_size, repeat } => {
                super::dlrm::command(&data, all_cores(threads), batch_size, repeat).await
            }
            Bench::Serve { listen, images, small_rows, shared_memory_dir } => {
                serve(listen, images, small_rows, shared_memory_dir).await
            }
            Bench::Read { workers, seconds, max_message_bytes, shared_memory } => {
                super::read::command(&super::read::ReadBench { workers, seconds, max_message_bytes, shared_memory })
                    .await
            }
        }
    }
}

/// Generates the corpus at `corpus` unless it is there.
fn ensure_corpus(corpus: &Path, images: usize) -> anyhow::Result<()> {
    if !corpus.exists() {
        eprintln!("generating {images} images under {} ...", corpus.display());
        corpus::generate(corpus, &CorpusSpec { images, ..Default::default() })?;
    }
    Ok(())
}

fn all_cores(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

async fn preprocess(corpus: &Path, threads: usize, repeat: usize) -> anyhow::Result<()> {
    let mut best: Option<super::PreprocessReport> = None;
    for run in 1..=repeat.max(1) {
        let report = super::preprocess(corpus, threads).await?;
        println!(
            "run {run}: {} images in {:.2} s: {:.0} images/s, {:.0} images/s per core ({threads} threads)",
            report.images,
            report.seconds,
            report.images_per_second(),
            report.per_core()
        );
        let ops: Vec<String> = report.op_ms.iter().map(|(op, ms)| format!("{op} {ms:.2} ms")).collect();
        println!("  per image: {}", ops.join(", "));
        if best.as_ref().is_none_or(|b| report.seconds < b.seconds) {
            best = Some(report);
        }
    }
    let best = best.expect("at least one run");
    println!("best: {:.0} images/s, {:.0} images/s per core", best.images_per_second(), best.per_core());
    Ok(())
}

async fn cache(corpus: &Path, volume: &Path, threads: usize, gets: usize) -> anyhow::Result<()> {
    let r = super::cache(corpus, volume, threads, gets).await?;
    let line = |what: &str, seconds: f64| {
        println!(
            "{what}: {} images in {seconds:.2} s: {:.0} images/s ({threads} threads)",
            r.images,
            r.images as f64 / seconds
        )
    };
    line("compute (no cache)", r.compute);
    line("put (computing, writing the cache)", r.put);
    println!(
        "entry: {:.0} MB, {:.0} KB per image",
        r.entry_bytes as f64 / 1e6,
        r.entry_bytes as f64 / 1e3 / r.images.max(1) as f64
    );
    for (i, &seconds) in r.gets.iter().enumerate() {
        line(&format!("get {} (reading the cache, page cache dropped)", i + 1), seconds);
    }
    let best = r.gets.iter().copied().fold(f64::INFINITY, f64::min);
    println!("best get: {:.2}x the compute epoch's speed", r.compute / best);
    Ok(())
}

async fn serve(
    listen: SocketAddr,
    images: usize,
    small_rows: Option<usize>,
    shared_memory_dir: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let tensors = match small_rows {
        Some(rows) => vec![("x".into(), DType::Uint8, vec![rows, 16])],
        None => vec![
            ("image".into(), DType::Float16, vec![images, 224, 224, 3]),
            ("label".into(), DType::Int64, vec![images]),
        ],
    };
    let source = SyntheticSource::new(tensors).shared_payload();
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("listening on {listen}"))?;
    tracing::info!(listen = %listener.local_addr()?, "serving synthetic batches");
    let shared = match shared_memory_dir {
        Some(dir) => Some(std::sync::Arc::new(
            stream::SharedMemory::open(&dir)
                .with_context(|| format!("the shared-memory directory {}", dir.display()))?,
        )),
        None => None,
    };
    let service = StreamService::new(source).with_shared_memory(shared.clone());
    let served = stream::serve_on(listener, service, &ServerOptions::default(), async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
    })
    .await;
    if let Some(shared) = shared {
        shared.remove_all();
    }
    Ok(served?)
}
