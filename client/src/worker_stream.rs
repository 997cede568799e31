//! One worker's batch stream: opening it, and reading its chunks into the client's queue.
//! Used alike for a fixed list of workers and for the ones the dispatcher names.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use stoker_api::proto::batch_stream_client::BatchStreamClient;
use stoker_api::{Batch, WorkerId};

use stoker_api::proto::{self, BatchChunk, PipelineRef, StreamRequest, StreamResume};
use stoker_api::token::TokenSource;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::delivery::Delivery;
use crate::error::Error;
use crate::options::ClientOptions;
use crate::reassemble::Reassembler;
use crate::tls::WorkerTls;

/// A worker as the client keys its streams and the rows they delivered: the address it is
/// reached at, and its id where the dispatcher gives one, for a new process at the same
/// address (a pod's IP reused, a container restarted in its pod) is another worker: the rows
/// the one before delivered are then held rows of a worker that left the list, not the new
/// one's.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct WorkerKey {
    pub address: String,
    pub id: Option<WorkerId>,
}

impl WorkerKey {
    /// A worker as a list names it (an empty id: none given).
    pub(crate) fn listed(address: String, id: Option<&String>) -> Self {
        WorkerKey { address, id: id.filter(|id| !id.is_empty()).map(|id| WorkerId::new(id.as_str())) }
    }
}

/// A worker known by its address alone (a fixed list of workers).
impl From<&str> for WorkerKey {
    fn from(address: &str) -> Self {
        WorkerKey { address: address.to_string(), id: None }
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.id {
            Some(id) => write!(f, "{}#{id}", self.address),
            None => f.write_str(&self.address),
        }
    }
}

/// A stream that outlives its connection (`StreamResume`): its id, and how many of its batches
/// arrived whole. Opened again under the same id after its connection broke, the worker sends
/// first what came after those.
#[derive(Debug)]
pub(crate) struct Cursor {
    id: u64,
    received: AtomicU64,
}

impl Cursor {
    pub(crate) fn new() -> Self {
        use std::hash::BuildHasher;
        static OPENED: AtomicU64 = AtomicU64::new(0);
        // Random per process (RandomState's keys), distinct within it (the count).
        let id = std::collections::hash_map::RandomState::new().hash_one(OPENED.fetch_add(1, Ordering::Relaxed));
        Cursor { id: id.max(1), received: AtomicU64::new(0) }
    }

    /// A batch is counted once it is in the queue, or refused: either way not asked for again.
    fn counted(&self, seq: u64) {
        if seq == 0 {
            return;
        }
        let had = self.received.swap(seq, Ordering::Relaxed);
        if seq != had + 1 {
            // Batches of before the worker registered again are not sent again (their rows come
            // from elsewhere); the worker says so loudly if it ever lost any other.
            tracing::debug!(stream = self.id, had, seq, "a resumed stream went on past batches not sent again");
        }
    }

    pub(crate) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn resume(&self, options: &ClientOptions) -> StreamResume {
        StreamResume {
            stream: self.id,
            received: self.received(),
            window_bytes: u64::from(options.stream_window_bytes),
        }
    }
}

/// The largest HTTP/2 frame a worker may send: with the 16 KiB default a 4 MiB batch came in
/// 256 frames, each a turn of the client's connection task.
const MAX_FRAME_BYTES: u32 = 1 << 20;

