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

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use stoker_api::{CacheDecision, order};

use super::gathering::Gathered;
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
    },
    /// Nothing to hand out in `epoch` now: other workers hold its last splits (one may come
    /// back if its worker dies), or it is more than one ahead of the job.
    Draining { epoch: u64 },
    /// Every split of `epoch` is done.
    Finished { epoch: u64 },
}

/// A split whose worker died, waiting for the clients that may hold some of its rows.
struct Recovery {
    /// The worker list without the dead worker: clients acknowledge this version or later.
    version: u64,
    /// Live clients of the job that have not acknowledged yet.
    waiting: BTreeSet<String>,
    since: Instant,
}

/// One pass over the pipeline's splits.
#[derive(Default)]
struct Pass {
    pending: VecDeque<u64>,
    /// Split -> the worker holding it.
    assigned: HashMap<u64, String>,
    recovering: BTreeMap<u64, Recovery>,
    /// Positions of unfinished splits already delivered, from the clients' acknowledgements.
    delivered: HashMap<u64, BTreeSet<u32>>,
    /// Ranks that reported an unfinished split complete (a job read by ranks).
    completed_by: HashMap<u64, BTreeSet<u32>>,
    done: BTreeSet<u64>,
    /// When its first split was handed out, and how many were computed, put and got.
    started: Option<Instant>,
    actions: [u64; 3],
}

