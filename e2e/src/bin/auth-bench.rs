//! `auth-bench`: what access control costs a training client, end to end on the local provider
//! (etcd and kube-apiserver processes, the operator and its workers as processes).
//!
//! ```sh
//! cargo build --release --workspace --bins
//! target/release/auth-bench [--rounds 4] [--setups 20] [--seconds 10] [--batch-size 256]
//! ```
//!
//! Rounds alternate authentication off (`--authentication=none`) and on (the default:
//! TokenReview and SubjectAccessReview against the API server), so a drift of the machine hits
//! both. Each round measures, from the client's side: stream setup (creating the client to its
//! first batch) with the same token every time (verdicts cached), with a fresh ServiceAccount's
//! token every time (auth on only: the dispatcher reviews each), and one client's steady read.
//! The operator and worker binaries are taken from beside this one (so a release build runs
//! release binaries) unless `STOKER_OPERATOR_BIN` / `STOKER_WORKER_BIN` say otherwise.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, ListParams, Patch, PatchParams};
use stoker_api::DataPipeline;
use stoker_client::{Client, ClientOptions};
use stoker_e2e::k8s::{fresh_namespace, service_account_can};
use stoker_e2e::kubelet::ProcessKubelet;
use stoker_e2e::local::LocalControlPlane;
use stoker_e2e::tenants::{grant_reader, reader_options, token};
use stoker_e2e::{Check, Cluster, OperatorOptions, wait_for};

const PIPELINE: &str = "authbench";
/// One split per file: 400,000 rows an epoch, so a steady read crosses an epoch end every
/// second or two, as a training loop would.
const FILES: usize = 16;
const ROWS_PER_FILE: usize = 25_000;

struct Args {
    rounds: usize,
    setups: usize,
    seconds: u64,
    batch_size: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
}

impl Mode {
    fn name(self) -> &'static str {
        if self == Mode::On { "on" } else { "off" }
    }
}

struct Steady {
    seconds: f64,
    batches: u64,
    rows: u64,
    bytes: u64,
    /// Cores used over the read, per process of this run by command name; "machine" is all of
    /// the machine, "others" what processes outside this run took of it.
    cores: BTreeMap<String, f64>,
}

struct Round {
    mode: Mode,
    cached: Vec<f64>,
    fresh: Vec<f64>,
    steady: Steady,
}

fn usage() -> ! {
    eprintln!("usage: auth-bench [--rounds N] [--setups N] [--seconds S] [--batch-size N]");
    std::process::exit(2);
}

