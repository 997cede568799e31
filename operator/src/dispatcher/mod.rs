//! The dispatcher: a split becomes batches here. Workers register and ask for splits, clients
//! register, follow the live worker list and report their batch times. Read in this order:
//!
//! 1. [`service`]: the gRPC face, mapping requests onto the state, which it brings in as
//!    [`registration`]'s types;
//! 2. [`state`]: the bookkeeping that answers each request, made of
//!    [`members`] (who is alive), [`ledger`] (each job's splits per epoch, kept in a
//!    [`queue`]), [`share`] (one production of a split for the jobs of a share group),
//!    [`ranks`] (equal batch counts for a job read by ranks), [`inbox`] (the clients' windows
//!    until the scaling loop takes them) and [`cache`] (each pipeline's cache plan).

pub mod cache;
mod gathering;
mod inbox;
mod ledger;
mod members;
mod pipeline;
mod queue;
mod ranks;
mod registration;
mod service;
mod share;
mod state;

pub use inbox::JobWindows;
pub use ledger::{Assignment, JobSummary};
pub use members::{Progress, Timeouts};
pub use ranks::{Quota, Received};
pub use registration::{DispatchError, MAX_ID_BYTES, MAX_SPLITS, WorkerRegistration};
pub use service::{Dispatcher, DispatcherService, HEARTBEAT_INTERVAL, WorkerTlsNames, serve};
pub use state::DispatcherState;
