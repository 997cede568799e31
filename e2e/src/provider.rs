//! The provider abstraction the scenarios are written against: the [`Cluster`] trait every
//! provider implements, and what the providers share.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::tools::{self, Cmd};

/// Which provider runs the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// etcd + kube-apiserver + kube-controller-manager on loopback; no kubelet; the operator
    /// runs as local processes.
    Local,
    /// A kind cluster (Docker); real pods; the operator runs in-cluster from the Helm chart.
    Kind,
    /// The local control plane plus a real node (kubelet, kube-scheduler, kube-proxy on
    /// Debian's dockerd); real pods; the operator runs in-cluster from the Helm chart.
    Kubelet,
}

impl Provider {
    /// From `STOKER_E2E_PROVIDER` (`local`, the default, `kubelet` or `kind`).
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var("STOKER_E2E_PROVIDER").unwrap_or_default().trim() {
            "" | "local" => Ok(Provider::Local),
            "kind" => Ok(Provider::Kind),
            "kubelet" => Ok(Provider::Kubelet),
            other => anyhow::bail!("STOKER_E2E_PROVIDER={other:?}: expected `local`, `kubelet` or `kind`"),
        }
    }

    /// Whether the operator and its workers run as real pods.
    pub fn real_pods(self) -> bool {
        self != Provider::Local
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Provider::Local => "local",
            Provider::Kind => "kind",
            Provider::Kubelet => "kubelet",
        })
    }
}

/// Why a provider did not start.
#[derive(Debug)]
pub enum StartError {
    /// The provider cannot run on this machine (no Docker engine, no kind): the suite is
    /// skipped, loudly, with this reason.
    Unavailable(String),
    /// The provider should have started and did not: the suite fails.
    Failed(anyhow::Error),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Unavailable(reason) => write!(f, "unavailable: {reason}"),
            StartError::Failed(e) => write!(f, "{e:#}"),
        }
    }
}

impl From<anyhow::Error> for StartError {
    fn from(e: anyhow::Error) -> Self {
        StartError::Failed(e)
    }
}

/// How the operator should run.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// How many operator processes (local) or pods (kind).
    pub replicas: usize,
    /// `--leader-election` (local only; the chart always elects).
    pub leader_election: bool,
    /// More `stoker-operator run` arguments (local only).
    pub extra_args: Vec<String>,
    /// More environment variables (local only).
    pub env: Vec<(String, String)>,
}

impl Default for OperatorOptions {
    fn default() -> Self {
        OperatorOptions { replicas: 1, leader_election: true, extra_args: Vec::new(), env: Vec::new() }
    }
}

impl OperatorOptions {
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }
}

/// Where workers see a directory of this machine, and what puts it there.
#[derive(Debug, Clone)]
pub struct WorkerData {
    /// The directory as the workers see it (for the `file://` source).
    pub path: String,
    /// Fields of the DataPipeline's `workers` (YAML flow-mapping entries), or empty.
    pub fields: String,
}

impl WorkerData {
    /// `fields` after a comma, to append to other `workers` entries.
    pub fn more_fields(&self) -> String {
        if self.fields.is_empty() { String::new() } else { format!(", {}", self.fields) }
    }
}

/// One operator process (local) or pod (kind).
#[derive(Debug, Clone)]
pub struct OperatorInstance {
    /// `POD_NAME` of the process, or the pod's name (its Lease identity is `<name>_<start>`).
    pub name: String,
    /// Whether it runs now (local: the process is alive; kind: the pod is Running).
    pub running: bool,
    /// Local only: where /healthz, /readyz and /metrics are served.
    pub metrics_addr: Option<SocketAddr>,
    /// Local only: the dispatcher's gRPC address.
    pub dispatcher_addr: Option<SocketAddr>,
}

/// A running cluster and the operator on it. Dropping it tears everything down.
#[async_trait]
pub trait Cluster: Send + Sync {
    fn provider(&self) -> Provider;

    /// The admin kubeconfig (for kubectl, helm and the scenarios' own tools).
    fn kubeconfig(&self) -> &Path;

    /// A client with admin rights, bound to the runtime the cluster was started on.
    fn client(&self) -> kube::Client;

    /// A directory for the run's files (logs, rendered manifests); removed on teardown.
    fn workdir(&self) -> &Path;

    /// Whether the provider installed the Helm chart itself (kind does: the operator runs from
    /// it). Locally the chart is installed by the `chart_installs` scenario.
    fn chart_preinstalled(&self) -> bool;

    /// Where training clients outside the cluster reach the dispatcher (the leader).
    fn dispatcher_url(&self) -> anyhow::Result<String>;

    /// How a DataPipeline's workers read `dir` of this machine (a `file://` source a scenario
    /// wrote): where local processes find it as it is; pods on this machine through a hostPath
    /// volume.
    fn worker_data(&self, dir: &Path) -> WorkerData {
        WorkerData { path: dir.display().to_string(), fields: String::new() }
    }

    /// Where the files of PersistentVolumeClaim `claim` of `namespace` are on this machine: the
    /// local provider's stand-in kubelet keeps them under the workdir.
    async fn claim_dir(&self, namespace: &str, claim: &str) -> anyhow::Result<std::path::PathBuf> {
        Ok(self.workdir().join("volumes").join(namespace).join(claim))
    }

    /// Makes worker Deployments of `namespace` run where nothing else would: the local
    /// provider has no kubelet, so the returned runner starts `stoker-worker` processes for
    /// them until dropped. None where real pods run (kind).
    fn run_workers(&self, namespace: &str) -> anyhow::Result<Option<crate::kubelet::ProcessKubelet>>;

