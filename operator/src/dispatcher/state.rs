//! The dispatcher's bookkeeping, without I/O: who is alive, which splits each job still needs
//! in its epoch, and the clients' latest batch-time windows. Time comes in as arguments, so
//! failure handling (dead workers, lost clients) is tested by moving a clock.
//!
//! A split is done when a client reports receiving the batch holding its last element (or,
//! for a split that produced nothing, when its worker says so). Delivery is at least once: a
//! split held by a worker that dies, or in flight to a client that goes silent, goes back to
//! the queue, so its elements may reach clients twice. Such repeats are counted.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use stoker_api::{CacheDecision, CacheMode, CacheStatus};

use super::cache::{CacheProgress, Caches, HintSeen};
use crate::autocache::plan::{Directive, Measured};

/// A DataPipeline by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PipelineKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PipelineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug)]
pub struct Timeouts {
    /// A worker silent this long is dead; its unfinished splits are handed out again.
    pub worker: Duration,
    /// A client silent this long (no window, no watch) has detached.
    pub client: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { worker: Duration::from_secs(10), client: Duration::from_secs(30) }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DispatchError {
    /// The id is unknown (e.g. the dispatcher restarted): register again.
    #[error("unknown {kind} {id}: register again")]
    Unknown { kind: &'static str, id: String },
    #[error(
        "worker {address} planned {got} splits (digest {got_digest}) but the pipeline's workers planned {want} ({want_digest}): the source listing differs between workers"
    )]
    PlanMismatch { address: String, got: u64, got_digest: String, want: u64, want_digest: String },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct WorkerRegistration {
    pub pipeline: PipelineKey,
    pub address: String,
    pub threads: u32,
    pub splits: u64,
    pub plan_digest: String,
    /// Kept when re-registering after a dispatcher restart.
    pub worker_id: Option<String>,
    pub cache_mode: CacheMode,
    /// Empty when the worker has no cache volume.
    pub cache_hints: Vec<HintSeen>,
}

/// What a worker should do next for a job.
#[derive(Clone, Debug, PartialEq)]
pub enum Assignment {
    Split {
        epoch: u64,
        split: u64,
    },
    /// Nothing to hand out in `epoch` until other workers finish theirs.
    Draining {
        epoch: u64,
    },
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub records: u64,
    pub elements: u64,
    pub batches: u64,
    pub batch_bytes: u64,
    pub skipped: BTreeMap<String, u64>,
    pub op_seconds: Vec<f64>,
    pub error: Option<String>,
    pub cache: CacheProgress,
}

/// One client's batch-time measurements over one window.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientWindow {
    pub batches: u64,
    pub median_seconds: f64,
    pub p90_seconds: f64,
    /// 1 / training speed over the window.
    pub mean_seconds: f64,
    pub wait_fraction: f64,
    pub workers: u32,
}

struct Worker {
    pipeline: PipelineKey,
    address: String,
    threads: u32,
    last_seen: Instant,
    progress: Progress,
}

struct Client {
    pipeline: PipelineKey,
    job: String,
    consumer_index: u32,
    last_seen: Instant,
    /// Windows not yet taken by the autoscaler.
    windows: Vec<ClientWindow>,
}

/// One pass over the pipeline's splits.
#[derive(Default)]
struct Pass {
    pending: VecDeque<u64>,
    assigned: HashMap<u64, String>,
    done: BTreeSet<u64>,
    /// When its first split was handed out, and how many were computed, put and got.
    started: Option<Instant>,
    actions: [u64; 3],
}

impl Pass {
    /// What most of the pass's splits did with the cache.
    fn action(&self) -> CacheDecision {
        let [compute, put, get] = self.actions;
        if get > compute + put {
            CacheDecision::Get
        } else if put > compute + get {
            CacheDecision::Put
        } else {
            CacheDecision::Compute
        }
    }
}

impl Pass {
    fn full(splits: u64) -> Pass {
        Pass { pending: (0..splits).collect(), ..Pass::default() }
    }

