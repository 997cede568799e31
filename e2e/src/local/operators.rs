//! The operator as local processes against the local control plane: one per replica, each with
//! its own metrics and dispatcher ports, after the CRD and the operator's namespace are in place.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::process::ManagedProcess;
use crate::provider::{OperatorInstance, OperatorOptions};
use crate::tools::{self, Cmd};
use crate::wait::{Check, wait_for};
use crate::{CRD_NAME, LEASE_NAME, OPERATOR_NAMESPACE, RELEASE};

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

/// The operator processes of a local control plane, started, stopped and killed on request.
pub(super) struct LocalOperators {
    client: kube::Client,
    /// Where their logs go.
    dir: PathBuf,
    kubeconfig: PathBuf,
    /// The operators' dispatcher addresses, for the proxy standing in for the Service.
    dispatcher_targets: Arc<Mutex<Vec<SocketAddr>>>,
    /// The proxy's URL, which operators hand to the workers they create.
    dispatcher_url: String,
    slots: Vec<OperatorSlot>,
    opts: Option<OperatorOptions>,
    /// Whether `stoker-operator run` knows `--dispatcher-addr` (checked once via --help).
    dispatcher_flag: Option<bool>,
}

impl LocalOperators {
    /// None running yet: `start` starts them.
    pub(super) fn new(
        client: kube::Client,
        dir: PathBuf,
        kubeconfig: PathBuf,
        dispatcher_targets: Arc<Mutex<Vec<SocketAddr>>>,
        dispatcher_url: String,
    ) -> Self {
        LocalOperators {
            client,
            dir,
            kubeconfig,
            dispatcher_targets,
            dispatcher_url,
            slots: Vec::new(),
            opts: None,
            dispatcher_flag: None,
        }
    }

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

    /// Starts operators until `opts.replicas` run (stopping any beyond), and waits until each
    /// is up and (with leader election) one of them leads.
    pub(super) async fn start(&mut self, opts: OperatorOptions) -> anyhow::Result<()> {
        let binary = tools::workspace_binary("stoker-operator")?;
        self.ensure_crd(&binary).await?;
        self.ensure_namespace(OPERATOR_NAMESPACE).await?;
        if self.dispatcher_flag.is_none() {
            let help = Cmd::new(&binary).args(["run", "--help"]).stdout().await.unwrap_or_default();
            self.dispatcher_flag = Some(help.contains("--dispatcher-addr"));
        }
        while self.slots.len() < opts.replicas {
            let dispatcher = crate::ports::free_addr();
            self.dispatcher_targets.lock().unwrap().push(dispatcher);
            let name = format!("stoker-operator-local-{}", self.slots.len());
            self.slots.push(OperatorSlot {
                log: self.dir.join(format!("{name}.log")),
                name,
                metrics: crate::ports::free_addr(),
                dispatcher,
                process: None,
            });
        }
        for slot in self.slots.iter_mut().skip(opts.replicas) {
            if let Some(p) = slot.process.as_mut() {
                p.terminate_async().await;
            }
        }
        for slot in self.slots.iter_mut().take(opts.replicas) {
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
                // As the in-cluster tier installs the chart: a NetworkPolicy per pipeline.
                "--network-policy=true".to_string(),
            ];
            if self.dispatcher_flag == Some(true) {
                args.push(format!("--dispatcher-addr={}", slot.dispatcher));
                args.push(format!("--dispatcher-url={}", self.dispatcher_url));
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
        self.opts = Some(opts.clone());
        for slot in self.slots.iter_mut().take(opts.replicas) {
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
                self.slots.iter().take(opts.replicas).map(|s| (s.name.clone(), s.metrics)).collect();
            let led = wait_for(Duration::from_secs(90), "one operator instance to lead (/readyz: leading)", || {
                let slots = slots.clone();
                async move {
                    let mut seen = Vec::new();
                    let mut leaders = Vec::new();
                    for (name, addr) in &slots {
                        match crate::http::get(*addr, "/readyz").await {
                            Ok(r) if r.says_leading() => leaders.push(name.clone()),
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
                bail!("{e:#}{}", self.log_tails(30));
            }
        }
        Ok(())
    }

    /// Stops every operator process (SIGTERM, then SIGKILL after the grace period).
    pub(super) async fn stop(&mut self) {
        for slot in self.slots.iter_mut() {
            if let Some(p) = slot.process.as_mut() {
                p.terminate_async().await;
            }
        }
    }

    /// Stops every operator process and starts them again with the options of the last start.
    pub(super) async fn restart(&mut self) -> anyhow::Result<()> {
        let opts = self.opts.clone().unwrap_or_default();
        self.stop().await;
        self.start(opts).await
    }

    /// Stops one operator process, gracefully or at once; it is not restarted.
    pub(super) async fn kill(&mut self, name: &str, graceful: bool) -> anyhow::Result<()> {
        let slot = self
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

    pub(super) fn instances(&mut self) -> Vec<OperatorInstance> {
        self.slots
            .iter_mut()
            .map(|s| OperatorInstance {
                running: s.running(),
                name: s.name.clone(),
                metrics_addr: Some(s.metrics),
                dispatcher_addr: Some(s.dispatcher),
            })
            .collect()
    }

    /// Where operator `name` serves /healthz, /readyz and /metrics.
    pub(super) fn metrics_addr(&self, name: &str) -> anyhow::Result<SocketAddr> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.metrics)
            .ok_or_else(|| anyhow!("no operator instance named {name}"))
    }

    pub(super) fn log_tails(&self, lines: usize) -> String {
        self.slots
            .iter()
            .map(|s| format!("\n--- last {lines} lines of {} ---\n{}", s.log.display(), tools::tail(&s.log, lines)))
            .collect()
    }

    /// Stops every operator process for good, without blocking the runtime.
    pub(super) async fn shutdown(&mut self) {
        for slot in self.slots.iter_mut() {
            if let Some(mut p) = slot.process.take() {
                p.terminate_async().await;
            }
        }
    }

    /// Stops every operator process for good, blocking (on drop).
    pub(super) fn terminate(&mut self) {
        for slot in self.slots.iter_mut() {
            if let Some(mut p) = slot.process.take() {
                p.terminate();
            }
        }
    }
}