fn main() {
    let mut args = Args { rounds: 4, setups: 20, seconds: 10, batch_size: 256 };
    let mut argv = std::env::args().skip(1);
    while let Some(flag) = argv.next() {
        let value = argv.next().unwrap_or_else(|| usage());
        match (flag.as_str(), value.parse::<u64>()) {
            ("--rounds", Ok(n)) if n > 0 => args.rounds = n as usize,
            ("--setups", Ok(n)) if n > 0 => args.setups = n as usize,
            ("--seconds", Ok(n)) if n > 0 => args.seconds = n,
            ("--batch-size", Ok(n)) if (1..=65536).contains(&n) => args.batch_size = n as u32,
            _ => usage(),
        }
    }
    // The harness runs target/debug binaries by default; a benchmark wants the build it is
    // part of. Set before any thread exists, so no other thread reads the environment.
    if let Some(dir) = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf())) {
        for (var, name) in [("STOKER_OPERATOR_BIN", "stoker-operator"), ("STOKER_WORKER_BIN", "stoker-worker")] {
            if std::env::var_os(var).is_none() && dir.join(name).is_file() {
                // SAFETY: single-threaded here (no runtime yet).
                unsafe { std::env::set_var(var, dir.join(name)) };
            }
        }
    }
    stoker_e2e::cluster::install_tls_provider();
    let result =
        tokio::runtime::Runtime::new().context("building the tokio runtime").and_then(|rt| rt.block_on(run(&args)));
    if let Err(e) = result {
        eprintln!("auth-bench: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: &Args) -> anyhow::Result<()> {
    for var in ["STOKER_OPERATOR_BIN", "STOKER_WORKER_BIN"] {
        eprintln!("{var} = {:?}", std::env::var_os(var).unwrap_or_else(|| "(harness default: target/debug)".into()));
    }
    eprintln!("starting etcd, kube-apiserver and kube-controller-manager ...");
    let cluster = LocalControlPlane::start().await?;
    let result = bench(&cluster, args).await;
    if result.is_err() {
        eprintln!("{}", cluster.diagnostics().await);
    }
    cluster.shutdown().await;
    let rounds = result?;
    summary(&rounds);
    Ok(())
}

async fn bench(cluster: &LocalControlPlane, args: &Args) -> anyhow::Result<Vec<Round>> {
    let client = cluster.client();
    let url = cluster.dispatcher_url()?;
    let ns = fresh_namespace(&client, "authbench").await?;
    let data = cluster.workdir().join("authbench-data");
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    for f in 0..FILES {
        let lines: String = (0..ROWS_PER_FILE)
            .map(|i| format!("{{\"id\": {}, \"label\": {}}}\n", f * ROWS_PER_FILE + i, i % 1000))
            .collect();
        let path = data.join(format!("{f:02}.jsonl"));
        std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))?;
    }
    let seen_as = cluster.worker_data(&data);
    let manifest = format!(
        "apiVersion: stoker.dev/v1alpha1\nkind: DataPipeline\nmetadata: {{name: {PIPELINE}}}\nspec:\n  \
         source: {{uri: 'file://{}/', format: jsonl}}\n  batchSize: {}\n  \
         autoscaling: {{mode: Fixed, replicas: 1}}\n  workers: {{{}}}\n",
        seen_as.path,
        args.batch_size,
        seen_as.more_fields()
    );
    let dp: DataPipeline = serde_yaml::from_str(&manifest).context("parsing the DataPipeline")?;
    let mut workers: Option<ProcessKubelet> = None;
    let mut rounds = Vec::new();
    for n in 0..args.rounds {
        let mode = if n % 2 == 0 { Mode::Off } else { Mode::On };
        eprintln!("round {} (auth {}): restarting the operator and the workers ...", n + 1, mode.name());
        switch_mode(cluster, &mut workers, mode).await?;
        if n == 0 {
            Api::<DataPipeline>::namespaced(client.clone(), &ns)
                .patch(PIPELINE, &PatchParams::apply("auth-bench").force(), &Patch::Apply(&dp))
                .await
                .context("applying the DataPipeline")?;
        }
        // Worker processes keep the environment they started with: new ones start only once the
        // Deployment is the one the new mode makes.
        wait_for(Duration::from_secs(60), format!("the workers Deployment for auth {}", mode.name()), || {
            deployment_matches(client.clone(), ns.clone(), mode)
        })
        .await?;
        workers = cluster.run_workers(&ns)?;

        let mut options = reader_options(&client, &ns, PIPELINE).await?;
        options.job = format!("setup-{n}");
        // Fresh readers for the uncached setups, made before any timer: one ServiceAccount each,
        // as the SubjectAccessReview verdict is cached per user, and this API server's tokens
        // for one account made in the same second are the same token.
        let mut fresh_tokens = Vec::new();
        if mode == Mode::On {
            for i in 0..args.setups {
                let sa = format!("fresh-{n}-{i}");
                grant_reader(&client, &ns, (&ns, &sa)).await?;
                fresh_tokens.push(token(&client, &ns, &sa, stoker_api::token::DEFAULT_AUDIENCE).await?);
            }
            let last = format!("fresh-{n}-{}", args.setups - 1);
            wait_for(Duration::from_secs(30), "RBAC to see the last RoleBinding", || {
                let (client, ns, last) = (client.clone(), ns.clone(), last.clone());
                async move {
                    let can =
                        service_account_can(&client, (&ns, &last), "get", "datapipelines.stoker.dev/stream", Some(&ns));
                    Ok(if can.await? { Check::Done(()) } else { Check::not_yet("not allowed yet") })
                }
            })
            .await?;
        }
        // Ready once a worker of this mode serves a batch; this read is also the warm-up that
        // puts the token's verdicts in the caches.
        wait_for(Duration::from_secs(120), "a worker to serve the first batch", || {
            let (url, options) = (url.clone(), options.clone());
            async move {
                let first = setup_time(&url, options, Duration::from_secs(10)).await;
                Ok(first.map_or_else(|e| Check::not_yet(format!("{e:#}")), |_| Check::Done(())))
            }
        })
        .await?;
        // The dispatcher is in the mode asked for: a client without a token is refused iff on.
        let mut tokenless = options.clone();
        tokenless.token = None;
        let refused = Client::from_dispatcher(&url, tokenless).await.is_err();
        ensure!(refused == (mode == Mode::On), "auth {}: a tokenless client refused: {refused}", mode.name());

        let cached = setups(&url, vec![options.clone(); args.setups]).await?;
        let with = |t: String| ClientOptions { token: Some(t), ..options.clone() };
        let fresh = setups(&url, fresh_tokens.into_iter().map(with).collect()).await?;
        let steady =
            steady_read(&url, ClientOptions { job: format!("steady-{n}"), ..options.clone() }, args.seconds).await?;
        let round = Round { mode, cached, fresh, steady };
        print_round(n + 1, &round);
        rounds.push(round);
    }
    if let Some(old) = workers.take() {
        tokio::task::spawn_blocking(move || drop(old)).await.context("stopping the workers")?;
    }
    Ok(rounds)
}