    /// Puts `lost` back at the front of the queue; returns how many.
    fn requeue(&mut self, lost: impl IntoIterator<Item = u64>) -> u64 {
        let mut lost: Vec<u64> = lost.into_iter().collect();
        lost.sort_unstable();
        for &split in lost.iter().rev() {
            self.assigned.remove(&split);
            self.pending.push_front(split);
        }
        lost.len() as u64
    }
}

/// A job's passes: the oldest unfinished epoch, and the one after it. Workers with nothing
/// left in the first start the second instead of idling until the last split of the first
/// reaches a client, which would cost every epoch a stall as long as a split's trip.
#[derive(Default)]
struct Job {
    epoch: u64,
    current: Pass,
    next: Option<Pass>,
    /// Splits completed more than once (after a requeue, or late by a presumed-dead worker).
    repeats: u64,
    /// Splits taken back from dead workers.
    requeued: u64,
}

impl Job {
    fn starting(epoch: u64, splits: u64) -> Job {
        Job { epoch, current: Pass::full(splits), ..Job::default() }
    }

    fn passes(&self) -> impl Iterator<Item = &Pass> {
        std::iter::once(&self.current).chain(self.next.as_ref())
    }

    fn passes_mut(&mut self) -> impl Iterator<Item = &mut Pass> {
        std::iter::once(&mut self.current).chain(self.next.as_mut())
    }

    /// The next split to produce: the current epoch's first, then the next epoch's.
    fn hand_out(&mut self, worker: &str, splits: u64, directive: &Directive, now: Instant) -> Assignment {
        let (epoch, pass) = match self.current.pending.is_empty() {
            false => (self.epoch, &mut self.current),
            true => (self.epoch + 1, self.next.get_or_insert_with(|| Pass::full(splits))),
        };
        match pass.pending.pop_front() {
            Some(split) => {
                pass.assigned.insert(split, worker.to_string());
                pass.started.get_or_insert(now);
                pass.actions[match directive {
                    Directive::Compute => 0,
                    Directive::Put(_) => 1,
                    Directive::Get(_) => 2,
                }] += 1;
                Assignment::Split { epoch, split }
            }
            None => Assignment::Draining { epoch: self.epoch },
        }
    }

    /// Marks (epoch, split)s done, and moves on once the current epoch's all are; returns the
    /// finished epoch's cache action and length.
    fn complete(&mut self, completed: &[(u64, u64)], splits: u64, now: Instant) -> Option<(CacheDecision, f64)> {
        for &(e, split) in completed {
            let pass = match e.checked_sub(self.epoch) {
                Some(0) => Some(&mut self.current),
                Some(1) => self.next.as_mut(),
                _ => None,
            };
            let Some(pass) = pass.filter(|_| split < splits) else {
                // A finished epoch's split: its epoch already advanced without it.
                self.repeats += 1;
                continue;
            };
            pass.assigned.remove(&split);
            if !pass.done.insert(split) {
                self.repeats += 1;
            } else if let Some(i) = pass.pending.iter().position(|&s| s == split) {
                // Done by a worker presumed dead whose split was queued again.
                pass.pending.remove(i);
            }
        }
        if self.current.done.len() as u64 != splits {
            return None;
        }
        let finished = std::mem::replace(&mut self.current, self.next.take().unwrap_or_else(|| Pass::full(splits)));
        self.epoch += 1;
        finished.started.map(|t| (finished.action(), now.saturating_duration_since(t).as_secs_f64()))
    }

    /// Hands out again the in-flight splits `holds` picks (their data may be lost with
    /// whoever held it).
    fn requeue(&mut self, holds: impl Fn(&str) -> bool) {
        let mut requeued = 0;
        for pass in self.passes_mut() {
            let lost: Vec<u64> = pass.assigned.iter().filter(|(_, w)| holds(w)).map(|(s, _)| *s).collect();
            requeued += pass.requeue(lost);
        }
        self.requeued += requeued;
    }
}

#[derive(Default)]
struct Pipeline {
    /// (splits, digest) every worker of the pipeline must agree on; set by the first worker.
    plan: Option<(u64, String)>,
    jobs: BTreeMap<String, Job>,
}

