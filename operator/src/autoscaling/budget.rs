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
//!
//! Beside the cluster-wide budget, an optional per-namespace cap bounds what one tenant's
//! pipelines get together, so one namespace cannot take the whole budget (or, without one, the
//! whole cluster). It limits only the workers handed out above the mins: a namespace whose
//! pipelines' mins alone exceed the cap still gets every min, as the cluster budget does,
//! because a spec's min is a floor the controller keeps whatever the autoscaler says.

use std::collections::{BTreeMap, BTreeSet};

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
    /// The pipeline's namespace, for the per-namespace cap.
    pub namespace: String,
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
    /// What held it back, when something did.
    pub by: Option<Cap>,
}

/// The caps workers are shared under; None is no cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// All pipelines together (`--worker-budget`).
    pub cluster: Option<u32>,
    /// The pipelines of one namespace together (`--namespace-worker-cap`).
    pub namespace: Option<u32>,
}

impl Caps {
    /// The operator's flags, where 0 means no cap.
    pub fn from_flags(cluster: u32, namespace: u32) -> Caps {
        Caps { cluster: (cluster > 0).then_some(cluster), namespace: (namespace > 0).then_some(namespace) }
    }
}

/// Which cap held a pipeline back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cap {
    Cluster,
    Namespace,
}

impl Cap {
    /// For scaling reasons: "held back by 2 by {this}".
    pub fn describe(self) -> &'static str {
        match self {
            Cap::Cluster => "the cluster-wide worker budget",
            Cap::Namespace => "its namespace's worker cap",
        }
    }
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

/// Grants per key under the cluster-wide `budget` alone (None: no cap).
pub fn share(wishes: Vec<Wish>, budget: Option<u32>) -> BTreeMap<String, Grant> {
    share_capped(wishes, Caps { cluster: budget, namespace: None })
}

/// Grants per key under both caps: every pipeline gets its min, then the workers left are
/// handed out one at a time to the largest gain among the pipelines that want more and whose
/// namespace is below its cap.
pub fn share_capped(wishes: Vec<Wish>, caps: Caps) -> BTreeMap<String, Grant> {
    let mut granted: BTreeMap<String, u32> =
        wishes.iter().map(|w| (w.key.clone(), w.min.min(w.wants).max(w.min))).collect();
    let mut by_namespace: BTreeMap<&str, u64> = BTreeMap::new();
    for w in &wishes {
        *by_namespace.entry(w.namespace.as_str()).or_default() += u64::from(granted[&w.key]);
    }
    let namespace_full = |by_namespace: &BTreeMap<&str, u64>, ns: &str| {
        caps.namespace.is_some_and(|cap| by_namespace[ns] >= u64::from(cap))
    };
    let mut left = match caps.cluster {
        None => u64::MAX,
        Some(b) => u64::from(b).saturating_sub(granted.values().map(|&g| u64::from(g)).sum()),
    };
    while left > 0 {
        let best = wishes
            .iter()
            .filter(|w| granted[&w.key] < w.wants && !namespace_full(&by_namespace, &w.namespace))
            .map(|w| {
                let g = gain(w.model.as_ref(), granted[&w.key]);
                (if granted[&w.key] < w.current { g * STICKINESS } else { g }, w)
            })
            // Largest gain; on a tie the smallest key.
            .max_by(|a, b| a.0.total_cmp(&b.0).then_with(|| b.1.key.cmp(&a.1.key)));
        let Some((_, w)) = best else { break };
        *granted.get_mut(&w.key).expect("every wish is granted its min") += 1;
        *by_namespace.get_mut(w.namespace.as_str()).expect("every namespace is counted") += 1;
        left -= 1;
    }
    wishes
        .iter()
        .map(|w| {
            let g = granted[&w.key];
            let held_back = w.wants.saturating_sub(g);
            // The namespace's cap when it is reached (it stops the pipeline whatever the
            // cluster has left), else the cluster budget.
            let by = (held_back > 0)
                .then(|| if namespace_full(&by_namespace, &w.namespace) { Cap::Namespace } else { Cap::Cluster });
            (w.key.clone(), Grant { granted: g, held_back, by })
        })
        .collect()
}

