//! The dispatcher's bookkeeping, without I/O: it answers each RPC by combining who is alive
//! (`members`), which splits each job still needs (`ledger`), the clients' windows (`inbox`)
//! and the cache plans (`cache`). Time comes in as arguments, so failure handling (dead
//! workers, lost clients) is tested by moving a clock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use stoker_api::proto::HintBytes;
use stoker_api::window::Window;
use stoker_api::{CacheStatus, ClientId, JobName, Reading, ShareName, WorkerId};

use super::cache::Caches;
use super::inbox::{Inbox, JobWindows};
use super::ledger::{Assignment, HandOut, Reporter};
use super::members::{Client, Members, Progress, Timeouts, Worker};
use super::pipeline::{JobEntry, Phase, Pipeline, share_members};
use super::ranks::{Quota, Ranks};
use super::registration::{
    Acknowledgement, ClientRegistration, DispatchError, MAX_ID_BYTES, MAX_SPLITS, Registered, Rejoin, Resume,
    WorkerRegistration,
};
use super::share::SharedProduction;
use crate::autocache::plan::{Directive, Measured};
use crate::key::PipelineKey;

/// What a pipeline's clients are told: its live workers, each job's open epoch, and the
/// quotas of the jobs read by ranks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Listing {
    /// (address, id) of each live worker, sorted.
    pub workers: Arc<Vec<(String, WorkerId)>>,
    pub version: u64,
    pub epochs: BTreeMap<JobName, u64>,
    pub quotas: BTreeMap<JobName, Vec<(u64, Quota)>>,
    /// Each job's live clients.
    pub clients: BTreeMap<JobName, u32>,
}

pub struct DispatcherState {
    /// Tells this dispatcher's start from any other's (see `Rejoin`); never 0.
    incarnation: u64,
    timeouts: Timeouts,
    members: Members,
    pipelines: BTreeMap<PipelineKey, Pipeline>,
    inbox: Inbox,
    caches: Caches,
}

impl DispatcherState {
    pub fn new(instance: impl Into<String>, timeouts: Timeouts) -> Self {
        let instance = instance.into();
        DispatcherState {
            incarnation: incarnation(&instance),
            timeouts,
            members: Members::new(instance),
            pipelines: BTreeMap::new(),
            inbox: Inbox::default(),
            caches: Caches::default(),
        }
    }

