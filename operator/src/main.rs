//! `stoker-operator`: `run` the controller, or print the `crd`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::{Api, Client, CustomResourceExt};
use stoker_api::DataPipeline;
use stoker_api::tls::{Scheme, with_scheme};
use stoker_operator::access::checked::Lifetimes;
use stoker_operator::access::{Access, Checked, KubeReviewer, Open};
use stoker_operator::autoscaling::{self, DeploymentScaler, Loop, ScalingBook};
use stoker_operator::controller::objects::{WorkerDefaults, worker_tls};
use stoker_operator::controller::{self, Context, WorkersTls};
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};
use stoker_operator::http::{self, HttpState, Role};
use stoker_operator::leader::{LeaderElector, LeaseConfig};
use stoker_operator::leader_pod::LeaderPod;
use stoker_operator::metrics::Metrics;
use stoker_operator::telemetry::{self, LogFormat};
use stoker_operator::tls::Ca;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tracing::{error, info, warn};

/// How often clients report a batch-time window to the dispatcher; the autoscaler judges a
/// pipeline on all the reports of its (longer) autoscaling window.
const DISPATCHER_WINDOW: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(version, about = "The Stoker operator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile DataPipelines (uses KUBECONFIG or the in-cluster service account).
    Run(Box<RunArgs>),
    /// Print the DataPipeline CustomResourceDefinition as YAML.
    Crd,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Serves /healthz, /readyz and /metrics.
    #[arg(long, env = "STOKER_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Take part in leader election; with false this process always reconciles.
    #[arg(long, env = "STOKER_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the Lease; the pod's namespace in a cluster, else the kubeconfig's.
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    #[arg(long, env = "STOKER_LEASE_NAME", default_value = "stoker-operator")]
    lease_name: String,
    /// Seconds a lease stays valid without renewal; a standby takes over after this.
    #[arg(long, env = "STOKER_LEASE_DURATION", default_value_t = 15)]
    lease_duration: u64,
    /// This process's name (the pod's in a cluster); its Lease identity is `<name>_<start time>`.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Label this process's pod (named by --identity, in the lease namespace) `stoker.dev/leader=true`
    /// while it leads: the chart's dispatcher Service selects that label.
    #[arg(long, env = "STOKER_MARK_LEADER_POD", default_value_t = false, action = clap::ArgAction::Set)]
    mark_leader_pod: bool,
    /// Image of worker pods when a pipeline names none.
    #[arg(long, env = "STOKER_WORKER_IMAGE", default_value = concat!("ghcr.io/stoker-dev/stoker-worker:", env!("CARGO_PKG_VERSION")))]
    worker_image: String,
    /// Where the dispatcher (gRPC) listens while this process leads.
    #[arg(long, env = "STOKER_DISPATCHER_ADDR", default_value = "0.0.0.0:50051")]
    dispatcher_addr: SocketAddr,
    /// Where workers reach the dispatcher; default: the stoker-dispatcher Service of the lease namespace.
    #[arg(long, env = "STOKER_DISPATCHER_URL")]
    dispatcher_url: Option<String>,
    /// Cluster-wide cap on worker pods across all BatchTime pipelines (0 = no cap); the
    /// autoscaler shares it out by marginal gain, never below a pipeline's min.
    #[arg(long, env = "STOKER_WORKER_BUDGET", default_value_t = 0)]
    worker_budget: u32,
    /// Cap on the worker pods of one namespace's BatchTime pipelines together (0 = no cap),
    /// beside --worker-budget, so one tenant cannot take it all; never below the pipelines' mins.
    #[arg(long, env = "STOKER_NAMESPACE_WORKER_CAP", default_value_t = 0)]
    namespace_worker_cap: u32,

    /// How callers of the dispatcher and workers prove who they are: `kubernetes` (a
    /// ServiceAccount token checked with TokenReview and SubjectAccessReview) or `none`
    /// (anyone who can reach them; for clusters whose network already isolates tenants).
    #[arg(long, env = "STOKER_AUTHENTICATION", value_enum, default_value_t = Authentication::Kubernetes)]
    authentication: Authentication,
    /// Give each pipeline a NetworkPolicy that admits to its workers only pods of its own
    /// namespace and of the operator's (the lease namespace).
    #[arg(long, env = "STOKER_NETWORK_POLICY", default_value_t = false, action = clap::ArgAction::Set)]
    network_policy: bool,
    /// The audience Stoker tokens must carry; worker pods get a projected token for it.
    #[arg(long, env = "STOKER_TOKEN_AUDIENCE", default_value = stoker_api::token::DEFAULT_AUDIENCE)]
    token_audience: String,

    #[command(flatten)]
    tls: TlsArgs,

    /// Log filter, e.g. `info` or `stoker_operator=debug,kube=info`.
    #[arg(long, env = "STOKER_LOG", default_value = "info")]
    log_level: String,
    #[arg(long, env = "STOKER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// TLS for the dispatcher and the data plane: all four files, or none (plaintext). With them,
/// the dispatcher serves TLS and each pipeline's workers serve TLS with a certificate this CA
/// issues for their Service's name.
#[derive(clap::Args)]
struct TlsArgs {
    /// The dispatcher's certificate chain (PEM); its names must include the dispatcher URL's host.
    #[arg(long, env = "STOKER_TLS_CERT_FILE")]
    tls_cert_file: Option<PathBuf>,
    /// The dispatcher's private key (PEM).
    #[arg(long, env = "STOKER_TLS_KEY_FILE")]
    tls_key_file: Option<PathBuf>,
    /// The certificate (chain) of the CA that signs workers' certificates.
    #[arg(long, env = "STOKER_TLS_CA_CERT_FILE")]
    tls_ca_cert_file: Option<PathBuf>,
    /// That CA's private key (PEM: PKCS#8, or PKCS#1 RSA).
    #[arg(long, env = "STOKER_TLS_CA_KEY_FILE")]
    tls_ca_key_file: Option<PathBuf>,
    /// The CA certificates workers verify the dispatcher with; default: --tls-ca-cert-file.
    #[arg(long, env = "STOKER_TLS_CA_BUNDLE_FILE")]
    tls_ca_bundle_file: Option<PathBuf>,
}

/// The dispatcher's TLS settings and the CA for workers' certificates, read at startup so a
/// wrong path or a bad file stops the operator with its name.
struct Tls {
    server: tonic::transport::ServerTlsConfig,
    workers: WorkersTls,
}

impl TlsArgs {
    fn load(&self) -> anyhow::Result<Option<Tls>> {
        let files = [&self.tls_cert_file, &self.tls_key_file, &self.tls_ca_cert_file, &self.tls_ca_key_file];
        let (Some(cert), Some(key), Some(ca_cert), Some(ca_key)) =
            (&self.tls_cert_file, &self.tls_key_file, &self.tls_ca_cert_file, &self.tls_ca_key_file)
        else {
            if files.iter().any(|f| f.is_some()) || self.tls_ca_bundle_file.is_some() {
                bail!(
                    "TLS needs all of --tls-cert-file, --tls-key-file (the dispatcher's) and --tls-ca-cert-file,                      --tls-ca-key-file (the CA that signs workers' certificates); some are missing"
                );
            }
            return Ok(None);
        };
        let server = stoker_operator::tls::server_config(cert, key)?;
        let ca = Ca::load(ca_cert, ca_key)?;
        let bundle = match &self.tls_ca_bundle_file {
            Some(path) => String::from_utf8(stoker_api::tls::read_pem(path, "CA bundle")?)
                .with_context(|| format!("{} is not PEM text", path.display()))?,
            None => ca.cert_pem().to_string(),
        };
        Ok(Some(Tls { server, workers: WorkersTls { ca, bundle } }))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Authentication {
    Kubernetes,
    None,
}

/// How often refused calls are turned into Events on their pipelines.
const REFUSALS_EVERY: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Several rustls providers are compiled into the workspace; choose one explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match Cli::parse().command {
        Command::Crd => {
            print!("{}", stoker_api::to_yaml(&DataPipeline::crd())?);
            Ok(())
        }
        Command::Run(args) => {
            telemetry::init(&args.log_level, args.log_format);
            let result = run(*args).await;
            if let Err(e) = &result {
                error!(error = format!("{e:#}"), "operator stopped");
            }
            result
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let tls = args.tls.load()?;
    let client = Client::try_default().await.context("connecting to the Kubernetes API (KUBECONFIG or in-cluster)")?;
    check_crd(&client).await?;

    let (shutdown_tx, shutdown) = watch::channel(false);
    tokio::spawn(async move {
        let (mut term, mut int) = (signal(SignalKind::terminate()).unwrap(), signal(SignalKind::interrupt()).unwrap());
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        info!("signal received: shutting down");
        shutdown_tx.send_replace(true);
    });

    let metrics = Metrics::default();
    let (role_tx, role) = watch::channel(Role::Starting);
    let (store_tx, pipelines) = watch::channel(None);
    let server = tokio::spawn(http::serve(
        args.metrics_addr,
        HttpState { metrics: metrics.clone(), role, pipelines },
        shutdown.clone(),
    ));

    let namespace = args.lease_namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let leader_pod = match (&args.identity, args.mark_leader_pod) {
        (Some(pod), true) => Some(LeaderPod::new(client.clone(), &namespace, pod.clone())),
        (None, true) => bail!("--mark-leader-pod needs the pod's name: set POD_NAME (or --identity)"),
        (_, false) => None,
    };
    if let Some(pod) = &leader_pod {
        // Before Ready: a pod that led before this process started must not keep the traffic.
        pod.clear_own().await?;
    }
    role_tx.send_replace(Role::Standby);
    let identity = lease_identity(args.identity.as_deref());
    let (leader_tx, mut leading) = watch::channel(!args.leader_election);
    let elector = args.leader_election.then(|| {
        let config = LeaseConfig {
            namespace: namespace.clone(),
            name: args.lease_name.clone(),
            identity: identity.clone(),
            lease_duration: Duration::from_secs(args.lease_duration),
            renew_every: Duration::from_secs((args.lease_duration / 3).max(1)),
        };
        tokio::spawn(LeaderElector::new(client.clone(), config).run(leader_tx, shutdown.clone()))
    });
    {
        let leading = leading.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut leading = leading;
            loop {
                metrics.leader.set(i64::from(*leading.borrow_and_update()));
                if leading.changed().await.is_err() {
                    break;
                }
            }
        });
    }

    info!(%identity, lease = %format!("{namespace}/{}", args.lease_name), "waiting to lead");
    let mut waiting = shutdown.clone();
    tokio::select! {
        _ = leading.wait_for(|l| *l) => {}
        _ = waiting.wait_for(|s| *s) => return finish(server, elector).await,
    }
    info!(%identity, worker_image = %args.worker_image, worker_budget = args.worker_budget, namespace_worker_cap = args.namespace_worker_cap, "leading: starting the controller");

    // The dispatcher serves TLS or plaintext, never both: the workers' URL says which.
    let scheme = if tls.is_some() { Scheme::Tls } else { Scheme::Plaintext };
    let given = args.dispatcher_url.clone().unwrap_or_else(|| format!("stoker-dispatcher.{namespace}.svc:50051"));
    let dispatcher_url = with_scheme(&given, &scheme);
    if args.dispatcher_url.as_ref().is_some_and(|g| g.contains("://") && *g != dispatcher_url) {
        warn!(given = %given, used = %dispatcher_url, "--dispatcher-url's scheme contradicts the dispatcher's TLS setting: workers use the one that works");
    }
    let defaults = WorkerDefaults {
        image: args.worker_image.clone(),
        dispatcher_url,
        token_audience: (args.authentication == Authentication::Kubernetes).then(|| args.token_audience.clone()),
        tls: tls.is_some(),
        network_policy: args.network_policy.then(|| namespace.clone()),
    };
    let (server_tls, workers_tls) = tls.map(|t| (t.server, t.workers)).unzip();
    let reporter = Reporter { controller: controller::FIELD_MANAGER.into(), instance: Some(identity.clone()) };
    let book = Arc::new(ScalingBook::default());
    let recorder = Recorder::new(client.clone(), reporter.clone());
    let mut ctx = Context::new(client.clone(), defaults, metrics.clone(), recorder.clone(), book.clone());
    if let Some(workers_tls) = workers_tls {
        info!(ca = %workers_tls.ca.fingerprint(), "TLS on: the dispatcher and workers serve TLS");
        ctx = ctx.with_tls(workers_tls);
    }
    let ctx = Arc::new(ctx);

    // The controller stops on shutdown, or when leadership is lost: a process that may no
    // longer lead must stop writing at once, so it exits and restarts as a standby.
    let (stop_tx, stop) = watch::channel(false);
    let mut lost = leading.clone();
    let mut shutting_down = shutdown.clone();
    let lost_leadership = tokio::spawn(async move {
        tokio::select! {
            _ = lost.wait_for(|l| !*l) => { stop_tx.send_replace(true); true }
            _ = shutting_down.wait_for(|s| *s) => { stop_tx.send_replace(true); false }
        }
    });
    // Only the leader listens, so the dispatcher Service (and any client retrying) reaches it.
    let access: Arc<dyn Access> = match args.authentication {
        Authentication::Kubernetes => {
            Arc::new(Checked::new(KubeReviewer::new(client.clone()), &args.token_audience, Lifetimes::default()))
        }
        Authentication::None => {
            warn!("authentication is off: anyone who reaches the dispatcher or a worker may read any pipeline");
            Arc::new(Open)
        }
    };
    let dispatcher = Dispatcher::guarded(Timeouts::default(), DISPATCHER_WINDOW, access);
    if ctx.tls.is_some() {
        dispatcher.set_worker_tls_names(worker_tls::server_name);
    }
    dispatcher.spawn_expiry();
    if let Err(e) = metrics.registry.register(Box::new(dispatcher.denials().counter())) {
        warn!(error = %e, "could not register the refused-calls counter");
    }
    tokio::spawn(publish_refusals(client.clone(), recorder.clone(), dispatcher.clone(), stop.clone()));
    let listener = tokio::net::TcpListener::bind(args.dispatcher_addr)
        .await
        .with_context(|| format!("listening for the dispatcher on {}", args.dispatcher_addr))?;
    info!(addr = %args.dispatcher_addr, tls = server_tls.is_some(), "dispatcher serving");
    let mut dispatcher_stop = stop.clone();
    tokio::spawn(dispatcher::serve(listener, dispatcher.clone(), server_tls, async move {
        let _ = dispatcher_stop.wait_for(|s| *s).await;
    }));
    let (reconcile_tx, reconcile_rx) = tokio::sync::mpsc::unbounded_channel();
    let scaling = Loop {
        dispatcher: dispatcher.clone(),
        book: book.clone(),
        scaler: DeploymentScaler::new(book.clone(), reconcile_tx.clone()),
        every: autoscaling::ROUND,
        caps: autoscaling::budget::Caps::from_flags(args.worker_budget, args.namespace_worker_cap),
    };
    let store = store_tx.subscribe();
    let after_round =
        autoscaling::after_round(client.clone(), reporter, store.clone(), reconcile_tx, book.clone(), metrics.clone());
    tokio::spawn(scaling.run(move |book: &ScalingBook| autoscaling::in_scope(&store, book), after_round, stop.clone()));
    role_tx.send_replace(Role::Leading);
    if let Some(pod) = leader_pod {
        tokio::spawn(keep_marked(pod, stop.clone()));
    }
    controller::run(ctx, stop, store_tx, reconcile_rx).await;
    role_tx.send_replace(Role::Starting);
    let lost = lost_leadership.await.unwrap_or(false);
    finish(server, elector).await?;
    if lost {
        bail!("lost the leader lease; exiting so this process restarts as a standby");
    }
    info!("stopped");
    Ok(())
}

/// Turns the calls refused in each period into one Warning Event per pipeline and caller, so
/// `kubectl describe dp` shows who tried to read or work for it without the right.
async fn publish_refusals(
    client: Client,
    recorder: Recorder,
    dispatcher: Arc<Dispatcher>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(REFUSALS_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        for tally in dispatcher.denials().take() {
            let api: Api<DataPipeline> = Api::namespaced(client.clone(), &tally.pipeline.namespace);
            // A pipeline that does not exist has nowhere to show it; the log and metric have it.
            let Ok(Some(dp)) = api.get_opt(&tally.pipeline.name).await else { continue };
            let note = format!(
                "{} call(s) by {} refused in the last {}s; last: {}",
                tally.count,
                tally.caller,
                REFUSALS_EVERY.as_secs(),
                tally.last
            );
            // Naming the ServiceAccount keeps each caller's refusals an Event of its own.
            let account = tally.caller.strip_prefix("system:serviceaccount:").and_then(|s| s.split_once(':'));
            let secondary = account.map(|(namespace, name)| ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("ServiceAccount".into()),
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                ..Default::default()
            });
            let (warning, reason) = (EventType::Warning, "AccessRefused");
            stoker_operator::events::publish_about(&recorder, &dp, secondary, warning, reason, "Authorize", &note)
                .await;
        }
    }
}

/// Keeps the leader's pod marked while it leads: until it is, the dispatcher Service has no
/// endpoint. The mark is checked again every few seconds, because a former leader whose
/// `mark` was still in flight when it stepped down clears it (found on real pods: a standby
/// being deleted took the lease for a moment during a restart of every replica, and its mark
/// landed after the new leader's). A request in flight when leadership ends is abandoned.
async fn keep_marked(pod: LeaderPod, mut stop: watch::Receiver<bool>) {
    loop {
        let step = async {
            match pod.is_marked().await {
                Ok(true) => Ok(()),
                Ok(false) => pod.mark().await,
                Err(e) => Err(e),
            }
        };
        let wait = tokio::select! {
            result = step => match result {
                Ok(()) => Duration::from_secs(5),
                Err(e) => {
                    warn!(error = format!("{e:#}"), "could not mark this pod as the leader's; retrying");
                    Duration::from_secs(2)
                }
            },
            _ = stop.wait_for(|s| *s) => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn finish(
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    elector: Option<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<()> {
    if let Some(elector) = elector {
        let _ = elector.await;
    }
    server.abort();
    Ok(())
}

async fn check_crd(client: &Client) -> anyhow::Result<()> {
    let api: Api<DataPipeline> = Api::all(client.clone());
    match api.list(&kube::api::ListParams::default().limit(1)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => bail!(
            "the DataPipeline CRD (datapipelines.stoker.dev) is not installed: install the Helm chart, \
             or `kubectl apply -f crds/`"
        ),
        Err(e) => Err(e).context("listing DataPipelines"),
    }
}

/// This process's name in the Lease: `<name>_<start>`, the name being `--identity` (the pod's)
/// or the host's. The start time tells processes of one pod apart: a process restarted in the
/// pod of a leader that crashed is a new candidate, not that leader renewing its lease (found
/// on real pods, where the kubelet restarts a killed container within a second).
fn lease_identity(name: Option<&str>) -> String {
    let name = name.map(str::to_string).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        if host.is_empty() { "stoker".to_string() } else { host }
    });
    let start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{name}_{:x}", start % (1 << 48))
}
