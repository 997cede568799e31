//! Who is alive: the registered workers and clients, their ids, what each last reported, and
//! when each was last heard from. Silent ones expire; what they held is the ledger's business.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stoker_api::{ClientId, JobName, WorkerId};

use super::cache::CacheProgress;
use crate::key::PipelineKey;

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

/// A worker's cumulative counters, from its last heartbeat.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub records: u64,
    pub elements: u64,
    pub batches: u64,
    pub batch_bytes: u64,
    pub skipped: BTreeMap<String, u64>,
    /// Per transform, in spec order.
    pub ops: Vec<stoker_api::OpTotals>,
    pub error: Option<String>,
    pub cache: CacheProgress,
    /// Bounded (`stoker_api::bounded_warnings`) as it arrives.
    pub warnings: Vec<String>,
    /// Elements from each source of the mix, in spec order.
    pub source_elements: Vec<u64>,
    /// Share groups' productions on the worker.
    pub sharing: stoker_api::proto::SharingProgress,
}

pub struct Worker {
    pub pipeline: PipelineKey,
    pub address: String,
    pub threads: u32,
    pub last_seen: Instant,
    pub progress: Progress,
}

pub struct Client {
    pub pipeline: PipelineKey,
    pub job: JobName,
    pub consumer_index: u32,
    pub last_seen: Instant,
}

/// Workers and clients by id, and indexed by pipeline (clients also by job) and workers by
/// address, so that a call about one pipeline costs what that pipeline has, not what the
/// dispatcher has: a heartbeat or an acknowledgement scanning every member made a thousand
/// workers' calls cost a thousand times more each.
pub struct Members {
    /// Distinguishes ids handed out by different dispatcher instances.
    instance: String,
    next_id: u64,
    workers: BTreeMap<WorkerId, Worker>,
    clients: BTreeMap<ClientId, Client>,
    workers_by_pipeline: BTreeMap<PipelineKey, BTreeSet<WorkerId>>,
    clients_by_job: BTreeMap<PipelineKey, BTreeMap<JobName, BTreeSet<ClientId>>>,
    workers_by_address: BTreeMap<String, BTreeSet<WorkerId>>,
}

/// Members that went silent, by id.
pub struct Expired {
    pub workers: Vec<(WorkerId, Worker)>,
    pub clients: Vec<(ClientId, Client)>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unknown {kind} {id}: register again")]
pub struct Unknown {
    pub kind: &'static str,
    pub id: String,
}

/// Adds `id` to the set at `key`.
fn index<K: Ord, I: Ord + Clone>(sets: &mut BTreeMap<K, BTreeSet<I>>, key: K, id: &I) {
    sets.entry(key).or_default().insert(id.clone());
}

/// Removes `id` from the set at `key`, and the set once empty.
fn unindex<K: Ord, I: Ord>(sets: &mut BTreeMap<K, BTreeSet<I>>, key: &K, id: &I) {
    if let Some(set) = sets.get_mut(key) {
        set.remove(id);
        if set.is_empty() {
            sets.remove(key);
        }
    }
}

impl Members {
    pub fn new(instance: String) -> Self {
        Members {
            instance,
            next_id: 0,
            workers: BTreeMap::new(),
            clients: BTreeMap::new(),
            workers_by_pipeline: BTreeMap::new(),
            clients_by_job: BTreeMap::new(),
            workers_by_address: BTreeMap::new(),
        }
    }

    /// The id a worker's registration asked to keep (after a dispatcher restart), else a
    /// fresh one.
    pub fn worker_id(&mut self, kept: Option<WorkerId>) -> WorkerId {
        kept.filter(|id| !id.is_empty()).unwrap_or_else(|| self.fresh("w").into())
    }

    /// As `worker_id`, for a client.
    pub fn client_id(&mut self, kept: Option<ClientId>) -> ClientId {
        kept.filter(|id| !id.is_empty()).unwrap_or_else(|| self.fresh("c").into())
    }

    /// A fresh name for a new run of `job` (resumed from a saved state).
    pub fn run_of(&mut self, job: &JobName) -> JobName {
        self.fresh(&format!("{job}~run")).into()
    }

    fn fresh(&mut self, kind: &str) -> String {
        self.next_id += 1;
        format!("{kind}-{}-{}", self.instance, self.next_id)
    }

