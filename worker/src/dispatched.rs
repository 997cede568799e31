//! Running under the dispatcher: the worker registers, heartbeats its progress, and for each
//! job with a consumer attached pulls splits one at a time (dynamic sharding). Each batch names
//! the splits whose last element it holds; the client that receives it tells the dispatcher,
//! so a split is done only once its data has arrived (what a dying worker had sent but the
//! client never got is produced again). The worker itself reports only splits that produced
//! no batch at all.
//!
//! The dispatcher may restart or move (leader change): every call retries, and an unknown-id
//! answer makes the worker register again under the same id. Clients see a pause, not an error.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use stoker_api::Batch;
use stoker_api::proto::dispatcher_client::DispatcherClient;
use stoker_api::proto::{self, next_split_response::Next};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::cached::{EngineCache, SplitCache};
use crate::deal::{Deal, JobItem};
use crate::engine::{Assigned, Engine, Ready, Split};
use crate::stream::{BatchSource, Batches, Subscription};

/// The worker's connection to the dispatcher, re-registering when the dispatcher forgot it.
pub struct Link {
    client: DispatcherClient<Channel>,
    registration: proto::RegisterWorkerRequest,
    /// Whose entries' completeness goes into every (re-)registration.
    cache: Option<Arc<EngineCache>>,
    worker_id: Mutex<String>,
    /// Grows each time the dispatcher forgot this worker (it restarted, or took the worker for
    /// dead and handed its splits to others): work pulled before then is stale.
    generation: AtomicU64,
    runtime: tokio::runtime::Handle,
}

/// A NextSplit answer: what to do, with the cache directive and the positions to skip.
type Handed = (Next, SplitCache, Vec<u32>);

/// How long to wait between attempts when the dispatcher is unreachable or not the leader.
const RETRY: Duration = Duration::from_millis(250);

