//! One contender trains one scenario on real processes: `stoker-worker`s capped at the
//! scenario's worker rate, the synthetic trainer through the real client, and the contender
//! deciding from what it would read in a cluster.
//!
//! - Ours is the product: local mode's scaling loop on the clients' reported windows.
//! - The baselines are the simulator's controllers ([`Contender::controller`]), fed real
//!   readings at their own period: Cachew's rule the same reported windows (combined as the
//!   scaling loop combines them), HPA the workers' CPU over their request ([`super::cpu`]),
//!   KEDA the client's prefetch queue (the trainer's time-averaged ready batches). Their
//!   decisions scale the worker processes.
//!
//! The run's figures are the simulator's [`Run`], so the comparison's tables print both.

use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use stoker_api::window::Window;
use stoker_client::trainer::{Stop, TrainSummary, TrainerSpec, train};
use stoker_client::{Client, ClientOptions};
use stoker_operator::autoscaling::policy::Decision;
use stoker_operator::autoscaling::sim::contenders::Contender;
use stoker_operator::autoscaling::sim::{Measurement, Run, SimConfig, Trainer, World};
use stoker_operator::autoscaling::{Scaler as _, combine};

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
    /// The CPU a worker at its cap uses, in cores: the request a platform team would give the
    /// pods, which HPA's utilisation is relative to ([`calibrate`] measures it).
    pub request: f64,
    /// Overrides the baselines' own period (HPA's 15 s sync): tests run shorter.
    pub period: Option<Duration>,
}

/// How often the run samples the running workers for its cost.
const TICK: Duration = Duration::from_millis(250);

/// The synthetic trainer the client-side runs for the simulator's `trainer` over `steps`.
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

/// The demo's image pipeline within the comparison's bounds; Ours scales it, every other
/// contender starts it as a fixed pool of `start` and scales it from outside.
fn spec(
    corpus: &Path,
    config: &SimConfig,
    contender: Contender,
    start: u32,
) -> anyhow::Result<stoker_api::DataPipelineSpec> {
    let mut spec =
        stoker_api::from_yaml::<stoker_api::DataPipelineSpec>(&crate::demo::pipeline_yaml(corpus, config.limits.max))?;
    spec.workers.min = config.limits.min as i32;
    if contender != Contender::Ours {
        spec.autoscaling.mode = stoker_api::AutoscalingMode::Fixed;
        spec.autoscaling.replicas = Some(start as i32);
    }
    Ok(spec)
}

async fn start_local(setting: &Setting<'_>, spec: stoker_api::DataPipelineSpec, rate: f64) -> anyhow::Result<Local> {
    Local::start(LocalOptions {
        namespace: "bench".into(),
        name: "policies".into(),
        spec,
        listen: "127.0.0.1:0".parse()?,
        workers: LocalWorkerConfig::rate_capped(rate, setting.logs.to_path_buf()),
        window: Some(Duration::from_secs_f64(setting.config.window_seconds)),
        budget: None,
        tls_dir: None,
    })
    .await
}

async fn connect(local: &Local, config: &SimConfig) -> anyhow::Result<Client> {
    let mut options = ClientOptions::new(&local.key.namespace, &local.key.name);
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
    let config = setting.config;
    let start = contender.start(config.limits, optimum);
    let local = start_local(setting, spec(setting.corpus, config, contender, start)?, trainer.rate).await?;
    let mut client = connect(&local, config).await?;
    let progress = RefCell::new(TrainSummary::default());
    let out = RefCell::new(Run { most_workers: start, final_workers: start, ..Run::default() });
    let spec = trainer_spec(trainer);
    let training = train(&mut client, &spec, Stop { steps: Some(steps), after: None }, |s, _| {
        *progress.borrow_mut() = s.clone();
    });
    let deciding = decide(contender, trainer, start, setting, &local, &progress, &out);
    // Deciding never ends: it stops when training does.
    let summary = tokio::select! {
        summary = training => summary,
        never = deciding => match never {},
    }?;
    drop(client);
    local.shutdown().await;
    let mut run = out.into_inner();
    run.seconds = summary.elapsed.as_secs_f64();
    run.batches = summary.steps;
    run.waited = summary.waited.as_secs_f64();
    Ok(run)
}

