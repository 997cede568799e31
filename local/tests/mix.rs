//! Weighted mixing of sources (`spec.source.mix`) in real `stoker-worker` processes under a
//! dispatcher: each epoch holds the sources in proportion to their weights (a small source
//! repeats, a large one gives another part of itself each epoch), every slot of an epoch
//! reaches the client exactly once, and the status reports the realised shares.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stoker_api::WorkerPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const LINES: i64 = 40;

/// `files` JSONL files of `LINES` records `{"id": n}`, ids from `first` up, every record the
/// same size so that a source's bytes count its records.
fn source(dir: &std::path::Path, files: i64, first: i64) {
    std::fs::create_dir_all(dir).unwrap();
    for file in 0..files {
        let records: String = (0..LINES).map(|i| format!("{{\"id\": {:>6}}}\n", first + file * LINES + i)).collect();
        std::fs::write(dir.join(format!("{file:03}.jsonl")), records).unwrap();
    }
}

/// Web: 12 files (ids 0..480); code: 4 files (ids 100000..100160); code weighted 3 to 1, so an
/// epoch of 16 files' bytes takes 4 web files and reads code's 4 three times each.
fn pipeline(dir: &std::path::Path) -> WorkerPipeline {
    source(&dir.join("web"), 12, 0);
    source(&dir.join("code"), 4, 100_000);
    let manifest = format!(
        "source:\n  format: jsonl\n  mix:\n  - {{uri: 'file://{0}/web/', weight: 1}}\n  - {{uri: 'file://{0}/code/', weight: 3}}\n\
         batchSize: 16\nseed: 9\nshuffle: {{bufferSize: 64}}\n",
        dir.display()
    );
    WorkerPipeline::new("ns", "mixed", &stoker_api::from_yaml(&manifest).unwrap())
}

fn ids(t: &stoker_api::Tensor) -> Vec<i64> {
    t.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_hold_the_sources_in_proportion_and_every_slot_once() {
    let dir = tempfile::tempdir().unwrap();
    let s = support::dispatched(pipeline(dir.path()), Duration::from_secs(10), None).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut client = Client::from_dispatcher(&s.url, ClientOptions::new("ns", "mixed")).await.unwrap();
    let mut web_seen: BTreeMap<i64, u32> = BTreeMap::new();
    for epoch in 0..3 {
        let mut rows = BTreeSet::new();
        let mut code: BTreeMap<i64, u32> = BTreeMap::new();
        let mut web = 0;
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the reader");
                assert_eq!(batch.epoch, epoch);
                for row in &batch.rows {
                    assert!(rows.insert(*row), "row {row:#x} of epoch {epoch} delivered twice");
                }
                for id in ids(&batch.tensors["id"]) {
                    if id >= 100_000 {
                        *code.entry(id).or_default() += 1;
                    } else {
                        web += 1;
                        *web_seen.entry(id).or_default() += 1;
                    }
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the epoch ends within 120 s");
        assert_eq!(rows.len(), 16 * LINES as usize, "epoch {epoch}: every slot's every row once");
        assert_eq!(web, 4 * LINES, "epoch {epoch}: a quarter of the bytes from web: 4 of its 12 files");
        assert_eq!(code.len(), 160, "epoch {epoch}: all of code");
        assert!(code.values().all(|&n| n == 3), "epoch {epoch}: code read three times over: {code:?}");
    }
    // Three epochs of 4 web files walked all 12 once.
    assert_eq!(web_seen.len(), 480, "every web record in three epochs");
    assert!(web_seen.values().all(|&n| n == 1), "none twice");

    // The workers' counts reach the status as shares, near the weights (they may be producing
    // the next epoch already, a split or so beyond).
    let deadline = Instant::now() + Duration::from_secs(30);
    let shares = loop {
        let shares = s.report().source_shares;
        if shares.len() == 2 && (shares[1] - 0.75).abs() < 0.05 {
            break shares;
        }
        assert!(Instant::now() < deadline, "no shares near [0.25, 0.75] within 30 s: {shares:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!((shares[0] + shares[1] - 1.0).abs() < 0.002, "{shares:?}");
    drop(client);
    s.workers.scale(&s.key, 0).await.unwrap();
}
