//! The trainer's side of the model: one window of training at the current worker count, and
//! what it measures.

use stoker_api::window::Window;

use super::Trainer;

/// One window: what the client reports, and what a cluster would see besides, which the
/// baselines read instead (worker utilisation for HPA, the prefetch queue for KEDA).
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub window: Window,
    /// Seconds of training the window took.
    pub seconds: f64,
    /// Seconds of it the trainer waited for data: accelerator time lost to input.
    pub waited: f64,
    /// Batches the workers made over the batches they could have made: a worker held back by
    /// a full prefetch queue idles, one that keeps up with a waiting trainer is busy.
    pub utilisation: f64,
    /// Time-averaged batches ready in the prefetch queue (a partly made batch is not ready).
    pub ready: f64,
}

pub struct World {
    trainer: Trainer,
    pub workers: u32,
    /// The share of a core each worker gets on a node shared with other jobs' workers (1: a
    /// core each).
    pub share: f64,
    queue: f64,
    pub clock: f64,
    batch: u64,
    window: u32,
    rng: u64,
    /// The trainer's outage is over.
    outage_done: bool,
}

impl World {
    pub fn new(trainer: Trainer, workers: u32) -> Self {
        let rng = trainer.seed;
        World { trainer, workers, share: 1.0, queue: 0.0, clock: 0.0, batch: 0, window: 0, rng, outage_done: false }
    }

    /// Batches trained so far.
    pub fn batches(&self) -> u64 {
        self.batch
    }

    fn unit(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn compute(&mut self) -> f64 {
        let t = &self.trainer;
        if t.stall_every.is_some_and(|n| n > 0 && self.batch % n == n - 1) {
            return t.stall;
        }
        let mut c = t.compute;
        if let Some((after, factor)) = t.speed_change
            && self.window >= after
        {
            c *= factor;
        }
        if let Some((after, factor)) = t.speed_change_at_batch
            && self.batch >= after
        {
            c *= factor;
        }
        if t.noise > 0.0 {
            let (noise, u) = (t.noise, self.unit());
            c *= 1.0 + noise * (2.0 * u - 1.0);
        }
        c
    }

    /// Worker-equivalents making batches now: the workers, slowed by any contention at this
    /// time and by their share of a shared node.
    fn capacity(&self) -> f64 {
        let n = f64::from(self.workers.max(1));
        let n = self.trainer.contention.map_or(n, |c| c.capacity(n, self.clock));
        n * self.share
    }

    /// One window of `seconds` of training (at least one batch) at the current worker count.
    pub fn window(&mut self, seconds: f64, prefetch: f64) -> Window {
        self.measure(seconds, prefetch, u64::MAX).window
    }

    /// One window of `seconds` of training, or fewer if `most` batches come first (at least
    /// one), at the current worker count.
    pub fn measure(&mut self, seconds: f64, prefetch: f64, most: u64) -> Measurement {
        let produce = self.trainer.rate * self.capacity();
        let start_queue = self.queue;
        let mut times = Vec::new();
        let (mut total, mut waited, mut ready_area) = (0.0, 0.0, 0.0);
        while times.is_empty() || (total < seconds && (times.len() as u64) < most) {
            // Nothing is ready while the trainer waits.
            let mut wait = if self.queue >= 1.0 {
                self.queue -= 1.0;
                0.0
            } else {
                let w = (1.0 - self.queue) / produce;
                self.queue = 0.0;
                w
            };
            if let Some((at, seconds)) = self.trainer.outage
                && !self.outage_done
                && self.clock + total >= at
            {
                // The workers make nothing for `seconds`; the trainer trains what was queued
                // meanwhile and waits for the rest.
                self.outage_done = true;
                wait += (seconds - self.queue * self.trainer.compute).max(0.0);
            }
            let c = self.compute();
            // While it computes the queue fills at `produce` until it is full; the whole
            // batches in it are ready.
            let q = self.queue;
            let until_full = (prefetch - q).max(0.0) / produce;
            if until_full >= c {
                self.queue = q + produce * c;
                ready_area += whole_area(q, self.queue) / produce;
            } else {
                ready_area += whole_area(q, prefetch) / produce + (c - until_full) * prefetch.floor();
                self.queue = prefetch;
            }
            times.push(wait + c);
            total += wait + c;
            waited += wait;
            self.batch += 1;
        }
        self.clock += total;
        self.window += 1;
        let batches = times.len() as u64;
        // What was made was either trained on or is still queued.
        let made = batches as f64 + self.queue - start_queue;
        let mean_s = total / batches as f64;
        // The q-quantile is the ceil(q * len)-th smallest.
        let len = times.len();
        let rank = |q: f64| ((q * len as f64).ceil() as usize).clamp(1, len) - 1;
        let (median_s, p90_s) = (select(&mut times, rank(0.5)), select(&mut times, rank(0.9)));
        Measurement {
            window: Window { workers: self.workers, batches, median_s, p90_s, mean_s, wait_fraction: waited / total },
            seconds: total,
            waited,
            utilisation: made / (produce * total),
            ready: ready_area / total,
        }
    }
}

/// The integral of floor(x) from `a` to `b` (0 <= a <= b): the batch-seconds of whole batches
/// in a queue that fills from `a` to `b` at one batch per second.
fn whole_area(a: f64, b: f64) -> f64 {
    let below = |x: f64| {
        let m = x.floor();
        m * x - m * (m + 1.0) / 2.0
    };
    below(b) - below(a)
}

/// The `k`-th smallest of `v` (from 0), reordering `v`: Hoare's selection, linear on average.
/// By hand because the standard library's generic selection is many times slower in debug
/// builds, where `stoker bench autoscaler` and the tests run.
pub(super) fn select(v: &mut [f64], k: usize) -> f64 {
    let (mut lo, mut hi) = (0, v.len() - 1);
    while lo < hi {
        let pivot = v[lo + (hi - lo) / 2];
        let (mut i, mut j) = (lo, hi);
        // Afterwards v[lo..=j] <= pivot <= v[j + 1..=hi], with lo <= j < hi.
        let j = loop {
            while v[i] < pivot {
                i += 1;
            }
            while v[j] > pivot {
                j -= 1;
            }
            if i >= j {
                break j;
            }
            // Not `swap`: its pointer checks dominate a debug build.
            (v[i], v[j]) = (v[j], v[i]);
            i += 1;
            j -= 1;
        };
        if k <= j {
            hi = j;
        } else {
            lo = j + 1;
        }
    }
    v[k]
}
