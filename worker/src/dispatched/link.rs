//! The worker's connection to the dispatcher: registering (again, under the same id, when the
//! dispatcher forgot it), heartbeats, asking for splits and returning the ones a stopped
//! producer held. Every call retries while the dispatcher is unreachable or not the leader.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use stoker_api::JobName;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, next_split_response::Next};
use stoker_api::token::TokenSource;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use crate::cached::{EngineCache, SplitCache};
use crate::engine::{Engine, Mix, Shared};

/// A dispatcher client that sends the worker's token with every call.
pub(crate) type DispatcherRpc = DispatcherClient<InterceptedService<Channel, TokenSource>>;

/// The worker's connection to the dispatcher, re-registering when the dispatcher forgot it.
pub struct Link {
    client: DispatcherRpc,
    pub(super) registration: proto::RegisterWorkerRequest,
    /// Whose entries' completeness goes into every (re-)registration.
    cache: Option<Arc<EngineCache>>,
    worker_id: Mutex<String>,
    /// Grows each time the dispatcher forgot this worker (it restarted, or took the worker for
    /// dead and handed its splits to others): work pulled before then is stale.
    generation: AtomicU64,
    runtime: tokio::runtime::Handle,
}

/// A NextSplit answer: what to do, and for a split how (its cache directive, the positions to
/// skip, its echo factor), with the dispatcher's incarnation (for the batches made of it).
pub(super) struct Handed {
    pub(super) next: Next,
    pub(super) cache: SplitCache,
    pub(super) skip: Vec<u32>,
    /// None: the pipeline's own (`Echo::initial`).
    pub(super) echo: Option<u32>,
    /// A share group's production the split is part of.
    pub(super) shared: Option<Shared>,
    pub(super) incarnation: u64,
}

/// How long to wait between attempts when the dispatcher is unreachable or not the leader.
const RETRY: Duration = Duration::from_millis(250);

impl Link {
    /// Connects lazily and registers, retrying until the dispatcher answers; every call
    /// carries `token`. With `tls` the dispatcher must present a certificate for the URL's host
    /// from a CA of the bundle.
    pub async fn register(
        url: &str,
        engine: &Engine,
        address: String,
        token: TokenSource,
        tls: Option<ClientTlsConfig>,
    ) -> anyhow::Result<Arc<Link>> {
        let mut endpoint = Endpoint::from_shared(url.to_string())?.connect_timeout(Duration::from_secs(5));
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).with_context(|| format!("TLS settings for the dispatcher {url}"))?;
        }
        let channel = endpoint.connect_lazy();
        let pipeline = engine.pipeline();
        let registration = proto::RegisterWorkerRequest {
            pipeline: Some(proto::PipelineRef { namespace: pipeline.namespace.clone(), name: pipeline.name.clone() }),
            address,
            threads: engine.threads() as u32,
            splits: engine.mix().slots(),
            plan_digest: plan_digest(engine.mix()),
            worker_id: String::new(),
            cache_hints: Vec::new(),
            cache_mode: proto::CacheMode::from(pipeline.cache_mode).into(),
            shuffle_seed: pipeline.data_plane.shuffle_seed(),
        };
        let link = Arc::new(Link {
            client: DispatcherClient::with_interceptor(channel, token),
            registration,
            cache: engine.cache.clone(),
            worker_id: Mutex::new(String::new()),
            generation: AtomicU64::new(0),
            runtime: tokio::runtime::Handle::current(),
        });
        link.reregister().await?;
        Ok(link)
    }

    async fn reregister(&self) -> anyhow::Result<()> {
        let mut request = self.registration.clone();
        request.worker_id = self.worker_id.lock().unwrap().clone();
        request.cache_hints = self.cache.as_ref().map(|c| c.seen()).unwrap_or_default();
        loop {
            match self.client.clone().register_worker(request.clone()).await {
                Ok(response) => {
                    let id = response.into_inner().worker_id;
                    tracing::info!(worker = %id, address = %request.address, "registered with the dispatcher");
                    *self.worker_id.lock().unwrap() = id;
                    return Ok(());
                }
                // A different listing or a bad request will not fix itself.
                Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::InvalidArgument) => {
                    anyhow::bail!("the dispatcher refused this worker: {}", s.message())
                }
                Err(s) => {
                    log_retry("registering", &s);
                    tokio::time::sleep(RETRY).await;
                }
            }
        }
    }

    /// The dispatcher client, for asking it about readers.
    pub fn client(&self) -> DispatcherRpc {
        self.client.clone()
    }

    /// How often this worker registered (again) with the dispatcher.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The id the dispatcher gave this worker (it stays the same across dispatcher restarts).
    pub(super) fn id(&self) -> String {
        self.worker_id.lock().unwrap().clone()
    }

    /// Calls the dispatcher until it answers, registering again when it forgot this worker.
    async fn call<T, F, Fut>(&self, what: &str, mut f: F) -> anyhow::Result<T>
    where
        F: FnMut(DispatcherRpc, String) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        loop {
            match f(self.client.clone(), self.id()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(s) if s.code() == Code::NotFound => {
                    self.generation.fetch_add(1, Ordering::SeqCst);
                    self.reregister().await?
                }
                Err(s) if s.code() == Code::InvalidArgument => anyhow::bail!("{what}: {}", s.message()),
                Err(s) => {
                    log_retry(what, &s);
                    tokio::time::sleep(RETRY).await;
                }
            }
        }
    }

    /// Sends the engine's counters every `interval` until the process ends.
    pub fn spawn_heartbeats(
        self: &Arc<Self>,
        engine: Arc<Engine>,
        errors: Arc<Mutex<Option<String>>>,
        interval: Duration,
    ) {
        let link = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let progress = progress(&engine, errors.lock().unwrap().clone());
                let result = link
                    .call("heartbeat", |mut c, worker_id| {
                        let progress = progress.clone();
                        async move {
                            c.worker_heartbeat(proto::WorkerHeartbeatRequest { worker_id, progress: Some(progress) })
                                .await
                        }
                    })
                    .await;
                if let Err(e) = result {
                    tracing::error!(error = %e, "heartbeat failed");
                }
            }
        });
    }

    /// The job's next split and how to produce it.
    pub(super) fn next_split(&self, job: &JobName, epoch: u64) -> anyhow::Result<Handed> {
        let response = self.runtime.block_on(self.call("next split", |mut c, worker_id| {
            // Completions go to the client, behind the batches they follow (see `produce`).
            let request = proto::NextSplitRequest { worker_id, job: job.to_string(), completed: Vec::new(), epoch };
            async move { c.next_split(request).await }
        }))?;
        let cache = SplitCache::from_directive(response.cache.as_ref());
        let next = response.next.ok_or_else(|| anyhow::anyhow!("the dispatcher answered NextSplit with nothing"))?;
        let mut skip = response.skip;
        skip.sort_unstable();
        let echo = (response.echo_factor > 0).then_some(response.echo_factor);
        let shared = response.production.map(|p| Shared { key: (response.incarnation, p.id), takers: p.takers });
        Ok(Handed { next, cache, skip, echo, shared, incarnation: response.incarnation })
    }

    /// Splits of `epoch` of `job` this worker took and will not deliver (nobody reads them).
    pub(super) fn return_splits(&self, job: &JobName, epoch: u64, splits: Vec<u64>) -> anyhow::Result<()> {
        self.runtime.block_on(self.call("return splits", |mut c, worker_id| {
            let request = proto::ReturnSplitsRequest { worker_id, job: job.to_string(), epoch, splits: splits.clone() };
            async move { c.return_splits(request).await }
        }))?;
        Ok(())
    }
}