    pub fn worker(&self, id: &WorkerId) -> Option<&Worker> {
        self.workers.get(id)
    }

    pub fn client(&self, id: &ClientId) -> Option<&Client> {
        self.clients.get(id)
    }

    /// Every live worker, by id.
    pub fn workers(&self) -> impl Iterator<Item = (&WorkerId, &Worker)> {
        self.workers.iter()
    }

    /// Every live client, by id.
    pub fn clients(&self) -> impl Iterator<Item = (&ClientId, &Client)> {
        self.clients.iter()
    }

    /// Adds (or replaces) worker `id`.
    pub fn insert_worker(&mut self, id: WorkerId, worker: Worker) {
        self.remove_worker(&id);
        index(&mut self.workers_by_pipeline, worker.pipeline.clone(), &id);
        index(&mut self.workers_by_address, worker.address.clone(), &id);
        self.workers.insert(id, worker);
    }

    pub fn remove_worker(&mut self, id: &WorkerId) -> Option<Worker> {
        let worker = self.workers.remove(id)?;
        unindex(&mut self.workers_by_pipeline, &worker.pipeline, id);
        unindex(&mut self.workers_by_address, &worker.address, id);
        Some(worker)
    }

    /// Adds (or replaces) client `id`.
    pub fn insert_client(&mut self, id: ClientId, client: Client) {
        self.remove_client(&id);
        let jobs = self.clients_by_job.entry(client.pipeline.clone()).or_default();
        index(jobs, client.job.clone(), &id);
        self.clients.insert(id, client);
    }

    pub fn remove_client(&mut self, id: &ClientId) -> Option<Client> {
        let client = self.clients.remove(id)?;
        if let Some(jobs) = self.clients_by_job.get_mut(&client.pipeline) {
            unindex(jobs, &client.job, id);
            if jobs.is_empty() {
                self.clients_by_job.remove(&client.pipeline);
            }
        }
        Some(client)
    }

    /// The worker, marked as heard from at `now`.
    pub fn seen_worker(&mut self, id: &WorkerId, now: Instant) -> Result<&mut Worker, Unknown> {
        let worker = self.workers.get_mut(id).ok_or_else(|| Unknown { kind: "worker", id: id.to_string() })?;
        worker.last_seen = now;
        Ok(worker)
    }

    /// The client, marked as heard from at `now`.
    pub fn seen_client(&mut self, id: &ClientId, now: Instant) -> Result<&mut Client, Unknown> {
        let client = self.clients.get_mut(id).ok_or_else(|| Unknown { kind: "client", id: id.to_string() })?;
        client.last_seen = now;
        Ok(client)
    }

