//! Parquet sources through the engine: row-group splits, projection, and files that cannot be
//! read.

use std::sync::Arc;

use crate::engine_support::{epoch, int64s};
use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use stoker_api::WorkerPipeline;

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
    pipeline_with(dir, extra, "")
}

fn pipeline_with(dir: &std::path::Path, extra: &str, transforms: &str) -> WorkerPipeline {
    let manifest =
        format!("source: {{uri: 'file://{}/', format: parquet{extra}}}\nbatchSize: 1000\n{transforms}", dir.display());
    crate::engine_support::pipeline("parquet", &manifest)
}

#[tokio::test(flavor = "multi_thread")]
async fn row_groups_are_splits_and_only_the_named_columns_are_read() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.parquet"), 0, 40_000, 10_000);
    write(&dir.path().join("b.parquet"), 40_000, 100, 10_000);
    std::fs::write(dir.path().join("_SUCCESS"), "").unwrap();
    let (batches, engine) = epoch(pipeline(dir.path(), ", columns: [id, city]")).await.unwrap();
    // a.parquet's four row groups of 10,000 rows gather in twos (16,384 rows or more a split);
    // b.parquet's 100 rows are the last split.
    let planned: Vec<(&str, std::ops::Range<usize>)> = engine
        .mix()
        .planned()
        .flat_map(|s| {
            s.shards.iter().zip(&s.row_groups).map(|(f, g)| (f.path.rsplit('/').next().unwrap(), g.range.clone()))
        })
        .collect();
    assert_eq!(planned, [("a.parquet", 0..2), ("a.parquet", 2..4), ("b.parquet", 0..1)]);
    assert_eq!(engine.mix().planned().count(), 3);
    let mut ids: Vec<i64> = batches.iter().flat_map(|b| int64s(b, "id")).collect();
    assert_eq!(batches[0].tensors.keys().collect::<Vec<_>>(), ["city", "id"], "score is never read");
    ids.sort_unstable();
    assert_eq!(ids, (0..40_100).collect::<Vec<_>>(), "every row once");

    let err = epoch(pipeline(dir.path(), ", columns: [id, price]")).await.map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("no column \"price\" (it has id, score, city)"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn small_files_gather_into_splits_and_every_row_arrives_once() {
    let dir = tempfile::tempdir().unwrap();
    for file in 0..10 {
        write(&dir.path().join(format!("part-{file:02}.parquet")), file * 3_000, 3_000, 1_000);
    }
    let (batches, engine) = epoch(pipeline(dir.path(), "")).await.unwrap();
    // Row groups of 1,000 rows: the first split is 17 of them (16,384 rows or more), five
    // files and two row groups of the sixth; the second the sixth's last and four files.
    let pieces: Vec<Vec<(usize, std::ops::Range<usize>)>> = engine
        .mix()
        .planned()
        .map(|s| s.row_groups.iter().enumerate().map(|(i, g)| (i, g.range.clone())).collect())
        .collect();
    assert_eq!(pieces[0].len(), 6);
    assert_eq!((pieces[0][5].1.clone(), pieces[1][0].1.clone(), pieces[1].len()), (0..2, 2..3, 5));
    let mut ids: Vec<i64> = batches.iter().flat_map(|b| int64s(b, "id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..30_000).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leading_filter_reads_only_the_row_groups_that_can_pass_it() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.parquet"), 0, 40_000, 5_000);
    let transforms = "transforms:\n- filter: {field: id, op: ge, value: '27500'}\n";
    let (batches, engine) = epoch(pipeline_with(dir.path(), "", transforms)).await.unwrap();
    let mut ids: Vec<i64> = batches.iter().flat_map(|b| int64s(b, "id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, (27_500..40_000).collect::<Vec<_>>());
    // Row groups 0-4 (ids below 25,000) were never read, 2,500 rows of group 5 by the op:
    // counted alike.
    assert_eq!(engine.stats.filtered.load(std::sync::atomic::Ordering::Relaxed), 27_500);
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

/// Writes, with pyarrow, one table of every type Stoker reads (nulls in each column, several
/// row groups, dictionary pages, a page index) once per codec, and what each row holds.
const PYARROW_FILES: &str = r#"
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[1]
n = 7
def nulls(values): return [None if i % 4 == 3 else v for i, v in enumerate(values)]
columns = {
    "i8": pa.array(nulls([-(i * 17) for i in range(n)]), pa.int8()),
    "i16": pa.array(nulls([i * 1000 for i in range(n)]), pa.int16()),
    "i32": pa.array(nulls([-i * 100000 for i in range(n)]), pa.int32()),
    "i64": pa.array(nulls([i << 40 for i in range(n)]), pa.int64()),
    "u8": pa.array(nulls([250 - i for i in range(n)]), pa.uint8()),
    "u16": pa.array(nulls([65000 + i for i in range(n)]), pa.uint16()),
    "u32": pa.array(nulls([4000000000 + i for i in range(n)]), pa.uint32()),
    "u64": pa.array(nulls([(1 << 63) + i for i in range(n)]), pa.uint64()),
    "f32": pa.array(nulls([i / 8 for i in range(n)]), pa.float32()),
    "f64": pa.array(nulls([i / 3 for i in range(n)]), pa.float64()),
    "flag": pa.array(nulls([i % 2 == 0 for i in range(n)]), pa.bool_()),
    "text": pa.array(nulls([f"row {i} é" for i in range(n)]), pa.string()),
    "large": pa.array(nulls([f"large {i}" for i in range(n)]), pa.large_string()),
    "blob": pa.array(nulls([bytes([i, 0, 255]) for i in range(n)]), pa.binary()),
    "city": pa.array(nulls([["oslo", "lima"][i % 2] for i in range(n)])).dictionary_encode(),
    "ids": pa.array(nulls([list(range(i, i + i % 3)) for i in range(n)]), pa.list_(pa.int64())),
    "weights": pa.array(nulls([[i / 2] * (i % 2) for i in range(n)]), pa.list_(pa.float32())),
    "tags": pa.array(nulls([["a", "bb"][: i % 3] for i in range(n)]), pa.list_(pa.string())),
}
table = pa.table(columns)
codecs = ["none", "snappy", "gzip", "zstd", "lz4"]
for codec in codecs:
    pq.write_table(table, f"{out}/{codec}.parquet", compression=codec, row_group_size=3,
                   use_dictionary=True, write_page_index=True)
def tag(t, v):
    if v is None: return None
    if pa.types.is_list(t):
        kind = tag(t.value_type, pa.scalar(0 if not pa.types.is_string(t.value_type) else "", t.value_type).as_py())[0]
        return ["list", kind, [tag(t.value_type, x)[1] for x in v]]
    if pa.types.is_dictionary(t): return tag(t.value_type, v)
    if pa.types.is_floating(t): return ["f32" if t == pa.float32() else "f64", v]
    if pa.types.is_boolean(t): return ["int", int(v)]
    if pa.types.is_integer(t): return ["int", v - (1 << 64) if v >= 1 << 63 else v]
    if isinstance(v, str): v = v.encode()
    return ["bytes", v.hex()]
rows = [{name: tag(col.type, col[i].as_py()) for name, col in columns.items()} for i in range(n)]
json.dump({"codecs": codecs, "rows": rows}, open(f"{out}/expected.json", "w"))
"#;

/// A tagged value of expected.json as the field the reader gives.
fn field(tagged: &serde_json::Value) -> stoker_worker::element::Field {
    use stoker_worker::element::Field;
    let (kind, value) = (tagged[0].as_str().unwrap(), &tagged[1]);
    let bytes = |v: &serde_json::Value| bytes::Bytes::from(hex(v.as_str().unwrap()));
    match kind {
        "int" => Field::Int64(vec![value.as_i64().unwrap()]),
        "f32" => Field::Float32(vec![value.as_f64().unwrap() as f32]),
        "f64" => Field::Float64(vec![value.as_f64().unwrap()]),
        "bytes" => Field::Bytes(bytes(value)),
        // ["list", the items' kind, [the items]]
        "list" => {
            let items = tagged[2].as_array().unwrap();
            match value.as_str().unwrap() {
                "f32" => Field::Float32(items.iter().map(|i| i.as_f64().unwrap() as f32).collect()),
                "bytes" => Field::BytesList(items.iter().map(bytes).collect()),
                _ => Field::Int64(items.iter().map(|i| i.as_i64().unwrap()).collect()),
            }
        }
        other => panic!("unknown tag {other}"),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn files_pyarrow_writes_read_as_pyarrow_reads_them() {
    use stoker_worker::formats::parquet::{ParquetFile, elements};
    let dir = tempfile::tempdir().unwrap();
    let python = std::env::var("STOKER_PYTHON").unwrap_or_else(|_| "python3".into());
    let status =
        std::process::Command::new(&python).args(["-c", PYARROW_FILES]).arg(dir.path()).status().unwrap_or_else(|e| {
            panic!("running {python} (set STOKER_PYTHON to a Python with pyarrow: `make venv`): {e}")
        });
    assert!(status.success(), "{python} could not write the files (does it have pyarrow? `make venv`)");
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("expected.json")).unwrap()).unwrap();
    let store: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::local::LocalFileSystem::new());
    for codec in expected["codecs"].as_array().unwrap() {
        let path = dir.path().join(format!("{}.parquet", codec.as_str().unwrap()));
        let size = std::fs::metadata(&path).unwrap().len();
        let file =
            ParquetFile::new(store.clone(), object_store::path::Path::from_filesystem_path(&path).unwrap(), size);
        let footer = file.metadata().await.unwrap();
        assert_eq!(footer.num_row_groups(), 3, "{codec}: 7 rows in row groups of 3");
        let rows: Vec<_> = file.read(0..3, None, &[]).await.unwrap().batches.iter().flat_map(elements).collect();
        let want = expected["rows"].as_array().unwrap();
        assert_eq!(rows.len(), want.len(), "{codec}");
        for (i, (row, want)) in rows.iter().zip(want).enumerate() {
            for (name, tagged) in want.as_object().unwrap() {
                match tagged {
                    serde_json::Value::Null => assert_eq!(row.get(name), None, "{codec} row {i} {name}: null"),
                    tagged => assert_eq!(row.get(name), Some(&field(tagged)), "{codec} row {i} {name}"),
                }
            }
            assert_eq!(row.len(), want.as_object().unwrap().values().filter(|v| !v.is_null()).count());
        }
    }
}