/// Stops the workers (off the runtime: it waits for them to exit) and restarts the operator in
/// `mode`; the harness starts it afresh, as only a stopped instance takes new arguments.
async fn switch_mode(
    cluster: &LocalControlPlane,
    workers: &mut Option<ProcessKubelet>,
    mode: Mode,
) -> anyhow::Result<()> {
    if let Some(old) = workers.take() {
        tokio::task::spawn_blocking(move || drop(old)).await.context("stopping the workers")?;
    }
    cluster.operator_stop().await?;
    let opts = OperatorOptions::default();
    cluster.operator_start(if mode == Mode::Off { opts.arg("--authentication=none") } else { opts }).await
}

/// Whether the pipeline's workers Deployment is what the operator makes in `mode`: readers
/// authorised (with a projected token) when on, not when off.
async fn deployment_matches(client: kube::Client, ns: String, mode: Mode) -> anyhow::Result<Check<()>> {
    let list = Api::<Deployment>::namespaced(client, &ns)
        .list(&ListParams::default().labels("app.kubernetes.io/component=worker"))
        .await?;
    let Some(deployment) = list.items.first() else { return Ok(Check::not_yet("no workers Deployment yet")) };
    let pod = deployment.spec.template.spec.as_ref();
    let env = pod.and_then(|p| p.containers.first()).and_then(|c| c.env.clone()).unwrap_or_default();
    let authorizes = env.iter().any(|e| e.name == "STOKER_AUTHORIZE_READERS" && e.value.as_deref() == Some("true"));
    Ok(if authorizes == (mode == Mode::On) {
        Check::Done(())
    } else {
        Check::not_yet(format!("STOKER_AUTHORIZE_READERS set: {authorizes}"))
    })
}

/// `setup_time` of one client after another, each with its options.
async fn setups(url: &str, clients: Vec<ClientOptions>) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(clients.len());
    for options in clients {
        times.push(setup_time(url, options, Duration::from_secs(60)).await?);
    }
    Ok(times)
}

