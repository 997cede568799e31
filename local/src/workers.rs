//! The local-processes scaler: runs a pipeline's workers as `stoker-worker` child processes
//! attached to the dispatcher, for `stoker local`, the demo and tests.
//!
//! No worker outlives this process, however it ends:
//! - killed outright (SIGKILL, a crash): each worker is started by [`crate::children`], with
//!   `PR_SET_PDEATHSIG(SIGKILL)` from a thread that lives as long as the process.
//! - stopped (SIGTERM to `stoker local`, the end of a test): [`LocalWorkers::stop_all`] stops
//!   scaling up, terminates every worker and waits for it, killing what outlasts the grace.
//! - dropped: a [`Worker`] kills its process on drop.
//!
//! Each worker runs in a process group of its own, signalled as a group, so a Ctrl-C in the
//! terminal reaches only `stoker local` (which then stops the workers in order) and anything a
//! worker might start goes with it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use stoker_api::children::spawn_tied;

use anyhow::Context as _;
use stoker_api::WorkerPipeline;

use stoker_operator::autoscaling::Scaler;
use stoker_operator::key::PipelineKey;

use crate::tls::WorkerTlsFiles;

#[derive(Clone, Debug)]
pub struct LocalWorkerConfig {
    pub binary: PathBuf,
    pub dispatcher_url: String,
    /// Transform threads per worker: one makes a worker's rate a known unit of capacity.
    pub threads: usize,
    pub memory_budget: usize,
    /// Caps each worker's batches per second (`--max-batch-rate`), unless its pipeline was
    /// added with a cap of its own.
    pub max_batch_rate: Option<f64>,
    /// Where each worker's log goes (`<dir>/<pipeline>-<n>.log`); inherited stderr when None.
    pub log_dir: Option<PathBuf>,
    /// The directory standing in for the namespace's cache volume; no caching when None.
    pub cache_dir: Option<PathBuf>,
    /// Workers serve TLS with this certificate and verify the dispatcher with its CA.
    pub tls: Option<WorkerTlsFiles>,
}

impl LocalWorkerConfig {
    /// One-thread workers capped at `rate` batches a second, logging into `logs`: capacity in
    /// known units on a small machine (the demo, the policy comparison).
    pub fn rate_capped(rate: f64, logs: PathBuf) -> Self {
        LocalWorkerConfig {
            binary: worker_binary(),
            dispatcher_url: String::new(),
            threads: 1,
            memory_budget: 64 << 20,
            max_batch_rate: Some(rate),
            log_dir: Some(logs),
            cache_dir: None,
            tls: None,
        }
    }
}

/// The `stoker-worker` next to this executable (cargo puts them side by side), else on PATH.
/// STOKER_WORKER_BIN overrides both.
pub fn worker_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("STOKER_WORKER_BIN") {
        return path.into();
    }
    if let Ok(exe) = std::env::current_exe() {
        // target/debug/stoker, or target/debug/deps/<test> for integration tests.
        for dir in exe.ancestors().skip(1).take(2) {
            let candidate = dir.join("stoker-worker");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("stoker-worker")
}

/// How long a stopping worker gets between SIGTERM and SIGKILL: enough to hand back what it
/// holds (its own grace after SIGTERM is shorter).
const GRACE: Duration = Duration::from_secs(10);

/// A worker process, in its own process group; killed (the group) and reaped on drop.
pub struct Worker {
    child: Child,
    exited: bool,
}

impl Worker {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn running(&mut self) -> bool {
        if !self.exited {
            self.exited = !matches!(self.child.try_wait(), Ok(None));
        }
        !self.exited
    }

    /// Signals the worker's process group; not once it has been reaped (its id may be reused).
    fn signal(&mut self, signal: i32) {
        if self.running() {
            // SAFETY: kill(2) on the group of our own unreaped child (its id is the group's).
            unsafe { libc::kill(-(self.child.id() as i32), signal) };
        }
    }

    /// SIGTERM, then up to `grace` for it to exit, then SIGKILL.
    async fn stop(mut self, grace: Duration) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while self.running() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Drop kills what is left and reaps.
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
        if !self.exited {
            // SIGKILL cannot be caught: this returns as soon as the kernel has ended it.
            let _ = self.child.wait();
        }
    }
}

struct Running {
    pipeline: WorkerPipeline,
    /// What the cache directory may hold (`--cache-cap-bytes`); the worker's default if None.
    cache_cap_bytes: Option<u64>,
    /// Each worker's cap on batches per second (`--max-batch-rate`).
    max_batch_rate: Option<f64>,
    children: Vec<Worker>,
    started: u64,
}

pub struct LocalWorkers {
    config: LocalWorkerConfig,
    pipelines: Mutex<BTreeMap<PipelineKey, Running>>,
    /// Set by `stop_all`: no worker is started after it (a scaling round racing the shutdown
    /// would otherwise start one nobody stops).
    closed: AtomicBool,
}

