//! Local mode: the dispatcher, the autoscaler and `stoker-worker` processes on one machine, no
//! Kubernetes. `stoker local` and `stoker demo` run it; so do the real-process tests.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use stoker_api::{AutoscalingMode, DataPipelineSpec, WorkerPipeline};
use tokio::sync::watch;

use stoker_operator::autoscaling::replicas::initial_replicas;
use stoker_operator::autoscaling::{self, Loop, Rescale, Scaled, Scaler, ScalingBook, ScalingRecord};
use stoker_operator::controller::objects::worker_tls;
use stoker_operator::dispatcher::{self, Dispatcher, Timeouts};
use stoker_operator::key::PipelineKey;

use crate::workers::{LocalWorkerConfig, LocalWorkers};

pub struct LocalOptions {
    pub namespace: String,
    pub name: String,
    pub spec: DataPipelineSpec,
    /// Where the dispatcher listens (port 0: any free port).
    pub listen: SocketAddr,
    /// Worker processes' settings; `dispatcher_url` is filled in.
    pub workers: LocalWorkerConfig,
    /// Overrides the spec's autoscaling window, in whole seconds (short windows make demos and
    /// tests quick).
    pub window: Option<Duration>,
    /// Cap on worker processes (None: the spec's max).
    pub budget: Option<u32>,
    /// Serve TLS (dispatcher and workers) with a CA made now, its files written here.
    pub tls_dir: Option<PathBuf>,
}

/// The terminal view's header; `view_line` fills it.
pub const VIEW_HEADER: &str = " time  workers      batch   wait      rate/s  decision";

pub struct Local {
    pub key: PipelineKey,
    pub url: String,
    /// With TLS: the CA clients must trust.
    pub ca_file: Option<PathBuf>,
    pub dispatcher: Arc<Dispatcher>,
    pub workers: Arc<LocalWorkers>,
    pub book: Arc<ScalingBook>,
    /// Every rescale so far, in order.
    pub rescales: watch::Receiver<Vec<Rescale>>,
    /// Autoscaling mode Fixed: no scaling loop, so no client windows are judged.
    fixed: bool,
    stop: watch::Sender<bool>,
}

/// Local workers as a shared scaler.
struct Shared(Arc<LocalWorkers>);

impl Scaler for Shared {
    async fn scale(&self, pipeline: &PipelineKey, workers: u32) -> anyhow::Result<()> {
        self.0.scale(pipeline, workers).await
    }
}

impl Local {
    /// Starts the dispatcher, the pipeline's first workers and the scaling loop.
    pub async fn start(mut options: LocalOptions) -> anyhow::Result<Local> {
        stoker_api::validate(&options.spec)
            .map_err(|errors| anyhow::anyhow!("the pipeline is invalid: {}", stoker_api::invalid_message(&errors)))?;
        if let Some(w) = options.window {
            options.spec.autoscaling.policy.window_seconds = w.as_secs().max(1) as u32;
        }
        let spec = &options.spec;
        let window = Duration::from_secs(u64::from(spec.autoscaling.policy.window_seconds));
        // Clients report every second; a pipeline is judged on all reports of its window.
        let dispatcher = Dispatcher::new(
            Timeouts { worker: Duration::from_secs(5), client: window * 3 + Duration::from_secs(5) },
            Duration::from_secs(1),
        );
        dispatcher.spawn_expiry();
        let key = PipelineKey::new(&options.namespace, &options.name);
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .with_context(|| format!("listening on {}", options.listen))?;
        let bound = listener.local_addr()?;
        let tls = match &options.tls_dir {
            Some(dir) => Some(crate::tls::generate(dir, bound.ip(), &key)?),
            None => None,
        };
        // As in a cluster: the worker lists name the certificate's name for clients to verify.
        if tls.is_some() {
            dispatcher.set_worker_tls_names(worker_tls::server_name);
        }
        let url = format!("{}://{bound}", if tls.is_some() { "https" } else { "http" });
        let (stop, stopped) = watch::channel(false);
        {
            let mut stopped = stopped.clone();
            let server_tls = tls.as_ref().map(|t| t.dispatcher.clone());
            let serving = dispatcher::serve(listener, dispatcher.clone(), server_tls, async move {
                let _ = stopped.wait_for(|s| *s).await;
            });
            tokio::spawn(async move {
                if let Err(e) = serving.await {
                    tracing::error!(error = %e, "the dispatcher stopped serving");
                }
            });
        }

        options.workers.dispatcher_url = url.clone();
        options.workers.tls = tls.as_ref().map(|t| t.workers.clone());
        let workers = Arc::new(LocalWorkers::new(options.workers.clone()));
        // The directory stands in for a volume of `spec.cache.volumeSize`.
        workers.add(WorkerPipeline::new(&options.namespace, &options.name, spec), spec.cache.cap_bytes());
        let (min, max) = (spec.workers.min.max(1) as u32, spec.workers.max.max(1) as u32);
        // One worker at least: without a cluster there is nothing to wait for.
        let start = initial_replicas(spec).max(1) as u32;
        workers.scale(&key, start).await?;
        let book = Arc::new(ScalingBook::default());
        let fixed = spec.autoscaling.mode == AutoscalingMode::Fixed;
        book.update(&key, |r| r.workers = start);

        let (rescales_tx, rescales) = watch::channel(Vec::new());
        if spec.autoscaling.mode == AutoscalingMode::BatchTime {
            let scaling = Loop {
                dispatcher: dispatcher.clone(),
                book: book.clone(),
                scaler: Shared(workers.clone()),
                every: autoscaling::ROUND,
                caps: stoker_operator::autoscaling::budget::Caps { cluster: options.budget, namespace: None },
            };
            let (policy, scope_key) = (spec.autoscaling.policy.clone(), key.clone());
            let pipelines = move |book: &ScalingBook| {
                let workers = book.get(&scope_key).map_or(min, |r: ScalingRecord| r.workers);
                vec![Scaled { key: scope_key.clone(), min, max, policy: policy.clone(), workers }]
            };
            let record = move |round: &[Rescale], _changed: bool| {
                if !round.is_empty() {
                    rescales_tx.send_modify(|all| all.extend_from_slice(round));
                }
            };
            tokio::spawn(scaling.run(pipelines, record, stopped));
        }
        let ca_file = tls.map(|t| t.ca_file);
        Ok(Local { key, url, ca_file, dispatcher, workers, book, rescales, fixed, stop })
    }

