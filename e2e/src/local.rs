//! The `local` provider: a real Kubernetes control plane on loopback, without a kubelet.
//!
//! etcd, kube-apiserver and kube-controller-manager (v1.20, from `make tools`) run as child
//! processes on free loopback ports, with everything (etcd data, certificates, keys, kubeconfig,
//! logs) in one temporary directory. The API server authenticates a static admin token (group
//! `system:masters`) and authorizes with RBAC; the controller manager runs every controller, so
//! Deployments get ReplicaSets and Pods (which stay Pending: nothing schedules or runs them),
//! service accounts get tokens, and the garbage collector and namespace controller work.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::process::ManagedProcess;
use crate::provider::{Cluster, OperatorInstance, OperatorOptions, Provider, client_from_kubeconfig};
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};
use crate::{CRD_NAME, LEASE_NAME, OPERATOR_NAMESPACE, RELEASE};

/// How long the control plane may take to come up (a cold kube-apiserver needs ~10 s on two
/// cores; the controller manager a few more).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// etcd, kube-apiserver, kube-controller-manager, in start order.
    processes: Mutex<Vec<ManagedProcess>>,
    operators: tokio::sync::Mutex<LocalOperators>,
    /// The operators' dispatcher addresses, for the proxy standing in for the Service.
    dispatcher_targets: Arc<Mutex<Vec<SocketAddr>>>,
    dispatcher: crate::leader_proxy::LeaderProxy,
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
        let processes = Mutex::new(Vec::new());
        let dispatcher_targets: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let dispatcher = crate::leader_proxy::LeaderProxy::start(dispatcher_targets.clone()).await?;
        match boot(&dir, &processes).await {
            Ok((kubeconfig, server, client)) => Ok(LocalControlPlane {
                dispatcher_targets,
                dispatcher,
                tempdir: Mutex::new(tempdir),
                dir,
                kubeconfig,
                server,
                client,
                processes,
                operators: tokio::sync::Mutex::new(LocalOperators::default()),
            }),
            Err(e) => {
                let logs = log_tails(&processes, 40);
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
        let mut processes = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        processes.iter_mut().try_for_each(ManagedProcess::check_running)
    }

    fn stop_control_plane(&self) {
        let mut processes = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut p) = processes.pop() {
            p.terminate();
        }
    }
}

