//! `stoker-worker`: runs a pipeline and streams its batches (under the operator, or standalone
//! from a manifest), generates the benchmark corpus, adds restart markers to a JPEG corpus,
//! and runs the benchmarks (with the `bench` feature).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use stoker_api::token::TokenSource;
use stoker_api::{CacheMode, WorkerPipeline};
use stoker_worker::cached::CacheConfig;
use stoker_worker::corpus::{self, CorpusSpec};
use stoker_worker::dispatched::{DispatchedSource, DispatcherReaders, Link};
use stoker_worker::engine::{Engine, EngineConfig};
use stoker_worker::serve::EngineSource;
use stoker_worker::stream::StreamService;

/// How often a worker under the dispatcher reports its progress.
const HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a stopping worker keeps serving open streams.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Parser)]
#[command(version, about = "Stoker worker: preprocesses a pipeline's data and streams batches")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Run without a dispatcher from a DataPipeline manifest (--pipeline).
    #[arg(long, requires = "pipeline")]
    standalone: bool,
    /// A DataPipeline manifest; without it the pipeline comes from STOKER_PIPELINE (the operator's).
    #[arg(long)]
    pipeline: Option<PathBuf>,
    /// Where clients connect.
    #[arg(long, env = "STOKER_LISTEN", default_value = "0.0.0.0:50052")]
    listen: SocketAddr,
    /// Where Prometheus scrapes /metrics (docs/observability.md); port 0 picks a free one,
    /// logged at start.
    #[arg(long, env = "STOKER_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// Epochs to produce; unlimited when unset.
    #[arg(long)]
    epochs: Option<u64>,
    /// Transform threads; every core when unset.
    #[arg(long, env = "STOKER_THREADS")]
    threads: Option<usize>,
    /// Bytes of transformed elements and unsent batches held before production pauses for
    /// slow clients.
    #[arg(long, env = "STOKER_MEMORY_BUDGET", default_value_t = 512 << 20)]
    memory_budget: usize,
    /// The dispatcher's URL (the operator sets it); splits come from there instead of this
    /// worker producing every split itself.
    #[arg(long, env = "STOKER_DISPATCHER", conflicts_with = "standalone")]
    dispatcher: Option<String>,
    /// Caps the batches per second this worker sends to each job (under the dispatcher): a
    /// worker whose rate is known, for demos and autoscaler tests on small machines.
    #[arg(long, env = "STOKER_MAX_BATCH_RATE")]
    max_batch_rate: Option<f64>,
    /// Under the dispatcher: an epoch of a job that no client has read for this long stops
    /// being produced here (its clients left; the dispatcher took its splits back).
    #[arg(long, env = "STOKER_ABANDONED_AFTER_SECONDS", default_value_t = stoker_worker::dispatched::ABANDONED_AFTER.as_secs())]
    abandoned_after_seconds: u64,
    /// host:port clients reach this worker at; default: POD_IP (or 127.0.0.1) and the bound port.
    #[arg(long, env = "STOKER_ADVERTISE")]
    advertise: Option<String>,
    /// The shared cache volume (the namespace's stoker-cache PVC, or a local directory); no
    /// caching without it.
    #[arg(long, env = "STOKER_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Bytes the cache may hold; least recently used entries are evicted beyond it.
    #[arg(long, env = "STOKER_CACHE_CAP_BYTES", default_value_t = 90 << 30)]
    cache_cap_bytes: u64,
    /// Under the dispatcher: admit a stream only if the dispatcher says its token may read the
    /// pipeline (the operator sets this when it authenticates callers). This worker's own
    /// token comes from STOKER_TOKEN_FILE or the default projected-token path.
    #[arg(long, env = "STOKER_AUTHORIZE_READERS", default_value_t = false, action = clap::ArgAction::Set)]
    authorize_readers: bool,
    /// Serve TLS with this certificate chain (PEM; with --tls-key-file). Under the operator:
    /// the pipeline's certificate, for its workers Service's name.
    #[arg(long, env = "STOKER_TLS_CERT_FILE", requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    #[arg(long, env = "STOKER_TLS_KEY_FILE", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// The CA certificates (PEM) the dispatcher's certificate must chain to; with one, the
    /// dispatcher is reached over TLS unless its URL says http://.
    #[arg(long, env = "STOKER_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// A shared-memory directory: a consumer on this host that maps files from it, as this
    /// worker's user, gets its batches there instead of in messages. `none`: never.
    #[arg(long, env = "STOKER_SHARED_MEMORY_DIR", default_value = "/dev/shm")]
    shared_memory_dir: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Write the deterministic ImageNet-like JPEG corpus (`<out>/<class>/<n>.jpg`).
    Corpus {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1000)]
        images: usize,
        #[arg(long, default_value_t = 10)]
        classes: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Each image's width and height are drawn from [min-side, max-side] pixels.
        #[arg(long, default_value_t = 250)]
        min_side: u32,
        #[arg(long, default_value_t = 500)]
        max_side: u32,
    },
    /// Rewrite every JPEG under --input (files, and inside tar and TFRecord shards), without
    /// loss, with restart markers, so that a randomResizedCrop decodes only the segments around
    /// its window (docs/transforms.md).
    AddRestartMarkers {
        #[arg(long)]
        input: PathBuf,
        /// Where the rewritten tree goes (other files are copied); the same as --input rewrites
        /// in place.
        #[arg(long)]
        output: PathBuf,
        /// The widest a segment between two markers may be, in pixels: narrower segments cut
        /// closer to a window, and each costs a few bytes.
        #[arg(long, default_value_t = stoker_worker::restart_markers::SEGMENT_PX)]
        segment_px: usize,
    },
    /// Run a pipeline on a sample of its data on this machine, as one worker of --threads, and
    /// print what each op costs as JSON: what `stoker profile` plans from
    /// (docs/observability.md).
    Profile {
        /// A DataPipeline manifest.
        #[arg(long)]
        pipeline: PathBuf,
        /// Records the timed run reads (whole splits, at least one).
        #[arg(long, default_value_t = 2000)]
        elements: u64,
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long, default_value_t = 512 << 20)]
        memory_budget: usize,
        /// A directory on the cache volume, whose throughput is probed for the autocache verdict.
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Benchmarks (see docs/performance.md).
    #[cfg(feature = "bench")]
    Bench {
        #[command(subcommand)]
        bench: stoker_worker::bench::Bench,
    },
    /// Benchmarks: not in this build (its `bench` feature is off), so any use says how to get them.
    #[cfg(not(feature = "bench"))]
    #[command(hide = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    stoker_worker::alloc::tune();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        None => run(cli.run).await,
        Some(Command::Corpus { out, images, classes, seed, min_side, max_side }) => {
            anyhow::ensure!(
                0 < min_side && min_side <= max_side,
                "--min-side must be at least 1 and at most --max-side"
            );
            let spec = CorpusSpec { images, classes, seed, min_side, max_side, ..Default::default() };
            let files = corpus::generate(&out, &spec)?;
            let bytes: u64 = files.iter().map(|f| f.metadata().map_or(0, |m| m.len())).sum();
            println!("wrote {} images ({:.1} MB) under {}", files.len(), bytes as f64 / 1e6, out.display());
            Ok(())
        }
        Some(Command::AddRestartMarkers { input, output, segment_px }) => {
            anyhow::ensure!(segment_px >= 8, "--segment-px must be at least 8 (one block)");
            let r = stoker_worker::restart_markers::rewrite_tree(&input, &output, segment_px)?;
            println!(
                "rewrote {} JPEGs ({:.1} MB to {:.1} MB), left {} other files, members and values as they were, under {}",
                r.rewritten,
                r.bytes_in as f64 / 1e6,
                r.bytes_out as f64 / 1e6,
                r.copied,
                output.display()
            );
            if let Some(refusal) = r.first_refusal {
                println!("left as they were: JPEGs libjpeg could not read or damaged shards, the first {refusal}");
            }
            Ok(())
        }
        Some(Command::Profile { pipeline, elements, threads, memory_budget, cache_dir }) => {
            let options = stoker_worker::profile::SampleOptions { elements, threads, memory_budget, cache_dir };
            let profile = stoker_worker::profile::sample(manifest(&pipeline)?, &options).await?;
            println!("{}", serde_json::to_string(&profile)?);
            Ok(())
        }
        #[cfg(feature = "bench")]
        Some(Command::Bench { bench }) => bench.run().await,
        #[cfg(not(feature = "bench"))]
        Some(Command::Bench { .. }) => anyhow::bail!(
            "this stoker-worker was built without benchmarks; build it with `cargo build --release -p stoker-worker --features bench`"
        ),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let pipeline = load(&args)?;
    tracing::info!(
        pipeline = %format!("{}/{}", pipeline.namespace, pipeline.name),
        source = %pipeline.data_plane.source.describe(),
        ops = ?pipeline.data_plane.transforms.iter().map(|t| t.name()).collect::<Vec<_>>(),
        batch_size = pipeline.data_plane.batch_size,
        "pipeline loaded"
    );
    let cache = (pipeline.cache_mode != CacheMode::Never)
        .then(|| args.cache_dir.clone().map(|dir| CacheConfig { dir, cap_bytes: args.cache_cap_bytes }))
        .flatten();
    let mut config = EngineConfig { memory_budget: args.memory_budget, cache, ..Default::default() };
    if let Some(threads) = args.threads {
        config.threads = threads;
    }
    let engine = Engine::open(pipeline, config).await.context("opening the pipeline")?;
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("listening on {}", args.listen))?;
    let bound = listener.local_addr()?;
    tracing::info!(splits = engine.mix().slots(), listen = %bound, "serving batches");
    let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
    let mut stopped_early = stopping.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! { _ = term.recv() => {}, _ = tokio::signal::ctrl_c() => {} }
        tracing::info!("shutting down");
        stopping_tx.send_replace(true);
    });
    let stopped = |mut stopping: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopping.wait_for(|s| *s).await;
    };
    let metrics = stoker_worker::metrics::WorkerMetrics::of(&engine);
    // Batches matter more than their metrics: a worker whose metrics port is taken (a second
    // standalone worker on one host) serves without them, and says so.
    let sent = metrics.sent();
    if let Err(e) = stoker_worker::metrics::serve(args.metrics_addr, metrics.clone(), stopped(stopping.clone())).await {
        tracing::warn!(error = %e, "no /metrics; give this worker a free --metrics-addr (port 0 picks one)");
    }
    let shutdown = stopped(stopping.clone());
    // Clients' streams never end on their own: give them a moment after the signal, then go.
    // Under the dispatcher, what this worker still held is handed to the others.
    let deadline = async move {
        let _ = stopping.wait_for(|s| *s).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::info!("streams still open after the grace period; exiting");
    };
    let mut options = stoker_worker::stream::ServerOptions::default();
    if let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_key_file) {
        options.tls = Some(stoker_worker::stream::server_tls(cert, key)?);
        tracing::info!(certificate = %cert.display(), "serving TLS");
    }
    let shared = shared_memory(&args.shared_memory_dir);
    let served = async {
        match args.dispatcher.clone().filter(|_| !args.standalone) {
            Some(url) => {
                let engine = Arc::new(engine);
                let address = args.advertise.clone().unwrap_or_else(|| advertised(bound));
                let (url, tls) = dispatcher_tls(&url, args.ca_file.as_deref())?;
                // Registration retries while the dispatcher is unreachable; a SIGTERM meanwhile
                // (its parent going away) must end the worker, not wait for a dispatcher that is gone.
                let link = tokio::select! {
                    link = Link::register(&url, &engine, address, TokenSource::discover(None), tls) => link?,
                    _ = stopped_early.wait_for(|s| *s) => {
                        tracing::info!("stopped before registering with the dispatcher");
                        return Ok(());
                    }
                };
                let abandoned_after = std::time::Duration::from_secs(args.abandoned_after_seconds);
                let source =
                    Arc::new(DispatchedSource::new(engine.clone(), link.clone(), args.max_batch_rate, abandoned_after));
                let depths = Arc::downgrade(&source);
                metrics.set_queues(Box::new(move || depths.upgrade().map(|s| s.queue_depths()).unwrap_or_default()));
                link.spawn_heartbeats(engine, source.errors.clone(), HEARTBEAT_INTERVAL);
                let served = if args.authorize_readers {
                    let service = service(source, &shared, args.memory_budget, Some(&link), &sent)
                        .with_authenticator(DispatcherReaders::new(link.client()));
                    tokio::select! {
                        served = stoker_worker::stream::serve_on(listener, service, &options, shutdown) => served,
                        () = deadline => Ok(()),
                    }
                } else {
                    tokio::select! {
                        served = stoker_worker::stream::serve_on(listener, service(source, &shared, args.memory_budget, Some(&link), &sent), &options, shutdown) => served,
                        () = deadline => Ok(()),
                    }
                };
                served?;
            }
            None => {
                let (source, producer) = EngineSource::start(engine, args.epochs);
                tokio::select! {
                    served = stoker_worker::stream::serve_on(listener, service(source, &shared, args.memory_budget, None, &sent), &options, shutdown) => served?,
                    () = deadline => {}
                }
                if producer.is_finished() {
                    producer.join().map_err(|_| anyhow::anyhow!("the engine thread panicked"))??;
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    // Batches no consumer took stay in memory until removed.
    if let Some(shared) = &shared {
        shared.remove_all();
    }
    served
}

/// The shared-memory directory for consumers on this host, if there is a usable one.
fn shared_memory(dir: &std::path::Path) -> Option<Arc<stoker_worker::stream::SharedMemory>> {
    if dir.as_os_str() == "none" {
        return None;
    }
    match stoker_worker::stream::SharedMemory::open(dir) {
        Ok(shared) => Some(Arc::new(shared)),
        Err(e) => {
            tracing::info!(dir = %dir.display(), error = %e, "no batches through shared memory");
            None
        }
    }
}

/// The dispatcher URL with its scheme, and the TLS settings to reach it: TLS when the URL says
/// https:// or (without a scheme) when a CA file is given.
fn dispatcher_tls(
    url: &str,
    ca_file: Option<&std::path::Path>,
) -> anyhow::Result<(String, Option<tonic::transport::ClientTlsConfig>)> {
    use stoker_api::tls::{Scheme, read_pem, scheme, with_scheme};
    let scheme = scheme(url, ca_file.is_some(), false).map_err(|e| anyhow::anyhow!("the dispatcher URL: {e}"))?;
    let tls = match (&scheme, ca_file) {
        (Scheme::Tls, Some(path)) => {
            let ca = tonic::transport::Certificate::from_pem(read_pem(path, "CA bundle")?);
            Some(tonic::transport::ClientTlsConfig::new().ca_certificate(ca))
        }
        _ => None,
    };
    Ok((with_scheme(url, &scheme), tls))
}

/// The address to register: the pod's IP in a cluster, loopback otherwise, with the bound port.
fn advertised(bound: SocketAddr) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let host = std::env::var("POD_IP").unwrap_or_else(|_| "127.0.0.1".into());
    format!("{host}:{}", bound.port())
}

fn load(args: &RunArgs) -> anyhow::Result<WorkerPipeline> {
    let pipeline = match &args.pipeline {
        Some(path) => manifest(path)?,
        None => {
            let json =
                std::env::var("STOKER_PIPELINE").context("no --pipeline given and STOKER_PIPELINE is not set")?;
            serde_json::from_str(&json).context("parsing STOKER_PIPELINE")?
        }
    };
    Ok(pipeline)
}

/// The pipeline of a DataPipeline manifest, validated.
fn manifest(path: &std::path::Path) -> anyhow::Result<WorkerPipeline> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let dp = stoker_api::parse_manifest(&text).with_context(|| format!("loading {}", path.display()))?;
    let name = dp.metadata.name.clone().unwrap_or_default();
    let namespace = dp.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    Ok(WorkerPipeline::new(&namespace, &name, &dp.spec))
}

/// The batch service of `source`, with shared memory as set up, keeping at most a quarter of
/// the memory budget for streams whose connection broke; under the dispatcher, sending nothing
/// again of before the worker registered again (`link`); counting what it sends into `sent`.
fn service<S: stoker_worker::stream::BatchSource>(
    source: S,
    shared: &Option<Arc<stoker_worker::stream::SharedMemory>>,
    memory_budget: usize,
    link: Option<&Arc<Link>>,
    sent: &Arc<stoker_worker::stream::SentByJob>,
) -> StreamService<S> {
    let mut resumes = stoker_worker::stream::Resumes::new(memory_budget as u64 / 4);
    if let Some(link) = link.cloned() {
        resumes = resumes.with_generation(Box::new(move || link.generation()));
    }
    StreamService::new(source).with_shared_memory(shared.clone()).with_resumes(resumes).with_sent(sent.clone())
}