    pub fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    pub fn register_worker(&mut self, r: WorkerRegistration, now: Instant) -> Result<WorkerId, DispatchError> {
        if r.address.is_empty() {
            return Err(DispatchError::Invalid("a worker must give the address clients reach it at".into()));
        }
        if r.splits == 0 {
            return Err(DispatchError::Invalid("a worker must plan at least one split".into()));
        }
        if r.splits > MAX_SPLITS {
            return Err(DispatchError::Invalid(format!("{} splits is above the limit of {MAX_SPLITS}", r.splits)));
        }
        check_id(r.worker_id.as_ref().map(WorkerId::as_str))?;
        // A new process at a live worker's address (a pod's IP given to its replacement, a
        // container restarted in its pod): that worker is gone, whatever its heartbeats say.
        let replaced: Vec<WorkerId> =
            self.members.workers_at(&r.address).filter(|id| r.worker_id.as_ref() != Some(*id)).cloned().collect();
        for id in replaced {
            let worker = self.members.remove_worker(&id).expect("listed above");
            self.worker_gone(&id, worker, "another worker registered at its address", now);
        }
        let has_workers = self.members.workers_of(&r.pipeline).next().is_some();
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
                *pipeline = Pipeline { plan: Some((r.splits, r.plan_digest.clone())), ..Pipeline::default() };
                self.caches.forget(&r.pipeline);
            }
            Some(_) => {}
            None => pipeline.plan = Some((r.splits, r.plan_digest.clone())),
        }
        // The newest worker's spec wins: epochs started from now on go out in its order.
        pipeline.shuffle_seed = r.shuffle_seed;
        pipeline.start_gathered();
        self.caches.register(&r.pipeline, r.cache_mode, &r.cache_hints, r.splits);
        let id = self.members.worker_id(r.worker_id);
        let worker = Worker {
            pipeline: r.pipeline,
            address: r.address,
            threads: r.threads,
            last_seen: now,
            progress: Progress::default(),
        };
        let key = worker.pipeline.clone();
        self.members.insert_worker(id.clone(), worker);
        self.relist(&key);
        Ok(id)
    }

    /// Records the pipeline's live worker addresses, moving the version on if they changed;
    /// returns the version.
    fn relist(&mut self, key: &PipelineKey) -> u64 {
        let mut workers: Vec<(String, WorkerId)> =
            self.members.workers_of(key).map(|(id, w)| (w.address.clone(), id.clone())).collect();
        workers.sort();
        let pipeline = self.pipelines.entry(key.clone()).or_default();
        if *pipeline.listed != workers {
            pipeline.listed = Arc::new(workers);
            pipeline.version += 1;
        }
        pipeline.version
    }

    /// The pipeline's workers, list version and jobs' open epochs, for its clients.
    pub fn listing(&self, key: &PipelineKey) -> Listing {
        let Some(p) = self.pipelines.get(key) else { return Listing::default() };
        // A job no worker has asked for yet starts where its clients said (a resumed one).
        Listing {
            workers: p.listed.clone(),
            version: p.version,
            epochs: p.jobs.iter().map(|(name, entry)| (name.clone(), entry.epoch())).collect(),
            quotas: p
                .jobs
                .iter()
                .filter_map(|(name, entry)| Some((name.clone(), entry.ranks.as_ref()?.quotas())))
                .collect(),
            clients: self.members.clients_per_job(key),
        }
    }

    /// The pipeline of a worker.
    pub fn pipeline_of_worker(&self, id: &WorkerId) -> Option<PipelineKey> {
        self.members.worker(id).map(|w| w.pipeline.clone())
    }

    /// The pipeline of a client.
    pub fn pipeline_of_client(&self, id: &ClientId) -> Option<PipelineKey> {
        self.members.client(id).map(|c| c.pipeline.clone())
    }

    /// Live clients of a job, by id.
    fn clients_of(&self, key: &PipelineKey, job: &JobName) -> BTreeSet<ClientId> {
        self.members.clients_of(key, job).cloned().collect()
    }

    pub fn heartbeat(&mut self, worker_id: &WorkerId, progress: Progress, now: Instant) -> Result<(), DispatchError> {
        let worker = self.members.seen_worker(worker_id, now)?;
        worker.progress = progress;
        let key = worker.pipeline.clone();
        let members = &self.members;
        let progress = &members.worker(worker_id).expect("seen above").progress.cache;
        // Summed over the pipeline's workers only while the plan measures: on every heartbeat
        // that made each second cost the square of the pipeline's workers.
        self.caches.reported(&key, progress, || measured(members.workers_of(&key).map(|(_, w)| w)));
        Ok(())
    }

    /// Splits of `epoch` of `job` the worker took and will not deliver: its producer stopped
    /// because no client read the epoch.
    pub fn give_back(
        &mut self,
        worker_id: &WorkerId,
        job: &JobName,
        epoch: u64,
        splits: &[u64],
        now: Instant,
    ) -> Result<(), DispatchError> {
        let key = self.members.seen_worker(worker_id, now)?.pipeline.clone();
        if let Some(state) = self.pipelines.get_mut(&key).and_then(|p| p.running(job)) {
            state.give_back(worker_id, epoch, splits);
        }
        Ok(())
    }

    /// Where the worker's next split gets its elements up to an autocache hint.
    pub fn cache_directive(&self, worker_id: &WorkerId) -> Directive {
        self.members.worker(worker_id).map_or(Directive::Compute, |w| self.caches.directive(&w.pipeline))
    }

    /// The echo factor of the pipeline's automatic `echo` from now on: splits of an epoch not
    /// handed out before get it (a split handed out again keeps its first). Before the
    /// pipeline's first worker registered there is nothing to set.
    pub fn set_echo(&mut self, key: &PipelineKey, factor: u32) {
        if let Some(pipeline) = self.pipelines.get_mut(key) {
            pipeline.echo = factor;
        }
    }

    /// Every pipeline's cache plan.
    pub fn cache_statuses(&self) -> BTreeMap<PipelineKey, CacheStatus> {
        self.pipelines.keys().filter_map(|k| Some((k.clone(), self.cache_status(k)?))).collect()
    }

    /// The pipeline's cache plan for status; `None` before its first worker registered.
    pub fn cache_status(&self, key: &PipelineKey) -> Option<CacheStatus> {
        let bytes = self
            .members
            .workers_of(key)
            .map(|(_, w)| w.progress.cache.hints.iter().map(|h| h.bytes).max().unwrap_or(0))
            .sum::<u64>();
        self.caches.status(key, (bytes > 0).then_some(bytes as i64))
    }

    /// Records `completed` and hands the worker its next split of `epoch` of `job`. A job the
    /// dispatcher does not know yet (first use, or after a restart) starts at that epoch.
    pub fn next_split(
        &mut self,
        worker_id: &WorkerId,
        job: &JobName,
        completed: &[(u64, u64)],
        epoch: u64,
        now: Instant,
    ) -> Result<Assignment, DispatchError> {
        self.next_production(worker_id, job, completed, epoch, now).map(|(a, _)| a)
    }

    /// `next_split`, and for a job of a share group the production the split is part of.
    pub fn next_production(
        &mut self,
        worker_id: &WorkerId,
        job: &JobName,
        completed: &[(u64, u64)],
        epoch: u64,
        now: Instant,
    ) -> Result<(Assignment, Option<SharedProduction>), DispatchError> {
        let key = self.members.seen_worker(worker_id, now)?.pipeline.clone();
        let claimed = self.members.clients_of(&key, job).next().is_some();
        let pipeline = self.pipelines.get_mut(&key).expect("a registered worker's pipeline exists");
        let plan = pipeline.ledger_plan();
        let entry = match pipeline.jobs.get_mut(job) {
            Some(entry) if claimed || matches!(entry.phase, Phase::Running(_)) => entry,
            // A job whose clients registered with another dispatcher (a plan changed under
            // them) starts at the epoch asked for.
            None if claimed => pipeline.jobs.entry(job.clone()).or_insert(JobEntry::declared(epoch)),
            // A job starts with its clients: one no client of which registered with this
            // dispatcher is one it restarted in the middle of, whose clients have not rejoined
            // yet (or one they left). Its splits wait for them.
            _ => return Ok((Assignment::Draining { epoch }, None)),
        };
        let live: BTreeSet<JobName> =
            self.members.clients_of_pipeline(&key).map(|(_, c)| c.job.clone()).chain([job.clone()]).collect();
        let share = entry.share.clone();
        // Nothing goes out while the job waits for its clients' states.
        let Some(state) = entry.start(&plan) else { return Ok((Assignment::Draining { epoch }, None)) };
        let directive = self.caches.directive(&key);
        if let Some((action, seconds)) = state.complete(completed, Reporter::Worker, &plan, now) {
            self.caches.epoch(&key, action, seconds);
        }
        // A job whose clients all left (a finished or crashed trial, a loader between the
        // clients of two epochs) gets nothing until one is back: made for nobody, its splits
        // would only fill the workers' queues, and be made again for whoever comes.
        if !claimed {
            return Ok((Assignment::Draining { epoch }, None));
        }
        let to = HandOut { worker: worker_id, directive: &directive, echo: pipeline.echo, now };
        let (assignment, production) = match share {
            Some(share) => {
                let mut jobs = share_members(&mut pipeline.jobs, &share, &live, &plan);
                let group = pipeline.shares.entry(share).or_default();
                match group.next(&mut jobs, job, epoch, &plan, to) {
                    Some((assignment, production)) => (assignment, Some(production)),
                    None => {
                        let (_, state) = jobs.iter_mut().find(|(name, _)| *name == job).expect("the asker runs");
                        // Nothing of the epoch now that no faster job would miss: ask again.
                        let (next, upcoming) = state.upcoming(&plan, 1);
                        if next == epoch && !upcoming.is_empty() {
                            (Assignment::Draining { epoch }, None)
                        } else {
                            (state.hand_out(epoch, &plan, to), None)
                        }
                    }
                }
            }
            None => (state.hand_out(epoch, &plan, to), None),
        };
        if let Assignment::Split { epoch, split, skip, echo } = &assignment {
            tracing::debug!(pipeline = %key, %job, worker = %worker_id, epoch, split, skip = skip.len(), echo, ?production, "handed out a split");
        }
        Ok((assignment, production))
    }

    /// Registers a consumer of a job. `consumers` > 1 declares a job read by that many ranks,
    /// `consumer_index` being this one's: every client of the job must declare the same, until
    /// none is left (then a new run of the job may have another count). With a saved state the
    /// client joins the job's new run from that step; rejoining, it tells a restarted
    /// dispatcher what it has of the job (see `gathering`).
    pub fn register_client(&mut self, r: ClientRegistration, now: Instant) -> Result<Registered, DispatchError> {
        let ClientRegistration {
            pipeline,
            job,
            consumer_index,
            consumers,
            coordinated,
            client_id,
            rejoin,
            resume,
            share,
        } = r;
        let reading = Reading::from_wire(consumers, consumer_index, coordinated).map_err(DispatchError::Invalid)?;
        check_id(client_id.as_ref().map(ClientId::as_str))?;
        let (job, start) = match resume {
            Some(resume) => {
                let epoch = resume.epoch;
                (self.resume(&pipeline, &job, consumer_index, consumers, resume)?, Some(epoch))
            }
            None => (job, None),
        };
        let others = self.members.clients_of(&pipeline, &job).filter(|id| client_id.as_ref() != Some(*id)).count();
        let pipeline_state = self.pipelines.entry(pipeline.clone()).or_default();
        let entry = pipeline_state.jobs.entry(job.clone()).or_insert_with(|| JobEntry::declared(start.unwrap_or(0)));
        if let (JobEntry { phase: Phase::Declared { start: first }, .. }, Some(start)) = (&mut *entry, start) {
            *first = start;
        }
        if entry.share != share {
            if others > 0 {
                return Err(DispatchError::Invalid(format!(
                    "job {job} is in share group {:?}, but this client names {:?}: every client of a job must name the same",
                    entry.share.as_ref().map(ShareName::as_str),
                    share.as_ref().map(ShareName::as_str)
                )));
            }
            entry.share = share;
        }
        let declared = entry.ranks.as_ref().map_or(Reading::Shared.shape(), Ranks::shape);
        let shape = reading.shape();
        if declared != shape {
            if others > 0 {
                return Err(DispatchError::Invalid(format!(
                    "job {job} is read by {declared}, but this client declares {shape}: every client of a job must declare the same"
                )));
            }
            entry.ranks = reading.is_ranked().then(|| Ranks::new(shape.ranks, shape.coordinated));
        }
        let id = self.members.client_id(client_id);
        if let Some(rejoin) = rejoin.filter(|r| r.incarnation != self.incarnation) {
            if let Some(ranks) = entry.ranks.as_mut() {
                ranks.rejoined(rejoin.open_epoch);
            }
            self.rejoin(&pipeline, &job, &id, consumer_index, consumers, rejoin, now);
        }
        self.members.insert_client(id.clone(), Client { pipeline, job: job.clone(), consumer_index, last_seen: now });
        Ok(Registered { client_id: id, job, incarnation: self.incarnation })
    }

    /// A client's batch-time window.
    pub fn report_window(&mut self, client_id: &ClientId, window: Window, now: Instant) -> Result<(), DispatchError> {
        window.check().map_err(|e| DispatchError::Invalid(e.to_string()))?;
        self.members.seen_client(client_id, now)?;
        self.inbox.push(client_id, window);
        Ok(())
    }

    /// A client's acknowledgement (see `Acknowledgement`). Returns the job's open epoch.
    pub fn acknowledge(
        &mut self,
        client_id: &ClientId,
        ack: Acknowledgement,
        now: Instant,
    ) -> Result<u64, DispatchError> {
        let Acknowledgement { completed, completed_again, version, held, received } = ack;
        let client = self.members.seen_client(client_id, now)?;
        let (key, job, rank) = (client.pipeline.clone(), client.job.clone(), client.consumer_index);
        let Some(pipeline) = self.pipelines.get_mut(&key) else { return Ok(0) };
        let plan = pipeline.ledger_plan();
        let Some(entry) = pipeline.jobs.get_mut(&job) else { return Ok(0) };
        if let Some(ranks) = entry.ranks.as_mut() {
            for (epoch, r) in received {
                ranks.report(rank, epoch, r);
            }
        }
        let by = entry.reporter(rank);
        let Some(state) = entry.running() else { return Ok(0) };
        if !completed.is_empty() || !held.is_empty() {
            tracing::debug!(
                pipeline = %key,
                %job,
                client = %client_id,
                version,
                ?completed,
                held = ?held.iter().map(|h| (h.epoch, h.split, h.positions.len())).collect::<Vec<_>>(),
                "acknowledged"
            );
        }
        state.acknowledge(client_id, version, &held, now);
        // Sent again after a lost answer: only what this dispatcher has not applied yet.
        let completed: Vec<(u64, u64)> = completed.into_iter().chain(state.unapplied(&completed_again, by)).collect();
        if let Some((action, seconds)) = state.complete(&completed, by, &plan, now) {
            self.caches.epoch(&key, action, seconds);
        }
        Ok(state.epoch())
    }

    /// A client closed. If it `discarded` batches (never handed to its training loop), the
    /// splits they completed may never be reported: as for a client that went silent, the
    /// job's in-flight splits are produced again.
    pub fn leave(&mut self, client_id: &ClientId, discarded: bool, now: Instant) {
        let Some(client) = self.members.remove_client(client_id) else { return };
        self.inbox.forget(client_id);
        self.client_gone(client_id, &client, discarded, now);
    }

    fn client_gone(&mut self, id: &ClientId, client: &Client, lost_batches: bool, now: Instant) {
        if let Some(state) = self.pipelines.get_mut(&client.pipeline).and_then(|p| p.running(&client.job)) {
            state.forget_client(id, now);
            if lost_batches {
                tracing::warn!(pipeline = %client.pipeline, job = %client.job, "a client went away holding batches; handing the job's in-flight splits out again");
                state.requeue(|_| true);
            }
        }
    }

    /// Drops workers and clients that went silent; returns the pipelines whose worker set changed.
    pub fn expire(&mut self, now: Instant) -> BTreeSet<PipelineKey> {
        let expired = self.members.expire(now, &self.timeouts);
        let mut changed = BTreeSet::new();
        for (id, client) in expired.clients {
            self.inbox.forget(&id);
            // Batches it had received but not reported are gone with it: produce them again.
            self.client_gone(&id, &client, true, now);
        }
        for (id, worker) in expired.workers {
            changed.insert(worker.pipeline.clone());
            self.worker_gone(&id, worker, "it stopped heartbeating", now);
        }
        changed.extend(self.gathered_late(now));
        // A client that never acknowledges holds a recovery up for at most its own timeout.
        for pipeline in self.pipelines.values_mut() {
            for job in pipeline.running_jobs() {
                job.give_up_waiting(now, self.timeouts.client);
            }
        }
        changed
    }

    /// A worker is gone (`why`): it leaves the list, and its splits are produced again without
    /// what the clients got of them, once they acknowledge the list without it.
    fn worker_gone(&mut self, id: &WorkerId, worker: Worker, why: &str, now: Instant) {
        tracing::warn!(worker = %id, address = %worker.address, pipeline = %worker.pipeline, "a worker is gone ({why}): its splits are produced again without what clients got");
        let version = self.relist(&worker.pipeline);
        if let Some(pipeline) = self.pipelines.get_mut(&worker.pipeline) {
            for share in pipeline.shares.values_mut() {
                share.forget_worker(id);
            }
        }
        let jobs: Vec<JobName> =
            self.pipelines.get(&worker.pipeline).map(|p| p.jobs.keys().cloned().collect()).unwrap_or_default();
        for job in jobs {
            let clients = self.clients_of(&worker.pipeline, &job);
            if let Some(state) = self.pipelines.get_mut(&worker.pipeline).and_then(|p| p.running(&job)) {
                // Also splits whose last batch this worker sent but no client reported yet:
                // they may have died in its buffers.
                state.recover(id, version, &clients, now);
            }
        }
    }

    /// Addresses of a pipeline's live workers, sorted.
    pub fn worker_addresses(&self, pipeline: &PipelineKey) -> Vec<String> {
        let mut addresses: Vec<String> = self.members.workers_of(pipeline).map(|(_, w)| w.address.clone()).collect();
        addresses.sort();
        addresses.dedup();
        addresses
    }

    pub fn worker_progress(&self, pipeline: &PipelineKey) -> Vec<(WorkerId, u32, Progress)> {
        self.members.workers_of(pipeline).map(|(id, w)| (id.clone(), w.threads, w.progress.clone())).collect()
    }

    /// Every (pipeline, job) with live clients, with the windows reported since the last call.
    pub fn take_windows(&mut self) -> Vec<JobWindows> {
        self.inbox.take(self.members.clients())
    }

    /// Pipelines with at least one live client.
    pub fn attached(&self) -> BTreeSet<PipelineKey> {
        self.members.attached()
    }

    pub fn consumers(&self, pipeline: &PipelineKey, job: &JobName) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .members
            .clients_of_pipeline(pipeline)
            .filter(|(_, c)| c.job == *job)
            .map(|(_, c)| c.consumer_index)
            .collect();
        v.sort_unstable();
        v
    }
}

