//! The dispatcher's gRPC face: admits each call (`access`), maps requests onto
//! `DispatcherState`, publishes worker lists to watching clients, and expires silent workers
//! and clients on a timer.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use stoker_api::proto::dispatcher_server::{self, DispatcherServer};
use stoker_api::proto::{self, next_split_response::Next};
use tokio::sync::watch;
use tonic::{Code, Request, Response, Status};

use stoker_api::window::Window;
use stoker_api::{ClientId, JobName, WorkerId};

use super::cache::{CacheProgress, HintSeen};
use super::ledger::Assignment;
use super::ledger::Held;
use super::members::{Progress, Timeouts};
use super::ranks::Received;
use super::registration::{Acknowledgement, ClientRegistration, DispatchError, Rejoin, Resume, WorkerRegistration};
use super::state::{DispatcherState, Listing};
use crate::access::{Access, Denials, Identity, Need, Open, Refusal};
use crate::autocache::plan::Directive;
use crate::key::PipelineKey;

/// How often workers heartbeat; the dead-worker timeout is several of these.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a worker may rely on a reader's admission before asking again, in ms; an open
/// stream is not cut when it ends.
const READER_VERDICT: u32 = 30_000;
/// How long a worker may rely on a reader's refusal, in ms: short, so a RoleBinding made after
/// a refusal takes effect soon.
const READER_REFUSAL: u32 = 5_000;
/// How long a worker waits before asking again while an epoch drains.
const DRAINING_RETRY: Duration = Duration::from_millis(50);

/// The dispatcher shared by the gRPC service, the autoscaler loop and status reporting.
pub struct Dispatcher {
    state: Mutex<DispatcherState>,
    listings: Mutex<HashMap<PipelineKey, watch::Sender<Listing>>>,
    /// Whether this process may answer (the leader); others answer UNAVAILABLE so callers retry.
    serving: AtomicBool,
    window: Duration,
    /// Who may call; `Open` in `stoker local`.
    access: Arc<dyn Access>,
    denials: Denials,
    /// Set when workers serve TLS: the name a pipeline's worker certificates are for, which
    /// worker lists tell clients. The operator's naming rule, kept in one place, so clients
    /// (Rust and Python) need not know it.
    worker_tls_names: OnceLock<WorkerTlsNames>,
}

/// The name a pipeline's workers' certificates are for.
pub type WorkerTlsNames = fn(&PipelineKey) -> String;

impl Dispatcher {
    /// A dispatcher that lets every caller in (`stoker local`, tests).
    pub fn new(timeouts: Timeouts, window: Duration) -> Arc<Self> {
        Self::guarded(timeouts, window, Arc::new(Open))
    }

