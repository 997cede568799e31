//! Where one epoch of a job's batches goes on this worker: one queue its consumers share (first
//! come, first served), or for a job read by ranks one queue per rank, dealt round-robin so
//! every rank gets about as many as the others (the dispatcher's quotas even out the rest).
//!
//! Each rank must see every split's completion behind its own batches of that split, or the
//! split could be done while a rank still had its rows on the way: the batch holding a split's
//! last element goes to one rank, and a batch of completions alone to each of the others.
//!
//! In coordinated mode the deal is in rounds: every round starts at rank 0 and gives each rank
//! one batch, tagged with the round, so the ranks can yield a worker's round at the same step
//! (the dispatcher orders the rounds of all workers).

use crate::budget::Unsent;
use stoker_api::proto::RoundRef;
use stoker_api::{Batch, Stacked};
use tokio::sync::mpsc;
use tonic::Status;

/// A batch (naming the splits it completes), or the job's failure.
pub type JobItem = Result<Batch<Stacked>, Status>;

/// An item in a rank's queue, with the worker's registration generation it was made under
/// (see `dispatched::link`): made before the dispatcher forgot this worker, a batch is stale.
#[derive(Debug)]
pub struct Queued {
    pub generation: u64,
    pub item: JobItem,
    /// A batch's place in its producer's budget until a stream takes it (`budget::Unsent`).
    pub unsent: Option<Unsent>,
}

impl Queued {
    /// A batch made before this worker registered again (as `generation`): its splits were
    /// handed to others, or the new dispatcher never gave them out, so no stream sends it. A
    /// failure is never stale: every stream must see it.
    pub fn stale(&self, generation: u64) -> bool {
        self.item.is_ok() && self.generation != generation
    }
}

pub struct Deal {
    queues: Vec<mpsc::Sender<Queued>>,
    /// The rank the next batch with tensors goes to.
    next: usize,
    /// Coordinated mode: this worker's id, which names its rounds, and the round being dealt.
    rounds: Option<(String, u64)>,
    /// The generation the items sent now were made under.
    generation: u64,
}

/// Every queue of the epoch is closed: no one reads what is sent.
#[derive(Debug)]
pub struct Closed;

/// The other side: each rank's queue, by rank.
pub type Hands = Vec<mpsc::Receiver<Queued>>;

impl Deal {
    /// Queues of `capacity` for `consumers` ranks (one shared queue for 0 or 1). The first
    /// batch goes to rank `first % consumers`: workers start at different ranks, so the
    /// remainders of their epochs do not all fall on rank 0.
    pub fn new(consumers: u32, capacity: usize, first: u64) -> (Deal, Hands) {
        let ranks = consumers.max(1) as usize;
        let (queues, hands) = (0..ranks).map(|_| mpsc::channel(capacity)).unzip();
        (Deal { queues, next: (first % ranks as u64) as usize, rounds: None, generation: 0 }, hands)
    }

    /// Coordinated mode for `consumers` ranks: rounds from rank 0, named by `worker`.
    pub fn in_rounds(consumers: u32, capacity: usize, worker: String) -> (Deal, Hands) {
        let (deal, hands) = Deal::new(consumers, capacity, 0);
        (Deal { rounds: Some((worker, 0)), ..deal }, hands)
    }

    /// What the items sent from now on were made under.
    pub fn tag(&mut self, generation: u64) {
        self.generation = generation;
    }

    fn queued(&self, item: JobItem) -> Queued {
        Queued { generation: self.generation, item, unsent: None }
    }

