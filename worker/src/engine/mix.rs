//! Mixing: which splits of which source each epoch reads, and in what order the dispatcher
//! numbers them.
//!
//! One source: every split once per epoch, numbered as planned. A mix (`spec.source.mix`):
//! each source gets a share of the bytes read in proportion to its weight, an epoch being as
//! many bytes as all the sources hold. A source smaller than its share repeats; a larger one
//! gives another part of itself each epoch, walking a seeded cycle of its splits so every split
//! is read equally often over the epochs.
//!
//! The slots of all epochs form one sequence, each slot going to the source furthest behind
//! its share of the slots so far (Sainte-Laguë's rule). So every stretch of an epoch (and the
//! dispatcher's seeded order of it) holds the sources in proportion, a share that is not a
//! whole number of splits per epoch is met over the epochs rather than rounded, and the
//! realised shares converge to the weights.
//!
//! The dispatcher's ledger sees only slots 0..slots(): the same count every epoch, each
//! delivered exactly once. Which split a slot reads is a pure function of the listing, the
//! weights, the seed and the epoch, so every worker agrees.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use stoker_api::{MixedSource, order};

use super::plan::Split;

/// A source's planned splits, in the order the epochs walk them (seeded for a mix, as
/// planned alone).
#[derive(Clone, Debug)]
struct Mixed {
    splits: Vec<Split>,
    cycle: Vec<usize>,
}

/// An epoch's slots: (source, index in the source's cycle, before wrapping).
type Table = Arc<Vec<(usize, u64)>>;

pub struct Mix {
    sources: Vec<Mixed>,
    /// Each source's fraction of the slots.
    quotas: Vec<f64>,
    slots: u64,
    /// Slots taken by each source before the epochs computed so far, and the latest tables:
    /// the sequence is walked from the nearest known start, not from epoch 0 every time.
    starts: Mutex<BTreeMap<u64, Vec<u64>>>,
    tables: Mutex<Vec<(u64, Table)>>,
}

/// Tables kept: the epoch being produced and the next (workers read ahead), with room.
const TABLES: usize = 4;

/// A split's weight in bytes, its files' or its row groups': an empty file still costs a read.
fn bytes(split: &Split) -> f64 {
    if split.row_groups.is_empty() {
        split.shards.iter().map(|s| s.size.max(1) as f64).sum()
    } else {
        split.row_groups.iter().map(|g| g.bytes.max(1) as f64).sum()
    }
}

impl Mix {
    /// `planned[i]` holds source i's splits (ids 0..n within the source, none empty), beside its
    /// weight.
    pub fn new(planned: Vec<(Vec<Split>, &MixedSource)>, seed: u64) -> Mix {
        let total_bytes: f64 = planned.iter().flat_map(|(splits, _)| splits.iter().map(bytes)).sum();
        let total_weight: f64 = planned.iter().map(|(_, m)| m.weight).sum();
        let mixing = planned.len() > 1;
        // Splits per epoch of each source: its share of the bytes over its mean split.
        let rates: Vec<f64> = planned
            .iter()
            .map(|(splits, m)| {
                let mean = splits.iter().map(bytes).sum::<f64>() / splits.len().max(1) as f64;
                if mixing { m.weight / total_weight * total_bytes / mean } else { splits.len() as f64 }
            })
            .collect();
        let total_rate: f64 = rates.iter().sum();
        let sources = planned
            .into_iter()
            .enumerate()
            .map(|(i, (splits, _))| {
                let mut cycle: Vec<usize> = (0..splits.len()).collect();
                if mixing {
                    let seed = order::key(seed, order::EVERY_EPOCH, i as u64);
                    order::shuffle(&mut cycle, seed, order::EVERY_EPOCH, |&j| j as u64);
                }
                Mixed { splits, cycle }
            })
            .collect::<Vec<_>>();
        Mix {
            quotas: rates.iter().map(|r| r / total_rate).collect(),
            slots: (total_rate.round() as u64).max(1),
            starts: Mutex::new(BTreeMap::from([(0, vec![0; sources.len()])])),
            tables: Mutex::new(Vec::new()),
            sources,
        }
    }

    /// Slots per epoch: what the dispatcher hands out.
    pub fn slots(&self) -> u64 {
        self.slots
    }

    /// Each source's fraction of the slots (of the bytes, when its splits are alike).
    pub fn quotas(&self) -> &[f64] {
        &self.quotas
    }

    /// Every source's planned splits, for the digest workers compare.
    pub fn planned(&self) -> impl Iterator<Item = &Split> {
        self.sources.iter().flat_map(|s| s.splits.iter())
    }

