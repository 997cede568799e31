//! The split ledger of one job: which splits of its epoch are waiting, held by a worker, or
//! done, and the next epoch started early by workers with nothing left in this one.
//!
//! A split is done when a client reports receiving the batch holding its last element (or the
//! batch without tensors that says a split produced nothing more). Delivery is at least once:
//! a split held by a worker that dies, or in flight to a client that goes silent, goes back
//! to the queue, so its elements may reach clients twice. Such repeats are counted.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Instant;

use stoker_api::{CacheDecision, order};

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
    },
    /// Nothing to hand out in `epoch` until other workers finish theirs.
    Draining {
        epoch: u64,
    },
}

/// One pass over the pipeline's splits.
#[derive(Default)]
struct Pass {
    pending: VecDeque<u64>,
    /// Split -> the worker holding it.
    assigned: HashMap<u64, String>,
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
            self.pending.push_front(split);
        }
        lost.len() as u64
    }
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

impl Job {
    /// A job first seen at `epoch` (a restarted dispatcher resumes where the workers are).
    pub fn starting(epoch: u64, plan: &Plan) -> Job {
        Job { epoch, current: Pass::full(plan, epoch), ..Job::default() }
    }

    fn passes(&self) -> impl Iterator<Item = &Pass> {
        std::iter::once(&self.current).chain(self.next.as_ref())
    }

    fn passes_mut(&mut self) -> impl Iterator<Item = &mut Pass> {
        std::iter::once(&mut self.current).chain(self.next.as_mut())
    }

    /// The next split to produce: the current epoch's first, then the next epoch's.
    pub fn hand_out(&mut self, worker: &str, plan: &Plan, directive: &Directive, now: Instant) -> Assignment {
        let (epoch, pass) = match self.current.pending.is_empty() {
            false => (self.epoch, &mut self.current),
            true => (self.epoch + 1, self.next.get_or_insert_with(|| Pass::full(plan, self.epoch + 1))),
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
    pub fn complete(&mut self, completed: &[(u64, u64)], plan: &Plan, now: Instant) -> Option<(CacheDecision, f64)> {
        let splits = plan.splits;
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
        let next = self.next.take().unwrap_or_else(|| Pass::full(plan, self.epoch + 1));
        let finished = std::mem::replace(&mut self.current, next);
        self.epoch += 1;
        finished.started.map(|t| (finished.action(), now.saturating_duration_since(t).as_secs_f64()))
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(epoch: u64, split: u64) -> Assignment {
        Assignment::Split { epoch, split }
    }

    fn plan(splits: u64) -> Plan {
        Plan { splits, order: None }
    }

    #[test]
    fn splits_go_out_in_order_and_an_epoch_ends_when_all_are_done() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(3));
        let got: Vec<Assignment> = (0..3).map(|_| job.hand_out("w", &plan(3), &Directive::Compute, t)).collect();
        assert_eq!(got, vec![split(0, 0), split(0, 1), split(0, 2)]);
        assert_eq!(job.complete(&[(0, 0), (0, 2)], &plan(3), t), None);
        let s = job.summary("j", 3);
        assert_eq!((s.epoch, s.done, s.in_flight, s.holders), (0, 2, 1, 1));
        let (action, _) = job.complete(&[(0, 1)], &plan(3), t).expect("the epoch is done");
        assert_eq!(action, CacheDecision::Compute);
        assert_eq!(job.summary("j", 3).epoch, 1);
    }

    #[test]
    fn an_epoch_runs_at_most_one_ahead() {
        let t = Instant::now();
        let mut job = Job::starting(4, &plan(1));
        assert_eq!(job.hand_out("a", &plan(1), &Directive::Compute, t), split(4, 0));
        assert_eq!(job.hand_out("a", &plan(1), &Directive::Compute, t), split(5, 0));
        assert_eq!(job.hand_out("a", &plan(1), &Directive::Compute, t), Assignment::Draining { epoch: 4 });
    }

    #[test]
    fn requeued_splits_come_back_first_and_a_second_completion_is_a_repeat() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(3));
        job.hand_out("a", &plan(3), &Directive::Compute, t);
        job.hand_out("b", &plan(3), &Directive::Compute, t);
        job.requeue(|w| w == "a");
        assert_eq!(job.summary("j", 3).requeued, 1);
        assert_eq!(job.hand_out("b", &plan(3), &Directive::Compute, t), split(0, 0), "the lost split first");
        job.complete(&[(0, 0)], &plan(3), t);
        // a was only slow: its late report of the same split is a repeat.
        job.complete(&[(0, 0)], &plan(3), t);
        assert_eq!(job.summary("j", 3).repeats, 1);
    }

    #[test]
    fn a_completion_from_a_finished_epoch_or_beyond_the_plan_is_a_repeat() {
        let t = Instant::now();
        let mut job = Job::starting(0, &plan(1));
        job.hand_out("a", &plan(1), &Directive::Compute, t);
        assert!(job.complete(&[(0, 0)], &plan(1), t).is_some());
        job.complete(&[(0, 0), (1, 7)], &plan(1), t);
        assert_eq!(job.summary("j", 1).repeats, 2);
    }

    #[test]
    fn an_epoch_is_named_by_what_most_of_its_splits_did_with_the_cache() {
        let t = Instant::now();
        let hint = crate::autocache::plan::Hint { at: 1, fingerprint: "f".into() };
        let mut job = Job::starting(0, &plan(3));
        job.hand_out("a", &plan(3), &Directive::Get(hint.clone()), t);
        job.hand_out("a", &plan(3), &Directive::Get(hint), t);
        job.hand_out("a", &plan(3), &Directive::Compute, t);
        let (action, _) = job.complete(&[(0, 0), (0, 1), (0, 2)], &plan(3), t).unwrap();
        assert_eq!(action, CacheDecision::Get);
    }

    #[test]
    fn with_a_seed_each_epoch_goes_out_in_its_own_order_and_every_split_once() {
        let t = Instant::now();
        let seeded = Plan { splits: 32, order: Some(7) };
        let epoch_order = |job: &mut Job, epoch: u64| -> Vec<u64> {
            let got: Vec<u64> = (0..32)
                .map(|_| match job.hand_out("w", &seeded, &Directive::Compute, t) {
                    Assignment::Split { epoch: e, split } if e == epoch => split,
                    other => panic!("{other:?}"),
                })
                .collect();
            let done: Vec<(u64, u64)> = got.iter().map(|&s| (epoch, s)).collect();
            assert!(job.complete(&done, &seeded, t).is_some(), "epoch {epoch} done");
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
}