    /// A dispatcher that admits each call through `access`.
    pub fn guarded(timeouts: Timeouts, window: Duration, access: Arc<dyn Access>) -> Arc<Self> {
        // Ids (and the incarnation, a hash of this) stay distinct across dispatcher restarts
        // without coordination. The time and process id alone were not enough: dispatchers
        // started in the same millisecond by one process (tests) or by processes that are
        // all pid 1 (containers) shared them. A randomly keyed hasher adds 32 random bits.
        let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
        let random = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), millis);
        let instance = format!("{:x}{:04x}{:08x}", millis & 0xffff_ffff, std::process::id() & 0xffff, random as u32);
        Arc::new(Dispatcher {
            state: Mutex::new(DispatcherState::new(instance, timeouts)),
            listings: Mutex::new(HashMap::new()),
            serving: AtomicBool::new(true),
            window,
            access,
            denials: Denials::default(),
            worker_tls_names: OnceLock::new(),
        })
    }

    /// Workers serve TLS with certificates for `names(pipeline)`: worker lists say so.
    pub fn set_worker_tls_names(&self, names: WorkerTlsNames) {
        let _ = self.worker_tls_names.set(names);
    }

    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::SeqCst);
    }

    /// Reads or changes the state; listing changes are published by the caller's request
    /// handlers and the expiry timer.
    pub fn with_state<R>(&self, f: impl FnOnce(&mut DispatcherState) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    /// Tells the pipeline's watching clients its workers and jobs' epochs, if they changed.
    fn publish(&self, pipeline: &PipelineKey) {
        let listing = self.with_state(|s| s.listing(pipeline));
        let mut listings = self.listings.lock().unwrap();
        let sender = listings.entry(pipeline.clone()).or_insert_with(|| watch::channel(Listing::default()).0);
        sender.send_if_modified(|current| {
            let changed = *current != listing;
            *current = listing;
            changed
        });
    }

    fn watch(&self, pipeline: &PipelineKey) -> watch::Receiver<Listing> {
        self.publish(pipeline);
        self.listings.lock().unwrap().get(pipeline).expect("published above").subscribe()
    }

    /// Expires silent workers and clients once a second until the dispatcher is dropped.
    pub fn spawn_expiry(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(dispatcher) = weak.upgrade() else { return };
                let changed = dispatcher.with_state(|s| s.expire(Instant::now()));
                for pipeline in changed {
                    dispatcher.publish(&pipeline);
                }
            }
        })
    }

    pub fn into_server(self: Arc<Self>) -> DispatcherServer<DispatcherService> {
        DispatcherServer::new(self.into_service())
    }

    /// The RPC handlers without the transport, for calling them directly (the fuzz targets).
    pub fn into_service(self: Arc<Self>) -> DispatcherService {
        DispatcherService(self)
    }

    /// Refused calls: the counter for the registry, the tally for Events.
    pub fn denials(&self) -> &Denials {
        &self.denials
    }

    fn check_serving(&self) -> Result<(), Status> {
        if self.serving.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Status::unavailable(
                "this operator is not the leader; retry (the dispatcher Service routes to the leader)",
            ))
        }
    }
}

pub struct DispatcherService(Arc<Dispatcher>);

impl DispatcherService {
    /// Admits a call that needs `need`, or refuses it (counted, logged, tallied for Events).
    async fn admit<T>(&self, rpc: &'static str, request: &Request<T>, need: Need<'_>) -> Result<Identity, Status> {
        self.0.check_serving()?;
        let token = proto::request_token(request.metadata());
        self.0.access.check(token, need).await.map_err(|refusal| {
            let pipeline = match need {
                Need::Read(p) | Need::Work(p) => Some(p),
                Need::Token => None,
            };
            self.0.denials.record(rpc, pipeline, &refusal);
            refusal.to_status()
        })
    }

    /// Admits a call about a worker or client: it must be allowed on that member's pipeline
    /// (a worker's calls need `work`, a client's read). An id the dispatcher does not know
    /// needs only a valid token; the call then answers NOT_FOUND as before.
    async fn admit_member<T>(&self, rpc: &'static str, request: &Request<T>, member: Member<'_>) -> Result<(), Status> {
        let pipeline = self.0.with_state(|s| match member {
            Member::Worker(id) => s.pipeline_of_worker(id),
            Member::Client(id) => s.pipeline_of_client(id),
        });
        let need = match (&pipeline, member) {
            (Some(p), Member::Worker(_)) => Need::Work(p),
            (Some(p), Member::Client(_)) => Need::Read(p),
            (None, _) => Need::Token,
        };
        self.admit(rpc, request, need).await.map(drop)
    }

    fn status(&self, e: DispatchError) -> Status {
        match e {
            DispatchError::Unknown { .. } => {
                // Whether the caller was only forgotten, or the dispatcher restarted.
                let mut metadata = tonic::metadata::MetadataMap::new();
                let incarnation = self.0.with_state(|s| s.incarnation());
                metadata.insert(proto::INCARNATION, incarnation.into());
                Status::with_metadata(Code::NotFound, e.to_string(), metadata)
            }
            DispatchError::PlanMismatch { .. } => Status::failed_precondition(e.to_string()),
            DispatchError::Invalid(_) => Status::invalid_argument(e.to_string()),
        }
    }
}

