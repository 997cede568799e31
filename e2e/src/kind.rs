//! The `kind` provider: a kind cluster with real pods, the images built locally and loaded into
//! the nodes, and the Helm chart installed; the operator runs in-cluster (two replicas, one
//! leads).
//!
//! Environment:
//! - `STOKER_KIND_CLUSTER=<name>`: use this existing cluster (it is not deleted afterwards).
//! - `STOKER_KIND_KEEP=1`: do not delete the cluster the harness created.
//! - `STOKER_KIND_SKIP_BUILD=1`: do not build the images (they must exist in Docker).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use async_trait::async_trait;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

use crate::provider::{Cluster, OperatorInstance, OperatorOptions, Provider, StartError, client_from_kubeconfig};
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};
use crate::{OPERATOR_NAMESPACE, RELEASE};

pub const OPERATOR_IMAGE: &str = "ghcr.io/stoker-dev/stoker-operator:e2e";
pub const WORKER_IMAGE: &str = "ghcr.io/stoker-dev/stoker-worker:e2e";
const DEFAULT_CLUSTER: &str = "stoker-e2e";

pub struct KindCluster {
    dir: PathBuf,
    /// Removed on shutdown (or drop).
    tempdir: std::sync::Mutex<Option<tempfile::TempDir>>,
    name: String,
    kind: PathBuf,
    /// Delete the cluster on teardown (the harness created it and nobody asked to keep it).
    delete: bool,
    deleted: AtomicBool,
    kubeconfig: PathBuf,
    client: kube::Client,
    /// The operator Deployment of the Helm release.
    deployment: String,
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v == "true")
}

/// Why the kind provider cannot run here, if it cannot.
pub async fn unavailable_reason() -> Option<String> {
    let Some(docker) = tools::find_tool("docker") else {
        return Some("kind provider SKIPPED: no `docker` CLI on PATH".into());
    };
    if let Err(e) =
        Cmd::new(&docker).args(["info", "--format", "{{.ServerVersion}}"]).timeout(Duration::from_secs(30)).run().await
    {
        let reason = format!("{e:#}");
        let reason = reason.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string();
        return Some(format!("kind provider SKIPPED: no Docker engine (docker info failed: {reason})"));
    }
    if tools::find_tool("kind").is_none() {
        return Some(format!("kind provider SKIPPED: no `kind` binary on PATH or in {}", tools::bin_dir().display()));
    }
    None
}

impl KindCluster {
    pub async fn start() -> Result<Self, StartError> {
        if let Some(reason) = unavailable_reason().await {
            return Err(StartError::Unavailable(reason));
        }
        Ok(Self::start_available().await?)
    }

