//! One contender trains jobs on real processes: `stoker-worker`s capped at each trainer's
//! worker rate, synthetic trainers through the real client, and the contender deciding from
//! what it would read in a cluster. A run is one job (a scenario), or several tenants' jobs
//! at once on one dispatcher.
//!
//! - Ours is the product: local mode's scaling loop on the clients' reported windows, over
//!   the budget when tenants share one.
//! - The baselines are the simulator's controllers ([`Contender::controller`]), one per job,
//!   fed real readings at their own period: Cachew's rule the same reported windows (combined
//!   as the scaling loop combines them), HPA the workers' CPU over their request
//!   ([`super::cpu`]), KEDA the client's prefetch queue (the trainer's time-averaged ready
//!   batches). Their decisions scale the worker processes.
//!
//! Each job's figures are the simulator's [`Run`], so the comparison's tables print both.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use stoker_api::window::Window;
use stoker_client::trainer::{Stop, TrainSummary, TrainerSpec, train};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::policy::{Decision, Limits};
use stoker_operator::autoscaling::sim::contenders::Contender;
use stoker_operator::autoscaling::sim::{Measurement, Run, SimConfig, Trainer, World};
use stoker_operator::autoscaling::{Scaler as _, combine};
use stoker_operator::key::PipelineKey;

use super::cpu::CpuMeter;
use crate::mode::{Local, LocalOptions};
use crate::workers::LocalWorkerConfig;

/// What every run of a comparison shares.
pub struct Setting<'a> {
    pub corpus: &'a Path,
    /// Where the workers' logs go.
    pub logs: &'a Path,
    /// Bounds, prefetch and the reported windows' length, as in the simulation.
    pub config: &'a SimConfig,
    /// The CPU a worker uses per batch a second, in cores ([`calibrate`] measures it). Times
    /// a worker's cap, it is the request a platform team would give the pods, which HPA's
    /// utilisation is relative to.
    pub cores_per_rate: f64,
    /// Overrides the baselines' own period (HPA's 15 s sync): tests run shorter.
    pub period: Option<Duration>,
}

/// How often the run samples the running workers for its cost.
const TICK: Duration = Duration::from_millis(250);

/// The synthetic trainer the client runs for the simulator's `trainer`.
pub fn trainer_spec(trainer: &Trainer) -> TrainerSpec {
    TrainerSpec {
        compute: Duration::from_secs_f64(trainer.compute),
        noise: trainer.noise,
        stall_every: trainer.stall_every,
        stall: Duration::from_secs_f64(trainer.stall),
        speed_change: trainer.speed_change_at_batch,
        seed: trainer.seed,
    }
}

/// One job of a run: its pipeline, its trainer, and its controller's bounds.
pub struct Job {
    pub name: String,
    pub trainer: Trainer,
    pub steps: u64,
    pub limits: Limits,
    /// The workers it starts with.
    pub start: u32,
}

/// The demo's image pipeline within `limits`; Ours scales it, every other contender starts it
/// as a fixed pool of `start` and scales it from outside.
fn spec(
    corpus: &Path,
    contender: Contender,
    limits: Limits,
    start: u32,
) -> anyhow::Result<stoker_api::DataPipelineSpec> {
    let mut spec =
        stoker_api::from_yaml::<stoker_api::DataPipelineSpec>(&crate::demo::pipeline_yaml(corpus, limits.max))?;
    spec.workers.min = limits.min as i32;
    if contender != Contender::Ours {
        spec.autoscaling.mode = stoker_api::AutoscalingMode::Fixed;
        spec.autoscaling.replicas = Some(start as i32);
    }
    Ok(spec)
}

/// Local mode with `first`'s pipeline; `budget` caps the scaling loop's workers.
async fn start_local(
    setting: &Setting<'_>,
    contender: Contender,
    first: &Job,
    budget: Option<u32>,
) -> anyhow::Result<Local> {
    Local::start(LocalOptions {
        namespace: "bench".into(),
        name: first.name.clone(),
        spec: spec(setting.corpus, contender, first.limits, first.start)?,
        listen: "127.0.0.1:0".parse()?,
        workers: LocalWorkerConfig::rate_capped(first.trainer.rate, setting.logs.to_path_buf()),
        window: Some(Duration::from_secs_f64(setting.config.window_seconds)),
        budget,
        tls_dir: None,
    })
    .await
}