impl Pass {
    /// Every split of `epoch`, waiting in the epoch's order: with a seed, a fresh permutation
    /// each epoch, so consecutive splits of the listing do not reach the trainer side by side.
    fn full(plan: &Plan, epoch: u64) -> Pass {
        let mut pending: Vec<u64> = (0..plan.splits).collect();
        if let Some(seed) = plan.order {
            order::shuffle(&mut pending, seed, epoch, |&split| split);
        }
        Pass { pending: pending.into(), ..Pass::default() }
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
                pass.pending.retain(|&s| s != split);
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
    pub fn hand_out(
        &mut self,
        epoch: u64,
        worker: &str,
        plan: &Plan,
        directive: &Directive,
        now: Instant,
    ) -> Assignment {
        let pass = match epoch.checked_sub(self.epoch) {
            None => return Assignment::Finished { epoch },
            Some(0) => &mut self.current,
            // Only once the open epoch has nothing left to hand out: until then its work comes
            // first (and its epoch time is not stretched by a split taken early).
            Some(1) if !self.current.pending.is_empty() => return Assignment::Draining { epoch },
            Some(1) => self.next.get_or_insert_with(|| Pass::full(plan, epoch)),
            Some(_) => return Assignment::Draining { epoch },
        };
        match pass.pending.pop_front() {
            Some(split) => {
                let skip: Vec<u32> =
                    pass.delivered.get(&split).map(|d| d.iter().copied().collect()).unwrap_or_default();
                self.skipped += skip.len() as u64;
                pass.assigned.insert(split, worker.to_string());
                pass.started.get_or_insert(now);
                pass.actions[match directive {
                    Directive::Compute => 0,
                    Directive::Put(_) => 1,
                    Directive::Get(_) => 2,
                }] += 1;
                Assignment::Split { epoch, split, skip }
            }
            None => Assignment::Draining { epoch },
        }
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
        for &(e, split) in completed {
            let Some(pass) = self.pass_mut(e).filter(|_| split < splits) else {
                // A finished epoch's split: its epoch already advanced without it.
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
            // A split held by a worker is in no queue: only another may be (one requeued),
            // and looking through the queue for every completion made an epoch cost the square
            // of its splits.
            let queued = !pass.assigned.contains_key(&split);
            if !pass.finish(split) {
                self.repeats += 1;
            } else if queued && let Some(i) = pass.pending.iter().position(|&s| s == split) {
                // Done by a worker presumed dead whose split was queued again.
                pass.pending.remove(i);
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

    /// The in-flight splits of a dead worker: produced again once `clients` (the job's live
    /// ones) have acknowledged the worker list `version`, which no longer has the worker, with
    /// the rows they got from it. With no client to wait for they go back at once.
    pub fn recover(&mut self, dead: &str, version: u64, clients: &BTreeSet<String>, now: Instant) {
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
    pub fn acknowledge(&mut self, client: &str, version: u64, held: &[Held], now: Instant) {
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
    pub fn forget_client(&mut self, client: &str, now: Instant) {
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
    pub fn requeue(&mut self, holds: impl Fn(&str) -> bool) {
        let mut requeued = 0;
        for pass in self.passes_mut() {
            let lost: Vec<u64> = pass.assigned.iter().filter(|(_, w)| holds(w)).map(|(s, _)| *s).collect();
            requeued += pass.requeue(lost);
        }
        self.requeued += requeued;
    }

    /// Splits of `epoch` that `worker` took and will not deliver (its producer stopped: nobody
    /// read the epoch): back to the queue, those it still holds.
    pub fn give_back(&mut self, worker: &str, epoch: u64, splits: &[u64]) {
        if let Some(pass) = self.pass_mut(epoch) {
            let held: Vec<u64> =
                splits.iter().copied().filter(|s| pass.assigned.get(s).is_some_and(|w| w == worker)).collect();
            pass.requeue(held);
        }
    }

    pub fn summary(&self, job: &str, splits: u64) -> JobSummary {
        JobSummary {
            job: job.to_string(),
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
mod tests {
    use super::*;

    fn split(epoch: u64, split: u64) -> Assignment {
        Assignment::Split { epoch, split, skip: Vec::new() }
    }

    const ONE: Reporter = Reporter::Client { rank: 0, consumers: 1 };

    fn plan(splits: u64) -> Plan {
        Plan { splits, order: None }
    }

    #[test]
    fn splits_go_out_in_order_and_an_epoch_ends_when_all_are_done() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(3));
        let got: Vec<Assignment> = (0..3).map(|_| job.hand_out(0, "w", &plan(3), &Directive::Compute, t)).collect();
        assert_eq!(got, vec![split(0, 0), split(0, 1), split(0, 2)]);
        assert_eq!(job.complete(&[(0, 0), (0, 2)], ONE, &plan(3), t), None);
        let s = job.summary("j", 3);
        assert_eq!((s.epoch, s.done, s.in_flight, s.holders), (0, 2, 1, 1));
        let (action, _) = job.complete(&[(0, 1)], ONE, &plan(3), t).expect("the epoch is done");
        assert_eq!(action, CacheDecision::Compute);
        assert_eq!(job.summary("j", 3).epoch, 1);
    }

    #[test]
    fn an_epoch_runs_at_most_one_ahead() {
        let t = Instant::now();
        let mut job = Job::starting(4, &plan(1));
        assert_eq!(
            job.hand_out(5, "a", &plan(1), &Directive::Compute, t),
            Assignment::Draining { epoch: 5 },
            "epoch 4 first"
        );
        assert_eq!(job.hand_out(4, "a", &plan(1), &Directive::Compute, t), split(4, 0));
        assert_eq!(job.hand_out(4, "a", &plan(1), &Directive::Compute, t), Assignment::Draining { epoch: 4 });
        assert_eq!(job.hand_out(5, "a", &plan(1), &Directive::Compute, t), split(5, 0));
        assert_eq!(job.hand_out(6, "a", &plan(1), &Directive::Compute, t), Assignment::Draining { epoch: 6 });
        assert_eq!(job.hand_out(3, "a", &plan(1), &Directive::Compute, t), Assignment::Finished { epoch: 3 });
        job.complete(&[(4, 0)], ONE, &plan(1), t);
        assert_eq!(job.hand_out(4, "a", &plan(1), &Directive::Compute, t), Assignment::Finished { epoch: 4 });
    }

    #[test]
    fn requeued_splits_come_back_first_and_a_second_completion_is_a_repeat() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(3));
        job.hand_out(0, "a", &plan(3), &Directive::Compute, t);
        job.hand_out(0, "b", &plan(3), &Directive::Compute, t);
        job.requeue(|w| w == "a");
        assert_eq!(job.summary("j", 3).requeued, 1);
        assert_eq!(job.hand_out(0, "b", &plan(3), &Directive::Compute, t), split(0, 0), "the lost split first");
        job.complete(&[(0, 0)], ONE, &plan(3), t);
        // a was only slow: its late report of the same split is a repeat.
        job.complete(&[(0, 0)], ONE, &plan(3), t);
        assert_eq!(job.summary("j", 3).repeats, 1);
    }

    #[test]
    fn a_split_completed_while_queued_again_leaves_the_queue() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(2));
        assert_eq!(job.hand_out(0, "a", &plan(2), &Directive::Compute, t), split(0, 0));
        job.requeue(|w| w == "a");
        // a was only slow: its split is done, and not handed out again.
        job.complete(&[(0, 0)], ONE, &plan(2), t);
        assert_eq!(job.hand_out(0, "b", &plan(2), &Directive::Compute, t), split(0, 1));
        assert_eq!(job.hand_out(0, "b", &plan(2), &Directive::Compute, t), Assignment::Draining { epoch: 0 });
    }

    #[test]
    fn a_completion_from_a_finished_epoch_or_beyond_the_plan_is_a_repeat() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(1));
        job.hand_out(0, "a", &plan(1), &Directive::Compute, t);
        assert!(job.complete(&[(0, 0)], ONE, &plan(1), t).is_some());
        job.complete(&[(0, 0), (1, 7)], ONE, &plan(1), t);
        assert_eq!(job.summary("j", 1).repeats, 2);
    }

    #[test]
    fn an_epoch_is_named_by_what_most_of_its_splits_did_with_the_cache() {
        let t = Instant::now();
        let hint = crate::autocache::plan::Hint { at: 1, fingerprint: "f".into() };
        let mut job = Job::starting(0, &plan(3));
        job.hand_out(0, "a", &plan(3), &Directive::Get(hint.clone()), t);
        job.hand_out(0, "a", &plan(3), &Directive::Get(hint), t);
        job.hand_out(0, "a", &plan(3), &Directive::Compute, t);
        let (action, _) = job.complete(&[(0, 0), (0, 1), (0, 2)], ONE, &plan(3), t).unwrap();
        assert_eq!(action, CacheDecision::Get);
    }

    #[test]
    fn with_a_seed_each_epoch_goes_out_in_its_own_order_and_every_split_once() {
        let t = Instant::now();
        let seeded = Plan { splits: 32, order: Some(7) };
        let epoch_order = |job: &mut Job, epoch: u64| -> Vec<u64> {
            let got: Vec<u64> = (0..32)
                .map(|_| match job.hand_out(epoch, "w", &seeded, &Directive::Compute, t) {
                    Assignment::Split { epoch: e, split, .. } if e == epoch => split,
                    other => panic!("{other:?}"),
                })
                .collect();
            let done: Vec<(u64, u64)> = got.iter().map(|&s| (epoch, s)).collect();
            assert!(job.complete(&done, ONE, &seeded, t).is_some(), "epoch {epoch} done");
            got
        };
        let mut job = Job::starting(0, &seeded);
        let (first, second) = (epoch_order(&mut job, 0), epoch_order(&mut job, 1));
        for order in [&first, &second] {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..32).collect::<Vec<_>>(), "every split once");
            assert_ne!(*order, (0..32).collect::<Vec<_>>(), "not plan order");
        }
        assert_ne!(first, second, "a fresh order each epoch");
        // The same seed repeats the same orders: a restarted job sees them again.
        let mut again = Job::starting(0, &seeded);
        assert_eq!(epoch_order(&mut again, 0), first);
        // A job first seen at epoch 1 (a restarted dispatcher) hands out epoch 1's order.
        assert_eq!(epoch_order(&mut Job::starting(1, &seeded), 1), second);
    }

    #[test]
    fn a_dead_workers_split_with_no_client_to_ask_goes_back_at_once_and_keeps_what_was_delivered() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(2));
        assert_eq!(job.hand_out(0, "a", &plan(2), &Directive::Compute, t), split(0, 0));
        job.recover("a", 1, &BTreeSet::new(), t);
        assert_eq!(job.hand_out(0, "b", &plan(2), &Directive::Compute, t), split(0, 0));
        // b dies too; the client that got rows from both acknowledges each time.
        let clients = BTreeSet::from(["c".to_string()]);
        job.acknowledge("c", 1, &[Held { epoch: 0, split: 0, positions: vec![0, 1] }], t);
        job.recover("b", 2, &clients, t);
        job.acknowledge("c", 2, &[Held { epoch: 0, split: 0, positions: vec![5] }], t);
        let again = job.hand_out(0, "d", &plan(2), &Directive::Compute, t);
        assert_eq!(again, Assignment::Split { epoch: 0, split: 0, skip: vec![0, 1, 5] }, "both attempts' rows");
    }

    #[test]
    fn a_job_read_by_ranks_finishes_a_split_once_every_rank_reported_it() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(1));
        job.hand_out(0, "a", &plan(1), &Directive::Compute, t);
        let rank = |rank| Reporter::Client { rank, consumers: 3 };
        assert_eq!(job.complete(&[(0, 0)], rank(1), &plan(1), t), None);
        assert_eq!(job.complete(&[(0, 0)], rank(1), &plan(1), t), None, "the same rank twice is not two");
        assert_eq!(job.complete(&[(0, 0)], rank(0), &plan(1), t), None);
        assert!(job.complete(&[(0, 0)], rank(2), &plan(1), t).is_some(), "all three: the epoch is done");
        let s = job.summary("j", 1);
        assert_eq!((s.epoch, s.repeats), (1, 0));
    }

    #[test]
    fn a_resumed_job_hands_its_epoch_out_without_the_rows_yielded_before() {
        let t = Instant::now();
        let yielded = [
            Held { epoch: 3, split: 1, positions: vec![4, 0] },
            Held { epoch: 3, split: 1, positions: vec![2] },
            Held { epoch: 2, split: 0, positions: vec![9] },
        ];
        let gathered = Gathered { epoch: 3, rows: yielded.to_vec(), ..Gathered::default() };
        let mut job = Job::rebuilt(&gathered, &plan(2), 2);
        assert_eq!(job.epoch(), 3);
        assert_eq!(job.hand_out(3, "w", &plan(2), &Directive::Compute, t), split(3, 0), "another epoch's rows");
        let resumed = job.hand_out(3, "w", &plan(2), &Directive::Compute, t);
        assert_eq!(resumed, Assignment::Split { epoch: 3, split: 1, skip: vec![0, 2, 4] }, "both ranks' rows");
    }

    #[test]
    fn a_rebuilt_job_is_done_with_what_every_rank_completed_and_goes_on_into_the_next_epoch() {
        let t = Instant::now();
        let both = BTreeSet::from([0, 1]);
        let gathered = Gathered {
            epoch: 5,
            rows: vec![
                Held { epoch: 5, split: 2, positions: vec![1] },
                Held { epoch: 6, split: 0, positions: vec![7] },
                Held { epoch: 5, split: 0, positions: vec![3] },
            ],
            completed: [((5, 0), both.clone()), ((5, 1), both), ((5, 2), BTreeSet::from([1]))].into(),
            incomplete: true,
        };
        let mut job = Job::rebuilt(&gathered, &plan(3), 2);
        assert_eq!(job.epoch(), 5);
        let again = job.hand_out(5, "w", &plan(3), &Directive::Compute, t);
        assert_eq!(again, Assignment::Split { epoch: 5, split: 2, skip: vec![1] }, "rank 0 may lack rows of it");
        assert!(job.complete(&[(5, 2)], Reporter::Client { rank: 0, consumers: 2 }, &plan(3), t).is_some());
        assert_eq!(job.epoch(), 6, "rank 1 had reported it: epoch 5 is done");
        let next = job.hand_out(6, "w", &plan(3), &Directive::Compute, t);
        assert_eq!(next, Assignment::Split { epoch: 6, split: 0, skip: vec![7] }, "the next epoch's rows too");
        let s = job.summary("j", 3);
        assert_eq!((s.repeats, s.unacknowledged), (0, 1), "went on without a client");

        let all = Gathered { epoch: 1, completed: [((1, 0), BTreeSet::from([0]))].into(), ..Gathered::default() };
        assert_eq!(Job::rebuilt(&all, &plan(1), 0).epoch(), 2, "an epoch every split of which is done is over");
    }
}
