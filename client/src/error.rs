//! What can go wrong, split where callers branch: retry another worker (connection), give up on
//! a worker that sends garbage (protocol), or act on what the worker said (status).

/// A broken chunk sequence: the worker (or something between) does not speak the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("a chunk without a header started a batch")]
    MissingHeader,
    #[error("a header arrived in the middle of a batch")]
    UnexpectedHeader,
    #[error("tensor {tensor:?} has unknown dtype {dtype}")]
    UnknownDtype { tensor: String, dtype: i32 },
    #[error("tensor {tensor:?} has unknown layout {layout}")]
    UnknownLayout { tensor: String, layout: i32 },
    #[error("tensor {tensor:?} appears twice")]
    DuplicateTensor { tensor: String },
    #[error("tensor {tensor:?}: shape {shape:?} does not match its {byte_length} bytes")]
    ShapeMismatch { tensor: String, shape: Vec<u64>, byte_length: u64 },
    #[error("batch of {declared} bytes is over the client's limit of {limit}")]
    BatchTooLarge { declared: u64, limit: u64 },
    #[error("more payload than the header declared ({declared} bytes)")]
    ExcessPayload { declared: u64 },
    #[error("batch ended after {received} of {declared} payload bytes")]
    Truncated { received: u64, declared: u64 },
    #[error("the stream ended in the middle of a batch")]
    EndedMidBatch,
    #[error("a batch in shared memory, which this stream did not ask for")]
    UnaskedSharedMemory,
    #[error("a batch in shared memory comes whole in one chunk: its header, no pieces, and last")]
    SharedMemoryInPieces,
    #[error(transparent)]
    SharedFile(#[from] crate::shared::TakeError),
}

impl ProtocolError {
    /// A batch's shared-memory file the worker removed before the client took it (its stream
    /// broke): the batch was not received, and a resumed stream sends it again.
    pub fn is_gone_file(&self) -> bool {
        matches!(self, ProtocolError::SharedFile(crate::shared::TakeError::Gone(_)))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no worker addresses given")]
    NoWorkers,
    #[error("invalid client options: {0}")]
    InvalidOptions(String),
    #[error("cannot connect to worker {worker}: {source}")]
    Connect {
        worker: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("worker {worker}: {status}")]
    Status {
        worker: String,
        #[source]
        status: Box<tonic::Status>,
    },
    #[error("dispatcher {url}: {status}")]
    Dispatcher {
        url: String,
        #[source]
        status: Box<tonic::Status>,
    },
    /// TLS with the dispatcher or a worker failed: its certificate does not verify with the
    /// client's CA or is not for the expected name, or one side does not speak TLS.
    #[error("TLS with {peer} failed: {problem}")]
    Tls { peer: String, problem: String },
    #[error("worker {worker}: {source}")]
    Protocol {
        worker: String,
        #[source]
        source: ProtocolError,
    },
}

impl Error {
    /// A worker's answer the training loop must see rather than have hidden by a reconnect
    /// (a refused request, a broken protocol, TLS that does not verify); anything else is a
    /// connection that broke, and its stream is opened again where it broke.
    pub fn is_fatal(&self) -> bool {
        match self {
            // A batch's shared-memory file removed as its stream broke: the resumed stream
            // sends the batch again.
            Error::Protocol { source, .. } if source.is_gone_file() => false,
            // The client's CA, or the worker's certificate, is wrong: no retry fixes it.
            Error::Protocol { .. } | Error::Tls { .. } => true,
            Error::Status { status, .. } => matches!(
                status.code(),
                tonic::Code::InvalidArgument
                    | tonic::Code::PermissionDenied
                    | tonic::Code::Unauthenticated
                    | tonic::Code::FailedPrecondition
            ),
            _ => false,
        }
    }

    /// The gRPC status code when the worker answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Status { status, .. } | Error::Dispatcher { status, .. } => Some(status.code()),
            _ => None,
        }
    }
}
