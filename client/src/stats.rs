//! Batch-time accounting, the signal the autoscaler scales on.
//!
//! Batch time is the interval between consecutive `next()` calls: the training step plus any
//! wait for data. Data-wait time is how long a call blocked before a batch was there. A call's
//! wait belongs to the interval it starts, so each recorded pair is (interval from call k to
//! call k+1, wait of call k) and the wait fraction is at most 1. All of this is plain
//! arithmetic on instants the caller passes in, so it is tested with made-up times.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Batch times kept for the quantiles. Counts and totals stay exact beyond it; the reporter is
/// expected to reset the window every few seconds, long before this fills.
const MAX_SAMPLES: usize = 1 << 16;

/// Summary of one reporting window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WindowStats {
    pub batches: u64,
    /// Nearest-rank median of the batch times.
    pub median: Duration,
    /// Nearest-rank 90th percentile of the batch times.
    pub p90: Duration,
    pub total_batch_time: Duration,
    pub total_wait: Duration,
    /// total_wait / total_batch_time; 0 for an empty window.
    pub wait_fraction: f64,
}

/// Accumulates (batch time, wait) pairs.
#[derive(Debug, Default, Clone)]
pub struct BatchTimes {
    samples: VecDeque<Duration>,
    batches: u64,
    total_batch_time: Duration,
    total_wait: Duration,
}

impl BatchTimes {
    pub fn record(&mut self, batch_time: Duration, wait: Duration) {
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(batch_time);
        self.batches += 1;
        self.total_batch_time += batch_time;
        self.total_wait += wait;
    }

    pub fn window(&self) -> WindowStats {
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort_unstable();
        let total = self.total_batch_time.as_secs_f64();
        WindowStats {
            batches: self.batches,
            median: nearest_rank(&sorted, 0.5),
            p90: nearest_rank(&sorted, 0.9),
            total_batch_time: self.total_batch_time,
            total_wait: self.total_wait,
            wait_fraction: if total > 0.0 { self.total_wait.as_secs_f64() / total } else { 0.0 },
        }
    }

    pub fn reset(&mut self) {
        *self = BatchTimes::default();
    }

    /// Adds the pairs of an `earlier` window (one whose report failed) before these.
    pub fn merge_earlier(&mut self, earlier: BatchTimes) {
        let room = MAX_SAMPLES - self.samples.len();
        for sample in earlier.samples.into_iter().rev().take(room) {
            self.samples.push_front(sample);
        }
        self.batches += earlier.batches;
        self.total_batch_time += earlier.total_batch_time;
        self.total_wait += earlier.total_wait;
    }
}

/// The smallest sample with at least a fraction `q` of the samples at or below it.
fn nearest_rank(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Turns the instants of `next()` calls into recorded pairs.
#[derive(Debug, Default, Clone)]
pub struct Meter {
    /// Start and wait of the last call that delivered a batch, not yet paired with the next call.
    open: Option<(Instant, Duration)>,
    times: BatchTimes,
}

impl Meter {
    /// A `next()` call started at `now`: closes the previous batch's interval.
    pub fn call_started(&mut self, now: Instant) {
        if let Some((start, wait)) = self.open.take() {
            self.times.record(now.saturating_duration_since(start), wait);
        }
    }

    /// The call that started at `start` delivered a batch at `now`.
    pub fn delivered(&mut self, start: Instant, now: Instant) {
        self.open = Some((start, now.saturating_duration_since(start)));
    }

    pub fn window(&self) -> WindowStats {
        self.times.window()
    }

    /// Starts a new window; the batch currently being processed counts in the new one.
    pub fn reset(&mut self) {
        self.times.reset();
    }

    /// The window's pairs, starting a new window.
    pub fn take(&mut self) -> BatchTimes {
        std::mem::take(&mut self.times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_whose_report_failed_counts_in_the_next() {
        let ms = Duration::from_millis;
        let mut failed = BatchTimes::default();
        failed.record(ms(10), ms(5));
        failed.record(ms(30), ms(0));
        let mut next = BatchTimes::default();
        next.record(ms(20), ms(5));
        next.merge_earlier(failed);
        let w = next.window();
        assert_eq!((w.batches, w.total_batch_time, w.total_wait, w.median), (3, ms(60), ms(10), ms(20)));
        let mut full = BatchTimes::default();
        for _ in 0..MAX_SAMPLES {
            full.record(ms(1), ms(0));
        }
        let mut earlier = BatchTimes::default();
        earlier.record(ms(100), ms(0));
        full.merge_earlier(earlier);
        assert_eq!((full.samples.len(), full.batches), (MAX_SAMPLES, MAX_SAMPLES as u64 + 1), "samples stay bounded");
    }
}
