//! Where the autoscaler's decisions take effect: the workers Deployment's replicas in a cluster,
//! `stoker-worker` processes in local mode. One trait, so the scaling loop is the same code.

use std::future::Future;

use crate::key::PipelineKey;

pub trait Scaler: Send + Sync {
    /// Makes `pipeline` run `workers` workers (eventually: processes start and pods schedule
    /// after this returns).
    fn scale(&self, pipeline: &PipelineKey, workers: u32) -> impl Future<Output = anyhow::Result<()>> + Send;
}
