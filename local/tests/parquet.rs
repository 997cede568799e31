//! A Parquet source in real `stoker-worker` processes under a dispatcher: row groups are the
//! splits two workers share, only the named column reaches the client, and every row of each
//! epoch arrives exactly once.

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use stoker_api::WorkerPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

/// Three files of 40,000 rows (`id`, and a `text` column the pipeline never reads) in row
/// groups of 5,000, snappy-compressed: two splits of four row groups each per file.
fn table(dir: &std::path::Path) {
    for file in 0..3i64 {
        let ids = Int64Array::from_iter_values(file * 40_000..(file + 1) * 40_000);
        let text = StringArray::from_iter_values((0..40_000).map(|i| format!("row {i} of file {file}")));
        let batch =
            RecordBatch::try_from_iter([("id", Arc::new(ids) as ArrayRef), ("text", Arc::new(text) as ArrayRef)])
                .unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(5_000))
            .set_compression(Compression::SNAPPY)
            .build();
        let out = std::fs::File::create(dir.join(format!("part-{file}.snappy.parquet"))).unwrap();
        let mut writer = ArrowWriter::try_new(out, batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
    std::fs::write(dir.join("_SUCCESS"), "").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_the_row_groups_and_deliver_every_row_once() {
    let dir = tempfile::tempdir().unwrap();
    table(dir.path());
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: parquet, columns: [id]}}\nbatchSize: 1000\nshuffle: {{bufferSize: 4096}}\nseed: 3\n",
        dir.path().display()
    );
    let pipeline = WorkerPipeline::new("ns", "table", &stoker_api::from_yaml(&manifest).unwrap());
    let s = support::dispatched(pipeline, Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "table")).await.unwrap();
    for epoch in 0..2 {
        let mut ids = BTreeSet::new();
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the reader");
                assert_eq!(batch.tensors.keys().collect::<Vec<_>>(), ["id"], "only the named column");
                for id in batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())) {
                    assert!(ids.insert(id), "id {id} twice in epoch {epoch}");
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the epoch ends within 120 s");
        assert_eq!(ids.len(), 120_000, "epoch {epoch}: every row once");
    }
}

/// The columnar path through a worker's death: a pipeline of feature ops (`hashBucket` of the
/// text, kept with the id), shuffled, two workers paced to 40 batches a second; in epoch 1,
/// once both have delivered, one is killed (SIGKILL). Its splits are produced again by the
/// other without the rows the client had (their positions are left out before the table is
/// transformed), so every row of every epoch arrives once, and each with the bucket of its
/// own text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_split_on_the_columnar_path_costs_no_row_and_repeats_none() {
    let dir = tempfile::tempdir().unwrap();
    table(dir.path());
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: parquet}}\nbatchSize: 500\nshuffle: {{bufferSize: 2000}}\nseed: 5\n\
         transforms:\n- hashBucket: {{fields: [text], buckets: 1000}}\n",
        dir.path().display()
    );
    let pipeline = WorkerPipeline::new("ns", "table", &stoker_api::from_yaml(&manifest).unwrap());
    let s = support::dispatched(pipeline, Duration::from_secs(3), Some(40.0)).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut options = ClientOptions::new("ns", "table");
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    let mut client = Client::from_dispatcher(&s.url, options).await.unwrap();
    let bucket = |id: i64| {
        let text = format!("row {} of file {}", id % 40_000, id / 40_000);
        (stoker_worker::table::column::xxh64(text.as_bytes()) % 1000) as i64
    };
    let mut killed = false;
    for epoch in 0..3 {
        let mut ids = BTreeSet::new();
        let mut batches = 0;
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the reader");
                let int64s = |f: &str| -> Vec<i64> {
                    batch.tensors[f].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
                };
                for (id, text) in int64s("id").into_iter().zip(int64s("text")) {
                    assert!(ids.insert(id), "id {id} twice in epoch {epoch}");
                    assert_eq!(text, bucket(id), "row {id}'s bucket");
                }
                batches += 1;
                let delivering = (s.dispatcher.with_state(|st| st.worker_progress(&s.key)).iter())
                    .filter(|w| w.2.batches > 0)
                    .count();
                if epoch == 1 && !killed && batches >= 30 && delivering == 2 {
                    killed = s.workers.kill_one(&s.key).is_some();
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the epoch ends within 120 s");
        assert_eq!(ids.len(), 120_000, "epoch {epoch}: every row once");
    }
    assert!(killed, "both workers never delivered, so none was killed");
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    assert!(jobs[0].requeued >= 1, "the dead worker's split was produced again: {:?}", jobs[0]);
    assert!(jobs[0].skipped > 0, "the rows the client had were skipped, not produced again: {:?}", jobs[0]);
}
