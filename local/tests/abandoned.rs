//! A job all of whose clients left stops being produced: its workers' epoch producers end (no
//! thread, no memory held for it) once no stream has read them for the abandonment time, the
//! splits they held go back to the queue, and a client coming back to the job later reads its
//! epochs to the end.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 4;
const LINES: i64 = 500;

/// Threads of process `pid` producing an epoch of job `job` (named `stoker-job-<job>-<epoch>`).
fn producers(pid: u32, job: &str) -> usize {
    let prefix = format!("stoker-job-{job}-");
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with(&prefix))
                .count()
        })
        .unwrap_or(0)
}

async fn read_epoch(client: &mut Client) -> BTreeSet<i64> {
    let mut seen = BTreeSet::new();
    let read = async {
        while let Some(batch) = client.next_in_epoch().await {
            seen.extend(support::ids(&batch.expect("no error reaches the caller")));
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read).await.expect("the epoch did not end within 60 s");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_left_by_its_clients_stops_on_its_workers_and_a_client_coming_back_reads_it_whole() {
    // SAFETY: set before any thread of this test reads the environment; the worker processes
    // started below inherit it.
    unsafe { std::env::set_var("STOKER_ABANDONED_AFTER_SECONDS", "2") };
    let data = tempfile::tempdir().unwrap();
    let s =
        support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(3), Some(100.0))
            .await;
    s.workers.scale(&s.key, 1).await.unwrap();
    let pid = s.workers.pids(&s.key)[0];
    let mut options = ClientOptions::new("ns", "records");
    options.job = "j".into();
    options.prefetch = 2;

    let mut first = Client::from_dispatcher(&s.url, options.clone()).await.unwrap();
    let mut before = BTreeSet::new();
    for _ in 0..20 {
        before.extend(support::ids(&first.next().await.unwrap().unwrap()));
    }
    assert!(producers(pid, "j") >= 1, "the worker produces epoch 0 (and reads epoch 1 ahead)");
    drop(first);
    let stopped = tokio::time::timeout(Duration::from_secs(30), async {
        while producers(pid, "j") > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(stopped.is_ok(), "the job's producers still run {} s after its client left", 30);
    let jobs = s.dispatcher.with_state(|st| st.jobs(&s.key));
    assert_eq!(jobs[0].in_flight, 0, "nothing stays held by a stopped producer: {:?}", jobs[0]);

    // Back to the job: epoch 0 goes on and ends (with what the first client had, every
    // record), and epoch 1 is whole.
    let mut again = Client::from_dispatcher(&s.url, options).await.unwrap();
    let all: BTreeSet<i64> = (0..FILES * LINES).collect();
    assert_eq!(again.epoch(), 0);
    let rest = read_epoch(&mut again).await;
    assert_eq!(before.union(&rest).copied().collect::<BTreeSet<i64>>(), all, "epoch 0: every record");
    assert_eq!(read_epoch(&mut again).await, all, "epoch 1: every record");
}
