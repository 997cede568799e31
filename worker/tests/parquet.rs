//! Parquet sources through the engine: row-group splits, projection, and files that cannot be
//! read.

use std::sync::Arc;
use std::sync::mpsc::sync_channel;

use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use stoker_api::{Batch, WorkerPipeline};
use stoker_worker::engine::{Engine, EngineConfig, EngineError};

/// `rows` rows (`id` from `first`, a float `score`, a string `city`) in row groups of `group`.
fn write(path: &std::path::Path, first: i64, rows: i64, group: usize) {
    let ids = Int64Array::from_iter_values(first..first + rows);
    let score = Float64Array::from_iter_values((first..first + rows).map(|i| i as f64 / 4.0));
    let city = StringArray::from_iter_values((first..first + rows).map(|i| ["oslo", "lima", "pune"][i as usize % 3]));
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(ids) as ArrayRef),
        ("score", Arc::new(score) as ArrayRef),
        ("city", Arc::new(city) as ArrayRef),
    ])
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group))
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .build();
    let mut writer = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

fn pipeline(dir: &std::path::Path, extra: &str) -> WorkerPipeline {
    let manifest = format!("source: {{uri: 'file://{}/', format: parquet{extra}}}\nbatchSize: 1000\n", dir.display());
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    stoker_api::validate(&spec).unwrap();
    WorkerPipeline::new("ns", "parquet", &spec)
}

async fn epoch(pipeline: WorkerPipeline) -> Result<(Vec<Batch>, Engine), EngineError> {
    let engine = Engine::open(pipeline, EngineConfig { threads: 2, ..Default::default() }).await?;
    let (tx, rx) = sync_channel(64);
    let producer = tokio::task::spawn_blocking(move || engine.run_epoch(0, &tx).map(|()| engine));
    let batches = tokio::task::spawn_blocking(move || rx.iter().map(|r| r.batch.join()).collect()).await.unwrap();
    Ok((batches, producer.await.unwrap()?))
}

fn int64s(batch: &Batch, field: &str) -> Vec<i64> {
    batch.tensors[field].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn row_groups_are_splits_and_only_the_named_columns_are_read() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.parquet"), 0, 40_000, 10_000);
    write(&dir.path().join("b.parquet"), 40_000, 100, 10_000);
    std::fs::write(dir.path().join("_SUCCESS"), "").unwrap();
    let (batches, engine) = epoch(pipeline(dir.path(), ", columns: [id, city]")).await.unwrap();
    // a.parquet's four row groups of 10,000 rows gather in twos (16,384 rows or more a split).
    let planned: Vec<_> = engine.mix().planned().map(|s| s.row_groups.clone().unwrap().range).collect();
    assert_eq!(planned, [0..2, 2..4, 0..1]);
    let mut ids: Vec<i64> = batches.iter().flat_map(|b| int64s(b, "id")).collect();
    assert_eq!(batches[0].tensors.keys().collect::<Vec<_>>(), ["city", "id"], "score is never read");
    ids.sort_unstable();
    assert_eq!(ids, (0..40_100).collect::<Vec<_>>(), "every row once");

    let err = epoch(pipeline(dir.path(), ", columns: [id, price]")).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("no column \"price\" (it has id, score, city)"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_row_group_is_skipped_whole_or_fatal_per_on_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.parquet");
    write(&path, 0, 40_000, 10_000);
    // Garbles the middle of the third row group's `id` chunk (zstd-compressed pages).
    let file = std::fs::File::open(&path).unwrap();
    let footer = parquet::file::reader::SerializedFileReader::new(file).unwrap();
    let chunk = parquet::file::reader::FileReader::metadata(&footer).row_group(2).column(0).clone();
    let (start, len) = chunk.byte_range();
    let mut bytes = std::fs::read(&path).unwrap();
    for b in &mut bytes[(start + len / 3) as usize..(start + len / 2) as usize] {
        *b ^= 0x5a;
    }
    std::fs::write(&path, bytes).unwrap();

    let (batches, engine) = epoch(pipeline(dir.path(), "")).await.unwrap();
    let rows: usize = batches.iter().map(|b| b.rows.len()).sum();
    assert_eq!(rows, 20_000, "the split of row groups 2-3 skipped, the other read");
    assert_eq!(engine.stats.skipped().get("bad_parquet"), Some(&1));

    let mut failing = pipeline(dir.path(), "");
    failing.data_plane.on_error = stoker_api::OnError::Fail;
    let err = epoch(failing).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("bad_parquet") && err.to_string().contains("a.parquet"), "{err}");

    // A file that is not Parquet at all cannot be planned: the error names it.
    std::fs::write(dir.path().join("b.parquet"), "not parquet").unwrap();
    let err = epoch(pipeline(dir.path(), "")).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("b.parquet"), "{err}");
}
