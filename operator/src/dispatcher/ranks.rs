//! Equal batches per rank. A job read by ranks (the processes of a DDP job) must hand every
//! rank's training loop the same number of batches in an epoch, or the ranks' collectives hang
//! on the last step. Workers deal each epoch's batches round-robin among the ranks, so the
//! counts differ by about a batch per worker; each rank reports how many it has received, and
//! every rank may yield as many as the rank that has received fewest (the epoch's quota). Once
//! every rank's stream of the epoch has ended the quota is final: ranks that received more
//! drop the rest, counted.

use std::collections::BTreeMap;

pub use stoker_api::ranks::{Quota, Received};

/// How many epochs of counts a job keeps: the one its ranks read, the one read ahead, and two
/// before for a rank that has not seen its final quota yet.
const KEPT_EPOCHS: usize = 4;

/// The ranks of one job and what each received of its recent epochs.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranks {
    consumers: u32,
    epochs: BTreeMap<u64, BTreeMap<u32, Received>>,
    /// Rows dropped over the job's life, for status.
    dropped_rows: u64,
}

impl Ranks {
    pub fn new(consumers: u32) -> Self {
        Ranks { consumers, epochs: BTreeMap::new(), dropped_rows: 0 }
    }

    pub fn consumers(&self) -> u32 {
        self.consumers
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
        let got = self.epochs.entry(epoch).or_default().entry(rank).or_default();
        self.dropped_rows += r.dropped_rows.saturating_sub(got.dropped_rows);
        *got = Received {
            batches: got.batches.max(r.batches),
            ended: got.ended || r.ended,
            dropped_rows: got.dropped_rows.max(r.dropped_rows),
        };
        while self.epochs.len() > KEPT_EPOCHS {
            self.epochs.pop_first();
        }
    }

    /// Each kept epoch's quota: none until every rank has reported it.
    pub fn quotas(&self) -> Vec<(u64, Quota)> {
        self.epochs
            .iter()
            .filter(|(_, ranks)| ranks.len() as u32 == self.consumers)
            .map(|(&epoch, ranks)| {
                let batches = ranks.values().map(|r| r.batches).min().unwrap_or(0);
                (epoch, Quota { batches, complete: ranks.values().all(|r| r.ended) })
            })
            .collect()
    }

    pub fn dropped_rows(&self) -> u64 {
        self.dropped_rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn got(batches: u64, ended: bool) -> Received {
        Received { batches, ended, dropped_rows: 0 }
    }

    #[test]
    fn the_quota_is_the_fewest_received_and_final_once_every_rank_ended() {
        let mut ranks = Ranks::new(3);
        ranks.report(0, 0, got(5, false));
        ranks.report(1, 0, got(4, false));
        assert_eq!(ranks.quotas(), [], "rank 2 has not said: it may have nothing yet");
        ranks.report(2, 0, got(6, false));
        assert_eq!(ranks.quotas(), [(0, Quota { batches: 4, complete: false })]);
        ranks.report(1, 0, got(7, true));
        ranks.report(0, 0, got(6, true));
        assert_eq!(ranks.quotas(), [(0, Quota { batches: 6, complete: false })]);
        ranks.report(2, 0, got(6, true));
        assert_eq!(ranks.quotas(), [(0, Quota { batches: 6, complete: true })]);
    }

    #[test]
    fn counts_only_grow_and_ranks_beyond_the_job_are_ignored() {
        let mut ranks = Ranks::new(2);
        ranks.report(0, 3, got(9, true));
        ranks.report(0, 3, got(2, false));
        ranks.report(1, 3, got(9, true));
        ranks.report(2, 3, got(0, false));
        assert_eq!(ranks.quotas(), [(3, Quota { batches: 9, complete: true })]);
    }

    #[test]
    fn dropped_rows_add_up_once_and_old_epochs_are_forgotten() {
        let mut ranks = Ranks::new(1);
        for epoch in 0..6 {
            ranks.report(0, epoch, Received { batches: 1, ended: true, dropped_rows: 3 });
            ranks.report(0, epoch, Received { batches: 1, ended: true, dropped_rows: 3 });
        }
        assert_eq!(ranks.dropped_rows(), 18);
        let kept: Vec<u64> = ranks.quotas().iter().map(|(e, _)| *e).collect();
        assert_eq!(kept, [2, 3, 4, 5]);
        ranks.report(0, 1, got(1, true));
        assert_eq!(ranks.quotas().len(), 4, "an epoch older than those kept is not taken back");
    }
}
