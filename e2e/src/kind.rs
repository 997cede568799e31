//! The `kind` provider: a kind cluster with real pods, the images built locally
//! (`in_cluster::build_images`) and loaded into the nodes, and the Helm chart installed; the
//! operator runs in-cluster (two replicas, one leads).
//!
//! Environment:
//! - `STOKER_KIND_CLUSTER=<name>`: use this existing cluster (it is not deleted afterwards).
//! - `STOKER_KIND_KEEP=1`: do not delete the cluster the harness created.
//! - `STOKER_KIND_SKIP_BUILD=1`: do not build the images (they must exist in Docker).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use crate::in_cluster::{self, InCluster, REPOSITORY, TAG};
use crate::provider::{Cluster, Provider, StartError, client_from_kubeconfig};
use crate::tools::{self, Cmd};

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
    /// The operator pods of the Helm release, once installed.
    operator: Option<InCluster>,
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v == "true")
}

/// Why the kind provider cannot run here, if it cannot. `kind` first: no registry these
/// machines reach ships it (nor its node images), and a missing Docker engine would hide that
/// reason behind one `make tools` could fix.
pub async fn unavailable_reason() -> Option<String> {
    if tools::find_tool("kind").is_none() {
        return Some(format!("kind provider SKIPPED: no `kind` binary on PATH or in {}", tools::bin_dir().display()));
    }
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
            operator: None,
        };

        if !env_flag("STOKER_KIND_SKIP_BUILD") {
            in_cluster::build_images(None).await?;
        }
        for target in ["operator", "worker", "worker-python"] {
            let image = format!("{REPOSITORY}/stoker-{target}:{TAG}");
            eprintln!("[e2e kind] kind load docker-image {image}");
            Cmd::new(&cluster.kind)
                .args(["load", "docker-image", &image, "--name", &cluster.name])
                .timeout(Duration::from_secs(600))
                .run()
                .await?;
        }
        cluster.operator = Some(in_cluster::install_chart(&cluster, &[], false).await?);
        Ok(cluster)
    }
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

    fn chart_operator(&self) -> anyhow::Result<&InCluster> {
        self.operator.as_ref().ok_or_else(|| anyhow::anyhow!("the chart is not installed yet"))
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
