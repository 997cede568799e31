//! The workers Deployment: the pipeline's spec (as JSON in the env), the dispatcher's address,
//! the cache volume when caching, the projected token with Stoker's audience when
//! authenticating, the pipeline's certificate with TLS, the user's scheduling, resources, env
//! and volumes; pods non-root with a read-only root filesystem.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource,
    ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ProjectedVolumeSource, SeccompProfile, SecretEnvSource, SecretVolumeSource, SecurityContext,
    ServiceAccountTokenProjection, TCPSocketAction, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use stoker_api::tls::{CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV, WORKER_TLS_VOLUME};
use stoker_api::{Cache, DataPipeline, WORKER_CACHE_VOLUME, WORKER_TMP_VOLUME, WORKER_TOKEN_VOLUME, WorkerPipeline};

use super::worker_tls::{POD_CERTIFICATE_ANNOTATION, secret_name};
use super::{
    CACHE_MOUNT, CACHE_PVC, DATA_PORT, Identity, METRICS_PORT, WorkerDefaults, uses_cache_volume, workers_name,
};

pub(super) fn build(
    dp: &DataPipeline,
    identity: &Identity,
    defaults: &WorkerDefaults,
    replicas: i32,
    cache_volume: Option<&Quantity>,
    certificate: Option<&str>,
) -> Deployment {
    let spec = &dp.spec;
    let (volumes, mounts) = volumes(dp, defaults.token_audience.as_deref(), defaults.tls);
    let container = Container {
        name: "worker".into(),
        image: Some(spec.workers.image.clone().unwrap_or_else(|| defaults.image.clone())),
        env: Some(env(dp, &identity.namespace, defaults, cache_volume)),
        env_from: spec.data_plane.source.credentials_secret.as_ref().map(|secret| {
            vec![EnvFromSource {
                secret_ref: Some(SecretEnvSource { name: secret.clone(), optional: None }),
                ..Default::default()
            }]
        }),
        ports: Some(vec![
            ContainerPort {
                name: Some("data".into()),
                container_port: DATA_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            // The worker's /metrics, which the chart's PodMonitor scrapes by this name.
            ContainerPort {
                name: Some("metrics".into()),
                container_port: METRICS_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
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

    Deployment {
        metadata: identity.meta(&workers_name(dp)),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector { match_labels: Some(identity.selector.clone()), match_expressions: None },
            // Scaling is the autoscaler's job; a rollout should not double the workers.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::String("25%".into())),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(identity.labels.clone()),
                    // A new certificate restarts the workers: each reads its certificate at start.
                    annotations: certificate
                        .filter(|_| defaults.tls)
                        .map(|digest| [(POD_CERTIFICATE_ANNOTATION.to_string(), digest.to_string())].into()),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: Some(volumes),
                    service_account_name: spec.workers.service_account_name.clone(),
                    // Workers never call the API server; their only credential is the
                    // Stoker-audience token above, useless against the API server.
                    automount_service_account_token: Some(false),
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
    }
}

/// The worker's settings: its pipeline, where the dispatcher is, where it listens, and its
/// cache directory and cap when caching; the user's env last, so it can override ours.
fn env(dp: &DataPipeline, namespace: &str, defaults: &WorkerDefaults, cache_volume: Option<&Quantity>) -> Vec<EnvVar> {
    let spec = &dp.spec;
    let pipeline_json =
        serde_json::to_string(&WorkerPipeline::new(namespace, &dp.name_any(), spec)).expect("pipeline spec serializes");
    let field_ref = |path: &str| EnvVarSource {
        field_ref: Some(ObjectFieldSelector { field_path: path.to_string(), ..Default::default() }),
        ..Default::default()
    };
    let mut env = vec![
        EnvVar { name: "STOKER_PIPELINE".into(), value: Some(pipeline_json), ..Default::default() },
        EnvVar { name: "STOKER_DISPATCHER".into(), value: Some(defaults.dispatcher_url.clone()), ..Default::default() },
        EnvVar { name: "STOKER_LISTEN".into(), value: Some(format!("0.0.0.0:{DATA_PORT}")), ..Default::default() },
        EnvVar {
            name: "STOKER_METRICS_ADDR".into(),
            value: Some(format!("0.0.0.0:{METRICS_PORT}")),
            ..Default::default()
        },
        EnvVar { name: "POD_NAME".into(), value_from: Some(field_ref("metadata.name")), ..Default::default() },
        EnvVar { name: "POD_IP".into(), value_from: Some(field_ref("status.podIP")), ..Default::default() },
    ];
    if defaults.token_audience.is_some() {
        let token_file = format!("{}/token", WORKER_TOKEN_VOLUME.1);
        env.push(EnvVar {
            name: stoker_api::token::TOKEN_FILE_ENV.into(),
            value: Some(token_file),
            ..Default::default()
        });
        env.push(EnvVar { name: "STOKER_AUTHORIZE_READERS".into(), value: Some("true".into()), ..Default::default() });
    }
    if defaults.tls {
        let file = |name: &str, file: &str| EnvVar {
            name: name.into(),
            value: Some(format!("{}/{file}", WORKER_TLS_VOLUME.1)),
            ..Default::default()
        };
        env.extend([file(CERT_FILE_ENV, "tls.crt"), file(KEY_FILE_ENV, "tls.key"), file(CA_FILE_ENV, "ca.crt")]);
    }
    if uses_cache_volume(spec) {
        env.push(EnvVar { name: "STOKER_CACHE_DIR".into(), value: Some(CACHE_MOUNT.into()), ..Default::default() });
        if let Some(cap) = cache_volume.map_or_else(|| spec.cache.cap_bytes(), Cache::cap_for) {
            env.push(EnvVar {
                name: "STOKER_CACHE_CAP_BYTES".into(),
                value: Some(cap.to_string()),
                ..Default::default()
            });
        }
    }
    env.extend(spec.workers.env.iter().flatten().cloned());
    env
}

/// A writable /tmp (the root filesystem is read-only), the cache volume when caching, the token
/// when authenticating, the certificate with TLS, and the user's volumes after ours
/// (validation keeps their names and paths apart).
fn volumes(dp: &DataPipeline, token_audience: Option<&str>, tls: bool) -> (Vec<Volume>, Vec<VolumeMount>) {
    let spec = &dp.spec;
    // ((name, mount path), read-only, the volume's source).
    let mut ours = vec![(
        WORKER_TMP_VOLUME,
        false,
        Volume { empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() },
    )];
    if uses_cache_volume(spec) {
        let claim = PersistentVolumeClaimVolumeSource { claim_name: CACHE_PVC.into(), read_only: None };
        ours.push((
            (WORKER_CACHE_VOLUME.0, CACHE_MOUNT),
            false,
            Volume { persistent_volume_claim: Some(claim), ..Default::default() },
        ));
    }
    if let Some(audience) = token_audience {
        let token = ServiceAccountTokenProjection {
            audience: Some(audience.into()),
            // The kubelet rewrites it at 80% of this; workers read it every minute.
            expiration_seconds: Some(3600),
            path: "token".into(),
            ..Default::default()
        };
        let sources = vec![VolumeProjection { service_account_token: Some(token), ..Default::default() }];
        let projected = ProjectedVolumeSource { sources: Some(sources), ..Default::default() };
        ours.push((WORKER_TOKEN_VOLUME, true, Volume { projected: Some(projected), ..Default::default() }));
    }
    if tls {
        let secret = SecretVolumeSource {
            secret_name: Some(secret_name(dp)),
            // Readable by the worker's user only; fsGroup makes it the pod's group.
            default_mode: Some(0o440),
            ..Default::default()
        };
        ours.push((WORKER_TLS_VOLUME, true, Volume { secret: Some(secret), ..Default::default() }));
    }
    let (mut volumes, mut mounts): (Vec<Volume>, Vec<VolumeMount>) = ours
        .into_iter()
        .map(|((name, path), read_only, volume)| {
            let mount = VolumeMount {
                name: name.into(),
                mount_path: path.into(),
                read_only: read_only.then_some(true),
                ..Default::default()
            };
            (Volume { name: name.into(), ..volume }, mount)
        })
        .unzip();
    volumes.extend(spec.workers.volumes.iter().flatten().cloned());
    mounts.extend(spec.workers.volume_mounts.iter().flatten().cloned());
    (volumes, mounts)
}
