//! KEDA scaling on the client's prefetch queue, as users improvise it: a Prometheus trigger on
//! the batches missing from the training client's prefetch buffer (its capacity minus the
//! batches ready, averaged over the sync period), with a target number of missing batches per
//! worker. The queue running dry is what users see when input stalls training, so it is what
//! they scale on.
//!
//! KEDA itself does not decide counts above one replica: it serves the metric to an HPA it
//! creates (its `pollingInterval`, 30 s by default, and `cooldownPeriod`, 300 s, govern only
//! activation and scaling to and from zero; with `minReplicaCount: 1` they never act). The
//! trigger's default `metricType` is `AverageValue`, for which the HPA recommends
//! `ceil(metric / target)` whatever the current count, unless `metric / (target * current)` is
//! within the 10% tolerance; without `useCachedMetrics` the HPA reads the metric at each of its
//! 15 s syncs. The recommendation then goes through the HPA's stabilisation and rate limits
//! ([`Hpa::recommend`]).
//!
//! What this shows: the metric is bounded by the buffer's capacity, so the recommendation
//! saturates at `ceil(prefetch / target)` however far the workers fall behind, and drops to
//! the minimum as soon as they keep up (a full buffer), held only by the five-minute
//! stabilisation window. A low target reaches large counts but overshoots small ones.

use super::hpa::{Hpa, within_tolerance};
use super::{Decision, Limits};

pub struct Keda {
    hpa: Hpa,
    /// The trigger's threshold: missing prefetch batches per worker.
    per_worker: f64,
}

impl Keda {
    pub fn new(limits: Limits, per_worker: f64) -> Self {
        Keda { hpa: Hpa::new(limits), per_worker: per_worker.max(f64::MIN_POSITIVE) }
    }

    /// One HPA sync at `now`: `missing` is the prefetch buffer's capacity minus its ready
    /// batches, averaged over the last period (summed over clients).
    pub fn sync(&mut self, now: f64, current: u32, missing: f64) -> Decision {
        let ratio = missing / (self.per_worker * f64::from(current.max(1)));
        let desired = if within_tolerance(ratio) { current } else { (missing / self.per_worker).ceil() as u32 };
        let metric = format!("{missing:.2} prefetch batches missing, target {} per worker", self.per_worker);
        self.hpa.recommend(now, current, desired, &metric)
    }
}

#[cfg(test)]
mod tests {
    use super::super::hpa::tests::to;
    use super::*;

    #[test]
    fn the_recommendation_is_the_metric_over_the_target_and_saturates_at_the_buffer() {
        let limits = Limits { min: 1, max: 64 };
        let mut keda = Keda::new(limits, 1.0);
        // An empty 8-batch buffer asks for 8 workers, rate-limited from 4 to 4 + 4.
        assert_eq!(to(keda.sync(0.0, 4, 8.0)), Some(8));
        // Still empty at 8 workers: 8 / (1 * 8) = 1, no change, however slow the workers are.
        assert_eq!(to(keda.sync(15.0, 8, 8.0)), None);
        // Half a batch missing at 12 workers: ratio 0.04, recommends 1; held for 300 s.
        let mut keda = Keda::new(limits, 1.0);
        assert_eq!(to(keda.sync(0.0, 12, 12.0)), None);
        assert_eq!(to(keda.sync(15.0, 12, 0.5)), None);
        assert_eq!(to(keda.sync(300.0, 12, 0.5)), Some(1));
        // A target of 1/8 batch per worker reaches 64 with an empty buffer.
        let mut keda = Keda::new(limits, 0.125);
        assert_eq!(to(keda.sync(0.0, 40, 8.0)), Some(64));
    }
}
