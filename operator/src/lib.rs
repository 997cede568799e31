//! The Stoker operator. Each path through the system reads as one folder, in order:
//!
//! - a spec becomes objects: [`controller`] (validate -> build -> apply -> status);
//! - a split becomes batches: [`dispatcher`] (workers ask for splits, clients follow workers);
//! - a batch-time report becomes a scaling decision: [`autoscaling`];
//! - a first epoch becomes a cache decision: [`autocache`] (fed by the dispatcher's cache
//!   bookkeeping, `dispatcher::cache`).
//!
//! Around them: the identity every part keys by ([`key`]), leader election, Events, metrics,
//! and the health endpoints. Local mode (`stoker local`) lives in the `stoker-local` crate.

pub mod access;
pub mod autocache;
pub mod autoscaling;
pub mod controller;
pub mod dispatcher;
pub mod events;
pub mod http;
pub mod key;
pub mod leader;
pub mod leader_pod;
pub mod metrics;
pub mod names;
pub mod telemetry;
pub mod tls;
