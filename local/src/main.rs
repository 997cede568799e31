//! `stoker`: the user's command line. `demo` shows the autoscaler converge on this machine;
//! `local` runs a pipeline without Kubernetes; `check` validates DataPipeline files offline;
//! `explain` shows what the operator makes of manifests; `profile` measures a pipeline on
//! this machine and plans its workers.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use kube::ResourceExt;
use stoker_api::DataPipeline;
use stoker_operator::autoscaling::replicas::initial_replicas;
use stoker_operator::controller::objects::{self, WorkerDefaults};

/// Counts the allocations of `stoker bench dispatcher`'s dispatcher thread (no other thread
/// is counted; the count is one thread-local read per allocation).
#[global_allocator]
static ALLOCATOR: stoker_local::bench::dispatcher::usage::Counting = stoker_local::bench::dispatcher::usage::Counting;

#[derive(Parser)]
#[command(version, about = "Stoker: preprocessing pipelines as an autoscaled service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate DataPipeline manifests the way the operator does; exits non-zero on any problem.
    Check {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Generate an image corpus and watch the autoscaler find the worker count a synthetic
    /// trainer needs, on this machine (no cluster).
    Demo {
        /// Where the demo corpus is generated (once) and worker logs go.
        #[arg(long, default_value_os_t = stoker_local::cli::cache_dir().join("demo/corpus"))]
        corpus: PathBuf,
        /// How long the synthetic trainer runs.
        #[arg(long, default_value_t = 45)]
        seconds: u64,
        /// The trainer's compute time per batch, in milliseconds.
        #[arg(long, default_value_t = 25.0)]
        compute_ms: f64,
        /// Each worker's cap, in batches per second.
        #[arg(long, default_value_t = 10.0)]
        worker_rate: f64,
    },
    /// Run a DataPipeline on this machine: dispatcher, autoscaler and worker processes, no
    /// Kubernetes. Training clients connect to the printed dispatcher URL.
    Local(LocalArgs),
    /// Run a pipeline on a sample of its data on this machine and print what each op costs,
    /// the workers a target rate needs, the training step with and without them, and what
    /// caching or rewriting the data would save (docs/observability.md). No cluster.
    Profile(ProfileArgs),
    /// Benchmarks (see docs/performance.md).
    Bench {
        #[command(subcommand)]
        bench: Bench,
    },
    /// Walk through manifests (default: the samples): what the operator accepts, refuses, and creates.
    Explain {
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/samples"))]
        samples: PathBuf,
        /// Print the generated objects in full.
        #[arg(long)]
        yaml: bool,
    },
}

#[derive(Subcommand)]
enum Bench {
    /// Our autoscaling policy beside Cachew's rule, Kubernetes' HPA, KEDA and fixed pools in
    /// simulation: markdown tables of training time, cost and waiting per scenario, and plots.
    Autoscaler {
        /// Where to write the SVG plot of ours and Cachew's rule converging (optimum 12, 10% noise).
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Where to write the SVG plot of every policy's workers over time (optimum 12, 10% noise).
        #[arg(long)]
        workers_plot: Option<PathBuf>,
        /// Where to write the SVG plot of cost against training time, every policy and scenario.
        #[arg(long)]
        cost_plot: Option<PathBuf>,
        /// Every figure of every scenario, not only of some.
        #[arg(long)]
        all: bool,
        /// Instead of simulating: run the policies on local worker processes and the synthetic
        /// trainer through the real client, one after the other (minutes per policy).
        #[arg(long)]
        local: bool,
        /// With --local: training time at full speed of each run, in seconds.
        #[arg(long, default_value_t = 180.0)]
        seconds: f64,
        /// With --local: a scenario of the simulation to run (repeatable; default: "optimum 4"
        /// and "optimum 8 -> 16: trainer 2x faster a third in").
        #[arg(long)]
        scenario: Vec<String>,
        /// With --local: the simulation's tenants over a budget (five jobs at once on one
        /// dispatcher) instead of the default scenarios; named scenarios still run first.
        #[arg(long)]
        tenants: bool,
    },
    /// One dispatcher on one core under simulated workers and training clients over loopback
    /// gRPC: NextSplit latency, throughput, the dispatcher's CPU and memory.
    Dispatcher(DispatcherArgs),
}

