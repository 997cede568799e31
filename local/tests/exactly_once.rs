//! Exactly once with real processes: 4000-record JSONL epochs, two `stoker-worker`s under a
//! dispatcher, read epoch by epoch (`next_in_epoch`); in the second, one worker is killed
//! (SIGKILL), or stopped (SIGTERM), mid-split after the client has some of its rows. Every
//! record reaches the client once per epoch: the dead worker's split is produced again without
//! the rows the client acknowledged.
//! (Before, a similar run delivered 4300 elements for 4000, 300 of them twice.) The same with
//! `echo`: every copy of every record once per epoch.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 4;
const LINES: i64 = 1000;

/// What a read of one epoch saw.
struct Read {
    /// How often each record arrived, and each echo copy of it (0 without echo).
    seen: BTreeMap<(i64, u32), u32>,
    /// The longest the trainer waited for a batch, or for the epoch's end.
    longest_wait: Duration,
}

/// Reads one epoch to its end with `next_in_epoch`, checking every batch is of that epoch and
/// its provenance matches its content. `each_batch` sees the batch count so far.
async fn read_epoch(client: &mut Client, mut each_batch: impl FnMut(usize)) -> Read {
    let epoch = client.epoch();
    let mut seen: BTreeMap<(i64, u32), u32> = BTreeMap::new();
    let mut batches = 0;
    let mut longest_wait = Duration::ZERO;
    let read = async {
        loop {
            let asked = std::time::Instant::now();
            let next = client.next_in_epoch().await;
            longest_wait = longest_wait.max(asked.elapsed());
            let Some(batch) = next else { break };
            let batch = batch.expect("no error reaches the caller");
            assert_eq!(batch.epoch, epoch, "a batch of another epoch inside epoch {epoch}");
            // Record i of file f is position i of split f.
            for ((&row, id), copy) in batch.rows.iter().zip(support::ids(&batch)).zip(batch.echo_copies()) {
                let (split, position) = stoker_api::row_origin(row);
                let element = if batch.echo { stoker_api::echo_copy(position).1 } else { position };
                assert_eq!(id, split as i64 * LINES + i64::from(element), "provenance of {id}");
                *seen.entry((id, copy)).or_insert(0) += 1;
            }
            batches += 1;
            each_batch(batches);
        }
    };
    tokio::time::timeout(Duration::from_secs(90), read)
        .await
        .unwrap_or_else(|_| panic!("epoch {epoch} did not end within 90 s"));
    Read { seen, longest_wait }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_end_cleanly_and_a_worker_killed_mid_split_costs_no_record_and_repeats_none() {
    worker_lost_mid_split(Loss::Killed, 1).await
}

/// With `echo` (factor 2) each row a record's copy: a worker killed mid-split costs no copy
/// and repeats none, the copies it had sent skipped where the split is produced again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_echo_a_worker_killed_mid_split_costs_no_copy_and_repeats_none() {
    worker_lost_mid_split(Loss::Killed, 2).await
}

/// SIGTERM, as a scale-down or a deleted pod gives (the kubelet's SIGKILL follows 2 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_mid_split_costs_no_record_and_repeats_none() {
    worker_lost_mid_split(Loss::Stopped, 1).await
}

/// SIGSTOP for 10 s, then SIGCONT: a worker that stops making progress with its connections
/// up (a node under memory pressure, a long pause, a frozen cgroup), past its 3 s timeout,
/// then wakes in the next epoch and goes on with what it had, its batches of splits since made
/// by the other. The trainer waits no longer than the timeout and the recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_frozen_past_its_timeout_then_thawed_costs_no_record_and_repeats_none() {
    worker_lost_mid_split(Loss::Frozen(Duration::from_secs(10)), 1).await
}

/// A worker slowed to a quarter of its speed for 20 s (stopped 300 ms of every 400, as a node
/// whose cores a neighbour takes): its heartbeats still arrive, so it is never taken for dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_slowed_mid_split_costs_no_record_and_repeats_none() {
    worker_lost_mid_split(Loss::Slowed(Duration::from_secs(20)), 1).await
}

/// How the worker is lost mid-split.
#[derive(Clone, Copy)]
enum Loss {
    Killed,
    Stopped,
    /// Frozen for this long, then thawed.
    Frozen(Duration),
    /// Running a quarter of the time for this long.
    Slowed(Duration),
}

/// Sends `signal` to the worker process `pid`.
fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: a signal to a worker process this test started and still owns.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}

