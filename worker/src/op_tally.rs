//! What one op did on a worker: its thread time and the elements into and out of it. Kept per
//! transform index from the inner loops (`apply`, `table::apply`, the engine's stages) up to the
//! heartbeat, the metrics and the bench reports.

use std::time::Duration;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpTally {
    /// Thread time, summed over the threads that ran the op.
    pub time: Duration,
    /// Elements (rows on the columnar path) the op was given.
    pub elements_in: u64,
    /// Elements it passed on: fewer after a filter or a failure, more after `echo`, rows after
    /// `pack`.
    pub elements_out: u64,
}

impl OpTally {
    /// A fresh tally for each of `ops` transforms.
    pub fn for_ops(ops: usize) -> Vec<OpTally> {
        vec![OpTally::default(); ops]
    }

    /// Adds `other` (a chunk's tallies) into `into`, index by index.
    pub fn add_all(into: &mut [OpTally], other: &[OpTally]) {
        for (total, t) in into.iter_mut().zip(other) {
            total.time += t.time;
            total.elements_in += t.elements_in;
            total.elements_out += t.elements_out;
        }
    }

    /// `elements` went in and came out (an op that maps one to one).
    pub fn passed(&mut self, elements: u64) {
        self.elements_in += elements;
        self.elements_out += elements;
    }
}
