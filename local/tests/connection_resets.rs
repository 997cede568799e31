//! Exactly once through connection faults, with real processes: two `stoker-worker`s under a
//! dispatcher, 4000-record JSONL epochs, read three epochs at a time while every 1.5 s every
//! TCP connection to the workers is reset (`ss -K`, as a proxy, a conntrack flush or a flaky
//! link does), and every third time those to the dispatcher too. Every process stays up.
//! Every epoch reaches the job exactly once, no error reaches the training loop, ranks keep
//! equal counts, and the run takes at most 1.5x one without faults. The two jobs of a share
//! group keep every epoch once each through the same resets and two leader changes. (Before, a
//! reset lost the batches on their way in the connection: an epoch came 120-160 rows short,
//! silently.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use stoker_client::ClientOptions;
use stoker_operator::autoscaling::Scaler;
use support::resets::{no_repeats, port, resetting, worker_ports};

const FILES: i64 = 4;
const LINES: i64 = 1000;
const EPOCHS: u64 = 3;
/// The share group's epochs: 10 splits (more would not be numbered in the order of their
/// files' names, which the provenance check of `support::read_until` assumes).
const GROUP_FILES: i64 = 10;
const GROUP_LINES: i64 = 400;

/// Reads [`EPOCHS`] epochs with `ranks` consumers (0: one client, the job shared) while the
/// connections are reset or not; what each consumer got, the time, and the sockets closed.
async fn read(ranks: u32, faults: bool) -> (Vec<Vec<support::Got>>, Duration, usize) {
    let data = tempfile::tempdir().unwrap();
    // 40 batches a second per worker and job: an epoch lasts about 5 s, several resets.
    let s =
        support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(10), Some(40.0))
            .await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ports = worker_ports(&s.dispatcher, &s.key).await;
    let resetter = faults.then(|| resetting(ports, port(&s.url), stop.clone()));
    let started = Instant::now();
    let consumers: Vec<_> = (0..ranks.max(1))
        .map(|r| {
            let options = support::rank("resets", ranks, r);
            tokio::spawn(support::consume(s.url.clone(), options, EPOCHS, LINES, Arc::new(AtomicUsize::new(0))))
        })
        .collect();
    let mut got = Vec::new();
    for consumer in consumers {
        got.push(consumer.await.expect("a consumer failed"));
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    eprintln!("the dispatcher's view: {jobs:?}");
    no_repeats(&jobs);
    let closed = resetter.map(|r| r.join().unwrap()).unwrap_or(0);
    (got, took, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_reset_every_second_and_a_half_lose_and_repeat_nothing() {
    let (_, calm, _) = read(0, false).await;
    let (got, took, closed) = read(0, true).await;
    eprintln!(
        "three epochs: {:.1} s without faults, {:.1} s with {closed} sockets reset ({:.2}x)",
        calm.as_secs_f64(),
        took.as_secs_f64(),
        took.as_secs_f64() / calm.as_secs_f64()
    );
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    assert!(took.as_secs_f64() <= 1.5 * calm.as_secs_f64(), "{took:?} with faults, {calm:?} without");
    let all = (FILES * LINES) as usize;
    for (epoch, seen) in support::counts(&[&got[0]]).iter().enumerate() {
        let repeats: u32 = seen.values().map(|n| n - 1).sum();
        assert_eq!((seen.len(), repeats), (all, 0), "epoch {epoch}: every record, none twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_keep_equal_counts_and_every_record_once_through_resets() {
    let (got, took, closed) = read(2, true).await;
    eprintln!("two ranks, three epochs: {:.1} s with {closed} sockets reset", took.as_secs_f64());
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    equal_ranks_every_record_once("the job", &got[0], &got[1], (FILES * LINES) as usize);
}

/// Two ranks of one job got the same number of batches in each epoch, and together every one
/// of `all` records once or dropped to keep them equal.
fn equal_ranks_every_record_once(job: &str, a: &[support::Got], b: &[support::Got], all: usize) {
    for (epoch, seen) in support::counts(&[a, b]).iter().enumerate() {
        let (a, b) = (&a[epoch], &b[epoch]);
        assert_eq!(a.batches, b.batches, "{job}, epoch {epoch}: both ranks the same number of batches");
        assert!(seen.values().all(|&n| n == 1), "{job}, epoch {epoch}: a record reached it twice");
        let dropped = (a.dropped_rows + b.dropped_rows) as usize;
        assert_eq!(seen.len() + dropped, all, "{job}, epoch {epoch}: every record reached a rank or was dropped");
    }
}

/// Coordinated ranks under the same resets, through an operator restart and then a resume:
/// an eighth into epoch 1 the dispatcher restarts (the ranks rejoin it while their connections
/// keep being reset); 60 batches into epoch 2 the ranks stop, saving their states, and two new
/// ranks resume the job from them and read on to the end of epoch 3. Each epoch reaches the
/// job exactly once across both runs (yielded, or dropped to keep the ranks equal), each run
/// gives both ranks the same number of batches, and the epochs one run read whole from one
/// dispatcher (0, and 3) line up round by round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinated_ranks_keep_their_guarantees_through_resets_an_operator_restart_and_a_resume() {
    const STOP_AT: usize = 60;
    let support::Restartable { mut dispatcher, url, key, workers: _workers, _dirs } =
        support::restartable(FILES, LINES).await;
    let stop = Arc::new(AtomicBool::new(false));
    let resetter = resetting(worker_ports(&dispatcher.dispatcher, &key).await, port(&url), stop.clone());
    let rank = |r: u32, resume| ClientOptions { coordinated: true, resume, ..support::rank("ddp", 2, r) };

    let read = Arc::new(AtomicUsize::new(0));
    let first: Vec<_> = (0..2)
        .map(|r| tokio::spawn(support::read_until(url.clone(), rank(r, None), 2, Some(STOP_AT), LINES, read.clone())))
        .collect();
    // Both ranks' batches: 400 an epoch.
    let per_epoch = (FILES * LINES / 10) as usize;
    tokio::time::timeout(Duration::from_secs(120), async {
        while read.load(Ordering::Relaxed) < per_epoch + per_epoch / 8 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("epoch 1 never got an eighth through");
    dispatcher.restart().await;
    let mut before = Vec::new();
    for r in first {
        before.push(r.await.expect("a rank failed"));
    }
    for (got, state) in &before {
        assert_eq!((state.epoch, state.batches), (2, STOP_AT as u64), "saved mid epoch 2");
        assert_eq!(got[&2].batches, STOP_AT);
    }

    let second: Vec<_> = before
        .iter()
        .enumerate()
        .map(|(r, (_, state))| {
            let options = rank(r as u32, Some(state.clone()));
            tokio::spawn(support::read_until(url.clone(), options, 3, None, LINES, Arc::default()))
        })
        .collect();
    let mut after = Vec::new();
    for r in second {
        after.push(r.await.expect("a resumed rank failed").0);
    }
    stop.store(true, Ordering::Relaxed);
    let closed = resetter.join().unwrap();
    let jobs = dispatcher.dispatcher.with_state(|st| st.jobs(&key));
    eprintln!("the dispatcher's view: {jobs:?}");
    no_repeats(&jobs);
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");

    let runs = [[&before[0].0, &before[1].0], [&after[0], &after[1]]];
    let all = (FILES * LINES) as usize;
    for epoch in 0..=3u64 {
        let mut seen: std::collections::BTreeMap<i64, u32> = std::collections::BTreeMap::new();
        let mut dropped = 0;
        for [a, b] in &runs {
            let (Some(a), Some(b)) = (a.get(&epoch), b.get(&epoch)) else { continue };
            assert_eq!(a.batches, b.batches, "epoch {epoch}: both ranks the same number of batches in a run");
            for id in a.ids.iter().chain(&b.ids) {
                *seen.entry(*id).or_default() += 1;
            }
            dropped += (a.dropped_rows + b.dropped_rows) as usize;
            let aligned = a.rounds.iter().zip(&b.rounds).take_while(|(x, y)| x == y).count();
            eprintln!("epoch {epoch}: {} batches per rank, {aligned} lined up, {dropped} rows dropped", a.batches);
            if epoch == 0 || epoch == 3 {
                assert!(a.batches - aligned <= 4, "epoch {epoch}: only {aligned} of {} lined up", a.batches);
            }
        }
        let twice = seen.values().filter(|&&n| n > 1).count();
        assert_eq!(twice, 0, "epoch {epoch}: no record twice across the runs");
        assert_eq!(seen.len() + dropped, all, "epoch {epoch}: every record once, or dropped and counted");
    }
}

/// A share group under the same resets, through a leader change: two jobs of one group, one
/// read by a client and one by two coordinated ranks. A quarter into epoch 1 the dispatcher is
/// handed over (a new one, knowing nothing, at once), and a quarter into epoch 2 it is gone for
/// 3 s before the next one starts (a leader that crashed: nobody leads until its lease runs
/// out). Every epoch reaches each job exactly once, the ranks equal, and the jobs still share
/// their productions on the last dispatcher (it knows them only from their clients' rejoins).
/// The same 4000 records in 10 splits: what the jobs held at the last change is made for each
/// again, the rest of the epoch shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_group_keeps_every_epoch_once_for_each_job_through_resets_and_leader_changes() {
    let support::Restartable { mut dispatcher, url, key, workers: _workers, _dirs } =
        support::restartable(GROUP_FILES, GROUP_LINES).await;
    let stop = Arc::new(AtomicBool::new(false));
    let resetter = resetting(worker_ports(&dispatcher.dispatcher, &key).await, port(&url), stop.clone());
    let in_group = |options: ClientOptions| ClientOptions { share: Some("sweep".into()), ..options };
    let solo_read = Arc::new(AtomicUsize::new(0));
    let solo = tokio::spawn(support::consume(
        url.clone(),
        in_group(support::rank("trial-a", 0, 0)),
        EPOCHS,
        GROUP_LINES,
        solo_read.clone(),
    ));
    let ranked_read = Arc::new(AtomicUsize::new(0));
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let options = in_group(ClientOptions { coordinated: true, ..support::rank("trial-b", 2, r) });
            tokio::spawn(support::consume(url.clone(), options, EPOCHS, GROUP_LINES, ranked_read.clone()))
        })
        .collect();
    // 400 batches an epoch per job (the ranks' together).
    let per_epoch = (GROUP_FILES * GROUP_LINES / 10) as usize;
    let both_past = |batches: usize| {
        let (solo_read, ranked_read) = (solo_read.clone(), ranked_read.clone());
        async move {
            let past = |n: &AtomicUsize| n.load(Ordering::Relaxed) >= batches;
            let reading = async {
                while !(past(&solo_read) && past(&ranked_read)) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(120), reading).await.expect("the jobs stopped reading");
        }
    };
    both_past(per_epoch + per_epoch / 4).await;
    dispatcher.restart().await;
    both_past(2 * per_epoch + per_epoch / 4).await;
    dispatcher.stop().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    dispatcher.start_again().await;

    let solo = solo.await.expect("trial-a's client failed");
    let mut ranked = Vec::new();
    for r in ranks {
        ranked.push(r.await.expect("a rank of trial-b failed"));
    }
    stop.store(true, Ordering::Relaxed);
    let closed = resetter.join().unwrap();
    assert!(closed >= 6, "the resets closed {closed} sockets: the faults did not happen");
    let all = (GROUP_FILES * GROUP_LINES) as usize;
    for (epoch, seen) in support::counts(&[&solo]).iter().enumerate() {
        let repeats: u32 = seen.values().map(|n| n - 1).sum();
        assert_eq!((seen.len(), repeats), (all, 0), "trial-a, epoch {epoch}: every record, none twice");
    }
    equal_ranks_every_record_once("trial-b", &ranked[0], &ranked[1], all);
    let jobs = dispatcher.dispatcher.with_state(|st| st.jobs(&key));
    let delivery = dispatcher.dispatcher.with_state(|st| st.delivery_statuses()).remove(&key).unwrap_or_default();
    eprintln!("{closed} sockets reset; the last dispatcher's view: {jobs:?}; {delivery:?}");
    no_repeats(&jobs);
    assert!(delivery.shared_deliveries > delivery.shared_productions, "still shared: {delivery:?}");
}
