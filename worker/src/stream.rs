//! The batch stream: serves a pipeline's ready batches to training clients over gRPC.
//!
//! The service is generic over where batches come from (`BatchSource`) and over who may ask
//! (`Authenticator`). Batches go out cut into chunks that fit the client's message limit
//! (`stoker_api::chunk`), so any batch size streams; to a consumer on the same host that asks,
//! in files of a shared-memory directory instead (`shared`).
//!
//! Backpressure comes from pulling: the response body (`body`) polls the chunk stream only
//! when HTTP/2 flow control lets it send, and each poll here pulls at most one batch from
//! the source. Nothing is spawned and nothing buffers ahead, so a slow client stops the
//! source instead of growing memory.

mod auth;
mod body;
mod resume;
mod sent;
mod server;
mod shared;
mod synthetic;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt, stream};
use prost::Message;
use stoker_api::chunk::chunk_batch;
use stoker_api::proto::batch_stream_server::BatchStream;
use stoker_api::proto::{self, BatchChunk, StreamRequest};
use stoker_api::{Batch, JobName, Reading, Stacked};
use tokio::net::TcpListener;
use tonic::codec::CompressionEncoding;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::budget::Unsent;

pub use auth::{AllowAll, Authenticator, Caller};
pub use resume::{Pulled, Resumes};
pub use sent::{Sent, SentByJob};
pub use server::StreamServer;
pub use shared::SharedMemory;
pub use synthetic::SyntheticSource;

/// A consumer's validated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub namespace: String,
    pub pipeline: String,
    pub job: JobName,
    /// Under the dispatcher: shared, or one rank of a job read by ranks (dealt in rounds in
    /// coordinated mode).
    pub reading: Reading,
    pub start_epoch: Option<u64>,
    /// Under the dispatcher: the one epoch to stream.
    pub epoch: Option<u64>,
    pub caller: Caller,
}

/// A batch on its way to a consumer, with its place in its producer's budget: over the limit
/// the producer's rows wait until the stream lets it go (`budget::Unsent`). A plain stream
/// lets go when it takes the batch; a resumable one may hold on while it still keeps the
/// batches before (`resume`).
pub struct Outgoing {
    pub batch: Batch<Stacked>,
    pub unsent: Option<Unsent>,
}

impl From<Batch<Stacked>> for Outgoing {
    fn from(batch: Batch<Stacked>) -> Self {
        Outgoing { batch, unsent: None }
    }
}

/// Batches for one consumer, in the order they should be sent.
pub type Batches = Pin<Box<dyn Stream<Item = Result<Outgoing, Status>> + Send>>;

/// Where the service gets batches: the pipeline engine, or a synthetic source in tests.
pub trait BatchSource: Send + Sync + 'static {
    /// Starts a consumer's stream. The stream is polled only as fast as the client reads, so
    /// it should produce lazily (or from a bounded queue), never run ahead on its own.
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status>;
}

/// A source shared with something else that reads it (the metrics read the dispatched
/// source's queues).
impl<S: BatchSource> BatchSource for Arc<S> {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        S::subscribe(self, subscription)
    }
}

/// Serving knobs; the defaults suit a cluster network.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// HTTP/2 window for what clients send us; requests are tiny, so the default suffices.
    pub stream_window_bytes: Option<u32>,
    /// Serve TLS with this certificate (the pipeline's, from the operator).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// TLS settings of a server from its certificate chain and key files (PEM).
pub fn server_tls(
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
) -> anyhow::Result<tonic::transport::ServerTlsConfig> {
    let cert = stoker_api::tls::read_pem(cert_file, "TLS certificate")?;
    let key = stoker_api::tls::read_pem(key_file, "TLS key")?;
    // tonic's TLS server uses rustls's process-wide provider, which rustls cannot choose by
    // itself with both ring and aws-lc-rs (object_store's) compiled in: ring, as everywhere.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key)))
}