/// A job's delivery counters, for status and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSummary {
    pub job: String,
    pub epoch: u64,
    pub splits: u64,
    pub done: u64,
    pub in_flight: u64,
    /// Distinct workers holding the in-flight splits.
    pub holders: u64,
    pub repeats: u64,
    pub requeued: u64,
}

/// What the autoscaler sees of one (pipeline, job).
#[derive(Clone, Debug, PartialEq)]
pub struct JobWindows {
    pub pipeline: PipelineKey,
    pub job: String,
    pub consumers: usize,
    /// Windows reported since the last call, from all the job's consumers.
    pub windows: Vec<ClientWindow>,
}

pub struct DispatcherState {
    timeouts: Timeouts,
    /// Distinguishes ids handed out by different dispatcher instances.
    instance: String,
    next_id: u64,
    workers: BTreeMap<String, Worker>,
    clients: BTreeMap<String, Client>,
    pipelines: BTreeMap<PipelineKey, Pipeline>,
    caches: Caches,
}

impl DispatcherState {
    pub fn new(instance: impl Into<String>, timeouts: Timeouts) -> Self {
        DispatcherState {
            timeouts,
            instance: instance.into(),
            next_id: 0,
            workers: BTreeMap::new(),
            clients: BTreeMap::new(),
            pipelines: BTreeMap::new(),
            caches: Caches::default(),
        }
    }

    pub fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    fn fresh_id(&mut self, kind: &str) -> String {
        self.next_id += 1;
        format!("{kind}-{}-{}", self.instance, self.next_id)
    }

    pub fn register_worker(&mut self, r: WorkerRegistration, now: Instant) -> Result<String, DispatchError> {
        if r.address.is_empty() {
            return Err(DispatchError::Invalid("a worker must give the address clients reach it at".into()));
        }
        if r.splits == 0 {
            return Err(DispatchError::Invalid("a worker must plan at least one split".into()));
        }
        let has_workers = self.workers.values().any(|w| w.pipeline == r.pipeline);
        let pipeline = self.pipelines.entry(r.pipeline.clone()).or_default();
        match &pipeline.plan {
            Some((splits, digest)) if (*splits, digest.as_str()) != (r.splits, r.plan_digest.as_str()) => {
                if has_workers {
                    return Err(DispatchError::PlanMismatch {
                        address: r.address,
                        got: r.splits,
                        got_digest: r.plan_digest,
                        want: *splits,
                        want_digest: digest.clone(),
                    });
                }
                // Every worker of the old plan is gone: the source changed; start over.
                *pipeline = Pipeline { plan: Some((r.splits, r.plan_digest.clone())), jobs: BTreeMap::new() };
                self.caches.forget(&r.pipeline);
            }
            Some(_) => {}
            None => pipeline.plan = Some((r.splits, r.plan_digest.clone())),
        }
        self.caches.register(&r.pipeline, r.cache_mode, &r.cache_hints, r.splits);
        let id = match r.worker_id.filter(|id| !id.is_empty()) {
            Some(id) => id,
            None => self.fresh_id("w"),
        };
        let worker = Worker {
            pipeline: r.pipeline,
            address: r.address,
            threads: r.threads,
            last_seen: now,
            progress: Progress::default(),
        };
        self.workers.insert(id.clone(), worker);
        Ok(id)
    }

    pub fn heartbeat(&mut self, worker_id: &str, progress: Progress, now: Instant) -> Result<(), DispatchError> {
        let worker = self.worker_mut(worker_id)?;
        worker.last_seen = now;
        worker.progress = progress;
        let key = worker.pipeline.clone();
        let measured = self.measured(&key);
        let progress = &self.workers[worker_id].progress.cache;
        self.caches.reported(&key, progress, &measured);
        Ok(())
    }

