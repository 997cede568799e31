//! A spec becomes objects: the reconciler, one pipeline at a time, validate -> build -> apply
//! -> status. Read in this order: this file (the steps), [`objects`] (the build step: pure,
//! one file per object), [`apply`] (server-side apply), [`status`] (pure: what status says).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use stoker_api::{DataPipeline, validate};
use tokio::sync::watch;
use tracing::{debug, info, warn};

pub mod apply;
pub mod objects;
pub mod status;

use self::objects::{MANAGED_BY, WorkerDefaults};
use self::status::Outcome;
use crate::autoscaling::ScalingBook;
use crate::autoscaling::replicas::replicas_of;
use crate::events;
use crate::key::PipelineKey;
use crate::metrics::Metrics;

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
    /// With TLS: the CA that signs each pipeline's worker certificate.
    pub tls: Option<Arc<WorkersTls>>,
    /// Consecutive failures per pipeline, for exponential backoff.
    failures: Mutex<HashMap<PipelineKey, u32>>,
}

/// What the operator issues worker certificates with.
pub struct WorkersTls {
    pub ca: crate::tls::Ca,
    /// The CA certificates workers verify the dispatcher with (`ca.crt` in their Secret).
    pub bundle: String,
}

impl Context {
    pub fn new(
        client: Client,
        defaults: WorkerDefaults,
        metrics: Metrics,
        recorder: Recorder,
        scaling: Arc<ScalingBook>,
    ) -> Self {
        Context { client, defaults, metrics, recorder, scaling, tls: None, failures: Mutex::default() }
    }

    /// Issue worker certificates with `tls` (the defaults must say workers serve TLS).
    pub fn with_tls(mut self, tls: WorkersTls) -> Self {
        self.tls = Some(Arc::new(tls));
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("applying {kind} {namespace}/{name}: {source}")]
    Apply { kind: String, namespace: String, name: String, source: kube::Error },
    #[error("updating the status of {namespace}/{name}: {source}")]
    Status { namespace: String, name: String, source: kube::Error },
    #[error("issuing the workers' certificate of {namespace}/{name}: {message}")]
    Certificate { namespace: String, name: String, message: String },
}

impl Error {
    fn kind(&self) -> &'static str {
        match self {
            Error::Apply { .. } => "apply",
            Error::Status { .. } => "status",
            Error::Certificate { .. } => "certificate",
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
        ctx.failures.lock().unwrap().remove(&PipelineKey::of(&dp));
    }
    result
}

fn error_policy(dp: Arc<DataPipeline>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.failed(error.kind());
    let mut failures = ctx.failures.lock().unwrap();
    let key = PipelineKey::of(&dp);
    let n = failures.entry(key.clone()).or_insert(0);
    *n += 1;
    let delay = Duration::from_secs(1u64 << (*n - 1).min(9)).min(MAX_BACKOFF);
    warn!(pipeline = %key.name, namespace = %key.namespace, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
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

    let replicas = replicas_of(dp, ctx.scaling.get(&PipelineKey::of(dp)).map(|r| r.workers));
    // The namespace's claim, if made already: its size bounds the workers' cache.
    let claim = apply::existing_claim(ctx, dp).await?;
    let size = claim.as_ref().and_then(objects::claim_size);
    // Before the Deployment, whose pods mount it (and restart when it is new).
    let applied = match apply::worker_certificate(ctx, dp).await {
        Ok(certificate) => {
            let built = objects::build(dp, &ctx.defaults, replicas, size.as_ref(), certificate.as_deref());
            apply::objects(ctx, dp, &built, claim.as_ref()).await
        }
        Err(e) => Err(e),
    };
    match applied {
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

/// Writes the status `outcome` implies, if it differs from the current one. Returns whether it wrote.
async fn update_status(dp: &DataPipeline, ctx: &Context, outcome: &Outcome) -> Result<bool, Error> {
    let now = Time(Timestamp::now());
    let record = ctx.scaling.get(&PipelineKey::of(dp));
    let cache = ctx.scaling.cache(&PipelineKey::of(dp));
    let delivery = ctx.scaling.delivery(&PipelineKey::of(dp));
    let data_wait = ctx.scaling.data_wait(&PipelineKey::of(dp));
    let workers = ctx.scaling.report(&PipelineKey::of(dp));
    let jobs = ctx.scaling.job_list(&PipelineKey::of(dp));
    let next = status::next(
        &dp.spec,
        dp.metadata.generation,
        dp.status.as_ref(),
        outcome,
        &status::Observed {
            scaling: record.as_ref(),
            cache: cache.as_ref(),
            delivery: delivery.as_ref(),
            data_wait: data_wait.as_ref(),
            workers: workers.as_ref(),
            jobs: jobs.as_deref(),
        },
        &now,
    );
    if dp.status.as_ref() == Some(&next) {
        return Ok(false);
    }
    let PipelineKey { namespace, name } = PipelineKey::of(dp);
    let api = Api::<DataPipeline>::namespaced(ctx.client.clone(), &namespace);
    let patch = serde_json::json!({ "status": next });
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.map_err(|source| Error::Status {
        namespace,
        name,
        source,
    })?;
    let before = dp.status.as_ref().and_then(|s| s.profile.as_ref());
    if let Some(note) = status::dominant_changed(before, next.profile.as_ref()) {
        publish(ctx, dp, EventType::Normal, "DominantOpChanged", &note).await;
    }
    Ok(true)
}

async fn publish(ctx: &Context, dp: &DataPipeline, type_: EventType, reason: &str, note: &str) {
    events::publish(&ctx.recorder, dp, type_, reason, "Reconcile", note).await
}
