//! Dynamic sharding with real worker processes: a dispatcher, two `stoker-worker` processes
//! pulling splits, and a client following the dispatcher's worker list. Every element of an
//! epoch arrives exactly once, also when a worker is killed mid-split: its split is produced
//! again without the rows the client already had.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_api::{Batch, WorkerPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const SHARDS: i64 = 8;
const LINES: i64 = 40;

/// The lines as JSONL splits of 40 elements; `rest` is the spec after the source.
fn pipeline(dir: &std::path::Path, rest: &str) -> WorkerPipeline {
    for shard in 0..SHARDS {
        // The padding makes a split ~640 KB, far more than the client's flow-control window, so a
        // killed worker still holds undelivered data.
        let pad = vec!["0.5"; 2000].join(",");
        let lines: String =
            (0..LINES).map(|i| format!("{{\"id\": {}, \"pad\": [{pad}]}}\n", shard * 1000 + i)).collect();
        std::fs::write(dir.join(format!("{shard:02}.jsonl")), lines).unwrap();
    }
    let manifest = format!("source: {{uri: 'file://{}/', format: jsonl}}\n{rest}", dir.display());
    let spec: stoker_api::DataPipelineSpec = stoker_api::from_yaml(&manifest).unwrap();
    WorkerPipeline::new("ns", "lines", &spec)
}

