//! The `kubelet` provider: the control plane of the `local` provider, serving the node's
//! address too, plus a real node: Debian's dockerd, the kubelet on it, kube-scheduler,
//! kube-proxy and a Service DNS. The operator and worker images are built here
//! (`e2e/cluster/images.sh`), the Helm chart is installed, and the operator and its workers run
//! as pods. The node's address is the Docker bridge's gateway: the API server, the DNS and the
//! kubelet are reached there from pods, and Services through kube-proxy's rules from pods and
//! from this machine alike.

pub mod daemons;
pub mod dns;
pub mod docker;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Node as K8sNode, PersistentVolume, PersistentVolumeClaim, Service};
use kube::api::Api;

use crate::control_plane::ControlPlaneProcesses;
use crate::in_cluster::{self, InCluster};
use crate::process::ManagedProcess;
use crate::provider::{Cluster, Provider, StartError, WorkerData};
use crate::wait::{Check, wait_for};
use crate::{OPERATOR_NAMESPACE, RELEASE};

use daemons::NODE;
use dns::ServiceDns;
use docker::Engine;

pub struct NodeCluster {
    tempdir: Mutex<Option<tempfile::TempDir>>,
    dir: PathBuf,
    kubeconfig: PathBuf,
    client: kube::Client,
    control_plane: ControlPlaneProcesses,
    /// kube-scheduler, kube-proxy, kubelet, in start order.
    daemons: Mutex<Vec<ManagedProcess>>,
    engine: tokio::sync::Mutex<Engine>,
    /// Dropped before the control plane stops (its watch would retry against nothing).
    dns: Mutex<Option<ServiceDns>>,
    operator: Option<InCluster>,
    /// The dispatcher Service's `http://<cluster IP>:<port>`.
    dispatcher: String,
}

impl NodeCluster {
    pub async fn start() -> Result<Self, StartError> {
        let dir = tempfile::Builder::new().prefix("stoker-e2e-node-").tempdir().context("a temporary directory")?;
        let path = dir.path().to_path_buf();
        // Pods (uid 65532) read the data scenarios write here through hostPath volumes.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .context("opening the run's directory")?;
        let engine = Engine::start(&path).await?;
        let ip = engine.bridge_gateway().await?;
        let pod_cidr = engine.bridge_subnet().await?;
        in_cluster::build_images(Some(&engine.host)).await?;
        daemons::clean_proxy_rules().await?;

        let control_plane = ControlPlaneProcesses::default();
        let (kubeconfig, _server, client) = match control_plane.boot(&path, Some(ip)).await {
            Ok(booted) => booted,
            Err(e) => {
                return Err(anyhow!("the control plane did not start: {e:#}{}", control_plane.log_tails(30)).into());
            }
        };
        let dns = ServiceDns::start(client.clone(), SocketAddr::from((ip, 53))).await?;
        let node =
            daemons::Node { dir: &path, kubeconfig: &kubeconfig, ip, docker_host: &engine.host, pod_cidr: &pod_cidr };
        let daemons = Mutex::new(vec![node.scheduler()?, node.proxy()?, node.kubelet()?]);
        let mut cluster = NodeCluster {
            tempdir: Mutex::new(Some(dir)),
            dir: path,
            kubeconfig,
            client,
            control_plane,
            daemons,
            engine: tokio::sync::Mutex::new(engine),
            dns: Mutex::new(Some(dns)),
            operator: None,
            dispatcher: String::new(),
        };
        let ready = async {
            cluster.node_ready().await?;
            daemons::offer_volumes(cluster.client.clone(), &cluster.dir).await?;
            let operator = in_cluster::install_chart(&cluster, &[], true).await?;
            let dispatcher = cluster.dispatcher_service().await?;
            anyhow::Ok((operator, dispatcher))
        };
        match ready.await {
            Ok((operator, dispatcher)) => {
                cluster.operator = Some(operator);
                cluster.dispatcher = dispatcher;
                Ok(cluster)
            }
            Err(e) => {
                Err(anyhow!("the kubelet cluster did not come up: {e:#}\n{}", cluster.diagnostics().await).into())
            }
        }
    }

