//! Feature ops on the columnar path, through the engine: a Criteo-style table (dense counts
//! and categorical strings with nulls, an id list) preprocessed as DLRM does, every value
//! checked against a reference computed here row by row, every row once.

use std::sync::Arc;

use crate::engine_support::{epoch, int64s};
use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use stoker_api::{Batch, WorkerPipeline};

const ROWS: i64 = 5000;

/// Row i: `id` i, dense `i1` = i % 7 - 2 (null every 5th row), `i2` = i * 3, categorical `c1`
/// (null every 4th row) and `c2`, and a `history` list of i % 4 ids.
fn dense1(i: i64) -> Option<i64> {
    (i % 5 != 0).then_some(i % 7 - 2)
}
fn c1(i: i64) -> Option<String> {
    (i % 4 != 0).then(|| format!("{:08x}", i % 37))
}
fn c2(i: i64) -> String {
    ["a", "b", "c"][i as usize % 3].to_string()
}
fn history(i: i64) -> Vec<i64> {
    (0..i % 4).map(|j| i * 10 + j).collect()
}

fn write(path: &std::path::Path) {
    write_rows(path, 0..ROWS, true)
}

/// Rows `ids` to `path`, their strings dictionary-encoded or not.
fn write_rows(path: &std::path::Path, ids: std::ops::Range<i64>, dictionary: bool) {
    let mut c1s = StringBuilder::new();
    let mut lists = ListBuilder::new(arrow_array::builder::Int64Builder::new());
    for i in ids.clone() {
        c1s.append_option(c1(i));
        lists.values().append_slice(&history(i));
        lists.append(true);
    }
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from_iter_values(ids.clone())) as ArrayRef),
        ("i1", Arc::new(Int64Array::from_iter(ids.clone().map(dense1))) as ArrayRef),
        ("i2", Arc::new(Int32Array::from_iter_values(ids.clone().map(|i| i as i32 * 3))) as ArrayRef),
        ("c1", Arc::new(c1s.finish()) as ArrayRef),
        ("c2", Arc::new(arrow_array::StringArray::from_iter_values(ids.clone().map(c2))) as ArrayRef),
        ("history", Arc::new(lists.finish()) as ArrayRef),
        ("unused", Arc::new(Int64Array::from_iter_values(ids)) as ArrayRef),
    ])
    .unwrap();
    let props =
        WriterProperties::builder().set_max_row_group_row_count(Some(1000)).set_dictionary_enabled(dictionary).build();
    let mut writer = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

fn pipeline(dir: &std::path::Path, transforms: &str) -> WorkerPipeline {
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: parquet}}\nbatchSize: 512\nshuffle: {{bufferSize: 2000}}\npadValue: -1\ntransforms:\n{transforms}",
        dir.display()
    );
    crate::engine_support::pipeline("features", &manifest)
}

