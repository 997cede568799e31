//! etcd, kube-apiserver and kube-controller-manager as child processes: booting them (with the
//! certificates, keys and admin kubeconfig they need) and stopping them. The API server serves
//! loopback only, or, for a cluster with a node, also the node's address, which it advertises
//! (the `kubernetes` Service's endpoint, what pods reach through kube-proxy).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::Api;

use crate::process::ManagedProcess;
use crate::provider::client_from_kubeconfig;
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};

/// How long the control plane may take to come up (a cold kube-apiserver needs ~10 s on two
/// cores; the controller manager a few more).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// etcd, kube-apiserver, kube-controller-manager, in start order.
#[derive(Default)]
pub(crate) struct ControlPlaneProcesses(Mutex<Vec<ManagedProcess>>);

impl ControlPlaneProcesses {
    /// Starts the processes in `dir` and waits until they serve; returns the admin kubeconfig's
    /// path, the API server's URL and a client. On failure the processes started so far stay
    /// here (dropping them terminates them).
    /// `node`: the address of the cluster's node, which the API server then also serves and
    /// advertises; None: loopback only.
    pub(crate) async fn boot(
        &self,
        dir: &Path,
        node: Option<Ipv4Addr>,
    ) -> anyhow::Result<(PathBuf, String, kube::Client)> {
        boot(dir, node, &self.0).await
    }

    /// An error naming the process that died, with its log tail.
    pub(crate) fn check_alive(&self) -> anyhow::Result<()> {
        let mut processes = self.0.lock().unwrap_or_else(|e| e.into_inner());
        processes.iter_mut().try_for_each(ManagedProcess::check_running)
    }

    pub(crate) fn log_tails(&self, lines: usize) -> String {
        let processes = self.0.lock().unwrap_or_else(|e| e.into_inner());
        processes
            .iter()
            .map(|p| {
                format!(
                    "\n--- last {lines} lines of {} ({}) ---\n{}",
                    p.name(),
                    p.log_path().display(),
                    p.log_tail(lines)
                )
            })
            .collect()
    }

    /// Stops the processes in reverse start order, blocking.
    pub(crate) fn terminate(&self) {
        let mut processes = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut p) = processes.pop() {
            p.terminate();
        }
    }

    /// Stops the processes in reverse start order without blocking the runtime.
    pub(crate) async fn shutdown(&self) {
        let processes: Vec<ManagedProcess> = {
            let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
            guard.drain(..).rev().collect()
        };
        for mut p in processes {
            p.terminate_async().await;
        }
    }
}