/// The BatchStream gRPC service.
pub struct StreamService<S, A = AllowAll> {
    source: Arc<S>,
    auth: Arc<A>,
    compression: Option<CompressionEncoding>,
    /// Where batches go for consumers on this host that ask for shared memory.
    shared: Option<Arc<SharedMemory>>,
    /// Streams kept for clients whose connection broke.
    resumes: Arc<Resumes>,
    /// What the streams sent, per job, for the metrics.
    sent: Arc<SentByJob>,
}

impl<S: BatchSource> StreamService<S> {
    pub fn new(source: S) -> Self {
        StreamService {
            source: Arc::new(source),
            auth: Arc::new(AllowAll),
            compression: None,
            shared: None,
            resumes: Arc::default(),
            sent: Arc::default(),
        }
    }
}

impl<S: BatchSource, A: Authenticator> StreamService<S, A> {
    pub fn with_authenticator<B: Authenticator>(self, auth: B) -> StreamService<S, B> {
        StreamService {
            source: self.source,
            auth: Arc::new(auth),
            compression: self.compression,
            shared: self.shared,
            resumes: self.resumes,
            sent: self.sent,
        }
    }

    /// Counts what the streams send, per job, into `sent` (the worker's metrics read it).
    pub fn with_sent(mut self, sent: Arc<SentByJob>) -> Self {
        self.sent = sent;
        self
    }

    /// Hands batches to consumers that map files from `shared`'s directory (the same host and
    /// user) through it, instead of in messages.
    pub fn with_shared_memory(mut self, shared: Option<Arc<SharedMemory>>) -> Self {
        self.shared = shared;
        self
    }

    /// Keeps streams for clients whose connection broke in `resumes`.
    pub fn with_resumes(mut self, resumes: Resumes) -> Self {
        self.resumes = Arc::new(resumes);
        self
    }

    /// Compresses responses for clients that accept `encoding` (off by default: tensors
    /// rarely compress well, and cluster links are faster than gzip).
    pub fn with_compression(mut self, encoding: CompressionEncoding) -> Self {
        self.compression = Some(encoding);
        self
    }

    /// The service to add to a tonic server.
    pub fn into_server(self) -> StreamServer<S, A> {
        StreamServer::new(self)
    }
}

/// Checks a request and returns the subscription, the message limit to chunk for, and the
/// [`proto::StreamResume`] when it asks for a resumable stream.
pub fn validate(
    request: StreamRequest,
    caller: Caller,
) -> Result<(Subscription, usize, Option<proto::StreamResume>), Status> {
    let invalid = |m: String| Err(Status::invalid_argument(m));
    let pipeline = request.pipeline.unwrap_or_default();
    if pipeline.namespace.is_empty() || pipeline.name.is_empty() {
        return invalid("pipeline namespace and name are required".into());
    }
    if pipeline.namespace.len() > 253 || pipeline.name.len() > 253 {
        return invalid("pipeline namespace and name are at most 253 characters".into());
    }
    if request.job.is_empty() || request.job.len() > 253 {
        return invalid("job is required and at most 253 characters".into());
    }
    let limit = proto::effective_max_message_bytes(request.max_message_bytes);
    let range = proto::MIN_MAX_MESSAGE_BYTES as u64..=proto::MAX_MAX_MESSAGE_BYTES as u64;
    if !range.contains(&limit) {
        return invalid(format!("max_message_bytes {limit} is outside {range:?}"));
    }
    let reading = match Reading::from_wire(request.consumers, request.consumer_index, request.coordinated) {
        Ok(reading) => reading,
        Err(e) => return invalid(e),
    };
    let subscription = Subscription {
        namespace: pipeline.namespace,
        pipeline: pipeline.name,
        job: request.job.into(),
        reading,
        start_epoch: request.start_epoch,
        epoch: request.epoch,
        caller,
    };
    Ok((subscription, limit as usize, request.resume))
}

/// The chunk size limit for a client's message limit. Compression can grow incompressible
/// data a little (gzip by ~0.03%, zstd by ~0.4%, plus framing), and the client checks the
/// compressed size, so compressed streams keep 1% + 1 KiB spare.
fn chunk_limit(max_message_bytes: usize, compressed: bool) -> usize {
    if compressed { max_message_bytes - max_message_bytes / 100 - 1024 } else { max_message_bytes }
}

