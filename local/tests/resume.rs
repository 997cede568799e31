//! Resuming a job mid-epoch from its ranks' saved states, with real processes: two ranks of one
//! job read epoch 0 and part of epoch 1 from two workers, save their states (`Client::state`)
//! and stop; then a new dispatcher (an operator that restarted, knowing nothing of the job) with
//! one worker (another worker count) and two new clients resuming from those states read the
//! rest. Epoch 1, across both runs, holds every record once (yielded or dropped to keep the
//! ranks equal), each run gives both ranks the same number of batches, and epoch 2 is whole.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_client::{Client, ClientOptions, ResumeState};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 8;
const LINES: i64 = 503;
/// Batches of epoch 1 each rank reads before the job stops (of about 200).
const BEFORE_STOP: usize = 60;

/// Per epoch read: the records each batch held, and the rows dropped.
type Read = BTreeMap<u64, (Vec<Vec<i64>>, u64)>;

fn options(rank: u32, resume: Option<ResumeState>) -> ClientOptions {
    let mut options = ClientOptions::new("ns", "records");
    options.job = "ddp".into();
    options.consumers = 2;
    options.consumer_index = rank;
    options.prefetch = 2;
    options.resume = resume;
    options
}

/// Reads as rank `rank` until epoch `until` has ended, or until `stop_after` batches of epoch 1:
/// what it read, and its state then.
async fn rank(
    url: String,
    rank: u32,
    resume: Option<ResumeState>,
    until: u64,
    stop_after: Option<usize>,
) -> (Read, ResumeState) {
    let mut client = Client::from_dispatcher(&url, options(rank, resume)).await.unwrap();
    let mut read = Read::new();
    let reading = async {
        while client.epoch() <= until {
            let epoch = client.epoch();
            let dropped_before = client.dropped_rows();
            let batches = &mut read.entry(epoch).or_default().0;
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the caller");
                assert_eq!(batch.epoch, epoch);
                batches.push(support::ids(&batch));
                if epoch == 1 && stop_after == Some(batches.len()) {
                    return;
                }
            }
            read.get_mut(&epoch).unwrap().1 = client.dropped_rows() - dropped_before;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), reading).await.expect("reading did not end within 120 s");
    (read, client.state().expect("dispatcher mode has a state"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_resume_mid_epoch_on_a_new_dispatcher_with_another_worker_count_and_cover_the_epoch_once() {
    let data = tempfile::tempdir().unwrap();
    let first =
        support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(3), Some(40.0))
            .await;
    first.workers.scale(&first.key, 2).await.unwrap();
    let ranks: Vec<_> = (0..2).map(|r| tokio::spawn(rank(first.url.clone(), r, None, 1, Some(BEFORE_STOP)))).collect();
    let mut before = Vec::new();
    for r in ranks {
        before.push(r.await.expect("a rank failed"));
    }
    for (read, state) in &before {
        assert_eq!((state.epoch, state.batches), (1, BEFORE_STOP as u64), "saved mid epoch 1");
        assert_eq!(read[&1].0.len(), BEFORE_STOP);
    }
    // The whole job stops: the clients, the workers, the dispatcher.
    drop(first);

    let second =
        support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(3), Some(40.0))
            .await;
    second.workers.scale(&second.key, 1).await.unwrap();
    let ranks: Vec<_> = before
        .iter()
        .enumerate()
        .map(|(r, (_, state))| tokio::spawn(rank(second.url.clone(), r as u32, Some(state.clone()), 2, None)))
        .collect();
    let mut after = Vec::new();
    for r in ranks {
        after.push(r.await.expect("a resumed rank failed"));
    }

    let jobs = second.dispatcher.with_state(|st| st.jobs(&second.key));
    let skipped: u64 = jobs.iter().map(|j| j.skipped).sum();
    assert_eq!(skipped, 2 * BEFORE_STOP as u64 * 10, "the new run left out the rows both ranks had yielded");
    let all = (FILES * LINES) as usize;
    let runs = [&before, &after];
    for run in runs {
        let (a, b) = (&run[0].0, &run[1].0);
        for (epoch, (batches, _)) in a {
            assert_eq!(
                batches.len(),
                b[epoch].0.len(),
                "epoch {epoch}: both ranks the same number of batches in a run"
            );
        }
    }
    for epoch in [1u64, 2] {
        let mut seen: BTreeMap<i64, u32> = BTreeMap::new();
        let mut dropped = 0;
        for (read, _) in runs.iter().flat_map(|run| run.iter()) {
            let Some((batches, d)) = read.get(&epoch) else { continue };
            for id in batches.iter().flatten() {
                *seen.entry(*id).or_default() += 1;
            }
            dropped += *d as usize;
        }
        let twice = seen.values().filter(|&&n| n > 1).count();
        eprintln!("epoch {epoch}: {} records yielded, {dropped} dropped, {twice} twice", seen.len());
        assert_eq!(twice, 0, "epoch {epoch}: no record twice across the runs");
        assert_eq!(seen.len() + dropped, all, "epoch {epoch}: every record once, or dropped and counted");
    }
}
