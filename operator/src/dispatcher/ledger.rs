//! The split ledger of one job: which splits of its epoch are waiting, held by a worker,
//! recovering from a dead one, or done, and the next epoch started early by workers with
//! nothing left in this one.
//!
//! A split is done when a client reports receiving the batch holding its last element (or the
//! batch without tensors that says a split produced nothing more). For a job read by ranks,
//! every rank gets the split's completion behind its own batches of it, and the split is done
//! once every rank has reported it.
//!
//! A split held by a worker that dies is recovering: every live client of the job stops
//! streaming from that worker and acknowledges with the rows of the split it received (their
//! positions), and the split goes back to the queue to be produced again without those rows,
//! so each element reaches the job once. A client that never acknowledges holds this up for
//! at most the client timeout; the split then goes back with what is known, and rows may
//! repeat. A client that goes silent takes the job's in-flight splits back to the queue whole
//! (its unreported batches are lost with it): then too rows may repeat. Repeats are counted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use stoker_api::{CacheDecision, ClientId, JobName, WorkerId, order};

use super::gathering::Gathered;
use super::queue::SplitQueue;
use crate::autocache::plan::Directive;

/// The splits an epoch has, and the seed of the order they go out in (None: 0, 1, 2, ...).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    pub splits: u64,
    pub order: Option<u64>,
}

/// What a worker should do next for a job.
#[derive(Clone, Debug, PartialEq)]
pub enum Assignment {
    Split {
        epoch: u64,
        split: u64,
        /// Positions already delivered by an earlier attempt: not to be produced again.
        skip: Vec<u32>,
        /// The split's echo factor (0: the pipeline's own), the same at every hand-out of it
        /// in the epoch, so that an attempt again names the same copies.
        echo: u32,
    },
    /// Nothing to hand out in `epoch` now: other workers hold its last splits (one may come
    /// back if its worker dies), or it is more than one ahead of the job.
    Draining { epoch: u64 },
    /// Every split of `epoch` is done.
    Finished { epoch: u64 },
}

/// What a split is handed out with: the worker it goes to, what it does with the cache, the
/// echo factor in force (0: the pipeline's own), and when.
#[derive(Clone, Copy, Debug)]
pub struct HandOut<'a> {
    pub worker: &'a WorkerId,
    pub directive: &'a Directive,
    pub echo: u32,
    pub now: Instant,
}

/// A split a job waits for: in which epoch, and the echo factor an earlier attempt of it in
/// that epoch had.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wanted {
    pub epoch: u64,
    pub echo: Option<u32>,
}

/// A split whose worker died, waiting for the clients that may hold some of its rows.
struct Recovery {
    /// The worker list without the dead worker: clients acknowledge this version or later.
    version: u64,
    /// Live clients of the job that have not acknowledged yet.
    waiting: BTreeSet<ClientId>,
    since: Instant,
}

/// One pass over the pipeline's splits.
#[derive(Default)]
struct Pass {
    pending: SplitQueue,
    /// Split -> the worker holding it.
    assigned: HashMap<u64, WorkerId>,
    recovering: BTreeMap<u64, Recovery>,
    /// Positions of unfinished splits already delivered, from the clients' acknowledgements.
    delivered: HashMap<u64, BTreeSet<u32>>,
    /// Ranks that reported an unfinished split complete (a job read by ranks).
    completed_by: HashMap<u64, BTreeSet<u32>>,
    done: BTreeSet<u64>,
    /// When its first split was handed out, and how many were computed, put and got.
    started: Option<Instant>,
    actions: [u64; 3],
    /// Each split's echo factor, from its first hand-out.
    echo: HashMap<u64, u32>,
}

impl Pass {
    /// Every split of `epoch`, waiting in the epoch's order: with a seed, a fresh permutation
    /// each epoch, so consecutive splits of the listing do not reach the trainer side by side.
    fn full(plan: &Plan, epoch: u64) -> Pass {
        let mut pending: Vec<u64> = (0..plan.splits).collect();
        if let Some(seed) = plan.order {
            order::shuffle(&mut pending, seed, epoch, |&split| split);
        }
        Pass { pending: SplitQueue::new(pending), ..Pass::default() }
    }

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

    /// Puts `lost` back at the front of the queue; returns how many.
    fn requeue(&mut self, lost: impl IntoIterator<Item = u64>) -> u64 {
        let mut lost: Vec<u64> = lost.into_iter().collect();
        lost.sort_unstable();
        for &split in lost.iter().rev() {
            self.assigned.remove(&split);
            self.recovering.remove(&split);
            self.pending.push_front(split);
        }
        lost.len() as u64
    }

