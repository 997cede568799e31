//! The shuffle buffer: holds up to `capacity` elements and releases a random one for each new
//! element, like tf.data's shuffle. Seeded per (seed, epoch) so runs repeat exactly. The
//! engine may stop it growing below `capacity` (the memory budget's cap, see the batcher);
//! from then on it behaves exactly as a buffer made with the smaller capacity.

/// SplitMix64: tiny, fast and well mixed; plenty for choosing buffer slots.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0), by multiply-shift: bias below 2^-32 for any realistic n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

pub struct ShuffleBuffer<T> {
    items: Vec<T>,
    capacity: usize,
    rng: SplitMix64,
}

impl<T> ShuffleBuffer<T> {
    pub fn new(capacity: usize, seed: u64, epoch: u64) -> Self {
        let mut mix = SplitMix64::new(seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let rng = SplitMix64::new(mix.next_u64());
        ShuffleBuffer { items: Vec::with_capacity(capacity.min(1 << 16)), capacity: capacity.max(1), rng }
    }

    /// Adds an element; once the buffer is full, returns a uniformly chosen one.
    pub fn push(&mut self, item: T) -> Option<T> {
        if self.items.len() < self.capacity {
            self.items.push(item);
            return None;
        }
        let i = self.rng.below(self.items.len());
        Some(std::mem::replace(&mut self.items[i], item))
    }

    /// The remaining elements in random order (end of input).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        std::iter::from_fn(move || {
            if self.items.is_empty() {
                return None;
            }
            let i = self.rng.below(self.items.len());
            Some(self.items.swap_remove(i))
        })
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the next push adds an element rather than swapping one out.
    pub fn is_growing(&self) -> bool {
        self.items.len() < self.capacity
    }

    /// Makes the current length the capacity (at least 1). Growing a buffer only appends
    /// without drawing, so the output is what a buffer made with this capacity gives.
    pub fn stop_growing(&mut self) {
        self.capacity = self.items.len().max(1);
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shuffled(n: u32, capacity: usize, seed: u64, epoch: u64) -> Vec<u32> {
        let mut buf = ShuffleBuffer::new(capacity, seed, epoch);
        let mut out: Vec<u32> = (0..n).filter_map(|i| buf.push(i)).collect();
        out.extend(buf.drain());
        out
    }

    #[test]
    fn every_element_comes_out_once() {
        let mut out = shuffled(1000, 64, 7, 0);
        assert_ne!(out, (0..1000).collect::<Vec<_>>(), "it shuffles");
        out.sort();
        assert_eq!(out, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn same_seed_and_epoch_repeat_other_epochs_differ() {
        assert_eq!(shuffled(500, 100, 7, 3), shuffled(500, 100, 7, 3));
        assert_ne!(shuffled(500, 100, 7, 3), shuffled(500, 100, 7, 4));
        assert_ne!(shuffled(500, 100, 7, 3), shuffled(500, 100, 8, 3));
    }

    #[test]
    fn a_buffer_of_one_keeps_order_and_a_full_buffer_mixes_everything() {
        assert_eq!(shuffled(50, 1, 1, 0), (0..50).collect::<Vec<_>>());
        // With the buffer as large as the input, the last element can land anywhere: over many
        // seeds its mean position is near the middle.
        let mean: f64 =
            (0..400).map(|s| shuffled(100, 100, s, 0).iter().position(|&x| x == 99).unwrap() as f64).sum::<f64>()
                / 400.0;
        assert!((35.0..65.0).contains(&mean), "mean position {mean}");
    }

    #[test]
    fn a_buffer_stopped_at_n_elements_shuffles_as_one_made_with_capacity_n() {
        for (n, seed) in [(1, 1), (17, 2), (64, 3)] {
            let mut buf = ShuffleBuffer::new(1 << 30, seed, 5);
            let mut out = Vec::new();
            for i in 0..1000u32 {
                out.extend(buf.push(i));
                if buf.len() == n && buf.is_growing() {
                    buf.stop_growing();
                }
            }
            assert!(!buf.is_growing() && buf.len() == n);
            out.extend(buf.drain());
            assert_eq!(out, shuffled(1000, n, seed, 5), "capped at {n}");
        }
    }

    #[test]
    fn below_is_roughly_uniform() {
        let mut rng = SplitMix64::new(1);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            counts[rng.below(10)] += 1;
        }
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }
}
