//! The Kubernetes scaler: a decision goes into the book and the pipeline is reconciled, so the
//! controller stays the one writer of the workers Deployment (and of status).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use stoker_api::{AutoscalingMode, CacheDecision, DataPipeline};
use tokio::sync::{mpsc, watch};

use super::policy::PolicyState;
use super::replicas::replicas_of;
use super::scaler::Scaler;
use super::{Rescale, Scaled, ScalingBook};
use crate::events;
use crate::key::PipelineKey;

pub struct DeploymentScaler {
    book: Arc<ScalingBook>,
    reconcile: mpsc::UnboundedSender<()>,
}

impl DeploymentScaler {
    /// `reconcile` feeds the controller's `reconcile_all_on`.
    pub fn new(book: Arc<ScalingBook>, reconcile: mpsc::UnboundedSender<()>) -> Self {
        DeploymentScaler { book, reconcile }
    }

    /// Asks for a reconcile, so status shows the book's latest records.
    pub fn refresh(&self) {
        let _ = self.reconcile.send(());
    }
}

impl Scaler for DeploymentScaler {
    async fn scale(&self, pipeline: &PipelineKey, workers: u32) -> anyhow::Result<()> {
        self.book.update(pipeline, |r| r.workers = workers);
        self.refresh();
        Ok(())
    }
}

/// The pipelines the autoscaler is responsible for: valid, mode BatchTime.
pub fn in_scope(store: &watch::Receiver<Option<Store<DataPipeline>>>, book: &ScalingBook) -> Vec<Scaled> {
    let Some(store) = store.borrow().clone() else { return Vec::new() };
    store
        .state()
        .iter()
        .filter(|dp| dp.spec.autoscaling.mode == AutoscalingMode::BatchTime && stoker_api::validate(&dp.spec).is_ok())
        .map(|dp| {
            let key = PipelineKey::of(dp);
            let decided = book.get(&key).map(|r| r.workers).filter(|n| *n > 0);
            let workers = replicas_of(dp, decided) as u32;
            if book.get(&key).is_none() {
                // A new leader: continue the history and state the last one recorded.
                let previous = dp.status.as_ref().and_then(|s| s.autoscaler.clone()).unwrap_or_default();
                book.update(&key, |r| {
                    r.workers = workers;
                    r.history = previous.history;
                    r.converged = previous.converged;
                    r.state = previous.state.as_deref().and_then(PolicyState::from_name);
                });
            }
            Scaled {
                key,
                min: dp.spec.workers.min as u32,
                max: dp.spec.workers.max as u32,
                policy: dp.spec.autoscaling.policy.clone(),
                workers,
                echo: dp.spec.data_plane.automatic_echo(),
            }
        })
        .collect()
}

/// What follows a round in a cluster: metrics, an Event on each rescaled pipeline saying why,
/// and a reconcile when any record changed so status shows it.
pub fn after_round(
    client: kube::Client,
    reporter: Reporter,
    store: watch::Receiver<Option<Store<DataPipeline>>>,
    reconcile: mpsc::UnboundedSender<()>,
    book: Arc<ScalingBook>,
    metrics: crate::metrics::Metrics,
) -> impl FnMut(&[Rescale], bool) {
    // Cache decisions already announced, so each change gets one Event.
    let mut announced: BTreeMap<PipelineKey, (CacheDecision, Option<u32>)> = BTreeMap::new();
    // A fresh recorder per event: a shared one folds every event of the same reason into
    // the first one's series, which would keep the first decision's note and lose the rest.
    let publish = move |dp: Arc<DataPipeline>, reason: &'static str, action: &'static str, note: String| {
        let recorder = Recorder::new(client.clone(), reporter.clone());
        tokio::spawn(async move { events::publish(&recorder, &dp, EventType::Normal, reason, action, &note).await });
    };
    move |rescales, changed| {
        metrics.scaling(&book.all(), rescales);
        metrics.deliveries(&book.deliveries());
        metrics.data_waits(&book.data_waits());
        metrics.jobs(&book.all_jobs());
        if changed {
            let _ = reconcile.send(());
        }
        let Some(store) = store.borrow().clone() else { return };
        for (key, cache) in book.caches() {
            let now = (cache.decision, cache.at);
            if announced.insert(key.clone(), now) == Some(now) || cache.decision == CacheDecision::Undecided {
                continue;
            }
            let Some(dp) = store.get(&ObjectRef::new(&key.name).within(&key.namespace)) else { continue };
            let at = cache.at.map(|a| format!(" at transform {a}")).unwrap_or_default();
            let note = format!("{:?}{at}: {}", cache.decision, cache.reason.unwrap_or_default());
            publish(dp, "CacheDecided", "Autocache", note);
        }
        for r in rescales {
            let Some(dp) = store.get(&ObjectRef::new(&r.pipeline.name).within(&r.pipeline.namespace)) else { continue };
            publish(dp, "Rescaled", "Autoscale", format!("{} -> {} workers: {}", r.from, r.to, r.reason));
        }
    }
}