    /// Requeues the recovering splits no client holds up any more (all acknowledged, or
    /// waited for longer than `patience`); returns how many waited that long.
    fn release(&mut self, now: Instant, patience: Duration) -> u64 {
        let ready: Vec<(u64, bool)> = self
            .recovering
            .iter()
            .filter_map(|(&split, r)| {
                let late = now.saturating_duration_since(r.since) >= patience;
                (r.waiting.is_empty() || late).then_some((split, !r.waiting.is_empty()))
            })
            .collect();
        self.requeue(ready.iter().map(|(split, _)| *split));
        ready.iter().filter(|(_, late)| *late).count() as u64
    }

    fn finish(&mut self, split: u64) -> bool {
        self.assigned.remove(&split);
        self.recovering.remove(&split);
        self.delivered.remove(&split);
        self.completed_by.remove(&split);
        self.done.insert(split)
    }
}

/// Who reports completions: a worker, or a client, which for a job read by ranks is one rank
/// of `consumers` (a split is done once each has reported it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reporter {
    Worker,
    Client { rank: u32, consumers: u32 },
}

/// Rows of an unfinished split a client received from a worker that left the list.
#[derive(Clone, Debug, PartialEq)]
pub struct Held {
    pub epoch: u64,
    pub split: u64,
    pub positions: Vec<u32>,
}

/// A job's passes: the oldest unfinished epoch, and the one after it. Workers with nothing
/// left in the first start the second instead of idling until the last split of the first
/// reaches a client, which would cost every epoch a stall as long as a split's trip.
#[derive(Default)]
pub struct Job {
    epoch: u64,
    current: Pass,
    next: Option<Pass>,
    /// Splits completed more than once (after a requeue, or late by a presumed-dead worker).
    repeats: u64,
    /// Splits taken back from dead workers.
    requeued: u64,
    /// Elements left out of splits produced again because they had been delivered.
    skipped: u64,
    /// Recoveries that gave up waiting for a client's acknowledgement.
    unacknowledged: u64,
    /// How fast the job's consumers take its splits.
    read: Rate,
}

/// Splits done per second, averaged over the last [`Rate::SECONDS`] or so.
#[derive(Default, Clone, Copy, Debug)]
pub struct Rate {
    per_second: f64,
    last: Option<Instant>,
}

impl Rate {
    const SECONDS: f64 = 10.0;

    fn add(&mut self, n: usize, now: Instant) {
        self.per_second = self.at(now) + n as f64 / Self::SECONDS;
        self.last = Some(now);
    }

    /// The rate at `now`: it decays while nothing is done.
    pub fn at(&self, now: Instant) -> f64 {
        let idle = self.last.map_or(0.0, |last| now.saturating_duration_since(last).as_secs_f64());
        self.per_second * (-idle / Self::SECONDS).exp()
    }
}

/// A job's delivery counters, for status and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSummary {
    pub job: JobName,
    pub epoch: u64,
    pub splits: u64,
    pub done: u64,
    pub in_flight: u64,
    /// Distinct workers holding the in-flight splits.
    pub holders: u64,
    pub repeats: u64,
    pub requeued: u64,
    /// Splits waiting for the clients' acknowledgements after their worker died.
    pub recovering: u64,
    pub skipped: u64,
    pub unacknowledged: u64,
}

impl Job {
    /// A job first seen at `epoch` (a restarted dispatcher resumes where the workers are).
    pub fn starting(epoch: u64, plan: &Plan) -> Job {
        Job { epoch, current: Pass::full(plan, epoch), ..Job::default() }
    }

    /// A job going on from what its clients have (see `gathering`): a split whose completion
    /// every rank (any client of a shared job, `consumers` 0 or 1) has is done, and the others
    /// go out without the rows they have (a split all of whose rows they have produces nothing
    /// and completes at once).
    pub fn rebuilt(gathered: &Gathered, plan: &Plan, consumers: u32) -> Job {
        let mut job = Job::starting(gathered.epoch, plan);
        if gathered.incomplete {
            job.unacknowledged += 1;
        }
        for h in gathered.rows.iter().filter(|h| h.split < plan.splits) {
            if let Some(pass) = job.open_pass(h.epoch, plan) {
                pass.delivered.entry(h.split).or_default().extend(h.positions.iter().copied());
            }
        }
        for (&(e, split), ranks) in gathered.completed.iter().filter(|((_, s), _)| *s < plan.splits) {
            let Some(pass) = job.open_pass(e, plan) else { continue };
            if ranks.len() as u32 >= consumers.max(1) {
                pass.finish(split);
                pass.pending.remove(split);
            } else {
                pass.completed_by.insert(split, ranks.clone());
            }
        }
        while plan.splits > 0 && job.current.done.len() as u64 == plan.splits {
            job.current = job.next.take().unwrap_or_else(|| Pass::full(plan, job.epoch.saturating_add(1)));
            job.epoch = job.epoch.saturating_add(1);
        }
        job
    }

