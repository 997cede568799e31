//! The end-to-end suite: starts the provider named by `STOKER_E2E_PROVIDER` (`local`, the
//! default, or `kind`), runs every scenario in order against that one cluster, tears it down and
//! exits with the result.
//!
//! - `local` must start: if it cannot, every scenario fails with the reason.
//! - `kind` is skipped (scenarios reported as ignored, exit 0) where Docker or kind is missing,
//!   with the reason printed.
//!
//! `cargo test -p stoker-e2e --test e2e [-- FILTER]` (after `cargo build --workspace --bins`).

mod scenarios;

use std::panic::AssertUnwindSafe;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use libtest_mimic::{Arguments, Failed, Trial};
use stoker_e2e::{Cluster, Provider, StartError};

/// Each failed scenario's name and the first line of its error, for the summary at the end.
static FAILED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A scenario that takes longer than this has hung.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(600);

fn trials(provider: Provider, run: impl Fn(&'static scenarios::Scenario) -> Trial) -> Vec<Trial> {
    scenarios::ALL.iter().map(|s| run(s).with_kind(provider.to_string())).collect()
}

fn banner(text: &str) {
    let line = "=".repeat(78);
    eprintln!("\n{line}\n{text}\n{line}\n");
}

fn main() -> ExitCode {
    // The scenarios' own clients log where RUST_LOG asks (e.g. `stoker_client=debug`).
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let mut args = Arguments::from_args();
    // The scenarios share one cluster and one operator: one at a time, in order.
    args.test_threads = Some(1);
    let provider = match Provider::from_env() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("e2e: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let placeholder = |s: &'static scenarios::Scenario| Trial::test(s.name, || Ok(()));

    // Listing, or a filter that selects nothing: no cluster needed.
    let selected = trials(provider, placeholder).iter().any(|t| !args.is_filtered_out(t) && !args.is_ignored(t));
    if args.list || !selected {
        return libtest_mimic::run(&args, trials(provider, placeholder)).exit_code();
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("building the tokio runtime");

    eprintln!("e2e: starting the {provider} cluster provider ...");
    let started = std::time::Instant::now();
    let cluster: Arc<dyn Cluster> = match runtime.block_on(stoker_e2e::cluster::start_from_env()) {
        Ok(cluster) => {
            eprintln!(
                "e2e: {provider} cluster up in {:.1?} (kubeconfig {})",
                started.elapsed(),
                cluster.kubeconfig().display()
            );
            Arc::from(cluster)
        }
        Err(StartError::Unavailable(reason)) => {
            banner(&format!("{reason}\nThe e2e scenarios are reported as ignored for the {provider} provider."));
            let conclusion =
                libtest_mimic::run(&args, trials(provider, |s| Trial::test(s.name, || Ok(())).with_ignored_flag(true)));
            return conclusion.exit_code();
        }
        Err(StartError::Failed(error)) => {
            let message = match provider {
                Provider::Local => format!("{error:#}"),
                other => format!("the {other} cluster did not start: {error:#}"),
            };
            banner(&format!("e2e: {message}"));
            let short = message.lines().next().unwrap_or_default().to_string();
            let conclusion = libtest_mimic::run(
                &args,
                trials(provider, |s| {
                    let short = short.clone();
                    Trial::test(s.name, move || Err(Failed::from(short)))
                }),
            );
            return if conclusion.has_failed() { ExitCode::FAILURE } else { conclusion.exit_code() };
        }
    };

    // Ctrl-C or SIGTERM: tear down before exiting (children would die with us anyway, through
    // PR_SET_PDEATHSIG, but this also stops them gracefully and deletes a kind cluster).
    {
        let cluster = cluster.clone();
        runtime.spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
                return;
            };
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
            eprintln!("\ne2e: interrupted: tearing the cluster down");
            cluster.shutdown().await;
            std::process::exit(130);
        });
    }

    let handle = runtime.handle().clone();
    let conclusion = libtest_mimic::run(
        &args,
        trials(provider, |s| {
            let cluster = cluster.clone();
            let handle = handle.clone();
            Trial::test(s.name, move || {
                handle.block_on(run_scenario(s, cluster)).map_err(|e| {
                    let first = e.lines().next().unwrap_or_default().chars().take(400).collect::<String>();
                    FAILED.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{}: {first}", s.name));
                    Failed::from(e)
                })
            })
        }),
    );

    eprintln!("e2e: tearing the {provider} cluster down");
    runtime.block_on(cluster.shutdown());
    // Last, where a CI log's tail shows it: why each scenario failed (the full reports with
    // diagnostics are above).
    let failed = FAILED.lock().unwrap_or_else(|p| p.into_inner());
    if !failed.is_empty() {
        eprintln!("e2e: {} scenario(s) failed on the {provider} provider:", failed.len());
        for line in failed.iter() {
            eprintln!("  {line}");
        }
    }
    drop(cluster);
    // Also drops the signal task's reference, and with it the cluster (its files).
    drop(runtime);
    conclusion.exit_code()
}

async fn run_scenario(scenario: &'static scenarios::Scenario, cluster: Arc<dyn Cluster>) -> Result<(), String> {
    let started = std::time::Instant::now();
    let outcome =
        tokio::time::timeout(SCENARIO_TIMEOUT, AssertUnwindSafe((scenario.run)(&*cluster)).catch_unwind()).await;
    let error = match outcome {
        Ok(Ok(Ok(()))) => {
            eprintln!("e2e: {} passed in {:.1?}", scenario.name, started.elapsed());
            return Ok(());
        }
        Ok(Ok(Err(e))) => describe(&e),
        Ok(Err(panic)) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(non-string panic payload)".into());
            format!("panicked: {text}")
        }
        Err(_) => format!("did not finish within {SCENARIO_TIMEOUT:?}"),
    };
    Err(format!("{error}\n\n=== diagnostics ({}) ==={}", cluster.provider(), cluster.diagnostics().await))
}

/// The error and its causes, one per line (without the backtrace `{:?}` would add).
fn describe(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    for cause in error.chain().skip(1) {
        let line = cause.to_string();
        text.push_str("\n  caused by: ");
        text.push_str(if line.trim().is_empty() { "(no message)" } else { &line });
    }
    text
}