#[derive(clap::Args)]
struct DispatcherArgs {
    #[arg(long, default_value_t = 1000)]
    workers: usize,
    #[arg(long, default_value_t = 1000)]
    consumers: usize,
    /// Workers and consumers are dealt to the pipelines in turn.
    #[arg(long, default_value_t = 10)]
    pipelines: usize,
    /// How long the measurement lasts, after every member registered.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// How long a simulated worker takes to produce a split, on average (each takes 0.5 to 1.5
    /// times this); 0: it asks again at once.
    #[arg(long, default_value_t = 100)]
    split_ms: u64,
    /// Splits in each pipeline's epoch.
    #[arg(long, default_value_t = 10_000)]
    splits: u64,
    /// Then stop the dispatcher, start a new one, and time until every worker and client is back.
    #[arg(long)]
    leader_change: bool,
    /// Run every size of the sweep (10 to 2000 workers and consumers, 1 to 200 pipelines)
    /// instead of the one given, printing a markdown table.
    #[arg(long)]
    sweep: bool,
    /// Print the run as one row of the sweep's table (and, with --leader-change, its figures
    /// as another line).
    #[arg(long)]
    row: bool,
}

#[derive(clap::Args)]
struct LocalArgs {
    /// The DataPipeline manifest.
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    /// Where the dispatcher listens.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: std::net::SocketAddr,
    /// Transform threads per worker process.
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    /// Caps each worker's batches per second (to emulate slower workers on a small machine).
    #[arg(long)]
    max_batch_rate: Option<f64>,
    /// Overrides the pipeline's autoscaling window, in seconds.
    #[arg(long)]
    window_seconds: Option<u32>,
    /// Stops after this many seconds (default: on Ctrl-C).
    #[arg(long)]
    seconds: Option<u64>,
    /// The directory standing in for the namespace's cache volume (default:
    /// ~/.cache/stoker/volumes/<namespace>).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Serve TLS (dispatcher and workers) with a throwaway CA made at startup; clients trust
    /// the `ca.crt` it prints. Off by default: local runs stay on loopback.
    #[arg(long)]
    tls: bool,
}