    fn passes(&self) -> impl Iterator<Item = &Pass> {
        std::iter::once(&self.current).chain(self.next.as_ref())
    }

    fn passes_mut(&mut self) -> impl Iterator<Item = &mut Pass> {
        std::iter::once(&mut self.current).chain(self.next.as_mut())
    }

    /// The next split of `epoch` to produce. Workers produce each epoch on its own (clients
    /// stream each on its own), the open one and the next: a worker with nothing left in the
    /// open epoch starts the next instead of idling until the open one's last split reaches a
    /// client, and no further, so nothing runs more than an epoch ahead.
    pub fn hand_out(&mut self, epoch: u64, plan: &Plan, to: HandOut) -> Assignment {
        let pass = match self.takeable(epoch, plan) {
            Ok(pass) => pass,
            Err(answer) => return answer,
        };
        match pass.pending.pop_front() {
            Some(split) => self.give(epoch, split, to),
            None => Assignment::Draining { epoch },
        }
    }

    /// The pass a worker may take splits of `epoch` from now, or what it is told instead.
    fn takeable(&mut self, epoch: u64, plan: &Plan) -> Result<&mut Pass, Assignment> {
        match epoch.checked_sub(self.epoch) {
            None => Err(Assignment::Finished { epoch }),
            Some(0) => Ok(&mut self.current),
            // Only once the open epoch has nothing left to hand out: until then its work comes
            // first (and its epoch time is not stretched by a split taken early).
            Some(1) if !self.current.pending.is_empty() => Err(Assignment::Draining { epoch }),
            Some(1) => Ok(self.next.get_or_insert_with(|| Pass::full(plan, epoch))),
            Some(_) => Err(Assignment::Draining { epoch }),
        }
    }

    /// Records `split` of `epoch` (out of its queue) as held by the worker it goes to.
    fn give(&mut self, epoch: u64, split: u64, to: HandOut) -> Assignment {
        let HandOut { worker, directive, echo, now } = to;
        let pass = self.pass_mut(epoch).expect("a takeable pass is open");
        let skip: Vec<u32> = pass.delivered.get(&split).map(|d| d.iter().copied().collect()).unwrap_or_default();
        pass.assigned.insert(split, worker.clone());
        pass.started.get_or_insert(now);
        pass.actions[match directive {
            Directive::Compute => 0,
            Directive::Put(_) => 1,
            Directive::Get(_) => 2,
        }] += 1;
        let echo = *pass.echo.entry(split).or_insert(echo);
        self.skipped += skip.len() as u64;
        Assignment::Split { epoch, split, skip, echo }
    }

    /// What this job would take next (for a share group: see `share`): the epoch, and its
    /// first `n` waiting splits in order: the open epoch's, or once none waits there, the next
    /// epoch's.
    pub fn upcoming(&mut self, plan: &Plan, n: usize) -> (u64, Vec<u64>) {
        let epoch = if self.current.pending.is_empty() { self.epoch.saturating_add(1) } else { self.epoch };
        let splits = self.takeable(epoch, plan).map(|pass| pass.pending.iter().take(n).collect()).unwrap_or_default();
        (epoch, splits)
    }

    /// Whether this job waits for `split` now, and in which epoch (the open one, or the next
    /// once the open one has nothing left to hand out), with the echo factor an earlier attempt
    /// gave it in that epoch (its copies must be the same again).
    pub fn wants(&self, split: u64, plan: &Plan) -> Option<Wanted> {
        let wanted = |epoch: u64, pass: &Pass| {
            pass.pending.contains(split).then(|| Wanted { epoch, echo: pass.echo.get(&split).copied() })
        };
        if !self.current.pending.is_empty() {
            return wanted(self.epoch, &self.current);
        }
        let next = self.epoch.saturating_add(1);
        match &self.next {
            Some(pass) => wanted(next, pass),
            // Not made yet: every split of it waits.
            None => (split < plan.splits).then_some(Wanted { epoch: next, echo: None }),
        }
    }