/// A refused token is a deployment mistake the user must see (it will not fix itself until
/// someone changes RBAC or the pod's ServiceAccount); an unreachable dispatcher is routine.
fn log_retry(what: &str, s: &Status) {
    if let Some(tls) = stoker_api::tls::tls_failure(s) {
        // A certificate that does not verify is a deployment mistake too.
        tracing::warn!(problem = %tls, "{what}: TLS with the dispatcher failed; retrying");
    } else if matches!(s.code(), Code::Unauthenticated | Code::PermissionDenied) {
        tracing::warn!(status = %s, "{what}: the dispatcher refused this worker; retrying");
    } else {
        tracing::debug!(status = %s, "{what}: retrying");
    }
}

fn progress(engine: &Engine, error: Option<String>) -> proto::WorkerProgress {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &engine.stats;
    let ops = stats.ops.lock().unwrap().clone();
    proto::WorkerProgress {
        records: stats.records.load(Relaxed),
        elements: stats.elements.load(Relaxed),
        batches: stats.batches.load(Relaxed),
        batch_bytes: stats.batch_bytes.load(Relaxed),
        skipped: stats.skipped().into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        op_seconds: ops.iter().map(|t| t.time.as_secs_f64()).collect(),
        op_elements_in: ops.iter().map(|t| t.elements_in).collect(),
        op_elements_out: ops.iter().map(|t| t.elements_out).collect(),
        error: error.unwrap_or_default(),
        cache: engine.cache.as_ref().map(|c| c.progress()),
        warnings: stats.warnings(),
        source_elements: stats.source_rows.lock().unwrap().clone(),
        sharing: Some(engine.shared.progress()),
    }
}

/// A stable digest of the planned splits, so workers that listed different data are caught.
pub fn plan_digest(mix: &Mix) -> String {
    let mut bytes = Vec::new();
    for quota in mix.quotas() {
        bytes.extend_from_slice(&quota.to_le_bytes());
    }
    for split in mix.planned() {
        bytes.extend_from_slice(&split.id.to_le_bytes());
        bytes.extend_from_slice(&(split.source as u64).to_le_bytes());
        for shard in &split.shards {
            bytes.extend_from_slice(shard.path.as_bytes());
            bytes.extend_from_slice(&shard.size.to_le_bytes());
        }
        for groups in &split.row_groups {
            for n in [groups.range.start, groups.range.end] {
                bytes.extend_from_slice(&(n as u64).to_le_bytes());
            }
        }
    }
    format!("{:016x}", fnv1a(&bytes))
}

/// FNV-1a: stable across builds and machines, unlike std's hasher.
pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}
