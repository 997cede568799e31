//! Exactly once with real processes: a 4000-record JSONL epoch, two `stoker-worker`s under a
//! dispatcher, one killed mid-split after the client has some of its rows. Every record reaches
//! the client once: the dead worker's split is produced again without the rows the client
//! acknowledged. (Before this, the same run delivered 4300 elements, 300 of them twice.)

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_api::{Batch, WorkerPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 4;
const LINES: i64 = 1000;

fn pipeline(dir: &std::path::Path) -> WorkerPipeline {
    for file in 0..FILES {
        let lines: String = (0..LINES).map(|i| format!("{{\"id\": {}}}\n", file * LINES + i)).collect();
        std::fs::write(dir.join(format!("{file}.jsonl")), lines).unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nshuffle: {{bufferSize: 64, seed: 1}}\n",
        dir.display()
    );
    WorkerPipeline::new("ns", "records", &stoker_api::from_yaml(&manifest).unwrap())
}

fn ids(batch: &Batch) -> Vec<i64> {
    batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_split_costs_no_record_and_repeats_none() {
    let data = tempfile::tempdir().unwrap();
    // 40 batches a second each: the epoch lasts seconds, so both workers are mid-split when
    // their heartbeats (every second) show they delivered.
    let s = support::dispatched(pipeline(data.path()), Duration::from_secs(3), Some(40.0)).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut options = ClientOptions::new("ns", "records");
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    let mut client = Client::from_dispatcher(&s.url, options).await.unwrap();

    let mut seen: BTreeMap<i64, u32> = BTreeMap::new();
    let mut batches = 0;
    let mut killed = None;
    let all = (FILES * LINES) as usize;
    tokio::time::timeout(Duration::from_secs(90), async {
        while seen.len() < all {
            let batch = client.next().await.expect("the stream goes on").expect("no error reaches the caller");
            if batch.epoch > 0 {
                continue; // the next epoch, started early by a worker with nothing left
            }
            // Provenance matches content: record i of file f is position i of split f.
            for (&row, id) in batch.rows.iter().zip(ids(&batch)) {
                let (split, position) = stoker_api::row_origin(row);
                assert_eq!(id, split as i64 * LINES + i64::from(position), "provenance of {id}");
                *seen.entry(id).or_insert(0) += 1;
            }
            batches += 1;
            // Both workers have delivered (heartbeats say so) and hold a split: kill one.
            let delivering =
                s.dispatcher.with_state(|st| st.worker_progress(&s.key)).iter().filter(|w| w.2.batches > 0).count();
            if killed.is_none() && batches >= 30 && delivering == 2 {
                killed = s.workers.kill_one(&s.key);
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("only {} of {all} records arrived within 90 s", seen.len()));
    assert!(killed.is_some(), "both workers never delivered, so none was killed");
    let repeats: u32 = seen.values().map(|n| n - 1).sum();
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    eprintln!("{batches} batches; {repeats} records twice; dispatcher: {:?}", jobs[0]);
    assert_eq!(seen.len(), all, "every record");
    assert_eq!(repeats, 0, "none twice");
    assert!(jobs[0].requeued >= 1, "the dead worker's split was produced again: {:?}", jobs[0]);
    assert!(jobs[0].skipped > 0, "the rows the client had were skipped, not produced again: {:?}", jobs[0]);
    // The counters status and metrics show.
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap();
    assert_eq!(delivery.redeliveries_skipped, jobs[0].skipped);
    assert_eq!((delivery.splits_repeated, delivery.recoveries_unacknowledged), (0, 0));
}