    /// Takes `split` of `epoch` out of the job's order for the worker it goes to (a share
    /// group's production of it: see `share`); None unless `wants` said so.
    pub fn take(&mut self, epoch: u64, split: u64, plan: &Plan, to: HandOut) -> Option<Assignment> {
        let pass = self.takeable(epoch, plan).ok()?;
        pass.pending.remove(split).then(|| self.give(epoch, split, to))
    }

    /// The pass of epoch `e` if it is the open one or the next (made if need be).
    fn open_pass(&mut self, e: u64, plan: &Plan) -> Option<&mut Pass> {
        match e.checked_sub(self.epoch) {
            Some(0) => Some(&mut self.current),
            Some(1) => Some(self.next.get_or_insert_with(|| Pass::full(plan, e))),
            _ => None,
        }
    }

    /// The pass of epoch `e`, if it is open.
    fn pass_mut(&mut self, e: u64) -> Option<&mut Pass> {
        match e.checked_sub(self.epoch) {
            Some(0) => Some(&mut self.current),
            Some(1) => self.next.as_mut(),
            _ => None,
        }
    }

    /// The positions of `split` of `epoch` already delivered (a take would skip them).
    pub fn delivered(&self, epoch: u64, split: u64) -> Vec<u32> {
        let pass = match epoch.checked_sub(self.epoch) {
            Some(0) => Some(&self.current),
            Some(1) => self.next.as_ref(),
            _ => None,
        };
        pass.and_then(|p| p.delivered.get(&split)).map(|d| d.iter().copied().collect()).unwrap_or_default()
    }

    /// Whether `worker` holds `split` of `epoch` for this job.
    pub fn holds(&self, epoch: u64, split: u64, worker: &WorkerId) -> bool {
        let pass = match epoch.checked_sub(self.epoch) {
            Some(0) => Some(&self.current),
            Some(1) => self.next.as_ref(),
            _ => None,
        };
        pass.is_some_and(|p| p.assigned.get(&split) == Some(worker))
    }

    /// How fast the job's splits are done (by its consumers).
    pub fn read_rate(&self, now: Instant) -> f64 {
        self.read.at(now)
    }

    /// The open epoch: every split of the epochs before it is done.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Marks (epoch, split)s done (for ranks: once each rank reported them), and moves on once
    /// the current epoch's all are; returns the finished epoch's cache action and length.
    pub fn complete(
        &mut self,
        completed: &[(u64, u64)],
        by: Reporter,
        plan: &Plan,
        now: Instant,
    ) -> Option<(CacheDecision, f64)> {
        let splits = plan.splits;
        self.read.add(completed.len(), now);
        for &(e, split) in completed {
            let Some(pass) = self.pass_mut(e).filter(|_| split < splits) else {
                // A finished epoch's split: its epoch already advanced without it.
                tracing::warn!(epoch = e, split, ?by, "a split of a finished epoch reported done again");
                self.repeats += 1;
                continue;
            };
            if let Reporter::Client { rank, consumers } = by
                && consumers > 1
                && !pass.done.contains(&split)
            {
                let ranks = pass.completed_by.entry(split).or_default();
                ranks.insert(rank);
                if (ranks.len() as u32) < consumers {
                    continue;
                }
            }
            if !pass.finish(split) {
                tracing::warn!(
                    epoch = e,
                    split,
                    ?by,
                    "a split reported done again: its elements may have reached the job twice"
                );
                self.repeats += 1;
            } else {
                // Done by a worker presumed dead whose split was queued again.
                pass.pending.remove(split);
            }
        }
        if self.current.done.len() as u64 != splits {
            return None;
        }
        // Saturating: a job may start at any epoch a worker names, u64::MAX too.
        let next = self.next.take().unwrap_or_else(|| Pass::full(plan, self.epoch.saturating_add(1)));
        let finished = std::mem::replace(&mut self.current, next);
        self.epoch = self.epoch.saturating_add(1);
        finished.started.map(|t| (finished.action(), now.saturating_duration_since(t).as_secs_f64()))
    }

