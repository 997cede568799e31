//! The local policy comparison on real worker processes:
//! - its baselines decide from real readings: HPA from the workers' CPU over the calibrated
//!   request, KEDA from the client's prefetch queue, Cachew's rule from the windows the client
//!   reports. One worker starts; the trainer needs four, so each must ask for more.
//! - tenants share a budget: two jobs on one dispatcher, each needing three workers, under one
//!   scaling loop with a budget of four.
//!
//! The two run one at a time: each measures what workers add on a 2-core machine, and the
//! other's workers beside it would take the cores it measures (a job then rightly converges at
//! one worker, since a second one adds nothing).

use std::time::Duration;

use stoker_local::bench::policies::{self, run};
use stoker_local::workers::worker_binary;
use stoker_operator::autoscaling::policy::Limits;
use stoker_operator::autoscaling::sim::contenders::Contender;
use stoker_operator::autoscaling::sim::{SimConfig, Trainer};

/// Held by each test for its whole run.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Prepared {
    corpus: std::path::PathBuf,
    logs: tempfile::TempDir,
    config: SimConfig,
    _dir: tempfile::TempDir,
}

/// A small corpus, a directory for the workers' logs, and the comparison's config with
/// two-second windows.
async fn prepare() -> Prepared {
    assert!(
        worker_binary().is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        worker_binary().display()
    );
    let (dir, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let corpus = dir.path().join("corpus");
    stoker_local::demo::ensure_corpus(&corpus, 200).await.unwrap();
    Prepared { corpus, logs, config: SimConfig { window_seconds: 2.0, ..policies::config() }, _dir: dir }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_baseline_scales_local_workers_up_from_what_it_reads() {
    let _alone = ALONE.lock().await;
    let Prepared { corpus, logs, config, _dir } = prepare().await;
    let scenario = policies::scenario("optimum 4").unwrap();
    let (trainer, steps) = policies::shortened(&scenario, 10.0);
    let mut setting = run::Setting {
        corpus: &corpus,
        logs: logs.path(),
        config: &config,
        cores_per_rate: 0.0,
        period: Some(Duration::from_secs(2)),
    };
    setting.cores_per_rate =
        run::calibrate(&setting, trainer.rate, Duration::from_secs(1), Duration::from_secs(3)).await.unwrap();
    let request = setting.cores_per_rate * trainer.rate;
    assert!(request > 0.0 && request < 1.5, "a capped worker uses {request} cores");

    for contender in [Contender::Hpa, Contender::Keda { per_worker: 1.0 }, Contender::Cachew] {
        let run = run::run(contender, &trainer, steps, 4, &setting).await.unwrap();
        eprintln!("{}: {run:?}", contender.name());
        assert_eq!(run.batches, steps, "{}", contender.name());
        let first = run.decisions.first().unwrap_or_else(|| panic!("{} never rescaled: {run:?}", contender.name()));
        assert!(first.2 > 1, "{} scaled down from 1 first: {run:?}", contender.name());
        assert!(run.most_workers >= 2 && run.worker_seconds > run.seconds, "{}: {run:?}", contender.name());
        assert!(run.waited > 0.0 && run.waited < run.seconds, "{}: {run:?}", contender.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_the_budget_and_a_finished_job_frees_its_workers() {
    let _alone = ALONE.lock().await;
    let Prepared { corpus, logs, config, _dir } = prepare().await;
    // Ours reads no CPU: the request is HPA's alone.
    let setting =
        run::Setting { corpus: &corpus, logs: logs.path(), config: &config, cores_per_rate: 1.0, period: None };
    let trainer = Trainer::with_optimum(3, 0.030);
    let limits = Limits { min: 1, max: 16 };
    // The second job is half as long: once it is done, the first may have its share.
    let jobs: Vec<run::Job> = [700, 350]
        .into_iter()
        .enumerate()
        .map(|(i, steps)| run::Job { name: format!("tenant-{i}"), trainer: trainer.clone(), steps, limits, start: 1 })
        .collect();
    let budget = 4;
    let runs = run::run_jobs(Contender::Ours, &jobs, Some(budget), &setting).await.unwrap();
    for (job, run) in jobs.iter().zip(&runs) {
        eprintln!("{}: {run:?}", job.name);
        assert_eq!(run.batches, job.steps, "{}", job.name);
        assert!(run.most_workers >= 2, "{} never scaled up: {run:?}", job.name);
        // Each keeps its min of one while the other runs.
        assert!(run.most_workers <= budget, "{} ran more than the budget: {run:?}", job.name);
    }
    // While both ran they had four workers at most between them: the workers' time then is
    // at most four times the shorter job's.
    let (first, second) = (&runs[0], &runs[1]);
    let during_both: f64 = second.worker_seconds + worker_seconds_until(first, second.seconds);
    assert!(
        during_both <= f64::from(budget) * second.seconds * 1.05,
        "{during_both:.1} worker-seconds in the {:.1} s both ran: over a budget of {budget}",
        second.seconds
    );
    // Each wanted three, so the budget held the first back until the second was done.
    let before = first.decisions.iter().filter(|d| d.1 < second.seconds).map(|d| d.2).max().unwrap_or(1);
    assert!(
        first.decisions.iter().any(|d| d.1 >= second.seconds && d.2 > before),
        "the first job never had more than its {before} workers after the second was done: {first:?}"
    );
}

/// The worker-seconds of `run` in its first `seconds`, from its decisions (it starts at one).
fn worker_seconds_until(run: &stoker_operator::autoscaling::sim::Run, seconds: f64) -> f64 {
    let (mut total, mut at, mut workers) = (0.0, 0.0, 1.0);
    for &(_, clock, to) in run.decisions.iter().take_while(|d| d.1 < seconds) {
        total += workers * (clock - at);
        (at, workers) = (clock, f64::from(to));
    }
    total + workers * (seconds - at)
}