    /// What `slot` of `epoch` reads: a source's split, numbered `slot`. None beyond the slots.
    pub fn split(&self, epoch: u64, slot: u64) -> Option<Split> {
        let table = self.table(epoch);
        let &(source, nth) = table.get(usize::try_from(slot).ok()?)?;
        let s = &self.sources[source];
        let at = s.cycle[(nth % s.cycle.len() as u64) as usize];
        Some(Split { id: slot, source, ..s.splits[at].clone() })
    }

    /// Every slot of `epoch`, in slot order.
    pub fn epoch(&self, epoch: u64) -> Vec<Split> {
        (0..self.slots).filter_map(|slot| self.split(epoch, slot)).collect()
    }

    fn table(&self, epoch: u64) -> Table {
        if let Some((_, table)) = self.tables.lock().unwrap().iter().find(|(e, _)| *e == epoch) {
            return table.clone();
        }
        let mut starts = self.starts.lock().unwrap();
        let (&from, taken) = starts.range(..=epoch).next_back().expect("epoch 0 starts with nothing taken");
        // One source takes every slot: nothing to walk.
        let (from, mut taken) =
            if self.sources.len() == 1 { (epoch, vec![epoch * self.slots]) } else { (from, taken.clone()) };
        for _ in 0..(epoch - from) * self.slots {
            let next = self.behind_most(&taken);
            taken[next] += 1;
        }
        starts.insert(epoch, taken.clone());
        let table: Vec<(usize, u64)> = (0..self.slots)
            .map(|_| {
                let next = self.behind_most(&taken);
                taken[next] += 1;
                (next, taken[next] - 1)
            })
            .collect();
        starts.insert(epoch + 1, taken);
        let table = Arc::new(table);
        let mut tables = self.tables.lock().unwrap();
        if tables.len() == TABLES {
            tables.remove(0);
        }
        tables.push((epoch, table.clone()));
        table
    }

    /// The source furthest behind its share: the smallest (taken + 1/2) / quota, ties to the
    /// first. Sources with no quota never come up.
    fn behind_most(&self, taken: &[u64]) -> usize {
        (0..taken.len())
            .filter(|&i| self.quotas[i] > 0.0)
            .min_by(|&a, &b| {
                let lhs = (taken[a] as f64 + 0.5) * self.quotas[b];
                let rhs = (taken[b] as f64 + 0.5) * self.quotas[a];
                lhs.total_cmp(&rhs).then(a.cmp(&b))
            })
            .expect("some source has a quota")
    }
}

