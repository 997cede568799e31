//! One rank's side of equal batches per rank: what it received of an epoch waits here until
//! the dispatcher's quota lets the training loop have it. A rank may yield as many batches as
//! the rank that has received fewest; once every rank's epoch has ended the quota is final and
//! what this rank has beyond it is dropped (its rows counted as dropped). Waiting batches are
//! pulled from the queue all the same, so a rank that is ahead never stops the streams the
//! others wait on. Batches carrying only completions are not kept: they were acknowledged as
//! they arrived.
//!
//! In coordinated mode the quota also carries the epoch's order of rounds: the rank yields its
//! batch of each round in that order (so its k-th batch is every rank's k-th round), and once
//! the quota is final, what no round of the order took, in arrival order.
use std::collections::VecDeque;

use stoker_api::Batch;
use stoker_api::ranks::Quota;

/// What to do with the next batch of the epoch.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Hand it to the training loop.
    Yield(Batch),
    /// Beyond the final quota: count its rows, yield nothing.
    Drop(Batch),
    /// Nothing may go yet: receive more, or wait for a larger quota.
    Wait,
    /// The epoch is over for this rank.
    Done,
}

#[derive(Default)]
pub(crate) struct Ration {
    waiting: VecDeque<Batch>,
    yielded: u64,
    /// Coordinated mode: rounds of the order yielded.
    position: u64,
    /// Every batch of the epoch this rank gets has been pushed.
    ended: bool,
    quota: Quota,
}

impl Ration {
    pub(crate) fn push(&mut self, batch: Batch) {
        if !batch.is_completions() {
            self.waiting.push_back(batch);
        }
    }

    pub(crate) fn end(&mut self) {
        self.ended = true;
    }

    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    pub(crate) fn set_quota(&mut self, quota: Quota) {
        self.quota = quota;
    }

    /// Whether batches are held back (so a stream's end cannot be taken for the epoch's).
    pub(crate) fn holds(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Coordinated mode: rounds of the epoch's order yielded so far.
    pub(crate) fn position(&self) -> u64 {
        self.position
    }

    pub(crate) fn step(&mut self) -> Step {
        if let Some(order) = &self.quota.order
            && let Some(round) = order.at(self.position)
        {
            // Every rank has reported this round: it is here or on its way.
            let Some(at) = self.waiting.iter().position(|b| b.round.as_ref() == Some(round)) else {
                return Step::Wait;
            };
            self.position += 1;
            self.yielded += 1;
            return Step::Yield(self.waiting.remove(at).expect("found above"));
        }
        // An order goes on growing until the quota is final; what it did not take comes after.
        if self.quota.order.is_some() && !self.quota.complete {
            return if self.waiting.is_empty() && self.ended { Step::Done } else { Step::Wait };
        }
        if self.waiting.is_empty() {
            // Everything received went out: whatever the final quota, it is not above that.
            return if self.ended { Step::Done } else { Step::Wait };
        }
        if self.yielded < self.quota.batches {
            self.yielded += 1;
            return Step::Yield(self.waiting.pop_front().expect("not empty"));
        }
        if self.quota.complete {
            return Step::Drop(self.waiting.pop_front().expect("not empty"));
        }
        Step::Wait
    }
}

#[cfg(test)]
mod tests {
    use stoker_api::proto::{RoundOrder, RoundRef};

    use super::*;

    fn data(id: u64) -> Batch {
        let tensor = stoker_api::Tensor::new(stoker_api::DType::Uint8, vec![1], vec![0u8].into()).unwrap();
        Batch { tensors: [("x".to_string(), tensor)].into(), sequence: id, ..Batch::default() }
    }

    fn quota(batches: u64, complete: bool) -> Quota {
        Quota { batches, complete, order: None }
    }

    fn round(worker: &str, index: u64) -> RoundRef {
        RoundRef { worker: worker.into(), index }
    }

