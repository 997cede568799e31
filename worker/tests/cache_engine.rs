//! The engine on a cache volume: a split read from the cache yields exactly what computing it
//! yields (random ops after the hint included), and a corrupt chunk is dropped and computed
//! instead, losing nothing.

use std::sync::mpsc::sync_channel;

use stoker_api::{Batch, WorkerPipeline};
use stoker_worker::cached::{CacheConfig, SplitCache};
use stoker_worker::corpus::{CorpusSpec, generate};
use stoker_worker::engine::{Engine, EngineConfig};

/// Every batch of one epoch, each split doing `cache`.
fn run(engine: &Engine, epoch: u64, cache: &SplitCache) -> Vec<Batch> {
    let (tx, rx) = sync_channel(1024);
    engine.run_splits(epoch, engine.assigned(epoch, cache), &tx).unwrap();
    drop(tx);
    rx.iter().map(|r| r.batch.join()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn reading_the_cache_yields_what_computing_does_and_a_corrupt_chunk_is_computed_instead() {
    let (data, volume) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generate(data.path(), &CorpusSpec { images: 24, classes: 2, min_side: 64, max_side: 96, ..Default::default() })
        .unwrap();
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\nbatchSize: 5\nseed: 7\ncache: {{mode: Always}}\n\
         transforms:\n- decodeImage: {{channels: 3}}\n- resize: {{size: [16, 16]}}\n- autocache: {{}}\n\
         - randomFlip: {{horizontal: true}}\n- normalize: {{mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}}\n",
        data.path().display()
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    let config = EngineConfig {
        threads: 2,
        files_per_split: 8,
        cache: Some(CacheConfig { dir: volume.path().to_path_buf(), cap_bytes: u64::MAX }),
        ..Default::default()
    };
    let engine = Engine::open(WorkerPipeline::new("ns", "cached", &spec), config).await.unwrap();
    let volume = volume.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        let cache = engine.cache.clone().expect("a cache volume was configured");
        let (at, fingerprint) = cache.hints[0].clone();
        assert_eq!(at, 2);
        let splits = engine.mix().slots();
        assert_eq!(splits, 3);
        let computed = run(&engine, 1, &SplitCache::Compute);

        let written = run(&engine, 0, &SplitCache::Put { at, fingerprint: fingerprint.clone() });
        assert_eq!(written.iter().map(|b| b.tensors["label"].shape[0]).sum::<usize>(), 24, "a put epoch delivers too");
        let entry = volume.join(fingerprint.trim_start_matches("sha256:"));
        assert!(entry.join("complete").is_file(), "every split was written, so the entry is complete");
        assert_eq!(cache.progress().splits_written, splits);

        let get = SplitCache::Get { at, fingerprint: fingerprint.clone() };
        let read = run(&engine, 1, &get);
        assert_eq!(read, computed, "epoch 1 read after the hint is epoch 1 computed, flips and all");
        assert_eq!((cache.progress().splits_read, cache.progress().elements_read), (splits, 24));

        // One flipped bit in a record of split 1's chunk file.
        let chunk = entry.join("splits/1.chunk");
        let mut bytes = std::fs::read(&chunk).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x04;
        std::fs::write(&chunk, bytes).unwrap();
        let recovered = run(&engine, 1, &get);
        assert_eq!(recovered, computed, "the corrupt split was computed from the source instead");
        let progress = cache.progress();
        assert_eq!(progress.corrupt, fingerprint);
        assert!(
            progress.corrupt_detail.contains("split 1") && progress.corrupt_detail.contains("checksum"),
            "{}",
            progress.corrupt_detail
        );
        assert!(!entry.exists(), "the corrupt entry is gone from where readers look");
        assert_eq!(run(&engine, 1, &get), computed, "a Get on the dropped entry computes");
    })
    .await
    .unwrap();
}