    /// The pipeline's workers' cache measurements, summed.
    fn measured(&self, key: &PipelineKey) -> Measured {
        let mut m = Measured::default();
        for w in self.workers.values().filter(|w| &w.pipeline == key) {
            let (p, c) = (&w.progress, &w.progress.cache);
            m.workers += 1;
            m.threads = m.threads.max(w.threads);
            m.splits += c.splits_measured;
            m.elements += p.elements.saturating_sub(c.elements_read);
            if m.op_seconds.len() < p.op_seconds.len() {
                m.op_seconds.resize(p.op_seconds.len(), 0.0);
            }
            for (total, s) in m.op_seconds.iter_mut().zip(&p.op_seconds) {
                *total += s;
            }
            for &(at, elements, bytes) in &c.hints {
                match m.hint_bytes.iter_mut().find(|h| h.0 == at) {
                    Some(h) => (h.1, h.2) = (h.1 + elements, h.2 + bytes),
                    None => m.hint_bytes.push((at, elements, bytes)),
                }
            }
            // The volume is shared: any worker's probe measures it.
            m.write_bytes_per_second = m.write_bytes_per_second.max(c.write_bytes_per_second);
            m.read_bytes_per_second = m.read_bytes_per_second.max(c.read_bytes_per_second);
        }
        m
    }

    /// Where the worker's next split gets its elements up to an autocache hint.
    pub fn cache_directive(&self, worker_id: &str) -> Directive {
        self.workers.get(worker_id).map_or(Directive::Compute, |w| self.caches.directive(&w.pipeline))
    }

    /// Every pipeline's cache plan.
    pub fn cache_statuses(&self) -> BTreeMap<PipelineKey, CacheStatus> {
        self.pipelines.keys().filter_map(|k| Some((k.clone(), self.cache_status(k)?))).collect()
    }

    /// The pipeline's cache plan for status; `None` before its first worker registered.
    pub fn cache_status(&self, key: &PipelineKey) -> Option<CacheStatus> {
        let bytes = self
            .workers
            .values()
            .filter(|w| &w.pipeline == key)
            .map(|w| w.progress.cache.hints.iter().map(|h| h.2).max().unwrap_or(0))
            .sum::<u64>();
        self.caches.status(key, (bytes > 0).then_some(bytes as i64))
    }

    fn worker_mut(&mut self, id: &str) -> Result<&mut Worker, DispatchError> {
        self.workers.get_mut(id).ok_or_else(|| DispatchError::Unknown { kind: "worker", id: id.into() })
    }

    /// Records `completed` and hands the worker its next split of `job`. `epoch` is where the
    /// worker is; a job the dispatcher does not know yet (first use, or after a restart)
    /// starts there.
    pub fn next_split(
        &mut self,
        worker_id: &str,
        job: &str,
        completed: &[(u64, u64)],
        epoch: u64,
        now: Instant,
    ) -> Result<Assignment, DispatchError> {
        let worker = self.worker_mut(worker_id)?;
        worker.last_seen = now;
        let key = worker.pipeline.clone();
        let pipeline = self.pipelines.get_mut(&key).expect("a registered worker's pipeline exists");
        let splits = pipeline.plan.as_ref().expect("set by the first worker").0;
        let state = pipeline.jobs.entry(job.to_string()).or_insert_with(|| Job::starting(epoch, splits));
        let directive = self.caches.directive(&key);
        if let Some((action, seconds)) = state.complete(completed, splits, now) {
            self.caches.epoch(&key, action, seconds);
        }
        Ok(state.hand_out(worker_id, splits, &directive, now))
    }

    pub fn register_client(
        &mut self,
        pipeline: PipelineKey,
        job: String,
        consumer_index: u32,
        client_id: Option<String>,
        now: Instant,
    ) -> String {
        let id = match client_id.filter(|id| !id.is_empty()) {
            Some(id) => id,
            None => self.fresh_id("c"),
        };
        self.clients.insert(id.clone(), Client { pipeline, job, consumer_index, last_seen: now, windows: Vec::new() });
        id
    }

    fn client_mut(&mut self, id: &str) -> Result<&mut Client, DispatchError> {
        self.clients.get_mut(id).ok_or_else(|| DispatchError::Unknown { kind: "client", id: id.into() })
    }

