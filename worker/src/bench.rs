//! Benchmarks run as commands (`stoker-worker bench ...`), never as timed tests.

mod command;
pub mod dlrm;
pub mod memory;
mod metrics_cost;
mod read;

pub use command::Bench;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use stoker_api::{Autocache, CacheMode, Resize, Transform, WorkerPipeline};

use crate::cached::{CacheConfig, SplitCache};
use crate::corpus::resnet50_train;
use crate::engine::{Engine, EngineConfig};

#[derive(Debug)]
pub struct PreprocessReport {
    pub images: u64,
    pub seconds: f64,
    pub threads: usize,
    /// (op, milliseconds of thread time per image).
    pub op_ms: Vec<(&'static str, f64)>,
}

impl PreprocessReport {
    pub fn images_per_second(&self) -> f64 {
        self.images as f64 / self.seconds
    }

    pub fn per_core(&self) -> f64 {
        self.images_per_second() / self.threads as f64
    }
}

/// One epoch of the ResNet-50 transforms over the image folder at `corpus`, batches dropped
/// as they come: the engine's throughput with nothing else in the way.
pub async fn preprocess(corpus: &Path, threads: usize) -> anyhow::Result<PreprocessReport> {
    let uri = format!("file://{}/", corpus.canonicalize()?.display());
    let config = EngineConfig { threads, ..Default::default() };
    let engine = Arc::new(Engine::open(resnet50_train(&uri, 64), config).await?);
    let (images, seconds) = timed_epoch(&engine, 0, SplitCache::Compute).await?;
    let skipped = engine.stats.skipped();
    anyhow::ensure!(skipped.is_empty(), "the benchmark corpus should be clean, skipped {skipped:?}");
    let ops = engine.stats.ops.lock().unwrap().clone();
    let op_ms = engine
        .pipeline()
        .data_plane
        .transforms
        .iter()
        .zip(ops)
        .map(|(t, tally)| (t.name(), tally.time.as_secs_f64() * 1e3 / images.max(1) as f64))
        .collect();
    Ok(PreprocessReport { images, seconds, threads, op_ms })
}

/// Runs one epoch, every split doing `cache`, dropping batches as they come: (images, seconds).
async fn timed_epoch(engine: &Arc<Engine>, epoch: u64, cache: SplitCache) -> anyhow::Result<(u64, f64)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let started = Instant::now();
    let producer = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || engine.run_splits(epoch, engine.assigned(epoch, &cache), &tx).map(drop))
    };
    let mut images = 0u64;
    while let Ok(ready) = tokio::task::block_in_place(|| rx.recv()) {
        images += ready.batch.tensors.get("image").map_or(0, |t| t.shape[0] as u64);
    }
    producer.await??;
    Ok((images, started.elapsed().as_secs_f64()))
}

/// `resnet50_train` with its decoded images resized to a shorter side of 256 and an autocache
/// hint there: the usual place to cache ImageNet (everything after it is random).
pub fn resnet50_train_cached(uri: &str, batch_size: u32) -> WorkerPipeline {
    let mut pipeline = resnet50_train(uri, batch_size);
    let resize = Transform::Resize(Resize { size: None, shorter_side: Some(256), field: "image".into() });
    pipeline.data_plane.transforms.splice(1..1, [resize, Transform::Autocache(Autocache {})]);
    pipeline.cache_mode = CacheMode::Always;
    pipeline
}

#[derive(Debug)]
pub struct CacheReport {
    pub images: u64,
    pub threads: usize,
    /// Epoch seconds computing everything, writing the cache, and reading it (each read epoch).
    pub compute: f64,
    pub put: f64,
    pub gets: Vec<f64>,
    pub entry_bytes: u64,
}

/// Epochs of `resnet50_train_cached` over the image folder at `corpus` with the cache on
/// `volume`: one computing everything, one writing the entry, then `gets` reading it, each
/// with the entry's files dropped from the page cache first.
pub async fn cache(corpus: &Path, volume: &Path, threads: usize, gets: usize) -> anyhow::Result<CacheReport> {
    let uri = format!("file://{}/", corpus.canonicalize()?.display());
    let cache_config = CacheConfig { dir: volume.to_path_buf(), cap_bytes: u64::MAX };
    let config = EngineConfig { threads, cache: Some(cache_config), ..Default::default() };
    let engine = Arc::new(Engine::open(resnet50_train_cached(&uri, 64), config).await?);
    let cache = engine.cache.clone().context("the engine has no cache")?;
    let (at, fingerprint) = cache.hints[0].clone();
    let entry = cache.entry(&fingerprint);
    if entry.dir().exists() {
        std::fs::remove_dir_all(entry.dir())
            .with_context(|| format!("removing the entry of an earlier run, {}", entry.dir().display()))?;
    }
    let (images, compute) = timed_epoch(&engine, 0, SplitCache::Compute).await?;
    let (_, put) = timed_epoch(&engine, 1, SplitCache::Put { at, fingerprint: fingerprint.clone() }).await?;
    let manifest = entry.manifest()?.context("the entry is not complete after the put epoch")?;
    let mut get_seconds = Vec::new();
    for epoch in 0..gets as u64 {
        entry.drop_from_page_cache();
        let (read, seconds) =
            timed_epoch(&engine, 2 + epoch, SplitCache::Get { at, fingerprint: fingerprint.clone() }).await?;
        anyhow::ensure!(read == images, "a get epoch delivered {read} images of {images}");
        get_seconds.push(seconds);
    }
    let splits_read = cache.progress().splits_read;
    anyhow::ensure!(
        splits_read == manifest.splits * gets as u64,
        "{splits_read} splits were read from the cache, not all"
    );
    Ok(CacheReport { images, threads, compute, put, gets: get_seconds, entry_bytes: manifest.bytes })
}