/// Opens a worker's stream: of one `epoch` under the dispatcher, else from `start_epoch` on;
/// over TLS as `tls` says, with the client's one `token` source; resumable with a `cursor`.
pub(crate) async fn open(
    worker: &str,
    (options, token): (&ClientOptions, &TokenSource),
    epoch: Option<u64>,
    tls: &WorkerTls,
    cursor: Option<&Cursor>,
) -> Result<tonic::Streaming<BatchChunk>, Error> {
    let connect = |source| Error::Connect { worker: worker.to_string(), source };
    let (uri, tls) = crate::tls::worker(worker, options, tls)?;
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(connect)?
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true)
        .initial_stream_window_size(options.stream_window_bytes)
        .initial_connection_window_size(options.stream_window_bytes.saturating_mul(2))
        .max_frame_size(MAX_FRAME_BYTES);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(connect)?;
    }
    let channel: Channel = endpoint
        .connect()
        .await
        .map_err(|source| crate::tls::failure(worker, &source).unwrap_or_else(|| connect(source)))?;
    let mut client = BatchStreamClient::new(channel).max_decoding_message_size(options.max_message_bytes);
    if let Some(encoding) = options.compression {
        client = client.accept_compressed(encoding);
    }
    let mut request = tonic::Request::new(StreamRequest {
        pipeline: Some(PipelineRef { namespace: options.namespace.clone(), name: options.pipeline.clone() }),
        job: options.job.clone(),
        consumer_index: options.consumer_index,
        consumers: options.consumers,
        coordinated: options.coordinated,
        // Under the dispatcher the stream is of one epoch.
        start_epoch: if epoch.is_none() { options.start_epoch } else { None },
        max_message_bytes: options.max_message_bytes as u64,
        epoch,
        shared_memory: options.shared_memory.as_deref().and_then(crate::shared::identity),
        resume: cursor.map(|c| c.resume(options)),
    });
    if let Some(token) = &options.token {
        proto::bearer(token)
            .parse::<tonic::metadata::MetadataValue<_>>()
            .map_err(|_| Error::InvalidOptions("the token is not a valid header value".into()))?;
    }
    token.attach(&mut request);
    let status = |s: tonic::Status| {
        crate::tls::failure(worker, &s)
            .unwrap_or_else(|| Error::Status { worker: worker.to_string(), status: Box::new(s) })
    };
    Ok(client.stream(request).await.map_err(status)?.into_inner())
}

/// Reads one worker's chunks into the shared queue. Waiting on the full queue stops reading the
/// stream, which stops HTTP/2 window updates, which stops the worker: that is the backpressure.
/// Under the dispatcher, `delivery` records each batch's rows as it enters the queue.
/// A resumable stream's `cursor` counts the batches that entered (or were refused), and skips
/// one sent again that it has.
/// Returns why the stream failed, or None when it ended or the client is gone.
pub(crate) async fn pump(
    worker: WorkerKey,
    mut stream: tonic::Streaming<BatchChunk>,
    tx: &mpsc::Sender<Result<Batch, Error>>,
    mut reassembler: Reassembler,
    (delivery, cursor): (Option<&Delivery>, Option<&Cursor>),
    mut on_batch: impl FnMut(),
) -> Option<Error> {
    let counted = |batch_seq: u64| cursor.inspect(|c| c.counted(batch_seq));
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => match reassembler.push(chunk) {
                Ok(Some(batch)) => {
                    if let Some(c) = cursor.filter(|c| batch.stream_seq != 0 && batch.stream_seq <= c.received()) {
                        tracing::debug!(%worker, seq = batch.stream_seq, received = c.received(), "a batch sent again that arrived before");
                        continue;
                    }
                    // Undone if the stream is stopped (its worker left the list) before the
                    // batch is in: only queued rows count as delivered.
                    let recorded = match delivery.map(|d| d.record(&worker, &batch)) {
                        // Made under a dispatcher this client rejoined another after.
                        Some(None) => {
                            counted(batch.stream_seq);
                            continue;
                        }
                        recorded => recorded.flatten(),
                    };
                    let data = (!batch.is_completions()).then(|| (batch.epoch, batch.round.clone()));
                    if data.is_some() {
                        on_batch();
                    }
                    let Ok(room) = tx.reserve().await else {
                        return None; // the client is gone
                    };
                    // Made under a dispatcher a rejoin retired while it waited for room.
                    if recorded.is_some_and(|r| !r.keep()) {
                        counted(batch.stream_seq);
                        continue;
                    }
                    counted(batch.stream_seq);
                    room.send(Ok(batch));
                    if let (Some(d), Some((epoch, round))) = (delivery, data) {
                        d.received(epoch, round.as_ref());
                    }
                }
                Ok(None) => {}
                Err(source) => return Some(Error::Protocol { worker: worker.to_string(), source }),
            },
            Ok(None) => {
                return reassembler.finish().err().map(|source| Error::Protocol { worker: worker.to_string(), source });
            }
            Err(status) => return Some(Error::Status { worker: worker.to_string(), status: Box::new(status) }),
        }
    }
}
