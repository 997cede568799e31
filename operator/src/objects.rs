//! The build step: a DataPipeline in, the Kubernetes objects that run it out. Pure: no client,
//! no clock, so every field is unit-tested here.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource,
    ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource,
    PodSecurityContext, PodSpec, PodTemplateSpec, Probe, SeccompProfile, SecretEnvSource, SecurityContext, Service,
    ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use stoker_api::{
    AutoscalingMode, Cache, CacheMode, DataPipeline, DataPipelineSpec, WORKER_CACHE_VOLUME, WORKER_TMP_VOLUME,
    WorkerPipeline,
};

use crate::names;

/// The namespace's shared cache volume; one per namespace, never owned by a pipeline.
pub const CACHE_PVC: &str = "stoker-cache";
pub const CACHE_MOUNT: &str = WORKER_CACHE_VOLUME.1;
pub const DATA_PORT: i32 = 50052;
pub const MANAGED_BY: &str = "stoker-operator";
pub const PIPELINE_LABEL: &str = "stoker.dev/pipeline";

/// Operator-wide settings that shape every pipeline's objects.
#[derive(Clone, Debug)]
pub struct WorkerDefaults {
    pub image: String,
    /// Where workers reach the dispatcher (the operator's Service).
    pub dispatcher_url: String,
}

/// Everything the operator applies for one pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineObjects {
    pub deployment: Deployment,
    pub service: Service,
    /// Present when the pipeline may cache; created if absent, never updated or deleted.
    pub cache_pvc: Option<PersistentVolumeClaim>,
}

pub fn workers_name(dp: &DataPipeline) -> String {
    names::child(&dp.name_any(), "-workers")
}

/// Worker count to run before the autoscaler has an opinion.
pub fn initial_replicas(spec: &DataPipelineSpec) -> i32 {
    match spec.autoscaling.mode {
        AutoscalingMode::Fixed => spec.autoscaling.replicas.unwrap_or(spec.workers.min),
        AutoscalingMode::BatchTime => spec.workers.min,
    }
}

/// Worker count to run now: Fixed runs `replicas`; BatchTime runs what the autoscaler decided,
/// else what the status last recorded (a new leader continues where the old one was), else
/// min. Always within [min, max], so a spec change of the bounds takes effect at once.
pub fn desired_replicas(spec: &DataPipelineSpec, recorded: Option<i32>, decided: Option<u32>) -> i32 {
    match spec.autoscaling.mode {
        AutoscalingMode::Fixed => initial_replicas(spec),
        AutoscalingMode::BatchTime => {
            let want = decided.map(|n| n.min(i32::MAX as u32) as i32).or(recorded).unwrap_or(spec.workers.min);
            want.clamp(spec.workers.min, spec.workers.max.max(spec.workers.min))
        }
    }
}

/// Whether the pipeline's workers mount the namespace's cache volume.
pub fn uses_cache_volume(spec: &DataPipelineSpec) -> bool {
    spec.cache.mode != CacheMode::Never
}

