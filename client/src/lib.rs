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
mod delivery;
mod epochs;
mod error;
mod follower;
mod options;
mod ration;
pub mod reassemble;
mod registration;
mod resume;
pub mod shared;
pub mod stats;
mod tasks;
mod tls;
pub mod trainer;
mod worker_stream;

pub use client::Client;
pub use error::{Error, ProtocolError};
pub use options::ClientOptions;
pub use resume::merge_states;
pub use stats::WindowStats;
pub use stoker_api::proto::ResumeState;
pub use stoker_api::{Batch, DType, DataPipelineSpec, Tensor, WorkerPipeline};
pub use tonic::codec::CompressionEncoding;
