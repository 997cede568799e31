//! The `local` provider: a real Kubernetes control plane on loopback, without a kubelet.
//!
//! etcd, kube-apiserver and kube-controller-manager (v1.20, from `make tools`) run as child
//! processes on free loopback ports, with everything (etcd data, certificates, keys, kubeconfig,
//! logs) in one temporary directory. The API server authenticates a static admin token (group
//! `system:masters`) and authorizes with RBAC; the controller manager runs every controller, so
//! Deployments get ReplicaSets and Pods (which stay Pending: nothing schedules or runs them),
//! service accounts get tokens, and the garbage collector and namespace controller work.

mod operators;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, anyhow};
use async_trait::async_trait;

use crate::leader_proxy::LeaderProxy;
use crate::provider::{Cluster, OperatorInstance, OperatorOptions, Provider};

use crate::control_plane::ControlPlaneProcesses;
use operators::LocalOperators;

/// Where and how to run the local control plane.
#[derive(Debug, Clone, Default)]
pub struct LocalOptions {
    /// Use this directory (created, and not removed afterwards) instead of a temporary one.
    pub dir: Option<PathBuf>,
    /// Keep the temporary directory after teardown (`STOKER_E2E_KEEP=1`).
    pub keep: bool,
}

impl LocalOptions {
    pub fn from_env() -> Self {
        LocalOptions { dir: None, keep: std::env::var("STOKER_E2E_KEEP").is_ok_and(|v| v == "1" || v == "true") }
    }
}

/// etcd + kube-apiserver + kube-controller-manager on loopback, and the operator processes.
pub struct LocalControlPlane {
    /// Removed on shutdown (or drop); `None` when the directory is kept.
    tempdir: Mutex<Option<tempfile::TempDir>>,
    dir: PathBuf,
    kubeconfig: PathBuf,
    server: String,
    client: kube::Client,
    processes: ControlPlaneProcesses,
    operators: tokio::sync::Mutex<LocalOperators>,
    /// Stands in for the dispatcher Service: routes to whichever operator leads.
    dispatcher: LeaderProxy,
}

impl LocalControlPlane {
    /// Starts with [`LocalOptions::from_env`].
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(LocalOptions::from_env()).await
    }

    pub async fn start_with(opts: LocalOptions) -> anyhow::Result<Self> {
        let (tempdir, dir) = match &opts.dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                (None, dir.canonicalize()?)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("stoker-e2e-")
                    .tempdir()
                    .context("creating a temporary directory")?;
                let path = t.path().to_path_buf();
                if opts.keep { (None, t.keep()) } else { (Some(t), path) }
            }
        };
        let processes = ControlPlaneProcesses::default();
        let dispatcher_targets: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let dispatcher = LeaderProxy::start(dispatcher_targets.clone()).await?;
        match processes.boot(&dir, None).await {
            Ok((kubeconfig, server, client)) => Ok(LocalControlPlane {
                operators: tokio::sync::Mutex::new(LocalOperators::new(
                    client.clone(),
                    dir.clone(),
                    kubeconfig.clone(),
                    dispatcher_targets,
                    dispatcher.url(),
                )),
                dispatcher,
                tempdir: Mutex::new(tempdir),
                dir,
                kubeconfig,
                server,
                client,
                processes,
            }),
            Err(e) => {
                let logs = processes.log_tails(40);
                // Dropping the processes terminates them.
                drop(processes);
                let files = if tempdir.is_some() {
                    "in a temporary directory, now removed".to_string()
                } else {
                    format!("in {}", dir.display())
                };
                Err(anyhow!("the local control plane did not start: {e:#}\n(its files were {files}){logs}"))
            }
        }
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server(&self) -> &str {
        &self.server
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// An error naming the control-plane process that died, with its log tail.
    pub fn check_alive(&self) -> anyhow::Result<()> {
        self.processes.check_alive()
    }
}

#[async_trait]
impl Cluster for LocalControlPlane {
    fn provider(&self) -> Provider {
        Provider::Local
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
        false
    }

    fn dispatcher_url(&self) -> anyhow::Result<String> {
        Ok(self.dispatcher.url())
    }

    fn run_workers(&self, namespace: &str) -> anyhow::Result<Option<crate::kubelet::ProcessKubelet>> {
        let url = self.dispatcher.url();
        crate::kubelet::ProcessKubelet::start(self.client.clone(), namespace, url, self.dir.clone()).map(Some)
    }

    async fn operator_start(&self, opts: OperatorOptions) -> anyhow::Result<()> {
        self.operators.lock().await.start(opts).await
    }

    async fn operator_stop(&self) -> anyhow::Result<()> {
        self.operators.lock().await.stop().await;
        Ok(())
    }

    async fn operator_restart(&self) -> anyhow::Result<()> {
        self.operators.lock().await.restart().await
    }

    async fn operator_kill(&self, name: &str, graceful: bool) -> anyhow::Result<()> {
        self.operators.lock().await.kill(name, graceful).await
    }

    async fn operator_instances(&self) -> anyhow::Result<Vec<OperatorInstance>> {
        Ok(self.operators.lock().await.instances())
    }

    async fn operator_metrics_addr(&self, name: &str) -> anyhow::Result<std::net::SocketAddr> {
        self.operators.lock().await.metrics_addr(name)
    }

    async fn operator_get(&self, name: &str, path: &str) -> anyhow::Result<crate::http::Response> {
        let addr = self.operators.lock().await.metrics_addr(name)?;
        crate::http::get(addr, path).await
    }

    async fn operator_logs(&self, lines: usize) -> String {
        self.operators.lock().await.log_tails(lines)
    }

    async fn diagnostics(&self) -> String {
        format!("{}{}", self.processes.log_tails(15), self.operator_logs(40).await)
    }

    async fn shutdown(&self) {
        self.operators.lock().await.shutdown().await;
        self.processes.shutdown().await;
        drop(self.tempdir.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for LocalControlPlane {
    fn drop(&mut self) {
        self.operators.get_mut().terminate();
        self.processes.terminate();
    }
}
