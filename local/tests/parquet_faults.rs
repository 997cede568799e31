//! The columnar path through connection faults and a share group, with real processes: a
//! Parquet table preprocessed by feature ops (`fillNull`, `log1p`, `hashBucket`,
//! `selectFields`), shuffled, in two `stoker-worker`s under a dispatcher, each paced to 40
//! batches a second per job.
//!
//! Read three epochs by one client while every 1.5 s every TCP connection to the workers is
//! reset (`ss -K`), and every third time those to the dispatcher too (as
//! connection_resets.rs does for JSONL records): every row of every epoch arrives once, with
//! the values the ops give it, and no split is counted done twice. Read two epochs by two jobs
//! of one share group: each job gets every row of each epoch once, with its values, and the
//! jobs really share the productions.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use stoker_api::{Batch, DType, WorkerPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;
use support::resets::{no_repeats, port, resetting, worker_ports};

/// Four files of 20,000 rows in row groups of 2,000: the worker gathers nine row groups into
/// a split (at least 16,384 rows), so an epoch is five splits, three of them across two files.
const FILES: i64 = 4;
const ROWS: i64 = 20_000;
const ROW_GROUP: usize = 2_000;
/// 80,000 rows in batches of 200: 400 batches an epoch, about 5 s at the workers' pace.
const BATCH: usize = 200;
const BUCKETS: u64 = 1000;

/// Row `id`'s count: null for every seventh row, negative for some (log1p clamps them to 0).
fn clicks(id: i64) -> Option<i64> {
    (id % 7 != 0).then_some(id * 13 % 101 - 5)
}

/// Row `id`'s category: null for every eleventh row.
fn category(id: i64) -> Option<String> {
    (id % 11 != 0).then(|| format!("cat-{}", id % 997))
}

/// What the ops make of row `id`: its count filled with 0 and log1p'd, its category filled
/// with "" and hashed into [`BUCKETS`].
fn expected(id: i64) -> (f32, i64) {
    let count = clicks(id).unwrap_or(0).max(0) as f64;
    let text = category(id).unwrap_or_default();
    (count.ln_1p() as f32, (stoker_worker::table::column::xxh64(text.as_bytes()) % BUCKETS) as i64)
}

/// The table written to `dir` (`id`, `clicks`, `category`, and a `note` no op reads), and the
/// pipeline of feature ops over it.
fn table(dir: &std::path::Path) -> WorkerPipeline {
    for file in 0..FILES {
        let ids = file * ROWS..(file + 1) * ROWS;
        let columns: [(&str, ArrayRef); 4] = [
            ("id", Arc::new(Int64Array::from_iter_values(ids.clone()))),
            ("clicks", Arc::new(Int64Array::from_iter(ids.clone().map(clicks)))),
            ("category", Arc::new(StringArray::from_iter(ids.clone().map(category)))),
            ("note", Arc::new(StringArray::from_iter_values(ids.map(|id| format!("row {id}, never read"))))),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let props = WriterProperties::builder().set_max_row_group_row_count(Some(ROW_GROUP)).build();
        let out = std::fs::File::create(dir.join(format!("part-{file}.parquet"))).unwrap();
        let mut writer = ArrowWriter::try_new(out, batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: parquet}}\nbatchSize: {BATCH}\nshuffle: {{bufferSize: 2000}}\nseed: 5\n\
         transforms:\n- fillNull: {{fields: [clicks, category], value: 0, text: ''}}\n- log1p: {{fields: [clicks]}}\n\
         - hashBucket: {{fields: [category], buckets: {BUCKETS}}}\n- selectFields: {{fields: [id, clicks, category]}}\n",
        dir.display()
    );
    WorkerPipeline::new("ns", "table", &stoker_api::from_yaml(&manifest).unwrap())
}

/// Two workers of the table's pipeline under a dispatcher, each sending at most 40 batches a
/// second per job.
async fn two_workers(data: &std::path::Path) -> support::Dispatched {
    let s = support::dispatched(table(data), Duration::from_secs(10), Some(40.0)).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    s
}

/// Job `job`'s client, in share group `share`, with little read ahead.
fn options(job: &str, share: Option<&str>) -> ClientOptions {
    let mut options = ClientOptions::new("ns", "table");
    options.job = job.into();
    options.share = share.map(Into::into);
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    options
}

/// A batch's int64 or float32 column, as f64s.
fn column(batch: &Batch, field: &str, dtype: DType) -> Vec<f64> {
    let tensor = &batch.tensors[field];
    assert_eq!((tensor.dtype, tensor.shape.as_slice()), (dtype, [batch.rows.len()].as_slice()), "{field}");
    match dtype {
        DType::Int64 => tensor.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::Float32 => tensor.data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        other => panic!("{field} as {other:?}"),
    }
}

