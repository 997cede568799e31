//! The client: one stream per worker, all feeding one bounded prefetch queue.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use std::sync::{Arc, Mutex};
use stoker_api::Batch;
use stoker_api::proto::batch_stream_client::BatchStreamClient;
use stoker_api::proto::{self, BatchChunk, PipelineRef, StreamRequest};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tonic::codec::CompressionEncoding;
use tonic::transport::{Channel, Endpoint};

use crate::error::Error;
use crate::reassemble::Reassembler;
use crate::stats::{Meter, WindowStats};

#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub namespace: String,
    pub pipeline: String,
    /// Consumers with the same job share one stream; different jobs each get whole epochs.
    pub job: String,
    pub consumer_index: u32,
    /// None: wherever the job currently is.
    pub start_epoch: Option<u64>,
    /// Batches received ahead of the training loop, across all workers.
    pub prefetch: usize,
    /// Largest gRPC message accepted; workers cut batches to fit.
    pub max_message_bytes: usize,
    /// Largest batch a header may announce (bounds what a broken worker makes us allocate).
    pub max_batch_bytes: u64,
    /// Ask workers to compress (off by default: tensors rarely compress well and loopback or
    /// in-cluster links are faster than gzip).
    pub compression: Option<CompressionEncoding>,
    /// The ServiceAccount token sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    pub connect_timeout: Duration,
    /// HTTP/2 flow-control window per stream: in-flight bytes per worker beyond the prefetch
    /// queue. Large enough for full speed, small enough that a slow trainer stops the worker.
    pub stream_window_bytes: u32,
}

impl ClientOptions {
    pub fn new(namespace: impl Into<String>, pipeline: impl Into<String>) -> Self {
        ClientOptions {
            namespace: namespace.into(),
            pipeline: pipeline.into(),
            job: "default".into(),
            consumer_index: 0,
            start_epoch: None,
            prefetch: 8,
            max_message_bytes: proto::DEFAULT_MAX_MESSAGE_BYTES,
            max_batch_bytes: 16 << 30,
            compression: None,
            token: None,
            connect_timeout: Duration::from_secs(10),
            stream_window_bytes: 4 << 20,
        }
    }

    fn check(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidOptions(m));
        if self.prefetch == 0 {
            return bad("prefetch must be at least 1".into());
        }
        let range = proto::MIN_MAX_MESSAGE_BYTES..=proto::MAX_MAX_MESSAGE_BYTES;
        if !range.contains(&self.max_message_bytes) {
            return bad(format!("max_message_bytes {} is outside {range:?}", self.max_message_bytes));
        }
        Ok(())
    }
}

/// Streams batches from one or more workers. Dropping it stops the streams.
pub struct Client {
    rx: mpsc::Receiver<Result<Batch, Error>>,
    tasks: Tasks,
    /// Shared with the window reporter in dispatcher mode.
    meter: Arc<Mutex<Meter>>,
    /// Dispatcher mode: (epoch, split)s whose last batch was delivered, for the next report.
    completed: Option<Received>,
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
        Ok(Client { rx, tasks, meter: Arc::default(), completed: None, call_start: None })
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
        let completed = Received::default();
        let link = crate::dispatched::Registration::register(url, &options).await?;
        tasks.spawn(crate::dispatched::follow(link, options, tx, meter.clone(), completed.clone(), tasks.clone()));
        Ok(Client { rx, tasks, meter, completed: Some(completed), call_start: None })
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
                if let Some(completed) = &self.completed {
                    completed.0.lock().unwrap().extend(batch.completes.iter().map(|&split| (batch.epoch, split)));
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

/// Splits whose last batch reached the training loop: reported to the dispatcher, which is what
/// makes a split done (so data lost in transit is produced again).
#[derive(Clone, Default)]
pub(crate) struct Received(pub(crate) Arc<Mutex<Vec<(u64, u64)>>>);

/// The client's background tasks, stopped when it is dropped.
#[derive(Clone, Default)]
pub(crate) struct Tasks(Arc<Mutex<Vec<AbortHandle>>>);

impl Tasks {
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> AbortHandle {
        let handle = tokio::spawn(task).abort_handle();
        let mut tasks = self.0.lock().unwrap();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle.clone());
        handle
    }

    fn abort_all(&self) {
        for task in self.0.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// `host:port` or a full URI.
fn uri(worker: &str) -> String {
    if worker.contains("://") { worker.to_string() } else { format!("http://{worker}") }
}

pub(crate) async fn open(worker: &str, options: &ClientOptions) -> Result<tonic::Streaming<BatchChunk>, Error> {
    let connect = |source| Error::Connect { worker: worker.to_string(), source };
    let channel: Channel = Endpoint::from_shared(uri(worker))
        .map_err(connect)?
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(options.stream_window_bytes)
        .initial_connection_window_size(options.stream_window_bytes.saturating_mul(2))
        .connect()
        .await
        .map_err(connect)?;
    let mut client = BatchStreamClient::new(channel).max_decoding_message_size(options.max_message_bytes);
    if let Some(encoding) = options.compression {
        client = client.accept_compressed(encoding);
    }
    let mut request = tonic::Request::new(StreamRequest {
        pipeline: Some(PipelineRef { namespace: options.namespace.clone(), name: options.pipeline.clone() }),
        job: options.job.clone(),
        consumer_index: options.consumer_index,
        start_epoch: options.start_epoch,
        max_message_bytes: options.max_message_bytes as u64,
    });
    if let Some(token) = &options.token {
        let value = proto::bearer(token)
            .parse()
            .map_err(|_| Error::InvalidOptions("the token is not a valid header value".into()))?;
        request.metadata_mut().insert(proto::AUTHORIZATION, value);
    }
    let status = |s| Error::Status { worker: worker.to_string(), status: Box::new(s) };
    Ok(client.stream(request).await.map_err(status)?.into_inner())
}

/// Reads one worker's chunks into the shared queue. Waiting on the full queue stops reading the
/// stream, which stops HTTP/2 window updates, which stops the worker: that is the backpressure.
/// Returns why the stream failed, or None when it ended or the client is gone.
pub(crate) async fn pump(
    worker: String,
    mut stream: tonic::Streaming<BatchChunk>,
    tx: &mpsc::Sender<Result<Batch, Error>>,
    max_batch_bytes: u64,
    mut on_batch: impl FnMut(),
) -> Option<Error> {
    let mut reassembler = Reassembler::new(max_batch_bytes);
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => match reassembler.push(chunk) {
                Ok(Some(batch)) => {
                    if !batch.is_completions() {
                        on_batch();
                    }
                    if tx.send(Ok(batch)).await.is_err() {
                        return None; // the client is gone
                    }
                }
                Ok(None) => {}
                Err(source) => return Some(Error::Protocol { worker, source }),
            },
            Ok(None) => return reassembler.finish().err().map(|source| Error::Protocol { worker, source }),
            Err(status) => return Some(Error::Status { worker, status: Box::new(status) }),
        }
    }
}

/// A fixed worker's stream: its failure is the caller's to see.
async fn pump_to_caller(
    worker: String,
    stream: tonic::Streaming<BatchChunk>,
    tx: mpsc::Sender<Result<Batch, Error>>,
    max_batch_bytes: u64,
) {
    if let Some(failure) = pump(worker, stream, &tx, max_batch_bytes, || {}).await {
        tracing::warn!(error = %failure, "worker stream failed");
        let _ = tx.send(Err(failure)).await;
    }
}
