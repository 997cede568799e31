//! The dispatcher: dynamic sharding of splits to workers, the live worker list for clients,
//! and the batch-time windows the autoscaler decides from.

pub mod cache;
mod service;
pub mod state;

pub use service::{Dispatcher, DispatcherService, HEARTBEAT_INTERVAL, serve};
pub use state::{Assignment, ClientWindow, DispatcherState, JobSummary, JobWindows, PipelineKey, Progress, Timeouts};
