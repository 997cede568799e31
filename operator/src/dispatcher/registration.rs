//! What the dispatcher's RPCs bring into its state and what a registration gets back, and
//! the bounds every request is checked against before it may size anything.

use stoker_api::{CacheMode, ClientId, JobName, ShareName, WorkerId};

use super::cache::HintSeen;
use super::ledger::Held;
use super::members::Unknown;
use super::ranks::Received;
use crate::key::PipelineKey;

/// The most splits a pipeline's plan may have: each job keeps a queue of every split of its
/// epoch (and of the next), so a worker's word alone must not size it. Rows name their split
/// in 32 bits anyway (`stoker_api::row`), and no listing comes near 16 million shards.
pub const MAX_SPLITS: u64 = 1 << 24;

/// The longest worker or client id a registration may ask to keep: ids are copied into every
/// round of a coordinated job's order, and the ones the dispatcher hands out are short.
pub const MAX_ID_BYTES: usize = 253;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DispatchError {
    /// The id is unknown (e.g. the dispatcher restarted): register again.
    #[error(transparent)]
    Unknown(#[from] Unknown),
    #[error(
        "worker {address} planned {got} splits (digest {got_digest}) but the pipeline's workers planned {want} ({want_digest}): the source listing differs between workers"
    )]
    PlanMismatch { address: String, got: u64, got_digest: String, want: u64, want_digest: String },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct WorkerRegistration {
    pub pipeline: PipelineKey,
    pub address: String,
    pub threads: u32,
    pub splits: u64,
    pub plan_digest: String,
    /// Kept when re-registering after a dispatcher restart.
    pub worker_id: Option<WorkerId>,
    pub cache_mode: CacheMode,
    /// Empty when the worker has no cache volume.
    pub cache_hints: Vec<HintSeen>,
    /// With `shuffle`: each epoch's splits go out in the order of (this seed, epoch).
    pub shuffle_seed: Option<u64>,
}

/// A client's registration.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientRegistration {
    pub pipeline: PipelineKey,
    pub job: JobName,
    pub consumer_index: u32,
    /// A job read by ranks: how many (0 or 1: its consumers share its batches).
    pub consumers: u32,
    /// With `consumers` > 1: batch k of every rank from the same round (see `ranks`).
    pub coordinated: bool,
    /// Kept when re-registering after a dispatcher restart.
    pub client_id: Option<ClientId>,
    /// Registering again with a dispatcher that forgot the client: what it has of the job.
    pub rejoin: Option<Rejoin>,
    /// Resume the job from this consumer's saved state.
    pub resume: Option<Resume>,
    /// The share group the job belongs to (see `share`).
    pub share: Option<ShareName>,
}

/// What a client has of its job's unfinished epochs, for a dispatcher that restarted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rejoin {
    /// The dispatcher it was registered with: if that is this one, nothing was forgotten.
    pub incarnation: u64,
    pub open_epoch: u64,
    /// The job's clients as last listed.
    pub clients: u32,
    /// (epoch, split)s whose completion it received.
    pub completed: Vec<(u64, u64)>,
    /// Rows it received of the other splits.
    pub received: Vec<Held>,
}

/// A client's acknowledgement: the splits whose last batch it received (which makes them
/// done), the newest worker list it applied, the rows it got of unfinished splits from
/// workers that left the list, and for a job read by ranks what this rank received of each
/// epoch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Acknowledgement {
    pub completed: Vec<(u64, u64)>,
    /// Completions an earlier acknowledgement carried whose answer never came: those applied
    /// already are not repeats.
    pub completed_again: Vec<(u64, u64)>,
    pub version: u64,
    pub held: Vec<Held>,
    pub received: Vec<(u64, Received)>,
}

/// A consumer's saved state: the epoch it read, how many batches of it it had yielded (the
/// step), and their rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Resume {
    pub job: JobName,
    pub epoch: u64,
    pub batches: u64,
    pub consumers: u32,
    pub consumer_index: u32,
    pub yielded: Vec<Held>,
    /// Every rank's state merged into one (`ResumeState.merged_ranks`): it resumes the job
    /// read by any number of ranks, each bringing it.
    pub merged: bool,
}

/// A registered client: its id, the job it streams as (a resumed job's run), and this
/// dispatcher's incarnation.
#[derive(Clone, Debug, PartialEq)]
pub struct Registered {
    pub client_id: ClientId,
    pub job: JobName,
    pub incarnation: u64,
}
