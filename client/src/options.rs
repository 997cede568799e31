//! What a client asks its workers (and the dispatcher) for, and the limits it holds them to.

use std::path::PathBuf;
use std::time::Duration;

use stoker_api::proto;
use tonic::codec::CompressionEncoding;

use crate::error::Error;

#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub namespace: String,
    pub pipeline: String,
    /// Consumers with the same job share one stream; different jobs each get whole epochs.
    pub job: String,
    pub consumer_index: u32,
    /// Under the dispatcher, a job read by ranks (e.g. the processes of a DDP job): how many,
    /// `consumer_index` being this client's rank. Each rank's training loop then gets the same
    /// number of batches every epoch (what a rank receives beyond it is dropped and counted).
    /// 0 or 1: the job's consumers share its batches, first come, first served.
    pub consumers: u32,
    /// With `consumers` > 1, coordinated mode: batch k of every rank comes from the same round
    /// of the same worker (`Batch::round`), so batches a pipeline groups by length line up
    /// across ranks. Every consumer of the job sets the same.
    pub coordinated: bool,
    /// Under the dispatcher: the share group of the pipeline this job belongs to (for example
    /// a hyperparameter sweep's name). The jobs of a group take their splits from one
    /// production, each still getting every element of each of its epochs once, at its own
    /// pace (docs/reuse.md). Every consumer of the job names the same group.
    pub share: Option<String>,
    /// Under the dispatcher: go on from a state `Client::state` gave (saved with a checkpoint),
    /// on any dispatcher and with any number of workers. Every consumer of the job resumes from
    /// its own state saved at the same step; the job produces the rest of that epoch without
    /// what any of them had yielded, once all their states are in. To resume with another
    /// number of ranks, every new rank passes the one state [`crate::merge_states`] makes of
    /// all the old ranks' states.
    pub resume: Option<proto::ResumeState>,
    /// The epoch to start at. Standalone workers: None is 0. Under the dispatcher a client
    /// starts at the job's open epoch, or at this one if it is later (the epochs between are
    /// left to the job's other consumers); resuming, the state's epoch.
    pub start_epoch: Option<u64>,
    /// Under the dispatcher: the epoch the job stops before (a training script's `num_epochs`:
    /// `Some(3)` reads epochs 0, 1 and 2). The client opens no stream for an epoch at or past
    /// it, so no worker makes an epoch nobody will read (in a share group, what the others
    /// would have paid for), and `next()` ends after the last. None: epochs go on as long as
    /// the loop reads.
    pub epochs: Option<u64>,
    /// Under the dispatcher: stream the next epoch while the training loop reads this one
    /// (queued apart, at most `prefetch` batches), so an epoch's end costs no wait. Turn it off
    /// for a client dropped at the end of each epoch, or what it read ahead is lost until
    /// the job's in-flight splits are produced again.
    pub prefetch_next_epoch: bool,
    /// Batches received ahead of the training loop, across all workers.
    pub prefetch: usize,
    /// Largest gRPC message accepted; workers cut batches to fit.
    pub max_message_bytes: usize,
    /// Largest batch a header may announce (bounds what a broken worker makes us allocate).
    pub max_batch_bytes: u64,
    /// Ask workers to compress (off by default: tensors rarely compress well and loopback or
    /// in-cluster links are faster than gzip).
    pub compression: Option<CompressionEncoding>,
    /// The ServiceAccount token (audience `stoker.dev` unless the operator says otherwise)
    /// sent as `authorization: Bearer <token>`. Without one, the client reads the file
    /// `STOKER_TOKEN_FILE` names, else the default projected-token path
    /// (/var/run/secrets/stoker.dev/serviceaccount/token) if it exists, again every minute.
    pub token: Option<String>,
    /// The CA certificates (a PEM file) the dispatcher's and the workers' certificates must
    /// chain to; default: the file `STOKER_CA_FILE` names. With a CA the client speaks TLS to
    /// the dispatcher unless its URL says `http://`, and to workers whenever the dispatcher
    /// says they serve TLS (verifying them against the name it gives). An `https://` URL
    /// without a CA is refused.
    pub tls_ca: Option<PathBuf>,
    /// The name the dispatcher's certificate must be for, when the URL's host is not it: a
    /// dispatcher reached by its cluster IP or through `kubectl port-forward` still presents a
    /// certificate for its Service's DNS name. Default: the URL's host.
    pub tls_server_name: Option<String>,
    pub connect_timeout: Duration,
    /// Batches from a worker on this host through this shared-memory directory (`/dev/shm`,
    /// [`crate::shared::DIRECTORY`]): the worker writes each batch once to a file there and the
    /// client maps it, instead of the batch crossing a socket. Workers elsewhere, or running as
    /// another user, send messages. None (the default): messages only.
    pub shared_memory: Option<PathBuf>,
    /// HTTP/2 flow-control window per stream: in-flight bytes per worker beyond the prefetch
    /// queue. Large enough for full speed, small enough that a slow trainer stops the worker.
    pub stream_window_bytes: u32,
}