    /// Waits for the node to register and report Ready.
    async fn node_ready(&self) -> anyhow::Result<()> {
        let nodes: Api<K8sNode> = Api::all(self.client.clone());
        let daemons = &self.daemons;
        wait_for(Duration::from_secs(120), format!("node {NODE} Ready"), || {
            let nodes = nodes.clone();
            async move {
                if let Some(dead) = daemons.lock().unwrap().iter_mut().find_map(|p| p.check_running().err()) {
                    return Err(dead);
                }
                let Some(node) = nodes.get_opt(NODE).await? else { return Ok(Check::not_yet("not registered")) };
                let ready =
                    node.status.and_then(|s| s.conditions).unwrap_or_default().into_iter().find(|c| c.type_ == "Ready");
                Ok(match ready {
                    Some(c) if c.status == "True" => Check::Done(()),
                    other => Check::not_yet(format!("{:?}", other.map(|c| (c.status, c.message)))),
                })
            }
        })
        .await
    }

    /// The chart's dispatcher Service, as `http://<cluster IP>:<port>`.
    async fn dispatcher_service(&self) -> anyhow::Result<String> {
        let services: Api<Service> = Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE);
        let selector = format!("app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=dispatcher");
        let list = services.list(&kube::api::ListParams::default().labels(&selector)).await?;
        let spec = list.items.first().and_then(|s| s.spec.clone()).context("no dispatcher Service in the release")?;
        let ip: Ipv4Addr = spec.cluster_ip.as_deref().unwrap_or_default().parse().context("its cluster IP")?;
        let port = spec.ports.unwrap_or_default().first().map(|p| p.port).context("its port")?;
        Ok(format!("http://{ip}:{port}"))
    }

    /// The last `lines` log lines of every worker pod (a few at most), for diagnostics.
    async fn worker_logs(&self, lines: usize) -> String {
        let pods = Api::<k8s_openapi::api::core::v1::Pod>::all(self.client.clone())
            .list(&kube::api::ListParams::default().labels("app.kubernetes.io/component=worker"))
            .await;
        let Ok(pods) = pods else { return "(cannot list worker pods)".into() };
        let mut out = String::new();
        for pod in pods.items.iter().take(8) {
            let (Some(ns), Some(name)) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref()) else {
                continue;
            };
            let tail = lines.to_string();
            let logs = self.kubectl(&["logs", "-n", ns, name, "--tail", &tail]).await;
            out += &format!("[{ns}/{name}]\n{}\n", logs.unwrap_or_else(|e| format!("{e:#}")));
        }
        out
    }

    fn log_tails(&self, lines: usize) -> String {
        let daemons = self.daemons.lock().unwrap_or_else(|e| e.into_inner());
        let tails: String = daemons
            .iter()
            .map(|p| format!("\n--- last {lines} lines of {} ---\n{}", p.name(), p.log_tail(lines)))
            .collect();
        format!("{}{tails}", self.control_plane.log_tails(lines))
    }

    /// The kubelet's last `lines` lines on pods deleted and containers killed: how long each
    /// pod took to go, when a namespace's deletion waits on its pods (once 125 s in CI, with
    /// a grace period of 10 s, and the tails above did not say why).
    fn pod_deletions(&self, lines: usize) -> String {
        pod_deletions(&std::fs::read_to_string(self.dir.join("kubelet.log")).unwrap_or_default(), lines)
    }

    /// Stops the daemons (kubelet first), unmounts what the kubelet mounted under the run's
    /// directory, and removes kube-proxy's rules.
    fn stop_daemons(&self) {
        let mut daemons = self.daemons.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut p) = daemons.pop() {
            p.terminate();
        }
        unmount_under(&self.dir);
        let _ = std::process::Command::new(crate::tools::bin_dir().join("kube-proxy")).arg("--cleanup").status();
    }
}

/// The last `lines` lines of a kubelet's `log` on pods deleted and containers killed.
fn pod_deletions(log: &str, lines: usize) -> String {
    const SAID: [&str; 4] = ["SyncLoop (DELETE", "SyncLoop (REMOVE", "Killing container", "killContainer"];
    let said: Vec<&str> = log.lines().filter(|l| SAID.iter().any(|s| l.contains(s))).collect();
    said[said.len().saturating_sub(lines)..].join("\n")
}

