//! The reconciler, one pipeline at a time: validate -> build -> apply -> status.
//! `objects::build` and `status::next` are pure and hold the decisions; this file is the I/O.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stoker_api::{DataPipeline, validate};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::dispatcher::PipelineKey;
use crate::metrics::Metrics;
use crate::objects::{self, MANAGED_BY, PipelineObjects, WorkerDefaults};
use crate::scaling::ScalingBook;
use crate::status::{self, Outcome};

/// The single field manager of everything the operator applies.
pub const FIELD_MANAGER: &str = "stoker-operator";
const RESYNC: Duration = Duration::from_secs(300);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

pub struct Context {
    pub client: Client,
    pub defaults: WorkerDefaults,
    pub metrics: Metrics,
    pub recorder: Recorder,
    /// The autoscaler's decisions: workers to run and what status says about them.
    pub scaling: Arc<ScalingBook>,
    /// Consecutive failures per pipeline, for exponential backoff.
    failures: Mutex<HashMap<(String, String), u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        defaults: WorkerDefaults,
        metrics: Metrics,
        recorder: Recorder,
        scaling: Arc<ScalingBook>,
    ) -> Self {
        Context { client, defaults, metrics, recorder, scaling, failures: Mutex::default() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("applying {kind} {namespace}/{name}: {source}")]
    Apply { kind: String, namespace: String, name: String, source: kube::Error },
    #[error("updating the status of {namespace}/{name}: {source}")]
    Status { namespace: String, name: String, source: kube::Error },
}

impl Error {
    fn kind(&self) -> &'static str {
        match self {
            Error::Apply { .. } => "apply",
            Error::Status { .. } => "status",
        }
    }
}

/// Runs the controller until `shutdown` fires. The controller's cache goes to `store` for the
/// metrics endpoint.
pub async fn run(
    ctx: Arc<Context>,
    mut shutdown: watch::Receiver<bool>,
    store: watch::Sender<Option<Store<DataPipeline>>>,
    scaled: tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let client = ctx.client.clone();
    let ours = watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGED_BY}"));
    let controller = Controller::new(Api::<DataPipeline>::all(client.clone()), watcher::Config::default())
        .owns(Api::<Deployment>::all(client.clone()), ours.clone())
        .owns(Api::<Service>::all(client), ours)
        // The autoscaler's decisions take effect through a reconcile. Reconciling every
        // pipeline costs only no-op applies (targeting one needs kube's unstable features).
        .reconcile_all_on(tokio_stream::wrappers::UnboundedReceiverStream::new(scaled));
    store.send_replace(Some(controller.store()));
    controller
        .graceful_shutdown_on(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => debug!(pipeline = %obj, "reconciled"),
                Err(e) => debug!(error = %e, "reconcile did not complete"),
            }
        })
        .await;
}

async fn reconcile(dp: Arc<DataPipeline>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_pipeline(&dp, &ctx).await;
    ctx.metrics.reconciled(started.elapsed());
    if result.is_ok() {
        ctx.failures.lock().unwrap().remove(&key(&dp));
    }
    result
}

