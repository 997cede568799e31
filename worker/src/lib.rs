//! The Stoker worker: reads a pipeline's source, runs its transforms and streams batches.

pub mod batch;
pub mod corpus;
pub mod element;
pub mod formats;
pub mod shuffle;
pub mod source;