fn log_tails(processes: &Mutex<Vec<ManagedProcess>>, lines: usize) -> String {
    let processes = processes.lock().unwrap_or_else(|e| e.into_inner());
    processes
        .iter()
        .map(|p| {
            format!("\n--- last {lines} lines of {} ({}) ---\n{}", p.name(), p.log_path().display(), p.log_tail(lines))
        })
        .collect()
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

async fn boot(dir: &Path, processes: &Mutex<Vec<ManagedProcess>>) -> anyhow::Result<(PathBuf, String, kube::Client)> {
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
    let server = format!("https://127.0.0.1:{port}");
    let apiserver_args = vec![
        format!("--etcd-servers={etcd_url}"),
        "--bind-address=127.0.0.1".to_string(),
        "--advertise-address=127.0.0.1".to_string(),
        format!("--secure-port={port}"),
        "--insecure-port=0".to_string(),
        format!("--cert-dir={}", pki.display()),
        format!("--token-auth-file={}", tokens.display()),
        "--authorization-mode=RBAC".to_string(),
        format!("--service-account-key-file={}", sa_pub.display()),
        format!("--service-account-signing-key-file={}", sa_key.display()),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_string(),
        "--service-cluster-ip-range=10.96.0.0/16".to_string(),
        // Endpoints may not point at loopback; nothing would reach them anyway.
        "--endpoint-reconciler-type=none".to_string(),
        "--allow-privileged=true".to_string(),
        "--profiling=false".to_string(),
        "--v=1".to_string(),
    ];
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

// ---------------------------------------------------------------------------------------------
// The operator as local processes.

struct OperatorSlot {
    name: String,
    metrics: SocketAddr,
    dispatcher: SocketAddr,
    log: PathBuf,
    process: Option<ManagedProcess>,
}

impl OperatorSlot {
    fn running(&mut self) -> bool {
        self.process.as_mut().is_some_and(ManagedProcess::is_running)
    }
}

#[derive(Default)]
struct LocalOperators {
    slots: Vec<OperatorSlot>,
    opts: Option<OperatorOptions>,
    /// Whether `stoker-operator run` knows `--dispatcher-addr` (checked once via --help).
    dispatcher_flag: Option<bool>,
}

impl LocalControlPlane {
    /// Installs the CRD from `stoker-operator crd` unless it exists, labelled so that a later
    /// `helm install` adopts it; then waits until it is Established.
    async fn ensure_crd(&self, operator: &Path) -> anyhow::Result<()> {
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        if crds.get_opt(CRD_NAME).await?.is_none() {
            let yaml = Cmd::new(operator).arg("crd").stdout().await?;
            let mut crd: CustomResourceDefinition =
                serde_yaml::from_str(&yaml).context("parsing the output of `stoker-operator crd`")?;
            let meta = &mut crd.metadata;
            meta.labels.get_or_insert_default().insert("app.kubernetes.io/managed-by".into(), "Helm".into());
            let annotations = meta.annotations.get_or_insert_default();
            annotations.insert("meta.helm.sh/release-name".into(), RELEASE.into());
            annotations.insert("meta.helm.sh/release-namespace".into(), OPERATOR_NAMESPACE.into());
            match crds.create(&PostParams::default(), &crd).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e).context(format!("creating the CRD {CRD_NAME}")),
            }
        }
        wait_for(Duration::from_secs(60), format!("the CRD {CRD_NAME} to be Established"), || {
            let crds = crds.clone();
            async move {
                let crd = crds.get(CRD_NAME).await?;
                let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
                Ok(if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
                    Check::Done(())
                } else {
                    Check::not_yet(format!("conditions: {conditions:?}"))
                })
            }
        })
        .await
    }

    async fn ensure_namespace(&self, name: &str) -> anyhow::Result<()> {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(name).await?.is_none() {
            let ns = Namespace {
                metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
                ..Default::default()
            };
            match namespaces.create(&PostParams::default(), &ns).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e).context(format!("creating namespace {name}")),
            }
        }
        Ok(())
    }

    async fn start_operators(&self, ops: &mut LocalOperators, opts: OperatorOptions) -> anyhow::Result<()> {
        let binary = tools::workspace_binary("stoker-operator")?;
        self.ensure_crd(&binary).await?;
        self.ensure_namespace(OPERATOR_NAMESPACE).await?;
        if ops.dispatcher_flag.is_none() {
            let help = Cmd::new(&binary).args(["run", "--help"]).stdout().await.unwrap_or_default();
            ops.dispatcher_flag = Some(help.contains("--dispatcher-addr"));
        }
        while ops.slots.len() < opts.replicas {
            let dispatcher = crate::ports::free_addr();
            self.dispatcher_targets.lock().unwrap().push(dispatcher);
            let name = format!("stoker-operator-local-{}", ops.slots.len());
            ops.slots.push(OperatorSlot {
                log: self.dir.join(format!("{name}.log")),
                name,
                metrics: crate::ports::free_addr(),
                dispatcher,
                process: None,
            });
        }
        for slot in ops.slots.iter_mut().skip(opts.replicas) {
            if let Some(p) = slot.process.as_mut() {
                p.terminate_async().await;
            }
        }
        for slot in ops.slots.iter_mut().take(opts.replicas) {
            if slot.running() {
                continue;
            }
            let mut args = vec![
                "run".to_string(),
                format!("--metrics-addr={}", slot.metrics),
                format!("--leader-election={}", opts.leader_election),
                format!("--lease-namespace={OPERATOR_NAMESPACE}"),
                format!("--lease-name={LEASE_NAME}"),
                "--log-level=info".to_string(),
                "--log-format=text".to_string(),
            ];
            if ops.dispatcher_flag == Some(true) {
                args.push(format!("--dispatcher-addr={}", slot.dispatcher));
                args.push(format!("--dispatcher-url={}", self.dispatcher.url()));
            }
            args.extend(opts.extra_args.iter().cloned());
            let mut env = vec![
                ("KUBECONFIG".to_string(), self.kubeconfig.display().to_string()),
                ("POD_NAME".to_string(), slot.name.clone()),
                ("POD_NAMESPACE".to_string(), OPERATOR_NAMESPACE.to_string()),
                ("RUST_BACKTRACE".to_string(), "1".to_string()),
            ];
            env.extend(opts.env.iter().cloned());
            {
                use std::io::Write as _;
                let mut log = std::fs::File::options().create(true).append(true).open(&slot.log)?;
                writeln!(log, "=== e2e harness: starting {} {} ===", binary.display(), args.join(" "))?;
            }
            slot.process = Some(
                ManagedProcess::spawn(&slot.name, &binary, &args, &env, &slot.log)?.with_grace(Duration::from_secs(15)),
            );
        }
        ops.opts = Some(opts.clone());
        for slot in ops.slots.iter_mut().take(opts.replicas) {
            let addr = slot.metrics;
            let name = slot.name.clone();
            let process = slot.process.as_mut().expect("started above");
            let up = wait_for(Duration::from_secs(60), format!("operator {name} to answer /healthz on {addr}"), || {
                let dead = process.exit_status();
                async move {
                    if let Some(status) = dead {
                        return Ok(Check::Abort(format!("the process exited ({status})")));
                    }
                    let r = crate::http::get(addr, "/healthz").await?;
                    Ok(if r.status == 200 {
                        Check::Done(())
                    } else {
                        Check::not_yet(format!("{} {}", r.status, r.body))
                    })
                }
            })
            .await;
            if let Err(e) = up {
                bail!("{e:#}\n--- last lines of {} ---\n{}", slot.log.display(), tools::tail(&slot.log, 40));
            }
        }
        if opts.leader_election {
            // A lease left by a killed leader expires after the lease duration (15 s default).
            let slots: Vec<(String, SocketAddr)> =
                ops.slots.iter().take(opts.replicas).map(|s| (s.name.clone(), s.metrics)).collect();
            let led = wait_for(Duration::from_secs(90), "one operator instance to lead (/readyz 200)", || {
                let slots = slots.clone();
                async move {
                    let mut seen = Vec::new();
                    let mut leaders = Vec::new();
                    for (name, addr) in &slots {
                        match crate::http::get(*addr, "/readyz").await {
                            Ok(r) if r.status == 200 => leaders.push(name.clone()),
                            Ok(r) => seen.push(format!("{name}: {} {}", r.status, r.body.trim())),
                            Err(e) => seen.push(format!("{name}: {e:#}")),
                        }
                    }
                    Ok(match leaders.len() {
                        1 => Check::Done(()),
                        0 => Check::not_yet(seen.join("; ")),
                        _ => Check::Abort(format!("more than one leader: {leaders:?}")),
                    })
                }
            })
            .await;
            if let Err(e) = led {
                bail!("{e:#}{}", operator_log_tails(&ops.slots, 30));
            }
        }
        Ok(())
    }
}