impl Link {
    /// Connects lazily and registers, retrying until the dispatcher answers.
    pub async fn register(url: &str, engine: &Engine, address: String) -> anyhow::Result<Arc<Link>> {
        let channel = Endpoint::from_shared(url.to_string())?.connect_timeout(Duration::from_secs(5)).connect_lazy();
        let pipeline = engine.pipeline();
        let registration = proto::RegisterWorkerRequest {
            pipeline: Some(proto::PipelineRef { namespace: pipeline.namespace.clone(), name: pipeline.name.clone() }),
            address,
            threads: engine.threads() as u32,
            splits: engine.splits().len() as u64,
            plan_digest: plan_digest(engine.splits()),
            worker_id: String::new(),
            cache_hints: Vec::new(),
            cache_mode: format!("{:?}", pipeline.cache_mode),
            shuffle_seed: pipeline.data_plane.shuffle_seed(),
        };
        let link = Arc::new(Link {
            client: DispatcherClient::new(channel),
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
                    tracing::debug!(status = %s, "dispatcher not reachable yet");
                    tokio::time::sleep(RETRY).await;
                }
            }
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn id(&self) -> String {
        self.worker_id.lock().unwrap().clone()
    }

    /// Calls the dispatcher until it answers, registering again when it forgot this worker.
    async fn call<T, F, Fut>(&self, what: &str, mut f: F) -> anyhow::Result<T>
    where
        F: FnMut(DispatcherClient<Channel>, String) -> Fut,
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
                    tracing::debug!(status = %s, "{what}: retrying");
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

    /// The job's next split, what it does with the cache, and the positions to skip.
    fn next_split(&self, job: &str, epoch: u64) -> anyhow::Result<Handed> {
        let response = self.runtime.block_on(self.call("next split", |mut c, worker_id| {
            // Completions go to the client, behind the batches they follow (see `produce`).
            let request = proto::NextSplitRequest { worker_id, job: job.to_string(), completed: Vec::new(), epoch };
            async move { c.next_split(request).await }
        }))?;
        let cache = SplitCache::from_directive(response.cache.as_ref());
        let next = response.next.ok_or_else(|| anyhow::anyhow!("the dispatcher answered NextSplit with nothing"))?;
        let mut skip = response.skip;
        skip.sort_unstable();
        Ok((next, cache, skip))
    }
}

fn progress(engine: &Engine, error: Option<String>) -> proto::WorkerProgress {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = &engine.stats;
    proto::WorkerProgress {
        records: stats.records.load(Relaxed),
        elements: stats.elements.load(Relaxed),
        batches: stats.batches.load(Relaxed),
        batch_bytes: stats.batch_bytes.load(Relaxed),
        skipped: stats.skipped().into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        op_seconds: stats.op_time.lock().unwrap().iter().map(Duration::as_secs_f64).collect(),
        error: error.unwrap_or_default(),
        cache: engine.cache.as_ref().map(|c| c.progress()),
    }
}

/// A stable digest of the planned splits, so workers that listed different data are caught.
pub fn plan_digest(splits: &[Split]) -> String {
    let mut bytes = Vec::new();
    for split in splits {
        bytes.extend_from_slice(&split.id.to_le_bytes());
        for shard in &split.shards {
            bytes.extend_from_slice(shard.path.as_bytes());
            bytes.extend_from_slice(&shard.size.to_le_bytes());
        }
    }
    format!("{:016x}", fnv1a(&bytes))
}

/// FNV-1a: stable across builds and machines, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// One epoch of a job's ready batches for one rank (or for all its consumers), each naming the
/// splits it completes.
type EpochBatches = Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<JobItem>>>;

/// (job, epoch)
type EpochKey = (String, u64);

/// The epochs of each job this worker's producers are busy with: from the first split handed
/// out until a run has ended and the dispatcher has nothing more of the epoch. A producer waits while an earlier epoch of its job is busy, so the
/// next epoch is made with what the current one leaves idle (its last splits held elsewhere)
/// and never takes a core from it.
#[derive(Default)]
struct Busy(Mutex<HashMap<String, BTreeSet<u64>>>);

impl Busy {
    fn set(&self, job: &str, epoch: u64, busy: bool) {
        let mut jobs = self.0.lock().unwrap();
        let epochs = jobs.entry(job.to_string()).or_default();
        if busy {
            epochs.insert(epoch);
        } else {
            epochs.remove(&epoch);
        }
    }

    fn earlier(&self, job: &str, epoch: u64) -> bool {
        self.0.lock().unwrap().get(job).is_some_and(|epochs| epochs.range(..epoch).next().is_some())
    }
}

struct EpochJob {
    /// By rank; one queue when the job's consumers share its batches.
    batches: Vec<EpochBatches>,
    /// The job's ranks, as its first consumer here declared (0: shared).
    consumers: u32,
    /// When the job's next batch may go out, under `--max-batch-rate`: shared by its epochs,
    /// so reading the next epoch ahead does not double the rate.
    next_send: Arc<tokio::sync::Mutex<tokio::time::Instant>>,
}

/// The engine as a batch source under the dispatcher: each epoch of each job has its own
/// producer, started by its first consumer and ended when the dispatcher says the epoch is
/// finished, so a job's next epoch never waits behind this one's stragglers, nor this one
/// behind a consumer that is not reading the next yet.
pub struct DispatchedSource {
    engine: Arc<Engine>,
    link: Arc<Link>,
    /// Least time between two batches of a job, from `--max-batch-rate`.
    min_interval: Option<Duration>,
    epochs: Arc<Mutex<HashMap<EpochKey, Arc<EpochJob>>>>,
    busy: Arc<Busy>,
    /// Per job: when its next batch may go out.
    next_sends: Mutex<HashMap<String, Arc<tokio::sync::Mutex<tokio::time::Instant>>>>,
    /// The first fatal engine error, for heartbeats (and so the DataPipeline status).
    pub errors: Arc<Mutex<Option<String>>>,
}

impl DispatchedSource {
    /// `max_batch_rate` caps the batches per second this worker sends per job and epoch.
    pub fn new(engine: Arc<Engine>, link: Arc<Link>, max_batch_rate: Option<f64>) -> Self {
        let min_interval = max_batch_rate.filter(|r| *r > 0.0).map(|r| Duration::from_secs_f64(1.0 / r));
        DispatchedSource {
            engine,
            link,
            min_interval,
            epochs: Arc::default(),
            next_sends: Mutex::default(),
            busy: Arc::default(),
            errors: Arc::new(Mutex::new(None)),
        }
    }