fn ids(batch: &Batch) -> Vec<i64> {
    batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The lines' pipeline under a dispatcher, and its data directory (kept while it runs).
async fn setup(worker_timeout: Duration, rest: &str) -> (support::Dispatched, tempfile::TempDir) {
    let data = tempfile::tempdir().unwrap();
    (support::dispatched(pipeline(data.path(), rest), worker_timeout, None).await, data)
}

/// Reads until every id of `epoch` has arrived; returns how often each arrived. Batches of
/// later epochs (a fast worker can start the next epoch while another's last batches are
/// still on the wire) are kept in `later` for the next call.
async fn read_epoch(
    client: &mut Client,
    later: &mut Vec<Batch>,
    epoch: u64,
    mut each_batch: impl FnMut(usize),
) -> BTreeMap<i64, u32> {
    let mut seen = BTreeMap::new();
    let mut batches = 0;
    let all = (SHARDS * LINES) as usize;
    let mut pending: Vec<Batch> = std::mem::take(later);
    tokio::time::timeout(Duration::from_secs(60), async {
        while seen.len() < all {
            let batch = match pending.pop() {
                Some(b) => b,
                None => client
                    .next()
                    .await
                    .expect("the client never ends under a dispatcher")
                    .expect("no error reaches the caller"),
            };
            if batch.epoch > epoch {
                later.push(batch);
                continue;
            }
            assert_eq!(batch.epoch, epoch, "a batch of a finished epoch arrived late");
            for id in ids(&batch) {
                *seen.entry(id).or_insert(0) += 1;
            }
            batches += 1;
            each_batch(batches);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("epoch {epoch}: only {} of {all} elements arrived within 60 s", seen.len()));
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_an_epoch_and_a_killed_one_loses_and_repeats_nothing() {
    let (s, data) = setup(Duration::from_secs(3), "batchSize: 10\n").await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut options = ClientOptions::new("ns", "lines");
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    let mut client = Client::from_dispatcher(&s.url, options).await.unwrap();

    let mut later = Vec::new();
    let first = read_epoch(&mut client, &mut later, 0, |_| {}).await;
    assert!(first.values().all(|&n| n == 1), "without failures every element arrives exactly once");
    let progress = s.dispatcher.with_state(|st| st.worker_progress(&s.key));
    assert_eq!(progress.len(), 2, "both workers registered");
    // Under `stoker local` each worker serves /metrics on a port of its own, and together they
    // count at least the epoch the client read (they may have begun the next).
    let texts = s.scrape_workers().await;
    assert_eq!(texts.len(), 2, "both workers serve /metrics");
    let elements = support::metric_sum(&texts, "stoker_worker_elements_total", &s.key);
    assert!(elements >= (SHARDS * LINES) as f64, "{elements} elements counted: {texts:?}");
    // What their streams sent, per job: at least the epoch's batches of 10 (the client's
    // prefetch of the next epoch may add some), and the next epoch's queues, in production
    // while the client holds its prefetch.
    let sent = support::metric_sum(&texts, "stoker_worker_sent_batches_total", &s.key);
    assert!(sent >= (SHARDS * LINES / 10) as f64, "{sent} batches sent: {texts:?}");
    assert!(support::metric_sum(&texts, "stoker_worker_sent_bytes_total", &s.key) > 0.0);
    let read = support::metric_sum(&texts, "stoker_worker_source_read_bytes_total", &s.key);
    let corpus: u64 = std::fs::read_dir(data.path()).unwrap().map(|f| f.unwrap().metadata().unwrap().len()).sum();
    assert!(read >= corpus as f64, "{read} bytes read of the {corpus} of the epoch's files: {texts:?}");
    assert!(texts.iter().any(|t| t.contains("stoker_worker_queued_batches{")), "queues of the epochs in production");

    // Epoch 1: kill a worker after a few batches; its splits must reach the client anyway.
    let workers = &s.workers;
    let key = &s.key;
    let mut killed = None;
    let second = read_epoch(&mut client, &mut later, 1, |batches| {
        // Only a worker holding a split can lose one: wait until both do.
        let both_hold = s.dispatcher.with_state(|st| st.jobs(key)).first().is_some_and(|j| j.holders == 2);
        if batches >= 3 && both_hold && killed.is_none() {
            killed = workers.kill_one(key);
        }
    })
    .await;
    assert!(killed.is_some(), "never saw both workers holding a split in epoch 1, so none was killed");
    assert_eq!(second.len() as i64, SHARDS * LINES, "every element of the epoch arrived");
    // The dispatcher notices the death after its timeout.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while s.dispatcher.with_state(|st| st.worker_addresses(&s.key)).len() != 1 {
        assert!(tokio::time::Instant::now() < deadline, "the dead worker is still listed after 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    assert_eq!(jobs.len(), 1);
    let repeats: u32 = second.values().map(|n| n - 1).sum();
    eprintln!("after the kill: {repeats} elements arrived twice; dispatcher: {:?}", jobs[0]);
    assert!(jobs[0].requeued >= 1, "the dead worker's split went back to the queue: {:?}", jobs[0]);
    assert_eq!(jobs[0].repeats, 0, "a dead worker cannot report");
    assert_eq!(repeats, 0, "exactly once: what the client had of the dead worker's split was skipped");
    assert_eq!(jobs[0].unacknowledged, 0, "the client acknowledged the list without the dead worker");
}

/// Splits that complete with no batch to carry them (shard 7 is all filtered out; each worker's
/// last rows of an epoch are dropped as the remainder) reach the dispatcher through the client,
/// in batches without tensors that the client reports and never yields: epochs still advance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_without_a_batch_reach_the_dispatcher_through_the_client() {
    let rest = "batchSize: 30\ndropRemainder: true\ntransforms: [{filter: {field: id, op: lt, value: '7000'}}]\n";
    let (s, _data) = setup(Duration::from_secs(10), rest).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "lines")).await.unwrap();
    let mut seen: BTreeMap<u64, BTreeMap<i64, u32>> = BTreeMap::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while !seen.contains_key(&3) {
            let batch = client.next().await.expect("the client never ends under a dispatcher").expect("no error");
            let ids = ids(&batch);
            assert_eq!(
                ids.len(),
                30,
                "only full batches reach the caller (epoch {}, completes {:?})",
                batch.epoch,
                batch.completes
            );
            for id in ids {
                assert!(id < 7000, "{id} should have been filtered out");
                *seen.entry(batch.epoch).or_default().entry(id).or_insert(0) += 1;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("epochs seen within 60 s: {:?}", seen.keys().collect::<Vec<_>>()));
    for epoch in 0..3 {
        let ids = &seen[&epoch];
        assert!(ids.values().all(|&n| n == 1), "epoch {epoch}: an element arrived twice");
        // 280 elements pass the filter; each of the two workers drops under one batch.
        assert!(ids.len() >= 280 - 2 * 29, "epoch {epoch}: {} elements", ids.len());
    }
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    assert_eq!(jobs[0].requeued, 0, "no split was handed out again: {:?}", jobs[0]);
}