    fn dealt(id: u64, worker: &str, index: u64) -> Batch {
        Batch { round: Some(round(worker, index)), ..data(id) }
    }

    fn ordered(batches: u64, complete: bool, base: u64, rounds: &[(&str, u64)]) -> Quota {
        let rounds = rounds.iter().map(|&(w, i)| round(w, i)).collect();
        Quota { batches, complete, order: Some(RoundOrder { base, rounds }) }
    }

    #[test]
    fn batches_go_out_up_to_the_quota_and_completions_are_not_kept() {
        let mut r = Ration::default();
        r.push(data(1));
        r.push(Batch::completions(0, vec![4]));
        r.push(data(2));
        assert_eq!(r.step(), Step::Wait, "no quota yet");
        r.set_quota(quota(1, false));
        assert_eq!(r.step(), Step::Yield(data(1)));
        assert_eq!(r.step(), Step::Wait);
        r.set_quota(quota(2, false));
        assert_eq!(r.step(), Step::Yield(data(2)), "the completions were not counted");
        assert_eq!(r.step(), Step::Wait, "more may come");
        r.end();
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn a_final_quota_drops_the_rest() {
        let mut r = Ration::default();
        for id in 0..3 {
            r.push(data(id));
        }
        r.end();
        r.set_quota(quota(2, true));
        assert_eq!(r.step(), Step::Yield(data(0)));
        assert_eq!(r.step(), Step::Yield(data(1)));
        assert_eq!(r.step(), Step::Drop(data(2)));
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn an_ended_epoch_holding_batches_waits_for_the_quota() {
        let mut r = Ration::default();
        r.push(data(0));
        r.end();
        assert_eq!(r.step(), Step::Wait, "another rank may yet receive its share");
        r.set_quota(quota(1, true));
        assert_eq!(r.step(), Step::Yield(data(0)));
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn coordinated_rounds_go_out_in_the_order_whatever_order_they_came_in() {
        let mut r = Ration::default();
        r.push(dealt(1, "a", 0));
        r.push(dealt(2, "a", 1));
        r.push(dealt(3, "b", 0));
        r.set_quota(ordered(3, false, 0, &[("b", 0), ("a", 0)]));
        assert_eq!(r.step(), Step::Yield(dealt(3, "b", 0)));
        assert_eq!(r.step(), Step::Yield(dealt(1, "a", 0)));
        assert_eq!(r.position(), 2);
        assert_eq!(r.step(), Step::Wait, "a's round 1 is not in the order yet, though within the quota");
        r.set_quota(ordered(3, false, 1, &[("a", 0), ("b", 1)]));
        assert_eq!(r.step(), Step::Wait, "b's round 1 is on its way");
        r.push(dealt(4, "b", 1));
        assert_eq!(r.step(), Step::Yield(dealt(4, "b", 1)));
    }

    #[test]
    fn coordinated_what_no_round_took_goes_after_the_order_within_the_final_quota() {
        let mut r = Ration::default();
        r.push(dealt(1, "a", 0));
        r.push(dealt(2, "a", 1));
        r.push(dealt(3, "dead", 4));
        r.end();
        r.set_quota(ordered(2, true, 0, &[("a", 0)]));
        assert_eq!(r.step(), Step::Yield(dealt(1, "a", 0)), "the order first");
        assert_eq!(r.step(), Step::Yield(dealt(2, "a", 1)), "then in arrival order");
        assert_eq!(r.step(), Step::Drop(dealt(3, "dead", 4)), "beyond the quota");
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn an_epoch_without_an_order_goes_in_arrival_order() {
        let mut r = Ration::default();
        r.push(dealt(1, "a", 1));
        r.push(dealt(2, "a", 0));
        r.set_quota(quota(2, false));
        assert_eq!(r.step(), Step::Yield(dealt(1, "a", 1)), "read across a dispatcher restart: not coordinated");
    }
}