impl ClientOptions {
    /// Where this client's token comes from (see `token`).
    pub fn token_source(&self) -> stoker_api::token::TokenSource {
        stoker_api::token::TokenSource::discover(self.token.clone())
    }

    pub fn new(namespace: impl Into<String>, pipeline: impl Into<String>) -> Self {
        ClientOptions {
            namespace: namespace.into(),
            pipeline: pipeline.into(),
            job: "default".into(),
            consumer_index: 0,
            consumers: 0,
            coordinated: false,
            share: None,
            resume: None,
            start_epoch: None,
            epochs: None,
            prefetch_next_epoch: true,
            prefetch: 8,
            max_message_bytes: proto::DEFAULT_MAX_MESSAGE_BYTES,
            max_batch_bytes: 16 << 30,
            compression: None,
            token: None,
            tls_ca: None,
            tls_server_name: None,
            connect_timeout: Duration::from_secs(10),
            shared_memory: None,
            stream_window_bytes: 4 << 20,
        }
    }

    /// How this client reads its job (`consumers`, `consumer_index` and `coordinated` checked
    /// together).
    pub fn reading(&self) -> Result<stoker_api::Reading, Error> {
        stoker_api::Reading::from_wire(self.consumers, self.consumer_index, self.coordinated)
            .map_err(Error::InvalidOptions)
    }

    /// What turns a stream's chunks back into batches, as this client asked for them.
    pub(crate) fn reassembler(&self) -> crate::reassemble::Reassembler {
        crate::reassemble::Reassembler::new(self.max_batch_bytes).with_shared_memory(self.shared_memory.clone())
    }

    /// The epoch this client asks to start at: `start_epoch`, else the resume state's, else 0
    /// (under the dispatcher, the job's open epoch if that is later).
    pub(crate) fn asked_start(&self) -> u64 {
        self.start_epoch.or(self.resume.as_ref().map(|r| r.epoch)).unwrap_or(0)
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidOptions(m));
        self.reading()?;
        if let Some(state) = &self.resume {
            if state.job != self.job {
                return bad(format!("the resume state is of job {:?}, not {:?}", state.job, self.job));
            }
            if self.start_epoch.is_some_and(|e| e != state.epoch) {
                return bad(format!(
                    "start_epoch {} is not the resume state's epoch {}",
                    self.start_epoch.unwrap_or_default(),
                    state.epoch
                ));
            }
            // A merged state resumes any number of ranks; a rank's own, only its rank of as many.
            let own = state.merged_ranks == 0;
            if own && (state.consumers.max(1), state.consumer_index) != (self.consumers.max(1), self.consumer_index) {
                return bad(format!(
                    "the resume state is of consumer {} of {}, not {} of {} (to resume with another number of \
                     ranks, merge every rank's state into one: merge_states)",
                    state.consumer_index, state.consumers, self.consumer_index, self.consumers
                ));
            }
        }
        if let Some(end) = self.epochs {
            let start = self.asked_start();
            if end <= start {
                return bad(format!("epochs {end} leaves nothing to read from epoch {start}"));
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_must_leave_an_epoch_to_read() {
        let mut options = ClientOptions::new("ns", "p");
        options.epochs = Some(3);
        assert!(options.check().is_ok());
        options.start_epoch = Some(3);
        let Err(Error::InvalidOptions(message)) = options.check() else { panic!("start 3 of 3 accepted") };
        assert_eq!(message, "epochs 3 leaves nothing to read from epoch 3");
        options.start_epoch = None;
        options.epochs = Some(0);
        assert!(options.check().is_err());
    }
}
