//! The operator as pods of the Helm release, for the providers with real pods (kind, kubelet):
//! installing the chart with the images built here, and starting, stopping, killing, probing
//! and reading the logs of the operator pods.

use std::time::Duration;

use anyhow::{Context as _, anyhow};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};

use crate::provider::{Cluster, OperatorInstance, OperatorOptions};
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};
use crate::{OPERATOR_NAMESPACE, RELEASE};

/// Where the images built by `e2e/cluster/images.sh` are: `<REPOSITORY>/stoker-operator:<tag>`,
/// `<REPOSITORY>/stoker-worker:<tag>` and `<REPOSITORY>/stoker-worker-python:<tag>`.
pub const REPOSITORY: &str = "stoker.local";
/// The tag the e2e tiers build and install.
pub const TAG: &str = "e2e";

/// Builds the operator and worker images (and the local base and pause images they need) with
/// `e2e/cluster/images.sh`, in the engine `docker_host` names (None: the default one).
pub async fn build_images(docker_host: Option<&str>) -> anyhow::Result<()> {
    let script = tools::workspace_root().join("e2e/cluster/images.sh");
    eprintln!("[e2e] building the images: {} {TAG}", script.display());
    let mut cmd = Cmd::new("bash").arg(&script).arg(TAG).timeout(Duration::from_secs(3600));
    if let Some(host) = docker_host {
        cmd = cmd.env("DOCKER_HOST", host);
    }
    cmd.run().await.context("building the images")?;
    Ok(())
}

/// Installs (or upgrades) the chart with the images [`build_images`] made and waits for it;
/// returns the operator pods as the release runs them. `pods_reachable`: this machine reaches
/// pod addresses (the pods run on it), so their endpoints are asked directly.
pub async fn install_chart(cluster: &dyn Cluster, extra: &[&str], pods_reachable: bool) -> anyhow::Result<InCluster> {
    let chart = tools::workspace_root().join("charts/stoker");
    eprintln!("[e2e] helm upgrade --install {RELEASE} {}", chart.display());
    let operator = format!("images.operator.repository={REPOSITORY}/stoker-operator");
    let worker = format!("images.worker.repository={REPOSITORY}/stoker-worker");
    let tags = format!("images.operator.tag={TAG},images.worker.tag={TAG}");
    cluster
        .helm_cmd()?
        .args(["upgrade", "--install", RELEASE])
        .arg(&chart)
        .args(["--namespace", OPERATOR_NAMESPACE, "--create-namespace"])
        .args(["--set", &operator, "--set", &worker, "--set", &tags])
        // Each pipeline gets its NetworkPolicy, as in local mode's operators (the tenancy
        // scenario checks it): the chart's path to `--network-policy` and its RBAC.
        .args(["--set", "networkPolicy.enabled=true"])
        .args(extra)
        // Helm waits until every replica is Ready, the standby too.
        .args(["--wait", "--timeout", "5m"])
        .run()
        .await?;
    let deployment = crate::k8s::release_deployment(cluster).await?;
    let operator = InCluster { client: cluster.client(), deployment, pods_reachable };
    operator.wait(None).await?;
    Ok(operator)
}

/// The operator Deployment of the Helm release and its pods.
pub struct InCluster {
    client: kube::Client,
    deployment: String,
    pods_reachable: bool,
}

