//! Rust client of Stoker: streams preprocessed batches from workers into a training loop.
//!
//! ```no_run
//! # async fn run() -> Result<(), stoker_client::Error> {
//! use stoker_client::{Client, ClientOptions};
//! let mut client = Client::connect(vec!["127.0.0.1:7070".into()], ClientOptions::new("team-a", "imagenet")).await?;
//! while let Some(batch) = client.next().await {
//!     let batch = batch?;
//!     // train on batch.tensors ...
//! }
//! println!("{:?}", client.window());
//! # Ok(()) }
//! ```

mod client;
mod dispatched;
mod error;
pub mod reassemble;
pub mod stats;
pub mod trainer;

pub use client::{Client, ClientOptions};
pub use error::{Error, ProtocolError};
pub use stats::WindowStats;
pub use stoker_api::{Batch, DType, DataPipelineSpec, Tensor, WorkerPipeline};
pub use tonic::codec::CompressionEncoding;
