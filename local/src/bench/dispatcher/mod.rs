//! `stoker bench dispatcher`: one dispatcher under simulated workers and training clients.
//!
//! The dispatcher is the operator's, served over loopback gRPC by a single-threaded runtime on
//! a thread of its own pinned to one core ([`server`]); the load runs on another thread pinned
//! to the other core, every simulated member multiplexed on one single-threaded runtime, each
//! with its own connection, speaking the real protocol ([`worker`], [`client`], [`route`],
//! [`rpc`]). What they see is tallied ([`tally`]); what the dispatcher's thread costs is read
//! from the kernel and the allocator ([`usage`]); [`report`] prints it and [`sweep`] runs a
//! range of sizes.
//!
//! A run: every member registers (clients also watch); the measurement lasts `duration`; with
//! `leader_change`, the dispatcher is then stopped and a new one started on its address, and
//! the time until every worker and client is back with it, and every pipeline's splits flow
//! again, is measured.

pub mod client;
pub mod report;
pub mod route;
pub mod rpc;
pub mod server;
pub mod sweep;
pub mod tally;
pub mod usage;
pub mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use client::SimClient;
use route::Route;
use server::Served;
use tally::{Delivery, Measured, Tally};
use usage::Heap;
use worker::SimWorker;

/// The size and shape of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Load {
    pub workers: usize,
    pub consumers: usize,
    /// Workers and consumers are dealt to pipelines in turn.
    pub pipelines: usize,
    pub duration: Duration,
    /// How long a worker takes to produce a split, on average (0.5 to 1.5 times this).
    pub split_time: Duration,
    /// Splits of each pipeline's epoch.
    pub splits: u64,
    /// The measurement also lasts until every pipeline completed this many epochs, and if not
    /// 0, after a leader change until each completed one more (delivery is checked across it).
    pub epochs: u64,
    pub leader_change: bool,
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub load: Load,
    /// Whether the dispatcher and the load each had a core of their own.
    pub pinned: bool,
    /// From the start until every worker had registered and every client was watching.
    pub setup: Duration,
    /// The measurement's length.
    pub elapsed: Duration,
    pub calls: Measured,
    pub dispatcher_cpu: Duration,
    pub load_cpu: Duration,
    /// The dispatcher thread's allocations during the measurement.
    pub heap: Heap,
    /// The dispatcher thread's heap at the end of the measurement, from its start.
    pub held: i64,
    pub rss: (u64, u64),
    /// CPU time other processes of the machine used during the measurement: with both cores
    /// taken by the run, anything here was taken from it.
    pub others_cpu: Duration,
    pub delivery: Delivery,
    /// Splits the dispatcher counted as completed twice.
    pub repeats: u64,
    pub leader_change: Option<LeaderChange>,
}

/// A leader change at the run's size, timed from the old dispatcher's stop.
#[derive(Clone, Debug)]
pub struct LeaderChange {
    /// Until the new dispatcher served (stopping the old one, binding its address).
    pub serving: Duration,
    pub workers_back: Duration,
    /// Registered again (rejoined) and with the new dispatcher's worker list.
    pub clients_back: Duration,
    /// Until every pipeline had a split handed out by the new dispatcher: its job waits for
    /// every client's rejoin.
    pub splits_again: Duration,
}

/// How long setting up or coming back may take before the run fails.
const PATIENCE: Duration = Duration::from_secs(180);

impl Load {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.pipelines >= 1, "at least one pipeline");
        anyhow::ensure!(
            self.workers >= self.pipelines && self.consumers >= self.pipelines,
            "every pipeline needs a worker and a consumer: {} workers and {} consumers for {} pipelines",
            self.workers,
            self.consumers,
            self.pipelines
        );
        anyhow::ensure!(self.splits >= 1, "at least one split an epoch");
        Ok(())
    }
}

/// Runs `load` against a dispatcher of its own: the load on a thread of its own, both pinned
/// to a core each when the machine has two.
pub fn run(load: &Load) -> anyhow::Result<Outcome> {
    load.check()?;
    let pinned = usage::cpus() >= 2;
    let served = Served::start(SocketAddr::from(([127, 0, 0, 1], 0)), pinned.then_some(0))?;
    let load = load.clone();
    std::thread::Builder::new()
        .name("dispatcher-load".into())
        .spawn(move || {
            if pinned {
                usage::pin(1);
            }
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            // Dropping the runtime ends every simulated member.
            runtime.block_on(generate(load, served, pinned))
        })
        .context("starting the load's thread")?
        .join()
        .map_err(|_| anyhow::anyhow!("the load's thread panicked"))?
}