async fn connect(local: &Local, key: &PipelineKey, config: &SimConfig) -> anyhow::Result<Client> {
    let mut options = ClientOptions::new(&key.namespace, &key.name);
    options.prefetch = config.prefetch as usize;
    Ok(Client::from_dispatcher(&local.url, options).await?)
}

/// Trains `steps` steps of `trainer` with `contender` deciding the workers; `optimum` sizes
/// the fixed pools.
pub async fn run(
    contender: Contender,
    trainer: &Trainer,
    steps: u64,
    optimum: u32,
    setting: &Setting<'_>,
) -> anyhow::Result<Run> {
    let limits = setting.config.limits;
    let job = Job {
        name: "policies".into(),
        trainer: trainer.clone(),
        steps,
        limits,
        start: contender.start(limits, optimum),
    };
    let mut runs = run_jobs(contender, std::slice::from_ref(&job), None, setting).await?;
    Ok(runs.remove(0))
}

/// Trains every job at once on one dispatcher, each with `contender` deciding its workers
/// (Ours: one scaling loop for all, within `budget`); each job's pipeline is taken out when
/// its steps are trained, so its workers go to the others. The jobs' runs, in order.
pub async fn run_jobs(
    contender: Contender,
    jobs: &[Job],
    budget: Option<u32>,
    setting: &Setting<'_>,
) -> anyhow::Result<Vec<Run>> {
    let Some(first) = jobs.first() else { return Ok(Vec::new()) };
    let local = start_local(setting, contender, first, budget).await?;
    let trained = async {
        let mut keys = vec![local.key.clone()];
        for job in &jobs[1..] {
            let spec = spec(setting.corpus, contender, job.limits, job.start)?;
            keys.push(local.add("bench", &job.name, spec, Some(job.trainer.rate)).await?);
        }
        let windows = Mailbox::default();
        let training =
            jobs.iter().zip(&keys).map(|(job, key)| train_job(contender, job, key, &local, &windows, setting));
        futures::future::try_join_all(training).await
    }
    .await;
    local.shutdown().await;
    trained
}

/// The clients' windows, taken from the dispatcher and handed to each job's controller: one
/// job taking them must not take its neighbours'.
#[derive(Default)]
struct Mailbox(RefCell<BTreeMap<PipelineKey, Vec<Window>>>);

impl Mailbox {
    fn take(&self, local: &Local, key: &PipelineKey) -> Vec<Window> {
        let mut held = self.0.borrow_mut();
        for jw in local.dispatcher.with_state(|s| s.take_windows()) {
            held.entry(jw.pipeline).or_default().extend(jw.windows);
        }
        held.remove(key).unwrap_or_default()
    }
}

/// One job: its client trains while its contender decides; then its pipeline is taken out.
async fn train_job(
    contender: Contender,
    job: &Job,
    key: &PipelineKey,
    local: &Local,
    windows: &Mailbox,
    setting: &Setting<'_>,
) -> anyhow::Result<Run> {
    let mut client = connect(local, key, setting.config).await?;
    let progress = RefCell::new(TrainSummary::default());
    let out = RefCell::new(Run { most_workers: job.start, final_workers: job.start, ..Run::default() });
    let spec = trainer_spec(&job.trainer);
    let training = train(&mut client, &spec, Stop { steps: Some(job.steps), after: None }, |s, _| {
        *progress.borrow_mut() = s.clone();
    });
    let deciding = decide(contender, job, key, setting, local, windows, &progress, &out);
    // Deciding never ends: it stops when training does.
    let summary = tokio::select! {
        summary = training => summary,
        never = deciding => match never {},
    }?;
    drop(client);
    local.remove(key).await?;
    let mut run = out.into_inner();
    run.seconds = summary.elapsed.as_secs_f64();
    run.batches = summary.steps;
    run.waited = summary.waited.as_secs_f64();
    Ok(run)
}