/// `cache_volume`: the size of the namespace's claim if it exists (made for whichever pipeline
/// cached first, and never updated), which bounds the workers' cache whatever this spec asks.
pub fn build(
    dp: &DataPipeline,
    defaults: &WorkerDefaults,
    replicas: i32,
    cache_volume: Option<&Quantity>,
) -> PipelineObjects {
    let name = dp.name_any();
    let ns = dp.namespace().unwrap_or_default();
    let spec = &dp.spec;
    let workers = workers_name(dp);
    let owner = dp.controller_owner_ref(&()).expect("a DataPipeline from the API server has a uid");

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
    let meta = |object_name: &str| ObjectMeta {
        name: Some(object_name.to_string()),
        namespace: Some(ns.clone()),
        labels: Some(labels.clone()),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    };

    let caching = uses_cache_volume(spec);
    let pipeline_json =
        serde_json::to_string(&WorkerPipeline::new(&ns, &name, spec)).expect("pipeline spec serializes");

    let field_ref = |path: &str| EnvVarSource {
        field_ref: Some(ObjectFieldSelector { field_path: path.to_string(), ..Default::default() }),
        ..Default::default()
    };
    let mut env = vec![
        EnvVar { name: "STOKER_PIPELINE".into(), value: Some(pipeline_json), ..Default::default() },
        EnvVar { name: "STOKER_DISPATCHER".into(), value: Some(defaults.dispatcher_url.clone()), ..Default::default() },
        EnvVar { name: "STOKER_LISTEN".into(), value: Some(format!("0.0.0.0:{DATA_PORT}")), ..Default::default() },
        EnvVar { name: "POD_NAME".into(), value_from: Some(field_ref("metadata.name")), ..Default::default() },
        EnvVar { name: "POD_IP".into(), value_from: Some(field_ref("status.podIP")), ..Default::default() },
    ];
    if caching {
        env.push(EnvVar { name: "STOKER_CACHE_DIR".into(), value: Some(CACHE_MOUNT.into()), ..Default::default() });
        if let Some(cap) = cache_volume.map_or_else(|| spec.cache.cap_bytes(), Cache::cap_for) {
            env.push(EnvVar {
                name: "STOKER_CACHE_CAP_BYTES".into(),
                value: Some(cap.to_string()),
                ..Default::default()
            });
        }
    }
    // User env last so it can override ours deliberately.
    env.extend(spec.workers.env.iter().flatten().cloned());

    let (tmp, tmp_path) = WORKER_TMP_VOLUME;
    let mut volumes =
        vec![Volume { name: tmp.into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() }];
    let mut mounts = vec![VolumeMount { name: tmp.into(), mount_path: tmp_path.into(), ..Default::default() }];
    if caching {
        volumes.push(Volume {
            name: WORKER_CACHE_VOLUME.0.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: CACHE_PVC.into(),
                read_only: None,
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: WORKER_CACHE_VOLUME.0.into(),
            mount_path: CACHE_MOUNT.into(),
            ..Default::default()
        });
    }
    // The user's after ours; validation keeps their names and paths apart.
    volumes.extend(spec.workers.volumes.iter().flatten().cloned());
    mounts.extend(spec.workers.volume_mounts.iter().flatten().cloned());

    let container = Container {
        name: "worker".into(),
        image: Some(spec.workers.image.clone().unwrap_or_else(|| defaults.image.clone())),
        env: Some(env),
        env_from: spec.source.credentials_secret.as_ref().map(|secret| {
            vec![EnvFromSource {
                secret_ref: Some(SecretEnvSource { name: secret.clone(), optional: None }),
                ..Default::default()
            }]
        }),
        ports: Some(vec![ContainerPort {
            name: Some("data".into()),
            container_port: DATA_PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction { port: IntOrString::String("data".into()), host: None }),
            period_seconds: Some(5),
            ..Default::default()
        }),
        resources: spec.workers.resources.clone(),
        volume_mounts: Some(mounts),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), add: None }),
            ..Default::default()
        }),
        ..Default::default()
    };

    let deployment = Deployment {
        metadata: meta(&workers),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector { match_labels: Some(selector.clone()), match_expressions: None },
            // Scaling is the autoscaler's job; a rollout should not double the workers.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::String("25%".into())),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(volumes),
                    service_account_name: spec.workers.service_account_name.clone(),
                    node_selector: spec.workers.node_selector.clone(),
                    tolerations: spec.workers.tolerations.clone(),
                    affinity: spec.workers.affinity.clone(),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        run_as_group: Some(65532),
                        fs_group: Some(65532),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".into(),
                            localhost_profile: None,
                        }),
                        ..Default::default()
                    }),
                    // Workers drain in-flight batches on SIGTERM; a few seconds is plenty.
                    termination_grace_period_seconds: Some(10),
                    ..Default::default()
                }),
            },
            ..Default::default()
        },
        status: None,
    };

    let service = Service {
        metadata: meta(&workers),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("data".into()),
                port: DATA_PORT,
                target_port: Some(IntOrString::String("data".into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    };

    let cache_pvc = caching.then(|| PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(CACHE_PVC.into()),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/name".to_string(), "stoker-cache".to_string()),
                ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
            ])),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![spec.cache.access_mode.as_str().into()]),
            storage_class_name: spec.cache.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), spec.cache.volume_size())])),
                limits: None,
            }),
            ..Default::default()
        }),
        status: None,
    });

    PipelineObjects { deployment, service, cache_pvc }
}

/// The size a claim asked for. Not a bound claim's capacity: that appears later and would
/// change the workers' env, restarting them, for a difference a provisioner's rounding makes.
pub fn claim_size(claim: &PersistentVolumeClaim) -> Option<Quantity> {
    claim.spec.as_ref()?.resources.as_ref()?.requests.as_ref()?.get("storage").cloned()
}

/// What the claim this pipeline would make (`wanted`) asks for that the existing one lacks,
/// for the user to see.
pub fn claim_differences(wanted: &PersistentVolumeClaim, have: &PersistentVolumeClaim) -> Vec<String> {
    let (want_spec, have_spec) = (wanted.spec.clone().unwrap_or_default(), have.spec.clone().unwrap_or_default());
    let mut differences = Vec::new();
    if let (Some(want), Some(size)) = (claim_size(wanted), claim_size(have))
        && Cache::cap_for(&want) != Cache::cap_for(&size)
    {
        differences.push(format!("volumeSize {} (the claim has {})", want.0, size.0));
    }
    if want_spec.storage_class_name.is_some() && want_spec.storage_class_name != have_spec.storage_class_name {
        let class = |c: &Option<String>| c.clone().unwrap_or_else(|| "the default".into());
        differences.push(format!(
            "storageClassName {} (the claim has {})",
            class(&want_spec.storage_class_name),
            class(&have_spec.storage_class_name)
        ));
    }
    if want_spec.access_modes != have_spec.access_modes {
        let modes = |m: &Option<Vec<String>>| m.clone().unwrap_or_default().join(",");
        differences.push(format!(
            "accessMode {} (the claim has {})",
            modes(&want_spec.access_modes),
            modes(&have_spec.access_modes)
        ));
    }
    differences
}