fn operator_log_tails(slots: &[OperatorSlot], lines: usize) -> String {
    slots
        .iter()
        .map(|s| format!("\n--- last {lines} lines of {} ---\n{}", s.log.display(), tools::tail(&s.log, lines)))
        .collect()
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
        let mut ops = self.operators.lock().await;
        self.start_operators(&mut ops, opts).await
    }

    async fn operator_stop(&self) -> anyhow::Result<()> {
        let mut ops = self.operators.lock().await;
        for slot in ops.slots.iter_mut() {
            if let Some(p) = slot.process.as_mut() {
                p.terminate_async().await;
            }
        }
        Ok(())
    }

    async fn operator_restart(&self) -> anyhow::Result<()> {
        let mut ops = self.operators.lock().await;
        let opts = ops.opts.clone().unwrap_or_default();
        for slot in ops.slots.iter_mut() {
            if let Some(p) = slot.process.as_mut() {
                p.terminate_async().await;
            }
        }
        self.start_operators(&mut ops, opts).await
    }

    async fn operator_kill(&self, name: &str, graceful: bool) -> anyhow::Result<()> {
        let mut ops = self.operators.lock().await;
        let slot = ops
            .slots
            .iter_mut()
            .find(|s| s.name == name)
            .ok_or_else(|| anyhow!("no operator instance named {name}"))?;
        if let Some(p) = slot.process.as_mut() {
            if graceful {
                p.terminate_async().await;
            } else {
                p.kill();
            }
        }
        Ok(())
    }

    async fn operator_instances(&self) -> anyhow::Result<Vec<OperatorInstance>> {
        let mut ops = self.operators.lock().await;
        Ok(ops
            .slots
            .iter_mut()
            .map(|s| OperatorInstance {
                running: s.running(),
                name: s.name.clone(),
                metrics_addr: Some(s.metrics),
                dispatcher_addr: Some(s.dispatcher),
            })
            .collect())
    }

    async fn operator_get(&self, name: &str, path: &str) -> anyhow::Result<crate::http::Response> {
        let addr = {
            let ops = self.operators.lock().await;
            ops.slots
                .iter()
                .find(|s| s.name == name)
                .map(|s| s.metrics)
                .ok_or_else(|| anyhow!("no operator instance named {name}"))?
        };
        crate::http::get(addr, path).await
    }

    async fn operator_logs(&self, lines: usize) -> String {
        let ops = self.operators.lock().await;
        operator_log_tails(&ops.slots, lines)
    }

    async fn diagnostics(&self) -> String {
        format!("{}{}", log_tails(&self.processes, 15), self.operator_logs(40).await)
    }

    async fn shutdown(&self) {
        {
            let mut ops = self.operators.lock().await;
            for slot in ops.slots.iter_mut() {
                if let Some(mut p) = slot.process.take() {
                    p.terminate_async().await;
                }
            }
        }
        let processes: Vec<ManagedProcess> = {
            let mut guard = self.processes.lock().unwrap_or_else(|e| e.into_inner());
            guard.drain(..).rev().collect()
        };
        for mut p in processes {
            p.terminate_async().await;
        }
        drop(self.tempdir.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for LocalControlPlane {
    fn drop(&mut self) {
        for slot in self.operators.get_mut().slots.iter_mut() {
            if let Some(mut p) = slot.process.take() {
                p.terminate();
            }
        }
        self.stop_control_plane();
    }
}
