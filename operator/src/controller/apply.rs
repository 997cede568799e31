//! The apply step: server-side apply of the built objects with one field manager, the
//! namespace's cache claim created once and never changed, and the workers' certificate
//! issued when it must be.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stoker_api::DataPipeline;

use super::objects::{self, PipelineObjects, worker_tls};
use super::{Context, Error, FIELD_MANAGER, publish};

fn claims(ctx: &Context, dp: &DataPipeline) -> Api<PersistentVolumeClaim> {
    Api::namespaced(ctx.client.clone(), &dp.namespace().unwrap_or_default())
}

/// The namespace's cache claim, if the pipeline caches and the claim was made already.
pub async fn existing_claim(ctx: &Context, dp: &DataPipeline) -> Result<Option<PersistentVolumeClaim>, Error> {
    if !objects::uses_cache_volume(&dp.spec) {
        return Ok(None);
    }
    claims(ctx, dp).get_opt(objects::CACHE_PVC).await.map_err(|source| Error::Apply {
        kind: "PersistentVolumeClaim".into(),
        namespace: dp.namespace().unwrap_or_default(),
        name: objects::CACHE_PVC.into(),
        source,
    })
}

/// With TLS: the pipeline's worker certificate, issued when missing, issued by another CA or
/// expiring, else left alone. Returns a digest of the certificate the workers should run with.
pub async fn worker_certificate(ctx: &Context, dp: &DataPipeline) -> Result<Option<String>, Error> {
    let Some(tls) = &ctx.tls else { return Ok(None) };
    let (namespace, name) = (dp.namespace().unwrap_or_default(), worker_tls::secret_name(dp));
    let api = Api::<Secret>::namespaced(ctx.client.clone(), &namespace);
    let existing = api.get_opt(&name).await.map_err(|source| Error::Apply {
        kind: "Secret".into(),
        namespace: namespace.clone(),
        name: name.clone(),
        source,
    })?;
    let secret = match (worker_tls::reissue(existing.as_ref(), tls.ca.fingerprint(), Timestamp::now()), existing) {
        (None, Some(kept)) => kept,
        (why, _) => {
            let names = worker_tls::certificate_names(dp);
            let issued = tls.ca.issue(&names, worker_tls::VALIDITY).map_err(|e| Error::Certificate {
                namespace: namespace.clone(),
                name: dp.name_any(),
                message: format!("{e:#}"),
            })?;
            let secret = objects::worker_certificate(dp, &issued, &tls.bundle, tls.ca.fingerprint());
            let applied = apply(&api, &secret).await?;
            let note = format!(
                "Issued the workers' TLS certificate for {} ({}), valid until {}",
                names[0],
                why.unwrap_or("missing"),
                Timestamp::from_second(issued.not_after.unix_timestamp()).unwrap_or(Timestamp::MAX)
            );
            tracing::info!(pipeline = %dp.name_any(), %namespace, %note);
            publish(ctx, dp, EventType::Normal, "CertificateIssued", &note).await;
            applied
        }
    };
    Ok(worker_tls::certificate_digest(&secret))
}

/// `claim`: the namespace's cache claim as it was found, if it existed.
pub async fn objects(
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
    if let Some(policy) = &built.network_policy {
        apply(&Api::<NetworkPolicy>::namespaced(ctx.client.clone(), &ns), policy).await?;
    }
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
