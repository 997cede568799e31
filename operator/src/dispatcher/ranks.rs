//! Equal batches per rank. A job read by ranks (the processes of a DDP job) must hand every
//! rank's training loop the same number of batches in an epoch, or the ranks' collectives hang
//! on the last step. Workers deal each epoch's batches round-robin among the ranks, so the
//! counts differ by about a batch per worker; each rank reports how many it has received, and
//! every rank may yield as many as the rank that has received fewest (the epoch's quota). Once
//! every rank's stream of the epoch has ended the quota is final: ranks that received more
//! drop the rest, counted.
//!
//! Coordinated mode goes further: batch k of every rank comes from the same round (a worker
//! deals one batch per rank per round, starting at rank 0), so batches a worker groups by
//! length line up across ranks. Each rank reports how many rounds of each worker it has
//! received; a round every rank has joins the epoch's order, which only grows, and every rank
//! yields the rounds in that order. What no round of the order holds (a worker's last,
//! incomplete round, rounds of a dead worker that not every rank received) is yielded after
//! the order, within the final quota: the counts stay equal and nothing is lost.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use stoker_api::WorkerId;
use stoker_api::proto::{RoundOrder, RoundRef};
pub use stoker_api::ranks::{Quota, Received};

/// How many epochs of counts a job keeps: the one its ranks read, the one read ahead, and two
/// before for a rank that has not seen its final quota yet.
const KEPT_EPOCHS: usize = 4;

/// The most rounds an epoch's order holds that not every rank has yielded. Ranks hold a few
/// batches each ahead of their training loop, far fewer than this.
pub const MAX_ORDER_ROUNDS: usize = 1 << 14;

/// The ranks of one job and what each received of its recent epochs.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranks {
    consumers: u32,
    coordinated: bool,
    /// Coordinated mode: epochs up to this one go without an order. They were being read when
    /// this dispatcher took over from one that had ordered them (their ranks have yielded
    /// different parts of that order, which is gone).
    unordered_through: Option<u64>,
    epochs: BTreeMap<u64, Epoch>,
    /// Rows dropped over the job's life, for status.
    dropped_rows: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct Epoch {
    ranks: BTreeMap<u32, Received>,
    order: Order,
}

/// An epoch's order of rounds: it only grows at the end, and forgets at the front what every
/// rank has yielded.
#[derive(Clone, Debug, Default, PartialEq)]
struct Order {
    /// By worker: its rounds in the order (every rank has them).
    taken: BTreeMap<WorkerId, u64>,
    /// Position of `rounds[0]`.
    base: u64,
    rounds: VecDeque<RoundRef>,
}

impl Ranks {
    pub fn new(consumers: u32, coordinated: bool) -> Self {
        Ranks { consumers, coordinated, unordered_through: None, epochs: BTreeMap::new(), dropped_rows: 0 }
    }

    pub fn consumers(&self) -> u32 {
        self.consumers
    }

    /// What every client of the job declares.
    pub fn shape(&self) -> stoker_api::JobShape {
        stoker_api::JobShape { ranks: self.consumers, coordinated: self.coordinated }
    }

    /// A rank rejoined this dispatcher with `open` as its job's open epoch: it may be reading
    /// that epoch or the next under another dispatcher's order.
    pub fn rejoined(&mut self, open: u64) {
        // Saturating: the epoch is the client's word, and may be u64::MAX.
        let through = open.saturating_add(1);
        self.unordered_through = Some(self.unordered_through.map_or(through, |t| t.max(through)));
    }

