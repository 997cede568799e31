//! Sharing a cluster-wide worker budget between pipelines by marginal gain.
//!
//! Each pipeline's measurements make a model of its batch time at any worker count,
//! T(n) = max(compute, data / n): compute per batch is the part of the batch time not spent
//! waiting, and data (worker-seconds of preprocessing per batch) is measured whenever the
//! clients wait, i.e. the workers are the bottleneck, and kept while they do not. The gain of one
//! more worker is ln(T(n) / T(n+1)), the log of the speedup it brings: scale-free, so a job
//! with small batches does not outbid one with large ones. These gains shrink with n, so
//! handing out workers one at a time to the largest gain maximises the total, the sum of the
//! pipelines' log speedups (proportional fairness: doubling one job's speed counts as much as
//! doubling another's). Every pipeline keeps its min; nobody gets more than it asked for; ties
//! go by name, so the same inputs always give the same answer (no oscillation).

use std::collections::BTreeMap;

use stoker_api::window::Window;

/// Below this wait fraction a window does not show how fast the workers could go.
const WAIT_LOW: f64 = 0.05;

/// What a pipeline's windows say about its batch time at other worker counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Model {
    pub compute_s: f64,
    /// Worker-seconds of preprocessing per batch.
    pub data_s: f64,
}

impl Model {
    /// Learns from a window. A window where clients do not wait only bounds the data time
    /// from above, so an earlier data-bound measurement is kept: that keeps the model, and so
    /// the budget's split, steady once a pipeline has enough workers.
    pub fn update(&mut self, w: &Window) {
        if w.batches == 0 || w.mean_s.is_nan() || w.mean_s <= 0.0 {
            return;
        }
        let wait = w.wait_fraction.clamp(0.0, 1.0);
        self.compute_s = w.mean_s * (1.0 - wait);
        let n = f64::from(w.workers.max(1));
        self.data_s = if wait >= WAIT_LOW {
            w.mean_s * n
        } else if self.data_s > 0.0 {
            self.data_s.min(self.compute_s * n)
        } else {
            self.compute_s * n
        };
    }

    pub fn from_window(w: &Window) -> Model {
        let mut m = Model::default();
        m.update(w);
        m
    }

    /// Predicted batch time at `n` workers.
    pub fn batch_time(&self, n: u32) -> f64 {
        self.compute_s.max(self.data_s / f64::from(n.max(1)))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Wish {
    pub key: String,
    pub min: u32,
    /// What the pipeline's policy wants (already within its min and max).
    pub wants: u32,
    /// Workers it runs now: keeping them wins near-ties, so measurement noise does not move
    /// workers back and forth between pipelines.
    pub current: u32,
    /// What its measurements say, if it has any.
    pub model: Option<Model>,
}

/// How much larger another pipeline's gain must be to take a worker a pipeline already runs.
const STICKINESS: f64 = 1.10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub granted: u32,
    /// Wanted but not granted because of the budget.
    pub held_back: u32,
}

/// ln of the speedup one more worker would bring at `n`.
pub fn gain(model: Option<&Model>, n: u32) -> f64 {
    match model {
        Some(m) => {
            let (now, more) = (m.batch_time(n), m.batch_time(n + 1));
            if now > 0.0 && more > 0.0 { (now / more).ln().max(0.0) } else { 0.0 }
        }
        // Unmeasured: last in line, but not refused.
        None => f64::MIN_POSITIVE,
    }
}

/// Grants per key. `budget` None means no cap: everyone gets what it wants.
pub fn share(wishes: Vec<Wish>, budget: Option<u32>) -> BTreeMap<String, Grant> {
    let mut granted: BTreeMap<String, u32> =
        wishes.iter().map(|w| (w.key.clone(), w.min.min(w.wants).max(w.min))).collect();
    let mut left = match budget {
        None => u64::MAX,
        Some(b) => u64::from(b).saturating_sub(granted.values().map(|&g| u64::from(g)).sum()),
    };
    while left > 0 {
        let best = wishes
            .iter()
            .filter(|w| granted[&w.key] < w.wants)
            .map(|w| {
                let g = gain(w.model.as_ref(), granted[&w.key]);
                (if granted[&w.key] < w.current { g * STICKINESS } else { g }, w)
            })
            // Largest gain; on a tie the smallest key.
            .max_by(|a, b| a.0.total_cmp(&b.0).then_with(|| b.1.key.cmp(&a.1.key)));
        let Some((_, w)) = best else { break };
        *granted.get_mut(&w.key).expect("every wish is granted its min") += 1;
        left -= 1;
    }
    wishes
        .iter()
        .map(|w| {
            let g = granted[&w.key];
            (w.key.clone(), Grant { granted: g, held_back: w.wants.saturating_sub(g) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(workers: u32, median_s: f64, wait_fraction: f64) -> Window {
        Window { workers, batches: 100, median_s, p90_s: median_s, mean_s: median_s, wait_fraction }
    }

    #[test]
    fn the_model_predicts_the_compute_bound() {
        // 2 workers, 100 ms batches, half of it waiting: compute 50 ms, data 200 worker-ms.
        let mut m = Model::from_window(&window(2, 0.100, 0.5));
        assert!((m.batch_time(2) - 0.100).abs() < 1e-9);
        assert!((m.batch_time(4) - 0.050).abs() < 1e-9);
        assert!((m.batch_time(8) - 0.050).abs() < 1e-9, "never below compute");
        assert_eq!(gain(Some(&m), 4), 0.0);
        // At 4 workers the clients stop waiting: the data time measured at 2 is kept.
        m.update(&window(4, 0.051, 0.0));
        assert!((m.data_s - 0.200).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn without_a_budget_everyone_gets_its_wish() {
        let wishes = vec![
            Wish { key: "a".into(), min: 1, wants: 7, current: 1, model: None },
            Wish { key: "b".into(), min: 2, wants: 2, current: 2, model: None },
        ];
        let grants = share(wishes, None);
        assert_eq!(grants["a"], Grant { granted: 7, held_back: 0 });
        assert_eq!(grants["b"], Grant { granted: 2, held_back: 0 });
    }

    #[test]
    fn mins_are_kept_even_over_the_budget() {
        let wishes = vec![
            Wish { key: "a".into(), min: 3, wants: 5, current: 3, model: None },
            Wish { key: "b".into(), min: 3, wants: 3, current: 3, model: None },
        ];
        let grants = share(wishes, Some(4));
        assert_eq!(grants["a"], Grant { granted: 3, held_back: 2 });
        assert_eq!(grants["b"].granted, 3);
    }
}
