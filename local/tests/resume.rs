//! Resuming a job mid-epoch from its ranks' saved states, with real processes: two ranks of one
//! job read epoch 0 and part of epoch 1 from two workers, save their states (`Client::state`)
//! and stop; then a new dispatcher (an operator that restarted, knowing nothing of the job) with
//! one worker (another worker count) and two new clients resuming from those states read the
//! rest. Epoch 1, across both runs, holds every record once (yielded or dropped to keep the
//! ranks equal), each run gives both ranks the same number of batches, and epoch 2 is whole.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use stoker_client::{ClientOptions, ResumeState};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 8;
const LINES: i64 = 503;
/// Batches of epoch 1 each rank reads before the job stops (of about 200).
const BEFORE_STOP: usize = 60;

/// Reads as rank `r` until epoch `until` has ended, or until `stop_after` batches of it: what
/// it read of each epoch, and its state then.
async fn rank(
    url: String,
    r: u32,
    resume: Option<ResumeState>,
    until: u64,
    stop_after: Option<usize>,
) -> (BTreeMap<u64, support::Got>, ResumeState) {
    let options = ClientOptions { resume, ..support::rank("ddp", 2, r) };
    support::read_until(url, options, until, stop_after, LINES, Arc::default()).await
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
        assert_eq!(read[&1].batches, BEFORE_STOP);
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
        for (epoch, got) in a {
            assert_eq!(got.batches, b[epoch].batches, "epoch {epoch}: both ranks the same number of batches in a run");
        }
    }
    for epoch in [1u64, 2] {
        let mut seen: BTreeMap<i64, u32> = BTreeMap::new();
        let mut dropped = 0;
        for (read, _) in runs.iter().flat_map(|run| run.iter()) {
            let Some(got) = read.get(&epoch) else { continue };
            for id in &got.ids {
                *seen.entry(*id).or_default() += 1;
            }
            dropped += got.dropped_rows as usize;
        }
        let twice = seen.values().filter(|&&n| n > 1).count();
        eprintln!("epoch {epoch}: {} records yielded, {dropped} dropped, {twice} twice", seen.len());
        assert_eq!(twice, 0, "epoch {epoch}: no record twice across the runs");
        assert_eq!(seen.len() + dropped, all, "epoch {epoch}: every record once, or dropped and counted");
    }
}
