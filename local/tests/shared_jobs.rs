//! Shared jobs with real processes: three jobs of one share group (a sweep's trials) read two
//! epochs each from two `stoker-worker`s, two at full speed and one slower. Each gets every
//! record of each of its epochs once, and the workers make about one job's elements, where the
//! same three jobs unshared make three times as many (both runs side by side, the figures
//! printed).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;

const FILES: i64 = 8;
const LINES: i64 = 250;
const EPOCHS: u64 = 2;

/// Reads `EPOCHS` epochs as job `job` (of group `share`), pausing `pause` after each batch:
/// how often each record arrived in each epoch.
async fn read(url: String, job: &str, share: Option<&str>, pause: Duration) -> Vec<BTreeMap<i64, u32>> {
    let mut options = ClientOptions::new("ns", "records");
    options.job = job.into();
    options.share = share.map(Into::into);
    options.prefetch = 4;
    let mut client = Client::from_dispatcher(&url, options).await.unwrap();
    let mut epochs = Vec::new();
    for _ in 0..EPOCHS {
        let epoch = client.epoch();
        let mut seen = BTreeMap::new();
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the caller");
                assert_eq!(batch.epoch, epoch);
                for id in support::ids(&batch) {
                    *seen.entry(id).or_insert(0) += 1;
                }
                tokio::time::sleep(pause).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reading)
            .await
            .unwrap_or_else(|_| panic!("{job}: epoch {epoch} did not end within 120 s"));
        epochs.push(seen);
    }
    client.close(Duration::from_secs(5)).await;
    epochs
}

/// Runs `jobs` (name, pause after each batch) in `share`, or each alone, on two fresh workers:
/// the elements the workers made, and what the share group counted.
async fn sweep(jobs: &[(&'static str, u64)], share: Option<&str>) -> (u64, String) {
    let data = tempfile::tempdir().unwrap();
    let s = support::dispatched(support::padded_records(data.path(), FILES, LINES), Duration::from_secs(3), None).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let readers: Vec<_> = jobs
        .iter()
        .map(|&(job, pause_ms)| {
            let (url, share) = (s.url.clone(), share.map(str::to_owned));
            tokio::spawn(async move { read(url, job, share.as_deref(), Duration::from_millis(pause_ms)).await })
        })
        .collect();
    for (reader, (job, _)) in readers.into_iter().zip(jobs) {
        let epochs = reader.await.unwrap();
        for (epoch, seen) in epochs.iter().enumerate() {
            assert_eq!(seen.len() as i64, FILES * LINES, "{job}: epoch {epoch} lacks records");
            let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
            assert!(twice.is_empty(), "{job}: epoch {epoch} repeats {twice:?}");
        }
    }
    // The workers' last heartbeats (every second) carry what they made.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let progress = s.dispatcher.with_state(|st| st.worker_progress(&s.key));
    let made = progress.iter().map(|(_, _, p)| p.elements).sum();
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap_or_default();
    if share.is_some() {
        // status.delivery says what was shared: more deliveries than productions.
        assert!(delivery.shared_deliveries > delivery.shared_productions, "{delivery:?}");
    } else {
        assert_eq!(delivery.shared_productions, 0);
    }
    let counts = s.dispatcher.with_state(|st| st.share_counts(&s.key));
    let sharing: Vec<_> = progress.into_iter().map(|(_, _, p)| p.sharing).collect();
    s.workers.stop_all().await;
    (made, format!("{counts:?}; workers {sharing:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeps_jobs_each_get_every_epoch_once_from_about_one_jobs_production() {
    // Two trials at full speed, one pausing after each batch.
    let trials = [("trial-a", 0), ("trial-b", 0), ("trial-c", 5)];
    // What one job costs alone, reading ahead into a third epoch as every client does.
    let (alone, _) = sweep(&trials[..1], None).await;
    let (shared, counts) = sweep(&trials, Some("sweep")).await;
    let (unshared, _) = sweep(&trials, None).await;
    eprintln!(
        "elements made for {EPOCHS} epochs of {}: one job alone {alone}; three jobs shared {shared} ({:.2}x one job), \
         unshared {unshared} ({:.2}x); {counts}",
        FILES * LINES,
        shared as f64 / alone as f64,
        unshared as f64 / alone as f64
    );
    assert!(unshared as f64 >= 2.5 * alone as f64, "unshared, each job is made for: {unshared}");
    assert!(
        (shared as f64) < 0.6 * unshared as f64,
        "shared: {shared} elements against {unshared} unshared ({alone} for one job)"
    );
}