#[derive(clap::Args)]
struct ProfileArgs {
    /// The DataPipeline manifest.
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    /// Records the timed run reads (whole splits, at least one).
    #[arg(long, default_value_t = 2000)]
    elements: u64,
    /// Threads of a worker, the size the plan is for; default: the spec's worker CPU limit,
    /// else its request, else 1.
    #[arg(long)]
    worker_threads: Option<u32>,
    /// The elements (batch rows) per second the trainer needs.
    #[arg(long, conflicts_with = "trainer_step_ms")]
    target_rate: Option<f64>,
    /// The trainer's step time with its data always ready, in ms (a batch of spec.batchSize a
    /// step): the target, and the what-if of the step at each worker count.
    #[arg(long)]
    trainer_step_ms: Option<f64>,
    /// The workers the pipeline runs with now, for the what-if (default: spec.workers.min, at least 1).
    #[arg(long)]
    workers: Option<u32>,
    /// A directory on the cache volume to probe (default: the one `stoker local` uses,
    /// ~/.cache/stoker/volumes/<namespace>).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    match Cli::parse().command {
        Command::Check { files } => {
            let mut bad = 0;
            for file in &files {
                match load(file).and_then(|dp| check(&dp).map(|()| dp)) {
                    Ok(dp) => println!("{}: {} is valid", file.display(), dp.name_any()),
                    Err(e) => {
                        bad += 1;
                        println!("{}: {e:#}", file.display());
                    }
                }
            }
            if bad > 0 {
                bail!("{bad} of {} file(s) invalid", files.len());
            }
            Ok(())
        }
        Command::Explain { samples, yaml } => explain(&samples, yaml),
        Command::Profile(args) => profile(args).await,
        Command::Bench { bench: Bench::Autoscaler { local: true, seconds, scenario, tenants, .. } } => {
            stoker_local::cli::quiet_logs();
            use stoker_local::bench::policies;
            let names = match (scenario.is_empty(), tenants) {
                (true, false) => policies::DEFAULT_SCENARIOS.map(String::from).to_vec(),
                _ => scenario,
            };
            let scenarios = names.iter().map(|n| policies::scenario(n)).collect::<anyhow::Result<Vec<_>>>()?;
            let options = policies::Options {
                corpus: stoker_local::cli::cache_dir().join("demo/corpus"),
                seconds,
                config: policies::config(),
            };
            let mut contests = Vec::new();
            for s in &scenarios {
                contests.push(policies::contest(s, &options, &mut std::io::stdout()).await?);
            }
            if !contests.is_empty() {
                print!("\n{}", policies::report(&contests, &options.config));
            }
            if tenants {
                let outcomes = policies::tenants::contest(&options, &mut std::io::stdout()).await?;
                print!("\n{}", policies::tenants::report(&outcomes));
            }
            Ok(())
        }
        Command::Bench { bench: Bench::Autoscaler { plot, workers_plot, cost_plot, all, .. } } => {
            use stoker_operator::autoscaling::sim;
            let config = sim::SimConfig::default();
            let contests = sim::compare::contests(&config);
            print!("{}", sim::compare::report(&contests, &config, all));
            // The plots' trainer: optimum 12, noisy, as the documentation shows it.
            let trainer = sim::Trainer { noise: 0.1, seed: 12, ..sim::Trainer::with_optimum(12, 0.030) };
            let scenario = sim::Scenario { name: "optimum 12, 10% noise".into(), trainer: trainer.clone() };
            let plots: [(Option<PathBuf>, &dyn Fn() -> String); 3] = [
                (plot, &|| sim::convergence_svg(&trainer, &config)),
                (workers_plot, &|| sim::plot::workers_svg(&scenario, &config, 1200.0)),
                (cost_plot, &|| sim::plot::cost_svg(&contests, &config, (1.2, 0.5, 2.5))),
            ];
            for (path, svg) in plots.into_iter().filter_map(|(path, svg)| Some((path?, svg))) {
                std::fs::write(&path, svg()).with_context(|| format!("writing {}", path.display()))?;
                println!("\nwrote {}", path.display());
            }
            Ok(())
        }
        Command::Bench { bench: Bench::Dispatcher(args) } => {
            stoker_local::cli::quiet_logs();
            use stoker_local::bench::dispatcher::{self, Load};
            let load = Load {
                workers: args.workers,
                consumers: args.consumers,
                pipelines: args.pipelines,
                duration: std::time::Duration::from_secs(args.seconds),
                split_time: std::time::Duration::from_millis(args.split_ms),
                splits: args.splits,
                epochs: 0,
                leader_change: args.leader_change,
            };
            tokio::task::spawn_blocking(move || {
                if args.sweep {
                    dispatcher::sweep::sweep(&load, &mut std::io::stdout())
                } else {
                    let outcome = dispatcher::run(&load)?;
                    match args.row {
                        true => println!("{}", dispatcher::report::row(&outcome)),
                        false => print!("{}", dispatcher::report::text(&outcome)),
                    }
                    Ok(())
                }
            })
            .await?
        }
        Command::Demo { corpus, seconds, compute_ms, worker_rate } => {
            stoker_local::cli::quiet_logs();
            let options = stoker_local::demo::DemoOptions {
                corpus,
                images: stoker_local::demo::CORPUS_IMAGES,
                compute: std::time::Duration::from_secs_f64(compute_ms / 1e3),
                worker_rate,
                max_workers: 8,
                window: std::time::Duration::from_secs(2),
                run_for: std::time::Duration::from_secs(seconds),
            };
            let report = stoker_local::demo::run(&options, &mut std::io::stdout()).await?;
            println!("\n{}", stoker_local::cli::demo_summary(&report));
            Ok(())
        }
        Command::Local(args) => {
            stoker_local::cli::quiet_logs();
            let dp = load(&args.file)?;
            check(&dp)?;
            let settings = stoker_local::cli::LocalSettings {
                listen: args.listen,
                threads: args.worker_threads,
                max_batch_rate: args.max_batch_rate,
                window_seconds: args.window_seconds,
                seconds: args.seconds,
                cache_dir: args.cache_dir,
                tls: args.tls,
            };
            stoker_local::cli::local(dp, settings).await
        }
    }
}

