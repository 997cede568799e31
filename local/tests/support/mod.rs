//! What the real-process tests share: a dispatcher on loopback and one pipeline's
//! `stoker-worker` processes attached to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[allow(dead_code)] // not every test uses it
pub mod resets;

use stoker_api::{Batch, WorkerPipeline};
use stoker_client::{Client, ClientOptions};
use stoker_local::workers::{LocalWorkerConfig, LocalWorkers, worker_binary};
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};
use stoker_operator::key::PipelineKey;

#[allow(dead_code)] // not every test uses it
pub struct Dispatched {
    pub dispatcher: Arc<Dispatcher>,
    pub workers: LocalWorkers,
    pub key: PipelineKey,
    pub url: String,
    _logs: tempfile::TempDir,
}

#[allow(dead_code)]
impl Dispatched {
    /// What the pipeline's workers reported last: warnings and the mix's shares.
    pub fn report(&self) -> stoker_api::WorkersReport {
        self.dispatcher.with_state(|s| s.reports()).remove(&self.key).unwrap_or_default()
    }

    /// Each worker's /metrics text, found where its log says it serves them.
    pub async fn scrape_workers(&self) -> Vec<String> {
        let mut texts = Vec::new();
        for log in std::fs::read_dir(self._logs.path()).unwrap() {
            let log = std::fs::read_to_string(log.unwrap().path()).unwrap();
            // The address follows `metrics=` on the line that says /metrics is served, once
            // the log's colours are taken out.
            let Some(line) = log.lines().find(|l| l.contains("serving /metrics")) else { continue };
            let plain = without_colours(line);
            let addr = plain.split("metrics=").nth(1).and_then(|a| a.split_whitespace().next()).unwrap_or_default();
            let addr = addr.parse().unwrap_or_else(|e| panic!("{addr:?} in {plain:?}: {e}"));
            texts.push(stoker_worker::metrics::scrape(addr).await.unwrap());
        }
        texts
    }
}