/// Fails as soon as one of the processes exits.
async fn watch_processes(processes: &Mutex<Vec<ManagedProcess>>) -> anyhow::Error {
    loop {
        {
            let mut processes = processes.lock().unwrap_or_else(|e| e.into_inner());
            for p in processes.iter_mut() {
                if let Some(status) = p.exit_status() {
                    return anyhow!("{} exited early ({status})", p.name());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits for `fut`, failing early when a control-plane process dies.
async fn unless_dead<T>(
    processes: &Mutex<Vec<ManagedProcess>>,
    fut: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::select! {
        r = fut => r,
        e = watch_processes(processes) => Err(e),
    }
}

async fn boot(
    dir: &Path,
    node: Option<Ipv4Addr>,
    processes: &Mutex<Vec<ManagedProcess>>,
) -> anyhow::Result<(PathBuf, String, kube::Client)> {
    let etcd = tools::tool("etcd")?;
    let apiserver = tools::tool("kube-apiserver")?;
    let kcm = tools::tool("kube-controller-manager")?;
    let openssl =
        tools::find_tool("openssl").ok_or_else(|| anyhow!("`openssl` is not on PATH (apt-get install openssl)"))?;
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki)?;

    // Service-account key pair: the API server verifies (and, for TokenRequest, signs) with it,
    // the controller manager signs the token secrets.
    let sa_key = pki.join("sa.key");
    let sa_pub = pki.join("sa.pub");
    Cmd::new(&openssl).args(["genrsa", "-out"]).arg(&sa_key).arg("2048").run().await?;
    Cmd::new(&openssl).args(["rsa", "-pubout", "-in"]).arg(&sa_key).arg("-out").arg(&sa_pub).run().await?;

    let token = tools::random_hex(24);
    let tokens = pki.join("tokens.csv");
    std::fs::write(&tokens, format!("{token},admin,admin,\"system:masters\"\n"))?;

    // etcd.
    let etcd_client = crate::ports::free_addr();
    let etcd_peer = crate::ports::free_addr();
    let etcd_url = format!("http://{etcd_client}");
    let peer_url = format!("http://{etcd_peer}");
    let etcd_args = vec![
        "--name=e2e".to_string(),
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls={etcd_url}"),
        format!("--advertise-client-urls={etcd_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=e2e={peer_url}"),
        "--initial-cluster-state=new".to_string(),
        "--listen-metrics-urls=".to_string(),
        "--log-level=warn".to_string(),
        "--logger=zap".to_string(),
    ];
    push(processes, ManagedProcess::spawn("etcd", &etcd, &etcd_args, &[], &dir.join("etcd.log"))?);
    unless_dead(
        processes,
        wait_for(STARTUP_TIMEOUT, format!("etcd to be healthy at {etcd_url}/health"), || async move {
            let r = crate::http::get(etcd_client, "/health").await?;
            Ok(if r.status == 200 && r.body.contains("true") {
                Check::Done(())
            } else {
                Check::not_yet(format!("{} {}", r.status, r.body))
            })
        }),
    )
    .await?;

    // kube-apiserver.
    let port = crate::ports::free_port();
    // Serving every address, its certificate names `localhost` rather than 127.0.0.1.
    let host = if node.is_some() { "localhost" } else { "127.0.0.1" };
    let server = format!("https://{host}:{port}");
    let mut apiserver_args = vec![
        format!("--etcd-servers={etcd_url}"),
        format!("--secure-port={port}"),
        "--insecure-port=0".to_string(),
        format!("--cert-dir={}", pki.display()),
        format!("--token-auth-file={}", tokens.display()),
        "--authorization-mode=RBAC".to_string(),
        format!("--service-account-key-file={}", sa_pub.display()),
        format!("--service-account-signing-key-file={}", sa_key.display()),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
        "--service-cluster-ip-range=10.96.0.0/16".to_string(),
        "--allow-privileged=true".to_string(),
        "--profiling=false".to_string(),
        "--v=1".to_string(),
    ];
    match node {
        // Its self-signed certificate names the advertised address, the `kubernetes` Service's
        // address (10.96.0.1) and `localhost`.
        Some(ip) => apiserver_args.extend([
            "--bind-address=0.0.0.0".to_string(),
            format!("--advertise-address={ip}"),
            // For logs and exec: the node's name resolves nowhere, its address is reachable.
            "--kubelet-preferred-address-types=InternalIP".to_string(),
        ]),
        None => apiserver_args.extend([
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            // Endpoints may not point at loopback; nothing would reach them anyway.
            "--endpoint-reconciler-type=none".to_string(),
        ]),
    }
    push(
        processes,
        ManagedProcess::spawn("kube-apiserver", &apiserver, &apiserver_args, &[], &dir.join("kube-apiserver.log"))?,
    );
    let ca = pki.join("apiserver.crt");
    {
        let ca = ca.clone();
        unless_dead(
            processes,
            wait_for(STARTUP_TIMEOUT, "kube-apiserver to write its self-signed certificate", || {
                let ca = ca.clone();
                async move {
                    Ok(if ca.exists() { Check::Done(()) } else { Check::not_yet(format!("{} missing", ca.display())) })
                }
            }),
        )
        .await?;
    }
    let kubeconfig = dir.join("kubeconfig");
    write_kubeconfig(&kubeconfig, &server, &ca, &token)?;
    let client = client_from_kubeconfig(&kubeconfig).await?;
    unless_dead(
        processes,
        wait_for(STARTUP_TIMEOUT, format!("kube-apiserver {server}/readyz"), || {
            let client = client.clone();
            async move {
                let req = http::Request::get("/readyz").body(Vec::new())?;
                Ok(match client.request_text(req).await {
                    Ok(body) if body.trim() == "ok" => Check::Done(()),
                    Ok(body) => Check::not_yet(body),
                    Err(e) => Check::not_yet(e),
                })
            }
        }),
    )
    .await?;

    // kube-controller-manager.
    let kcm_args = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--controllers=*".to_string(),
        format!("--service-account-private-key-file={}", sa_key.display()),
        format!("--root-ca-file={}", ca.display()),
        "--use-service-account-credentials=false".to_string(),
        "--leader-elect=false".to_string(),
        "--bind-address=127.0.0.1".to_string(),
        "--secure-port=0".to_string(),
        "--port=0".to_string(),
        "--profiling=false".to_string(),
        "--v=1".to_string(),
    ];
    push(
        processes,
        ManagedProcess::spawn(
            "kube-controller-manager",
            &kcm,
            &kcm_args,
            &[],
            &dir.join("kube-controller-manager.log"),
        )?,
    );
    // Pods can be created once the default ServiceAccount has its token (1.20 admission
    // rejects pods until then): that proves the service-account and token controllers run.
    let sa: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    unless_dead(
        processes,
        wait_for(STARTUP_TIMEOUT, "the default ServiceAccount in namespace default and its token", || {
            let sa = sa.clone();
            async move {
                Ok(match sa.get_opt("default").await? {
                    None => Check::not_yet("serviceaccount default/default does not exist yet"),
                    Some(sa) if sa.secrets.as_ref().is_some_and(|s| !s.is_empty()) => Check::Done(()),
                    Some(_) => Check::not_yet("serviceaccount default/default has no token secret yet"),
                })
            }
        }),
    )
    .await?;
    Ok((kubeconfig, server, client))
}

fn push(processes: &Mutex<Vec<ManagedProcess>>, p: ManagedProcess) {
    processes.lock().unwrap_or_else(|e| e.into_inner()).push(p);
}

fn write_kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> anyhow::Result<()> {
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stoker-e2e", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "stoker-e2e", "context": {"cluster": "stoker-e2e", "user": "admin"}}],
        "current-context": "stoker-e2e",
    });
    std::fs::write(path, serde_yaml::to_string(&config)?).with_context(|| format!("writing {}", path.display()))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}
