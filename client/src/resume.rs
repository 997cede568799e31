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
            merged_ranks: 0,
            yielded: self
                .rows
                .iter()
                .map(|(&split, positions)| {
                    let mut positions = positions.clone();
                    positions.sort_unstable();
                    // A merged state's rows may come back in every new rank's state.
                    positions.dedup();
                    HeldRows { epoch: self.epoch, split, positions }
                })
                .collect(),
        }
    }
}

/// One state from the states every rank of a job saved at the same step (`Client::state`):
/// their rows together. It resumes the job read by any number of ranks, each passing it as
/// its `ClientOptions::resume` under its own rank (2 ranks' states resume 4 ranks, or 1, after
/// a preemption onto other nodes). Refused unless the states are of one job, one step (the
/// same epoch and batches yielded) and every rank, each once.
pub fn merge_states(states: &[ResumeState]) -> Result<ResumeState, String> {
    let Some(first) = states.first() else { return Err("no states to merge".into()) };
    if let [only] = states
        && only.merged_ranks > 0
    {
        return Ok(only.clone());
    }
    let ranks = first.consumers.max(1);
    let mut seen = BTreeMap::new();
    for s in states {
        if s.merged_ranks > 0 {
            return Err("a merged state is merged again only alone: merge the ranks' own states".into());
        }
        if (&s.job, s.epoch, s.batches, s.consumers.max(1)) != (&first.job, first.epoch, first.batches, ranks) {
            return Err(format!(
                "the states are of different steps: job {:?} epoch {} after {} batches of {} rank(s), and job {:?} \
                 epoch {} after {} batches of {} rank(s): merge the states saved at one checkpoint",
                first.job,
                first.epoch,
                first.batches,
                ranks,
                s.job,
                s.epoch,
                s.batches,
                s.consumers.max(1)
            ));
        }
        if seen.insert(s.consumer_index, ()).is_some() {
            return Err(format!("rank {}'s state is given twice", s.consumer_index));
        }
    }
    let missing: Vec<String> = (0..ranks).filter(|r| !seen.contains_key(r)).map(|r| r.to_string()).collect();
    if !missing.is_empty() || seen.len() as u32 != ranks {
        return Err(format!(
            "the states of {ranks} rank(s) are needed, one each; missing: rank(s) {}",
            if missing.is_empty() { "none, but some are out of range".to_string() } else { missing.join(", ") }
        ));
    }
    let mut rows: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for h in states.iter().flat_map(|s| &s.yielded).filter(|h| h.epoch == first.epoch) {
        rows.entry(h.split).or_default().extend(&h.positions);
    }
    let yielded = rows
        .into_iter()
        .map(|(split, mut positions)| {
            positions.sort_unstable();
            positions.dedup();
            HeldRows { epoch: first.epoch, split, positions }
        })
        .collect();
    Ok(ResumeState { consumer_index: 0, yielded, merged_ranks: ranks, ..first.clone() })
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

    #[test]
    fn the_ranks_states_of_one_step_merge_into_one_and_nothing_else_does() {
        let state = |rank, rows: &[(u64, u64)]| {
            let mut y = Yielded::new(4);
            y.record(&batch(rows));
            y.state("job", 2, rank)
        };
        let (a, b) = (state(0, &[(1, 5), (0, 3)]), state(1, &[(1, 2), (1, 5)]));
        let merged = merge_states(&[b.clone(), a.clone()]).unwrap();
        assert_eq!((merged.merged_ranks, merged.epoch, merged.batches, merged.consumers), (2, 4, 1, 2));
        let rows: Vec<(u64, Vec<u32>)> = merged.yielded.iter().map(|h| (h.split, h.positions.clone())).collect();
        assert_eq!(rows, [(0, vec![3]), (1, vec![2, 5])]);
        assert_eq!(merge_states(std::slice::from_ref(&merged)).unwrap(), merged, "a merged state alone is itself");

        let err = |states: &[ResumeState]| merge_states(states).unwrap_err();
        assert!(err(std::slice::from_ref(&a)).contains("missing: rank(s) 1"));
        assert!(err(&[a.clone(), a.clone()]).contains("rank 0's state is given twice"));
        let later = state(1, &[(1, 2)]);
        let mut later = ResumeState { batches: 2, ..later };
        assert!(err(&[a.clone(), later.clone()]).contains("different steps"));
        later.batches = 1;
        later.job = "other".into();
        assert!(err(&[a.clone(), later]).contains("different steps"));
        assert!(err(&[a, merged]).contains("merged again only alone"));
        assert!(err(&[]).contains("no states"));
    }
}
