//! Shared jobs with real processes, the sweep of docs/reuse.md: four jobs of one share group
//! read three epochs each from two `stoker-worker`s, with trainers at 1x, 1x, 0.7x and 0.4x
//! speed. The second 1x trial joins when the first starts its second epoch; the 0.4x one is a
//! process of its own, killed with SIGKILL in the middle of its second epoch.
//!
//! Every job gets every record of each epoch it finished once; the fast jobs never pause for
//! the killed one; the copies waiting on the workers stay within their memory budget. The same
//! scenario runs unshared, and the first trial alone: the workers' CPU-seconds and elements of
//! the three runs, and the first trial's wait, are printed side by side (docs/reuse.md records
//! them). A second test has the 0.7x trial stop reading for `STOKER_SWEEP_STOP_S` seconds
//! (default 25) half-way through its second epoch.

mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::Scaler;
use stoker_worker::corpus::{CorpusSpec, generate};
use tokio::sync::watch;

const FILES: i64 = 40;
const LINES: i64 = 50;
/// With `STOKER_SWEEP_DATA=images`: JPEGs of 200-260 px, in 40 splits, cropped to 64 px
/// (`STOKER_SWEEP_IMAGES` and `STOKER_SWEEP_CROP` change both: the benchmark of
/// docs/reuse.md reads epochs many times what the workers hold in flight).
fn images_and_crop() -> (i64, u32) {
    let var = |name: &str, default| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    (var("STOKER_SWEEP_IMAGES", 480) as i64, var("STOKER_SWEEP_CROP", 64) as u32)
}
const EPOCHS: u64 = 3;
/// The fastest trainer's step per batch (of 10 records, or 8 images).
fn step_ms() -> f64 {
    if images() { 20.0 } else { 5.0 }
}
/// The environment variable that makes `child_trainer` a trainer: `url job share step_ms`.
const CHILD: &str = "STOKER_SWEEP_CHILD";
/// What starts the child trainer's lines for the parent.
const MARK: &str = "sweep-trainer:";

/// Whether the sweep reads images (`STOKER_SWEEP_DATA=images`: JPEGs decoded, cropped and
/// flipped, what a sweep's workers spend their time on) or JSONL records (the default: cheap to
/// make, so each job's own batching and sending is most of the workers' time).
fn images() -> bool {
    std::env::var("STOKER_SWEEP_DATA").is_ok_and(|d| d == "images")
}

/// Elements in an epoch.
fn elements() -> i64 {
    if images() { images_and_crop().0 } else { FILES * LINES }
}

/// The sweep's pipeline over data written to `dir`.
fn pipeline(dir: &std::path::Path) -> stoker_api::WorkerPipeline {
    if !images() {
        return support::padded_records(dir, FILES, LINES);
    }
    let (images, crop) = images_and_crop();
    let corpus = CorpusSpec { images: images as usize, classes: 4, min_side: 200, max_side: 260, ..Default::default() };
    generate(dir, &corpus).unwrap();
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: imageFolder}}\ntransforms:\n- decodeImage: {{channels: 3}}\n\
         - randomResizedCrop: {{size: [{crop}, {crop}]}}\n- randomFlip: {{horizontal: true}}\nbatchSize: 8\n\
         shuffle: {{bufferSize: 64, seed: 1}}\n",
        dir.display()
    );
    stoker_api::WorkerPipeline::new("ns", "records", &stoker_api::from_yaml(&manifest).unwrap())
}

/// Each row's identity: the record's id, or for images its provenance (split and position).
fn identities(batch: &stoker_api::Batch) -> Vec<i64> {
    if images() { batch.rows.iter().map(|&r| r as i64).collect() } else { support::ids(batch) }
}

fn stop_for() -> Duration {
    let seconds = std::env::var("STOKER_SWEEP_STOP_S").ok().and_then(|s| s.parse().ok()).unwrap_or(25);
    assert!(seconds > 20, "a stop past what a worker keeps a copy for (20 s)");
    Duration::from_secs(seconds)
}