    pub fn workers_of<'a>(&'a self, pipeline: &PipelineKey) -> impl Iterator<Item = (&'a WorkerId, &'a Worker)> + 'a {
        let ids = self.workers_by_pipeline.get(pipeline).into_iter().flatten();
        ids.map(|id| (id, &self.workers[id]))
    }

    /// Ids of the workers registered at `address`.
    pub fn workers_at(&self, address: &str) -> impl Iterator<Item = &WorkerId> {
        self.workers_by_address.get(address).into_iter().flatten()
    }

    /// Ids of a job's live clients.
    pub fn clients_of<'a>(&'a self, pipeline: &PipelineKey, job: &JobName) -> impl Iterator<Item = &'a ClientId> + 'a {
        self.clients_by_job.get(pipeline).and_then(|jobs| jobs.get(job)).into_iter().flatten()
    }

    /// A pipeline's live clients, by id.
    pub fn clients_of_pipeline<'a>(
        &'a self,
        pipeline: &PipelineKey,
    ) -> impl Iterator<Item = (&'a ClientId, &'a Client)> + 'a {
        let ids = self.clients_by_job.get(pipeline).into_iter().flat_map(BTreeMap::values).flatten();
        ids.map(|id| (id, &self.clients[id]))
    }

    /// How many live clients each of a pipeline's jobs has.
    pub fn clients_per_job(&self, pipeline: &PipelineKey) -> BTreeMap<JobName, u32> {
        let jobs = self.clients_by_job.get(pipeline).into_iter().flatten();
        jobs.map(|(job, ids)| (job.clone(), ids.len() as u32)).collect()
    }

    /// Removes the workers and clients silent longer than their timeouts, and returns them.
    pub fn expire(&mut self, now: Instant, timeouts: &Timeouts) -> Expired {
        let silent = |last_seen: Instant, timeout: Duration| now.saturating_duration_since(last_seen) > timeout;
        let dead: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| silent(w.last_seen, timeouts.worker))
            .map(|(id, _)| id.clone())
            .collect();
        let gone: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| silent(c.last_seen, timeouts.client))
            .map(|(id, _)| id.clone())
            .collect();
        Expired {
            workers: dead.into_iter().map(|id| (id.clone(), self.remove_worker(&id).expect("listed above"))).collect(),
            clients: gone.into_iter().map(|id| (id.clone(), self.remove_client(&id).expect("listed above"))).collect(),
        }
    }

    /// Pipelines with at least one live client.
    pub fn attached(&self) -> BTreeSet<PipelineKey> {
        self.clients_by_job.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(now: Instant) -> Worker {
        Worker {
            pipeline: PipelineKey::new("ns", "p"),
            address: "a:1".into(),
            threads: 1,
            last_seen: now,
            progress: Progress::default(),
        }
    }

    fn client(job: &str, now: Instant) -> Client {
        Client { pipeline: PipelineKey::new("ns", "p"), job: job.into(), consumer_index: 0, last_seen: now }
    }

    #[test]
    fn a_pipelines_members_are_found_by_its_indexes_until_they_go() {
        let t = Instant::now();
        let key = PipelineKey::new("ns", "p");
        let mut m = Members::new("i".into());
        m.insert_client("c1".into(), client("j", t));
        m.insert_client("c2".into(), client("j", t));
        m.insert_client("c3".into(), client("k", t));
        // Registering again under the same id, for another job: indexed once, under it.
        m.insert_client("c2".into(), client("k", t));
        assert_eq!(m.clients_per_job(&key), BTreeMap::from([("j".into(), 1), ("k".into(), 2)]));
        assert_eq!(m.clients_of(&key, &"k".into()).collect::<Vec<_>>(), vec!["c2", "c3"]);
        for id in ["c1", "c2", "c3"] {
            m.remove_client(&id.into());
        }
        assert!(m.attached().is_empty() && m.clients_per_job(&key).is_empty());
        m.insert_worker("w".into(), worker(t));
        m.insert_worker("w".into(), Worker { address: "b:1".into(), ..worker(t) });
        assert_eq!(m.workers_at("a:1").count(), 0, "moved to another address");
        assert_eq!(m.workers_at("b:1").collect::<Vec<_>>(), vec!["w"]);
        assert_eq!(m.workers_of(&PipelineKey::new("ns", "other")).count(), 0);
    }

    #[test]
    fn ids_are_fresh_per_instance_unless_one_is_kept() {
        let mut m = Members::new("i1".into());
        assert_eq!(m.worker_id(None), "w-i1-1");
        assert_eq!(m.client_id(Some("".into())), "c-i1-2");
        assert_eq!(m.worker_id(Some("w-i0-7".into())), "w-i0-7");
        assert_eq!(m.run_of(&"train".into()), "train~run-i1-3");
    }

    #[test]
    fn only_the_silent_expire_and_hearing_from_one_keeps_it() {
        let t = Instant::now();
        let timeouts = Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(5) };
        let mut m = Members::new("i".into());
        m.insert_worker("quiet".into(), worker(t));
        m.insert_worker("talking".into(), Worker { address: "b:1".into(), ..worker(t) });
        m.seen_worker(&"talking".into(), t + Duration::from_secs(4)).unwrap();
        let expired = m.expire(t + Duration::from_secs(6), &timeouts);
        assert_eq!(expired.workers.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), vec!["quiet"]);
        assert!(expired.clients.is_empty());
        assert_eq!(m.workers().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), vec!["talking"]);
        let key = PipelineKey::new("ns", "p");
        assert_eq!(m.workers_of(&key).map(|(id, _)| id.as_str()).collect::<Vec<_>>(), vec!["talking"], "indexed too");
        assert_eq!(m.workers_at("a:1").count(), 0, "its address forgotten");
        assert_eq!(m.seen_worker(&"quiet".into(), t).err(), Some(Unknown { kind: "worker", id: "quiet".into() }));
    }
}
