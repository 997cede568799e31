//! The Docker engine the node's kubelet runs pods on: Debian's dockerd (from `make tools`) on a
//! socket and data root of its own, so a run never touches another engine, and its images (the
//! base, pause and the ones built from the repository) stay cached between runs.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;

use crate::process::ManagedProcess;
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};

pub struct Engine {
    /// `unix://...`, for DOCKER_HOST and the kubelet's `--docker-endpoint`.
    pub host: String,
    /// None when an engine on the socket was running already (kept running afterwards).
    process: Option<ManagedProcess>,
}

fn cache() -> PathBuf {
    tools::bin_dir().parent().map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir)
}

impl Engine {
    /// The engine on `~/.cache/stoker/docker.sock`, started if none answers there; logs to
    /// `log_dir`.
    pub async fn start(log_dir: &Path) -> anyhow::Result<Self> {
        let cache = cache();
        let socket = cache.join("docker.sock");
        let host = format!("unix://{}", socket.display());
        let mut engine = Engine { host, process: None };
        if engine.docker(&["info", "--format", "{{.ServerVersion}}"]).await.is_ok() {
            eprintln!("[e2e kubelet] using the docker engine already on {}", engine.host);
        } else {
            let dockerd = tools::tool("dockerd")?;
            let args = vec![
                format!("--host={}", engine.host),
                format!("--data-root={}", cache.join("docker").display()),
                // Short: it holds unix sockets, whose paths are limited to 108 bytes.
                "--exec-root=/tmp/stoker-docker".to_string(),
                format!("--pidfile={}", cache.join("docker.pid").display()),
            ];
            let process = ManagedProcess::spawn("dockerd", &dockerd, &args, &[], &log_dir.join("dockerd.log"))?
                .with_grace(Duration::from_secs(20));
            engine.process = Some(process);
            let this = &engine;
            wait_for(Duration::from_secs(60), format!("dockerd to answer on {}", this.host), || async move {
                Ok(match this.docker(&["info", "--format", "{{.ServerVersion}}"]).await {
                    Ok(_) => Check::Done(()),
                    Err(e) => Check::not_yet(e),
                })
            })
            .await?;
        }
        // Containers left by an earlier run (the engine is this harness's alone).
        let left = engine.docker(&["ps", "-aq"]).await?;
        let left: Vec<&str> = left.split_whitespace().collect();
        if !left.is_empty() {
            let mut args = vec!["rm", "-f"];
            args.extend(left);
            engine.docker(&args).await?;
        }
        Ok(engine)
    }

    /// `docker args...` against this engine; stdout.
    pub async fn docker(&self, args: &[&str]) -> anyhow::Result<String> {
        Cmd::new(tools::tool("docker")?)
            .env("DOCKER_HOST", &self.host)
            .args(args)
            .timeout(Duration::from_secs(120))
            .stdout()
            .await
    }

    /// SIGKILL to the containers of pod `namespace/pod` (not its sandbox), as a crash would:
    /// the kubelet restarts them in the same pod. Returns how many were killed.
    pub async fn kill_pod(&self, namespace: &str, pod: &str) -> anyhow::Result<usize> {
        let ns_filter = format!("label=io.kubernetes.pod.namespace={namespace}");
        let pod_filter = format!("label=io.kubernetes.pod.name={pod}");
        let format = "{{.ID}} {{.Label \"io.kubernetes.container.name\"}}";
        let listed = self.docker(&["ps", "--filter", &ns_filter, "--filter", &pod_filter, "--format", format]).await?;
        // The sandbox (pause) container is named POD by the kubelet.
        let ids: Vec<&str> = listed
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, name)| *name != "POD")
            .map(|(id, _)| id)
            .collect();
        anyhow::ensure!(!ids.is_empty(), "no running container of pod {namespace}/{pod}");
        let mut args = vec!["kill", "--signal", "KILL"];
        args.extend(&ids);
        self.docker(&args).await?;
        Ok(ids.len())
    }

    /// The address of the engine's bridge on this machine: the node's address, which pods
    /// reach the host's processes at.
    pub async fn bridge_gateway(&self) -> anyhow::Result<Ipv4Addr> {
        let gateway =
            self.docker(&["network", "inspect", "bridge", "--format", "{{(index .IPAM.Config 0).Gateway}}"]).await?;
        if !gateway.trim().is_empty() {
            return gateway.trim().parse().with_context(|| format!("the bridge's gateway {gateway:?}"));
        }
        // An engine that made docker0 itself on its first start (no Docker service ran on the
        // machine before) records only the subnet; its gateway is the subnet's first address.
        let subnet = self.bridge_subnet().await?;
        first_host(&subnet).with_context(|| format!("the bridge records no gateway and its subnet is {subnet:?}"))
    }

    /// The bridge's subnet (the pods' addresses), e.g. `172.17.0.0/16`.
    pub async fn bridge_subnet(&self) -> anyhow::Result<String> {
        let subnet =
            self.docker(&["network", "inspect", "bridge", "--format", "{{(index .IPAM.Config 0).Subnet}}"]).await?;
        Ok(subnet.trim().to_string())
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.process.as_ref().map(|p| p.log_tail(lines)).unwrap_or_default()
    }

    /// Stops the engine if this run started it (its containers stop with it).
    pub async fn shutdown(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.terminate_async().await;
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.terminate();
        }
    }
}

/// The first host address of an IPv4 subnet (`172.17.0.0/16` -> 172.17.0.1): the gateway
/// Docker gives a bridge.
fn first_host(subnet: &str) -> anyhow::Result<Ipv4Addr> {
    let (address, bits) = subnet.trim().split_once('/').context("no prefix length")?;
    let bits: u32 = bits.parse().context("prefix length")?;
    anyhow::ensure!((1..=30).contains(&bits), "prefix length {bits} leaves no host address");
    let network = u32::from(address.parse::<Ipv4Addr>()?) & (u32::MAX << (32 - bits));
    Ok(Ipv4Addr::from(network + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bridge_without_a_recorded_gateway_uses_its_subnets_first_address() {
        assert_eq!(first_host("172.17.0.0/16").unwrap(), Ipv4Addr::new(172, 17, 0, 1));
        assert_eq!(first_host("10.1.2.128/25\n").unwrap(), Ipv4Addr::new(10, 1, 2, 129));
        assert!(first_host("").is_err() && first_host("172.17.0.0/32").is_err() && first_host("x/16").is_err());
    }
}
