//! Plays the kubelet for worker Deployments on the local provider, which has none: runs as many
//! `stoker-worker` processes as each workers Deployment of a namespace asks for, with the pod
//! template's environment and its token and Secret volumes as directories, so scaling
//! decisions become real processes.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams};
use stoker_api::tls::{Scheme, with_scheme};

use crate::process::ManagedProcess;

/// The label the operator puts on worker Deployments.
const WORKER_SELECTOR: &str = "app.kubernetes.io/component=worker";

/// A worker process and the address of its metrics endpoint.
struct Pod {
    process: ManagedProcess,
    metrics: std::net::SocketAddr,
}

type Pods = Arc<Mutex<BTreeMap<String, Vec<Pod>>>>;

pub struct ProcessKubelet {
    pods: Pods,
    task: tokio::task::JoinHandle<()>,
}

impl ProcessKubelet {
    /// Follows the namespace's worker Deployments until dropped. Workers reach the dispatcher
    /// at `dispatcher_url` and log to `log_dir`.
    pub fn start(
        client: kube::Client,
        namespace: &str,
        dispatcher_url: String,
        log_dir: PathBuf,
    ) -> anyhow::Result<Self> {
        let binary = crate::tools::workspace_binary("stoker-worker")?;
        let api: Api<Deployment> = Api::namespaced(client, namespace);
        let pods: Pods = Arc::default();
        let task = {
            let pods = pods.clone();
            let client = api.clone().into_client();
            tokio::spawn(async move {
                let mut started = 0u64;
                let mut volumes = Volumes::default();
                loop {
                    match api.list(&ListParams::default().labels(WORKER_SELECTOR)).await {
                        Ok(list) => {
                            let mut ready = Vec::new();
                            for d in list.items {
                                match volumes.project(&client, &d, &log_dir).await {
                                    Ok(()) => ready.push(d),
                                    // As a kubelet does, the pod waits for its volumes.
                                    Err(e) => eprintln!("kubelet: volumes of {:?} not ready: {e:#}", d.metadata.name),
                                }
                            }
                            sync(&pods, &ready, &binary, &dispatcher_url, &log_dir, &volumes, &mut started)
                        }
                        Err(e) => eprintln!("kubelet: listing Deployments: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };
        Ok(ProcessKubelet { pods, task })
    }

    /// Worker processes running for a Deployment.
    pub fn running(&self, deployment: &str) -> usize {
        let mut pods = self.pods.lock().unwrap();
        pods.get_mut(deployment)
            .map_or(0, |v| v.iter_mut().filter_map(|p| p.process.is_running().then_some(())).count())
    }

    /// The metrics endpoints of the namespace's running workers.
    pub fn metrics_addrs(&self) -> Vec<std::net::SocketAddr> {
        let mut pods = self.pods.lock().unwrap();
        pods.values_mut().flatten().filter_map(|p| p.process.is_running().then_some(p.metrics)).collect()
    }

    /// Kills one of a Deployment's workers abruptly, like a node failure; a replacement starts
    /// on the next sync, as a ReplicaSet would make one.
    pub fn kill_one(&self, deployment: &str) -> bool {
        let mut pods = self.pods.lock().unwrap();
        match pods.get_mut(deployment).and_then(|v| v.pop()) {
            Some(mut p) => {
                p.process.kill();
                true
            }
            None => false,
        }
    }
}

impl Drop for ProcessKubelet {
    fn drop(&mut self) {
        self.task.abort();
        // Dropping the processes terminates them.
        self.pods.lock().unwrap().clear();
    }
}

fn sync(
    pods: &Pods,
    deployments: &[Deployment],
    binary: &std::path::Path,
    dispatcher_url: &str,
    log_dir: &std::path::Path,
    volumes: &Volumes,
    started: &mut u64,
) {
    let mut pods = pods.lock().unwrap();
    let names: Vec<String> = deployments.iter().filter_map(|d| d.metadata.name.clone()).collect();
    pods.retain(|name, _| names.contains(name));
    for d in deployments {
        let Some(name) = d.metadata.name.clone() else { continue };
        let want = d.spec.replicas.unwrap_or(1).max(0) as usize;
        let running = pods.entry(name.clone()).or_default();
        running.retain_mut(|p| p.process.is_running());
        while running.len() > want {
            let mut p = running.pop().expect("more than wanted");
            // Off the runtime: terminating waits for the worker to exit.
            std::thread::spawn(move || p.process.terminate());
        }
        while running.len() < want {
            *started += 1;
            match spawn(d, binary, dispatcher_url, log_dir, volumes, *started) {
                Ok(p) => running.push(p),
                Err(e) => {
                    eprintln!("kubelet: starting a worker for {name}: {e:#}");
                    break;
                }
            }
        }
    }
}

/// A worker process with the pod template's literal env; the listen and dispatcher addresses
/// are what a pod would get from its IP and the Service.
fn spawn(
    d: &Deployment,
    binary: &std::path::Path,
    dispatcher_url: &str,
    log_dir: &std::path::Path,
    projected: &Volumes,
    n: u64,
) -> anyhow::Result<Pod> {
    let container = d
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|p| p.containers.first())
        .ok_or_else(|| anyhow::anyhow!("the Deployment has no container"))?;
    let mut env: Vec<(String, String)> =
        container.env.iter().flatten().filter_map(|e| Some((e.name.clone(), e.value.clone()?))).collect();
    // PVC mounts become a directory per (namespace, claim), shared by every process that
    // mounts the claim, as a ReadWriteMany volume is; env naming the mount path follows it.
    let namespace = d.metadata.namespace.as_deref().unwrap_or("default");
    let volumes = d.spec.template.spec.as_ref().and_then(|p| p.volumes.clone()).unwrap_or_default();
    for mount in container.volume_mounts.iter().flatten() {
        let claim = volumes.iter().find(|v| v.name == mount.name).and_then(|v| v.persistent_volume_claim.as_ref());
        if let Some(claim) = claim {
            let dir = log_dir.join("volumes").join(namespace).join(&claim.claim_name);
            std::fs::create_dir_all(&dir)?;
            for (_, value) in env.iter_mut().filter(|(_, v)| *v == mount.mount_path) {
                *value = dir.display().to_string();
            }
        }
    }
    // A projected token or Secret volume becomes the directory its files were written to.
    for mount in container.volume_mounts.iter().flatten() {
        if let Some(dir) = projected.dirs.get(&(
            namespace.to_string(),
            mount.name.clone(),
            d.metadata.name.clone().unwrap_or_default(),
        )) {
            let prefix = format!("{}/", mount.mount_path.trim_end_matches('/'));
            for (_, value) in env.iter_mut().filter(|(_, v)| v.starts_with(&prefix)) {
                *value = format!("{}/{}", dir.display(), &value[prefix.len()..]);
            }
        }
    }
    // The dispatcher is reached where this machine has it, over TLS when the pod's is.
    let tls = env.iter().any(|(k, v)| k == "STOKER_DISPATCHER" && v.starts_with("https://"));
    let scheme = if tls { Scheme::Tls } else { Scheme::Plaintext };
    env.retain(|(k, _)| {
        !matches!(k.as_str(), "STOKER_LISTEN" | "STOKER_METRICS_ADDR" | "STOKER_DISPATCHER" | "STOKER_THREADS")
    });
    // The workers share this host's ports: each takes free ones (its metrics port chosen here,
    // so a Prometheus can be told where to scrape).
    let metrics = crate::ports::free_addr();
    env.push(("STOKER_LISTEN".into(), "127.0.0.1:0".into()));
    env.push(("STOKER_METRICS_ADDR".into(), metrics.to_string()));
    env.push(("STOKER_DISPATCHER".into(), with_scheme(dispatcher_url, &scheme)));
    // One transform thread per worker: this machine's cores are shared by all of them.
    env.push(("STOKER_THREADS".into(), "1".into()));
    let name = format!("{}-{n}", d.metadata.name.as_deref().unwrap_or("worker"));
    let log = log_dir.join(format!("{name}.log"));
    let process = ManagedProcess::spawn(&name, binary, &Vec::<String>::new(), &env, &log)?;
    Ok(Pod { process, metrics })
}

/// What the kubelet puts in a pod's volumes: projected ServiceAccount tokens (one TokenRequest
/// per Deployment's volume, for the pod's ServiceAccount and the volume's audience) and Secrets
/// (their keys as files, written again when the pod template changes), each in a directory that
/// stands in for the mount.
#[derive(Default)]
struct Volumes {
    /// (namespace, volume, deployment) -> the directory holding the volume's files.
    dirs: HashMap<(String, String, String), PathBuf>,
    /// The Deployment generation each Secret volume was written at: a renewed certificate
    /// changes the pod template (its digest annotation), so the Secret is read again only then.
    secrets_at: HashMap<(String, String, String), Option<i64>>,
}

impl Volumes {
    /// Writes the Deployment's token and Secret volumes; an error when one cannot be (a Secret
    /// not made yet): its pods wait, as a kubelet's do.
    async fn project(
        &mut self,
        client: &kube::Client,
        d: &Deployment,
        log_dir: &std::path::Path,
    ) -> anyhow::Result<()> {
        let namespace = d.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let name = d.metadata.name.clone().unwrap_or_default();
        let Some(pod) = d.spec.template.spec.as_ref() else { return Ok(()) };
        let account = pod.service_account_name.clone().unwrap_or_else(|| "default".into());
        for volume in pod.volumes.iter().flatten() {
            let key = (namespace.clone(), volume.name.clone(), name.clone());
            let dir = log_dir.join("volumes-of-pods").join(&namespace).join(&name).join(&volume.name);
            if let Some(secret) = volume.secret.as_ref().and_then(|s| s.secret_name.clone()) {
                if self.secrets_at.get(&key) == Some(&d.metadata.generation) {
                    continue;
                }
                let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
                let data = secrets.get(&secret).await.with_context(|| format!("Secret {namespace}/{secret}"))?.data;
                std::fs::create_dir_all(&dir)?;
                for (file, bytes) in data.unwrap_or_default() {
                    let path = dir.join(&file);
                    if std::fs::read(&path).ok().as_deref() != Some(&bytes.0[..]) {
                        std::fs::write(&path, &bytes.0)?;
                    }
                }
                self.secrets_at.insert(key.clone(), d.metadata.generation);
                self.dirs.insert(key, dir);
                continue;
            }
            if self.dirs.contains_key(&key) {
                continue;
            }
            let projections = volume.projected.as_ref().and_then(|p| p.sources.clone()).unwrap_or_default();
            let mut wrote = false;
            for token in projections.iter().filter_map(|p| p.service_account_token.as_ref()) {
                let audience = token.audience.clone().unwrap_or_default();
                let value = crate::tenants::token(client, &namespace, &account, &audience).await?;
                std::fs::create_dir_all(&dir)?;
                std::fs::write(dir.join(&token.path), value)?;
                wrote = true;
            }
            if wrote {
                self.dirs.insert(key, dir);
            }
        }
        Ok(())
    }
}
