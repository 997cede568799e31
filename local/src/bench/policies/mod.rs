//! `stoker bench autoscaler --local`: the simulated comparison's policies on real processes.
//! Each scenario's trainer is the simulator's, shortened: workers capped at its rate, the
//! synthetic trainer at its compute time, through the real dispatcher and client. Every
//! contender trains the same steps; the figures go into the simulation's tables.
//!
//! Read in this order: [`cpu`] (what HPA reads of a worker), [`run`] (one contender training
//! one job or several tenants' at once, and the CPU request's calibration), [`contest`] here,
//! then [`tenants`] (the simulation's tenants over a budget).

pub mod cpu;
pub mod run;
pub mod tenants;

use std::path::{Path, PathBuf};
use std::time::Duration;

use stoker_operator::autoscaling::sim::compare::{self, Contest};
use stoker_operator::autoscaling::sim::contenders::Contender;
use stoker_operator::autoscaling::sim::scenarios::comparison_scenarios;
use stoker_operator::autoscaling::sim::{Run, Scenario, SimConfig, Trainer, optimum};

pub struct Options {
    /// The demo's generated image corpus (made if missing).
    pub corpus: PathBuf,
    /// Training time at full speed of each run (the simulation's runs are an hour).
    pub seconds: f64,
    pub config: SimConfig,
}

/// The scenarios run when none are named: one steady, one whose trainer speeds up.
pub const DEFAULT_SCENARIOS: [&str; 2] = ["optimum 4", "optimum 8 -> 16: trainer 2x faster a third in"];

/// The comparison's bounds on this machine: 16 workers at most (the simulation's 64 would be
/// 64 processes on 2 cores), so KEDA's second target is prefetch / 16.
pub fn config() -> SimConfig {
    SimConfig { limits: stoker_operator::autoscaling::policy::Limits { min: 1, max: 16 }, ..SimConfig::default() }
}

/// The simulation's scenario called `name`.
pub fn scenario(name: &str) -> anyhow::Result<Scenario> {
    let all = comparison_scenarios();
    match all.iter().find(|s| s.name == name) {
        Some(s) => Ok(s.clone()),
        None => {
            let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
            anyhow::bail!("no scenario {name:?}; the simulation's are: {}", names.join(", "))
        }
    }
}

/// `scenario`'s trainer for a run of `seconds` at full speed, and its steps; a speed change
/// stays at the same share of the steps.
pub fn shortened(scenario: &Scenario, seconds: f64) -> (Trainer, u64) {
    let mut trainer = scenario.trainer.clone();
    let steps = (seconds / trainer.mean_step()).round().max(1.0) as u64;
    let full = stoker_operator::autoscaling::sim::scenarios::steps(&trainer);
    if let Some((at, factor)) = trainer.speed_change_at_batch {
        trainer.speed_change_at_batch = Some((at * steps / full.max(1), factor));
    }
    (trainer, steps)
}

/// Every contender of the simulation on `scenario`, one after the other, each run printed to
/// `out` as it ends. The best achievable time is the trainer's own: its steps' compute.
pub async fn contest(
    scenario: &Scenario,
    options: &Options,
    out: &mut (dyn std::io::Write + Send),
) -> anyhow::Result<Contest> {
    let config = &options.config;
    let (trainer, steps) = shortened(scenario, options.seconds);
    let optimum = optimum(&trainer, config);
    let logs = logs(options).await?;
    let setting = setting(options, &logs, trainer.rate).await?;
    writeln!(
        out,
        "{}: {steps} steps, optimum {optimum} workers of {:.2} batches/s; a worker at its cap uses {:.3} cores (the request HPA divides by)",
        scenario.name,
        trainer.rate,
        setting.cores_per_rate * trainer.rate
    )?;
    let spec = run::trainer_spec(&trainer);
    let best =
        Run { seconds: (0..steps).map(|s| spec.step_time(s).as_secs_f64()).sum(), batches: steps, ..Run::default() };
    let mut runs = Vec::new();
    for contender in Contender::all(config) {
        let run = run::run(contender, &trainer, steps, optimum, &setting).await?;
        writeln!(
            out,
            "  {:<28} {:>6.1} s  {:>7.0} worker-s  waited {:>5.1} s  {} decisions, final {}",
            contender.name(),
            run.seconds,
            run.worker_seconds,
            run.waited,
            run.decisions.len(),
            run.final_workers
        )?;
        out.flush()?;
        runs.push((contender, run));
    }
    Ok(Contest { scenario: scenario.clone(), optimum, steps, best, runs })
}

/// Makes the corpus if missing; the directory for the workers' logs.
async fn logs(options: &Options) -> anyhow::Result<PathBuf> {
    crate::demo::ensure_corpus(&options.corpus, crate::demo::CORPUS_IMAGES).await?;
    let logs = options.corpus.parent().unwrap_or(&options.corpus).join("bench-logs");
    std::fs::create_dir_all(&logs)?;
    Ok(logs)
}

/// The runs' setting, with the CPU a worker uses calibrated at `rate`.
async fn setting<'a>(options: &'a Options, logs: &'a Path, rate: f64) -> anyhow::Result<run::Setting<'a>> {
    let mut setting =
        run::Setting { corpus: &options.corpus, logs, config: &options.config, cores_per_rate: 0.0, period: None };
    setting.cores_per_rate = run::calibrate(&setting, rate, Duration::from_secs(3), Duration::from_secs(8)).await?;
    Ok(setting)
}

/// The simulation's tables, for runs on processes.
pub fn report(contests: &[Contest], config: &SimConfig) -> String {
    let mut out = String::from(
        "Training time over the trainer's own / cost over the pool hand-sized at the optimum, on local processes:\n\n",
    );
    out.push_str(&compare::summary_table(contests, config, false));
    out.push_str("\nEvery figure:\n\n");
    out.push_str(&compare::detail_table(contests, true));
    out
}
