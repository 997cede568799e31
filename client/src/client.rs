//! The client: streams from workers feeding bounded prefetch queues; under the dispatcher one
//! queue per epoch, so an epoch ends cleanly.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use futures::Stream;
use stoker_api::Batch;
use stoker_api::proto::BatchChunk;
use stoker_api::proto::ResumeState;
use tokio::sync::{Notify, mpsc, oneshot};

use crate::delivery::Delivery;
use crate::epochs::{Epochs, Item};
use crate::error::Error;
use crate::follower::{Follower, Shared};
use crate::options::ClientOptions;
use crate::ration::{Ration, Step};
use crate::registration::RETRY;
use crate::registration::{Registration, Rejoining};
use crate::resume::Yielded;
use crate::stats::{Meter, WindowStats};
use crate::tasks::Tasks;
use crate::tls::WorkerTls;
use crate::worker_stream::{Cursor, WorkerKey, open, pump};

/// Streams batches from one or more workers. Dropping it stops the streams.
pub struct Client {
    source: Source,
    tasks: Tasks,
    /// Shared with the window reporter in dispatcher mode.
    meter: Arc<Mutex<Meter>>,
    /// Start of the `next()` call in progress, kept across polls.
    call_start: Option<Instant>,
    /// Under the dispatcher, the task that says goodbye to it once the client is dropped.
    follower: Option<tokio::task::JoinHandle<()>>,
}

/// Under the dispatcher: who this consumer is, and what its loop has been handed of the epoch.
struct Progress {
    job: String,
    consumers: u32,
    consumer_index: u32,
    yielded: Yielded,
    /// The epoch the job stops before (`ClientOptions::epochs`).
    end: Option<u64>,
}

enum Source {
    /// A fixed list of workers, all feeding one queue.
    Fixed(mpsc::Receiver<Item>),
    /// Under the dispatcher: the queue of the epoch being read, and what the follower shares;
    /// for a job read by ranks, what the epoch's quota holds back.
    Dispatched {
        queue: mpsc::Receiver<Item>,
        shared: Shared,
        leave: Option<oneshot::Sender<bool>>,
        ration: Option<Box<Ration>>,
        progress: Box<Progress>,
    },
}

/// What a rank's rationed queue gives.
enum Rationed {
    Batch(Batch),
    Failed(Error),
    EpochOver,
}

impl Client {
    /// Connects to every worker and opens its stream; fails if any worker is unreachable or
    /// refuses the request, so configuration mistakes surface here rather than mid-training.
    pub async fn connect(workers: Vec<String>, options: ClientOptions) -> Result<Client, Error> {
        if workers.is_empty() {
            return Err(Error::NoWorkers);
        }
        options.check()?;
        let token = options.token_source();
        // Each stream resumable: a connection that breaks while the worker stays up goes on
        // where it broke.
        let cursors: Vec<Arc<Cursor>> = workers.iter().map(|_| Arc::new(Cursor::new())).collect();
        let streams = futures::future::try_join_all(
            workers
                .iter()
                .zip(&cursors)
                .map(|(w, c)| open(w, (&options, &token), None, &WorkerTls::ByAddress, Some(c))),
        )
        .await?;
        let (tx, rx) = mpsc::channel(options.prefetch);
        let tasks = Tasks::default();
        for ((worker, stream), cursor) in workers.into_iter().zip(streams).zip(cursors) {
            let fixed = FixedStream { worker, options: options.clone(), token: token.clone(), cursor };
            tasks.spawn(fixed.pump_to_caller(stream, tx.clone()));
        }
        Ok(Client { source: Source::Fixed(rx), tasks, meter: Arc::default(), call_start: None, follower: None })
    }

