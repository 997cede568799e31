//! Rust client of Stoker: streams preprocessed batches from workers into a training loop.
//! The stream itself builds on the worker's data service; this crate already shares the
//! pipeline types with the rest of Stoker.

pub use stoker_api::{DataPipelineSpec, WorkerPipeline};