/// Whose call it is.
#[derive(Clone, Copy)]
enum Member<'a> {
    Worker(&'a WorkerId),
    Client(&'a ClientId),
}

fn pipeline_key(p: Option<proto::PipelineRef>) -> Result<PipelineKey, Status> {
    match p {
        Some(p) if !p.namespace.is_empty() && !p.name.is_empty() => Ok(PipelineKey::new(p.namespace, p.name)),
        _ => Err(Status::invalid_argument("pipeline (namespace and name) is required")),
    }
}

type WorkerListStream = Pin<Box<dyn Stream<Item = Result<proto::WorkerList, Status>> + Send>>;

#[tonic::async_trait]
impl dispatcher_server::Dispatcher for DispatcherService {
    async fn register_worker(
        &self,
        request: Request<proto::RegisterWorkerRequest>,
    ) -> Result<Response<proto::RegisterWorkerResponse>, Status> {
        let pipeline = pipeline_key(request.get_ref().pipeline.clone())?;
        self.admit("RegisterWorker", &request, Need::Work(&pipeline)).await?;
        let r = request.into_inner();
        let registration = WorkerRegistration {
            pipeline,
            address: r.address,
            threads: r.threads,
            splits: r.splits,
            plan_digest: r.plan_digest,
            worker_id: Some(r.worker_id.into()),
            cache_mode: proto::CacheMode::try_from(r.cache_mode)
                .map_err(|_| Status::invalid_argument(format!("cache_mode {} is not a CacheMode", r.cache_mode)))?
                .into(),
            cache_hints: r
                .cache_hints
                .into_iter()
                .map(|h| HintSeen { at: h.at, fingerprint: h.fingerprint, complete: h.complete })
                .collect(),
            shuffle_seed: r.shuffle_seed,
        };
        let pipeline = registration.pipeline.clone();
        let address = registration.address.clone();
        let (worker_id, incarnation) = self
            .0
            .with_state(|s| Ok((s.register_worker(registration, Instant::now())?, s.incarnation())))
            .map_err(|e| self.status(e))?;
        tracing::info!(%pipeline, %address, worker = %worker_id, "worker registered");
        self.0.publish(&pipeline);
        Ok(Response::new(proto::RegisterWorkerResponse {
            worker_id: worker_id.into_string(),
            heartbeat_interval_ms: HEARTBEAT_INTERVAL.as_millis() as u32,
            incarnation,
        }))
    }

    async fn worker_heartbeat(
        &self,
        request: Request<proto::WorkerHeartbeatRequest>,
    ) -> Result<Response<proto::WorkerHeartbeatResponse>, Status> {
        let worker = WorkerId::from(request.get_ref().worker_id.as_str());
        self.admit_member("WorkerHeartbeat", &request, Member::Worker(&worker)).await?;
        let r = request.into_inner();
        let p = r.progress.unwrap_or_default();
        let progress = Progress {
            records: p.records,
            elements: p.elements,
            batches: p.batches,
            batch_bytes: p.batch_bytes,
            skipped: p.skipped.into_iter().collect(),
            ops: op_totals(&p.op_seconds, &p.op_elements_in, &p.op_elements_out),
            error: (!p.error.is_empty()).then_some(p.error),
            cache: p.cache.map(cache_progress).unwrap_or_default(),
            warnings: stoker_api::bounded_warnings(p.warnings),
            source_elements: if p.source_elements.len() <= stoker_api::bounds::MAX_MIXED_SOURCES {
                p.source_elements
            } else {
                Vec::new()
            },
            sharing: p.sharing.unwrap_or_default(),
        };
        self.0.with_state(|s| s.heartbeat(&worker, progress, Instant::now())).map_err(|e| self.status(e))?;
        Ok(Response::new(proto::WorkerHeartbeatResponse {}))
    }

    async fn next_split(
        &self,
        request: Request<proto::NextSplitRequest>,
    ) -> Result<Response<proto::NextSplitResponse>, Status> {
        let worker = WorkerId::from(request.get_ref().worker_id.as_str());
        self.admit_member("NextSplit", &request, Member::Worker(&worker)).await?;
        let r = request.into_inner();
        if r.job.is_empty() {
            return Err(Status::invalid_argument("job is required"));
        }
        let job = JobName::from(r.job);
        let completed: Vec<(u64, u64)> = r.completed.iter().map(|c| (c.epoch, c.split)).collect();
        let (next, directive, pipeline, incarnation) = self
            .0
            .with_state(|s| {
                Ok((
                    s.next_production(&worker, &job, &completed, r.epoch, Instant::now())?,
                    s.cache_directive(&worker),
                    s.pipeline_of_worker(&worker),
                    s.incarnation(),
                ))
            })
            .map_err(|e| self.status(e))?;
        if !completed.is_empty()
            && let Some(pipeline) = pipeline
        {
            self.0.publish(&pipeline);
        }
        let (next, production) = next;
        let production = production.map(|p| proto::SharedProduction { id: p.id, takers: p.takers });
        let (next, skip, echo_factor) = match next {
            Assignment::Split { epoch, split, skip, echo } => {
                (Next::Split(proto::SplitRef { epoch, split }), skip, echo)
            }
            Assignment::Draining { epoch } => (
                Next::Draining(proto::EpochDraining { epoch, retry_ms: DRAINING_RETRY.as_millis() as u32 }),
                Vec::new(),
                0,
            ),
            Assignment::Finished { epoch } => (Next::Finished(proto::EpochFinished { epoch }), Vec::new(), 0),
        };
        use proto::cache_directive::Action;
        let cache = match directive {
            Directive::Compute => proto::CacheDirective::default(),
            Directive::Put(h) => {
                proto::CacheDirective { action: Action::Put.into(), at: h.at, fingerprint: h.fingerprint }
            }
            Directive::Get(h) => {
                proto::CacheDirective { action: Action::Get.into(), at: h.at, fingerprint: h.fingerprint }
            }
        };
        Ok(Response::new(proto::NextSplitResponse {
            next: Some(next),
            cache: Some(cache),
            skip,
            incarnation,
            echo_factor,
            production,
        }))
    }

    async fn return_splits(
        &self,
        request: Request<proto::ReturnSplitsRequest>,
    ) -> Result<Response<proto::ReturnSplitsResponse>, Status> {
        let worker = WorkerId::from(request.get_ref().worker_id.as_str());
        self.admit_member("ReturnSplits", &request, Member::Worker(&worker)).await?;
        let r = request.into_inner();
        let job = JobName::from(r.job.as_str());
        self.0
            .with_state(|s| s.give_back(&worker, &job, r.epoch, &r.splits, Instant::now()))
            .map_err(|e| self.status(e))?;
        tracing::info!(worker = %r.worker_id, job = %r.job, epoch = r.epoch, splits = ?r.splits, "splits returned by a stopped producer");
        Ok(Response::new(proto::ReturnSplitsResponse {}))
    }

    async fn register_client(
        &self,
        request: Request<proto::RegisterClientRequest>,
    ) -> Result<Response<proto::RegisterClientResponse>, Status> {
        let pipeline = pipeline_key(request.get_ref().pipeline.clone())?;
        self.admit("RegisterClient", &request, Need::Read(&pipeline)).await?;
        let r = request.into_inner();
        if r.job.is_empty() {
            return Err(Status::invalid_argument("job is required"));
        }
        let registration = ClientRegistration {
            pipeline: pipeline.clone(),
            job: r.job.into(),
            consumer_index: r.consumer_index,
            consumers: r.consumers,
            coordinated: r.coordinated,
            client_id: Some(r.client_id.into()),
            share: (!r.share.is_empty()).then(|| r.share.into()),
            rejoin: r.rejoin.map(|j| Rejoin {
                incarnation: j.incarnation,
                open_epoch: j.open_epoch,
                clients: j.clients,
                completed: j.completed.iter().map(|c| (c.epoch, c.split)).collect(),
                received: j.received.into_iter().map(held).collect(),
            }),
            resume: r.resume.map(|s| Resume {
                job: s.job.into(),
                epoch: s.epoch,
                batches: s.batches,
                consumers: s.consumers,
                consumer_index: s.consumer_index,
                yielded: s.yielded.into_iter().map(held).collect(),
                merged: s.merged_ranks > 0,
            }),
        };
        let registered =
            self.0.with_state(|s| s.register_client(registration, Instant::now())).map_err(|e| self.status(e))?;
        tracing::info!(%pipeline, job = %registered.job, consumer = r.consumer_index, client = %registered.client_id, "client registered");
        // Its job's client count changed.
        self.0.publish(&pipeline);
        Ok(Response::new(proto::RegisterClientResponse {
            client_id: registered.client_id.into_string(),
            window_ms: self.0.window.as_millis() as u32,
            job: registered.job.into_string(),
            incarnation: registered.incarnation,
        }))
    }

    type WatchWorkersStream = WorkerListStream;

    async fn watch_workers(
        &self,
        request: Request<proto::WatchWorkersRequest>,
    ) -> Result<Response<Self::WatchWorkersStream>, Status> {
        let pipeline = pipeline_key(request.get_ref().pipeline.clone())?;
        self.admit("WatchWorkers", &request, Need::Read(&pipeline)).await?;
        let r = request.into_inner();
        let updates = tokio_stream::wrappers::WatchStream::new(self.0.watch(&pipeline));
        let incarnation = self.0.with_state(|s| s.incarnation());
        let job = JobName::from(r.job);
        let tls_server_name = self.0.worker_tls_names.get().map(|names| names(&pipeline)).unwrap_or_default();
        // The workers this stream last sent: the list is shared until it changes, so the
        // pointer says whether it did.
        let mut sent: Option<Arc<Vec<(String, WorkerId)>>> = None;
        let lists = updates.map(move |l| {
            let same_workers = sent.as_ref().is_some_and(|w| Arc::ptr_eq(w, &l.workers));
            sent = Some(l.workers.clone());
            let listed = if same_workers { &[][..] } else { &l.workers[..] };
            let epoch = l.epochs.get(&job).copied().unwrap_or_default();
            let quotas = l
                .quotas
                .get(&job)
                .map_or_else(Vec::new, |quotas| quotas.iter().map(|(epoch, q)| q.to_proto(*epoch)).collect());
            let clients = l.clients.get(&job).copied().unwrap_or_default();
            Ok(proto::WorkerList {
                addresses: listed.iter().map(|(address, _)| address.clone()).collect(),
                workers: listed.iter().map(|(_, id)| id.to_string()).collect(),
                same_workers,
                version: l.version,
                epoch,
                quotas,
                incarnation,
                clients,
                tls_server_name: tls_server_name.clone(),
            })
        });
        Ok(Response::new(lists.boxed()))
    }

    async fn report_window(
        &self,
        request: Request<proto::ReportWindowRequest>,
    ) -> Result<Response<proto::ReportWindowResponse>, Status> {
        let client = ClientId::from(request.get_ref().client_id.as_str());
        self.admit_member("ReportWindow", &request, Member::Client(&client)).await?;
        let window = Window::from(request.get_ref());
        self.0.with_state(|s| s.report_window(&client, window, Instant::now())).map_err(|e| self.status(e))?;
        Ok(Response::new(proto::ReportWindowResponse {}))
    }

    async fn acknowledge(
        &self,
        request: Request<proto::AcknowledgeRequest>,
    ) -> Result<Response<proto::AcknowledgeResponse>, Status> {
        let client = ClientId::from(request.get_ref().client_id.as_str());
        self.admit_member("Acknowledge", &request, Member::Client(&client)).await?;
        let r = request.into_inner();
        let splits = |s: &[proto::SplitRef]| s.iter().map(|c| (c.epoch, c.split)).collect();
        let ack = Acknowledgement {
            completed: splits(&r.completed),
            completed_again: splits(&r.completed_again),
            version: r.list_version,
            held: r.held.into_iter().map(held).collect(),
            received: r.received.iter().map(Received::from_proto).collect(),
        };
        let (epoch, pipeline) = self
            .0
            .with_state(|s| {
                let pipeline = s.pipeline_of_client(&client);
                let epoch = s.acknowledge(&client, ack, Instant::now())?;
                if r.leaving {
                    s.leave(&client, r.discarded, Instant::now());
                }
                Ok((epoch, pipeline))
            })
            .map_err(|e| self.status(e))?;
        if let Some(pipeline) = pipeline {
            self.0.publish(&pipeline);
        }
        Ok(Response::new(proto::AcknowledgeResponse { epoch }))
    }

    async fn authorize_reader(
        &self,
        request: Request<proto::AuthorizeReaderRequest>,
    ) -> Result<Response<proto::AuthorizeReaderResponse>, Status> {
        let pipeline = pipeline_key(request.get_ref().pipeline.clone())?;
        self.admit("AuthorizeReader", &request, Need::Work(&pipeline)).await?;
        let token = request.get_ref().token.as_str();
        // The reader's refusal is an answer, not an error: an error would read to the worker
        // as its own call failing.
        let verdict = match self.0.access.check(Some(token), Need::Read(&pipeline)).await {
            Ok(reader) => proto::AuthorizeReaderResponse {
                username: reader.username,
                valid_for_ms: READER_VERDICT,
                refused: None,
            },
            Err(unavailable @ Refusal::Unavailable(_)) => return Err(unavailable.to_status()),
            Err(refusal) => {
                self.0.denials.record("Stream", Some(&pipeline), &refusal);
                let unauthenticated = matches!(refusal, Refusal::NoToken { .. } | Refusal::BadToken(_));
                proto::AuthorizeReaderResponse {
                    username: String::new(),
                    valid_for_ms: READER_REFUSAL,
                    refused: Some(proto::ReaderRefusal { unauthenticated, message: refusal.to_string() }),
                }
            }
        };
        Ok(Response::new(verdict))
    }
}

/// Serves the dispatcher on a bound listener until `shutdown` completes, over TLS when `tls`
/// is given.
pub async fn serve(
    listener: tokio::net::TcpListener,
    dispatcher: Arc<Dispatcher>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    builder.add_service(dispatcher.into_server()).serve_with_incoming_shutdown(incoming, shutdown).await
}

fn held(h: proto::HeldRows) -> Held {
    Held { epoch: h.epoch, split: h.split, positions: h.positions }
}

/// A heartbeat's per-op lists as one tally per op (a worker that sends no counts: zeros).
fn op_totals(seconds: &[f64], elements_in: &[u64], elements_out: &[u64]) -> Vec<stoker_api::OpTotals> {
    (seconds.iter().enumerate())
        .map(|(i, &seconds)| stoker_api::OpTotals {
            seconds: if seconds.is_finite() { seconds.max(0.0) } else { 0.0 },
            elements_in: elements_in.get(i).copied().unwrap_or(0),
            elements_out: elements_out.get(i).copied().unwrap_or(0),
        })
        .collect()
}

fn cache_progress(c: proto::CacheProgress) -> CacheProgress {
    CacheProgress {
        hints: c.hints,
        splits_measured: c.splits_measured,
        write_bytes_per_second: c.write_bytes_per_second,
        read_bytes_per_second: c.read_bytes_per_second,
        complete: c.complete,
        corrupt: (!c.corrupt.is_empty()).then_some((c.corrupt, c.corrupt_detail)),
        splits_written: c.splits_written,
        splits_read: c.splits_read,
        elements_read: c.elements_read,
    }
}

#[cfg(test)]
#[path = "service_access_tests.rs"]
mod access_tests;

#[cfg(test)]
#[path = "service_watch_tests.rs"]
mod watch_tests;
