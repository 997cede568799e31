//! Benchmarks run as commands (`stoker-worker bench ...`), never as timed tests.

pub mod memory;

use std::path::Path;
use std::time::Instant;

use stoker_api::{
    DType, DecodeImage, Normalize, OnError, RandomFlip, RandomResizedCrop, Source, SourceFormat, Transform,
    WorkerPipeline,
};

use crate::engine::{Engine, EngineConfig};

/// ResNet-50's training transforms (torchvision's reference recipe) over an image folder.
pub fn resnet50_train(uri: &str, batch_size: u32) -> WorkerPipeline {
    WorkerPipeline {
        namespace: "bench".into(),
        name: "resnet50-train".into(),
        source: Source { uri: uri.into(), format: SourceFormat::ImageFolder, credentials_secret: None },
        transforms: vec![
            Transform::DecodeImage(DecodeImage { channels: 3, field: "image".into() }),
            Transform::RandomResizedCrop(RandomResizedCrop {
                size: [224, 224],
                scale: [0.08, 1.0],
                ratio: [3.0 / 4.0, 4.0 / 3.0],
                field: "image".into(),
            }),
            Transform::RandomFlip(RandomFlip { horizontal: true, vertical: false, field: "image".into() }),
            Transform::Normalize(Normalize {
                mean: vec![0.485, 0.456, 0.406],
                std: vec![0.229, 0.224, 0.225],
                dtype: DType::Float32,
                field: "image".into(),
            }),
        ],
        shuffle: None,
        batch_size,
        drop_remainder: false,
        pad_value: None,
        seed: Some(1),
        on_error: OnError::Skip,
        cache_mode: Default::default(),
    }
}

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
    let engine = Engine::open(resnet50_train(&uri, 64), config).await?;
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let started = Instant::now();
    let producer = tokio::task::spawn_blocking(move || {
        let splits = engine.splits().to_vec();
        engine.run_epoch(0, &splits, &tx).map(|()| engine)
    });
    let mut images = 0u64;
    while let Ok(ready) = tokio::task::block_in_place(|| rx.recv()) {
        images += ready.batch.tensors.get("image").map_or(0, |t| t.shape[0] as u64);
    }
    let engine = producer.await??;
    let seconds = started.elapsed().as_secs_f64();
    let skipped = engine.stats.skipped();
    anyhow::ensure!(skipped.is_empty(), "the benchmark corpus should be clean, skipped {skipped:?}");
    let op_time = engine.stats.op_time.lock().unwrap().clone();
    let op_ms = engine
        .pipeline()
        .transforms
        .iter()
        .zip(op_time)
        .map(|(t, d)| (t.name(), d.as_secs_f64() * 1e3 / images.max(1) as f64))
        .collect();
    Ok(PreprocessReport { images, seconds, threads, op_ms })
}
