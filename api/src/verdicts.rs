//! A small, bounded cache of access verdicts (a token's identity, whether an identity may read
//! a pipeline), so that a stream or an RPC burst costs the API server one review, not one per
//! call. Entries expire; when full, the one expiring first makes room.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

#[derive(Debug)]
pub struct Verdicts<K, V> {
    entries: HashMap<K, (Instant, V)>,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V: Clone> Verdicts<K, V> {
    pub fn new(capacity: usize) -> Self {
        Verdicts { entries: HashMap::new(), capacity: capacity.max(1) }
    }

    /// The verdict for `key` if it has not expired at `now`.
    pub fn get(&self, key: &K, now: Instant) -> Option<V> {
        self.entries.get(key).filter(|(expires, _)| *expires > now).map(|(_, v)| v.clone())
    }

    /// Keeps `value` for `ttl` from `now`.
    pub fn insert(&mut self, key: K, value: V, ttl: Duration, now: Instant) {
        if self.entries.len() >= self.capacity && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (expires, _)| *expires > now);
            if self.entries.len() >= self.capacity
                && let Some(first) =
                    self.entries.iter().min_by_key(|(_, (expires, _))| *expires).map(|(k, _)| k.clone())
            {
                self.entries.remove(&first);
            }
        }
        self.entries.insert(key, (now + ttl, value));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A cache key for a token: its digest, so caches never hold the credentials themselves.
pub fn token_key(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_expire_and_stay_within_capacity() {
        let t0 = Instant::now();
        let mut v = Verdicts::new(3);
        v.insert("a", 1, Duration::from_secs(10), t0);
        v.insert("b", 2, Duration::from_secs(1), t0);
        v.insert("c", 3, Duration::from_secs(5), t0);
        assert_eq!(v.get(&"b", t0), Some(2));
        assert_eq!(v.get(&"b", t0 + Duration::from_secs(1)), None, "expired");
        // Full: the entry expiring first ("b") makes room.
        v.insert("d", 4, Duration::from_secs(10), t0);
        assert_eq!(v.len(), 3);
        assert_eq!(v.get(&"b", t0), None);
        assert_eq!((v.get(&"a", t0), v.get(&"c", t0), v.get(&"d", t0)), (Some(1), Some(3), Some(4)));
        // Later, expired entries go first, all of them.
        v.insert("e", 5, Duration::from_secs(10), t0 + Duration::from_secs(6));
        assert_eq!(v.len(), 3);
        assert_eq!(v.get(&"c", t0), None);
        for i in 0..100 {
            v.insert(if i % 2 == 0 { "x" } else { "y" }, i, Duration::from_secs(1), t0);
        }
        assert!(v.len() <= 3);
        assert_ne!(token_key("t1"), token_key("t2"));
    }
}
