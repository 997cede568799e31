//! The memory budget: producers reserve bytes before making data ready and consumers give them
//! back once sent, so a slow client stops production instead of growing memory.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

pub struct MemoryBudget {
    limit: usize,
    used: Mutex<usize>,
    freed: Condvar,
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Self {
        MemoryBudget { limit: limit.max(1), used: Mutex::new(0), freed: Condvar::new() }
    }

    /// Blocks until `bytes` fit under the limit. A single reservation larger than the whole
    /// budget is let through when nothing else is held, so one huge batch cannot deadlock.
    pub fn reserve(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        while *used > 0 && *used + bytes > self.limit {
            used = self.freed.wait(used).unwrap();
        }
        *used += bytes;
    }

    /// Like `reserve`, giving up after `timeout`; returns whether it reserved.
    pub fn reserve_timeout(&self, bytes: usize, timeout: Duration) -> bool {
        let used = self.used.lock().unwrap();
        let (mut used, result) = self
            .freed
            .wait_timeout_while(used, timeout, |used| *used > 0 && *used + bytes > self.limit)
            .unwrap();
        if result.timed_out() {
            return false;
        }
        *used += bytes;
        true
    }

    pub fn release(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        *used = used.saturating_sub(bytes);
        self.freed.notify_all();
    }

    pub fn used(&self) -> usize {
        *self.used.lock().unwrap()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn reservations_block_at_the_limit_until_released() {
        let budget = Arc::new(MemoryBudget::new(100));
        budget.reserve(60);
        assert!(!budget.reserve_timeout(50, Duration::from_millis(20)), "60 + 50 exceeds 100");
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve(50))
        };
        budget.release(60);
        waiter.join().unwrap();
        assert_eq!(budget.used(), 50);
    }

    #[test]
    fn an_oversized_reservation_passes_only_alone() {
        let budget = MemoryBudget::new(10);
        assert!(budget.reserve_timeout(1000, Duration::from_millis(10)), "nothing held: let it through");
        assert!(!budget.reserve_timeout(1, Duration::from_millis(10)), "now the budget is exhausted");
        budget.release(1000);
        assert_eq!(budget.used(), 0);
    }
}
