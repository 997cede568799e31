//! Seeded orders, shared by the worker (how the listing becomes splits, and in which order a
//! split's elements are read) and the dispatcher (in which order an epoch's splits go out), so
//! the same seed gives the same order everywhere.
//!
//! Items are ordered by a key hashed from (seed, epoch, item id) rather than by a shuffle of
//! their positions: a subset keeps the relative order the whole set would have (a split read
//! back from the cache, with the elements a filter dropped missing, comes out in the order the
//! same elements computed from the source do).

/// The epoch argument for orders fixed across epochs (the listing cut into splits).
pub const EVERY_EPOCH: u64 = u64::MAX;

/// What orders `item` in `epoch` under `seed`: the SplitMix64 finalizer of the three, mixed so
/// neighbouring items, epochs and seeds land far apart.
pub fn key(seed: u64, epoch: u64, item: u64) -> u64 {
    let mut z = seed
        .wrapping_add(epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(item.wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// An id for a name (a file of the listing): FNV-1a, stable across builds and machines.
pub fn name_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Puts `items` in the seeded order of `epoch`, each known by `id`.
pub fn shuffle<T>(items: &mut [T], seed: u64, epoch: u64, id: impl Fn(&T) -> u64) {
    items.sort_by_cached_key(|item| key(seed, epoch, id(item)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_repeats_for_its_seed_and_epoch_and_differs_otherwise() {
        let order = |seed, epoch| {
            let mut v: Vec<u64> = (0..100).collect();
            shuffle(&mut v, seed, epoch, |&i| i);
            v
        };
        assert_eq!(order(7, 0), order(7, 0));
        assert_ne!(order(7, 0), order(7, 1));
        assert_ne!(order(7, 0), order(8, 0));
        assert_ne!(order(7, 0), (0..100).collect::<Vec<_>>());
        let mut sorted = order(7, 3);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>(), "a permutation");
    }

    #[test]
    fn a_subset_keeps_the_order_the_whole_set_has() {
        let mut all: Vec<u64> = (0..50).collect();
        shuffle(&mut all, 1, 2, |&i| i);
        let mut evens: Vec<u64> = (0..50).filter(|i| i % 2 == 0).collect();
        shuffle(&mut evens, 1, 2, |&i| i);
        assert_eq!(evens, all.into_iter().filter(|i| i % 2 == 0).collect::<Vec<_>>());
    }

    #[test]
    fn sorted_runs_are_spread_out() {
        // 20 classes of 100 consecutive items: the first 64 of an order hold most classes.
        let mut v: Vec<u64> = (0..2000).collect();
        shuffle(&mut v, 0, 0, |&i| i);
        let classes: std::collections::BTreeSet<u64> = v[..64].iter().map(|i| i / 100).collect();
        assert!(classes.len() >= 18, "{} classes in the first 64", classes.len());
    }
}