async fn generate(load: Load, mut served: Served, pinned: bool) -> anyhow::Result<Outcome> {
    let tally = Arc::new(Tally::new(load.splits));
    let url = served.url();
    let mut members = JoinSet::new();
    let mut routes: Vec<Vec<mpsc::UnboundedSender<route::Completion>>> = vec![Vec::new(); load.pipelines];
    let start = Instant::now();
    for c in 0..load.consumers {
        let (tx, completions) = mpsc::unbounded_channel();
        let pipeline = c % load.pipelines;
        routes[pipeline].push(tx);
        let client =
            SimClient { index: c, pipeline, rank: (c / load.pipelines) as u32, tally: tally.clone(), completions };
        members.spawn(client.run(url.clone()));
    }
    let routes: Vec<Arc<Route>> = routes.into_iter().map(|r| Arc::new(Route::new(r))).collect();
    for index in 0..load.workers {
        let pipeline = index % load.pipelines;
        let worker = SimWorker {
            index,
            pipeline,
            splits: load.splits,
            split_time: load.split_time,
            tally: tally.clone(),
            route: routes[pipeline].clone(),
        };
        members.spawn(worker.run(url.clone()));
    }
    let first = served.dispatcher.with_state(|s| s.incarnation());
    wait_for("every worker and client to register", &mut members, || everyone_back(&tally, first, &load)).await?;
    let setup = start.elapsed();

    tally.start_measuring();
    let (cpu, load_cpu, heap, rss) = (served.cpu()?, own_cpu()?, Heap::now(), usage::rss_bytes()?);
    let others = usage::machine_busy()?.saturating_sub(usage::process_cpu()?);
    let begun = Instant::now();
    watch_members(&mut members, load.duration).await?;
    let epochs_done = || tally.fewest_complete(load.pipelines) >= load.epochs;
    wait_for("every pipeline to complete its epochs", &mut members, epochs_done).await?;
    let calls = tally.stop_measuring();
    let elapsed = begun.elapsed();
    let dispatcher_cpu = served.cpu()? - cpu;
    let load_cpu = own_cpu()? - load_cpu;
    let heap_now = Heap::now();
    let rss = (rss, usage::rss_bytes()?);
    let others_cpu = usage::machine_busy()?.saturating_sub(usage::process_cpu()?).saturating_sub(others);

    let leader_change = if load.leader_change {
        let (change, again) = change_leader(served, &tally, &load, &mut members).await?;
        served = again;
        if load.epochs > 0 {
            let before = tally.fewest_complete(load.pipelines);
            let one_more = || tally.fewest_complete(load.pipelines) > before;
            wait_for("every pipeline to complete an epoch after the leader change", &mut members, one_more).await?;
        }
        Some(change)
    } else {
        None
    };
    members.abort_all();
    let repeats = served.dispatcher.with_state(|s| s.delivery_statuses().values().map(|d| d.splits_repeated).sum());
    Ok(Outcome {
        load,
        pinned,
        setup,
        elapsed,
        calls,
        dispatcher_cpu,
        load_cpu,
        heap: heap_now.since(&heap),
        held: heap_now.held(),
        rss,
        others_cpu,
        delivery: tally.delivery(),
        repeats,
        leader_change,
    })
}

/// Stops the dispatcher and starts a new one on its address; times the members' return.
async fn change_leader(
    served: Served,
    tally: &Arc<Tally>,
    load: &Load,
    members: &mut JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<(LeaderChange, Served)> {
    let (addr, old) = (served.addr, served.dispatcher.with_state(|s| s.incarnation()));
    let cpu = usage::cpus() >= 2;
    let stopped = Instant::now();
    let again = tokio::task::spawn_blocking(move || {
        served.stop();
        Served::start(addr, cpu.then_some(0))
    })
    .await??;
    let serving = stopped.elapsed();
    let new = again.dispatcher.with_state(|s| s.incarnation());
    anyhow::ensure!(new != old, "the new dispatcher has the old one's incarnation");
    let all_flowing = || {
        let b = tally.backs(new);
        everyone_back(tally, new, load) && b.first_split.len() == load.pipelines
    };
    wait_for("every member to come back to the new dispatcher", members, all_flowing).await?;
    let b = tally.backs(new);
    let since = |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t.saturating_duration_since(stopped));
    let change = LeaderChange {
        serving,
        workers_back: since(b.last_worker),
        clients_back: since(b.last_client),
        splits_again: since(b.first_split.values().max().copied()),
    };
    Ok((change, again))
}

fn everyone_back(tally: &Tally, incarnation: u64, load: &Load) -> bool {
    let b = tally.backs(incarnation);
    b.workers == load.workers && b.clients == load.consumers
}

/// Waits until `done`, failing after `PATIENCE` or as soon as a member fails.
async fn wait_for(
    what: &str,
    members: &mut JoinSet<anyhow::Result<()>>,
    done: impl Fn() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "waited {PATIENCE:?} for {what}");
        check_members(members)?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Lets the members run for `duration`, failing as soon as one fails.
async fn watch_members(members: &mut JoinSet<anyhow::Result<()>>, duration: Duration) -> anyhow::Result<()> {
    let end = tokio::time::Instant::now() + duration;
    while tokio::time::Instant::now() < end {
        check_members(members)?;
        tokio::time::sleep_until(end.min(tokio::time::Instant::now() + Duration::from_millis(100))).await;
    }
    check_members(members)
}

/// A member that ended failed (they run until stopped).
fn check_members(members: &mut JoinSet<anyhow::Result<()>>) -> anyhow::Result<()> {
    match members.try_join_next() {
        None => Ok(()),
        Some(Ok(Ok(()))) => anyhow::bail!("a simulated member stopped"),
        Some(Ok(Err(e))) => Err(e.context("a simulated member failed")),
        Some(Err(e)) => Err(anyhow::Error::new(e).context("a simulated member panicked")),
    }
}

/// CPU time of the load's thread so far.
fn own_cpu() -> anyhow::Result<Duration> {
    usage::thread_cpu(usage::thread_id())
}