    /// Registers with the dispatcher at `url`, streams from the pipeline's workers as they come
    /// and go, starting at the job's open epoch, and reports batch-time windows for the
    /// autoscaler. Fails only when the dispatcher refuses the registration (or is unreachable
    /// for the connect timeout); a leader change is retried, and a worker that dies is dropped
    /// (its splits go to the others).
    pub async fn from_dispatcher(url: &str, mut options: ClientOptions) -> Result<Client, Error> {
        options.check()?;
        let deadline = tokio::time::Instant::now() + options.connect_timeout;
        let mut link = Registration::register(url, &options).await?;
        let asked_start = options.asked_start();
        let (job, resume) = (options.job.clone(), options.resume.take());
        // Streams go to the run a resumed job goes on as.
        options.job = link.job().to_string();
        let (watch, first) = link
            .first_list(deadline)
            .await
            .map_err(|status| Error::Dispatcher { url: url.to_string(), status: Box::new(status) })?;
        // Reading starts at the job's open epoch, or at a later start epoch (the epochs between
        // are left to the job's other consumers).
        let start = first.epoch.max(asked_start);
        let epochs = Arc::new(Epochs::new(options.prefetch));
        let ranked = options.reading()?.is_ranked();
        let shared = Shared {
            epochs: epochs.clone(),
            delivery: if ranked { Delivery::ranked() } else { Delivery::default() },
            quotas: Arc::default(),
            quota_changed: Arc::default(),
            dropped_rows: Arc::default(),
            meter: Arc::default(),
            open_epoch: Arc::new(AtomicU64::new(first.epoch)),
            clients: Arc::new(AtomicU32::new(first.clients)),
            reading: Arc::new(AtomicU64::new(start)),
            switched: Arc::new(Notify::new()),
        };
        link.had = Some(Rejoining {
            delivery: shared.delivery.clone(),
            open_epoch: shared.open_epoch.clone(),
            clients: shared.clients.clone(),
        });
        let queue = epochs.take_receiver(start);
        let progress = Progress {
            job,
            consumers: options.consumers,
            consumer_index: options.consumer_index,
            end: options.epochs,
            yielded: resume.as_ref().map_or_else(|| Yielded::new(start), Yielded::resumed),
        };
        let (leave, leaving) = oneshot::channel();
        let tasks = Tasks::default();
        let follower = Follower {
            link,
            options,
            shared: shared.clone(),
            tasks: tasks.clone(),
            watch: Some(watch),
            first: Some(first),
            leave: leaving,
        };
        // Not among the tasks aborted on drop: it says goodbye to the dispatcher first.
        let follower = Some(tokio::spawn(follower.run()));
        let meter = shared.meter.clone();
        let ration = ranked.then(Box::default);
        let source = Source::Dispatched { queue, shared, leave: Some(leave), ration, progress: Box::new(progress) };
        Ok(Client { source, tasks, meter, call_start: None, follower })
    }

    /// Stops every stream and, under the dispatcher, tells it the client is leaving (with what
    /// is left to acknowledge, and whether batches were received that the loop never took),
    /// waiting at most `timeout` for that to be said. Dropping the client does the same
    /// without waiting.
    pub async fn close(mut self, timeout: std::time::Duration) {
        let follower = self.follower.take();
        drop(self);
        if let Some(follower) = follower {
            let _ = tokio::time::timeout(timeout, follower).await;
        }
    }

    /// The next batch from any worker, across epochs; None once every worker's stream has ended
    /// (fixed workers), or after the last of `ClientOptions::epochs` (under the dispatcher). An
    /// error ends that worker's stream only: the others keep delivering.
    pub async fn next(&mut self) -> Option<Result<Batch, Error>> {
        std::future::poll_fn(|cx| self.poll_batch(cx, false)).await
    }

    /// Under the dispatcher, the next batch of the epoch being read; None at its end, after
    /// which the next call reads the next epoch (None at once past `ClientOptions::epochs`).
    /// Every element of the epoch this consumer gets has come before the None. With fixed
    /// workers, like `next`.
    pub async fn next_in_epoch(&mut self) -> Option<Result<Batch, Error>> {
        std::future::poll_fn(|cx| self.poll_batch(cx, true)).await
    }

    /// Under the dispatcher, the epoch being read (0 with fixed workers).
    pub fn epoch(&self) -> u64 {
        match &self.source {
            Source::Fixed(_) => 0,
            Source::Dispatched { shared, .. } => shared.reading.load(Ordering::Relaxed),
        }
    }

    /// Under the dispatcher, the job's open epoch: every split of the epochs before it has
    /// reached a consumer of the job. 0 with fixed workers.
    pub fn open_epoch(&self) -> u64 {
        match &self.source {
            Source::Fixed(_) => 0,
            Source::Dispatched { shared, .. } => shared.open_epoch.load(Ordering::Relaxed),
        }
    }

    /// Under the dispatcher, this consumer's state after the last batch it returned: saved with
    /// a checkpoint, `ClientOptions::resume` goes on from it. None with fixed workers.
    pub fn state(&self) -> Option<ResumeState> {
        match &self.source {
            Source::Dispatched { progress: p, .. } => Some(p.yielded.state(&p.job, p.consumers, p.consumer_index)),
            Source::Fixed(_) => None,
        }
    }