/// `echo`: the pipeline with an `echo` op of this factor at its end (1: none).
async fn worker_lost_mid_split(loss: Loss, echo: u32) {
    let data = tempfile::tempdir().unwrap();
    // 40 batches a second each: an epoch lasts seconds, so both workers are mid-split when
    // their heartbeats (every second) show they delivered.
    let mut pipeline = support::padded_records(data.path(), FILES, LINES);
    if echo > 1 {
        pipeline.data_plane.transforms.push(stoker_api::Transform::Echo(stoker_api::Echo::fixed(echo)));
    }
    let s = support::dispatched(pipeline, Duration::from_secs(3), Some(40.0)).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let mut options = ClientOptions::new("ns", "records");
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    let mut client = Client::from_dispatcher(&s.url, options).await.unwrap();
    let all = (FILES * LINES) as usize * echo as usize;

    assert_eq!(client.epoch(), 0);
    let first = read_epoch(&mut client, |_| {}).await.seen;
    assert_eq!(first.len(), all, "epoch 0: every record");
    assert!(first.keys().all(|&(_, copy)| copy < echo), "copies 0 to {echo} - 1");
    assert!(first.values().all(|&n| n == 1), "epoch 0: none twice");

    // Epoch 1: both workers have delivered (heartbeats say so): kill one. Each worker is
    // producing epoch 1 and, for the client reading ahead, epoch 2, so its unfinished splits
    // are of those two; both must still arrive whole, once.
    assert_eq!(client.epoch(), 1, "the next epoch follows");
    let mut killed = None;
    let thawed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let second = read_epoch(&mut client, |batches| {
        let delivering =
            s.dispatcher.with_state(|st| st.worker_progress(&s.key)).iter().filter(|w| w.2.batches > 0).count();
        if killed.is_none() && batches >= 30 && delivering == 2 {
            killed = match loss {
                Loss::Stopped => {
                    // As the autoscaler scales down, and as the kubelet stops a deleted pod.
                    let scaled = s.workers.scale(&s.key, 1);
                    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(scaled)).ok()
                }
                Loss::Killed => s.workers.kill_one(&s.key).map(|_| ()),
                Loss::Slowed(how_long) => s.workers.pids(&s.key).first().map(|&pid| {
                    std::thread::spawn(move || {
                        let until = std::time::Instant::now() + how_long;
                        while std::time::Instant::now() < until {
                            signal(pid, libc::SIGSTOP);
                            std::thread::sleep(Duration::from_millis(300));
                            signal(pid, libc::SIGCONT);
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    });
                }),
                Loss::Frozen(how_long) => s.workers.pids(&s.key).first().map(|&pid| {
                    signal(pid, libc::SIGSTOP);
                    let thawed = thawed.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(how_long);
                        signal(pid, libc::SIGCONT);
                        thawed.store(true, std::sync::atomic::Ordering::SeqCst);
                    });
                }),
            };
        }
    })
    .await;
    assert!(killed.is_some(), "both workers never delivered, so none was killed");
    let third = read_epoch(&mut client, |_| {}).await;
    let longest_wait = second.longest_wait.max(third.longest_wait);
    eprintln!("the trainer waited at most {longest_wait:?} for a batch after the loss");
    if let Loss::Slowed(_) = loss {
        assert!(longest_wait < Duration::from_secs(7), "the trainer waited {longest_wait:?} for a batch");
    }
    if let Loss::Frozen(_) = loss {
        assert!(thawed.load(std::sync::atomic::Ordering::SeqCst), "the worker was thawed before epoch 2 ended");
        // At most the worker's timeout (3 s) and the recovery, not the freeze: a thawed worker's
        // producer stuck behind batches made before the freeze once held the client's epoch
        // for a minute.
        assert!(longest_wait < Duration::from_secs(7), "the trainer waited {longest_wait:?} for a batch");
        // The thawed worker registered again and is listed (it heartbeats once a second).
        let listed = || s.dispatcher.with_state(|st| st.worker_progress(&s.key)).len();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while listed() < 2 {
            assert!(std::time::Instant::now() < deadline, "the thawed worker is not listed again within 20 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for (epoch, seen) in [(1, &second.seen), (2, &third.seen)] {
        let repeats: u32 = seen.values().map(|n| n - 1).sum();
        assert_eq!((seen.len(), repeats), (all, 0), "epoch {epoch}: every record, none twice");
    }
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    eprintln!("after the kill: dispatcher: {:?}", jobs[0]);
    if let Loss::Slowed(_) = loss {
        // Its heartbeats (every second) came within its timeout (3 s).
        assert_eq!(jobs[0].requeued, 0, "a slowed worker was taken for dead: {:?}", jobs[0]);
    } else {
        assert!(jobs[0].requeued >= 1, "the dead worker's split was produced again: {:?}", jobs[0]);
        assert!(jobs[0].skipped > 0, "the rows the client had were skipped, not produced again: {:?}", jobs[0]);
    }
    // The counters status and metrics show.
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap();
    assert_eq!(delivery.redeliveries_skipped, jobs[0].skipped);
    assert_eq!((delivery.splits_repeated, delivery.recoveries_unacknowledged), (0, 0));
}