/// The chunks of a batch stream, pulled one batch at a time; each chunk's size goes to a
/// resumable stream's `pulled` as the body takes it.
fn chunks(
    batches: Batches,
    limit: usize,
    pulled: Option<Pulled>,
) -> impl Stream<Item = Result<BatchChunk, Status>> + Send {
    batches.flat_map(move |outgoing| {
        let pulled = pulled.clone();
        let chunks: Box<dyn Iterator<Item = Result<BatchChunk, Status>> + Send> = match outgoing {
            // A resumable stream holds the batch's place in the budget itself (`Resumed`).
            Ok(Outgoing { batch, unsent: _ }) => match chunk_batch(&batch, limit) {
                Ok(chunks) => Box::new(chunks.map(move |chunk| {
                    if let Some(pulled) = &pulled {
                        pulled.pulled(chunk.encoded_len() as u64);
                    }
                    Ok(chunk)
                })),
                Err(e) => Box::new(std::iter::once(Err(Status::resource_exhausted(e.to_string())))),
            },
            Err(status) => Box::new(std::iter::once(Err(status))),
        };
        stream::iter(chunks)
    })
}

#[tonic::async_trait]
impl<S: BatchSource, A: Authenticator> BatchStream for StreamService<S, A> {
    type StreamStream = body::ChunkStream;

    async fn stream(&self, request: Request<StreamRequest>) -> Result<Response<Self::StreamStream>, Status> {
        let metadata = request.metadata().clone();
        let request = request.into_inner();
        // A consumer on this host that maps files from our shared-memory directory.
        let shared =
            self.shared.clone().filter(|s| request.shared_memory.as_ref().is_some_and(|theirs| s.serves(theirs)));
        let (mut subscription, limit, resume) = validate(request, Caller::default())?;
        subscription.caller =
            self.auth.authenticate(&metadata, &subscription.namespace, &subscription.pipeline).await?;
        tracing::info!(
            pipeline = %format!("{}/{}", subscription.namespace, subscription.pipeline),
            job = %subscription.job,
            reading = ?subscription.reading,
            reader = subscription.caller.username.as_deref().unwrap_or("-"),
            limit,
            shared_memory = shared.is_some(),
            "consumer subscribed"
        );
        let (sent, job) = (self.sent.clone(), subscription.job.clone());
        // Each batch once, as the source hands it to the job's stream (a resumed stream's
        // replays are not counted again).
        let mut batches: Batches = Box::pin(self.source.subscribe(&subscription)?.inspect(move |outgoing| {
            if let Ok(outgoing) = outgoing {
                sent.count(&job, outgoing.batch.payload_bytes() as u64);
            }
        }));
        let mut pulled = None;
        if let Some(resume) = &resume {
            let resumed = self.resumes.stream(&subscription, resume, limit, batches)?;
            (batches, pulled) = (resumed.0, Some(resumed.1));
        }
        let limit = chunk_limit(limit, self.compression.is_some());
        Ok(Response::new(match shared {
            Some(shared) => Box::pin(shared::shared_chunks(batches, shared, limit, pulled)),
            None => Box::pin(chunks(batches, limit, pulled)),
        }))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `source` on `addr` until `shutdown` completes.
pub async fn serve<S: BatchSource>(
    addr: SocketAddr,
    source: S,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let listener = TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?;
    serve_on(listener, StreamService::new(source), &ServerOptions::default(), shutdown).await
}

/// Serves on a bound listener (bind to port 0 and read its address to get a free port).
pub async fn serve_on<S: BatchSource, A: Authenticator>(
    listener: TcpListener,
    service: StreamService<S, A>,
    options: &ServerOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &options.tls {
        // Fails here, at startup, when the certificate or key does not parse.
        builder = builder.tls_config(tls.clone())?;
    }
    builder
        .initial_stream_window_size(options.stream_window_bytes)
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