    /// Sends `batch` (with its place in the budget, `unsent`, if its producer waits for it) to
    /// its rank, waiting while that rank's queue is full, and its completions to the others.
    /// Err once every queue is closed.
    pub fn send(&mut self, batch: Batch<Stacked>, unsent: Option<Unsent>) -> Result<(), Closed> {
        let ranks = self.queues.len();
        if ranks == 1 {
            return self.queues[0].blocking_send(Queued { unsent, ..self.queued(Ok(batch)) }).map_err(|_| Closed);
        }
        if batch.is_completions() {
            self.to_ranks(|_| true, &batch);
        } else {
            let mut batch = batch;
            let rank = self.next;
            self.next = (rank + 1) % ranks;
            if let Some((worker, round)) = &mut self.rounds {
                batch.round = Some(RoundRef { worker: worker.clone(), index: *round });
                if self.next == 0 {
                    *round += 1;
                }
            }
            let completions =
                (!batch.completes.is_empty()).then(|| Batch::completions(batch.epoch, batch.completes.clone()));
            let _ = self.queues[rank].blocking_send(Queued { unsent, ..self.queued(Ok(batch)) });
            if let Some(c) = completions {
                self.to_ranks(|r| r != rank, &c);
            }
        }
        if self.is_closed() { Err(Closed) } else { Ok(()) }
    }

    /// The job's failure, to every rank.
    pub fn fail(&self, status: Status) {
        for q in &self.queues {
            let _ = q.blocking_send(self.queued(Err(status.clone())));
        }
    }

    pub fn is_closed(&self) -> bool {
        self.queues.iter().all(mpsc::Sender::is_closed)
    }

    fn to_ranks(&self, pick: impl Fn(usize) -> bool, batch: &Batch<Stacked>) {
        for (_, q) in self.queues.iter().enumerate().filter(|(rank, _)| pick(*rank)) {
            let _ = q.blocking_send(self.queued(Ok(batch.clone())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(completes: &[u64]) -> Batch<Stacked> {
        let tensor = stoker_api::Tensor::new(stoker_api::DType::Uint8, vec![1], vec![0u8].into()).unwrap();
        Batch { tensors: [("x".to_string(), tensor.into())].into(), completes: completes.to_vec(), ..Batch::default() }
    }

    fn drain(hands: &mut Hands) -> Vec<Vec<(bool, Vec<u64>)>> {
        hands
            .iter_mut()
            .map(|h| {
                std::iter::from_fn(|| h.try_recv().ok().map(|q| q.item))
                    .map(|item| item.map(|b| (b.is_completions(), b.completes)).unwrap())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn batches_are_dealt_round_robin_and_every_rank_sees_each_completion_behind_its_batches() {
        let (mut deal, mut hands) = Deal::new(3, 8, 4);
        for completes in [&[][..], &[], &[7], &[], &[]] {
            deal.send(data(completes), None).unwrap();
        }
        deal.send(Batch::completions(0, vec![9]), None).unwrap();
        let data = |c: &[u64]| (false, c.to_vec());
        let only = |c: &[u64]| (true, c.to_vec());
        assert_eq!(
            drain(&mut hands),
            [
                vec![data(&[7]), only(&[9])],
                vec![data(&[]), only(&[7]), data(&[]), only(&[9])],
                vec![data(&[]), only(&[7]), data(&[]), only(&[9])],
            ],
            "the first goes to rank 4 % 3"
        );
    }

    #[test]
    fn in_rounds_every_round_starts_at_rank_0_and_names_itself() {
        let (mut deal, mut hands) = Deal::in_rounds(2, 8, "w-1".into());
        for completes in [&[][..], &[3], &[]] {
            deal.send(data(completes), None).unwrap();
        }
        let rounds: Vec<Vec<(Option<u64>, Vec<u64>)>> = hands
            .iter_mut()
            .map(|h| {
                std::iter::from_fn(|| h.try_recv().ok().map(|q| q.item))
                    .map(|item| item.map(|b| (b.round.map(|r| r.index), b.completes)).unwrap())
                    .collect()
            })
            .collect();
        assert_eq!(
            rounds,
            [vec![(Some(0), vec![]), (None, vec![3]), (Some(1), vec![])], vec![(Some(0), vec![3])]],
            "completions alone carry no round"
        );
    }

    #[test]
    fn one_consumer_or_none_declared_shares_one_queue() {
        let (mut deal, mut hands) = Deal::new(0, 8, 5);
        deal.send(data(&[1]), None).unwrap();
        deal.send(data(&[]), None).unwrap();
        assert_eq!(drain(&mut hands), [vec![(false, vec![1]), (false, vec![])]]);
        drop(hands);
        assert!(deal.send(data(&[]), None).is_err(), "no one left to send to");
    }
}