    /// For a job read by ranks: rows this rank received beyond the epochs' equal counts and
    /// dropped (never yielded). 0 otherwise.
    pub fn dropped_rows(&self) -> u64 {
        match &self.source {
            Source::Dispatched { shared, .. } => shared.dropped_rows.load(Ordering::Relaxed),
            Source::Fixed(_) => 0,
        }
    }

    /// Batches ready in the prefetch queue being read: what a gauge of the queue shows (KEDA
    /// users scale on it). Completions and errors waiting there count too; a rank's rationed
    /// batches do not.
    pub fn ready(&self) -> usize {
        match &self.source {
            Source::Fixed(rx) => rx.len(),
            Source::Dispatched { queue, .. } => queue.len(),
        }
    }

    /// Batch-time statistics since the last reset.
    /// In dispatcher mode the window restarts after each report to the dispatcher.
    pub fn window(&self) -> WindowStats {
        self.meter.lock().unwrap().window()
    }

    pub fn reset_window(&mut self) {
        self.meter.lock().unwrap().reset();
    }

    fn poll_batch(&mut self, cx: &mut Context<'_>, stop_at_epoch_end: bool) -> Poll<Option<Result<Batch, Error>>> {
        let start = match self.call_start {
            Some(start) => start,
            None => {
                let now = Instant::now();
                self.meter.lock().unwrap().call_started(now);
                *self.call_start.insert(now)
            }
        };
        loop {
            if let Source::Dispatched { shared, progress, .. } = &self.source
                && progress.end.is_some_and(|end| shared.reading.load(Ordering::Relaxed) >= end)
            {
                // Past the job's last epoch: nothing streams, nothing more comes.
                self.call_start = None;
                return Poll::Ready(None);
            }
            let item = match &mut self.source {
                Source::Fixed(rx) => std::task::ready!(rx.poll_recv(cx)),
                Source::Dispatched { queue, shared, ration: None, progress, .. } => {
                    match std::task::ready!(queue.poll_recv(cx)) {
                        Some(item) => {
                            if let Ok(batch) = &item {
                                shared.delivery.taken(batch);
                            }
                            Some(item)
                        }
                        None => {
                            next_epoch(queue, shared, progress);
                            if stop_at_epoch_end {
                                self.call_start = None;
                                return Poll::Ready(None);
                            }
                            continue;
                        }
                    }
                }
                Source::Dispatched { queue, shared, ration: Some(ration), progress, .. } => {
                    match std::task::ready!(poll_rationed(queue, shared, ration, cx)) {
                        Rationed::Batch(batch) => Some(Ok(batch)),
                        Rationed::Failed(e) => Some(Err(e)),
                        Rationed::EpochOver => {
                            **ration = Ration::default();
                            next_epoch(queue, shared, progress);
                            if stop_at_epoch_end {
                                self.call_start = None;
                                return Poll::Ready(None);
                            }
                            continue;
                        }
                    }
                }
            };
            if let Some(Ok(batch)) = &item {
                // Only completions: acknowledged, not a batch the caller waited for.
                if batch.is_completions() {
                    continue;
                }
                if let Source::Dispatched { progress, .. } = &mut self.source {
                    progress.yielded.record(batch);
                }
                self.meter.lock().unwrap().delivered(start, Instant::now());
            }
            self.call_start = None;
            return Poll::Ready(item);
        }
    }
}

impl Stream for Client {
    type Item = Result<Batch, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_batch(cx, false)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.tasks.abort_all();
        if let Source::Dispatched { queue, shared, leave, ration, .. } = &mut self.source {
            // Batches received and never read are lost with the client: the dispatcher then
            // produces the job's in-flight splits again.
            let held = ration.as_ref().is_some_and(|r| r.holds());
            let discarded = held || !queue.is_empty() || shared.epochs.any_queued();
            if let Some(leave) = leave.take() {
                let _ = leave.send(discarded);
            }
        }
    }
}

/// The epoch read is over: read the next one.
fn next_epoch(queue: &mut mpsc::Receiver<Item>, shared: &Shared, progress: &mut Progress) {
    let next = shared.reading.fetch_add(1, Ordering::Relaxed) + 1;
    *queue = shared.epochs.take_receiver(next);
    progress.yielded.next_epoch(next);
    shared.switched.notify_one();
}

