//! Local mode: the dispatcher, the autoscaler and `stoker-worker` processes on one machine, no
//! Kubernetes. `stoker local` and `stoker demo` run it with one pipeline; the tenants'
//! benchmark adds more ([`Local::add`]), which share one scaling loop and its budget as a
//! cluster's pipelines share the operator's. The real-process tests run it too.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use stoker_api::{AutoscalingMode, AutoscalingPolicy, DataPipelineSpec, WorkerPipeline};
use tokio::sync::watch;

use stoker_operator::autoscaling::budget::Caps;
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
    /// Cap on all pipelines' worker processes together (None: each pipeline's max).
    pub budget: Option<u32>,
    /// Serve TLS (dispatcher and workers) with a CA made now, its files written here.
    pub tls_dir: Option<PathBuf>,
}

/// The terminal view's header; `view_line` fills it.
pub const VIEW_HEADER: &str = " time  workers      batch   wait      rate/s  decision";

pub struct Local {
    /// The pipeline local mode was started with: the one its views show.
    pub key: PipelineKey,
    pub url: String,
    /// With TLS: the CA clients must trust.
    pub ca_file: Option<PathBuf>,
    pub dispatcher: Arc<Dispatcher>,
    pub workers: Arc<LocalWorkers>,
    pub book: Arc<ScalingBook>,
    /// Every rescale so far, of every pipeline, in order.
    pub rescales: watch::Receiver<Vec<Rescale>>,
    /// The pipelines the scaling loop scales (autoscaling mode BatchTime): one scaling loop and
    /// one budget for all, as the operator has for a cluster's.
    scope: Arc<Mutex<Vec<Scoped>>>,
    /// What the scaling loop needs, until the first pipeline that autoscales starts it. Not
    /// before: the loop takes the clients' windows, which a benchmark's outside controllers
    /// read when every pipeline is Fixed.
    unstarted: Mutex<Option<Unstarted>>,
    /// Overrides every pipeline's autoscaling window.
    window: Option<Duration>,
    stop: watch::Sender<bool>,
}

/// A pipeline in the scaling loop's scope: its bounds and policy.
struct Scoped {
    key: PipelineKey,
    min: u32,
    max: u32,
    policy: AutoscalingPolicy,
    echo: Option<u32>,
}

struct Unstarted {
    caps: Caps,
    rescales: watch::Sender<Vec<Rescale>>,
    stopped: watch::Receiver<bool>,
}

/// Local workers as a shared scaler.
struct Shared(Arc<LocalWorkers>);

impl Scaler for Shared {
    async fn scale(&self, pipeline: &PipelineKey, workers: u32) -> anyhow::Result<()> {
        self.0.scale(pipeline, workers).await
    }
}

impl Local {
    /// Starts the dispatcher, the scaling loop, and the pipeline's first workers.
    pub async fn start(mut options: LocalOptions) -> anyhow::Result<Local> {
        let spec = &options.spec;
        let window = options.window.unwrap_or(Duration::from_secs(u64::from(spec.autoscaling.policy.window_seconds)));
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
        let book = Arc::new(ScalingBook::default());
        let (rescales_tx, rescales) = watch::channel(Vec::new());
        let caps = Caps { cluster: options.budget, namespace: None };
        let ca_file = tls.map(|t| t.ca_file);
        let local = Local {
            key: key.clone(),
            url,
            ca_file,
            dispatcher,
            workers,
            book,
            rescales,
            scope: Arc::default(),
            unstarted: Mutex::new(Some(Unstarted { caps, rescales: rescales_tx, stopped })),
            window: options.window,
            stop,
        };
        if let Err(e) = local.add(&options.namespace, &options.name, options.spec, None).await {
            local.shutdown().await;
            return Err(e);
        }
        Ok(local)
    }