/// Detaches every mount below `dir` (the kubelet's volumes), deepest first.
fn unmount_under(dir: &Path) {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else { return };
    let mut points: Vec<&str> =
        mounts.lines().filter_map(|l| l.split_whitespace().nth(1)).filter(|p| Path::new(p).starts_with(dir)).collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        if let Ok(c) = std::ffi::CString::new(point) {
            // SAFETY: a valid C string; MNT_DETACH cannot fail in a way that matters here.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

#[async_trait]
impl Cluster for NodeCluster {
    fn provider(&self) -> Provider {
        Provider::Kubelet
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
        Ok(self.dispatcher.clone())
    }

    fn worker_data(&self, dir: &Path) -> WorkerData {
        // Not at the same path: the operator keeps /tmp for the workers' own volume.
        let path = "/data/e2e";
        let fields = format!(
            "volumes: [{{name: e2e-data, hostPath: {{path: '{}', type: Directory}}}}], \
             volumeMounts: [{{name: e2e-data, mountPath: '{path}', readOnly: true}}]",
            dir.display()
        );
        WorkerData { path: path.to_string(), fields }
    }

    async fn claim_dir(&self, namespace: &str, claim: &str) -> anyhow::Result<PathBuf> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), namespace);
        let bound = claims.get(claim).await?.spec.and_then(|s| s.volume_name);
        let volume = bound.with_context(|| format!("claim {namespace}/{claim} is not bound"))?;
        let pv = Api::<PersistentVolume>::all(self.client.clone()).get(&volume).await?;
        let path = pv.spec.and_then(|s| s.host_path).map(|h| h.path);
        path.map(PathBuf::from).with_context(|| format!("volume {volume} is not a hostPath volume"))
    }

    fn run_workers(&self, _namespace: &str) -> anyhow::Result<Option<crate::kubelet::ProcessKubelet>> {
        Ok(None)
    }

    async fn crash_pod(&self, namespace: &str, pod: &str) -> anyhow::Result<()> {
        let killed = self.engine.lock().await.kill_pod(namespace, pod).await?;
        eprintln!("  SIGKILL to {killed} container(s) of pod {namespace}/{pod}");
        Ok(())
    }

    fn chart_operator(&self) -> anyhow::Result<&InCluster> {
        self.operator.as_ref().ok_or_else(|| anyhow!("the chart is not installed yet"))
    }

    async fn diagnostics(&self) -> String {
        let pods = self.kubectl(&["get", "pods", "-A", "-o", "wide"]).await.unwrap_or_else(|e| format!("{e:#}"));
        let engine = self.engine.lock().await.log_tail(15);
        format!(
            "--- pods ---\n{pods}\n--- operator logs ---\n{}\n--- worker logs ---\n{}{}\n--- dockerd ---\n{engine}\n\
             --- the kubelet's pod deletions ---\n{}",
            self.operator_logs(40).await,
            self.worker_logs(20).await,
            self.log_tails(15),
            self.pod_deletions(40)
        )
    }

    async fn shutdown(&self) {
        drop(self.dns.lock().unwrap_or_else(|e| e.into_inner()).take());
        self.stop_daemons();
        self.control_plane.shutdown().await;
        self.engine.lock().await.shutdown().await;
        drop(self.tempdir.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for NodeCluster {
    fn drop(&mut self) {
        self.stop_daemons();
        self.control_plane.terminate();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pod_deletions_are_the_kubelets_last_lines_on_deleting_and_killing() {
        let log = "I1 kubelet.go:1904] SyncLoop (DELETE, \"api\"): \"a_ns\"\n\
                   I2 prober.go:117] Readiness probe failed\n\
                   I3 kuberuntime_container.go:635] \"Killing container with a grace period\" pod=\"ns/a\"\n\
                   E4 kuberuntime_container.go:662] killContainer \"w\" failed\n\
                   I5 kubelet.go:1898] SyncLoop (REMOVE, \"api\"): \"a_ns\"\n";
        let all = super::pod_deletions(log, 40);
        assert_eq!(all.lines().map(|l| &l[..2]).collect::<Vec<_>>(), ["I1", "I3", "E4", "I5"]);
        assert_eq!(super::pod_deletions(log, 2).lines().map(|l| &l[..2]).collect::<Vec<_>>(), ["E4", "I5"]);
    }
}