/// Samples the running workers into the run's cost, and lets the contender decide at its
/// period: baselines from their readings, Ours by the scaling loop (its rescales recorded).
async fn decide(
    contender: Contender,
    trainer: &Trainer,
    start: u32,
    setting: &Setting<'_>,
    local: &Local,
    progress: &RefCell<TrainSummary>,
    out: &RefCell<Run>,
) -> std::convert::Infallible {
    let config = setting.config;
    let mut controller = contender.controller(config.limits, start, config);
    let period = setting.period.unwrap_or(Duration::from_secs_f64(controller.period()));
    let reads_windows =
        matches!(contender, Contender::Ours | Contender::Cachew | Contender::Fixed { .. } | Contender::Max);
    let mut cpu = CpuMeter::default();
    cpu.used_since_last(&local.workers.pids(&local.key));
    let began = Instant::now();
    let (mut last_tick, mut last_decision) = (began, began);
    let mut last_read = progress.borrow().clone();
    let (mut current, mut rescales_seen) = (start, 0);
    let mut index = 0u32;
    let mut ticks = tokio::time::interval(TICK);
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let running = local.workers.running(&local.key) as f64;
        out.borrow_mut().worker_seconds += running * (now - last_tick).as_secs_f64();
        last_tick = now;
        let clock = (now - began).as_secs_f64();
        if contender == Contender::Ours {
            for r in local.rescales.borrow().iter().skip(rescales_seen) {
                out.borrow_mut().rescaled((clock / period.as_secs_f64()) as u32, clock, r.to);
                (current, rescales_seen) = (r.to, rescales_seen + 1);
            }
        }
        if now - last_decision < period {
            continue;
        }
        let seconds = (now - last_decision).as_secs_f64();
        last_decision = now;
        let read = progress.borrow().clone();
        let pids = local.workers.pids(&local.key);
        let used = cpu.used_since_last(&pids);
        // Ours' windows belong to the scaling loop: taking them here would starve it.
        let windows: Vec<Window> = match contender {
            Contender::Ours => Vec::new(),
            _ => local
                .dispatcher
                .with_state(|s| s.take_windows())
                .into_iter()
                .filter(|jw| jw.pipeline == local.key)
                .flat_map(|jw| jw.windows)
                .collect(),
        };
        let window = combine(&windows, current);
        let measured = Measurement {
            window: window.clone().unwrap_or_default(),
            seconds,
            waited: (read.waited - last_read.waited).as_secs_f64(),
            utilisation: used / (seconds * pids.len().max(1) as f64 * setting.request),
            ready: (read.ready_batch_seconds - last_read.ready_batch_seconds) / seconds,
        };
        last_read = read;
        out.borrow_mut().trace.push((clock, current, measured.window.median_s));
        // The controller reads only the clock and the count of the world it was written for.
        let mut world = World::new(trainer.clone(), current);
        world.clock = clock;
        let judged = contender != Contender::Ours && (window.is_some() || !reads_windows);
        if judged && let Decision::Scale { to, reason } = controller.decide(&measured, &world) {
            tracing::info!(contender = %contender.name(), from = current, to, %reason, "rescaling");
            if let Err(e) = local.workers.scale(&local.key, to).await {
                tracing::warn!(error = format!("{e:#}"), "rescaling failed");
            }
            current = to;
            out.borrow_mut().rescaled(index, clock, to);
        }
        out.borrow_mut().final_workers = current;
        index += 1;
    }
}

/// The CPU one worker uses at its cap of `rate` batches per second, in cores: one worker fed
/// to a trainer that never waits, measured for `measure` after `warm_up`.
pub async fn calibrate(setting: &Setting<'_>, rate: f64, warm_up: Duration, measure: Duration) -> anyhow::Result<f64> {
    let spec = spec(setting.corpus, setting.config, Contender::Fixed { times: 1 }, 1)?;
    let local = start_local(setting, spec, rate).await?;
    let mut client = connect(&local, setting.config).await?;
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
    Ok(cores)
}