fn float32s(batch: &Batch, field: &str) -> Vec<f32> {
    batch.tensors[field].data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// XXH64 (seed 0) written out from its specification, independent of the crate the worker uses.
fn xxh64(input: &[u8]) -> u64 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P3: u64 = 0x1656_67B1_9E37_79F9;
    const P4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P5: u64 = 0x27D4_EB2F_1656_67C5;
    let round = |acc: u64, lane: u64| acc.wrapping_add(lane.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1);
    let merge = |acc: u64, v: u64| (acc ^ round(0, v)).wrapping_mul(P1).wrapping_add(P4);
    let lane = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let mut rest = input;
    let mut h = if input.len() >= 32 {
        let mut v = [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)];
        while rest.len() >= 32 {
            for (i, acc) in v.iter_mut().enumerate() {
                *acc = round(*acc, lane(&rest[8 * i..]));
            }
            rest = &rest[32..];
        }
        let mut h = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        for acc in v {
            h = merge(h, acc);
        }
        h
    } else {
        P5
    };
    h = h.wrapping_add(input.len() as u64);
    while rest.len() >= 8 {
        h = (h ^ round(0, lane(rest))).rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        h = (h ^ u64::from(u32::from_le_bytes(rest[..4].try_into().unwrap())).wrapping_mul(P1))
            .rotate_left(23)
            .wrapping_mul(P2)
            .wrapping_add(P3);
        rest = &rest[4..];
    }
    for &b in rest {
        h = (h ^ u64::from(b).wrapping_mul(P5)).rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// The same rows, with their strings dictionary-encoded (read as dictionaries, each op on the
/// distinct values), written plain, and half of each in one source (splits that join the two).
#[tokio::test(flavor = "multi_thread")]
async fn dlrm_preprocessing_matches_a_row_by_row_reference() {
    for layout in ["dictionary", "plain", "half of each"] {
        let dir = tempfile::tempdir().unwrap();
        let (half, path) = (ROWS / 2, |name: &str| dir.path().join(name));
        match layout {
            "dictionary" => write_rows(&path("part-0.parquet"), 0..ROWS, true),
            "plain" => write_rows(&path("part-0.parquet"), 0..ROWS, false),
            _ => {
                write_rows(&path("part-0.parquet"), 0..half, true);
                write_rows(&path("part-1.parquet"), half..ROWS, false);
            }
        }
        dlrm_preprocessing_matches(dir.path()).await;
    }
}

async fn dlrm_preprocessing_matches(dir: &std::path::Path) {
    let files = tempfile::tempdir().unwrap();
    std::fs::write(files.path().join("vocab.txt"), "a\nc\n").unwrap();
    let transforms = format!(
        "- fillNull: {{fields: [i1], value: 0}}\n\
         - fillNull: {{fields: [c1], text: ''}}\n\
         - cross: {{fields: [c1, c2], buckets: 1000, output: c1_c2}}\n\
         - hashBucket: {{fields: [c1], buckets: 97}}\n\
         - vocabulary: {{fields: [c2], path: {}/vocab.txt}}\n\
         - bucketize: {{fields: [i2], boundaries: [30, 3000]}}\n\
         - log1p: {{fields: [i1]}}\n\
         - concat: {{fields: [i1, i2], output: dense}}\n\
         - truncate: {{fields: [history], length: 2, keep: last}}\n\
         - selectFields: {{fields: [id, dense, c1, c1_c2, c2, history]}}\n",
        files.path().display()
    );
    let (batches, engine) = epoch(pipeline(dir, &transforms)).await.unwrap();
    let mut seen = vec![false; ROWS as usize];
    for batch in &batches {
        let ids = int64s(batch, "id");
        let dense = float32s(batch, "dense");
        let (cat, crossed, vocab) = (int64s(batch, "c1"), int64s(batch, "c1_c2"), int64s(batch, "c2"));
        let history_tensor = &batch.tensors["history"];
        assert_eq!(history_tensor.shape, [ids.len(), 2], "cut to 2, padded to the longest");
        let histories = int64s(batch, "history");
        assert_eq!(batch.tensors["dense"].shape, [ids.len(), 2]);
        for (row, &i) in ids.iter().enumerate() {
            assert!(!std::mem::replace(&mut seen[i as usize], true), "row {i} twice");
            let filled = dense1(i).unwrap_or(0) as f64;
            assert_eq!(dense[2 * row], filled.max(0.0).ln_1p() as f32, "log1p of row {i}");
            let bucket = [30.0, 3000.0].iter().filter(|b| **b <= (i * 3) as f64).count();
            assert_eq!(dense[2 * row + 1], bucket as f32, "bucketize of row {i}");
            let text = c1(i).unwrap_or_default();
            assert_eq!(cat[row], (xxh64(text.as_bytes()) % 97) as i64, "hashBucket of row {i}");
            let joined: Vec<u8> =
                [xxh64(text.as_bytes()), xxh64(c2(i).as_bytes())].iter().flat_map(|h| h.to_le_bytes()).collect();
            assert_eq!(crossed[row], (xxh64(&joined) % 1000) as i64, "cross of row {i}");
            assert_eq!(vocab[row], [0, 2, 1][i as usize % 3], "vocabulary of row {i}: a, b (out of it), c");
            let h = history(i);
            let mut want: Vec<i64> = h[h.len().saturating_sub(2)..].to_vec();
            want.resize(2, -1);
            assert_eq!(histories[2 * row..2 * row + 2], want, "truncate of row {i}");
        }
    }
    assert!(seen.iter().all(|s| *s), "every row once");
    assert_eq!(engine.stats.elements.load(std::sync::atomic::Ordering::Relaxed), ROWS as u64);
    let ids: Vec<i64> = batches.iter().flat_map(|b| int64s(b, "id")).collect();
    assert_ne!(ids, (0..ROWS).collect::<Vec<_>>(), "shuffled");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_null_reaching_the_batch_or_a_wrong_type_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("part-0.parquet"));
    let e = epoch(pipeline(dir.path(), "- log1p: {fields: [i1]}\n- selectFields: {fields: [i1]}\n"))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("\"i1\" is null") && e.contains("fillNull"), "{e}");
    let e = epoch(pipeline(dir.path(), "- log1p: {fields: [c2]}\n")).await.err().unwrap().to_string();
    assert!(e.contains("transforms[0].log1p: field \"c2\" is Utf8; this op takes numbers"), "{e}");
    let e =
        epoch(pipeline(dir.path(), "- hashBucket: {fields: [nope], buckets: 3}\n")).await.err().unwrap().to_string();
    assert!(e.contains("no field \"nope\""), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_columns_read_are_those_the_ops_need() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("part-0.parquet"));
    let transforms =
        "- fillNull: {fields: [i1], value: 0}\n- log1p: {fields: [i1]}\n- selectFields: {fields: [i1, id]}\n";
    let spec = pipeline(dir.path(), transforms);
    assert_eq!(spec.data_plane.columns_read(), Some(vec!["i1".to_string(), "id".to_string()]));
    let (batches, _) = epoch(spec).await.unwrap();
    assert_eq!(batches[0].tensors.keys().collect::<Vec<_>>(), ["i1", "id"]);
}

/// `stoker-worker profile` on the columnar path: every op given every row, and the columns'
/// bytes measured after each (two float32 values a row after the concat and select).
#[tokio::test(flavor = "multi_thread")]
async fn the_profile_measures_each_op_on_the_columnar_path() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("part-0.parquet"));
    let transforms = "- fillNull: {fields: [i1], value: 0}\n\
         - log1p: {fields: [i1]}\n\
         - concat: {fields: [i1, i2], output: dense}\n\
         - selectFields: {fields: [dense]}\n";
    let options = stoker_worker::profile::SampleOptions {
        elements: ROWS as u64,
        threads: 2,
        memory_budget: 256 << 20,
        cache_dir: None,
    };
    let sample = stoker_worker::profile::sample(pipeline(dir.path(), transforms), &options).await.unwrap();
    assert_eq!((sample.records, sample.rows), (ROWS as u64, ROWS as u64), "{sample:?}");
    for (i, op) in sample.ops.iter().enumerate() {
        assert_eq!(op.totals.elements_in, ROWS as u64, "transforms[{i}]: {sample:?}");
        assert!(op.bytes_per_element.is_some_and(|b| b > 0.0), "transforms[{i}]'s bytes: {sample:?}");
    }
    let dense = sample.ops[3].bytes_per_element.unwrap();
    assert!((8.0..16.0).contains(&dense), "two float32s a row, and their nulls at most: {dense}");
    assert!(sample.restart_markers.is_none());
}
