//! The parts of the `stoker` command line worth testing: local mode's terminal view and the
//! demo's summary.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use stoker_api::DataPipeline;

use crate::demo::DemoReport;
use crate::mode::{Local, LocalOptions};
use crate::workers::{LocalWorkerConfig, worker_binary};

/// ~/.cache/stoker (or $STOKER_CACHE): generated corpora and logs, outside any checkout.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STOKER_CACHE") {
        return dir.into();
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/stoker")
}

/// Warnings only (STOKER_LOG overrides): the terminal view is the output.
pub fn quiet_logs() {
    let filter = std::env::var("STOKER_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn demo_summary(r: &DemoReport) -> String {
    let verdict = if r.final_workers.abs_diff(r.optimum) <= 1 { "within one of" } else { "NOT within one of" };
    let converged =
        r.converged_after.map_or("no rescale".to_string(), |d| format!("last rescale after ~{} s", d.as_secs()));
    let mut summary = format!(
        "Summary: ended at {} workers, {verdict} the optimum of {}; {} rescale decisions ({converged}).\n\
         The trainer ran {} steps on {} images in {:.0} s ({:.0} images/s).",
        r.final_workers,
        r.optimum,
        r.decisions,
        r.steps,
        r.images,
        r.elapsed.as_secs_f64(),
        r.images as f64 / r.elapsed.as_secs_f64().max(1e-9)
    );
    if let Some(wait) = r.data_wait.as_ref().filter(|w| w.total_seconds > 0.0) {
        summary.push('\n');
        summary.push_str(&wait_line(wait));
    }
    summary
}

pub struct LocalSettings {
    pub listen: SocketAddr,
    pub threads: usize,
    pub max_batch_rate: Option<f64>,
    pub window_seconds: Option<u32>,
    pub seconds: Option<u64>,
    /// Default: ~/.cache/stoker/volumes/<namespace>, one per namespace as in a cluster.
    pub cache_dir: Option<PathBuf>,
    /// Serve TLS with a throwaway CA (written beside the logs, in `tls/`).
    pub tls: bool,
}

/// `stoker local`: runs until Ctrl-C or `seconds`, a status line per window, then a summary.
pub async fn local(dp: DataPipeline, settings: LocalSettings) -> anyhow::Result<()> {
    let LocalSettings { listen, threads, max_batch_rate, window_seconds, seconds, cache_dir: volume, tls } = settings;
    let name = dp.name_any();
    let namespace = dp.namespace().unwrap_or_else(|| "default".into());
    let logs = cache_dir().join("local").join(&name);
    std::fs::create_dir_all(&logs)?;
    let volume = volume.unwrap_or_else(|| cache_dir().join("volumes").join(&namespace));
    let local = Local::start(LocalOptions {
        namespace: namespace.clone(),
        name: name.clone(),
        spec: dp.spec.clone(),
        listen,
        workers: LocalWorkerConfig {
            binary: worker_binary(),
            dispatcher_url: String::new(),
            threads,
            memory_budget: 512 << 20,
            max_batch_rate,
            log_dir: Some(logs.clone()),
            cache_dir: Some(volume),
            tls: None,
        },
        window: window_seconds.map(|s| Duration::from_secs(u64::from(s))),
        budget: None,
        tls_dir: tls.then(|| logs.join("tls")),
    })
    .await?;
    println!("Pipeline {namespace}/{name} runs locally. Point training clients at the dispatcher:");
    println!("    {}   (pipeline {namespace}/{name}; worker logs in {})", local.url, logs.display());
    if let Some(ca) = &local.ca_file {
        // The exact line the Python TLS test reads the CA from.
        println!("    TLS on: clients trust the CA in {} (STOKER_CA_FILE={0})", ca.display());
    }
    println!();
    println!("{}", crate::mode::VIEW_HEADER);
    let window =
        Duration::from_secs(u64::from(window_seconds.unwrap_or(dp.spec.autoscaling.policy.window_seconds).max(1)));
    let start = Instant::now();
    let mut tick = tokio::time::interval(window);
    tick.tick().await;
    let (mut seen, mut last_elements, mut last) = (0, local.elements(), Instant::now());
    let mut shown_cache: Option<String> = None;
    let mut shown_warnings = std::collections::BTreeSet::new();
    let mut shown_mix = None;
    let mut shown_jobs = Vec::new();
    // The run ends after `seconds`, on Ctrl-C, or on SIGTERM from whatever started it (a test,
    // a supervisor): either way the workers are stopped below, not left behind.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let deadline = async move {
        let run_for = async {
            match seconds {
                Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = run_for => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = &mut deadline => break,
        }
        let elements = local.elements();
        let rate = elements.saturating_sub(last_elements) as f64 / last.elapsed().as_secs_f64();
        (last_elements, last) = (elements, Instant::now());
        println!("{}", local.view_line(start.elapsed(), rate, &mut seen).0);
        let cache = local.cache().map(|c| cache_line(&c));
        if cache.is_some() && cache != shown_cache {
            println!("{}", cache.as_deref().unwrap_or_default());
            shown_cache = cache;
        }
        let report = local.report();
        for warning in &report.warnings {
            if shown_warnings.insert(warning.clone()) {
                println!("warning: {warning}");
            }
        }
        // A job joining or leaving, or its policy wanting another count, is worth a line.
        let jobs: Vec<_> = local.book.job_list(&local.key).unwrap_or_default();
        let jobs_now: Vec<_> = jobs.iter().map(|j| (j.name.clone(), j.share.clone(), j.workers_wanted)).collect();
        if jobs_now != shown_jobs {
            for job in &jobs {
                println!("  {}", job_line(job));
            }
            shown_jobs = jobs_now;
        }
        let mix = mix_line(&dp.spec.data_plane.source, &report.source_shares);
        if mix.is_some() && mix != shown_mix {
            println!("{}", mix.as_deref().unwrap_or_default());
            shown_mix = mix;
        }
    }
    let record = local.record();
    println!(
        "\nSummary: {} workers ({}), {} rescale decisions in {:.0} s.",
        record.workers,
        if record.converged { "converged".to_string() } else { local.state(&record) },
        local.rescales.borrow().len(),
        start.elapsed().as_secs_f64()
    );
    for step in &record.history {
        println!("  {} -> {} workers: {}", step.time, step.workers, step.reason);
    }
    if let Some(wait) = local.book.data_wait(&local.key).filter(|w| w.total_seconds > 0.0) {
        println!("{}", wait_line(&wait));
    }
    for job in local.book.job_list(&local.key).unwrap_or_default() {
        println!("  {}", job_line(&job));
    }
    if let Some(cache) = local.cache() {
        println!("{}", cache_line(&cache));
    }
    local.shutdown().await;
    Ok(())
}

/// The trainers' time waiting for data: the accelerator time input cost them.
pub fn wait_line(w: &stoker_api::DataWaitStatus) -> String {
    format!(
        "Trainers waited for data {:.1} s of {:.1} s ({:.0}%; {:.0}% in the last window).",
        w.waiting_seconds,
        w.total_seconds,
        100.0 * w.waiting_seconds / w.total_seconds.max(f64::MIN_POSITIVE),
        100.0 * w.fraction
    )
}

/// One job reading the pipeline: its group, its consumers' wait, what its policy wants, and
/// what it took from its group's productions.
pub fn job_line(j: &stoker_api::JobStatus) -> String {
    let mut line = format!("job {} ({} consumers", j.name, j.consumers);
    if let Some(share) = &j.share {
        line.push_str(&format!(", share group {share}: {} splits shared, {} missed", j.shared_taken, j.shared_missed));
    }
    line.push(')');
    if let Some(w) = j.data_wait.as_ref().filter(|w| w.total_seconds > 0.0) {
        line.push_str(&format!(": waited {:.0}%", 100.0 * w.waiting_seconds / w.total_seconds));
    }
    if let Some(n) = j.workers_wanted {
        line.push_str(&format!(", its policy wants {n} workers"));
    }
    line
}

/// A mix's realised shares beside its weights in one line; None without a mix or before any
/// element.
pub fn mix_line(source: &stoker_api::Source, shares: &[f64]) -> Option<String> {
    if source.mix.is_empty() || shares.len() != source.mix.len() {
        return None;
    }
    let parts: Vec<String> = (source.mix.iter().zip(source.weight_shares()))
        .zip(shares)
        .map(|((m, weight), share)| format!("{} {share:.3} (weight {weight:.3})", m.uri))
        .collect();
    Some(format!("mix realised: {}", parts.join(", ")))
}

/// The cache plan in one line: decision, hint, reason, and epoch times measured.
pub fn cache_line(c: &stoker_api::CacheStatus) -> String {
    let at = c.at.map(|a| format!(" at transform {a}")).unwrap_or_default();
    let mut line = format!("cache: {:?}{at}: {}", c.decision, c.reason.as_deref().unwrap_or(""));
    if let Some(m) = &c.measured {
        let kinds = [("compute", m.compute), ("put", m.put), ("get", m.get)];
        let times: Vec<String> = kinds.iter().filter_map(|(k, s)| s.map(|s| format!("{k} {s:.1} s"))).collect();
        line.push_str(&format!(" (epochs measured: {})", times.join(", ")));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_line_says_how_long_trainers_waited() {
        let wait = stoker_api::DataWaitStatus { fraction: 0.1, waiting_seconds: 3.0, total_seconds: 12.0 };
        assert_eq!(wait_line(&wait), "Trainers waited for data 3.0 s of 12.0 s (25%; 10% in the last window).");
    }

    #[test]
    fn the_mix_line_shows_each_realised_share_beside_its_weight() {
        let mix = vec![
            stoker_api::MixedSource { uri: "s3://c/web/".into(), weight: 7.0 },
            stoker_api::MixedSource { uri: "s3://c/code/".into(), weight: 3.0 },
        ];
        let source = stoker_api::Source { mix, ..stoker_api::Source::single("", stoker_api::SourceFormat::Jsonl) };
        assert_eq!(
            mix_line(&source, &[0.688, 0.312]).as_deref(),
            Some("mix realised: s3://c/web/ 0.688 (weight 0.700), s3://c/code/ 0.312 (weight 0.300)")
        );
        assert_eq!(mix_line(&source, &[]), None, "nothing produced yet");
        let single = stoker_api::Source::single("s3://c/web/", stoker_api::SourceFormat::Jsonl);
        assert_eq!(mix_line(&single, &[1.0]), None, "one source: no line");
    }
}