#[cfg(test)]
mod tests {
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
        WorkerDefaults { image: "stoker-worker:test".into(), dispatcher_url: "http://d:50051".into() }
    }

    fn pod(objects: &PipelineObjects) -> &PodSpec {
        objects.deployment.spec.template.spec.as_ref().unwrap()
    }

    fn env<'a>(pod: &'a PodSpec, name: &str) -> Option<&'a EnvVar> {
        pod.containers[0].env.as_ref().unwrap().iter().find(|e| e.name == name)
    }

    #[test]
    fn deployment_and_service_are_named_labelled_and_owned() {
        let o = build(&pipeline("imagenet", ""), &defaults(), 3, None);
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
        let o = build(&pipeline("p", ""), &defaults(), 1, None);
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
        let o = build(&pipeline("p", "transforms:\n- decodeImage: {}\nseed: 7\n"), &defaults(), 1, None);
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
        assert_eq!(mounts, [("tmp", "/tmp"), ("data", "/data")]);
        // The user's env comes after ours, so it wins.
        let last = p.containers[0].env.as_ref().unwrap().iter().rev().find(|e| e.name == "STOKER_LISTEN").unwrap();
        assert_eq!(last.value.as_deref(), Some("0.0.0.0:1"));
    }

    #[test]
    fn cache_volume_only_when_caching_and_never_owned() {
        let off = build(&pipeline("p", ""), &defaults(), 1, None);
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
        );
        let pvc = on.cache_pvc.as_ref().unwrap();
        assert_eq!(pvc.metadata.name.as_deref(), Some(CACHE_PVC));
        assert!(pvc.metadata.owner_references.is_none(), "shared by the namespace, never garbage-collected");
        let s = pvc.spec.as_ref().unwrap();
        assert_eq!(s.access_modes.as_deref(), Some(&["ReadWriteOnce".to_string()][..]));
        assert_eq!(s.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(s.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0, "20Gi");
        let default_size = build(&pipeline("p", "cache: {mode: Auto}\n"), &defaults(), 1, None).cache_pvc.unwrap();
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
        let made_for = |extra: &str| build(&pipeline("first", extra), &defaults(), 1, None).cache_pvc.unwrap();
        let cap = |o: &PipelineObjects| env(pod(o), "STOKER_CACHE_CAP_BYTES").and_then(|e| e.value.clone());
        let ninety_percent_of_gib = |gib: u64| (((gib << 30) as f64 * 0.9) as u64).to_string();

        let on_claim =
            |claim: &PersistentVolumeClaim| build(&pipeline("p", asks), &defaults(), 1, claim_size(claim).as_ref());

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
        let o = build(&pipeline(&name, ""), &defaults(), 1, None);
        let n = o.deployment.metadata.name.unwrap();
        assert!(n.len() <= 63 && n.ends_with("-workers"), "{n}");
        for v in o.deployment.metadata.labels.unwrap().values() {
            assert!(v.len() <= 63, "{v}");
        }
    }

    #[test]
    fn desired_replicas_follow_the_autoscaler_within_bounds() {
        let p = pipeline("p", "workers: {min: 2, max: 6}\n");
        assert_eq!(desired_replicas(&p.spec, None, None), 2, "min before anything is known");
        assert_eq!(desired_replicas(&p.spec, Some(4), None), 4, "a new leader keeps the recorded count");
        assert_eq!(desired_replicas(&p.spec, Some(4), Some(5)), 5, "the decision wins");
        assert_eq!(desired_replicas(&p.spec, None, Some(50)), 6, "capped at max");
        assert_eq!(desired_replicas(&p.spec, Some(1), None), 2, "raised to min");
        let fixed = pipeline("p", "autoscaling: {mode: Fixed, replicas: 3}\nworkers: {min: 1, max: 4}\n");
        assert_eq!(desired_replicas(&fixed.spec, Some(1), Some(4)), 3, "Fixed ignores the autoscaler");
    }

    #[test]
    fn initial_replicas_follow_the_mode() {
        assert_eq!(initial_replicas(&pipeline("p", "workers: {min: 2, max: 4}\n").spec), 2);
        let fixed = pipeline("p", "autoscaling: {mode: Fixed, replicas: 3}\nworkers: {min: 1, max: 4}\n");
        assert_eq!(initial_replicas(&fixed.spec), 3);
    }

    #[test]
    fn scaling_knobs_do_not_change_the_pod_template() {
        let a = build(&pipeline("p", "workers: {min: 1, max: 4}\n"), &defaults(), 1, None);
        let b = build(
            &pipeline("p", "workers: {min: 1, max: 9}\nautoscaling: {policy: {windowSeconds: 30}}\n"),
            &defaults(),
            1,
            None,
        );
        assert_eq!(a.deployment.spec.template, b.deployment.spec.template);
    }
}
