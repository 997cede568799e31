//! A simulated training client, speaking to the dispatcher as stoker-client's follower does
//! (client/src/follower.rs, registration.rs): it registers as a consumer of the pipeline's
//! job, watches the worker list, acknowledges completions as soon as they arrive (several at
//! once when they arrive during a call) and after each new list, and reports a batch-time
//! window every `window_ms` the dispatcher asked for. When the dispatcher restarts it rejoins,
//! telling the new one the completions it took of the unfinished epochs, and from then takes
//! no completion of a split the old one handed out.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoker_api::proto;
use tokio::sync::mpsc;

use super::route::Completion;
use super::rpc::{self, Failed, JOB, Rpc};
use super::tally::{Call, Tally};

pub struct SimClient {
    /// Its index among all clients.
    pub index: usize,
    pub pipeline: usize,
    /// Its index among the pipeline's clients.
    pub rank: u32,
    pub tally: Arc<Tally>,
    pub completions: mpsc::UnboundedReceiver<Completion>,
}

/// The client's registration and what it has of the job.
struct Session {
    rpc: Rpc,
    pipeline: usize,
    request: proto::RegisterClientRequest,
    incarnation: u64,
    window: Duration,
    /// The newest worker list: its version, workers and the job's clients.
    version: u64,
    workers: u32,
    clients: u32,
    open_epoch: u64,
    /// The dispatcher whose list this client last had, with it registered too.
    watching: u64,
    /// Completions taken and not acknowledged yet.
    pending: Vec<(u64, u64)>,
    /// Completions taken of the open epoch and after: what a rejoin tells.
    taken: BTreeSet<(u64, u64)>,
    tally: Arc<Tally>,
}

impl SimClient {
    /// Registers and follows the job until the runtime running it stops.
    pub async fn run(mut self, url: String) -> anyhow::Result<()> {
        let mut session = Session {
            rpc: rpc::connect(&url)?,
            pipeline: self.pipeline,
            request: proto::RegisterClientRequest {
                pipeline: Some(rpc::pipeline(self.pipeline)),
                job: JOB.into(),
                consumer_index: self.rank,
                // A job whose consumers share its batches.
                consumers: 0,
                ..Default::default()
            },
            incarnation: 0,
            window: Duration::from_secs(10),
            version: 0,
            workers: 0,
            clients: 0,
            open_epoch: 0,
            watching: 0,
            pending: Vec::new(),
            taken: BTreeSet::new(),
            tally: self.tally.clone(),
        };
        session.register().await?;
        let phase = rpc::phase(self.index, session.window);
        let mut report = tokio::time::interval_at(tokio::time::Instant::now() + phase, session.window);
        let mut watch: Option<tonic::Streaming<proto::WorkerList>> = None;
        let mut unacknowledged = false;
        loop {
            let Some(updates) = watch.as_mut() else {
                match session.rpc.watch_workers(session.watch_request()).await {
                    Ok(w) => watch = Some(w.into_inner()),
                    Err(_) => {
                        session.tally.call(Call::Error);
                        tokio::time::sleep(rpc::RETRY).await;
                    }
                }
                continue;
            };
            let retry = tokio::time::sleep(if unacknowledged { rpc::RETRY } else { Duration::from_secs(3600) });
            tokio::select! {
                update = updates.message() => match update {
                    Ok(Some(list)) => unacknowledged = !session.apply(list).await?,
                    // The dispatcher went away (leader change): watch again.
                    _ => watch = None,
                },
                Some(first) = self.completions.recv() => {
                    session.take(first);
                    while let Ok(more) = self.completions.try_recv() {
                        session.take(more);
                    }
                    unacknowledged = !session.acknowledge().await?;
                }
                _ = retry => unacknowledged = !session.acknowledge().await?,
                _ = report.tick() => session.report().await?,
            }
        }
    }
}

impl Session {
    fn watch_request(&self) -> proto::WatchWorkersRequest {
        proto::WatchWorkersRequest { pipeline: self.request.pipeline.clone(), job: self.request.job.clone() }
    }

    /// Registers (rejoining when `request.rejoin` says so), retrying an unreachable dispatcher.
    async fn register(&mut self) -> anyhow::Result<()> {
        loop {
            match self.rpc.register_client(self.request.clone()).await {
                Ok(response) => {
                    let response = response.into_inner();
                    if response.window_ms > 0 {
                        self.window = Duration::from_millis(u64::from(response.window_ms));
                    }
                    self.request.client_id = response.client_id;
                    self.request.rejoin = None;
                    self.incarnation = response.incarnation;
                    return Ok(());
                }
                Err(s) => {
                    self.tally.call(Call::Error);
                    match rpc::failed(s) {
                        Failed::Fatal(s) => anyhow::bail!("the dispatcher refused a client: {s}"),
                        Failed::Forgotten | Failed::Retry => tokio::time::sleep(rpc::RETRY).await,
                    }
                }
            }
        }
    }

