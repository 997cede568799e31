//! A share group: jobs (the trials of a hyperparameter sweep) that take their splits from one
//! production. Each job keeps its own ledger, epochs, ranks and completions; what they share is
//! the making of a split. When a job's producer on a worker asks for a split, the split it gets
//! is recorded in the ledger of every job of the group that waits for it and has room on that
//! worker (a production), each with its own epoch; the other members' producers there are
//! handed the same production when they ask next. One member's producer makes the split's rows
//! and keeps them, the others take them (`worker/src/engine/shared.rs`), and each job shuffles
//! and batches them for its own consumers.
//!
//! Which split: the asking job's next, unless a faster job (splits done per second) without room
//! on that worker waits for it too, which would have to get it again later: production follows
//! the fastest jobs. A slower job takes what their production makes whenever it has room, in
//! whatever order it comes; what went by while it had none (counted as missed) it gets from a
//! later production of the same split, usually one the fast jobs' next epoch makes anyway. It is
//! never skipped ahead and never holds the others back, and a job joining mid-epoch takes the
//! production where it is and the splits that went by from the next pass.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use stoker_api::{JobName, WorkerId};

use super::ledger::{Assignment, HandOut, Job, Plan};

/// A job's place on one worker of the group: the epochs its consumers read there, and what
/// the worker made for it and has not sent yet.
#[derive(Clone, Debug, PartialEq)]
pub struct Tail {
    pub job: JobName,
    pub epochs: Vec<u64>,
    /// Elements made for the job on this worker and not sent to its consumers yet.
    pub backlog: u64,
    /// The backlog is below the job's share of the worker's window: it may take more.
    pub room: bool,
}

/// One production of a split, each job it goes to with the job's own assignment (its epoch,
/// the rows it has of the split already, the echo factor). Which member's producer makes it is
/// the worker's choice: the first to come for it (the others may be busy with what waited for
/// them before, and nobody should wait for a producer that has not started).
#[derive(Clone, Debug, PartialEq)]
pub struct Production {
    pub split: u64,
    pub members: Vec<(JobName, Assignment)>,
}

/// A group's counters, for status and metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShareCounts {
    /// Splits made for the group.
    pub productions: u64,
    /// Per job: the splits it got from the group's productions (summed: the (job, split)
    /// deliveries the productions were for).
    pub taken: BTreeMap<JobName, u64>,
    /// Per job: productions of a split it waited for, made while it had no room on the
    /// worker. Each is a split made again for it later.
    pub missed: BTreeMap<JobName, u64>,
}

impl ShareCounts {
    /// The (job, split) deliveries the group's productions were for.
    pub fn deliveries(&self) -> u64 {
        self.taken.values().sum()
    }
}

/// How far into a leading job's order a worker looks for a split no faster job without room
/// waits for.
const LOOK_AHEAD: usize = 32;

/// Productions a job may have waiting on one worker for its producer there (its window):
/// beyond, it takes no part in new ones on that worker.
pub const WINDOW: usize = 4;

/// How long a production waits for a member's producer to take it: one that never comes (the
/// job's consumers stopped reading that epoch on that worker) gives the split back to its
/// job's queue, to be made again for it.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The next production on `worker` for the jobs of a share group, led by `leader` (the job
/// whose producer asks), given each job's tail there; None when the leader waits for nothing
/// it may take now.
///
/// The leader takes the first split of its order that no faster job (splits done per second)
/// without room here waits for (that one would have to get it again later); a slower job
/// without room misses it, and gets it from a later production. A leader whose consumers have
/// nothing left here (backlog 0) takes its first split regardless: its trainer waits now. The
/// members are every job with room here that waits for the split, with the leader's rows
/// of it already delivered (none, unless a worker died) and echo factor.
pub fn hand_out(
    jobs: &mut [(&JobName, &mut Job)],
    tails: &[Tail],
    leader: &JobName,
    plan: &Plan,
    to: HandOut,
    counts: &mut ShareCounts,
) -> Option<Production> {
    let now = to.now;
    let tail = |job: &JobName| tails.iter().find(|t| t.job == *job);
    // Whether a job waits for `split` in an epoch it reads here.
    let waits = |job: &Job, t: &Tail, split: u64| job.wants(split, plan).filter(|w| t.epochs.contains(&w.epoch));
    let lead = jobs.iter().position(|(name, _)| *name == leader)?;
    let lead_tail = tail(leader).filter(|t| t.room)?;
    let rate = jobs[lead].1.read_rate(now);
    let (epoch, upcoming) = jobs[lead].1.upcoming(plan, LOOK_AHEAD);
    if !lead_tail.epochs.contains(&epoch) {
        return None;
    }
    let faster_without_room = |s: u64| {
        jobs.iter().any(|(name, job)| {
            job.read_rate(now) > rate && tail(name).is_some_and(|t| !t.room && waits(job, t, s).is_some())
        })
    };
    let split = upcoming
        .iter()
        .copied()
        .find(|&s| !faster_without_room(s))
        .or_else(|| upcoming.first().copied().filter(|_| lead_tail.backlog == 0))?;
    let first = jobs[lead].1.take(epoch, split, plan, to)?;
    let Assignment::Split { skip: ref lead_skip, echo: lead_echo, .. } = first else { return None };
    let mut members = vec![(leader.clone(), first.clone())];
    for (name, job) in jobs.iter_mut().filter(|(name, _)| *name != leader) {
        let Some(t) = tail(name) else { continue };
        let Some(wanted) = waits(job, t, split) else { continue };
        // A job with copies of the split from an attempt with another factor waits for a
        // production with that one.
        if wanted.echo.is_some_and(|e| e != lead_echo) || job.delivered(wanted.epoch, split) != *lead_skip {
            continue;
        }
        if !t.room {
            *counts.missed.entry((*name).clone()).or_default() += 1;
            continue;
        }
        if let Some(a) = job.take(wanted.epoch, split, plan, HandOut { echo: lead_echo, ..to }) {
            members.push(((*name).clone(), a));
        }
    }
    counts.productions += 1;
    for (name, _) in &members {
        *counts.taken.entry(name.clone()).or_default() += 1;
    }
    Some(Production { split, members })
}

