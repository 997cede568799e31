//! `stoker demo`: local mode on a generated image corpus with a synthetic trainer, showing the
//! autoscaler converge. Workers are capped at a known rate, so the right answer is known:
//! ceil(demand / rate) workers, where demand = 1 / compute time per batch.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use stoker_client::trainer::{Stop, TrainerSpec, train};
use stoker_client::{Client, ClientOptions};

use crate::mode::{Local, LocalOptions};
use crate::workers::{LocalWorkerConfig, worker_binary};

#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub corpus: PathBuf,
    pub images: usize,
    /// The synthetic trainer's compute time per batch.
    pub compute: Duration,
    /// Each worker's cap, in batches per second.
    pub worker_rate: f64,
    pub max_workers: u32,
    pub window: Duration,
    pub run_for: Duration,
}

impl DemoOptions {
    /// Workers that exactly keep up with the trainer.
    pub fn optimum(&self) -> u32 {
        (1.0 / (self.worker_rate * self.compute.as_secs_f64()) - 1e-9).ceil().max(1.0) as u32
    }
}

/// What the demo saw, for the summary and for tests.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub optimum: u32,
    pub final_workers: u32,
    pub decisions: usize,
    /// When the last rescale happened.
    pub converged_after: Option<Duration>,
    pub steps: u64,
    pub images: u64,
    pub elapsed: Duration,
    /// How long the trainer waited for data (what the operator shows as status.dataWait).
    pub data_wait: Option<stoker_api::DataWaitStatus>,
}

/// The demo's pipeline (also the local policy comparison's): decode, crop to 96x96, flip,
/// normalize, batches of 8.
pub(crate) fn pipeline_yaml(corpus: &Path, max_workers: u32) -> String {
    format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\n\
         transforms:\n\
         - decodeImage: {{channels: 3}}\n\
         - randomResizedCrop: {{size: [96, 96]}}\n\
         - randomFlip: {{horizontal: true}}\n\
         - normalize: {{mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}}\n\
         shuffle: {{bufferSize: 64}}\n\
         batchSize: 8\n\
         workers: {{min: 1, max: {max_workers}}}\n",
        corpus.display()
    )
}

/// Images in the demo's corpus.
pub const CORPUS_IMAGES: usize = 1200;

/// Generates the corpus with `stoker-worker corpus` unless it is there.
pub async fn ensure_corpus(dir: &Path, images: usize) -> anyhow::Result<()> {
    let marker = dir.join(".complete");
    if std::fs::read_to_string(&marker).is_ok_and(|n| n.trim() == images.to_string()) {
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(dir);
    let status = tokio::process::Command::new(worker_binary())
        .args(["corpus", "--out"])
        .arg(dir)
        .args(["--images", &images.to_string(), "--classes", "5"])
        .status()
        .await
        .context("running stoker-worker corpus")?;
    anyhow::ensure!(status.success(), "stoker-worker corpus failed");
    std::fs::write(marker, images.to_string())?;
    Ok(())
}

/// Runs the demo, printing a live view to `out` (one line per window).
pub async fn run(options: &DemoOptions, out: &mut (dyn std::io::Write + Send)) -> anyhow::Result<DemoReport> {
    ensure_corpus(&options.corpus, options.images).await?;
    let spec: stoker_api::DataPipelineSpec =
        stoker_api::from_yaml(&pipeline_yaml(&options.corpus, options.max_workers))?;
    let logs = options.corpus.parent().unwrap_or(&options.corpus).join("demo-logs");
    std::fs::create_dir_all(&logs)?;
    let local = Local::start(LocalOptions {
        namespace: "demo".into(),
        name: "imagenet-like".into(),
        spec,
        listen: "127.0.0.1:0".parse()?,
        workers: LocalWorkerConfig::rate_capped(options.worker_rate, logs.clone()),
        window: Some(options.window),
        budget: None,
        tls_dir: None,
    })
    .await?;
    let optimum = options.optimum();
    writeln!(
        out,
        "Stoker demo: a trainer needing {:.0} ms per batch of 8 images; each worker makes at most {} batches/s,\n\
         so {optimum} workers keep it fed. The autoscaler starts at 1 and knows none of this.\n\
         dispatcher {}   worker logs {}\n",
        options.compute.as_secs_f64() * 1e3,
        options.worker_rate,
        local.url,
        logs.display()
    )?;
    writeln!(out, "{}   (rate: images/s)", crate::mode::VIEW_HEADER)?;

    let mut client_options = ClientOptions::new("demo", "imagenet-like");
    client_options.prefetch = 4;
    let mut client = Client::from_dispatcher(&local.url, client_options).await?;
    let trainer = TrainerSpec::steady(options.compute);
    let start = Instant::now();
    let mut last_line = Instant::now();
    let mut last_images = 0u64;
    let mut seen_rescales = 0;
    let mut converged_after = None;
    let summary = train(&mut client, &trainer, Stop { steps: None, after: Some(options.run_for) }, |s, _| {
        if last_line.elapsed() < options.window {
            return;
        }
        let rate = (s.elements - last_images) as f64 / last_line.elapsed().as_secs_f64();
        last_images = s.elements;
        last_line = Instant::now();
        let (line, rescaled) = local.view_line(start.elapsed(), rate, &mut seen_rescales);
        if rescaled {
            converged_after = Some(start.elapsed());
        }
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    })
    .await;
    let summary = summary?;
    let rescales = local.rescales.borrow().clone();
    let record = local.record();
    let report = DemoReport {
        optimum,
        final_workers: record.workers,
        decisions: rescales.len(),
        converged_after,
        steps: summary.steps,
        images: summary.elements,
        elapsed: summary.elapsed,
        data_wait: local.book.data_wait(&local.key),
    };
    drop(client);
    local.shutdown().await;
    Ok(report)
}
