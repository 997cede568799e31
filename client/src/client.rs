//! The client: one stream per worker, all feeding one bounded prefetch queue.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use futures::Stream;
use stoker_api::Batch;
use stoker_api::proto::BatchChunk;
use tokio::sync::mpsc;

use crate::delivery::Delivery;
use crate::dispatched::{self, Registration};
use crate::error::Error;
use crate::options::ClientOptions;
use crate::stats::{Meter, WindowStats};
use crate::tasks::Tasks;
use crate::worker_stream::{open, pump};

/// Streams batches from one or more workers. Dropping it stops the streams.
pub struct Client {
    rx: mpsc::Receiver<Result<Batch, Error>>,
    tasks: Tasks,
    /// Shared with the window reporter in dispatcher mode.
    meter: Arc<Mutex<Meter>>,
    /// Dispatcher mode: what was received, for the follower's acknowledgements.
    delivery: Option<Delivery>,
    /// Dispatcher mode: the job's open epoch, as the dispatcher last said.
    open_epoch: Arc<AtomicU64>,
    /// Start of the `next()` call in progress, kept across polls.
    call_start: Option<Instant>,
}

impl Client {
    /// Connects to every worker and opens its stream; fails if any worker is unreachable or
    /// refuses the request, so configuration mistakes surface here rather than mid-training.
    pub async fn connect(workers: Vec<String>, options: ClientOptions) -> Result<Client, Error> {
        if workers.is_empty() {
            return Err(Error::NoWorkers);
        }
        options.check()?;
        let streams = futures::future::try_join_all(workers.iter().map(|w| open(w, &options))).await?;
        let (tx, rx) = mpsc::channel(options.prefetch);
        let tasks = Tasks::default();
        for (worker, stream) in workers.into_iter().zip(streams) {
            tasks.spawn(pump_to_caller(worker, stream, tx.clone(), options.max_batch_bytes));
        }
        Ok(Client { rx, tasks, meter: Arc::default(), delivery: None, open_epoch: Arc::default(), call_start: None })
    }

    /// Registers with the dispatcher at `url`, streams from the pipeline's workers as they come
    /// and go, and reports batch-time windows for the autoscaler. Fails only when the
    /// dispatcher refuses the registration; an unreachable dispatcher or a leader change is
    /// retried, and a worker that dies is dropped (its splits go to the others).
    pub async fn from_dispatcher(url: &str, options: ClientOptions) -> Result<Client, Error> {
        options.check()?;
        let (tx, rx) = mpsc::channel(options.prefetch);
        let tasks = Tasks::default();
        let meter: Arc<Mutex<Meter>> = Arc::default();
        let delivery = Delivery::default();
        let open_epoch: Arc<AtomicU64> = Arc::default();
        let link = Registration::register(url, &options).await?;
        let follower = dispatched::Follower {
            link,
            options,
            tx,
            meter: meter.clone(),
            delivery: delivery.clone(),
            open_epoch: open_epoch.clone(),
            tasks: tasks.clone(),
        };
        tasks.spawn(follower.run());
        Ok(Client { rx, tasks, meter, delivery: Some(delivery), open_epoch, call_start: None })
    }

    /// Under the dispatcher, the job's open epoch: every split of the epochs before it has
    /// reached a consumer of the job. 0 until the dispatcher said otherwise (and in fixed-worker
    /// mode).
    pub fn open_epoch(&self) -> u64 {
        self.open_epoch.load(Ordering::Relaxed)
    }

    /// The next batch from any worker; None once every worker's stream has ended. An error
    /// ends that worker's stream only: the others keep delivering.
    pub async fn next(&mut self) -> Option<Result<Batch, Error>> {
        std::future::poll_fn(|cx| self.poll_batch(cx)).await
    }

    /// Batch-time statistics since the last reset.
    /// In dispatcher mode the window restarts after each report to the dispatcher.
    pub fn window(&self) -> WindowStats {
        self.meter.lock().unwrap().window()
    }

    pub fn reset_window(&mut self) {
        self.meter.lock().unwrap().reset();
    }

    fn poll_batch(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Batch, Error>>> {
        let start = match self.call_start {
            Some(start) => start,
            None => {
                let now = Instant::now();
                self.meter.lock().unwrap().call_started(now);
                *self.call_start.insert(now)
            }
        };
        loop {
            let item = std::task::ready!(self.rx.poll_recv(cx));
            if let Some(Ok(batch)) = &item {
                if let Some(delivery) = &self.delivery {
                    delivery.taken(batch);
                }
                // Only completions: reported, not a batch the caller waited for.
                if batch.is_completions() {
                    continue;
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
        self.get_mut().poll_batch(cx)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// A fixed worker's stream: its failure is the caller's to see.
async fn pump_to_caller(
    worker: String,
    stream: tonic::Streaming<BatchChunk>,
    tx: mpsc::Sender<Result<Batch, Error>>,
    max_batch_bytes: u64,
) {
    if let Some(failure) = pump(worker, stream, &tx, max_batch_bytes, None, || {}).await {
        tracing::warn!(error = %failure, "worker stream failed");
        let _ = tx.send(Err(failure)).await;
    }
}
