//! The build step: a DataPipeline in, the Kubernetes objects that run it out, one file per
//! object. Pure: no client, no clock, so every field is unit-tested here.

mod cache_claim;
mod deployment;
mod network_policy;
mod service;
pub mod worker_tls;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};
use stoker_api::{CacheMode, DataPipeline, DataPipelineSpec, WORKER_CACHE_VOLUME};

pub use cache_claim::{claim_differences, claim_size};

use crate::names;

/// The namespace's shared cache volume; one per namespace, never owned by a pipeline.
pub const CACHE_PVC: &str = "stoker-cache";
pub const CACHE_MOUNT: &str = WORKER_CACHE_VOLUME.1;
pub const DATA_PORT: i32 = 50052;
/// Where a worker serves /metrics (its `--metrics-addr` default).
pub const METRICS_PORT: i32 = 9090;
pub const MANAGED_BY: &str = "stoker-operator";
pub const PIPELINE_LABEL: &str = "stoker.dev/pipeline";

/// Operator-wide settings that shape every pipeline's objects.
#[derive(Clone, Debug)]
pub struct WorkerDefaults {
    pub image: String,
    /// Where workers reach the dispatcher (the operator's Service).
    pub dispatcher_url: String,
    /// With authentication on: the audience of the token mounted into worker pods, which also
    /// makes workers admit only readers the dispatcher approves.
    pub token_audience: Option<String>,
    /// Workers serve TLS with their pipeline's certificate (Secret `<pipeline>-workers-tls`)
    /// and verify the dispatcher with the CA bundle in it.
    pub tls: bool,
    /// With `--network-policy`: the operator's namespace, whose pods (with the pipeline's own
    /// namespace's) are the only ones a pipeline's NetworkPolicy lets reach its workers.
    pub network_policy: Option<String>,
}

/// Everything the operator applies for one pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineObjects {
    pub deployment: Deployment,
    pub service: Service,
    /// Present when the pipeline may cache; created if absent, never updated or deleted.
    pub cache_pvc: Option<PersistentVolumeClaim>,
    /// Present with `--network-policy`.
    pub network_policy: Option<NetworkPolicy>,
}

pub fn workers_name(dp: &DataPipeline) -> String {
    names::child(&dp.name_any(), "-workers")
}

/// Whether the pipeline's workers mount the namespace's cache volume.
pub fn uses_cache_volume(spec: &DataPipelineSpec) -> bool {
    spec.cache.mode != CacheMode::Never
}

/// The labels and metadata the workers Deployment, its pods and its Service share.
struct Identity {
    namespace: String,
    /// What the Service and the Deployment select pods by.
    selector: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    owner: k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
}

impl Identity {
    fn of(dp: &DataPipeline) -> Identity {
        let name = dp.name_any();
        let selector = BTreeMap::from([
            (PIPELINE_LABEL.to_string(), names::label_value(&name)),
            ("app.kubernetes.io/component".to_string(), "worker".to_string()),
        ]);
        let mut labels = selector.clone();
        labels.extend([
            ("app.kubernetes.io/name".to_string(), "stoker-worker".to_string()),
            ("app.kubernetes.io/instance".to_string(), names::label_value(&name)),
            ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
        ]);
        Identity {
            namespace: dp.namespace().unwrap_or_default(),
            selector,
            labels,
            owner: dp.controller_owner_ref(&()).expect("a DataPipeline from the API server has a uid"),
        }
    }

    /// Metadata of an object the pipeline owns.
    fn meta(&self, object_name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(object_name.to_string()),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels.clone()),
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }
}

/// `cache_volume`: the size of the namespace's claim if it exists (made for whichever pipeline
/// cached first, and never updated), which bounds the workers' cache whatever this spec asks.
/// `certificate`: with TLS, a digest of the workers' current certificate (a new one restarts them).
pub fn build(
    dp: &DataPipeline,
    defaults: &WorkerDefaults,
    replicas: i32,
    cache_volume: Option<&Quantity>,
    certificate: Option<&str>,
) -> PipelineObjects {
    let identity = Identity::of(dp);
    PipelineObjects {
        deployment: deployment::build(dp, &identity, defaults, replicas, cache_volume, certificate),
        service: service::build(dp, &identity),
        cache_pvc: uses_cache_volume(&dp.spec).then(|| cache_claim::build(&dp.spec, &identity.namespace)),
        network_policy: defaults.network_policy.as_deref().map(|ns| network_policy::build(dp, &identity, ns)),
    }
}

