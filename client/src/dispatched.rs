//! Dispatcher mode: register as a consumer of a job, follow the pipeline's live worker list,
//! and report a batch-time window every few seconds (the autoscaler's input).
//!
//! Failures here are the cluster's business, not the training loop's: the dispatcher being
//! unreachable or changing leader is retried, and a worker that dies is dropped because the
//! dispatcher hands its unfinished splits to the others. Only a refusal (bad request, not
//! allowed, a failed pipeline) reaches the caller.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use stoker_api::Batch;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, PipelineRef};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::error::Error;
use crate::options::ClientOptions;
use crate::stats::{Meter, WindowStats};
use crate::tasks::Tasks;
use crate::worker_stream::{open, pump};

const RETRY: Duration = Duration::from_millis(250);

/// Splits whose last batch reached the training loop: reported to the dispatcher, which is what
/// makes a split done (so data lost in transit is produced again).
#[derive(Clone, Default)]
pub(crate) struct Received(Arc<Mutex<Vec<(u64, u64)>>>);

impl Received {
    /// The splits `batch` completes, now that the training loop has it.
    pub(crate) fn record(&self, batch: &Batch) {
        self.0.lock().unwrap().extend(batch.completes.iter().map(|&split| (batch.epoch, split)));
    }

    /// Everything recorded since the last take, for a report.
    fn take(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// Splits a failed report carried: they go with the next one.
    fn restore(&self, completed: Vec<(u64, u64)>) {
        self.0.lock().unwrap().extend(completed);
    }
}

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

    async fn report(&mut self, stats: WindowStats, workers: usize, completed: &[(u64, u64)]) -> Result<(), Status> {
        let report = proto::ReportWindowRequest {
            completed: completed.iter().map(|&(epoch, split)| proto::SplitRef { epoch, split }).collect(),
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

    async fn watch(&mut self) -> Result<tonic::Streaming<proto::WorkerList>, Status> {
        let request = proto::WatchWorkersRequest { pipeline: self.request.pipeline.clone() };
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

/// Follows the worker list and reports windows until the client is dropped.
pub(crate) async fn follow(
    mut link: Registration,
    options: ClientOptions,
    tx: mpsc::Sender<Result<Batch, Error>>,
    meter: Arc<Mutex<Meter>>,
    received: Received,
    tasks: Tasks,
) {
    let mut listed: BTreeSet<String> = BTreeSet::new();
    // Per worker: its stream, and whether a batch has come from it yet. Only workers that
    // delivered count in the reported worker count: a worker that just started is listed
    // before it produces, and windows from then would show the old count's speed as the new.
    let mut streaming: HashMap<String, (AbortHandle, Arc<AtomicBool>)> = HashMap::new();
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<String>();
    let mut report = tokio::time::interval(link.window);
    report.tick().await;
    let mut watch = None;
    loop {
        if watch.is_none() {
            match link.watch().await {
                Ok(w) => watch = Some(w),
                Err(s) => {
                    tracing::debug!(status = %s, "watching workers: retrying");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            }
        }
        let updates = watch.as_mut().expect("opened above");
        tokio::select! {
            update = updates.next() => match update {
                Some(Ok(list)) => {
                    listed = list.addresses.into_iter().collect();
                    for address in &listed {
                        if !streaming.contains_key(address) {
                            let delivered = Arc::new(AtomicBool::new(false));
                            let task = stream_from(address.clone(), options.clone(), tx.clone(), ended_tx.clone(), delivered.clone());
                            streaming.insert(address.clone(), (tasks.spawn(task), delivered));
                        }
                    }
                }
                // The dispatcher went away (leader change): watch again.
                _ => watch = None,
            },
            Some(address) = ended_rx.recv() => {
                streaming.remove(&address);
                if listed.contains(&address) {
                    // Still alive as far as the dispatcher knows: reconnect after a pause.
                    tokio::time::sleep(RETRY).await;
                    let delivered = Arc::new(AtomicBool::new(false));
                    let task = stream_from(address.clone(), options.clone(), tx.clone(), ended_tx.clone(), delivered.clone());
                    streaming.insert(address, (tasks.spawn(task), delivered));
                }
            }
            _ = report.tick() => {
                let stats = {
                    let mut meter = meter.lock().unwrap();
                    let stats = meter.window();
                    meter.reset();
                    stats
                };
                let completed = received.take();
                let delivering = streaming.values().filter(|(_, d)| d.load(Ordering::Relaxed)).count();
                if let Err(s) = link.report(stats, delivering, &completed).await {
                    tracing::debug!(status = %s, "reporting a batch-time window failed");
                    received.restore(completed);
                }
            }
        }
        if tx.is_closed() {
            return;
        }
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
) {
    let failure = match open(&worker, &options).await {
        Ok(stream) => {
            pump(worker.clone(), stream, &tx, options.max_batch_bytes, || delivered.store(true, Ordering::Relaxed))
                .await
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