    async fn start_available() -> anyhow::Result<Self> {
        let kind = tools::tool("kind")?;
        let docker = tools::tool("docker")?;
        let dir = tempfile::Builder::new().prefix("stoker-e2e-kind-").tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        let requested = std::env::var("STOKER_KIND_CLUSTER").ok().filter(|s| !s.is_empty());
        let name = requested.clone().unwrap_or_else(|| DEFAULT_CLUSTER.to_string());
        let existing = Cmd::new(&kind).args(["get", "clusters"]).stdout().await?;
        let exists = existing.lines().any(|l| l.trim() == name);
        let mut delete = false;
        if exists {
            eprintln!("[e2e kind] reusing the existing kind cluster {name}");
        } else {
            if requested.is_some() {
                eprintln!("[e2e kind] STOKER_KIND_CLUSTER={name} does not exist: creating it");
            }
            eprintln!("[e2e kind] creating kind cluster {name}");
            Cmd::new(&kind)
                .args(["create", "cluster", "--name", &name, "--wait", "180s"])
                .timeout(Duration::from_secs(600))
                .run()
                .await?;
            delete = !env_flag("STOKER_KIND_KEEP") && requested.is_none();
        }
        let setup = async {
            let kubeconfig_text = Cmd::new(&kind).args(["get", "kubeconfig", "--name", &name]).stdout().await?;
            std::fs::write(&kubeconfig, kubeconfig_text)?;
            client_from_kubeconfig(&kubeconfig).await
        };
        let client = match setup.await {
            Ok(client) => client,
            Err(e) => {
                if delete {
                    let _ = Cmd::new(&kind).args(["delete", "cluster", "--name", &name]).run().await;
                }
                return Err(e);
            }
        };
        // From here on, dropping `cluster` deletes what the harness created.
        let mut cluster = KindCluster {
            dir: dir.path().to_path_buf(),
            tempdir: std::sync::Mutex::new(Some(dir)),
            name,
            kind,
            delete,
            deleted: AtomicBool::new(false),
            kubeconfig,
            client,
            deployment: String::new(),
        };

        let root = tools::workspace_root();
        if !env_flag("STOKER_KIND_SKIP_BUILD") {
            for (dockerfile, image) in [("operator/Dockerfile", OPERATOR_IMAGE), ("worker/Dockerfile", WORKER_IMAGE)] {
                eprintln!("[e2e kind] docker build -f {dockerfile} -t {image} .");
                Cmd::new(&docker)
                    .args(["build", "-f", dockerfile, "-t", image, "."])
                    .current_dir(&root)
                    .timeout(Duration::from_secs(3600))
                    .run()
                    .await?;
            }
        }
        for image in [OPERATOR_IMAGE, WORKER_IMAGE] {
            eprintln!("[e2e kind] kind load docker-image {image}");
            Cmd::new(&cluster.kind)
                .args(["load", "docker-image", image, "--name", &cluster.name])
                .timeout(Duration::from_secs(600))
                .run()
                .await?;
        }
        let chart = root.join("charts/stoker");
        eprintln!("[e2e kind] helm upgrade --install {RELEASE} {}", chart.display());
        cluster
            .helm_cmd()?
            .args(["upgrade", "--install", RELEASE])
            .arg(&chart)
            .args(["--namespace", OPERATOR_NAMESPACE, "--create-namespace"])
            .args(["--set", "images.operator.tag=e2e", "--set", "images.worker.tag=e2e"])
            .args(["--wait", "--timeout", "5m"])
            .run()
            .await?;
        cluster.deployment = crate::k8s::release_deployment(&cluster).await?;
        cluster.wait_for_operator(None).await?;
        Ok(cluster)
    }

    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE)
    }

    /// The label selector of the operator Deployment's pods.
    async fn selector(&self) -> anyhow::Result<String> {
        let deploy = self.deployments().get(&self.deployment).await.context("reading the operator Deployment")?;
        let labels = deploy.spec.selector.match_labels.unwrap_or_default();
        if labels.is_empty() {
            return Err(anyhow!("Deployment {OPERATOR_NAMESPACE}/{} has no matchLabels selector", self.deployment));
        }
        Ok(labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))
    }

    async fn operator_pods(&self) -> anyhow::Result<Vec<Pod>> {
        let selector = self.selector().await?;
        Ok(self.pods().list(&ListParams::default().labels(&selector)).await?.items)
    }

    /// Waits until `replicas` (default: the Deployment's) pods run and exactly one is Ready
    /// (non-leaders report not-ready).
    async fn wait_for_operator(&self, replicas: Option<usize>) -> anyhow::Result<()> {
        let want = match replicas {
            Some(n) => n,
            None => self.deployments().get(&self.deployment).await?.spec.replicas.unwrap_or(1) as usize,
        };
        wait_for(Duration::from_secs(300), format!("{want} operator pods running, one of them Ready"), || async move {
            let pods = self.operator_pods().await?;
            let live: Vec<&Pod> = pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect();
            let running = live.iter().filter(|p| pod_phase(p) == "Running").count();
            let ready = live.iter().filter(|p| pod_ready(p)).count();
            let state = live
                .iter()
                .map(|p| format!("{} {}{}", name_of(p), pod_phase(p), if pod_ready(p) { " Ready" } else { "" }))
                .collect::<Vec<_>>();
            Ok(if want == 0 && pods.is_empty() || want > 0 && live.len() == want && running == want && ready == 1 {
                Check::Done(())
            } else {
                Check::not_yet(format!("pods: {state:?}"))
            })
        })
        .await
    }
}

