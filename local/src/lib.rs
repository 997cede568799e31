//! Stoker on one machine, without Kubernetes: the operator's dispatcher and autoscaler with
//! `stoker-worker` processes as the scaler's backend. `stoker local` and `stoker demo` run it,
//! and so do the real-process tests.
//!
//! - [`mode`]: starts the dispatcher, the first workers and the scaling loop for one pipeline;
//! - [`workers`]: the local-processes scaler;
//! - [`children`]: child processes that die with this one (workers, and the e2e harness's);
//! - [`demo`]: a synthetic trainer against a generated corpus, for `stoker demo`;
//! - [`tls`]: `stoker local --tls`'s throwaway CA and certificates;
//! - [`cli`]: what the `stoker` subcommands print;
//! - [`profile`]: `stoker profile`, a pipeline measured on a sample and its workers planned;
//! - [`bench`]: `stoker bench dispatcher` (one dispatcher under simulated workers and clients)
//!   and `stoker bench autoscaler --local` (the autoscaling policies on local processes).

pub mod bench;
pub mod cli;
pub mod demo;
pub mod mode;
pub mod profile;
pub mod tls;
pub mod workers;

pub use mode::{Local, LocalOptions, VIEW_HEADER};
