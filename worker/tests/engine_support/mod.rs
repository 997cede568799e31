//! One epoch of a pipeline through the engine, for the tests of what it computes: the
//! pipeline from a spec's YAML (validated, as the operator would), its batches joined.

#![allow(dead_code)] // each test file uses a different part

use std::sync::mpsc::sync_channel;

use stoker_api::{Batch, WorkerPipeline};
use stoker_worker::engine::{Engine, EngineConfig, EngineError};

/// The pipeline `name` of namespace `ns` of the spec `yaml`, which must be valid.
pub fn pipeline(name: &str, yaml: &str) -> WorkerPipeline {
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(yaml).unwrap();
    stoker_api::validate(&spec).unwrap_or_else(|e| panic!("{yaml}: {e:?}"));
    WorkerPipeline::new("ns", name, &spec)
}

/// Epoch 0 of `pipeline` on two threads: its batches, and the engine (its stats).
pub async fn epoch(pipeline: WorkerPipeline) -> Result<(Vec<Batch>, Engine), EngineError> {
    let engine = Engine::open(pipeline, EngineConfig { threads: 2, ..Default::default() }).await?;
    let (tx, rx) = sync_channel(64);
    let producer = tokio::task::spawn_blocking(move || engine.run_epoch(0, &tx).map(|()| engine));
    let batches = tokio::task::spawn_blocking(move || rx.iter().map(|r| r.batch.join()).collect()).await.unwrap();
    Ok((batches, producer.await.unwrap()?))
}

/// A tensor's int64 values.
pub fn int64s(batch: &Batch, field: &str) -> Vec<i64> {
    batch.tensors[field].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}
