//! Dispatcher mode: register as a consumer of a job, follow the pipeline's live worker list,
//! acknowledge what arrived (completed splits at once; when a worker leaves the list, the rows
//! it delivered, so its split is produced again without them), and report a batch-time window
//! every few seconds (the autoscaler's input).
//!
//! Failures here are the cluster's business, not the training loop's: the dispatcher being
//! unreachable or changing leader is retried, and a worker that dies is dropped because the
//! dispatcher hands its unfinished splits to the others. Only a refusal (bad request, not
//! allowed, a failed pipeline) reaches the caller.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use stoker_api::Batch;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, PipelineRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::delivery::{Delivery, Held, SplitId};
use crate::error::Error;
use crate::options::ClientOptions;
use crate::stats::{Meter, WindowStats};
use crate::tasks::Tasks;
use crate::worker_stream::{open, pump};

const RETRY: Duration = Duration::from_millis(250);

pub(crate) struct Registration {
    url: String,
    client: DispatcherClient<Channel>,
    request: proto::RegisterClientRequest,
    token: Option<String>,
    window: Duration,
}

impl Registration {
    /// Registers, retrying an unreachable dispatcher for the options' connect timeout.
    pub(crate) async fn register(url: &str, options: &ClientOptions) -> Result<Registration, Error> {
        let dispatcher = |status: Status| Error::Dispatcher { url: url.to_string(), status: Box::new(status) };
        let channel = Endpoint::from_shared(url.to_string())
            .map_err(|e| Error::InvalidOptions(format!("dispatcher url {url:?}: {e}")))?
            .connect_timeout(options.connect_timeout)
            .connect_lazy();
        let mut link = Registration {
            url: url.to_string(),
            client: DispatcherClient::new(channel),
            request: proto::RegisterClientRequest {
                pipeline: Some(PipelineRef { namespace: options.namespace.clone(), name: options.pipeline.clone() }),
                job: options.job.clone(),
                consumer_index: options.consumer_index,
                client_id: String::new(),
            },
            token: options.token.clone(),
            window: Duration::from_secs(10),
        };
        let deadline = tokio::time::Instant::now() + options.connect_timeout;
        loop {
            match link.try_register().await {
                Ok(()) => return Ok(link),
                Err(s) if retryable(&s) && tokio::time::Instant::now() < deadline => tokio::time::sleep(RETRY).await,
                Err(s) => return Err(dispatcher(s)),
            }
        }
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(value) = self.token.as_deref().and_then(|t| proto::bearer(t).parse().ok()) {
            request.metadata_mut().insert(proto::AUTHORIZATION, value);
        }
        request
    }

    async fn try_register(&mut self) -> Result<(), Status> {
        let response = self.client.register_client(self.request(self.request.clone())).await?.into_inner();
        if response.window_ms > 0 {
            self.window = Duration::from_millis(u64::from(response.window_ms));
        }
        tracing::info!(dispatcher = %self.url, client = %response.client_id, "registered with the dispatcher");
        self.request.client_id = response.client_id;
        Ok(())
    }

    async fn report(&mut self, stats: WindowStats, workers: usize) -> Result<(), Status> {
        let report = proto::ReportWindowRequest {
            client_id: self.request.client_id.clone(),
            batches: stats.batches,
            median_seconds: stats.median.as_secs_f64(),
            mean_seconds: if stats.batches > 0 {
                stats.total_batch_time.as_secs_f64() / stats.batches as f64
            } else {
                0.0
            },
            p90_seconds: stats.p90.as_secs_f64(),
            wait_fraction: stats.wait_fraction,
            workers: workers as u32,
        };
        match self.client.report_window(self.request(report.clone())).await {
            // The dispatcher restarted and forgot us: register again under the same id.
            Err(s) if s.code() == Code::NotFound => {
                self.try_register().await?;
                self.client.report_window(self.request(report)).await.map(drop)
            }
            other => other.map(drop),
        }
    }

    /// Acknowledges completions, and list `version` with the rows held from workers that
    /// left it; returns the job's open epoch.
    async fn acknowledge(&mut self, completed: &[SplitId], version: u64, held: &[Held]) -> Result<u64, Status> {
        let ack = proto::AcknowledgeRequest {
            client_id: self.request.client_id.clone(),
            completed: completed.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect(),
            list_version: version,
            held: held
                .iter()
                .map(|h| proto::HeldRows { epoch: h.split.0, split: h.split.1, positions: h.positions.clone() })
                .collect(),
        };
        let response = match self.client.acknowledge(self.request(ack.clone())).await {
            Err(s) if s.code() == Code::NotFound => {
                self.try_register().await?;
                self.client.acknowledge(self.request(ack)).await
            }
            other => other,
        };
        Ok(response?.into_inner().epoch)
    }

    async fn watch(&mut self) -> Result<tonic::Streaming<proto::WorkerList>, Status> {
        let request =
            proto::WatchWorkersRequest { pipeline: self.request.pipeline.clone(), job: self.request.job.clone() };
        Ok(self.client.watch_workers(self.request(request)).await?.into_inner())
    }
}

/// Worth retrying: the dispatcher is starting, moving or briefly unreachable.
fn retryable(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded | Code::NotFound)
}

/// A worker's answer the training loop must see rather than have hidden by a reconnect.
fn fatal(e: &Error) -> bool {
    match e {
        Error::Protocol { .. } => true,
        Error::Status { status, .. } => matches!(
            status.code(),
            Code::InvalidArgument | Code::PermissionDenied | Code::Unauthenticated | Code::FailedPrecondition
        ),
        _ => false,
    }
}