    /// A rank's counts for `epoch`. They only grow: a report overtaken by a later one (a retry
    /// after a dispatcher restart) changes nothing.
    pub fn report(&mut self, rank: u32, epoch: u64, r: Received) {
        if rank >= self.consumers {
            return;
        }
        if self.epochs.len() >= KEPT_EPOCHS && self.epochs.keys().next().is_some_and(|&oldest| epoch < oldest) {
            return;
        }
        let e = self.epochs.entry(epoch).or_default();
        let got = e.ranks.entry(rank).or_default();
        self.dropped_rows = self.dropped_rows.saturating_add(r.dropped_rows.saturating_sub(got.dropped_rows));
        got.batches = got.batches.max(r.batches);
        got.ended |= r.ended;
        got.dropped_rows = got.dropped_rows.max(r.dropped_rows);
        got.position = got.position.max(r.position);
        // No worker has a longer id; a longer one would be copied into every round of the order.
        for (worker, n) in r.rounds.into_iter().filter(|(w, _)| w.as_str().len() <= super::registration::MAX_ID_BYTES) {
            let rounds = got.rounds.entry(worker).or_default();
            *rounds = (*rounds).max(n);
        }
        if self.coordinated && e.ranks.len() as u32 == self.consumers {
            e.order.extend(&e.ranks);
        }
        while self.epochs.len() > KEPT_EPOCHS {
            self.epochs.pop_first();
        }
    }

    /// Each kept epoch's quota: none until every rank has reported it.
    pub fn quotas(&self) -> Vec<(u64, Quota)> {
        self.epochs
            .iter()
            .filter(|(_, e)| e.ranks.len() as u32 == self.consumers)
            .map(|(&epoch, e)| {
                let batches = e.ranks.values().map(|r| r.batches).min().unwrap_or(0);
                let ordered = self.coordinated && self.unordered_through.is_none_or(|t| epoch > t);
                let order = ordered
                    .then(|| RoundOrder { base: e.order.base, rounds: e.order.rounds.iter().cloned().collect() });
                (epoch, Quota { batches, complete: e.ranks.values().all(|r| r.ended), order })
            })
            .collect()
    }

    pub fn dropped_rows(&self) -> u64 {
        self.dropped_rows
    }
}