async fn profile(args: ProfileArgs) -> anyhow::Result<()> {
    use stoker_local::profile::{self, Ask, Plan, SampleRun, Target};
    let dp = load(&args.file)?;
    check(&dp)?;
    let namespace = dp.namespace().unwrap_or_else(|| "default".into());
    let threads = args.worker_threads.unwrap_or_else(|| profile::spec_threads(&dp.spec));
    let run = SampleRun {
        worker: &stoker_local::workers::worker_binary(),
        manifest: &args.file,
        elements: args.elements,
        threads,
        cache_dir: Some(
            args.cache_dir.unwrap_or_else(|| stoker_local::cli::cache_dir().join("volumes").join(namespace)),
        ),
    };
    let sample = tokio::task::block_in_place(|| profile::sample(&run))?;
    let target = match (args.target_rate, args.trainer_step_ms) {
        (Some(rate), _) => Some(Target::Rate(rate)),
        (_, Some(ms)) => Some(Target::Step { ms }),
        _ => None,
    };
    let ask = Ask { target, workers_now: args.workers.unwrap_or(dp.spec.workers.min.max(1) as u32) };
    let plan = Plan::of(&dp.spec, &sample, &ask);
    print!("{}", profile::render::text(&dp.name_any(), &sample, &plan));
    Ok(())
}

/// A manifest as the API server would store it (schema and unknown fields checked).
fn load(path: &Path) -> anyhow::Result<DataPipeline> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(stoker_api::parse_manifest_unvalidated(&text)?)
}

fn check(dp: &DataPipeline) -> anyhow::Result<()> {
    Ok(stoker_api::validate(&dp.spec).map_err(stoker_api::ManifestError::Invalid)?)
}

fn explain(samples: &Path, yaml: bool) -> anyhow::Result<()> {
    let samples = &samples.canonicalize().with_context(|| format!("finding {}", samples.display()))?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(samples)
        .with_context(|| format!("reading samples from {}", samples.display()))?
        .chain(std::fs::read_dir(samples.join("invalid")).into_iter().flatten())
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort_by_key(|p| (p.parent() != Some(samples), p.clone()));
    let defaults = WorkerDefaults {
        image: concat!("ghcr.io/stoker-dev/stoker-worker:", env!("CARGO_PKG_VERSION")).into(),
        dispatcher_url: "http://stoker-dispatcher.stoker-system.svc:50051".into(),
        token_audience: Some(stoker_api::token::DEFAULT_AUDIENCE.into()),
        tls: false,
        network_policy: None,
    };
    println!("What the operator makes of each manifest in {}\n", samples.display());
    for file in files {
        let name = file.strip_prefix(samples).unwrap_or(&file).display().to_string();
        let mut dp = match load(&file) {
            Ok(dp) => dp,
            Err(e) => {
                println!("✗ {name}\n    refused by the CRD schema: {}\n", e.root_cause());
                continue;
            }
        };
        if let Err(e) = check(&dp) {
            println!("✗ {name}\n    {e}\n");
            continue;
        }
        dp.metadata.namespace.get_or_insert_with(|| "default".into());
        dp.metadata.uid = Some("demo".into());
        let replicas = initial_replicas(&dp.spec);
        let built = objects::build(&dp, &defaults, replicas, None, None);
        println!("✓ {name}: DataPipeline {}", dp.name_any());
        println!(
            "    Deployment {}  replicas {replicas} (workers {}..{}, {:?})",
            built.deployment.metadata.name.as_deref().unwrap_or_default(),
            dp.spec.workers.min,
            dp.spec.workers.max,
            dp.spec.autoscaling.mode
        );
        println!(
            "    Service    {}  headless, port {}",
            built.service.metadata.name.as_deref().unwrap_or_default(),
            objects::DATA_PORT
        );
        match built.cache_pvc {
            Some(_) => println!(
                "    PVC        {}  shared by the namespace (cache mode {:?})",
                objects::CACHE_PVC,
                dp.spec.cache.mode
            ),
            None => println!("    no cache volume (cache mode {:?})", dp.spec.cache.mode),
        }
        if yaml {
            for doc in [stoker_api::to_yaml(&built.deployment)?, stoker_api::to_yaml(&built.service)?] {
                println!("---\n{doc}");
            }
            if let Some(pvc) = &built.cache_pvc {
                println!("---\n{}", stoker_api::to_yaml(pvc)?);
            }
        }
        println!();
    }
    println!("Next: install the operator (docs/install.md) and `kubectl apply -f manifests/samples/`.");
    Ok(())
}