/// Whether a pipeline stopped serving clients since the last round (it finished, was deleted,
/// or went idle): `before` and `after` are each round's pipelines that do. Its workers are then
/// room, on the budget and on the nodes, that may let more workers help the others where they
/// did not. Only a departure counts, not a smaller count: a pipeline stepping back from a
/// re-try that did not help gives back nothing it had before, and counting it would make two
/// pipelines re-try in turn forever.
pub fn departed<K: Ord>(before: &BTreeSet<K>, after: &BTreeSet<K>) -> bool {
    !before.is_subset(after)
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
            Wish { key: "a".into(), namespace: "n".into(), min: 1, wants: 7, current: 1, model: None },
            Wish { key: "b".into(), namespace: "n".into(), min: 2, wants: 2, current: 2, model: None },
        ];
        let grants = share(wishes, None);
        assert_eq!(grants["a"], Grant { granted: 7, held_back: 0, by: None });
        assert_eq!(grants["b"], Grant { granted: 2, held_back: 0, by: None });
    }

    #[test]
    fn mins_are_kept_even_over_the_budget() {
        let wishes = vec![
            Wish { key: "a".into(), namespace: "n".into(), min: 3, wants: 5, current: 3, model: None },
            Wish { key: "b".into(), namespace: "n".into(), min: 3, wants: 3, current: 3, model: None },
        ];
        let grants = share(wishes, Some(4));
        assert_eq!(grants["a"], Grant { granted: 3, held_back: 2, by: Some(Cap::Cluster) });
        assert_eq!(grants["b"].granted, 3);
    }

    fn wish(key: &str, namespace: &str, min: u32, wants: u32, wait: f64) -> Wish {
        let w = window(min.max(1), 0.100, wait);
        Wish {
            key: key.into(),
            namespace: namespace.into(),
            min,
            wants,
            current: min,
            model: Some(Model::from_window(&w)),
        }
    }

    fn granted(grants: &BTreeMap<String, Grant>) -> Vec<(&str, u32)> {
        grants.iter().map(|(k, g)| (k.as_str(), g.granted)).collect()
    }

    #[test]
    fn a_namespace_never_gets_more_than_its_cap_and_the_rest_goes_to_others() {
        // Tenant t1's two pipelines are the hungriest, yet together they get only the cap of 5;
        // t2 gets all it wants (4) from the rest of the cluster's 12.
        let wishes = vec![wish("t1/a", "t1", 1, 8, 0.9), wish("t1/b", "t1", 1, 8, 0.9), wish("t2/c", "t2", 1, 4, 0.3)];
        let grants = share_capped(wishes.clone(), Caps { cluster: Some(12), namespace: Some(5) });
        assert_eq!(grants["t1/a"].granted + grants["t1/b"].granted, 5, "{grants:?}");
        assert_eq!(grants["t2/c"], Grant { granted: 4, held_back: 0, by: None });
        assert_eq!(grants["t1/a"].by, Some(Cap::Namespace));
        assert_eq!(grants["t1/a"].held_back + grants["t1/b"].held_back, 11);

        // Without a cluster budget the namespace cap alone bounds each tenant.
        let grants = share_capped(wishes.clone(), Caps { cluster: None, namespace: Some(5) });
        assert_eq!(granted(&grants), [("t1/a", 3), ("t1/b", 2), ("t2/c", 4)]);
        // With a cluster budget smaller than the caps allow, the cluster budget is what binds.
        let grants = share_capped(wishes, Caps { cluster: Some(6), namespace: Some(5) });
        assert_eq!(grants.values().map(|g| g.granted).sum::<u32>(), 6);
        assert!(grants["t2/c"].granted < 4 && grants["t2/c"].by == Some(Cap::Cluster), "{grants:?}");
    }

    #[test]
    fn mins_are_kept_over_the_namespace_cap_and_nothing_is_added_above_them() {
        let wishes = vec![wish("t1/a", "t1", 3, 8, 0.9), wish("t1/b", "t1", 2, 8, 0.9), wish("t2/c", "t2", 0, 2, 0.5)];
        let grants = share_capped(wishes, Caps { cluster: None, namespace: Some(4) });
        assert_eq!(granted(&grants), [("t1/a", 3), ("t1/b", 2), ("t2/c", 2)], "mins 3 + 2 exceed the cap of 4");
        assert_eq!(grants["t1/b"].by, Some(Cap::Namespace));
    }

    #[test]
    fn the_namespace_cap_is_shared_by_gain_and_is_deterministic() {
        let wishes = vec![wish("t1/a", "t1", 1, 8, 0.9), wish("t1/b", "t1", 1, 8, 0.1)];
        let caps = Caps { cluster: None, namespace: Some(6) };
        let grants = share_capped(wishes.clone(), caps);
        assert!(grants["t1/a"].granted > grants["t1/b"].granted, "the more data-bound gets more: {grants:?}");
        assert_eq!(grants, share_capped(wishes, caps), "the same inputs give the same split");
        assert_eq!(Caps::from_flags(0, 0), Caps::default(), "0 is no cap");
        assert_eq!(Caps::from_flags(40, 8), Caps { cluster: Some(40), namespace: Some(8) });
    }

    #[test]
    fn only_a_pipeline_that_stops_serving_clients_is_a_departure() {
        let set = |keys: &[&str]| keys.iter().map(|k| k.to_string()).collect::<BTreeSet<_>>();
        assert!(departed(&set(&["a", "b"]), &set(&["a"])), "b finished or went idle");
        assert!(!departed(&set(&["a"]), &set(&["a", "b"])), "b arrived");
        assert!(!departed(&set(&["a", "b"]), &set(&["a", "b"])), "same pipelines, whatever their counts");
        assert!(departed(&set(&["a", "b"]), &set(&["a", "c"])), "b left as c came");
    }
}