/// Milliseconds from creating a client to its first batch; the client leaves afterwards.
async fn setup_time(url: &str, options: ClientOptions, first_within: Duration) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut client = Client::from_dispatcher(url, options).await.context("registering a client")?;
    match tokio::time::timeout(first_within, client.next()).await {
        Ok(Some(Ok(_))) => Ok(start.elapsed().as_secs_f64() * 1e3),
        Ok(Some(Err(e))) => Err(e).context("reading the first batch"),
        Ok(None) => bail!("the stream ended before the first batch"),
        Err(_) => bail!("no first batch within {first_within:?}"),
    }
}

/// One client reading for `seconds` after its first batch; counts what arrives, and the CPU
/// time of this run's processes meanwhile, to say what bounds the rate.
async fn steady_read(url: &str, options: ClientOptions, seconds: u64) -> anyhow::Result<Steady> {
    let mut client = Client::from_dispatcher(url, options).await.context("registering the steady client")?;
    match tokio::time::timeout(Duration::from_secs(60), client.next()).await {
        Ok(Some(Ok(_))) => {}
        other => bail!("the steady client got no first batch: {:?}", other.map(|b| b.map(|r| r.err()))),
    }
    let (cpu_before, machine_before) = (process_cpu()?, machine_cpu()?);
    let start = Instant::now();
    let end = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let (mut batches, mut rows, mut bytes) = (0u64, 0u64, 0u64);
    // Cancelling `next` at the deadline loses nothing: a batch is only taken when returned.
    while let Ok(next) = tokio::time::timeout_at(end, client.next()).await {
        let batch = next.context("the stream ended")?.context("reading a batch")?;
        batches += 1;
        rows += batch.rows.len() as u64;
        bytes += batch.tensors.values().map(|t| t.data.len() as u64).sum::<u64>();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (cpu_after, machine_after) = (process_cpu()?, machine_cpu()?);
    let mut cores: BTreeMap<String, f64> = cpu_after
        .iter()
        .map(|(name, after)| (name.clone(), (after - cpu_before.get(name).copied().unwrap_or(0.0)) / elapsed))
        .filter(|(_, c)| *c >= 0.005)
        .collect();
    let ours: f64 = cores.values().sum();
    let machine = (machine_after - machine_before) / elapsed;
    // What other jobs on the machine took meanwhile: they compete for the same cores.
    cores.insert("others".into(), (machine - ours).max(0.0));
    cores.insert("machine".into(), machine);
    Ok(Steady { seconds: elapsed, batches, rows, bytes, cores })
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// CPU seconds (user + system) of this process and of its children, summed by command name.
fn process_cpu() -> anyhow::Result<BTreeMap<String, f64>> {
    let me = std::process::id().to_string();
    let mut seconds = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").context("listing /proc")? {
        let pid = entry.context("listing /proc")?.file_name().to_string_lossy().into_owned();
        // A process may exit between the listing and the read: skip it.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let (Some((head, tail)), true) = (stat.rsplit_once(')'), pid.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let fields: Vec<&str> = tail.split_whitespace().collect();
        let name = match head.split_once('(') {
            _ if pid == me => "auth-bench (client)",
            Some((_, comm)) if fields.get(1) == Some(&me.as_str()) => comm,
            _ => continue,
        };
        let ticks: f64 = fields.get(11..13).into_iter().flatten().filter_map(|f| f.parse::<f64>().ok()).sum();
        *seconds.entry(name.to_string()).or_insert(0.0) += ticks / clock_ticks();
    }
    Ok(seconds)
}

/// CPU seconds the whole machine spent busy (not idle nor waiting for I/O), from /proc/stat.
fn machine_cpu() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let ticks: Vec<f64> = line.split_whitespace().skip(1).take(8).filter_map(|f| f.parse().ok()).collect();
    ensure!(ticks.len() == 8, "unexpected /proc/stat line: {line}");
    Ok((ticks.iter().sum::<f64>() - ticks[3] - ticks[4]) / clock_ticks())
}