    fn epoch(&self, key: EpochKey, consumers: u32) -> Arc<EpochJob> {
        let next_send = self
            .next_sends
            .lock()
            .unwrap()
            .entry(key.0.clone())
            .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(tokio::time::Instant::now())))
            .clone();
        let mut epochs = self.epochs.lock().unwrap();
        epochs
            .entry(key.clone())
            .or_insert_with(|| {
                // Workers begin dealing at different ranks, and each epoch at another one.
                let first = fnv1a(self.link.registration.address.as_bytes()).wrapping_add(key.1);
                let (mut deal, hands) = Deal::new(consumers, 1, first);
                let batches = hands.into_iter().map(|rx| Arc::new(tokio::sync::Mutex::new(rx))).collect();
                let epoch_job = Arc::new(EpochJob { batches, consumers, next_send });
                let (engine, link, errors, epochs, busy) = (
                    self.engine.clone(),
                    self.link.clone(),
                    self.errors.clone(),
                    self.epochs.clone(),
                    self.busy.clone(),
                );
                // Busy until its first answer: a later epoch's producer started at the same
                // moment must not take the splits first.
                busy.set(&key.0, key.1, true);
                std::thread::Builder::new()
                    .name(format!("stoker-job-{}-{}", key.0, key.1))
                    .spawn(move || {
                        let (job, epoch) = (&key.0, key.1);
                        let result = produce(&engine, &link, &busy, job, epoch, &mut deal);
                        busy.set(job, epoch, false);
                        if let Err(e) = result {
                            let message = format!("{e:#}");
                            tracing::error!(%job, epoch, error = %message, "the job's producer stopped");
                            errors.lock().unwrap().get_or_insert(message.clone());
                            deal.fail(Status::failed_precondition(format!("the pipeline failed: {message}")));
                        }
                        // Consumers arriving later start a producer that learns the epoch is over.
                        epochs.lock().unwrap().remove(&key);
                    })
                    .expect("spawning an epoch producer");
                epoch_job
            })
            .clone()
    }
}

impl BatchSource for DispatchedSource {
    fn subscribe(&self, subscription: &Subscription) -> Result<Batches, Status> {
        let Some(epoch) = subscription.epoch else {
            return Err(Status::invalid_argument(
                "under the dispatcher a stream is of one epoch: set StreamRequest.epoch",
            ));
        };
        tracing::info!(job = %subscription.job, epoch, consumer = subscription.consumer_index, "consumer attached");
        let epoch_job = self.epoch((subscription.job.clone(), epoch), subscription.consumers);
        if epoch_job.consumers.max(1) != subscription.consumers.max(1) {
            return Err(Status::invalid_argument(format!(
                "job {} is read by {} consumer(s) on this worker, but this stream declares {}: every consumer of a job must declare the same number",
                subscription.job, epoch_job.consumers, subscription.consumers
            )));
        }
        let rank = if subscription.consumers > 1 { subscription.consumer_index as usize } else { 0 };
        let min_interval = self.min_interval;
        Ok(futures::stream::unfold(epoch_job, move |epoch_job| async move {
            // None once the producer is done with the epoch: the stream ends.
            let next = epoch_job.batches[rank].lock().await.recv().await?;
            // Rate-limited once a batch is in hand, so a stream waiting for its epoch's batches
            // takes no turns from the job's other epoch.
            if let Some(interval) = min_interval {
                let mut next_send = epoch_job.next_send.lock().await;
                tokio::time::sleep_until(*next_send).await;
                *next_send = tokio::time::Instant::now().max(*next_send) + interval;
            }
            // The batch names the splits it completes; the client that receives it reports them.
            Some((next, epoch_job))
        })
        .boxed())
    }
}

