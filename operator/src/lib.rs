//! The Stoker operator: reconciles DataPipelines into worker Deployments, Services and the
//! namespace's cache volume, with leader election, metrics and health endpoints.

pub mod autocache;
pub mod autoscaler;
pub mod cli;
pub mod controller;
pub mod demo;
pub mod dispatcher;
pub mod http;
pub mod leader;
pub mod local;
pub mod local_workers;
pub mod metrics;
pub mod names;
pub mod objects;
pub mod scaler;
pub mod scaling;
pub mod status;
pub mod telemetry;