impl std::fmt::Debug for Mix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mix").field("slots", &self.slots).field("quotas", &self.quotas).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Shard;

    fn splits(source: &str, sizes: &[u64]) -> Vec<Split> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| Split {
                id: i as u64,
                source: 0,
                shards: vec![Shard { path: format!("{source}/{i:04}"), size, version: "v".into() }],
                row_groups: Vec::new(),
            })
            .collect()
    }

    fn weight(uri: &str, weight: f64) -> MixedSource {
        MixedSource { uri: uri.into(), weight }
    }

    fn path(split: &Split) -> &str {
        &split.shards[0].path
    }

    /// Splits each source gives `epoch`.
    fn counts(mix: &Mix, epoch: u64) -> Vec<usize> {
        let splits = mix.epoch(epoch);
        (0..mix.quotas().len()).map(|i| splits.iter().filter(|s| s.source == i).count()).collect()
    }

    #[test]
    fn one_source_reads_every_split_once_as_planned() {
        let only = weight("a", 1.0);
        let mix = Mix::new(vec![(splits("a", &[10, 20, 30, 40]), &only)], 7);
        assert_eq!(mix.slots(), 4);
        for epoch in [0, 1, 9, 3] {
            let paths: Vec<String> = mix.epoch(epoch).iter().map(|s| path(s).to_string()).collect();
            assert_eq!(paths, ["a/0000", "a/0001", "a/0002", "a/0003"], "epoch {epoch}");
        }
        assert!(mix.split(0, 4).is_none(), "beyond the plan");
    }

    #[test]
    fn a_mix_takes_each_sources_share_of_the_bytes_in_alternation() {
        // Web: 40 splits of 1 MB; code: 10 of 2 MB; books: 5 of 4 MB. 80 MB in all.
        let (web, code, books) = (weight("web", 0.7), weight("code", 0.2), weight("books", 0.1));
        let planned = vec![
            (splits("web", &[1 << 20; 40]), &web),
            (splits("code", &[2 << 20; 10]), &code),
            (splits("books", &[4 << 20; 5]), &books),
        ];
        let mix = Mix::new(planned, 3);
        // 0.7 * 80 MB = 56 splits of web (it repeats), 0.2 * 80 / 2 = 8 of code, 0.1 * 80 / 4 = 2 books.
        assert_eq!(mix.slots(), 66);
        assert_eq!(counts(&mix, 0), [56, 8, 2]);
        let epoch = mix.epoch(0);
        assert!(epoch.iter().enumerate().all(|(i, s)| s.id == i as u64), "slots numbered in order");
        // Any stretch of 33 slots holds the sources within one split of their share.
        for start in 0..33 {
            let window = &epoch[start..start + 33];
            for (source, expected) in [(0, 28.0), (1, 4.0), (2, 1.0)] {
                let n = window.iter().filter(|s| s.source == source).count() as f64;
                assert!((n - expected).abs() <= 1.0, "slots {start}..: source {source} has {n}, not about {expected}");
            }
        }
        let bytes_of = |source: usize| epoch.iter().filter(|s| s.source == source).map(bytes).sum::<f64>();
        let total: f64 = (0..3).map(bytes_of).sum();
        for (source, w) in [(0, 0.7), (1, 0.2), (2, 0.1)] {
            assert!((bytes_of(source) / total - w).abs() < 0.01, "source {source}");
        }
    }

    #[test]
    fn over_the_epochs_every_split_of_a_source_is_read_equally_often() {
        let (big, small) = (weight("big", 1.0), weight("small", 1.0));
        let mix = || Mix::new(vec![(splits("big", &[1; 30]), &big), (splits("small", &[1; 6]), &small)], 11);
        // Equal weights over 36 equal splits: 18 a source per epoch.
        let m = mix();
        let mut reads = std::collections::BTreeMap::<String, u32>::new();
        for epoch in 0..5 {
            assert_eq!(counts(&m, epoch), [18, 18]);
            let splits = m.epoch(epoch);
            let big_paths: std::collections::BTreeSet<&str> =
                splits.iter().filter(|s| s.source == 0).map(path).collect();
            assert_eq!(big_paths.len(), 18, "no big split twice within an epoch");
            for s in &splits {
                *reads.entry(path(s).to_string()).or_default() += 1;
            }
        }
        // 5 epochs of 18: every big split 3 times, every small one 15 times.
        assert!(reads.iter().filter(|(p, _)| p.starts_with("big")).all(|(_, &n)| n == 3), "{reads:?}");
        assert!(reads.iter().filter(|(p, _)| p.starts_with("small")).all(|(_, &n)| n == 15), "{reads:?}");
        assert_eq!(reads.len(), 36);
        assert_eq!(mix().epoch(3), m.epoch(3), "the same for the same seed on every worker, in any epoch order");
        let other = Mix::new(vec![(splits("big", &[1; 30]), &big), (splits("small", &[1; 6]), &small)], 12);
        assert_ne!(m.epoch(0), other.epoch(0), "another seed walks another cycle");
        assert_ne!(m.epoch(0), m.epoch(1), "consecutive epochs read other parts of the big source");
    }

    #[test]
    fn shares_that_are_not_whole_splits_per_epoch_are_met_over_the_epochs() {
        // 10 splits each; weights 0.76 / 0.24 give 15.2 and 4.8 splits an epoch of 20.
        let (a, b) = (weight("a", 0.76), weight("b", 0.24));
        let mix = Mix::new(vec![(splits("a", &[7; 10]), &a), (splits("b", &[7; 10]), &b)], 5);
        assert_eq!(mix.slots(), 20);
        let mut b_total = 0;
        for epoch in 0..25 {
            let c = counts(&mix, epoch);
            assert_eq!(c[0] + c[1], 20);
            assert!((4..=5).contains(&c[1]), "epoch {epoch}: {c:?}");
            b_total += c[1];
        }
        assert_eq!(b_total, 120, "0.24 of 500 slots exactly, not 5 an epoch rounded");
        // Resuming far ahead gives what walking there gives.
        let fresh = Mix::new(vec![(splits("a", &[7; 10]), &a), (splits("b", &[7; 10]), &b)], 5);
        assert_eq!(fresh.epoch(24), mix.epoch(24));
    }

    #[test]
    fn a_tiny_weight_gets_its_tiny_share() {
        let (a, b) = (weight("a", 99.0), weight("b", 1.0));
        let mix = Mix::new(vec![(splits("a", &[1; 10]), &a), (splits("b", &[1; 10]), &b)], 0);
        assert_eq!(mix.slots(), 20);
        let b_splits: usize = (0..50).map(|e| counts(&mix, e)[1]).sum();
        assert_eq!(b_splits, 10, "1% of 1000 slots");
    }
}