    /// A client's window, and the splits whose last batch it received (which makes them done).
    pub fn report_window(
        &mut self,
        client_id: &str,
        window: ClientWindow,
        completed: &[(u64, u64)],
        now: Instant,
    ) -> Result<(), DispatchError> {
        let valid = |x: f64| x.is_finite() && x >= 0.0;
        if ![window.median_seconds, window.p90_seconds, window.mean_seconds, window.wait_fraction]
            .into_iter()
            .all(valid)
        {
            return Err(DispatchError::Invalid("batch times and wait fraction must be finite and non-negative".into()));
        }
        let client = self.client_mut(client_id)?;
        client.last_seen = now;
        // A client that reports but never gets read would otherwise grow this without bound.
        if client.windows.len() >= 64 {
            client.windows.remove(0);
        }
        client.windows.push(window);
        let (key, job) = (client.pipeline.clone(), client.job.clone());
        if !completed.is_empty()
            && let Some(pipeline) = self.pipelines.get_mut(&key)
            && let Some(state) = pipeline.jobs.get_mut(&job)
        {
            let splits = pipeline.plan.as_ref().map_or(0, |p| p.0);
            if let Some((action, seconds)) = state.complete(completed, splits, now) {
                self.caches.epoch(&key, action, seconds);
            }
        }
        Ok(())
    }

