//! Per-element randomness. A random op's draws depend only on (pipeline seed, epoch, element
//! index, op index), never on which thread or worker ran the element or in what order, so a
//! rerun of a pipeline reproduces every crop and flip.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The generator random ops draw from.
pub type ElementRng = ChaCha8Rng;

/// Domain tag filling the key's last word, so these streams can never coincide with another
/// use of ChaCha keyed by the same numbers.
const TAG: u64 = u64::from_le_bytes(*b"stokerop");

/// ChaCha is a keyed pseudorandom function, so placing the numbers in the key and stream id
/// directly (no hashing) gives every combination its own independent stream without any
/// chance of collision: the key holds (seed, epoch, op index) and the 64-bit stream id the
/// element index.
pub fn element_rng(seed: u64, epoch: u64, element: u64, op_index: u64) -> ElementRng {
    let mut key = [0u8; 32];
    for (chunk, word) in key.chunks_exact_mut(8).zip([seed, epoch, op_index, TAG]) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    let mut rng = ChaCha8Rng::from_seed(key);
    rng.set_stream(element);
    rng
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;

    fn first(seed: u64, epoch: u64, element: u64, op: u64) -> [u64; 4] {
        let mut rng = element_rng(seed, epoch, element, op);
        [(); 4].map(|_| rng.next_u64())
    }

    #[test]
    fn same_inputs_same_stream() {
        assert_eq!(first(1, 2, 3, 4), first(1, 2, 3, 4));
    }

    #[test]
    fn each_input_changes_the_stream() {
        let base = first(1, 2, 3, 4);
        for other in [first(0, 2, 3, 4), first(1, 0, 3, 4), first(1, 2, 0, 4), first(1, 2, 3, 0)] {
            assert_ne!(base, other);
        }
        // Swapping numbers between positions must not alias either.
        assert_ne!(first(1, 2, 3, 4), first(2, 1, 3, 4));
        assert_ne!(first(1, 2, 3, 4), first(1, 2, 4, 3));
    }
}