/// Samples the job's running workers into its cost, and lets the contender decide at its
/// period: baselines from their readings, Ours by the scaling loop (its rescales recorded).
#[allow(clippy::too_many_arguments)]
async fn decide(
    contender: Contender,
    job: &Job,
    key: &PipelineKey,
    setting: &Setting<'_>,
    local: &Local,
    windows: &Mailbox,
    progress: &RefCell<TrainSummary>,
    out: &RefCell<Run>,
) -> std::convert::Infallible {
    let config = setting.config;
    let mut controller = contender.controller(job.limits, job.start, config);
    let period = setting.period.unwrap_or(Duration::from_secs_f64(controller.period()));
    let reads_windows =
        matches!(contender, Contender::Ours | Contender::Cachew | Contender::Fixed { .. } | Contender::Max);
    let request = setting.cores_per_rate * job.trainer.rate;
    let mut cpu = CpuMeter::default();
    cpu.used_since_last(&local.workers.pids(key));
    let began = Instant::now();
    let (mut last_tick, mut last_decision) = (began, began);
    let mut last_read = progress.borrow().clone();
    let (mut current, mut rescales_seen) = (job.start, 0);
    let mut index = 0u32;
    let mut ticks = tokio::time::interval(TICK);
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let running = local.workers.running(key) as f64;
        out.borrow_mut().worker_seconds += running * (now - last_tick).as_secs_f64();
        last_tick = now;
        let clock = (now - began).as_secs_f64();
        if contender == Contender::Ours {
            let rescales = local.rescales.borrow().clone();
            for r in rescales.iter().skip(rescales_seen).filter(|r| &r.pipeline == key) {
                out.borrow_mut().rescaled((clock / period.as_secs_f64()) as u32, clock, r.to);
                current = r.to;
            }
            rescales_seen = rescales.len();
        }
        if now - last_decision < period {
            continue;
        }
        let seconds = (now - last_decision).as_secs_f64();
        last_decision = now;
        let read = progress.borrow().clone();
        let pids = local.workers.pids(key);
        let used = cpu.used_since_last(&pids);
        // Ours' windows belong to the scaling loop: taking them here would starve it.
        let windows = match contender {
            Contender::Ours => Vec::new(),
            _ => windows.take(local, key),
        };
        let window = combine(&windows, current);
        let measured = Measurement {
            window: window.clone().unwrap_or_default(),
            seconds,
            waited: (read.waited - last_read.waited).as_secs_f64(),
            utilisation: used / (seconds * pids.len().max(1) as f64 * request),
            ready: (read.ready_batch_seconds - last_read.ready_batch_seconds) / seconds,
        };
        last_read = read;
        out.borrow_mut().trace.push((clock, current, measured.window.median_s));
        // The controller reads only the clock and the count of the world it was written for.
        let mut world = World::new(job.trainer.clone(), current);
        world.clock = clock;
        let judged = contender != Contender::Ours && (window.is_some() || !reads_windows);
        if judged && let Decision::Scale { to, reason } = controller.decide(&measured, &world) {
            tracing::info!(contender = %contender.name(), pipeline = %key, from = current, to, %reason, "rescaling");
            if let Err(e) = local.workers.scale(key, to).await {
                tracing::warn!(error = format!("{e:#}"), "rescaling failed");
            }
            current = to;
            out.borrow_mut().rescaled(index, clock, to);
        }
        out.borrow_mut().final_workers = current;
        index += 1;
    }
}

/// The CPU one worker uses per batch a second, in cores: one worker capped at `rate`, fed to
/// a trainer that never waits, measured for `measure` after `warm_up`.
pub async fn calibrate(setting: &Setting<'_>, rate: f64, warm_up: Duration, measure: Duration) -> anyhow::Result<f64> {
    let trainer = Trainer { rate, ..Trainer::with_optimum(1, 1.0 / rate) };
    let job = Job { name: "calibration".into(), trainer, steps: 0, limits: Limits { min: 1, max: 1 }, start: 1 };
    let local = start_local(setting, Contender::Fixed { times: 1 }, &job, None).await?;
    let mut client = connect(&local, &local.key, setting.config).await?;
    let trainer = TrainerSpec::steady(Duration::ZERO);
    let measuring = async {
        tokio::time::sleep(warm_up).await;
        let pids = local.workers.pids(&local.key);
        anyhow::ensure!(pids.len() == 1, "calibrating with {} workers, not 1", pids.len());
        let mut cpu = CpuMeter::default();
        cpu.used_since_last(&pids);
        let began = Instant::now();
        tokio::time::sleep(measure).await;
        Ok(cpu.used_since_last(&pids) / began.elapsed().as_secs_f64())
    };
    let training = train(&mut client, &trainer, Stop::default(), |_, _| {});
    let cores = tokio::select! {
        cores = measuring => cores,
        trained = training => Err(anyhow::anyhow!("the calibration's stream ended: {:?}", trained.map(|s| s.steps))),
    };
    drop(client);
    local.shutdown().await;
    let cores = cores?;
    anyhow::ensure!(cores > 0.0, "a worker at its cap used no CPU");
    Ok(cores / rate)
}
