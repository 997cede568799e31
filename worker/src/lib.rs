//! The Stoker worker: reads a pipeline's source, runs its transforms and streams batches.

pub mod source;