    /// The pipeline's record: workers, batch time, policy state, history.
    pub fn record(&self) -> ScalingRecord {
        self.book.get(&self.key).unwrap_or_default()
    }

    /// What the autoscaler is doing, in words (Fixed mode has none).
    pub fn state(&self, record: &ScalingRecord) -> String {
        match (self.fixed, record.state) {
            (true, _) => "autoscaling mode Fixed".into(),
            (false, state) => state.map(|s| s.name().to_string()).unwrap_or_default(),
        }
    }

    /// One line of the terminal view. `seen` counts the rescales already shown; the newest
    /// unseen one is the decision shown (else the policy's state). Returns the line and
    /// whether it shows a rescale.
    pub fn view_line(&self, elapsed: Duration, rate: f64, seen: &mut usize) -> (String, bool) {
        let record = self.record();
        let rescales = self.rescales.borrow().clone();
        let newest = rescales.get(*seen..).and_then(|r| r.last());
        *seen = rescales.len();
        let decision = match newest {
            Some(r) => format!("{} -> {}: {}", r.from, r.to, r.reason),
            None if record.attached || self.fixed => self.state(&record),
            None => "no client attached".into(),
        };
        // Batch times come from the autoscaler's measuring; Fixed mode has none to show.
        let (batch_time, waited) = match (record.batch_time_ms, record.wait_fraction) {
            (Some(ms), wait) => (format!("{ms:>6.1} ms"), format!("{:>4.0}%", wait.unwrap_or(0.0) * 100.0)),
            (None, _) => (format!("{:>9}", "-"), format!("{:>5}", "-")),
        };
        let line = format!(
            "{:>4}s  {:>7}  {batch_time}  {waited}  {:>10.0}  {decision}",
            elapsed.as_secs(),
            self.workers.running(&self.key),
            rate,
        );
        (line, newest.is_some())
    }

    /// The cache plan: decision, hint, predicted and measured epoch times.
    pub fn cache(&self) -> Option<stoker_api::CacheStatus> {
        self.dispatcher.with_state(|s| s.cache_status(&self.key))
    }

    /// What the workers report for the status: what they changed of the spec to stay within
    /// their bounds, and the mix's realised shares.
    pub fn report(&self) -> stoker_api::WorkersReport {
        self.dispatcher.with_state(|s| s.reports()).remove(&self.key).unwrap_or_default()
    }

    /// Elements produced so far by the live workers.
    pub fn elements(&self) -> u64 {
        self.dispatcher.with_state(|s| s.worker_progress(&self.key)).iter().map(|(_, _, p)| p.elements).sum()
    }

    /// Stops scaling and the dispatcher, and terminates the workers.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        self.workers.stop_all().await;
    }
}
