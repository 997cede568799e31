//! One rank's side of equal batches per rank: what it received of an epoch waits here, in
//! order, until the dispatcher's quota lets the training loop have it. A rank may yield as many
//! batches as the rank that has received fewest; once every rank's epoch has ended the quota
//! is final and what this rank has beyond it is dropped (its completions still count, so its
//! splits finish; its rows are counted as dropped). Waiting batches are pulled from the queue
//! all the same, so a rank that is ahead never stops the streams the others wait on.

use std::collections::VecDeque;

use stoker_api::Batch;
use stoker_api::ranks::Quota;

/// What to do with the next batch of the epoch.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Hand it to the training loop.
    Yield(Batch),
    /// Completions only: acknowledge them, yield nothing.
    Pass(Batch),
    /// Beyond the final quota: acknowledge its completions, count its rows, yield nothing.
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
    /// Every batch of the epoch this rank gets has been pushed.
    ended: bool,
    quota: Quota,
}

impl Ration {
    pub(crate) fn push(&mut self, batch: Batch) {
        self.waiting.push_back(batch);
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

    pub(crate) fn step(&mut self) -> Step {
        let Some(front) = self.waiting.front() else {
            // Everything received went out: whatever the final quota, it is not above that.
            return if self.ended { Step::Done } else { Step::Wait };
        };
        if front.is_completions() {
            return Step::Pass(self.waiting.pop_front().expect("front"));
        }
        if self.yielded < self.quota.batches {
            self.yielded += 1;
            return Step::Yield(self.waiting.pop_front().expect("front"));
        }
        if self.quota.complete {
            return Step::Drop(self.waiting.pop_front().expect("front"));
        }
        Step::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(id: u64) -> Batch {
        let tensor = stoker_api::Tensor::new(stoker_api::DType::Uint8, vec![1], vec![0u8].into()).unwrap();
        Batch { tensors: [("x".to_string(), tensor)].into(), sequence: id, ..Batch::default() }
    }

    fn quota(batches: u64, complete: bool) -> Quota {
        Quota { batches, complete }
    }

    #[test]
    fn batches_go_out_up_to_the_quota_and_completions_pass_in_order() {
        let mut r = Ration::default();
        r.push(data(1));
        r.push(Batch::completions(0, vec![4]));
        r.push(data(2));
        assert_eq!(r.step(), Step::Wait, "no quota yet");
        r.set_quota(quota(1, false));
        assert_eq!(r.step(), Step::Yield(data(1)));
        assert_eq!(r.step(), Step::Pass(Batch::completions(0, vec![4])), "not counted against the quota");
        assert_eq!(r.step(), Step::Wait);
        r.set_quota(quota(2, false));
        assert_eq!(r.step(), Step::Yield(data(2)));
        assert_eq!(r.step(), Step::Wait, "more may come");
        r.end();
        assert_eq!(r.step(), Step::Done);
    }

    #[test]
    fn a_final_quota_drops_the_rest_and_still_passes_completions() {
        let mut r = Ration::default();
        for id in 0..3 {
            r.push(data(id));
        }
        r.push(Batch::completions(0, vec![1]));
        r.end();
        r.set_quota(quota(2, true));
        assert_eq!(r.step(), Step::Yield(data(0)));
        assert_eq!(r.step(), Step::Yield(data(1)));
        assert_eq!(r.step(), Step::Drop(data(2)));
        assert_eq!(r.step(), Step::Pass(Batch::completions(0, vec![1])));
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
}