    /// The dispatcher restarted (or forgot this client): registers again, telling it the
    /// completions taken of the unfinished epochs; the acknowledgement of those is then moot.
    async fn rejoin(&mut self) -> anyhow::Result<()> {
        let forgotten_by = self.incarnation;
        self.request.rejoin = Some(proto::Rejoin {
            incarnation: self.incarnation,
            open_epoch: self.open_epoch,
            clients: self.clients,
            completed: self.taken.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect(),
            received: Vec::new(),
        });
        self.register().await?;
        // A new dispatcher has them from the rejoin; one that only forgot this client still
        // needs them acknowledged.
        if self.incarnation != forgotten_by {
            self.pending.clear();
        }
        Ok(())
    }

    /// A new worker list: rejoin if it comes from another dispatcher, then acknowledge it.
    async fn apply(&mut self, list: proto::WorkerList) -> anyhow::Result<bool> {
        if list.incarnation != 0 && list.incarnation != self.incarnation {
            self.rejoin().await?;
        }
        self.version = list.version;
        if !list.same_workers {
            self.workers = list.addresses.len() as u32;
        }
        self.clients = list.clients;
        self.saw_epoch(list.epoch);
        if list.incarnation == self.incarnation && self.watching != self.incarnation {
            self.watching = self.incarnation;
            self.tally.back(self.incarnation, false, Instant::now());
        }
        self.acknowledge().await
    }

    fn saw_epoch(&mut self, epoch: u64) {
        self.open_epoch = self.open_epoch.max(epoch);
        let open = self.open_epoch;
        self.taken.retain(|&(e, _)| e >= open);
    }

    /// A completion from a worker: taken, unless the dispatcher that handed its split out is
    /// not the one this client is registered with (its batches are refused from the rejoin on).
    fn take(&mut self, c: Completion) {
        if c.incarnation != self.incarnation {
            return;
        }
        self.tally.taken(self.pipeline, c.epoch, c.split);
        self.pending.push((c.epoch, c.split));
        self.taken.insert((c.epoch, c.split));
    }

    /// Acknowledges what is pending with the list version; false when the dispatcher could
    /// not be reached (kept for the next try).
    async fn acknowledge(&mut self) -> anyhow::Result<bool> {
        let completed = std::mem::take(&mut self.pending);
        let ack = proto::AcknowledgeRequest {
            client_id: self.request.client_id.clone(),
            completed: completed.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect(),
            list_version: self.version,
            ..Default::default()
        };
        let start = Instant::now();
        match self.rpc.acknowledge(ack).await {
            Ok(response) => {
                self.tally.acknowledged(completed.len(), start.elapsed());
                self.saw_epoch(response.into_inner().epoch);
                Ok(true)
            }
            Err(s) => {
                self.tally.call(Call::Error);
                self.pending.splice(0..0, completed);
                match rpc::failed(s) {
                    Failed::Forgotten => {
                        self.rejoin().await?;
                        Ok(false)
                    }
                    Failed::Retry => Ok(false),
                    Failed::Fatal(s) => anyhow::bail!("the dispatcher refused an acknowledgement: {s}"),
                }
            }
        }
    }

    /// One window of batch times, as a trainer taking 33 ms a step would measure it.
    async fn report(&mut self) -> anyhow::Result<()> {
        let report = proto::ReportWindowRequest {
            client_id: self.request.client_id.clone(),
            batches: (self.window.as_secs_f64() / 0.034) as u64,
            median_seconds: 0.033,
            p90_seconds: 0.041,
            wait_fraction: 0.02,
            workers: self.workers,
            mean_seconds: 0.034,
        };
        match self.rpc.report_window(report).await {
            Ok(_) => self.tally.call(Call::Report),
            Err(s) => {
                self.tally.call(Call::Error);
                match rpc::failed(s) {
                    Failed::Forgotten => self.rejoin().await?,
                    Failed::Retry => {}
                    Failed::Fatal(s) => anyhow::bail!("the dispatcher refused a window: {s}"),
                }
            }
        }
        Ok(())
    }
}