/// One worker's stream: its task, and whether a batch has come from it yet. Only workers that
/// delivered count in the reported worker count: a worker that just started is listed before
/// it produces, and windows from then would show the old count's speed as the new.
struct Streaming {
    task: JoinHandle<()>,
    delivered: Arc<AtomicBool>,
}

/// Follows the worker list, acknowledges and reports windows until the client is dropped.
pub(crate) struct Follower {
    pub link: Registration,
    pub options: ClientOptions,
    pub tx: mpsc::Sender<Result<Batch, Error>>,
    pub meter: Arc<Mutex<Meter>>,
    pub delivery: Delivery,
    pub open_epoch: Arc<AtomicU64>,
    pub tasks: Tasks,
}

impl Follower {
    pub(crate) async fn run(mut self) {
        let mut listed: BTreeSet<String> = BTreeSet::new();
        let mut version = 0;
        let mut streaming: HashMap<String, Streaming> = HashMap::new();
        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<String>();
        let mut report = tokio::time::interval(self.link.window);
        report.tick().await;
        let mut watch = None;
        // Set when there is something to acknowledge that a failed attempt left behind.
        let mut unacknowledged = false;
        loop {
            if watch.is_none() {
                match self.link.watch().await {
                    Ok(w) => watch = Some(w),
                    Err(s) => {
                        tracing::debug!(status = %s, "watching workers: retrying");
                        tokio::time::sleep(RETRY).await;
                        continue;
                    }
                }
            }
            let updates = watch.as_mut().expect("opened above");
            let retry = tokio::time::sleep(if unacknowledged { RETRY } else { Duration::from_secs(3600) });
            tokio::select! {
                update = updates.next() => match update {
                    Some(Ok(list)) => {
                        listed = list.addresses.into_iter().collect();
                        version = list.version;
                        self.open_epoch.store(list.epoch, Ordering::Relaxed);
                        // Stop the streams of workers that left, and wait until they have
                        // stopped: then every row they queued is recorded, and nothing more
                        // comes from them.
                        let gone: Vec<String> = streaming.keys().filter(|a| !listed.contains(*a)).cloned().collect();
                        for address in gone {
                            let stream = streaming.remove(&address).expect("listed above");
                            stream.task.abort();
                            let _ = stream.task.await;
                        }
                        for address in &listed {
                            if !streaming.contains_key(address) {
                                streaming.insert(address.clone(), self.stream(address, &ended_tx));
                            }
                        }
                        unacknowledged = !self.acknowledge(&listed, version).await;
                    }
                    // The dispatcher went away (leader change): watch again.
                    _ => watch = None,
                },
                Some(address) = ended_rx.recv() => {
                    streaming.remove(&address);
                    if listed.contains(&address) {
                        // Still alive as far as the dispatcher knows: reconnect after a pause.
                        tokio::time::sleep(RETRY).await;
                        streaming.insert(address.clone(), self.stream(&address, &ended_tx));
                    }
                }
                _ = self.delivery.completions.notified() => {
                    unacknowledged = !self.acknowledge(&listed, version).await;
                }
                _ = retry => {
                    unacknowledged = !self.acknowledge(&listed, version).await;
                }
                _ = report.tick() => {
                    let stats = {
                        let mut meter = self.meter.lock().unwrap();
                        let stats = meter.window();
                        meter.reset();
                        stats
                    };
                    let delivering = streaming.values().filter(|s| s.delivered.load(Ordering::Relaxed)).count();
                    if let Err(s) = self.link.report(stats, delivering).await {
                        tracing::debug!(status = %s, "reporting a batch-time window failed");
                    }
                }
            }
            if self.tx.is_closed() {
                return;
            }
        }
    }

    /// Sends what there is to acknowledge; false when it failed (it is kept for the next try).
    async fn acknowledge(&mut self, listed: &BTreeSet<String>, version: u64) -> bool {
        let (completed, held) = self.delivery.take(listed);
        match self.link.acknowledge(&completed, version, &held).await {
            Ok(epoch) => {
                self.open_epoch.store(epoch, Ordering::Relaxed);
                true
            }
            Err(s) => {
                tracing::debug!(status = %s, "acknowledging failed; retrying");
                self.delivery.restore(completed, held);
                false
            }
        }
    }

    fn stream(&self, address: &str, ended: &mpsc::UnboundedSender<String>) -> Streaming {
        let delivered = Arc::new(AtomicBool::new(false));
        let stream = stream_from(
            address.to_string(),
            self.options.clone(),
            self.tx.clone(),
            ended.clone(),
            delivered.clone(),
            self.delivery.clone(),
        );
        Streaming { task: self.tasks.spawn_joinable(stream), delivered }
    }
}

/// Streams one worker's batches; tells `ended` when the stream stops for any reason but a
/// fatal one, which goes to the caller instead.
async fn stream_from(
    worker: String,
    options: ClientOptions,
    tx: mpsc::Sender<Result<Batch, Error>>,
    ended: mpsc::UnboundedSender<String>,
    delivered: Arc<AtomicBool>,
    delivery: Delivery,
) {
    let failure = match open(&worker, &options).await {
        Ok(stream) => {
            let on_batch = || delivered.store(true, Ordering::Relaxed);
            pump(worker.clone(), stream, &tx, options.max_batch_bytes, Some(&delivery), on_batch).await
        }
        Err(e) => Some(e),
    };
    match failure {
        Some(e) if fatal(&e) => {
            tracing::error!(error = %e, "worker refused the stream");
            let _ = tx.send(Err(e)).await;
        }
        other => {
            if let Some(e) = other {
                tracing::info!(error = %e, "worker stream ended; the dispatcher reassigns its splits");
            }
            let _ = ended.send(worker);
        }
    }
}