fn error_policy(dp: Arc<DataPipeline>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failed(error.kind());
    let mut failures = ctx.failures.lock().unwrap();
    let n = failures.entry(key(&dp)).or_insert(0);
    *n += 1;
    let delay = Duration::from_secs(1u64 << (*n - 1).min(9)).min(MAX_BACKOFF);
    warn!(pipeline = %key(&dp).1, namespace = %key(&dp).0, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn pipeline_key(dp: &DataPipeline) -> PipelineKey {
    PipelineKey { namespace: dp.namespace().unwrap_or_default(), name: dp.name_any() }
}

fn key(dp: &DataPipeline) -> (String, String) {
    (dp.namespace().unwrap_or_default(), dp.name_any())
}

async fn reconcile_pipeline(dp: &DataPipeline, ctx: &Context) -> Result<Action, Error> {
    if let Err(errors) = validate(&dp.spec) {
        let message = stoker_api::invalid_message(&errors);
        if update_status(dp, ctx, &Outcome::Invalid(errors)).await? {
            info!(pipeline = %dp.name_any(), namespace = ?dp.namespace(), %message, "spec is invalid");
            publish(ctx, dp, EventType::Warning, "InvalidSpec", &message).await;
        }
        // Only a spec change can fix it: wait for one rather than retrying.
        return Ok(Action::await_change());
    }

    let record = ctx.scaling.get(&pipeline_key(dp));
    let recorded = dp.status.as_ref().and_then(|s| s.workers.as_ref()).map(|w| w.desired);
    let replicas = objects::desired_replicas(&dp.spec, recorded, record.as_ref().map(|r| r.workers));
    // The namespace's claim, if made already: its size bounds the workers' cache.
    let claim = match objects::uses_cache_volume(&dp.spec) {
        true => claims(ctx, dp).get_opt(objects::CACHE_PVC).await.map_err(|source| Error::Apply {
            kind: "PersistentVolumeClaim".into(),
            namespace: dp.namespace().unwrap_or_default(),
            name: objects::CACHE_PVC.into(),
            source,
        })?,
        false => None,
    };
    let built = objects::build(dp, &ctx.defaults, replicas, claim.as_ref().and_then(objects::claim_size).as_ref());
    match apply_objects(ctx, dp, &built, claim.as_ref()).await {
        Ok(deployment) => {
            let ready = deployment.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            update_status(dp, ctx, &Outcome::Applied { desired: replicas, ready }).await?;
            Ok(Action::requeue(RESYNC))
        }
        Err(e) => {
            let message = e.to_string();
            match update_status(dp, ctx, &Outcome::Failed(message.clone())).await {
                Ok(true) => publish(ctx, dp, EventType::Warning, "ApplyFailed", &message).await,
                Ok(false) => {}
                Err(status_error) => warn!(error = %status_error, "could not record the apply failure in status"),
            }
            Err(e)
        }
    }
}

fn claims(ctx: &Context, dp: &DataPipeline) -> Api<PersistentVolumeClaim> {
    Api::namespaced(ctx.client.clone(), &dp.namespace().unwrap_or_default())
}

/// `claim`: the namespace's cache claim as it was found, if it existed.
async fn apply_objects(
    ctx: &Context,
    dp: &DataPipeline,
    built: &PipelineObjects,
    claim: Option<&PersistentVolumeClaim>,
) -> Result<Deployment, Error> {
    let ns = dp.namespace().unwrap_or_default();
    match (&built.cache_pvc, claim) {
        (Some(pvc), None) => {
            if create_if_absent(&claims(ctx, dp), pvc).await? {
                let note = "Created the namespace's shared cache volume stoker-cache";
                publish(ctx, dp, EventType::Normal, "CacheVolumeCreated", note).await;
            }
        }
        (Some(pvc), Some(claim)) => {
            let differences = objects::claim_differences(pvc, claim);
            // Once per spec generation, so a resync or a restarted operator stays quiet.
            let new_generation = dp.status.as_ref().and_then(|s| s.observed_generation) != dp.metadata.generation;
            if !differences.is_empty() && new_generation {
                let note = format!(
                    "The namespace's cache volume stoker-cache already exists and is never changed; this pipeline \
                     asks for {}. Its workers use the volume as it is (cache cap from its size). To change it, \
                     delete the claim (losing the cache) and a pipeline that caches recreates it.",
                    differences.join(", ")
                );
                publish(ctx, dp, EventType::Warning, "CacheVolumeDiffers", &note).await;
            }
        }
        (None, _) => {}
    }
    apply(&Api::<Service>::namespaced(ctx.client.clone(), &ns), &built.service).await?;
    apply(&Api::<Deployment>::namespaced(ctx.client.clone(), &ns), &built.deployment).await
}

/// Server-side apply with our one field manager. The API server does not write an object
/// whose applied fields are unchanged, so a resync or a restarted operator writes nothing
/// (the e2e suite checks resourceVersions across a restart).
async fn apply<K>(api: &Api<K>, desired: &K) -> Result<K, Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = desired.meta().name.clone().unwrap_or_default();
    api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(desired)).await.map_err(|source| {
        Error::Apply {
            kind: K::kind(&()).into_owned(),
            namespace: desired.meta().namespace.clone().unwrap_or_default(),
            name: name.clone(),
            source,
        }
    })
}

/// Creates the object unless it exists; never updates it. Returns whether it created it.
async fn create_if_absent<K>(api: &Api<K>, object: &K) -> Result<bool, Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() }, object).await {
        Ok(_) => Ok(true),
        // Another pipeline's reconcile made it in between; the next reconcile sees it.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(source) => Err(Error::Apply {
            kind: K::kind(&()).into_owned(),
            namespace: object.meta().namespace.clone().unwrap_or_default(),
            name: object.meta().name.clone().unwrap_or_default(),
            source,
        }),
    }
}

/// Writes the status `outcome` implies, if it differs from the current one. Returns whether it wrote.
async fn update_status(dp: &DataPipeline, ctx: &Context, outcome: &Outcome) -> Result<bool, Error> {
    let now = Time(Timestamp::now());
    let record = ctx.scaling.get(&pipeline_key(dp));
    let cache = ctx.scaling.cache(&pipeline_key(dp));
    let next = status::next(
        &dp.spec,
        dp.metadata.generation,
        dp.status.as_ref(),
        outcome,
        record.as_ref(),
        cache.as_ref(),
        &now,
    );
    if dp.status.as_ref() == Some(&next) {
        return Ok(false);
    }
    let (namespace, name) = key(dp);
    let api = Api::<DataPipeline>::namespaced(ctx.client.clone(), &namespace);
    let patch = serde_json::json!({ "status": next });
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(|source| Error::Status {
        namespace,
        name,
        source,
    })?;
    Ok(true)
}

async fn publish(ctx: &Context, dp: &DataPipeline, type_: EventType, reason: &str, note: &str) {
    let event = Event {
        type_,
        reason: reason.into(),
        // The events API caps notes at 1 kB.
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &dp.object_ref(&())).await {
        warn!(error = %e, reason, "could not publish an event");
    }
}