/// Reads `epochs` epochs as `options` says (declared: nothing is made past them), checking
/// each batch; each epoch's rows by id, each with its row number (`Batch.rows`: its split and
/// position).
async fn read(url: String, mut options: ClientOptions, epochs: u64) -> Vec<BTreeMap<i64, u64>> {
    let job = options.job.clone();
    options.epochs = Some(epochs);
    let mut client = Client::from_dispatcher(&url, options).await.unwrap();
    let mut got = vec![BTreeMap::new(); epochs as usize];
    for (epoch, rows) in (0..).zip(&mut got) {
        assert_eq!(client.epoch(), epoch, "{job}: the epochs in order");
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                check(&job, epoch, &batch.expect("no error reaches the reader"), rows);
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reading)
            .await
            .unwrap_or_else(|_| panic!("{job}: epoch {epoch} did not end within 120 s"));
    }
    client.close(Duration::from_secs(5)).await;
    got
}

/// A batch `job` got in `epoch`: the selected columns only, each row's values those the ops
/// give it, no row already in `rows`, where its row is added.
fn check(job: &str, epoch: u64, batch: &Batch, rows: &mut BTreeMap<i64, u64>) {
    assert_eq!(batch.epoch, epoch);
    assert_eq!(batch.tensors.keys().collect::<Vec<_>>(), ["category", "clicks", "id"], "the selected columns");
    let ids = column(batch, "id", DType::Int64);
    let counts = column(batch, "clicks", DType::Float32);
    let buckets = column(batch, "category", DType::Int64);
    for (k, &row) in batch.rows.iter().enumerate() {
        let id = ids[k] as i64;
        assert_eq!((counts[k] as f32, buckets[k] as i64), expected(id), "{job}: row {id}'s values");
        assert!(rows.insert(id, row).is_none(), "{job}: row {id} twice in epoch {epoch}");
    }
}

/// Every epoch `job` got holds every row of the table once, each under the row number it had
/// in the first (a row's identity, by which the exactly-once bookkeeping skips it, is its own).
fn every_row_once(job: &str, got: &[BTreeMap<i64, u64>]) {
    let first = &got[0];
    assert_eq!(first.keys().copied().collect::<Vec<_>>(), (0..FILES * ROWS).collect::<Vec<_>>(), "{job}: epoch 0");
    assert_eq!(first.values().collect::<BTreeSet<_>>().len(), first.len(), "{job}: a row number twice");
    for (epoch, rows) in got.iter().enumerate().skip(1) {
        let differ: Vec<_> = rows.iter().filter(|(id, row)| first.get(id) != Some(row)).take(5).collect();
        assert!(
            rows.len() == first.len() && differ.is_empty(),
            "{job}, epoch {epoch}: {} rows, {differ:?}",
            rows.len()
        );
    }
}

/// Both workers delivered batches: the rows came through two processes.
fn both_delivered(s: &support::Dispatched) {
    let progress = s.dispatcher.with_state(|st| st.worker_progress(&s.key));
    let delivering = progress.iter().filter(|w| w.2.batches > 0).count();
    assert_eq!(delivering, 2, "both workers delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_resets_on_the_columnar_path_lose_and_repeat_no_row() {
    let data = tempfile::tempdir().unwrap();
    let s = two_workers(data.path()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let resetter = resetting(worker_ports(&s.dispatcher, &s.key).await, port(&s.url), stop.clone());
    let started = Instant::now();
    let got = read(s.url.clone(), options("resets", None), 3).await;
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let closed = resetter.join().unwrap();
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    eprintln!("three epochs in {:.1} s, {closed} sockets reset; the dispatcher's view: {jobs:?}", took.as_secs_f64());
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    every_row_once("resets", &got);
    no_repeats(&jobs);
    both_delivered(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_group_on_the_columnar_path_gives_each_job_every_row_once() {
    let data = tempfile::tempdir().unwrap();
    let s = two_workers(data.path()).await;
    let started = Instant::now();
    let readers: Vec<_> = ["trial-a", "trial-b"]
        .into_iter()
        .map(|job| (job, tokio::spawn(read(s.url.clone(), options(job, Some("sweep")), 2))))
        .collect();
    for (job, reader) in readers {
        every_row_once(job, &reader.await.unwrap_or_else(|e| panic!("{job}'s client failed: {e}")));
    }
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap_or_default();
    eprintln!("two jobs, two epochs in {:.1} s; {jobs:?}; {delivery:?}", started.elapsed().as_secs_f64());
    no_repeats(&jobs);
    assert_eq!(delivery.splits_repeated, 0, "{delivery:?}");
    assert!(delivery.shared_deliveries > delivery.shared_productions, "shared: {delivery:?}");
    // A taker gives up on a copy that has not grown for 750 ms: with 16,384-row chunks 3 of
    // these 10 productions were made twice in every run; with a split made for takers landing
    // a piece a thread at a time, and its maker saying when it has read the split, none.
    assert!(delivery.shared_made_again * 4 < delivery.shared_productions, "made twice: {delivery:?}");
    both_delivered(&s);
}