/// A pipeline's workers' cache measurements, summed.
fn measured<'a>(workers: impl Iterator<Item = &'a Worker>) -> Measured {
    let mut m = Measured::default();
    for w in workers {
        let (p, c) = (&w.progress, &w.progress.cache);
        m.workers += 1;
        m.threads = m.threads.max(w.threads);
        // Saturating: the counts are the workers' word.
        m.splits = m.splits.saturating_add(c.splits_measured);
        m.elements = m.elements.saturating_add(p.elements.saturating_sub(c.elements_read));
        if m.op_seconds.len() < p.ops.len() {
            m.op_seconds.resize(p.ops.len(), 0.0);
        }
        for (total, op) in m.op_seconds.iter_mut().zip(&p.ops) {
            *total += op.seconds;
        }
        for h in &c.hints {
            HintBytes::add_into(&mut m.hint_bytes, h);
        }
        // The volume is shared: any worker's probe measures it.
        m.write_bytes_per_second = m.write_bytes_per_second.max(c.write_bytes_per_second);
        m.read_bytes_per_second = m.read_bytes_per_second.max(c.read_bytes_per_second);
    }
    m
}

/// An id a registration asks to keep must be short (see `MAX_ID_BYTES`).
fn check_id(id: Option<&str>) -> Result<(), DispatchError> {
    match id {
        Some(id) if id.len() > MAX_ID_BYTES => {
            Err(DispatchError::Invalid(format!("an id of {} bytes is longer than {MAX_ID_BYTES}", id.len())))
        }
        _ => Ok(()),
    }
}

/// A number for a dispatcher's start, from its instance name: never 0 (a standalone worker's).
fn incarnation(instance: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    instance.hash(&mut hasher);
    hasher.finish().max(1)
}

#[path = "state_gather.rs"]
mod gather;

#[path = "state_report.rs"]
mod report;

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "state_bounds_tests.rs"]
mod bounds_tests;

#[cfg(test)]
#[path = "state_share_tests.rs"]
mod share_tests;