    /// Where the operator runs from the Helm chart (kind, kubelet): its pods. The operator
    /// methods below default to them; the local provider runs processes and overrides them.
    fn chart_operator(&self) -> anyhow::Result<&crate::in_cluster::InCluster> {
        anyhow::bail!("the {} provider runs no operator pods", self.provider())
    }

    /// Starts the operator so that `opts.replicas` instances run, and waits until each is up
    /// and (with leader election) one of them leads. Local: installs the CRD first if it is
    /// missing, and the `stoker-system` namespace.
    async fn operator_start(&self, opts: OperatorOptions) -> anyhow::Result<()> {
        self.chart_operator()?.start(opts).await
    }

    /// Stops every operator instance (local: SIGTERM then SIGKILL; pods: scale to 0).
    async fn operator_stop(&self) -> anyhow::Result<()> {
        self.chart_operator()?.stop().await
    }

    /// Restarts every operator instance with the options it was started with (pods: deletes
    /// them) and waits as `operator_start` does.
    async fn operator_restart(&self) -> anyhow::Result<()> {
        self.chart_operator()?.restart().await
    }

    /// Stops one instance: gracefully (SIGTERM / pod delete) or at once (SIGKILL / forced
    /// delete). It is not restarted (pods: the Deployment starts a replacement).
    async fn operator_kill(&self, name: &str, graceful: bool) -> anyhow::Result<()> {
        if graceful {
            self.chart_operator()?.delete(name).await
        } else {
            self.crash_pod(crate::OPERATOR_NAMESPACE, name).await
        }
    }

    /// Kills pod `pod`'s processes as a crash would. Where the harness owns the container
    /// engine (kubelet): SIGKILL to its containers, which the kubelet restarts in the same pod.
    /// Elsewhere (kind): the pod deleted with no grace period, the closest the API offers (its
    /// processes still get SIGTERM 2 s before SIGKILL).
    async fn crash_pod(&self, namespace: &str, pod: &str) -> anyhow::Result<()> {
        let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(self.client(), namespace);
        pods.delete(pod, &kube::api::DeleteParams::default().grace_period(0)).await?;
        Ok(())
    }

    /// The operator instances now.
    async fn operator_instances(&self) -> anyhow::Result<Vec<OperatorInstance>> {
        self.chart_operator()?.instances().await
    }

    /// `GET <path>` on one instance's metrics/health endpoint (/healthz, /readyz, /metrics).
    async fn operator_get(&self, name: &str, path: &str) -> anyhow::Result<crate::http::Response> {
        self.chart_operator()?.get(name, path).await
    }

    /// The address of one instance's metrics endpoint, for a Prometheus on this machine.
    async fn operator_metrics_addr(&self, name: &str) -> anyhow::Result<std::net::SocketAddr> {
        self.chart_operator()?.metrics_addr(name).await
    }

    /// The last `lines` log lines of every operator instance, labelled.
    async fn operator_logs(&self, lines: usize) -> String {
        match self.chart_operator() {
            Ok(operator) => operator.logs(self.kubeconfig(), lines).await,
            Err(e) => format!("(no operator logs: {e:#})"),
        }
    }

    /// Log tails of everything the provider runs, for failure reports.
    async fn diagnostics(&self) -> String;

    /// Tears everything down; also done on drop, but this does not block the runtime.
    async fn shutdown(&self);

    /// The instance that leads now (its /readyz answers "leading"), if any.
    async fn operator_leader(&self) -> anyhow::Result<Option<String>> {
        for instance in self.operator_instances().await? {
            if instance.running && self.operator_get(&instance.name, "/readyz").await.is_ok_and(|r| r.says_leading()) {
                return Ok(Some(instance.name));
            }
        }
        Ok(None)
    }

    /// A `kubectl` command with this cluster's kubeconfig; add arguments and `.stdout().await`.
    fn kubectl_cmd(&self) -> anyhow::Result<Cmd> {
        Ok(Cmd::new(tools::tool("kubectl")?)
            .env("KUBECONFIG", self.kubeconfig())
            .current_dir(tools::workspace_root())
            .timeout(Duration::from_secs(120)))
    }

    /// Runs `kubectl args...`; stdout, or an error with stderr.
    async fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_cmd()?.args(args).stdout().await
    }

    /// Runs `kubectl args...` with `input` on stdin (e.g. `apply -f -`).
    async fn kubectl_stdin(&self, args: &[&str], input: &str) -> anyhow::Result<String> {
        self.kubectl_cmd()?.args(args).stdin(input).stdout().await
    }

    /// A `helm` command with this cluster's kubeconfig (and helm's caches in the workdir).
    fn helm_cmd(&self) -> anyhow::Result<Cmd> {
        let home = self.workdir().join("helm");
        Ok(Cmd::new(tools::tool("helm")?)
            .env("KUBECONFIG", self.kubeconfig())
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .current_dir(tools::workspace_root())
            .timeout(Duration::from_secs(600)))
    }

    /// Runs `helm args...`; stdout, or an error with stderr.
    async fn helm(&self, args: &[&str]) -> anyhow::Result<String> {
        self.helm_cmd()?.args(args).stdout().await
    }
}

/// A client for a kubeconfig file (its current context).
pub async fn client_from_kubeconfig(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading {}", path.display()))?;
    kube::Client::try_from(config).context("building a Kubernetes client")
}