/// `line` without its ANSI colour sequences (ESC [ ... m).
fn without_colours(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The sum over `texts` of the series `name` with exactly the pipeline's labels.
#[allow(dead_code)]
pub fn metric_sum(texts: &[String], name: &str, key: &PipelineKey) -> f64 {
    // Every series of `name` with the pipeline's labels, whatever others it has (the text
    // format sorts labels by name).
    let (namespace, pipeline) = (format!(r#"namespace="{}""#, key.namespace), format!(r#"pipeline="{}""#, key.name));
    let prefix = format!("{name}{{");
    let values = texts.iter().flat_map(|t| t.lines()).filter_map(|l| {
        let (series, value) = l.strip_prefix(&prefix)?.rsplit_once("} ")?;
        let labels: Vec<&str> = series.split(',').collect();
        (labels.contains(&namespace.as_str()) && labels.contains(&pipeline.as_str()))
            .then(|| value.parse::<f64>().ok())?
    });
    values.sum()
}

/// A dispatcher declaring workers dead after `worker_timeout`, and `pipeline`'s workers
/// (one transform thread each, each sending at most `max_batch_rate` batches a second, none
/// started yet: scale them).
#[allow(dead_code)]
pub async fn dispatched(pipeline: WorkerPipeline, worker_timeout: Duration, max_batch_rate: Option<f64>) -> Dispatched {
    let dispatcher = Dispatcher::new(
        Timeouts { worker: worker_timeout, client: Duration::from_secs(30) },
        Duration::from_millis(500),
    );
    dispatcher.spawn_expiry();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(dispatcher::serve(listener, dispatcher.clone(), None, std::future::pending()));
    // Not in the data directory: the logs would become shards of the source.
    let logs = tempfile::tempdir().unwrap();
    let workers = workers(&url, max_batch_rate, &kept_logs(logs.path()));
    let key = PipelineKey::new(&pipeline.namespace, &pipeline.name);
    workers.add(pipeline, None, None);
    Dispatched { dispatcher, workers, key, url, _logs: logs }
}

/// A dispatcher on its own runtime, so that it can be restarted as a process would be: every
/// connection and task of the old one ends and a new one, knowing nothing, serves the same
/// address.
#[allow(dead_code)] // not every test uses it
pub struct RestartableDispatcher {
    runtime: Option<tokio::runtime::Runtime>,
    pub dispatcher: Arc<Dispatcher>,
    pub addr: std::net::SocketAddr,
    timeouts: Timeouts,
}

#[allow(dead_code)]
impl RestartableDispatcher {
    pub async fn start(addr: std::net::SocketAddr, timeouts: Timeouts) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let window = timeouts.clone();
        let started = runtime.spawn(async move {
            let dispatcher = Dispatcher::new(window, Duration::from_millis(500));
            dispatcher.spawn_expiry();
            // The old one's socket may take a moment to go.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let listener = loop {
                match tokio::net::TcpListener::bind(addr).await {
                    Ok(l) => break l,
                    Err(e) if tokio::time::Instant::now() < deadline => {
                        eprintln!("binding {addr}: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("binding {addr}: {e}"),
                }
            };
            let addr = listener.local_addr().unwrap();
            tokio::spawn(dispatcher::serve(listener, dispatcher.clone(), None, std::future::pending()));
            (dispatcher, addr)
        });
        let (dispatcher, addr) = started.await.unwrap();
        RestartableDispatcher { runtime: Some(runtime), dispatcher, addr, timeouts }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops every task and connection of the dispatcher and starts a new one on its address.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.start_again().await;
    }

    /// Stops every task and connection of the dispatcher: its address refuses connections
    /// until `start_again` (a crashed leader, until the next one leads).
    pub async fn stop(&mut self) {
        let runtime = self.runtime.take().expect("running");
        tokio::task::spawn_blocking(move || runtime.shutdown_timeout(Duration::from_secs(5))).await.unwrap();
    }

    /// A new dispatcher, knowing nothing, on the stopped one's address.
    pub async fn start_again(&mut self) {
        *self = RestartableDispatcher::start(self.addr, self.timeouts.clone()).await;
    }
}

impl Drop for RestartableDispatcher {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A restartable dispatcher and two worker processes of [`padded_records`], each at 40
/// batches a second per job: an epoch of a few thousand records lasts seconds, so a fault
/// lands where it is aimed.
#[allow(dead_code)] // not every test uses it
pub struct Restartable {
    pub dispatcher: RestartableDispatcher,
    pub url: String,
    pub key: PipelineKey,
    pub workers: LocalWorkers,
    pub _dirs: (tempfile::TempDir, tempfile::TempDir),
}

#[allow(dead_code)]
pub async fn restartable(files: i64, lines: i64) -> Restartable {
    let (data, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let timeouts = Timeouts { worker: Duration::from_secs(3), client: Duration::from_secs(30) };
    let dispatcher = RestartableDispatcher::start("127.0.0.1:0".parse().unwrap(), timeouts).await;
    let url = dispatcher.url();
    let pipeline = padded_records(data.path(), files, lines);
    let key = PipelineKey::new(&pipeline.namespace, &pipeline.name);
    let workers = workers(&url, Some(40.0), &kept_logs(logs.path()));
    workers.add(pipeline, None, None);
    stoker_operator::autoscaling::Scaler::scale(&workers, &key, 2).await.unwrap();
    Restartable { dispatcher, url, key, workers, _dirs: (data, logs) }
}

/// Where a test's logs go: a directory named after the test under `$STOKER_TEST_LOGS` when
/// set (then the tracing of every test in the process goes to `test.log` there too, filtered
/// by `RUST_LOG`, and the directory stays after the test, for chasing a failure that comes
/// once in many runs), else `default`.
#[allow(dead_code)]
pub fn kept_logs(default: &std::path::Path) -> std::path::PathBuf {
    let Some(root) = std::env::var_os("STOKER_TEST_LOGS").map(std::path::PathBuf::from) else {
        return default.to_path_buf();
    };
    // The test harness names each test's thread after the test.
    let test = std::thread::current().name().unwrap_or("test").replace("::", "-");
    // A test that runs several scenarios keeps each one's logs: the second gets `<test>-2`.
    let dir = (1..)
        .map(|n| if n == 1 { root.join(&test) } else { root.join(format!("{test}-{n}")) })
        .find(|dir| std::fs::create_dir(dir).is_ok())
        .unwrap();
    let file = std::fs::OpenOptions::new().create(true).append(true).open(root.join("test.log")).unwrap();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .try_init();
    dir
}

/// `stoker-worker corpus`: `images` generated JPEGs in 4 class folders under `dir`.
#[allow(dead_code)]
pub fn image_corpus(dir: &std::path::Path, images: usize) {
    let status = std::process::Command::new(worker_binary())
        .args(["corpus", "--images", &images.to_string(), "--classes", "4", "--out"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "generating the corpus failed");
}

/// The workers' memory budget: 64 MiB, or `STOKER_TEST_WORKER_BUDGET_MIB` (benchmarks run
/// them at a deployment's size).
pub fn worker_budget() -> usize {
    std::env::var("STOKER_TEST_WORKER_BUDGET_MIB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(64) << 20
}

/// `pipeline`'s workers (none started yet) attached to the dispatcher at `url`.
#[allow(dead_code)]
pub fn workers(url: &str, max_batch_rate: Option<f64>, logs: &std::path::Path) -> LocalWorkers {
    let binary = worker_binary();
    assert!(binary.is_file(), "{} is missing: run `cargo build --workspace --bins` first", binary.display());
    LocalWorkers::new(LocalWorkerConfig {
        binary,
        dispatcher_url: url.to_string(),
        threads: 1,
        memory_budget: worker_budget(),
        max_batch_rate,
        log_dir: Some(logs.to_path_buf()),
        cache_dir: None,
        tls: None,
    })
}

/// `files` JSONL files of `lines` records each, `{"id": n, "pad": [...]}` with ids 0.. in file
/// order, as a pipeline of batches of 10 with a seeded shuffle. The padding makes a batch
/// (~25 KB) a good part of a client's flow-control window, so a worker cannot run far ahead of
/// what its clients have read: killed, it still holds some of its split, and they the rest.
#[allow(dead_code)] // not every test uses it
pub fn padded_records(dir: &std::path::Path, files: i64, lines: i64) -> WorkerPipeline {
    let pad = vec!["0.5"; 500].join(",");
    for file in 0..files {
        let records: String =
            (0..lines).map(|i| format!("{{\"id\": {}, \"pad\": [{pad}]}}\n", file * lines + i)).collect();
        std::fs::write(dir.join(format!("{file}.jsonl")), records).unwrap();
    }
    let manifest = format!(
        "source: {{uri: 'file://{}/', format: jsonl}}\nbatchSize: 10\nshuffle: {{bufferSize: 64, seed: 1}}\n",
        dir.display()
    );
    WorkerPipeline::new("ns", "records", &stoker_api::from_yaml(&manifest).unwrap())
}

/// The `id`s of a batch of [`padded_records`].
#[allow(dead_code)]
pub fn ids(batch: &Batch) -> Vec<i64> {
    batch.tensors["id"].data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// What a consumer got of each epoch: its batches, the records in them, and in coordinated
/// mode the round of each batch.
#[allow(dead_code)]
#[derive(Debug, Default)]
pub struct Got {
    pub batches: usize,
    pub ids: Vec<i64>,
    pub dropped_rows: u64,
    pub rounds: Vec<Option<stoker_api::proto::RoundRef>>,
}

/// How often each record reached a job in each epoch, over its consumers (what [`consume`]
/// returned for each).
#[allow(dead_code)]
pub fn counts<Consumer: AsRef<[Got]>>(consumers: &[Consumer]) -> Vec<std::collections::BTreeMap<i64, u32>> {
    (0..consumers[0].as_ref().len())
        .map(|epoch| {
            let mut seen = std::collections::BTreeMap::new();
            for got in consumers {
                for id in &got.as_ref()[epoch].ids {
                    *seen.entry(*id).or_default() += 1;
                }
            }
            seen
        })
        .collect()
}

/// A client of [`padded_records`] reading `job` as rank `rank` of `consumers` (0: shared),
/// with little read ahead.
#[allow(dead_code)]
pub fn rank(job: &str, consumers: u32, rank: u32) -> ClientOptions {
    let mut options = ClientOptions::new("ns", "records");
    options.job = job.into();
    options.consumers = consumers;
    options.consumer_index = rank;
    options.prefetch = 2;
    options.stream_window_bytes = 64 << 10;
    options
}

/// Reads `epochs` epochs of [`padded_records`] with `lines` records a file from epoch 0,
/// checking each row's provenance; counts batches in `read`.
#[allow(dead_code)] // not every test uses it
pub async fn consume(url: String, options: ClientOptions, epochs: u64, lines: i64, read: Arc<AtomicUsize>) -> Vec<Got> {
    let job = options.job.clone();
    let (got, _) = read_until(url, options, epochs - 1, None, lines, read).await;
    assert!(got.keys().copied().eq(0..epochs), "{job}: read epochs {:?}", got.keys());
    got.into_values().collect()
}

/// Reads [`padded_records`] with `lines` records a file from the epoch the client starts at
/// (0, or the one its resume state was saved in) until epoch `last` has ended, or, with
/// `stop_after`, until that many batches of epoch `last`; checks each row's provenance and
/// counts batches in `read`. What it got of each epoch, and its state at the end.
#[allow(dead_code)] // not every test uses it
pub async fn read_until(
    url: String,
    options: ClientOptions,
    last: u64,
    stop_after: Option<usize>,
    lines: i64,
    read: Arc<AtomicUsize>,
) -> (std::collections::BTreeMap<u64, Got>, stoker_client::ResumeState) {
    let (job, rank) = (options.job.clone(), options.consumer_index);
    let mut client = Client::from_dispatcher(&url, options).await.unwrap();
    let mut got_epochs = std::collections::BTreeMap::new();
    while client.epoch() <= last {
        let epoch = client.epoch();
        let dropped_before = client.dropped_rows();
        let mut got = Got::default();
        let reading = async {
            while let Some(batch) = client.next_in_epoch().await {
                let batch = batch.expect("no error reaches the caller");
                assert_eq!(batch.epoch, epoch);
                for (&row, id) in batch.rows.iter().zip(ids(&batch)) {
                    let (split, position) = stoker_api::row_origin(row);
                    assert_eq!(id, split as i64 * lines + i64::from(position), "provenance of {id}");
                }
                got.ids.extend(ids(&batch));
                got.rounds.push(batch.round.clone());
                got.batches += 1;
                read.fetch_add(1, Ordering::Relaxed);
                if epoch == last && stop_after == Some(got.batches) {
                    return true;
                }
            }
            false
        };
        let stopped = tokio::time::timeout(Duration::from_secs(120), reading)
            .await
            .unwrap_or_else(|_| panic!("{job} rank {rank}: epoch {epoch} did not end within 120 s"));
        got.dropped_rows = client.dropped_rows() - dropped_before;
        got_epochs.insert(epoch, got);
        if stopped {
            break;
        }
    }
    (got_epochs, client.state().expect("dispatcher mode has a state"))
}

/// The most resident memory process `pid` has had, in bytes (`VmHWM`).
#[allow(dead_code)] // not every test uses it
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap().trim().trim_end_matches(" kB");
    kib.trim().parse::<u64>().unwrap() << 10
}

/// The CPU-seconds every process of the machine has used since it booted (`/proc/stat`).
#[allow(dead_code)] // not every test uses it
pub fn machine_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let all = stat.lines().next().unwrap().strip_prefix("cpu ").unwrap();
    // user nice system idle iowait irq softirq steal: everything but idle and iowait.
    let ticks: Vec<f64> = all.split_whitespace().map(|t| t.parse().unwrap()).collect();
    let busy: f64 = ticks[..8].iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    seconds_of_ticks(busy)
}

/// Clock ticks (`/proc`'s unit of CPU time) in seconds.
fn seconds_of_ticks(ticks: f64) -> f64 {
    // SAFETY: sysconf only reads a system constant.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// The CPU-seconds the processes `pids` have used, together.
#[allow(dead_code)] // not every test uses it
pub fn cpu_seconds_of(pids: &[u32]) -> f64 {
    pids.iter().copied().map(cpu_seconds).sum()
}

/// The CPU-seconds (user and system) process `pid` has used.
#[allow(dead_code)] // not every test uses it
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    seconds_of_ticks(ticks)
}
