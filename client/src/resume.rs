//! What a consumer's training loop has been handed of the epoch it reads, kept so the client
//! can give its state after any batch (`Client::state`): saved with a checkpoint, it restarts
//! the job there, on any dispatcher and with any number of workers, without repeating or
//! skipping an element (the dispatcher leaves out every rank's yielded rows).

use std::collections::BTreeMap;

use stoker_api::proto::{HeldRows, ResumeState};
use stoker_api::{Batch, row_origin};

pub(crate) struct Yielded {
    epoch: u64,
    batches: u64,
    /// Positions yielded, by split.
    rows: BTreeMap<u64, Vec<u32>>,
}

impl Yielded {
    pub(crate) fn new(epoch: u64) -> Self {
        Yielded { epoch, batches: 0, rows: BTreeMap::new() }
    }

    /// Goes on from a saved state: a later state of the same epoch covers both runs.
    pub(crate) fn resumed(state: &ResumeState) -> Self {
        let mut rows: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        for h in state.yielded.iter().filter(|h| h.epoch == state.epoch) {
            rows.entry(h.split).or_default().extend(&h.positions);
        }
        Yielded { epoch: state.epoch, batches: state.batches, rows }
    }

    /// The training loop got `batch`.
    pub(crate) fn record(&mut self, batch: &Batch) {
        self.batches += 1;
        for &row in &batch.rows {
            let (split, position) = row_origin(row);
            self.rows.entry(split).or_default().push(position);
        }
    }

    /// The loop moves on to `epoch`.
    pub(crate) fn next_epoch(&mut self, epoch: u64) {
        *self = Yielded::new(epoch);
    }

    pub(crate) fn state(&self, job: &str, consumers: u32, consumer_index: u32) -> ResumeState {
        ResumeState {
            job: job.to_string(),
            epoch: self.epoch,
            batches: self.batches,
            consumers,
            consumer_index,
            yielded: self
                .rows
                .iter()
                .map(|(&split, positions)| {
                    let mut positions = positions.clone();
                    positions.sort_unstable();
                    HeldRows { epoch: self.epoch, split, positions }
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: &[(u64, u64)]) -> Batch {
        Batch { rows: rows.iter().map(|&(s, p)| stoker_api::row(s, p)).collect(), ..Batch::default() }
    }

    #[test]
    fn the_state_holds_the_epochs_yielded_rows_and_a_resumed_one_goes_on_from_it() {
        let mut y = Yielded::new(2);
        y.record(&batch(&[(1, 5), (0, 3)]));
        y.record(&batch(&[(1, 2)]));
        let state = y.state("job", 2, 1);
        assert_eq!((state.epoch, state.batches, state.consumers, state.consumer_index), (2, 2, 2, 1));
        let rows: Vec<(u64, Vec<u32>)> = state.yielded.iter().map(|h| (h.split, h.positions.clone())).collect();
        assert_eq!(rows, [(0, vec![3]), (1, vec![2, 5])]);

        let mut resumed = Yielded::resumed(&state);
        resumed.record(&batch(&[(1, 0)]));
        let later = resumed.state("job", 2, 1);
        assert_eq!(later.batches, 3);
        assert_eq!(later.yielded[1].positions, [0, 2, 5], "both runs' rows");

        resumed.next_epoch(3);
        let next = resumed.state("job", 2, 1);
        assert_eq!((next.epoch, next.batches, next.yielded.len()), (3, 0, 0));
    }
}
