//! `stoker-worker bench dlrm`: DLRM's preprocessing of a Criteo-style Parquet table
//! (`worker/bench/peers/criteo_generate.py` writes one) through the engine, beside its floor:
//! the projected columns decoded alone with arrow-rs on the same threads. Rows/s, rows/s per
//! core, and the bytes the projection reads against every column's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder};

use crate::cached::SplitCache;
use crate::engine::{Engine, EngineConfig};
use crate::formats::parquet::kept_dictionaries;

/// The counts and categoricals of the Criteo layout.
const DENSE: usize = 13;
const CATEGORICAL: usize = 26;

/// The sample's pipeline (manifests/samples/dlrm-criteo.yaml) over `uri`, without shuffle as
/// the peers read, keeping only what the model takes.
pub fn pipeline(uri: &str, batch_size: u32) -> anyhow::Result<stoker_api::WorkerPipeline> {
    let dense: Vec<String> = (1..=DENSE).map(|i| format!("i{i}")).collect();
    let cats: Vec<String> = (1..=CATEGORICAL).map(|c| format!("c{c}")).collect();
    let (dense, cats) = (dense.join(", "), cats.join(", "));
    let manifest = format!(
        "source: {{uri: '{uri}', format: parquet}}\nbatchSize: {batch_size}\ntransforms:\n\
         - fillNull: {{fields: [{dense}], value: 0}}\n\
         - fillNull: {{fields: [{cats}], text: ''}}\n\
         - log1p: {{fields: [{dense}]}}\n\
         - hashBucket: {{fields: [{cats}], buckets: 10000000}}\n\
         - concat: {{fields: [{dense}], output: dense}}\n\
         - selectFields: {{fields: [dense, {cats}, label]}}\n"
    );
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest)?;
    stoker_api::validate(&spec).map_err(|e| anyhow::anyhow!("{}", stoker_api::invalid_message(&e)))?;
    Ok(stoker_api::WorkerPipeline::new("bench", "dlrm", &spec))
}

pub async fn command(data: &Path, threads: usize, batch_size: u32, repeat: usize) -> anyhow::Result<()> {
    let data = data.canonicalize().with_context(|| format!("the table {}", data.display()))?;
    let uri = format!("file://{}/", data.display());
    let pipeline = pipeline(&uri, batch_size)?;
    let columns = pipeline.data_plane.columns_read().context("the pipeline bounds its columns")?;
    let files = parquet_files(&data)?;
    let (projected, all) = column_bytes(&files, &columns)?;
    println!(
        "{} files; the projection reads {} of their columns: {:.0} MB of {:.0} MB compressed ({:.0}%)",
        files.len(),
        columns.len(),
        projected as f64 / 1e6,
        all as f64 / 1e6,
        100.0 * projected as f64 / all as f64
    );
    let engine = Arc::new(Engine::open(pipeline, EngineConfig { threads, ..Default::default() }).await?);
    for run in 1..=repeat.max(1) {
        let cpu = crate::cpu_time::process_cpu();
        let (rows, seconds) = epoch(&engine, run as u64).await?;
        let cpu = crate::cpu_time::process_cpu() - cpu;
        let rate = rows as f64 / seconds;
        println!(
            "stoker run {run}: {rows} rows in {seconds:.2} s ({cpu:.2} CPU-s): {rate:.0} rows/s, {:.0} rows/s per core",
            rate / threads as f64
        );
        for (name, dictionaries) in [("floor", false), ("dictionary floor", true)] {
            let floor_cpu = crate::cpu_time::process_cpu();
            let floor = floor(&files, &columns, threads, dictionaries)?;
            let floor_cpu = crate::cpu_time::process_cpu() - floor_cpu;
            anyhow::ensure!(floor.0 as u64 == rows, "the {name} read {} rows, the engine {rows}", floor.0);
            let floor_rate = floor.0 as f64 / floor.1;
            println!(
                "{name} run {run}: decoding the projected columns alone{}: {floor_rate:.0} rows/s \
                 ({floor_cpu:.2} CPU-s); stoker is {:.2}x its time, {:.2}x its CPU",
                if dictionaries { ", whole dictionaries kept as the engine keeps them" } else { "" },
                floor_rate / rate,
                cpu / floor_cpu
            );
        }
    }
    let ops = engine.stats.ops.lock().unwrap().clone();
    let names = engine.pipeline().data_plane.transforms.iter().map(|t| t.name());
    let per_op: Vec<String> = names.zip(ops).map(|(n, t)| format!("{n} {:.2} s", t.time.as_secs_f64())).collect();
    println!("thread time per op over every run: {}", per_op.join(", "));
    Ok(())
}