    /// Adds a pipeline beside the others: its first workers, and with autoscaling mode
    /// BatchTime a place in the scaling loop and its budget. `max_batch_rate` caps its
    /// workers' batches per second instead of the workers' config.
    pub async fn add(
        &self,
        namespace: &str,
        name: &str,
        mut spec: DataPipelineSpec,
        max_batch_rate: Option<f64>,
    ) -> anyhow::Result<PipelineKey> {
        stoker_api::validate(&spec)
            .map_err(|errors| anyhow::anyhow!("the pipeline is invalid: {}", stoker_api::invalid_message(&errors)))?;
        if let Some(w) = self.window {
            spec.autoscaling.policy.window_seconds = w.as_secs().max(1) as u32;
        }
        let key = PipelineKey::new(namespace, name);
        // The directory stands in for a volume of `spec.cache.volumeSize`.
        self.workers.add(WorkerPipeline::new(namespace, name, &spec), spec.cache.cap_bytes(), max_batch_rate);
        let (min, max) = (spec.workers.min.max(1) as u32, spec.workers.max.max(1) as u32);
        // One worker at least: without a cluster there is nothing to wait for.
        let start = initial_replicas(&spec).max(1) as u32;
        self.workers.scale(&key, start).await?;
        self.book.update(&key, |r| r.workers = start);
        if spec.autoscaling.mode == AutoscalingMode::BatchTime {
            let (policy, echo) = (spec.autoscaling.policy, spec.data_plane.automatic_echo());
            self.scope.lock().unwrap().push(Scoped { key: key.clone(), min, max, policy, echo });
            self.start_scaling();
        }
        Ok(key)
    }

    /// Starts the scaling loop over the pipelines in scope, once.
    fn start_scaling(&self) {
        let Some(Unstarted { caps, rescales, stopped }) = self.unstarted.lock().unwrap().take() else { return };
        let scaling = Loop {
            dispatcher: self.dispatcher.clone(),
            book: self.book.clone(),
            scaler: Shared(self.workers.clone()),
            every: autoscaling::ROUND,
            caps,
        };
        let scope = self.scope.clone();
        let pipelines = move |book: &ScalingBook| {
            let scaled = |s: &Scoped| Scaled {
                key: s.key.clone(),
                min: s.min,
                max: s.max,
                policy: s.policy.clone(),
                workers: book.get(&s.key).map_or(s.min, |r: ScalingRecord| r.workers),
                echo: s.echo,
            };
            scope.lock().unwrap().iter().map(scaled).collect()
        };
        let record = move |round: &[Rescale], _changed: bool| {
            if !round.is_empty() {
                rescales.send_modify(|all| all.extend_from_slice(round));
            }
        };
        tokio::spawn(scaling.run(pipelines, record, stopped));
    }

    /// Takes a pipeline out, as deleting it would: out of the scaling loop's scope (its share
    /// of the budget goes to the others) and its workers stopped.
    pub async fn remove(&self, key: &PipelineKey) -> anyhow::Result<()> {
        self.scope.lock().unwrap().retain(|s| &s.key != key);
        self.workers.scale(key, 0).await
    }

    /// A new `workers.max` for a pipeline the scaling loop scales, as editing the spec would
    /// (at least its `workers.min`): the next round scales within it.
    pub fn set_max(&self, key: &PipelineKey, max: u32) {
        for scoped in self.scope.lock().unwrap().iter_mut().filter(|s| &s.key == key) {
            scoped.max = max.max(scoped.min);
        }
    }

    /// Autoscaling mode Fixed: no scaling loop, so no client windows are judged.
    fn fixed(&self) -> bool {
        !self.scope.lock().unwrap().iter().any(|s| s.key == self.key)
    }

    /// The pipeline's record: workers, batch time, policy state, history.
    pub fn record(&self) -> ScalingRecord {
        self.book.get(&self.key).unwrap_or_default()
    }

    /// What the autoscaler is doing, in words (Fixed mode has none).
    pub fn state(&self, record: &ScalingRecord) -> String {
        match (self.fixed(), record.state) {
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
            None if record.attached || self.fixed() => self.state(&record),
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