    /// Drops workers and clients that went silent; returns the pipelines whose worker set changed.
    pub fn expire(&mut self, now: Instant) -> BTreeSet<PipelineKey> {
        let dead: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| now.saturating_duration_since(w.last_seen) > self.timeouts.worker)
            .map(|(id, _)| id.clone())
            .collect();
        let mut changed = BTreeSet::new();
        for id in dead {
            let worker = self.workers.remove(&id).expect("listed above");
            tracing::warn!(worker = %id, address = %worker.address, pipeline = %worker.pipeline, "worker stopped heartbeating; handing its splits out again");
            if let Some(pipeline) = self.pipelines.get_mut(&worker.pipeline) {
                for job in pipeline.jobs.values_mut() {
                    // Also splits whose last batch this worker sent but no client reported yet:
                    // they may have died in its buffers.
                    job.requeue(|holder| holder == id);
                }
            }
            changed.insert(worker.pipeline);
        }
        let client_timeout = self.timeouts.client;
        let gone: Vec<(PipelineKey, String)> = self
            .clients
            .values()
            .filter(|c| now.saturating_duration_since(c.last_seen) > client_timeout)
            .map(|c| (c.pipeline.clone(), c.job.clone()))
            .collect();
        self.clients.retain(|_, c| now.saturating_duration_since(c.last_seen) <= client_timeout);
        for (key, job) in gone {
            // Batches it had received but not reported are gone with it: produce them again.
            if let Some(state) = self.pipelines.get_mut(&key).and_then(|p| p.jobs.get_mut(&job)) {
                tracing::warn!(pipeline = %key, job = %job, "a client went silent; handing the job's in-flight splits out again");
                state.requeue(|_| true);
            }
        }
        changed
    }

    /// Addresses of a pipeline's live workers, sorted.
    pub fn worker_addresses(&self, pipeline: &PipelineKey) -> Vec<String> {
        let mut addresses: Vec<String> =
            self.workers.values().filter(|w| &w.pipeline == pipeline).map(|w| w.address.clone()).collect();
        addresses.sort();
        addresses.dedup();
        addresses
    }

    pub fn worker_progress(&self, pipeline: &PipelineKey) -> Vec<(String, u32, Progress)> {
        self.workers
            .iter()
            .filter(|(_, w)| &w.pipeline == pipeline)
            .map(|(id, w)| (id.clone(), w.threads, w.progress.clone()))
            .collect()
    }

    pub fn jobs(&self, pipeline: &PipelineKey) -> Vec<JobSummary> {
        let Some(p) = self.pipelines.get(pipeline) else { return Vec::new() };
        let splits = p.plan.as_ref().map_or(0, |(n, _)| *n);
        p.jobs
            .iter()
            .map(|(name, j)| JobSummary {
                job: name.clone(),
                epoch: j.epoch,
                splits,
                done: j.current.done.len() as u64,
                in_flight: j.passes().map(|p| p.assigned.len() as u64).sum(),
                holders: j.passes().flat_map(|p| p.assigned.values()).collect::<BTreeSet<_>>().len() as u64,
                repeats: j.repeats,
                requeued: j.requeued,
            })
            .collect()
    }

    /// Every (pipeline, job) with live clients, with the windows reported since the last call.
    pub fn take_windows(&mut self) -> Vec<JobWindows> {
        let mut by_job: BTreeMap<(PipelineKey, String), JobWindows> = BTreeMap::new();
        for client in self.clients.values_mut() {
            let entry = by_job.entry((client.pipeline.clone(), client.job.clone())).or_insert_with(|| JobWindows {
                pipeline: client.pipeline.clone(),
                job: client.job.clone(),
                consumers: 0,
                windows: Vec::new(),
            });
            entry.consumers += 1;
            entry.windows.append(&mut client.windows);
        }
        by_job.into_values().collect()
    }

    /// Pipelines with at least one live client.
    pub fn attached(&self) -> BTreeSet<PipelineKey> {
        self.clients.values().map(|c| c.pipeline.clone()).collect()
    }

    pub fn consumers(&self, pipeline: &PipelineKey, job: &str) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .clients
            .values()
            .filter(|c| &c.pipeline == pipeline && c.job == job)
            .map(|c| c.consumer_index)
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PipelineKey {
        PipelineKey { namespace: "ns".into(), name: "p".into() }
    }

    fn registration(address: &str, splits: u64) -> WorkerRegistration {
        WorkerRegistration {
            pipeline: key(),
            address: address.into(),
            threads: 2,
            splits,
            plan_digest: format!("d{splits}"),
            worker_id: None,
            cache_mode: CacheMode::Never,
            cache_hints: Vec::new(),
        }
    }

    /// Takes and completes splits until the dispatcher answers with something else, which is
    /// returned beside the splits done.
    fn work(state: &mut DispatcherState, worker: &str, job: &str, epoch: u64, now: Instant) -> (Vec<u64>, Assignment) {
        let mut got = Vec::new();
        let mut completed = Vec::new();
        loop {
            match state.next_split(worker, job, &completed, 0, now).unwrap() {
                Assignment::Split { epoch: e, split } if e == epoch => {
                    got.push(split);
                    completed = vec![(e, split)];
                }
                other => return (got, other),
            }
        }
    }

    #[test]
    fn one_worker_gets_every_split_once_then_the_next_epoch() {
        let t = Instant::now();
        let mut s = DispatcherState::new("t", Timeouts::default());
        let w = s.register_worker(registration("a:1", 3), t).unwrap();
        let (got, next) = work(&mut s, &w, "job", 0, t);
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(next, Assignment::Split { epoch: 1, split: 0 });
        assert_eq!(s.jobs(&key())[0].epoch, 1);
    }

    #[test]
    fn a_worker_with_nothing_left_in_an_epoch_starts_the_next_but_not_the_one_after() {
        let t = Instant::now();
        let mut s = DispatcherState::new("t", Timeouts::default());
        let a = s.register_worker(registration("a:1", 2), t).unwrap();
        let b = s.register_worker(registration("b:1", 2), t).unwrap();
        assert_eq!(s.next_split(&a, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        assert_eq!(s.next_split(&b, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        assert_eq!(s.next_split(&a, "j", &[(0, 0)], 0, t).unwrap(), Assignment::Split { epoch: 1, split: 0 });
        assert_eq!(s.next_split(&a, "j", &[(1, 0)], 0, t).unwrap(), Assignment::Split { epoch: 1, split: 1 });
        // b still holds epoch 0's split 1: a may not run two epochs ahead of it.
        assert_eq!(s.next_split(&a, "j", &[(1, 1)], 0, t).unwrap(), Assignment::Draining { epoch: 0 });
        assert_eq!(s.jobs(&key())[0].epoch, 0);
        // b finishes: epoch 1 is already done too, so both move on to epoch 2.
        assert_eq!(s.next_split(&b, "j", &[(0, 1)], 0, t).unwrap(), Assignment::Split { epoch: 2, split: 0 });
        assert_eq!(s.jobs(&key())[0].epoch, 1);
        assert_eq!(s.next_split(&a, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 2, split: 1 });
        assert_eq!(s.jobs(&key())[0].epoch, 2);
    }

    #[test]
    fn a_dead_workers_splits_of_the_next_epoch_come_back_too() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
        let a = s.register_worker(registration("a:1", 2), t).unwrap();
        let b = s.register_worker(registration("b:1", 2), t).unwrap();
        assert_eq!(s.next_split(&a, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        assert_eq!(s.next_split(&b, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        assert_eq!(s.next_split(&b, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 1, split: 0 });
        let later = t + Duration::from_secs(6);
        s.heartbeat(&a, Progress::default(), later).unwrap();
        s.expire(later);
        assert_eq!(s.jobs(&key())[0].requeued, 2);
        assert_eq!(s.next_split(&a, "j", &[(0, 0)], 0, later).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        assert_eq!(s.next_split(&a, "j", &[(0, 1)], 0, later).unwrap(), Assignment::Split { epoch: 1, split: 0 });
    }

    #[test]
    fn jobs_each_get_whole_epochs() {
        let t = Instant::now();
        let mut s = DispatcherState::new("t", Timeouts::default());
        let w = s.register_worker(registration("a:1", 4), t).unwrap();
        assert_eq!(work(&mut s, &w, "x", 0, t).0, vec![0, 1, 2, 3]);
        assert_eq!(work(&mut s, &w, "y", 0, t).0, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_dead_workers_unfinished_splits_go_to_the_others() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
        let a = s.register_worker(registration("a:1", 4), t).unwrap();
        let b = s.register_worker(registration("b:1", 4), t).unwrap();
        assert_eq!(s.next_split(&a, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        assert_eq!(s.next_split(&a, "j", &[(0, 0)], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        // a dies holding split 1; b keeps heartbeating.
        let later = t + Duration::from_secs(6);
        s.heartbeat(&b, Progress::default(), later).unwrap();
        assert_eq!(s.expire(later), BTreeSet::from([key()]));
        assert_eq!(s.worker_addresses(&key()), vec!["b:1".to_string()]);
        let (mut got, _) = work(&mut s, &b, "j", 0, later);
        got.sort_unstable();
        assert_eq!(got, vec![1, 2, 3], "split 0 was done by a before it died; 1 comes back");
        let job = &s.jobs(&key())[0];
        assert_eq!((job.epoch, job.requeued, job.repeats), (1, 1, 0));
        // The dead worker's id is unknown now: it must register again.
        assert!(matches!(s.next_split(&a, "j", &[], 0, later), Err(DispatchError::Unknown { .. })));
    }

    #[test]
    fn a_late_completion_of_a_requeued_split_counts_as_a_repeat() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
        let a = s.register_worker(registration("a:1", 2), t).unwrap();
        let b = s.register_worker(registration("b:1", 2), t).unwrap();
        assert_eq!(s.next_split(&a, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        let later = t + Duration::from_secs(6);
        s.heartbeat(&b, Progress::default(), later).unwrap();
        s.expire(later);
        assert_eq!(s.next_split(&b, "j", &[], 0, later).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        // a was only slow: it comes back and reports split 0 as well.
        let a2 = s
            .register_worker(WorkerRegistration { worker_id: Some(a.clone()), ..registration("a:1", 2) }, later)
            .unwrap();
        assert_eq!(a2, a, "re-registration keeps the id");
        assert_eq!(s.next_split(&b, "j", &[(0, 0)], 0, later).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        s.next_split(&a, "j", &[(0, 0)], 0, later).unwrap();
        assert_eq!(s.jobs(&key())[0].repeats, 1);
    }

    #[test]
    fn a_restarted_dispatcher_resumes_a_job_at_the_workers_epoch() {
        let t = Instant::now();
        let mut s = DispatcherState::new("t2", Timeouts::default());
        let w = s
            .register_worker(WorkerRegistration { worker_id: Some("w-t1-1".into()), ..registration("a:1", 2) }, t)
            .unwrap();
        assert_eq!(w, "w-t1-1");
        assert_eq!(s.next_split(&w, "j", &[], 7, t).unwrap(), Assignment::Split { epoch: 7, split: 0 });
    }

    #[test]
    fn workers_with_a_different_listing_are_refused_while_the_old_ones_live() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(30) });
        s.register_worker(registration("a:1", 2), t).unwrap();
        let err = s.register_worker(registration("b:1", 3), t).unwrap_err();
        assert!(err.to_string().contains("listing differs"), "{err}");
        // Once the old workers are gone, the new listing wins.
        let later = t + Duration::from_secs(6);
        s.expire(later);
        s.register_worker(registration("b:1", 3), later).unwrap();
        assert_eq!(s.jobs(&key()), vec![]);
    }

    #[test]
    fn windows_are_grouped_by_job_and_taken_once() {
        let t = Instant::now();
        let mut s = DispatcherState::new("t", Timeouts::default());
        let c0 = s.register_client(key(), "j".into(), 0, None, t);
        let c1 = s.register_client(key(), "j".into(), 1, None, t);
        let window = ClientWindow {
            batches: 10,
            median_seconds: 0.1,
            p90_seconds: 0.2,
            mean_seconds: 0.12,
            wait_fraction: 0.5,
            workers: 1,
        };
        s.report_window(&c0, window.clone(), &[], t).unwrap();
        s.report_window(&c1, window.clone(), &[], t).unwrap();
        let bad = ClientWindow { median_seconds: f64::NAN, ..window.clone() };
        assert!(matches!(s.report_window(&c1, bad, &[], t), Err(DispatchError::Invalid(_))));
        let taken = s.take_windows();
        assert_eq!(taken.len(), 1);
        assert_eq!((taken[0].consumers, taken[0].windows.len()), (2, 2));
        assert!(s.take_windows()[0].windows.is_empty());
        assert_eq!(s.consumers(&key(), "j"), vec![0, 1]);
    }

    #[test]
    fn clients_complete_splits_and_a_silent_one_gets_its_splits_redone() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(60), client: Duration::from_secs(5) });
        let w = s.register_worker(registration("a:1", 2), t).unwrap();
        let c = s.register_client(key(), "j".into(), 0, None, t);
        let window = ClientWindow {
            batches: 1,
            median_seconds: 0.1,
            p90_seconds: 0.1,
            mean_seconds: 0.1,
            wait_fraction: 0.0,
            workers: 1,
        };
        assert_eq!(s.next_split(&w, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 0 });
        assert_eq!(s.next_split(&w, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        // The worker has sent both; only the client's report makes them done.
        assert_eq!(s.jobs(&key())[0].in_flight, 2);
        s.report_window(&c, window.clone(), &[(0, 0)], t).unwrap();
        assert_eq!(s.jobs(&key())[0].done, 1);
        // The client goes silent holding split 1's last batch: split 1 is produced again.
        s.expire(t + Duration::from_secs(6));
        assert_eq!(s.jobs(&key())[0].requeued, 1);
        assert_eq!(s.next_split(&w, "j", &[], 0, t).unwrap(), Assignment::Split { epoch: 0, split: 1 });
        let c2 = s.register_client(key(), "j".into(), 0, None, t + Duration::from_secs(6));
        s.report_window(&c2, window, &[(0, 1)], t + Duration::from_secs(6)).unwrap();
        assert_eq!(s.jobs(&key())[0].epoch, 1, "every split reported: the next epoch");
    }

    #[test]
    fn silent_clients_detach() {
        let t = Instant::now();
        let mut s =
            DispatcherState::new("t", Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(5) });
        let c = s.register_client(key(), "j".into(), 0, None, t);
        assert_eq!(s.attached(), BTreeSet::from([key()]));
        let window = ClientWindow {
            batches: 0,
            median_seconds: 0.0,
            p90_seconds: 0.0,
            mean_seconds: 0.0,
            wait_fraction: 0.0,
            workers: 0,
        };
        s.report_window(&c, window, &[], t + Duration::from_secs(4)).unwrap();
        s.expire(t + Duration::from_secs(8));
        assert_eq!(s.attached(), BTreeSet::from([key()]), "reported at 4 s, alive until 9 s");
        s.expire(t + Duration::from_secs(10));
        assert!(s.attached().is_empty());
    }
}