/// One epoch, batches dropped as they come: (rows, seconds).
async fn epoch(engine: &Arc<Engine>, epoch: u64) -> anyhow::Result<(u64, f64)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let started = Instant::now();
    let producer = {
        let engine = engine.clone();
        tokio::task::spawn_blocking(move || {
            engine.run_splits(epoch, engine.assigned(epoch, &SplitCache::Compute), &tx).map(drop)
        })
    };
    let mut rows = 0u64;
    while let Ok(ready) = tokio::task::block_in_place(|| rx.recv()) {
        rows += ready.batch.tensors.get("label").map_or(0, |t| t.shape[0] as u64);
    }
    producer.await??;
    Ok((rows, started.elapsed().as_secs_f64()))
}

fn parquet_files(data: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(data)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no .parquet files in {}", data.display());
    Ok(files)
}

/// Compressed bytes of the projected columns' chunks, and of every column's.
fn column_bytes(files: &[PathBuf], columns: &[String]) -> anyhow::Result<(u64, u64)> {
    let (mut projected, mut all) = (0, 0);
    for file in files {
        let builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(file)?)?;
        for group in builder.metadata().row_groups() {
            for chunk in group.columns() {
                let size = chunk.compressed_size() as u64;
                all += size;
                if columns.iter().any(|c| chunk.column_path().parts() == [c.as_str()]) {
                    projected += size;
                }
            }
        }
    }
    Ok((projected, all))
}

/// The floor: every file's projected columns decoded to Arrow by arrow-rs's reader, the files
/// shared among `threads` threads, nothing else done: (rows, seconds). With `dictionaries`,
/// string columns dictionary-encoded throughout are decoded to keys into their dictionary, as
/// the engine reads them (`formats::parquet::kept_dictionaries`): the reader's default
/// copies every row's string out of the dictionary.
fn floor(files: &[PathBuf], columns: &[String], threads: usize, dictionaries: bool) -> anyhow::Result<(usize, f64)> {
    let started = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let rows: anyhow::Result<usize> = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                // Named, so that a profile tells the floor's threads from the engine's.
                let floor = std::thread::Builder::new().name("floor".into());
                floor.spawn_scoped(scope, || -> anyhow::Result<usize> {
                    let mut rows = 0;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(file) = files.get(i) else { return Ok(rows) };
                        let mut builder = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(file)?)?;
                        if dictionaries {
                            let groups: Vec<usize> = (0..builder.metadata().num_row_groups()).collect();
                            let all: Vec<usize> = (0..builder.schema().fields().len()).collect();
                            let keyed = kept_dictionaries(builder.schema(), builder.metadata(), &groups, &all);
                            let options = ArrowReaderOptions::new().with_schema(Arc::new(keyed));
                            builder = ParquetRecordBatchReaderBuilder::try_new_with_options(
                                std::fs::File::open(file)?,
                                options,
                            )?;
                        }
                        let roots: Vec<usize> = (builder.schema().fields().iter().enumerate())
                            .filter(|(_, f)| columns.contains(f.name()))
                            .map(|(i, _)| i)
                            .collect();
                        let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
                        for batch in builder.with_projection(mask).with_batch_size(1 << 17).build()? {
                            rows += batch?.num_rows();
                        }
                    }
                })
            })
            .collect::<Result<_, _>>()?;
        readers.into_iter().map(|r| r.join().expect("a reader thread does not panic")).sum()
    });
    Ok((rows?, started.elapsed().as_secs_f64()))
}