/// One making of a split on a worker for `takers` jobs (see the proto's SharedProduction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedProduction {
    pub id: u64,
    pub takers: u32,
}

/// A production waiting for a member's producer on a worker.
struct Membership {
    assignment: Assignment,
    production: SharedProduction,
    since: Instant,
}

/// A share group's productions waiting for their members' producers, and its counters.
#[derive(Default)]
pub struct Share {
    waiting: BTreeMap<(JobName, WorkerId), VecDeque<Membership>>,
    next_id: u64,
    pub counts: ShareCounts,
}

impl Share {
    /// What `asker`'s producer of `epoch` on `worker` makes next: a production waiting for it
    /// there, or a new one it leads (with the group's `jobs`, `asker` among them). None: the
    /// ledger's own answer holds (draining, finished).
    pub fn next(
        &mut self,
        jobs: &mut [(&JobName, &mut Job)],
        asker: &JobName,
        epoch: u64,
        plan: &Plan,
        to: HandOut,
    ) -> Option<(Assignment, SharedProduction)> {
        let HandOut { worker, now, .. } = to;
        self.expire(jobs, now);
        let key = (asker.clone(), worker.clone());
        if let Some(queue) = self.waiting.get_mut(&key)
            && let Some(i) =
                queue.iter().position(|m| matches!(m.assignment, Assignment::Split { epoch: e, .. } if e == epoch))
        {
            let m = queue.remove(i).expect("found above");
            return Some((m.assignment, m.production));
        }
        let tails: Vec<Tail> = jobs
            .iter()
            .map(|(name, job)| {
                let backlog = self.waiting.get(&((*name).clone(), worker.clone())).map_or(0, VecDeque::len);
                let epochs =
                    if *name == asker { vec![epoch] } else { vec![job.epoch(), job.epoch().saturating_add(1)] };
                Tail { job: (*name).clone(), epochs, backlog: backlog as u64, room: backlog < WINDOW }
            })
            .collect();
        let production = hand_out(jobs, &tails, asker, plan, to, &mut self.counts)?;
        let (id, takers) = (self.next_id, production.members.len() as u32);
        self.next_id += 1;
        let mut own = None;
        for (job, assignment) in production.members {
            let shared = SharedProduction { id, takers };
            if job == *asker {
                own = Some((assignment, shared));
            } else {
                let waiting = Membership { assignment, production: shared, since: now };
                self.waiting.entry((job, worker.clone())).or_default().push_back(waiting);
            }
        }
        own
    }

    /// Productions that waited longer than `PATIENCE` for their member: its split goes back
    /// to the job's queue (counted as missed), as does any the job's ledger no longer has
    /// on that worker (requeued meanwhile: taking it would produce it twice). Those of a job
    /// without clients now wait for it to have some again: only its ledger can take them back.
    fn expire(&mut self, jobs: &mut [(&JobName, &mut Job)], now: Instant) {
        for ((job, worker), queue) in self.waiting.iter_mut() {
            let Some((_, ledger)) = jobs.iter_mut().find(|(name, _)| *name == job) else { continue };
            queue.retain(|m| {
                let Assignment::Split { epoch, split, .. } = m.assignment else { return false };
                if !ledger.holds(epoch, split, worker) {
                    return false;
                }
                if now.saturating_duration_since(m.since) < PATIENCE {
                    return true;
                }
                ledger.give_back(worker, epoch, &[split]);
                *self.counts.missed.entry(job.clone()).or_default() += 1;
                false
            });
        }
        self.waiting.retain(|_, queue| !queue.is_empty());
    }

    /// A worker is gone: what waited there goes with it (each job's ledger recovers its splits).
    pub fn forget_worker(&mut self, worker: &WorkerId) {
        self.waiting.retain(|(_, w), _| w != worker);
    }
}

#[cfg(test)]
#[path = "share_tests.rs"]
mod tests;