/// The Secret with the pipeline's worker certificate `issued` by the CA `issuer` (its
/// fingerprint), and the CA bundle workers verify the dispatcher with.
pub fn worker_certificate(dp: &DataPipeline, issued: &crate::tls::Issued, ca_bundle: &str, issuer: &str) -> Secret {
    worker_tls::build(dp, &Identity::of(dp), issued, ca_bundle, issuer)
}

#[cfg(test)]
mod tls_tests;

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{EnvVar, PodSpec};

    use super::*;

    fn pipeline(name: &str, extra: &str) -> DataPipeline {
        let spec = stoker_api::from_yaml(&format!(
            "source: {{uri: 's3://b/train/', format: imageFolder, credentialsSecret: s3}}\nbatchSize: 8\n{extra}"
        ))
        .unwrap();
        let mut dp = DataPipeline::new(name, spec);
        dp.metadata.namespace = Some("team-a".into());
        dp.metadata.uid = Some("uid-1".into());
        dp
    }

    fn defaults() -> WorkerDefaults {
        WorkerDefaults {
            image: "stoker-worker:test".into(),
            dispatcher_url: "http://d:50051".into(),
            token_audience: Some("stoker.dev".into()),
            tls: false,
            network_policy: None,
        }
    }

    #[test]
    fn a_network_policy_admits_only_the_pipelines_namespace_and_the_operators() {
        assert!(build(&pipeline("p", ""), &defaults(), 1, None, None).network_policy.is_none());
        let on = WorkerDefaults { network_policy: Some("stoker-system".into()), ..defaults() };
        let o = build(&pipeline("p", ""), &on, 1, None, None);
        let policy = o.network_policy.unwrap();
        assert_eq!(policy.metadata.name.as_deref(), Some("p-workers"));
        assert_eq!(policy.metadata.owner_references.as_ref().unwrap()[0].kind, "DataPipeline");
        let spec = policy.spec.unwrap();
        // The workers the Deployment runs, selected the same way.
        assert_eq!(spec.pod_selector.unwrap().match_labels, o.deployment.spec.selector.match_labels);
        assert_eq!(spec.policy_types.as_deref(), Some(&["Ingress".to_string()][..]));
        let rules = spec.ingress.unwrap();
        assert_eq!(rules.len(), 1, "one rule: anything else is denied");
        let from = rules[0].from.as_ref().unwrap();
        assert_eq!(from.len(), 2);
        assert!(from[0].namespace_selector.is_none() && from[0].pod_selector.is_some(), "this namespace's pods");
        let operator = from[1].namespace_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
        assert_eq!(operator["kubernetes.io/metadata.name"], "stoker-system");
        let port = &rules[0].ports.as_ref().unwrap()[0];
        assert_eq!(port.port, Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("data".into())));
    }

    fn pod(objects: &PipelineObjects) -> &PodSpec {
        objects.deployment.spec.template.spec.as_ref().unwrap()
    }

    fn env<'a>(pod: &'a PodSpec, name: &str) -> Option<&'a EnvVar> {
        pod.containers[0].env.as_ref().unwrap().iter().find(|e| e.name == name)
    }

    #[test]
    fn deployment_and_service_are_named_labelled_and_owned() {
        let o = build(&pipeline("imagenet", ""), &defaults(), 3, None, None);
        let d = &o.deployment;
        assert_eq!(d.metadata.name.as_deref(), Some("imagenet-workers"));
        assert_eq!(d.metadata.namespace.as_deref(), Some("team-a"));
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("DataPipeline", "imagenet", "uid-1")
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(d.spec.replicas, Some(3));
        let selector = d.spec.selector.match_labels.as_ref().unwrap();
        let template_labels = d.spec.template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
        assert!(selector.iter().all(|(k, v)| template_labels.get(k) == Some(v)), "selector matches the pods");
        assert_eq!(o.service.metadata.name.as_deref(), Some("imagenet-workers"));
        let svc = o.service.spec.as_ref().unwrap();
        assert_eq!(svc.cluster_ip.as_deref(), Some("None"));
        assert_eq!(svc.selector.as_ref(), Some(selector));
        assert_eq!(svc.ports.as_ref().unwrap()[0].port, DATA_PORT);
    }

    #[test]
    fn pods_are_non_root_with_read_only_root_and_writable_tmp() {
        let o = build(&pipeline("p", ""), &defaults(), 1, None, None);
        let p = pod(&o);
        assert_eq!(p.security_context.as_ref().unwrap().run_as_non_root, Some(true));
        let c = &p.containers[0];
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert!(c.volume_mounts.as_ref().unwrap().iter().any(|m| m.mount_path == "/tmp"));
    }

    #[test]
    fn worker_gets_its_pipeline_dispatcher_and_credentials() {
        let o = build(&pipeline("p", "transforms:\n- decodeImage: {}\nseed: 7\n"), &defaults(), 1, None, None);
        let p = pod(&o);
        let spec: serde_json::Value =
            serde_json::from_str(env(p, "STOKER_PIPELINE").unwrap().value.as_deref().unwrap()).unwrap();
        assert_eq!(spec["source"]["uri"], "s3://b/train/");
        assert_eq!(spec["transforms"][0]["decodeImage"]["channels"], 3);
        assert_eq!(spec["seed"], 7);
        assert_eq!(spec["namespace"], "team-a");
        assert_eq!(env(p, "STOKER_DISPATCHER").unwrap().value.as_deref(), Some("http://d:50051"));
        let from = &p.containers[0].env_from.as_ref().unwrap()[0];
        assert_eq!(from.secret_ref.as_ref().unwrap().name, "s3");
        assert_eq!(p.containers[0].image.as_deref(), Some("stoker-worker:test"));
    }

    #[test]
    fn scheduling_and_resources_pass_through() {
        let o = build(
            &pipeline(
                "p",
                "workers:\n  image: custom:1\n  serviceAccountName: sa\n  nodeSelector: {pool: cpu}\n  \
                 tolerations: [{key: k, operator: Exists}]\n  resources: {requests: {cpu: '4', memory: 8Gi}}\n  \
                 env: [{name: STOKER_LISTEN, value: '0.0.0.0:1'}]\n  \
                 volumes: [{name: data, persistentVolumeClaim: {claimName: corpus, readOnly: true}}]\n  \
                 volumeMounts: [{name: data, mountPath: /data, readOnly: true}]\n",
            ),
            &defaults(),
            1,
            None,
            None,
        );
        let p = pod(&o);
        assert_eq!(p.containers[0].image.as_deref(), Some("custom:1"));
        assert_eq!(p.service_account_name.as_deref(), Some("sa"));
        assert_eq!(p.node_selector.as_ref().unwrap()["pool"], "cpu");
        assert_eq!(p.tolerations.as_ref().unwrap()[0].key.as_deref(), Some("k"));
        let req = p.containers[0].resources.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(req["cpu"].0, "4");
        let claims: Vec<&str> = p
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| Some(v.persistent_volume_claim.as_ref()?.claim_name.as_str()))
            .collect();
        assert_eq!(claims, ["corpus"], "the user's volume beside the operator's scratch volume");
        let mounts: Vec<(&str, &str)> =
            p.containers[0].volume_mounts.iter().flatten().map(|m| (m.name.as_str(), m.mount_path.as_str())).collect();
        assert_eq!(
            mounts,
            [("tmp", "/tmp"), ("stoker-token", "/var/run/secrets/stoker.dev/serviceaccount"), ("data", "/data")]
        );
        // The user's env comes after ours, so it wins.
        let last = p.containers[0].env.as_ref().unwrap().iter().rev().find(|e| e.name == "STOKER_LISTEN").unwrap();
        assert_eq!(last.value.as_deref(), Some("0.0.0.0:1"));
    }

    #[test]
    fn workers_get_a_stoker_token_and_no_api_server_token_when_authenticating() {
        let on = build(&pipeline("p", ""), &defaults(), 1, None, None);
        let p = pod(&on);
        assert_eq!(p.automount_service_account_token, Some(false));
        let projected = p.volumes.iter().flatten().find(|v| v.name == "stoker-token").unwrap().projected.clone();
        let token = projected.unwrap().sources.unwrap()[0].service_account_token.clone().unwrap();
        assert_eq!((token.audience.as_deref(), token.path.as_str()), (Some("stoker.dev"), "token"));
        assert_eq!(
            env(p, "STOKER_TOKEN_FILE").unwrap().value.as_deref(),
            Some("/var/run/secrets/stoker.dev/serviceaccount/token")
        );
        assert_eq!(env(p, "STOKER_AUTHORIZE_READERS").unwrap().value.as_deref(), Some("true"));

        let open = WorkerDefaults { token_audience: None, ..defaults() };
        let off = build(&pipeline("p", ""), &open, 1, None, None);
        let p = pod(&off);
        assert!(p.volumes.iter().flatten().all(|v| v.name != "stoker-token"));
        assert!(env(p, "STOKER_AUTHORIZE_READERS").is_none() && env(p, "STOKER_TOKEN_FILE").is_none());
    }

    #[test]
    fn cache_volume_only_when_caching_and_never_owned() {
        let off = build(&pipeline("p", ""), &defaults(), 1, None, None);
        assert!(off.cache_pvc.is_none());
        assert!(env(pod(&off), "STOKER_CACHE_DIR").is_none());
        let on = build(
            &pipeline(
                "p",
                "cache: {mode: Auto, volumeSize: 20Gi, storageClassName: fast, accessMode: ReadWriteOnce}\n",
            ),
            &defaults(),
            1,
            None,
            None,
        );
        let pvc = on.cache_pvc.as_ref().unwrap();
        assert_eq!(pvc.metadata.name.as_deref(), Some(CACHE_PVC));
        assert!(pvc.metadata.owner_references.is_none(), "shared by the namespace, never garbage-collected");
        let s = pvc.spec.as_ref().unwrap();
        assert_eq!(s.access_modes.as_deref(), Some(&["ReadWriteOnce".to_string()][..]));
        assert_eq!(s.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(s.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0, "20Gi");
        let default_size =
            build(&pipeline("p", "cache: {mode: Auto}\n"), &defaults(), 1, None, None).cache_pvc.unwrap();
        assert_eq!(default_size.spec.unwrap().resources.unwrap().requests.unwrap()["storage"].0, "100Gi");
        let p = pod(&on);
        assert_eq!(env(p, "STOKER_CACHE_DIR").unwrap().value.as_deref(), Some(CACHE_MOUNT));
        let cap = ((20u64 << 30) as f64 * 0.9) as u64;
        assert_eq!(env(p, "STOKER_CACHE_CAP_BYTES").unwrap().value, Some(cap.to_string()), "90% of the volume");
        assert!(
            p.volumes
                .as_ref()
                .unwrap()
                .iter()
                .any(|v| v.persistent_volume_claim.as_ref().is_some_and(|c| c.claim_name == CACHE_PVC))
        );
    }

    #[test]
    fn an_existing_claim_sets_the_cap_and_what_differs_is_said() {
        let asks = "cache: {mode: Auto, volumeSize: 20Gi, storageClassName: fast, accessMode: ReadWriteMany}\n";
        let made_for = |extra: &str| build(&pipeline("first", extra), &defaults(), 1, None, None).cache_pvc.unwrap();
        let cap = |o: &PipelineObjects| env(pod(o), "STOKER_CACHE_CAP_BYTES").and_then(|e| e.value.clone());
        let ninety_percent_of_gib = |gib: u64| (((gib << 30) as f64 * 0.9) as u64).to_string();

        let on_claim = |claim: &PersistentVolumeClaim| {
            build(&pipeline("p", asks), &defaults(), 1, claim_size(claim).as_ref(), None)
        };

        let same_claim = made_for(asks);
        let same = on_claim(&same_claim);
        assert!(claim_differences(same.cache_pvc.as_ref().unwrap(), &same_claim).is_empty());
        assert_eq!(cap(&same), Some(ninety_percent_of_gib(20)));

        let claim = made_for("cache: {mode: Auto, volumeSize: 5Gi, accessMode: ReadWriteOnce}\n");
        let other = on_claim(&claim);
        let differences = claim_differences(other.cache_pvc.as_ref().unwrap(), &claim);
        assert_eq!(
            differences,
            [
                "volumeSize 20Gi (the claim has 5Gi)",
                "storageClassName fast (the claim has the default)",
                "accessMode ReadWriteMany (the claim has ReadWriteOnce)"
            ]
        );
        assert_eq!(cap(&other), Some(ninety_percent_of_gib(5)), "the claim's size, not the spec's");
        assert_eq!(
            pod(&other).containers[0]
                .env
                .as_ref()
                .unwrap()
                .iter()
                .filter(|e| e.name == "STOKER_CACHE_CAP_BYTES")
                .count(),
            1
        );
    }

    #[test]
    fn long_names_fit_kubernetes_limits() {
        let name = format!("{}.train", "a".repeat(240));
        let o = build(&pipeline(&name, ""), &defaults(), 1, None, None);
        let n = o.deployment.metadata.name.unwrap();
        assert!(n.len() <= 63 && n.ends_with("-workers"), "{n}");
        for v in o.deployment.metadata.labels.unwrap().values() {
            assert!(v.len() <= 63, "{v}");
        }
    }

    #[test]
    fn scaling_knobs_do_not_change_the_pod_template() {
        let a = build(&pipeline("p", "workers: {min: 1, max: 4}\n"), &defaults(), 1, None, None);
        let b = build(
            &pipeline("p", "workers: {min: 1, max: 9}\nautoscaling: {policy: {windowSeconds: 30}}\n"),
            &defaults(),
            1,
            None,
            None,
        );
        assert_eq!(a.deployment.spec.template, b.deployment.spec.template);
    }
}