impl LocalWorkers {
    pub fn new(config: LocalWorkerConfig) -> Self {
        LocalWorkers { config, pipelines: Mutex::new(BTreeMap::new()), closed: AtomicBool::new(false) }
    }

    /// Makes the pipeline known; it runs no worker until scaled. `max_batch_rate` overrides
    /// the config's cap for its workers (tenants of different speeds).
    pub fn add(&self, pipeline: WorkerPipeline, cache_cap_bytes: Option<u64>, max_batch_rate: Option<f64>) {
        let key = PipelineKey::new(&pipeline.namespace, &pipeline.name);
        let max_batch_rate = max_batch_rate.or(self.config.max_batch_rate);
        let running = Running { pipeline, cache_cap_bytes, max_batch_rate, children: Vec::new(), started: 0 };
        self.pipelines.lock().unwrap().insert(key, running);
    }

    /// Running worker processes of a pipeline (exited ones are reaped and not counted).
    pub fn running(&self, pipeline: &PipelineKey) -> usize {
        let mut pipelines = self.pipelines.lock().unwrap();
        let Some(running) = pipelines.get_mut(pipeline) else { return 0 };
        running.children.retain_mut(Worker::running);
        running.children.len()
    }

    /// Process ids of a pipeline's running workers.
    pub fn pids(&self, pipeline: &PipelineKey) -> Vec<u32> {
        let mut pipelines = self.pipelines.lock().unwrap();
        let Some(running) = pipelines.get_mut(pipeline) else { return Vec::new() };
        running.children.retain_mut(Worker::running);
        running.children.iter().map(Worker::pid).collect()
    }

    /// Kills one worker abruptly (SIGKILL), as a crash would: for failure tests.
    pub fn kill_one(&self, pipeline: &PipelineKey) -> Option<u32> {
        let mut pipelines = self.pipelines.lock().unwrap();
        let worker = pipelines.get_mut(pipeline)?.children.pop()?;
        let pid = worker.pid();
        drop(worker); // kills and reaps
        Some(pid)
    }

    /// Stops every worker of every pipeline and waits until they have exited (SIGTERM, then
    /// SIGKILL after the grace period); none is started afterwards.
    pub async fn stop_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let workers: Vec<Worker> = {
            let mut pipelines = self.pipelines.lock().unwrap();
            pipelines.values_mut().flat_map(|r| r.children.drain(..)).collect()
        };
        let stopping: Vec<_> = workers.into_iter().map(|w| tokio::spawn(w.stop(GRACE))).collect();
        for stopped in stopping {
            let _ = stopped.await;
        }
    }

    fn spawn(&self, running: &Running) -> anyhow::Result<Worker> {
        let c = &self.config;
        let pipeline = &running.pipeline;
        let json = serde_json::to_string(pipeline)?;
        let mut command = Command::new(&c.binary);
        command
            .args(["--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--dispatcher", &c.dispatcher_url])
            .args(["--threads", &c.threads.to_string(), "--memory-budget", &c.memory_budget.to_string()])
            .args(running.max_batch_rate.map(|r| format!("--max-batch-rate={r}")))
            .args(c.cache_dir.iter().flat_map(|d| [std::ffi::OsStr::new("--cache-dir"), d.as_os_str()]))
            .args(running.cache_cap_bytes.map(|b| format!("--cache-cap-bytes={b}")))
            .args(c.tls.iter().flat_map(|t| {
                [("--tls-cert-file", &t.cert), ("--tls-key-file", &t.key), ("--ca-file", &t.ca)]
                    .map(|(flag, path)| format!("{flag}={}", path.display()))
            }))
            .env("STOKER_PIPELINE", json)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(dir) = &c.log_dir {
            let path = dir.join(format!("{}-{}.log", pipeline.name, running.started));
            command.stderr(std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?);
        }
        let child = spawn_tied(command).with_context(|| format!("starting {}", c.binary.display()))?;
        Ok(Worker { child, exited: false })
    }
}

impl Scaler for LocalWorkers {
    async fn scale(&self, pipeline: &PipelineKey, workers: u32) -> anyhow::Result<()> {
        let mut stopping = Vec::new();
        {
            let mut pipelines = self.pipelines.lock().unwrap();
            let running = pipelines.get_mut(pipeline).with_context(|| format!("no local pipeline {pipeline}"))?;
            running.children.retain_mut(Worker::running);
            if self.closed.load(Ordering::SeqCst) && workers > 0 {
                anyhow::bail!("the local workers are stopped; not starting {workers} for {pipeline}");
            }
            while running.children.len() < workers as usize {
                running.started += 1;
                let child = self.spawn(running)?;
                running.children.push(child);
            }
            while running.children.len() > workers as usize {
                stopping.push(running.children.pop().expect("more than wanted"));
            }
        }
        // Newest first, gracefully: SIGTERM lets a worker finish handing out what it holds. Not
        // awaited, so scaling goes on; a worker still stopping when the runtime ends is killed
        // by its drop.
        for worker in stopping {
            tokio::spawn(worker.stop(GRACE));
        }
        Ok(())
    }
}
