//! The worker's integration tests, one module per file beside this one, linked as one test
//! binary: the worker's crate is optimised in every build, so each test binary compiled its
//! own optimised copy of the engine's generic code (25-33 CPU-seconds apiece, nine of them).
//! `tests/fuzz_stream.rs` stays a binary of its own: it counts every allocation of its
//! process, which tests running beside it in threads would disturb. `tests/formats/` is the
//! formats' own.
//!
//! Run one file's tests with its module as the filter, e.g.
//! `cargo test -p stoker-worker --test worker parquet::`.

mod engine_support;
mod stream_support;

mod cache_engine;
mod engine;
mod features;
mod features_numpy;
mod ops_bench;
mod ops_reference;
mod parquet;
mod standalone;
mod stream_backpressure;
mod stream_bench;
mod stream_roundtrip;
