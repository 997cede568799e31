//! The local-processes scaler: runs a pipeline's workers as `stoker-worker` child processes
//! attached to the dispatcher, for `stoker local`, the demo and tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;

use anyhow::Context as _;
use stoker_api::WorkerPipeline;
use tokio::process::{Child, Command};

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
    /// Caps each worker's batches per second (`--max-batch-rate`).
    pub max_batch_rate: Option<f64>,
    /// Where each worker's log goes (`<dir>/<pipeline>-<n>.log`); inherited stderr when None.
    pub log_dir: Option<PathBuf>,
    /// The directory standing in for the namespace's cache volume; no caching when None.
    pub cache_dir: Option<PathBuf>,
    /// Workers serve TLS with this certificate and verify the dispatcher with its CA.
    pub tls: Option<WorkerTlsFiles>,
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

struct Running {
    pipeline: WorkerPipeline,
    /// What the cache directory may hold (`--cache-cap-bytes`); the worker's default if None.
    cache_cap_bytes: Option<u64>,
    children: Vec<Child>,
    started: u64,
}

pub struct LocalWorkers {
    config: LocalWorkerConfig,
    pipelines: Mutex<BTreeMap<PipelineKey, Running>>,
}

impl LocalWorkers {
    pub fn new(config: LocalWorkerConfig) -> Self {
        LocalWorkers { config, pipelines: Mutex::new(BTreeMap::new()) }
    }

    /// Makes the pipeline known; it runs no worker until scaled.
    pub fn add(&self, pipeline: WorkerPipeline, cache_cap_bytes: Option<u64>) {
        let key = PipelineKey::new(&pipeline.namespace, &pipeline.name);
        self.pipelines
            .lock()
            .unwrap()
            .insert(key, Running { pipeline, cache_cap_bytes, children: Vec::new(), started: 0 });
    }

    /// Running worker processes of a pipeline (exited ones are reaped and not counted).
    pub fn running(&self, pipeline: &PipelineKey) -> usize {
        let mut pipelines = self.pipelines.lock().unwrap();
        let Some(running) = pipelines.get_mut(pipeline) else { return 0 };
        running.children.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
        running.children.len()
    }

    /// Process ids of a pipeline's running workers.
    pub fn pids(&self, pipeline: &PipelineKey) -> Vec<u32> {
        let pipelines = self.pipelines.lock().unwrap();
        pipelines.get(pipeline).map(|r| r.children.iter().filter_map(|c| c.id()).collect()).unwrap_or_default()
    }

    /// Kills one worker abruptly (SIGKILL), as a crash would: for failure tests.
    pub fn kill_one(&self, pipeline: &PipelineKey) -> Option<u32> {
        let mut pipelines = self.pipelines.lock().unwrap();
        let child = pipelines.get_mut(pipeline)?.children.pop()?;
        let pid = child.id();
        drop(child); // kill_on_drop
        pid
    }

    fn spawn(&self, pipeline: &WorkerPipeline, cache_cap_bytes: Option<u64>, n: u64) -> anyhow::Result<Child> {
        let c = &self.config;
        let json = serde_json::to_string(pipeline)?;
        let mut command = Command::new(&c.binary);
        command
            .args(["--listen", "127.0.0.1:0", "--dispatcher", &c.dispatcher_url])
            .args(["--threads", &c.threads.to_string(), "--memory-budget", &c.memory_budget.to_string()])
            .args(c.max_batch_rate.map(|r| format!("--max-batch-rate={r}")))
            .args(c.cache_dir.iter().flat_map(|d| [std::ffi::OsStr::new("--cache-dir"), d.as_os_str()]))
            .args(cache_cap_bytes.map(|b| format!("--cache-cap-bytes={b}")))
            .args(c.tls.iter().flat_map(|t| {
                [("--tls-cert-file", &t.cert), ("--tls-key-file", &t.key), ("--ca-file", &t.ca)]
                    .map(|(flag, path)| format!("{flag}={}", path.display()))
            }))
            .env("STOKER_PIPELINE", json)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true);
        // A worker dies with `stoker local` even when it is killed outright (no drop runs).
        // SAFETY: prctl is async-signal-safe and touches nothing of the parent's.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        if let Some(dir) = &c.log_dir {
            let path = dir.join(format!("{}-{}.log", pipeline.name, n));
            command.stderr(std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?);
        }
        command.spawn().with_context(|| format!("starting {}", c.binary.display()))
    }
}

impl Scaler for LocalWorkers {
    async fn scale(&self, pipeline: &PipelineKey, workers: u32) -> anyhow::Result<()> {
        let mut stopping = Vec::new();
        {
            let mut pipelines = self.pipelines.lock().unwrap();
            let running = pipelines.get_mut(pipeline).with_context(|| format!("no local pipeline {pipeline}"))?;
            running.children.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
            while running.children.len() < workers as usize {
                running.started += 1;
                let child = self.spawn(&running.pipeline, running.cache_cap_bytes, running.started)?;
                running.children.push(child);
            }
            while running.children.len() > workers as usize {
                stopping.push(running.children.pop().expect("more than wanted"));
            }
        }
        // Newest first, gracefully: SIGTERM lets a worker finish handing out what it holds.
        for mut child in stopping {
            if let Some(pid) = child.id() {
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            tokio::spawn(async move {
                if tokio::time::timeout(std::time::Duration::from_secs(10), child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
            });
        }
        Ok(())
    }
}