/// What one trainer saw of one epoch.
#[derive(Debug, Default)]
struct Epoch {
    seen: BTreeMap<i64, u32>,
    /// Time spent waiting for batches, and in all.
    waited: Duration,
    took: Duration,
    /// The longest wait for one batch (the epoch's first excepted: workers start, epochs turn).
    longest: Duration,
}

impl Epoch {
    fn check(&self, job: &str, epoch: usize) {
        assert_eq!(self.seen.len() as i64, elements(), "{job}: epoch {epoch} lacks records");
        let twice: Vec<_> = self.seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "{job}: epoch {epoch} repeats {twice:?}");
    }
}

/// A trainer's plan: its step per batch, and where it stops reading for a while.
#[derive(Clone, Copy)]
struct Trainer {
    step: Duration,
    /// Stop for this long half-way through epoch 1.
    stop: Option<Duration>,
}

fn options(job: &str, share: Option<&str>) -> ClientOptions {
    let mut options = ClientOptions::new("ns", "records");
    options.job = job.into();
    options.share = share.map(Into::into);
    options.prefetch = 4;
    // The trials stop after their last epoch: no worker makes the one after it for them.
    options.epochs = Some(EPOCHS);
    options
}

/// What a trainer tells whoever watches it.
enum Event<'a> {
    /// Half-way through its second epoch (once per batch from there on).
    Half,
    Ended(&'a Epoch),
}

/// Reads `EPOCHS` epochs as `job`; `epochs` hears of each epoch begun, `tell` of the events.
async fn train(
    url: &str,
    job: &str,
    share: Option<&str>,
    mut trainer: Trainer,
    epochs: &watch::Sender<u64>,
    mut tell: impl FnMut(Event),
) -> Vec<Epoch> {
    let mut client = Client::from_dispatcher(url, options(job, share)).await.unwrap();
    let mut got = Vec::new();
    for index in 0..EPOCHS {
        let epoch = client.epoch();
        epochs.send_replace(epoch);
        let mut e = Epoch::default();
        let started = Instant::now();
        let limit = Duration::from_secs(180) + trainer.stop.unwrap_or_default();
        let reading = async {
            let mut first = true;
            loop {
                let asked = Instant::now();
                let Some(batch) = client.next_in_epoch().await else { break };
                let waited = asked.elapsed();
                e.waited += waited;
                if !first {
                    e.longest = e.longest.max(waited);
                }
                first = false;
                let batch = batch.expect("no error reaches the caller");
                assert_eq!(batch.epoch, epoch);
                for id in identities(&batch) {
                    *e.seen.entry(id).or_insert(0) += 1;
                }
                if index == 1 && e.seen.len() as i64 >= elements() / 2 {
                    tell(Event::Half);
                    if let Some(stop) = trainer.stop.take() {
                        tokio::time::sleep(stop).await;
                    }
                }
                tokio::time::sleep(trainer.step).await;
            }
        };
        tokio::time::timeout(limit, reading).await.unwrap_or_else(|_| panic!("{job}: epoch {epoch} did not end"));
        e.took = started.elapsed();
        tell(Event::Ended(&e));
        got.push(e);
    }
    client.close(Duration::from_secs(5)).await;
    got
}

/// The trainer in a process of its own (this test binary run again), so that killing it is a
/// crash: no goodbye reaches the dispatcher. It prints `half` half-way through epoch 1 and
/// `epoch N records R repeats P` at the end of each epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "not a test: the trainer process the sweep starts (with STOKER_SWEEP_CHILD set)"]
async fn child_trainer() {
    let args = std::env::var(CHILD).expect("started by the sweep, which sets STOKER_SWEEP_CHILD");
    let args: Vec<&str> = args.split(' ').collect();
    let [url, job, share, step_ms] = args[..] else { panic!("{CHILD}={args:?}") };
    let share = (share != "-").then_some(share);
    let step = Duration::from_secs_f64(step_ms.parse::<f64>().unwrap() / 1e3);
    let (epochs, _) = watch::channel(0);
    let (mut said, mut ended) = (false, 0);
    let tell = |event: Event| match event {
        Event::Half if !std::mem::replace(&mut said, true) => println!("{MARK} half"),
        Event::Half => {}
        Event::Ended(e) => {
            let repeats: u32 = e.seen.values().map(|n| n - 1).sum();
            println!("{MARK} epoch {ended} records {} repeats {repeats}", e.seen.len());
            ended += 1;
        }
    };
    train(url, job, share, Trainer { step, stop: None }, &epochs, tell).await;
}