/// A rank's next batch of the epoch it reads, within the epoch's quota. Whatever arrives is
/// acknowledged at once, not when the training loop takes it: its completions must reach the
/// dispatcher for the epoch to end, and its end is what makes the quota final.
fn poll_rationed(
    queue: &mut mpsc::Receiver<Item>,
    shared: &Shared,
    ration: &mut Ration,
    cx: &mut Context<'_>,
) -> Poll<Rationed> {
    let epoch = shared.reading.load(Ordering::Relaxed);
    loop {
        shared.quota_changed.register(cx.waker());
        if let Some(quota) = shared.quotas.lock().unwrap().get(&epoch) {
            ration.set_quota(quota.clone());
        }
        match ration.step() {
            Step::Yield(batch) => {
                if batch.round.is_some() {
                    shared.delivery.yielded_rounds(epoch, ration.position());
                }
                return Poll::Ready(Rationed::Batch(batch));
            }
            Step::Drop(batch) => {
                let rows = if batch.rows.is_empty() {
                    batch.tensors.values().next().and_then(|t| t.shape.first().copied()).unwrap_or(0) as u64
                } else {
                    batch.rows.len() as u64
                };
                shared.dropped_rows.fetch_add(rows, Ordering::Relaxed);
                shared.delivery.dropped(epoch, rows);
            }
            Step::Done => return Poll::Ready(Rationed::EpochOver),
            // Waiting for a quota the follower's wake-up brings.
            Step::Wait if ration.ended() => return Poll::Pending,
            Step::Wait => match std::task::ready!(queue.poll_recv(cx)) {
                Some(Ok(batch)) => {
                    shared.delivery.taken(&batch);
                    ration.push(batch);
                }
                Some(Err(e)) => return Poll::Ready(Rationed::Failed(e)),
                None => {
                    ration.end();
                    shared.delivery.ended(epoch);
                }
            },
        }
    }
}

/// Whether a fixed worker's stream failed because its connection did (not because the worker
/// said so): what resuming it fixes.
fn broken_connection(e: &Error) -> bool {
    match e {
        Error::Connect { .. } => true,
        Error::Protocol { source, .. } => source.is_gone_file(),
        // What a transport failure reaches the stream as (a worker choosing one of these
        // too is retried only until the stream has made no progress for the connect timeout).
        Error::Status { status, .. } => {
            matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled)
        }
        _ => false,
    }
}

/// A fixed worker's stream and what it takes to open it again where it broke.
struct FixedStream {
    worker: String,
    options: ClientOptions,
    token: stoker_api::token::TokenSource,
    cursor: Arc<Cursor>,
}

impl FixedStream {
    /// Reads the stream into the caller's queue. A connection that breaks (the transport
    /// fails, or the worker is unreachable for a moment) is opened again under the stream's
    /// cursor, the worker sending first what the broken one took with it; without progress
    /// for the connect timeout it gives up. Any other failure (a status the worker sent, a
    /// worker that forgot the stream) is the caller's to see.
    async fn pump_to_caller(self, mut stream: tonic::Streaming<BatchChunk>, tx: mpsc::Sender<Item>) {
        let accounts = (None, Some(self.cursor.as_ref()));
        // Since when the stream has delivered nothing, and what it had then.
        let mut stalled: Option<(tokio::time::Instant, u64)> = None;
        loop {
            let Some(failure) =
                pump(WorkerKey::from(self.worker.as_str()), stream, &tx, self.options.reassembler(), accounts, || {})
                    .await
            else {
                return;
            };
            if tx.is_closed() {
                // The client is gone: its connections closing is no worker's failure.
                return;
            }
            let received = self.cursor.received();
            let since = match stalled {
                Some((since, had)) if had == received => since,
                _ => tokio::time::Instant::now(),
            };
            stalled = Some((since, received));
            let mut failure = failure;
            let reopened = loop {
                if !broken_connection(&failure) || since.elapsed() > self.options.connect_timeout {
                    break None;
                }
                tracing::info!(worker = %self.worker, error = %failure, "worker stream broke; resuming it");
                tokio::time::sleep(RETRY).await;
                let tls = &WorkerTls::ByAddress;
                match open(&self.worker, (&self.options, &self.token), None, tls, Some(&self.cursor)).await {
                    Ok(stream) => break Some(stream),
                    Err(e) => failure = e,
                }
            };
            match reopened {
                Some(again) => stream = again,
                None => {
                    tracing::warn!(error = %failure, "worker stream failed");
                    let _ = tx.send(Err(failure)).await;
                    return;
                }
            }
        }
    }
}