/// (p50, p95, mean) by nearest rank.
fn stats(samples: &[f64]) -> Option<(f64, f64, f64)> {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    (!sorted.is_empty()).then(|| (rank(0.50), rank(0.95), sorted.iter().sum::<f64>() / sorted.len() as f64))
}

fn stats_cell(samples: &[f64]) -> String {
    stats(samples).map_or_else(|| "-".into(), |(p50, p95, mean)| format!("{p50:.2} / {p95:.2} / {mean:.2}"))
}

fn print_round(n: usize, r: &Round) {
    let s = &r.steady;
    println!("\nround {n}: auth {}", r.mode.name());
    println!("  setup, same token (cached)  n={:<3} p50/p95/mean ms: {}", r.cached.len(), stats_cell(&r.cached));
    println!("  setup, fresh token          n={:<3} p50/p95/mean ms: {}", r.fresh.len(), stats_cell(&r.fresh));
    let raw = |v: &[f64]| v.iter().map(|ms| format!("{ms:.1}")).collect::<Vec<_>>().join(" ");
    println!("  samples ms, same token: {}; fresh token: {}", raw(&r.cached), raw(&r.fresh));
    let rate = |n: u64| n as f64 / s.seconds;
    let (batches, rows, mb) = (rate(s.batches), rate(s.rows), rate(s.bytes) / 1e6);
    println!(
        "  steady {:.2} s: {} batches ({batches:.1}/s), {} rows ({rows:.0}/s), {mb:.2} MB/s of tensors",
        s.seconds, s.batches, s.rows
    );
    let cores: Vec<String> = s.cores.iter().map(|(name, c)| format!("{name} {c:.2}")).collect();
    println!("  cores busy over the read: {}", cores.join(", "));
}

fn summary(rounds: &[Round]) {
    println!(
        "\n| round | auth | setup, same token: p50 / p95 / mean ms | setup, fresh token: p50 / p95 / mean ms | batches/s | rows/s | worker CPU µs/batch | cores: worker, client, operator, others, machine |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (n, r) in rounds.iter().enumerate() {
        let s = &r.steady;
        let names = ["stoker-worker", "auth-bench (client)", "stoker-operator", "others", "machine"];
        let cores = names.map(|name| s.cores.get(name).map_or_else(|| "0.00".into(), |c| format!("{c:.2}")));
        let (cached, fresh) = (stats_cell(&r.cached), stats_cell(&r.fresh));
        let (batches, rows) = (s.batches as f64 / s.seconds, s.rows as f64 / s.seconds);
        // The worker's CPU per batch varies less than its rate when other jobs take cores.
        let per_batch = s.cores.get("stoker-worker").copied().unwrap_or(0.0) / batches * 1e6;
        let line = format!("{cached} | {fresh} | {batches:.1} | {rows:.0} | {per_batch:.0} | {}", cores.join(", "));
        println!("| {} | {} | {line} |", n + 1, r.mode.name());
    }
    for mode in [Mode::Off, Mode::On] {
        let of_mode: Vec<&Round> = rounds.iter().filter(|r| r.mode == mode).collect();
        let pooled =
            |pick: fn(&Round) -> &Vec<f64>| of_mode.iter().flat_map(|r| pick(r).iter().copied()).collect::<Vec<_>>();
        let rates: Vec<String> =
            of_mode.iter().map(|r| format!("{:.0}", r.steady.rows as f64 / r.steady.seconds)).collect();
        println!(
            "auth {:>3}: setup same token (all rounds) {} ms; fresh token {} ms; rows/s {}",
            mode.name(),
            stats_cell(&pooled(|r| &r.cached)),
            stats_cell(&pooled(|r| &r.fresh)),
            rates.join(", ")
        );
    }
}