impl InCluster {
    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), OPERATOR_NAMESPACE)
    }

    /// The label selector of the operator Deployment's pods.
    pub async fn selector(&self) -> anyhow::Result<String> {
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

    /// Waits until `replicas` (default: the Deployment's) pods run and are Ready, and exactly
    /// one carries the leader's label (which routes the dispatcher Service to it).
    pub async fn wait(&self, replicas: Option<usize>) -> anyhow::Result<()> {
        let want = match replicas {
            Some(n) => n,
            None => self.deployments().get(&self.deployment).await?.spec.replicas.unwrap_or(1) as usize,
        };
        wait_for(
            Duration::from_secs(300),
            format!("{want} operator pods Ready, one of them the leader"),
            || async move {
                let pods = self.operator_pods().await?;
                let live: Vec<&Pod> = pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect();
                let running = live.iter().filter(|p| pod_phase(p) == "Running").count();
                let ready = live.iter().filter(|p| pod_ready(p)).count();
                let leaders = live.iter().filter(|p| marked_leader(p)).count();
                let state = live
                    .iter()
                    .map(|p| {
                        let ready = if pod_ready(p) { " Ready" } else { "" };
                        let leader = if marked_leader(p) { " leader" } else { "" };
                        format!("{} {}{ready}{leader}", name_of(p), pod_phase(p))
                    })
                    .collect::<Vec<_>>();
                let up = live.len() == want && running == want && ready == want && leaders == 1;
                Ok(if want == 0 && pods.is_empty() || want > 0 && up {
                    Check::Done(())
                } else {
                    Check::not_yet(format!("pods: {state:?}"))
                })
            },
        )
        .await
    }

    /// `Cluster::operator_start`: the chart's options only, scaled to `opts.replicas`.
    pub async fn start(&self, opts: OperatorOptions) -> anyhow::Result<()> {
        if !opts.extra_args.is_empty() || !opts.env.is_empty() || !opts.leader_election {
            anyhow::bail!(
                "the operator runs from the chart here: extra args, env and leader_election=false are not supported"
            );
        }
        self.scale(opts.replicas).await?;
        self.wait(Some(opts.replicas)).await
    }

    pub async fn stop(&self) -> anyhow::Result<()> {
        self.scale(0).await?;
        self.wait(Some(0)).await
    }

    async fn scale(&self, replicas: usize) -> anyhow::Result<()> {
        let patch = serde_json::json!({"spec": {"replicas": replicas}});
        self.deployments().patch(&self.deployment, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        Ok(())
    }

    /// Deletes every operator pod and waits for the Deployment's replacements.
    pub async fn restart(&self) -> anyhow::Result<()> {
        let selector = self.selector().await?;
        self.pods().delete_collection(&DeleteParams::default(), &ListParams::default().labels(&selector)).await?;
        // Let the old pods go before counting the new ones.
        wait_for(Duration::from_secs(120), "the old operator pods to go", || async move {
            let pods = self.operator_pods().await?;
            let old = pods.iter().filter(|p| p.metadata.deletion_timestamp.is_some()).count();
            Ok(if old == 0 { Check::Done(()) } else { Check::not_yet(format!("{old} terminating")) })
        })
        .await?;
        self.wait(None).await
    }

    /// Deletes operator pod `name` (its process stops gracefully; the Deployment replaces it).
    pub async fn delete(&self, name: &str) -> anyhow::Result<()> {
        self.pods().delete(name, &DeleteParams::default()).await?;
        Ok(())
    }

    pub async fn instances(&self) -> anyhow::Result<Vec<OperatorInstance>> {
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

    /// `GET path` on a pod's metrics/health port: at the pod's address where this machine
    /// reaches it, else through the API server's pod proxy.
    pub async fn get(&self, name: &str, path: &str) -> anyhow::Result<crate::http::Response> {
        if self.pods_reachable {
            return crate::http::get(self.metrics_addr(name).await?, path).await;
        }
        let port = self.metrics_port(name).await?;
        let uri = format!("/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods/{name}:{port}/proxy{path}");
        let req = http::Request::get(uri).body(kube::client::Body::from(Vec::new()))?;
        let resp = self.client.send(req).await?;
        let status = resp.status().as_u16();
        use http_body_util::BodyExt as _;
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(crate::http::Response { status, body: String::from_utf8_lossy(&bytes).into_owned() })
    }

    /// A pod's metrics/health address, where this machine reaches pods (kubelet, not kind).
    pub async fn metrics_addr(&self, name: &str) -> anyhow::Result<std::net::SocketAddr> {
        anyhow::ensure!(self.pods_reachable, "this machine does not reach the operator pods' addresses");
        let port = self.metrics_port(name).await?;
        let pod = self.pods().get(name).await?;
        let ip = pod.status.and_then(|s| s.pod_ip).with_context(|| format!("pod {name} has no address"))?;
        let ip: std::net::IpAddr = ip.parse().with_context(|| format!("pod {name}'s address {ip}"))?;
        Ok(std::net::SocketAddr::new(ip, port))
    }

    async fn metrics_port(&self, name: &str) -> anyhow::Result<u16> {
        let pod = self.pods().get(name).await?;
        let port = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| matches!(p.name.as_deref(), Some("metrics" | "http")))
            .map(|p| p.container_port)
            .unwrap_or(8080);
        Ok(port as u16)
    }

    /// The last `lines` log lines of every operator pod, prefixed with its name (kubectl with
    /// `kubeconfig`).
    pub async fn logs(&self, kubeconfig: &std::path::Path, lines: usize) -> String {
        let logs = async {
            let selector = self.selector().await?;
            Cmd::new(tools::tool("kubectl")?)
                .env("KUBECONFIG", kubeconfig)
                .args(["logs", "-n", OPERATOR_NAMESPACE, "-l", &selector, "--prefix", "--tail", &lines.to_string()])
                .timeout(Duration::from_secs(60))
                .stdout()
                .await
        };
        logs.await.unwrap_or_else(|e| format!("(no operator logs: {e:#})"))
    }
}

fn name_of(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

fn pod_phase(p: &Pod) -> String {
    p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default()
}

/// The label the leading operator puts on its own pod (operator/src/leader_pod.rs).
fn marked_leader(p: &Pod) -> bool {
    p.metadata.labels.as_ref().and_then(|l| l.get("stoker.dev/leader")).is_some_and(|v| v == "true")
}

fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