/// Pulls one epoch's splits of a job and runs them through the engine until the dispatcher
/// says the epoch is finished. Each stretch of splits handed out without a pause is one engine
/// run (one shuffle buffer); a pause (the epoch's last splits are held by other workers) ends
/// the run, so no split's rows wait in the buffer while the epoch waits for its completion.
fn produce(engine: &Engine, link: &Link, busy: &Busy, job: &str, epoch: u64, out: &mut Deal) -> anyhow::Result<()> {
    let split = |id: u64| {
        engine
            .splits()
            .get(id as usize)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("the dispatcher handed out split {id}, beyond this worker's plan"))
    };
    // Asks for the next split once no earlier epoch of the job keeps this worker busy.
    let ask = || -> anyhow::Result<Handed> {
        while busy.earlier(job, epoch) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let next = link.next_split(job, epoch)?;
        if matches!(next.0, Next::Split(_)) {
            busy.set(job, epoch, true);
        }
        Ok(next)
    };
    let mut next = ask()?;
    loop {
        let first = match next {
            (Next::Finished(_), _, _) => return Ok(()),
            (Next::Draining(d), _, _) => {
                // Idle until the epoch's last splits are done elsewhere: the next epoch may
                // use this worker meanwhile (busy again when a dead worker's split comes back).
                busy.set(job, epoch, false);
                std::thread::sleep(Duration::from_millis(u64::from(d.retry_ms)));
                if out.is_closed() {
                    return Ok(());
                }
                next = ask()?;
                continue;
            }
            (Next::Split(s), cache, skip) => {
                anyhow::ensure!(s.epoch == epoch, "asked for a split of epoch {epoch}, got one of {}", s.epoch);
                Assigned { split: split(s.split)?, cache, skip }
            }
        };
        // The epoch's splits, pulled as the engine asks, until a pause or the epoch's end; the
        // dispatcher forgetting this worker ends the run too: what it handed out before went
        // to others, so the run's batches are stale and must not join fresh splits' in a batch.
        let generation = link.generation();
        let stale = || link.generation() != generation;
        let mut after: Option<Handed> = None;
        let mut failed: Option<anyhow::Error> = None;
        let pulled = std::iter::once(first).chain(std::iter::from_fn(|| {
            // While an earlier epoch keeps this worker busy (at the start, or when a dead
            // worker's split of it came back), `ask` waits: the run pauses, its rows held, and
            // goes on afterwards without a partial batch.
            if after.is_some() || failed.is_some() || stale() {
                return None;
            }
            match ask().and_then(|n| match n {
                (Next::Split(s), cache, skip) if !stale() => {
                    split(s.split).map(|split| Some(Assigned { split, cache, skip }))
                }
                other => {
                    after = Some(other);
                    Ok(None)
                }
            }) {
                Ok(s) => s,
                Err(e) => {
                    failed = Some(e);
                    None
                }
            }
        }));
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Ready>(1);
        let leftover = std::thread::scope(|scope| {
            scope.spawn(|| {
                for ready in ready_rx {
                    if stale() {
                        continue; // dropped: another worker produces these splits now
                    }
                    let mut batch = ready.batch;
                    batch.completes = ready.completes;
                    if out.send(batch).is_err() {
                        break;
                    }
                }
            });
            let result = engine.run_splits(epoch, pulled, &ready_tx);
            drop(ready_tx);
            result
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        // Splits that completed with no batch to carry them (all filtered, or their tail dropped
        // as the remainder) go to the client in a batch without tensors, behind the batches
        // holding their elements: reported by the worker, they could be done while one of
        // those batches was still on its way, and lost with it if the worker died.
        if !leftover.is_empty() && !stale() && out.send(Batch::completions(epoch, leftover)).is_err() {
            return Ok(());
        }
        if out.is_closed() {
            return Ok(());
        }
        next = match after {
            Some(n) => n,
            None => ask()?,
        };
    }
}
