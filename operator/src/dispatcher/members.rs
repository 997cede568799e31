//! Who is alive: the registered workers and clients, their ids, what each last reported, and
//! when each was last heard from. Silent ones expire; what they held is the ledger's business.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

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
    pub op_seconds: Vec<f64>,
    pub error: Option<String>,
    pub cache: CacheProgress,
    /// Bounded (`stoker_api::bounded_warnings`) as it arrives.
    pub warnings: Vec<String>,
    /// Elements from each source of the mix, in spec order.
    pub source_elements: Vec<u64>,
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
    pub job: String,
    pub consumer_index: u32,
    pub last_seen: Instant,
}

/// Workers and clients by id.
pub struct Members {
    /// Distinguishes ids handed out by different dispatcher instances.
    instance: String,
    next_id: u64,
    pub workers: BTreeMap<String, Worker>,
    pub clients: BTreeMap<String, Client>,
}

/// Members that went silent, by id.
pub struct Expired {
    pub workers: Vec<(String, Worker)>,
    pub clients: Vec<(String, Client)>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unknown {kind} {id}: register again")]
pub struct Unknown {
    pub kind: &'static str,
    pub id: String,
}

impl Members {
    pub fn new(instance: String) -> Self {
        Members { instance, next_id: 0, workers: BTreeMap::new(), clients: BTreeMap::new() }
    }

    /// The id a registration asked to keep (after a dispatcher restart), else a fresh one.
    pub fn id(&mut self, kind: &str, kept: Option<String>) -> String {
        match kept.filter(|id| !id.is_empty()) {
            Some(id) => id,
            None => {
                self.next_id += 1;
                format!("{kind}-{}-{}", self.instance, self.next_id)
            }
        }
    }

    /// The worker, marked as heard from at `now`.
    pub fn seen_worker(&mut self, id: &str, now: Instant) -> Result<&mut Worker, Unknown> {
        let worker = self.workers.get_mut(id).ok_or_else(|| Unknown { kind: "worker", id: id.into() })?;
        worker.last_seen = now;
        Ok(worker)
    }

    /// The client, marked as heard from at `now`.
    pub fn seen_client(&mut self, id: &str, now: Instant) -> Result<&mut Client, Unknown> {
        let client = self.clients.get_mut(id).ok_or_else(|| Unknown { kind: "client", id: id.into() })?;
        client.last_seen = now;
        Ok(client)
    }

    pub fn workers_of<'a>(&'a self, pipeline: &'a PipelineKey) -> impl Iterator<Item = (&'a String, &'a Worker)> + 'a {
        self.workers.iter().filter(move |(_, w)| &w.pipeline == pipeline)
    }

    /// Removes the workers and clients silent longer than their timeouts, and returns them.
    pub fn expire(&mut self, now: Instant, timeouts: &Timeouts) -> Expired {
        let silent = |last_seen: Instant, timeout: Duration| now.saturating_duration_since(last_seen) > timeout;
        let dead: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| silent(w.last_seen, timeouts.worker))
            .map(|(id, _)| id.clone())
            .collect();
        let gone: Vec<String> = self
            .clients
            .iter()
            .filter(|(_, c)| silent(c.last_seen, timeouts.client))
            .map(|(id, _)| id.clone())
            .collect();
        Expired {
            workers: dead.into_iter().map(|id| (id.clone(), self.workers.remove(&id).expect("listed above"))).collect(),
            clients: gone.into_iter().map(|id| (id.clone(), self.clients.remove(&id).expect("listed above"))).collect(),
        }
    }

    /// Pipelines with at least one live client.
    pub fn attached(&self) -> BTreeSet<PipelineKey> {
        self.clients.values().map(|c| c.pipeline.clone()).collect()
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

    #[test]
    fn ids_are_fresh_per_instance_unless_one_is_kept() {
        let mut m = Members::new("i1".into());
        assert_eq!(m.id("w", None), "w-i1-1");
        assert_eq!(m.id("c", Some(String::new())), "c-i1-2");
        assert_eq!(m.id("w", Some("w-i0-7".into())), "w-i0-7");
    }

    #[test]
    fn only_the_silent_expire_and_hearing_from_one_keeps_it() {
        let t = Instant::now();
        let timeouts = Timeouts { worker: Duration::from_secs(5), client: Duration::from_secs(5) };
        let mut m = Members::new("i".into());
        m.workers.insert("quiet".into(), worker(t));
        m.workers.insert("talking".into(), worker(t));
        m.seen_worker("talking", t + Duration::from_secs(4)).unwrap();
        let expired = m.expire(t + Duration::from_secs(6), &timeouts);
        assert_eq!(expired.workers.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), vec!["quiet"]);
        assert!(expired.clients.is_empty());
        assert_eq!(m.workers.keys().collect::<Vec<_>>(), vec!["talking"]);
        assert_eq!(m.seen_worker("quiet", t).err(), Some(Unknown { kind: "worker", id: "quiet".into() }));
    }
}