/// Runs the child trainer as `job` and kills it (SIGKILL) once it is half-way through epoch 1;
/// returns its lines.
fn killed_trainer(url: &str, job: &str, share: Option<&str>, step: Duration) -> Vec<String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_trainer", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{url} {job} {} {}", share.unwrap_or("-"), step.as_secs_f64() * 1e3))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        // The test harness's own words come first on a line ("test child_trainer ... ").
        let line = line.unwrap();
        let Some(said) = line.split_once(MARK).map(|(_, said)| said.trim().to_string()) else { continue };
        let half = said == "half";
        lines.push(said);
        if half {
            child.kill().unwrap();
            break;
        }
    }
    child.wait().unwrap();
    lines
}

/// What one run of the scenario cost and what its first trial waited.
struct Run {
    cpu_seconds: f64,
    elements: u64,
    /// The first trial's time waiting for data over its time in all.
    wait: f64,
    seconds: f64,
    delivery: stoker_api::DeliveryStatus,
    /// The most the workers held in copies for slower jobs, at one heartbeat.
    kept_most: u64,
    /// The most resident memory of the fuller worker.
    peak_rss: u64,
}

/// One sweep at a time: each measures CPU-seconds and waits, and two at once on a 2-core
/// machine measure each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The sweep: trial-a alone (`all` false) or all four trials, in `share` or unshared, on two
/// fresh workers; trial-c stops for `stop` half-way through its second epoch.
async fn sweep(all: bool, share: Option<&'static str>, stop: Option<Duration>) -> Run {
    let _alone = ONE_AT_A_TIME.lock().await;
    let data = tempfile::tempdir().unwrap();
    let s = support::dispatched(pipeline(data.path()), Duration::from_secs(3), None).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let started = Instant::now();
    let step = |speed: f64| Duration::from_secs_f64(step_ms() / speed / 1e3);
    let (a_epochs, mut a_began) = watch::channel(0);
    let url = Arc::new(s.url.clone());
    let spawn = |job: &'static str, trainer: Trainer| {
        let url = url.clone();
        let (epochs, _) = watch::channel(0);
        let epochs = if job == "trial-a" { a_epochs.clone() } else { epochs };
        tokio::spawn(async move { train(&url, job, share, trainer, &epochs, |_| {}).await })
    };
    let mut trainers = vec![("trial-a", spawn("trial-a", Trainer { step: step(1.0), stop: None }))];
    let mut killed = None;
    let mut kept_most = 0u64;
    if all {
        trainers.push(("trial-c", spawn("trial-c", Trainer { step: step(0.7), stop })));
        let (url, slow) = (s.url.clone(), step(0.4));
        killed = Some(tokio::task::spawn_blocking(move || killed_trainer(&url, "trial-d", share, slow)));
        // trial-b joins when trial-a begins its second epoch.
        a_began.wait_for(|e| *e >= 1).await.unwrap();
        trainers.push(("trial-b", spawn("trial-b", Trainer { step: step(1.0), stop: None })));
        if share.is_some() {
            // The group in status: every job with its group (the killed one until its clients
            // expire).
            let listed = loop {
                let jobs = s.dispatcher.with_state(|st| st.job_statuses()).remove(&s.key).unwrap_or_default();
                if jobs.len() == 4 || started.elapsed() > Duration::from_secs(30) {
                    break jobs;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let names: Vec<_> =
                listed.iter().map(|j| (j.name.as_str(), j.share.as_ref().map(|s| s.as_str()))).collect();
            let group = Some("sweep");
            assert_eq!(names, [("trial-a", group), ("trial-b", group), ("trial-c", group), ("trial-d", group)]);
        }
    }
    let mut first = None;
    for (job, trainer) in trainers {
        let mut finishing = std::pin::pin!(trainer);
        // While the trainers run, the copies kept for slower jobs stay within the workers'
        // budgets.
        let epochs = loop {
            tokio::select! {
                done = &mut finishing => break done.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    let progress = s.dispatcher.with_state(|st| st.worker_progress(&s.key));
                    for (_, _, p) in progress {
                        kept_most = kept_most.max(p.sharing.kept_bytes);
                        assert!(p.sharing.kept_bytes <= support::worker_budget() as u64, "{}", p.sharing.kept_bytes);
                    }
                }
            }
        };
        for (epoch, e) in epochs.iter().enumerate() {
            e.check(job, epoch);
        }
        if job != "trial-c" {
            // The fast trials never pause for the stopped or the killed one.
            let longest = epochs.iter().map(|e| e.longest).max().unwrap();
            assert!(longest < Duration::from_secs(4), "{job} waited {longest:?} for a batch");
        }
        first.get_or_insert(epochs);
    }
    if let Some(killed) = killed {
        let lines = killed.await.unwrap();
        let expected = format!("epoch 0 records {} repeats 0", elements());
        assert_eq!(lines, [expected, "half".to_string()], "the killed trial: half-way through epoch 1 after epoch 0");
    }
    // The workers' last heartbeats (every second) carry what they made.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let progress = s.dispatcher.with_state(|st| st.worker_progress(&s.key));
    let elements = progress.iter().map(|(_, _, p)| p.elements).sum();
    let cpu_seconds = support::cpu_seconds_of(&s.workers.pids(&s.key));
    let peak_rss = s.workers.pids(&s.key).into_iter().map(support::peak_rss).max().unwrap_or(0);
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap_or_default();
    if share.is_some() {
        assert!(delivery.shared_deliveries > delivery.shared_productions, "{delivery:?}");
    } else {
        assert_eq!(delivery.shared_productions, 0);
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "{}: {elements} elements, {cpu_seconds:.1} CPU-s in {seconds:.1} s; most kept {kept_most} B; \
         worker peak RSS {} MiB; {delivery:?}",
        match (all, share, stop) {
            (false, _, _) => "trial-a alone",
            (true, Some(_), None) => "four trials shared",
            (true, Some(_), Some(_)) => "four trials shared, trial-c stopping",
            (true, None, _) => "four trials unshared",
        },
        peak_rss >> 20
    );
    s.workers.stop_all().await;
    let a = first.unwrap();
    let (waited, took) = a.iter().fold((0.0, 0.0), |(w, t), e| (w + e.waited.as_secs_f64(), t + e.took.as_secs_f64()));
    Run { cpu_seconds, elements, wait: waited / took, seconds, delivery, kept_most, peak_rss }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeps_trials_each_get_every_epoch_once_from_about_one_jobs_production() {
    let alone = sweep(false, None, None).await;
    // Declaring its epochs, the trial has nothing made past its last (it had most of an epoch).
    assert!(alone.elements <= EPOCHS * elements() as u64, "alone: {} elements made", alone.elements);
    let shared = sweep(true, Some("sweep"), None).await;
    let unshared = sweep(true, None, None).await;
    let ratio = |r: &Run| r.cpu_seconds / alone.cpu_seconds;
    eprintln!(
        "{EPOCHS} epochs of {} {}, trainers 1x 1x 0.7x 0.4x: worker CPU-seconds alone {:.1}, shared {:.1} \
         ({:.2}x), unshared {:.1} ({:.2}x); elements {} / {} / {}; trial-a waited {:.1}% alone, {:.1}% shared, \
         {:.1}% unshared; runs of {:.0} / {:.0} / {:.0} s; worker peak RSS {} / {} / {} MiB",
        elements(),
        if images() { "images" } else { "records" },
        alone.cpu_seconds,
        shared.cpu_seconds,
        ratio(&shared),
        unshared.cpu_seconds,
        ratio(&unshared),
        alone.elements,
        shared.elements,
        unshared.elements,
        100.0 * alone.wait,
        100.0 * shared.wait,
        100.0 * unshared.wait,
        alone.seconds,
        shared.seconds,
        unshared.seconds,
        alone.peak_rss >> 20,
        shared.peak_rss >> 20,
        unshared.peak_rss >> 20,
    );
    assert!(unshared.elements as f64 >= 2.5 * alone.elements as f64, "unshared, each job is made for");
    assert!(
        (shared.elements as f64) < 0.7 * unshared.elements as f64,
        "shared: {} elements against {} unshared ({} for one job)",
        shared.elements,
        unshared.elements,
        alone.elements
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trial_that_stops_reading_gets_the_rest_of_its_epoch_and_holds_nobody_up() {
    // `sweep` checks that trial-c's epochs are whole (the rest of its second epoch made for it
    // after it went on: the others were done by then, and a copy kept for it longer than a
    // worker keeps one was made again), that the others never paused, and that the copies
    // stayed within the workers' budgets.
    let stop = stop_for();
    let run = sweep(true, Some("sweep"), Some(stop)).await;
    eprintln!(
        "trial-c stopped {stop:?}: copies kept at most {} B, trial-a waited {:.1}%; {:?}",
        run.kept_most,
        100.0 * run.wait,
        run.delivery
    );
}

/// A worker killed with SIGKILL while a group of two trials reads (the 1x one half-way through
/// its second epoch): what it held, its own splits and the group's productions it was making,
/// is made again on the other worker, and both trials get every element of every epoch once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_a_group_reads_loses_and_repeats_nothing() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let data = tempfile::tempdir().unwrap();
    let s = support::dispatched(pipeline(data.path()), Duration::from_secs(3), None).await;
    s.workers.scale(&s.key, 2).await.unwrap();
    let step = |speed: f64| Duration::from_secs_f64(step_ms() / speed / 1e3);
    let killed = std::cell::Cell::new(None);
    let kill = |event: Event| {
        if matches!(event, Event::Half) && killed.get().is_none() {
            killed.set(Some(s.workers.kill_one(&s.key).expect("a worker to kill")));
        }
    };
    let share = Some("sweep");
    let (a_epochs, b_epochs) = (watch::channel(0).0, watch::channel(0).0);
    let (a, b) = tokio::join!(
        train(&s.url, "trial-a", share, Trainer { step: step(1.0), stop: None }, &a_epochs, kill),
        train(&s.url, "trial-b", share, Trainer { step: step(0.7), stop: None }, &b_epochs, |_| {}),
    );
    let pid = killed.get().expect("a worker was killed half-way through trial-a's second epoch");
    for (job, epochs) in [("trial-a", &a), ("trial-b", &b)] {
        assert_eq!(epochs.len() as u64, EPOCHS);
        for (epoch, e) in epochs.iter().enumerate() {
            e.check(job, epoch);
        }
    }
    // The kill was real: the dispatcher drops the dead worker (its timeout is 3 s here).
    let since = Instant::now();
    while s.dispatcher.with_state(|st| st.worker_progress(&s.key)).len() != 1 {
        assert!(since.elapsed() < Duration::from_secs(15), "the dispatcher still lists the killed worker {pid}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let delivery = s.dispatcher.with_state(|st| st.delivery_statuses()).remove(&s.key).unwrap_or_default();
    assert!(delivery.shared_deliveries > delivery.shared_productions, "still shared: {delivery:?}");
    // No split reported done twice. It was, in 5 of 140 runs, every element still once: the
    // slower trial's client acknowledged a split once for the dead worker's last batch, still
    // in its queue, and again for the empty production of the rows it held (all of them).
    assert_eq!(delivery.splits_repeated, 0, "{delivery:?}");
    eprintln!("worker {pid} killed: {delivery:?}");
    s.workers.stop_all().await;
}
