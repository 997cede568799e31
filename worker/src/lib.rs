//! The Stoker worker: reads a pipeline's source, runs its transforms and streams batches.

pub mod alloc;
pub mod apply;
mod avx2;
#[cfg(feature = "bench")]
pub mod bench;
pub mod budget;
pub mod cache;
pub mod cached;
pub mod corpus;
pub mod cpu_time;
pub mod deal;
pub mod dispatched;
pub mod element;
pub mod engine;
pub mod formats;
pub mod loaded;
pub mod metrics;
pub mod op_tally;
pub mod ops;
pub mod profile;
pub mod python;
pub mod restart_markers;
pub mod serve;
pub mod shuffle;
pub mod source;
pub mod source_reads;
pub mod stream;
pub mod table;
