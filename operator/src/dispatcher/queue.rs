//! The splits of a pass waiting to be handed out, in order, with any one taken out of the
//! middle in logarithmic time: a job of a share group takes the split another job's
//! production makes, wherever it stands in its own order (see `share`), and a deque's
//! search for it made an epoch cost the square of its splits.

use std::collections::{BTreeMap, HashMap};

#[derive(Default, Debug)]
pub struct SplitQueue {
    /// Rank -> split: the queue in order. Ranks below the first go to the front.
    by_rank: BTreeMap<i64, u64>,
    rank_of: HashMap<u64, i64>,
}

impl SplitQueue {
    pub fn new(splits: impl IntoIterator<Item = u64>) -> Self {
        let mut queue = SplitQueue::default();
        for split in splits {
            queue.push_back(split);
        }
        queue
    }

    fn push_back(&mut self, split: u64) {
        let rank = self.by_rank.last_key_value().map_or(0, |(r, _)| r + 1);
        self.insert(split, rank);
    }

    /// Puts `split` first (a split whose attempt was lost goes out before the rest). A split
    /// already waiting moves to the front rather than waiting twice.
    pub fn push_front(&mut self, split: u64) {
        self.remove(split);
        let rank = self.by_rank.first_key_value().map_or(0, |(r, _)| r - 1);
        self.insert(split, rank);
    }

    fn insert(&mut self, split: u64, rank: i64) {
        self.by_rank.insert(rank, split);
        self.rank_of.insert(split, rank);
    }

    pub fn pop_front(&mut self) -> Option<u64> {
        let (_, split) = self.by_rank.pop_first()?;
        self.rank_of.remove(&split);
        Some(split)
    }

    /// Takes `split` out wherever it waits; false if it does not.
    pub fn remove(&mut self, split: u64) -> bool {
        match self.rank_of.remove(&split) {
            Some(rank) => {
                self.by_rank.remove(&rank);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, split: u64) -> bool {
        self.rank_of.contains_key(&split)
    }

    pub fn is_empty(&self) -> bool {
        self.rank_of.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_rank.values().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_takes_from_the_middle_and_puts_lost_splits_first() {
        let mut q = SplitQueue::new([3, 1, 4, 5]);
        assert!(q.remove(4));
        assert!(!q.remove(4), "taken once");
        q.push_front(9);
        q.push_front(5);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![5, 9, 3, 1], "5 moved to the front, not doubled");
        assert_eq!((q.contains(1), q.contains(4)), (true, false));
        let drained: Vec<u64> = std::iter::from_fn(|| q.pop_front()).collect();
        assert_eq!(drained, vec![5, 9, 3, 1]);
        assert!(q.is_empty());
    }
}
