//! `stoker profile`: runs a pipeline on a sample of its data on this machine (the worker's
//! `profile` command, in a process of its own as every local worker is), then plans from the
//! measurements (`plan`) and prints the plan (`render`). No cluster.

pub mod plan;
pub mod render;

use std::path::{Path, PathBuf};

use anyhow::Context;
use stoker_api::{DataPipelineSpec, SampleProfile};

pub use plan::{Ask, Plan, Target};

/// How the sample runs.
pub struct SampleRun<'a> {
    pub worker: &'a Path,
    pub manifest: &'a Path,
    /// Records the timed run reads.
    pub elements: u64,
    /// Transform threads of the one worker measured: the worker size the plan is for.
    pub threads: u32,
    /// A directory on the cache volume to probe for the autocache verdict.
    pub cache_dir: Option<PathBuf>,
}

/// Runs the worker's `profile` command and reads its measurements.
pub fn sample(run: &SampleRun<'_>) -> anyhow::Result<SampleProfile> {
    let mut command = std::process::Command::new(run.worker);
    command
        .arg("profile")
        .arg("--pipeline")
        .arg(run.manifest)
        .args(["--elements", &run.elements.to_string(), "--threads", &run.threads.to_string()])
        // Its warnings come back in the measurements, printed with the plan; errors show here.
        .env("RUST_LOG", std::env::var("STOKER_LOG").unwrap_or_else(|_| "error".into()))
        .stderr(std::process::Stdio::inherit());
    if let Some(dir) = &run.cache_dir {
        command.arg("--cache-dir").arg(dir);
    }
    let out = command.output().with_context(|| format!("running {}", run.worker.display()))?;
    anyhow::ensure!(out.status.success(), "the sample run failed ({}); its errors are above", out.status);
    serde_json::from_slice(&out.stdout).context("reading the sample run's measurements")
}

/// The threads of one worker as the spec sizes it: its CPU limit, else its request, rounded
/// up; 1 when it sets neither.
pub fn spec_threads(spec: &DataPipelineSpec) -> u32 {
    let resources = spec.workers.resources.as_ref();
    let cpu = |list: Option<
        &std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { list?.get("cpu").and_then(|q| cores(&q.0)) };
    let cores =
        cpu(resources.and_then(|r| r.limits.as_ref())).or_else(|| cpu(resources.and_then(|r| r.requests.as_ref())));
    cores.map_or(1, |c| (c.ceil() as u32).max(1))
}

/// A CPU quantity's cores: "4", "2.5", "500m".
fn cores(quantity: &str) -> Option<f64> {
    match quantity.strip_suffix('m') {
        Some(millis) => millis.parse::<f64>().ok().map(|m| m / 1e3),
        None => quantity.parse().ok(),
    }
    .filter(|c: &f64| c.is_finite() && *c > 0.0)
}