impl Order {
    /// Takes the rounds every rank now has, worker by worker in turn (one round of each, then
    /// the next), and forgets those every rank has yielded.
    fn extend(&mut self, ranks: &BTreeMap<u32, Received>) {
        let workers: BTreeSet<&WorkerId> = ranks.values().flat_map(|r| r.rounds.keys()).collect();
        // (worker, its next round to take, the rounds every rank has)
        let mut ready: Vec<(WorkerId, u64, u64)> = workers
            .into_iter()
            .filter_map(|w| {
                let everyone = ranks.values().map(|r| r.rounds.get(w).copied().unwrap_or(0)).min().unwrap_or(0);
                let taken = self.taken.get(w).copied().unwrap_or(0);
                (everyone > taken).then(|| (w.clone(), taken, everyone))
            })
            .collect();
        // The counts are the clients' word: at most MAX_ORDER_ROUNDS rounds wait in the order
        // (u64::MAX of them would never fit), the rest join with a later report once the ranks
        // have yielded some.
        let mut room = MAX_ORDER_ROUNDS.saturating_sub(self.rounds.len());
        let mut added = true;
        while added {
            added = false;
            for (worker, next, end) in ready.iter_mut() {
                if *next < *end && room > 0 {
                    self.rounds.push_back(RoundRef { worker: worker.to_string(), index: *next });
                    *next += 1;
                    room -= 1;
                    added = true;
                }
            }
        }
        for (worker, next, _) in ready {
            self.taken.insert(worker, next);
        }
        let yielded = ranks.values().map(|r| r.position).min().unwrap_or(0);
        while self.base < yielded && self.rounds.pop_front().is_some() {
            self.base += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn got(batches: u64, ended: bool) -> Received {
        Received { batches, ended, ..Received::default() }
    }

    fn quota(batches: u64, complete: bool) -> Quota {
        Quota { batches, complete, order: None }
    }

    /// A coordinated rank's report: rounds by worker, and its position in the order.
    fn rounds(of: &[(&str, u64)], position: u64) -> Received {
        let rounds = of.iter().map(|&(w, n)| (WorkerId::from(w), n)).collect();
        Received { batches: of.iter().map(|(_, n)| n).sum(), rounds, position, ..Received::default() }
    }

    trait With {
        fn with(self, of: &[(&str, u64)]) -> Received;
    }

    impl With for Received {
        /// These rounds, without summing them into `batches` (u64::MAX would overflow).
        fn with(mut self, of: &[(&str, u64)]) -> Received {
            self.rounds = of.iter().map(|&(w, n)| (WorkerId::from(w), n)).collect();
            self
        }
    }

    fn order(ranks: &Ranks, epoch: u64) -> (u64, Vec<(String, u64)>) {
        let quotas = ranks.quotas();
        let (_, q) = quotas.iter().find(|(e, _)| *e == epoch).expect("a quota");
        let o = q.order.as_ref().expect("an order");
        (o.base, o.rounds.iter().map(|r| (r.worker.clone(), r.index)).collect())
    }

    fn r(worker: &str, index: u64) -> (String, u64) {
        (worker.to_string(), index)
    }

    #[test]
    fn the_quota_is_the_fewest_received_and_final_once_every_rank_ended() {
        let mut ranks = Ranks::new(3, false);
        ranks.report(0, 0, got(5, false));
        ranks.report(1, 0, got(4, false));
        assert_eq!(ranks.quotas(), [], "rank 2 has not said: it may have nothing yet");
        ranks.report(2, 0, got(6, false));
        assert_eq!(ranks.quotas(), [(0, quota(4, false))]);
        ranks.report(1, 0, got(7, true));
        ranks.report(0, 0, got(6, true));
        assert_eq!(ranks.quotas(), [(0, quota(6, false))]);
        ranks.report(2, 0, got(6, true));
        assert_eq!(ranks.quotas(), [(0, quota(6, true))]);
    }

    #[test]
    fn counts_only_grow_and_ranks_beyond_the_job_are_ignored() {
        let mut ranks = Ranks::new(2, false);
        ranks.report(0, 3, got(9, true));
        ranks.report(0, 3, got(2, false));
        ranks.report(1, 3, got(9, true));
        ranks.report(2, 3, got(0, false));
        assert_eq!(ranks.quotas(), [(3, quota(9, true))]);
    }

    #[test]
    fn dropped_rows_add_up_once_and_old_epochs_are_forgotten() {
        let mut ranks = Ranks::new(1, false);
        for epoch in 0..6 {
            ranks.report(0, epoch, Received { batches: 1, ended: true, dropped_rows: 3, ..Received::default() });
            ranks.report(0, epoch, Received { batches: 1, ended: true, dropped_rows: 3, ..Received::default() });
        }
        assert_eq!(ranks.dropped_rows(), 18);
        let kept: Vec<u64> = ranks.quotas().iter().map(|(e, _)| *e).collect();
        assert_eq!(kept, [2, 3, 4, 5]);
        ranks.report(0, 1, got(1, true));
        assert_eq!(ranks.quotas().len(), 4, "an epoch older than those kept is not taken back");
    }

    #[test]
    fn a_round_joins_the_order_once_every_rank_has_it_and_workers_take_turns() {
        let mut ranks = Ranks::new(2, true);
        ranks.report(0, 0, rounds(&[("a", 3), ("b", 1)], 0));
        assert_eq!(ranks.quotas(), [], "rank 1 has not said");
        ranks.report(1, 0, rounds(&[("a", 2)], 0));
        assert_eq!(order(&ranks, 0), (0, vec![r("a", 0), r("a", 1)]), "b's round 0 is not at rank 1 yet");
        ranks.report(1, 0, rounds(&[("a", 3), ("b", 2)], 0));
        assert_eq!(order(&ranks, 0), (0, vec![r("a", 0), r("a", 1), r("a", 2), r("b", 0)]));
        ranks.report(0, 0, rounds(&[("a", 5), ("b", 4)], 0));
        ranks.report(1, 0, rounds(&[("a", 5), ("b", 4)], 0));
        let (_, rounds) = order(&ranks, 0);
        assert_eq!(
            rounds[4..],
            [r("b", 1), r("a", 3), r("b", 2), r("a", 4), r("b", 3)],
            "rank 0's report let b's round 1 in; then in turn"
        );
    }

    #[test]
    fn the_order_only_grows_and_forgets_what_every_rank_yielded() {
        let mut ranks = Ranks::new(2, true);
        ranks.report(0, 0, rounds(&[("a", 3)], 0));
        ranks.report(1, 0, rounds(&[("a", 3)], 0));
        ranks.report(0, 0, rounds(&[("a", 3)], 2));
        assert_eq!(order(&ranks, 0).0, 0, "rank 1 yielded nothing yet");
        ranks.report(1, 0, rounds(&[("a", 1)], 1));
        assert_eq!(order(&ranks, 0), (1, vec![r("a", 1), r("a", 2)]), "an old report takes nothing back");
        ranks.report(1, 0, rounds(&[("a", 3)], 3));
        ranks.report(0, 0, rounds(&[("a", 3)], 3));
        assert_eq!(order(&ranks, 0), (3, vec![]));
    }

    #[test]
    fn epochs_read_across_a_dispatcher_change_go_without_an_order() {
        let mut ranks = Ranks::new(2, true);
        ranks.rejoined(4);
        ranks.rejoined(3);
        for epoch in [5, 6] {
            ranks.report(0, epoch, rounds(&[("a", 1)], 0));
            ranks.report(1, epoch, rounds(&[("a", 1)], 0));
        }
        let quotas = ranks.quotas();
        assert_eq!(quotas[0], (5, quota(1, false)), "the open epoch 4 and the next, 5, had another's order");
        assert_eq!(quotas[1].1.order.as_ref().map(|o| o.rounds.len()), Some(1));
        let mut plain = Ranks::new(2, false);
        plain.report(0, 0, rounds(&[("a", 1)], 0));
        plain.report(1, 0, rounds(&[("a", 1)], 0));
        assert_eq!(plain.quotas(), [(0, quota(1, false))], "not coordinated: no order");
    }

    #[test]
    fn rounds_counts_a_client_makes_up_fill_the_order_only_so_far() {
        // Both ranks claiming u64::MAX rounds of a worker looped until memory ran out.
        let claim = |of: &[(&str, u64)], position| Received { batches: 1, ..rounds(&of[..0], position) }.with(of);
        let mut ranks = Ranks::new(2, true);
        ranks.report(0, 0, claim(&[("a", u64::MAX), ("b", 2)], 0));
        ranks.report(1, 0, claim(&[("a", u64::MAX), ("b", 2)], 0));
        let (base, taken) = order(&ranks, 0);
        assert_eq!((base, taken.len()), (0, MAX_ORDER_ROUNDS));
        assert_eq!(taken[..4], [r("a", 0), r("b", 0), r("a", 1), r("b", 1)], "in turn, as before");
        // Once the ranks have yielded some, their next reports take as many more, in order.
        for _ in 0..2 {
            ranks.report(0, 0, claim(&[("a", u64::MAX)], 10));
            ranks.report(1, 0, claim(&[("a", u64::MAX)], 10));
        }
        let (base, taken) = order(&ranks, 0);
        assert_eq!((base, taken.len()), (10, MAX_ORDER_ROUNDS));
        assert_eq!(taken.last(), Some(&r("a", MAX_ORDER_ROUNDS as u64 + 7)));
        // A worker id longer than any the dispatcher accepts is not copied into the order.
        let long = "w".repeat(crate::dispatcher::MAX_ID_BYTES + 1);
        let mut other = Ranks::new(2, true);
        other.report(0, 0, rounds(&[(&long, 3)], 0));
        other.report(1, 0, rounds(&[(&long, 3)], 0));
        assert_eq!(order(&other, 0), (0, vec![]));
    }

    #[test]
    fn dropped_rows_saturate() {
        let mut ranks = Ranks::new(1, false);
        for epoch in 0..2 {
            ranks.report(0, epoch, Received { dropped_rows: u64::MAX, ..Received::default() });
        }
        assert_eq!(ranks.dropped_rows(), u64::MAX);
    }
}
