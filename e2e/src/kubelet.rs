//! Plays the kubelet for worker Deployments on the local provider, which has none: runs as many
//! `stoker-worker` processes as each workers Deployment of a namespace asks for, with the pod
//! template's environment, so scaling decisions become real processes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, ListParams};

use crate::process::ManagedProcess;

/// The label the operator puts on worker Deployments.
const WORKER_SELECTOR: &str = "app.kubernetes.io/component=worker";

type Pods = Arc<Mutex<BTreeMap<String, Vec<ManagedProcess>>>>;

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
            tokio::spawn(async move {
                let mut started = 0u64;
                loop {
                    match api.list(&ListParams::default().labels(WORKER_SELECTOR)).await {
                        Ok(list) => sync(&pods, &list.items, &binary, &dispatcher_url, &log_dir, &mut started),
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
        pods.get_mut(deployment).map_or(0, |v| v.iter_mut().filter_map(|p| p.is_running().then_some(())).count())
    }

    /// Kills one of a Deployment's workers abruptly, like a node failure; a replacement starts
    /// on the next sync, as a ReplicaSet would make one.
    pub fn kill_one(&self, deployment: &str) -> bool {
        let mut pods = self.pods.lock().unwrap();
        match pods.get_mut(deployment).and_then(|v| v.pop()) {
            Some(mut p) => {
                p.kill();
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
    started: &mut u64,
) {
    let mut pods = pods.lock().unwrap();
    let names: Vec<String> = deployments.iter().filter_map(|d| d.metadata.name.clone()).collect();
    pods.retain(|name, _| names.contains(name));
    for d in deployments {
        let Some(name) = d.metadata.name.clone() else { continue };
        let want = d.spec.replicas.unwrap_or(1).max(0) as usize;
        let running = pods.entry(name.clone()).or_default();
        running.retain_mut(ManagedProcess::is_running);
        while running.len() > want {
            let mut p = running.pop().expect("more than wanted");
            // Off the runtime: terminating waits for the worker to exit.
            std::thread::spawn(move || p.terminate());
        }
        while running.len() < want {
            *started += 1;
            match spawn(d, binary, dispatcher_url, log_dir, *started) {
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
    n: u64,
) -> anyhow::Result<ManagedProcess> {
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
    env.retain(|(k, _)| !matches!(k.as_str(), "STOKER_LISTEN" | "STOKER_DISPATCHER" | "STOKER_THREADS"));
    env.push(("STOKER_LISTEN".into(), "127.0.0.1:0".into()));
    env.push(("STOKER_DISPATCHER".into(), dispatcher_url.into()));
    // One transform thread per worker: this machine's cores are shared by all of them.
    env.push(("STOKER_THREADS".into(), "1".into()));
    let name = format!("{}-{n}", d.metadata.name.as_deref().unwrap_or("worker"));
    let log = log_dir.join(format!("{name}.log"));
    ManagedProcess::spawn(&name, binary, &Vec::<String>::new(), &env, &log)
}