fn name_of(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn pod_phase(p: &Pod) -> String {
    p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[async_trait]
impl Cluster for KindCluster {
    fn provider(&self) -> Provider {
        Provider::Kind
    }

    fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    fn client(&self) -> kube::Client {
        self.client.clone()
    }

    fn workdir(&self) -> &Path {
        &self.dir
    }

    fn chart_preinstalled(&self) -> bool {
        true
    }

    fn dispatcher_url(&self) -> anyhow::Result<String> {
        anyhow::bail!(
            "reaching the dispatcher from outside kind needs a port-forward, which the kind provider does not set up yet"
        )
    }

    fn run_workers(&self, _namespace: &str) -> anyhow::Result<Option<crate::kubelet::ProcessKubelet>> {
        Ok(None)
    }

    async fn operator_start(&self, opts: OperatorOptions) -> anyhow::Result<()> {
        if !opts.extra_args.is_empty() || !opts.env.is_empty() || !opts.leader_election {
            anyhow::bail!(
                "the kind provider runs the operator from the chart: extra args, env and leader_election=false are not supported"
            );
        }
        let patch = serde_json::json!({"spec": {"replicas": opts.replicas}});
        self.deployments().patch(&self.deployment, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        self.wait_for_operator(Some(opts.replicas)).await
    }

    async fn operator_stop(&self) -> anyhow::Result<()> {
        let patch = serde_json::json!({"spec": {"replicas": 0}});
        self.deployments().patch(&self.deployment, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        self.wait_for_operator(Some(0)).await
    }

    async fn operator_restart(&self) -> anyhow::Result<()> {
        let selector = self.selector().await?;
        self.pods().delete_collection(&DeleteParams::default(), &ListParams::default().labels(&selector)).await?;
        // Let the old pods go before counting the new ones.
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.wait_for_operator(None).await
    }

    async fn operator_kill(&self, name: &str, graceful: bool) -> anyhow::Result<()> {
        let params = if graceful { DeleteParams::default() } else { DeleteParams::default().grace_period(0) };
        self.pods().delete(name, &params).await?;
        Ok(())
    }

    async fn operator_instances(&self) -> anyhow::Result<Vec<OperatorInstance>> {
        Ok(self
            .operator_pods()
            .await?
            .iter()
            .map(|p| OperatorInstance {
                name: name_of(p),
                running: pod_phase(p) == "Running" && p.metadata.deletion_timestamp.is_none(),
                metrics_addr: None,
                dispatcher_addr: None,
            })
            .collect())
    }

    async fn operator_get(&self, name: &str, path: &str) -> anyhow::Result<crate::http::Response> {
        // Through the API server's pod proxy, to the container port named "metrics" or "http".
        let pod = self.pods().get(name).await?;
        let port = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| matches!(p.name.as_deref(), Some("metrics" | "http")))
            .map(|p| p.container_port)
            .unwrap_or(8080);
        let uri = format!("/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods/{name}:{port}/proxy{path}");
        let req = http::Request::get(uri).body(kube::client::Body::from(Vec::new()))?;
        let resp = self.client.send(req).await?;
        let status = resp.status().as_u16();
        use http_body_util::BodyExt as _;
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(crate::http::Response { status, body: String::from_utf8_lossy(&bytes).into_owned() })
    }

    async fn operator_logs(&self, lines: usize) -> String {
        let selector = match self.selector().await {
            Ok(s) => s,
            Err(e) => return format!("(no operator logs: {e:#})"),
        };
        match self.kubectl_cmd().map(|c| {
            c.args(["logs", "-n", OPERATOR_NAMESPACE, "-l", &selector, "--prefix", "--tail", &lines.to_string()])
        }) {
            Ok(cmd) => cmd.stdout().await.unwrap_or_else(|e| format!("(kubectl logs failed: {e:#})")),
            Err(e) => format!("(no operator logs: {e:#})"),
        }
    }

    async fn diagnostics(&self) -> String {
        let pods = self.kubectl(&["get", "pods", "-A", "-o", "wide"]).await.unwrap_or_else(|e| format!("{e:#}"));
        format!("--- pods ---\n{pods}\n--- operator logs ---\n{}", self.operator_logs(40).await)
    }

    async fn shutdown(&self) {
        if self.delete && !self.deleted.swap(true, Ordering::SeqCst) {
            eprintln!("[e2e kind] deleting kind cluster {}", self.name);
            let delete = Cmd::new(&self.kind).args(["delete", "cluster", "--name", &self.name]).run().await;
            if let Err(e) = delete {
                eprintln!("[e2e kind] {e:#}");
            }
        }
        drop(self.tempdir.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for KindCluster {
    fn drop(&mut self) {
        if self.delete && !self.deleted.swap(true, Ordering::SeqCst) {
            eprintln!("[e2e kind] deleting kind cluster {}", self.name);
            let _ = std::process::Command::new(&self.kind).args(["delete", "cluster", "--name", &self.name]).status();
        } else if !self.delete {
            eprintln!("[e2e kind] keeping kind cluster {}", self.name);
        }
    }
}
