//! The node's Kubernetes daemons (v1.20, built by `make tools`): the kubelet on the Docker
//! engine, kube-scheduler and kube-proxy; and the PersistentVolumes its claims bind to.
//!
//! The kubelet runs as these machines allow: no swap check, cgroupfs without QoS cgroups or
//! node allocatable, no eviction, oom_score_adj 0 (no CAP_SYS_RESOURCE: a negative one is
//! refused; install-tools.sh patched the sandbox and Guaranteed adjustments to 0 likewise),
//! image garbage collection off (the images are built here, there is no registry to pull them
//! back from), and no resolv.conf of the host's: pods resolve cluster names only.

use std::net::Ipv4Addr;
use std::path::Path;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, PostParams};

use crate::in_cluster::REPOSITORY;
use crate::node::dns::CLUSTER_DOMAIN;
use crate::process::ManagedProcess;
use crate::tools;

/// The node's name.
pub const NODE: &str = "stoker-node";
/// The pod sandbox image `e2e/cluster/images.sh` imports.
pub fn pause_image() -> String {
    format!("{REPOSITORY}/pause:3.4")
}

/// How many hostPath PersistentVolumes the node offers (one per cache claim a run makes).
const VOLUMES: usize = 12;

pub struct Node<'a> {
    pub dir: &'a Path,
    pub kubeconfig: &'a Path,
    pub ip: Ipv4Addr,
    pub docker_host: &'a str,
    /// The pods' addresses (the Docker bridge's subnet).
    pub pod_cidr: &'a str,
}

impl Node<'_> {
    pub fn kubelet(&self) -> anyhow::Result<ManagedProcess> {
        let root = self.dir.join("kubelet");
        std::fs::create_dir_all(&root)?;
        let args = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--hostname-override={NODE}"),
            format!("--node-ip={}", self.ip),
            "--container-runtime=docker".to_string(),
            format!("--docker-endpoint={}", self.docker_host),
            format!("--pod-infra-container-image={}", pause_image()),
            format!("--root-dir={}", root.display()),
            format!("--cert-dir={}", self.dir.join("kubelet-pki").display()),
            format!("--cluster-dns={}", self.ip),
            format!("--cluster-domain={CLUSTER_DOMAIN}"),
            "--resolv-conf=".to_string(),
            format!("--port={}", crate::ports::free_port()),
            "--read-only-port=0".to_string(),
            "--healthz-port=0".to_string(),
            "--fail-swap-on=false".to_string(),
            "--cgroup-driver=cgroupfs".to_string(),
            "--cgroups-per-qos=false".to_string(),
            "--enforce-node-allocatable=".to_string(),
            "--eviction-hard=".to_string(),
            "--oom-score-adj=0".to_string(),
            "--image-gc-high-threshold=100".to_string(),
            "--image-gc-low-threshold=99".to_string(),
            // 2: the kubelet logs each pod's deletion and each container it kills, which the
            // diagnostics show (`NodeCluster::pod_deletions`).
            "--v=2".to_string(),
        ];
        ManagedProcess::spawn("kubelet", &tools::tool("kubelet")?, &args, &[], &self.dir.join("kubelet.log"))
    }

    pub fn scheduler(&self) -> anyhow::Result<ManagedProcess> {
        let args = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            "--leader-elect=false".to_string(),
            "--port=0".to_string(),
            "--secure-port=0".to_string(),
            "--v=1".to_string(),
        ];
        let log = self.dir.join("kube-scheduler.log");
        ManagedProcess::spawn("kube-scheduler", &tools::tool("kube-scheduler")?, &args, &[], &log)
    }

    /// kube-proxy in iptables mode. Every Service connection is masqueraded: a pod reaching a
    /// Service whose endpoint is on the same bridge would otherwise get the answer straight
    /// from the endpoint, bypassing the rewrite (these machines have no br_netfilter).
    pub fn proxy(&self) -> anyhow::Result<ManagedProcess> {
        let args = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--hostname-override={NODE}"),
            "--proxy-mode=iptables".to_string(),
            "--masquerade-all".to_string(),
            format!("--cluster-cidr={}", self.pod_cidr),
            "--conntrack-max-per-core=0".to_string(),
            format!("--healthz-bind-address=127.0.0.1:{}", crate::ports::free_port()),
            format!("--metrics-bind-address=127.0.0.1:{}", crate::ports::free_port()),
            "--v=1".to_string(),
        ];
        ManagedProcess::spawn("kube-proxy", &tools::tool("kube-proxy")?, &args, &[], &self.dir.join("kube-proxy.log"))
    }
}

/// Removes the Service rules a kube-proxy left (they outlive it).
pub async fn clean_proxy_rules() -> anyhow::Result<()> {
    crate::tools::Cmd::new(tools::tool("kube-proxy")?).arg("--cleanup").run().await?;
    Ok(())
}

/// hostPath PersistentVolumes without a storage class, so a claim that names none binds one.
/// World-writable, as a local-path provisioner makes them: hostPath ignores fsGroup.
pub async fn offer_volumes(client: kube::Client, dir: &Path) -> anyhow::Result<()> {
    let api: Api<PersistentVolume> = Api::all(client);
    for n in 0..VOLUMES {
        let path = dir.join(format!("volumes/pv-{n}"));
        std::fs::create_dir_all(&path)?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
        let pv: PersistentVolume = serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("stoker-node-pv-{n}")},
            "spec": {
                "capacity": {"storage": "1Ti"},
                "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": path, "type": "Directory"},
            },
        }))?;
        api.create(&PostParams::default(), &pv).await?;
    }
    Ok(())
}