    /// Of completions `by` sent again after a lost answer, those not applied yet: an open
    /// epoch's splits not done (for a rank: not reported by it). A finished epoch's were.
    pub fn unapplied(&self, again: &[(u64, u64)], by: Reporter) -> Vec<(u64, u64)> {
        let applied = |&(e, split): &(u64, u64)| {
            let pass = match e.checked_sub(self.epoch) {
                Some(0) => &self.current,
                Some(1) => match &self.next {
                    Some(next) => next,
                    None => return false,
                },
                _ => return true,
            };
            pass.done.contains(&split)
                || matches!(by, Reporter::Client { rank, consumers } if consumers > 1
                    && pass.completed_by.get(&split).is_some_and(|ranks| ranks.contains(&rank)))
        };
        again.iter().copied().filter(|c| !applied(c)).collect()
    }

    /// The in-flight splits of a dead worker: produced again once `clients` (the job's live
    /// ones) have acknowledged the worker list `version`, which no longer has the worker, with
    /// the rows they got from it. With no client to wait for they go back at once.
    pub fn recover(&mut self, dead: &WorkerId, version: u64, clients: &BTreeSet<ClientId>, now: Instant) {
        let mut requeued = 0;
        for pass in self.passes_mut() {
            let lost: Vec<u64> = pass.assigned.iter().filter(|(_, w)| *w == dead).map(|(s, _)| *s).collect();
            requeued += lost.len() as u64;
            for split in lost {
                pass.assigned.remove(&split);
                pass.recovering.insert(split, Recovery { version, waiting: clients.clone(), since: now });
            }
        }
        self.requeued += requeued;
        self.give_up_waiting(now, Duration::MAX);
    }

    /// A client's acknowledgement: it streams from no worker missing from list `version`, and
    /// `held` is what it got from the ones that left.
    pub fn acknowledge(&mut self, client: &ClientId, version: u64, held: &[Held], now: Instant) {
        for h in held {
            if let Some(pass) = self.pass_mut(h.epoch)
                && !pass.done.contains(&h.split)
            {
                pass.delivered.entry(h.split).or_default().extend(h.positions.iter().copied());
            }
        }
        for pass in self.passes_mut() {
            for recovery in pass.recovering.values_mut().filter(|r| r.version <= version) {
                recovery.waiting.remove(client);
            }
        }
        self.give_up_waiting(now, Duration::MAX);
    }

    /// A client that went silent is waited for no more.
    pub fn forget_client(&mut self, client: &ClientId, now: Instant) {
        for pass in self.passes_mut() {
            for recovery in pass.recovering.values_mut() {
                recovery.waiting.remove(client);
            }
        }
        self.give_up_waiting(now, Duration::MAX);
    }

    /// Requeues the recoveries every client acknowledged, and those that waited `patience`
    /// for an acknowledgement that never came.
    pub fn give_up_waiting(&mut self, now: Instant, patience: Duration) {
        let mut late = 0;
        for pass in self.passes_mut() {
            late += pass.release(now, patience);
        }
        self.unacknowledged += late;
    }

    /// Hands out again the in-flight splits `holds` picks (their data may be lost with
    /// whoever held it).
    pub fn requeue(&mut self, holds: impl Fn(&WorkerId) -> bool) {
        let mut requeued = 0;
        for pass in self.passes_mut() {
            let lost: Vec<u64> = pass.assigned.iter().filter(|(_, w)| holds(w)).map(|(s, _)| *s).collect();
            requeued += pass.requeue(lost);
        }
        self.requeued += requeued;
    }

    /// Splits of `epoch` that `worker` took and will not deliver (its producer stopped: nobody
    /// read the epoch): back to the queue, those it still holds.
    pub fn give_back(&mut self, worker: &WorkerId, epoch: u64, splits: &[u64]) {
        if let Some(pass) = self.pass_mut(epoch) {
            let held: Vec<u64> =
                splits.iter().copied().filter(|s| pass.assigned.get(s).is_some_and(|w| w == worker)).collect();
            pass.requeue(held);
        }
    }

    pub fn summary(&self, job: &JobName, splits: u64) -> JobSummary {
        JobSummary {
            job: job.clone(),
            epoch: self.epoch,
            splits,
            done: self.current.done.len() as u64,
            in_flight: self.passes().map(|p| p.assigned.len() as u64).sum(),
            holders: self.passes().flat_map(|p| p.assigned.values()).collect::<BTreeSet<_>>().len() as u64,
            repeats: self.repeats,
            requeued: self.requeued,
            recovering: self.passes().map(|p| p.recovering.len() as u64).sum(),
            skipped: self.skipped,
            unacknowledged: self.unacknowledged,
        }
    }
}

#[cfg(test)]
#[path = "ledger_tests.rs"]
mod tests;
