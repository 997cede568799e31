//! Kubernetes' HorizontalPodAutoscaler on CPU utilisation: what a platform team deploys when
//! it has nothing better, and the baseline Cachew's paper measured against. A pure model of the
//! controller's algorithm (kube-controller-manager's podautoscaler, with the defaults of
//! `pkg/apis/autoscaling/v2/defaults.go` and the "Algorithm details" and "Default Behavior"
//! sections of the HorizontalPodAutoscaler documentation):
//!
//! - it syncs every 15 s (`--horizontal-pod-autoscaler-sync-period`);
//! - the utilisation is the pods' CPU use over their request in whole percent, and the
//!   recommendation is `ceil(current * utilisation / target)` with the default target of 80%;
//!   while `|utilisation / target - 1| <= 0.1` (`--horizontal-pod-autoscaler-tolerance`) the
//!   count stays;
//! - stabilisation: none for scaling up; for scaling down the highest recommendation of the
//!   last 300 s (`stabilizationWindowSeconds` of `scaleDown`);
//! - rate limits, the default policies: up by at most the larger of 4 pods and 100% per 15 s
//!   (`selectPolicy: Max`), down by at most 100% per 15 s; both counted from the replicas at
//!   the start of the policy's period, as the controller does from its recent scale events;
//! - `minReplicas` and `maxReplicas` bound the result.
//!
//! Not modelled: the readiness delay and CPU initialisation period of new pods and missing
//! metrics, because the simulator starts every worker at once, for every policy alike.
//!
//! [`Hpa::recommend`] is the part that turns any metric's recommendation into a replica count;
//! KEDA's external metrics go through it too ([`super::Keda`]).

use std::collections::VecDeque;

use super::{Decision, Limits};

/// `--horizontal-pod-autoscaler-sync-period`.
pub const SYNC_SECONDS: f64 = 15.0;
/// The default target CPU utilisation (`DefaultCPUUtilization`), in percent.
pub const TARGET_PERCENT: f64 = 80.0;
/// `--horizontal-pod-autoscaler-tolerance`.
pub const TOLERANCE: f64 = 0.1;
/// The default `scaleDown.stabilizationWindowSeconds` (scale-up has none).
const DOWN_WINDOW_SECONDS: f64 = 300.0;
/// The default scaling policies' period (`periodSeconds`), up and down.
const POLICY_PERIOD_SECONDS: f64 = 15.0;
/// The default scale-up policies: 4 pods or 100%, whichever allows more.
const UP_PODS: u32 = 4;
const UP_PERCENT: f64 = 100.0;
/// The default scale-down policy: 100%.
const DOWN_PERCENT: f64 = 100.0;

/// Whether a usage ratio is close enough to 1 to leave the count alone.
pub fn within_tolerance(ratio: f64) -> bool {
    (ratio - 1.0).abs() <= TOLERANCE
}

pub struct Hpa {
    limits: Limits,
    /// Unstabilised recommendations of the last `DOWN_WINDOW_SECONDS`: (time, replicas).
    recommendations: VecDeque<(f64, u32)>,
    /// Rescales of the last `POLICY_PERIOD_SECONDS`: (time, from, to).
    events: VecDeque<(f64, u32, u32)>,
}

impl Hpa {
    pub fn new(limits: Limits) -> Self {
        Hpa { limits, recommendations: VecDeque::new(), events: VecDeque::new() }
    }

    /// One sync on CPU: `utilisation` is the pods' mean busy fraction over the last period
    /// (1.0: every worker produced all the time).
    pub fn sync_cpu(&mut self, now: f64, current: u32, utilisation: f64) -> Decision {
        // The controller computes utilisation in whole percent (integer division).
        let percent = (utilisation * 100.0).floor();
        let ratio = percent / TARGET_PERCENT;
        let desired = if within_tolerance(ratio) { current } else { (ratio * f64::from(current)).ceil() as u32 };
        self.recommend(now, current, desired, &format!("CPU {percent:.0}% of requests, target {TARGET_PERCENT:.0}%"))
    }

    /// What the controller makes of a metric's recommendation `desired` at `now` with
    /// `current` replicas: the scale-down stabilisation, then the rate limits and bounds.
    pub fn recommend(&mut self, now: f64, current: u32, desired: u32, metric: &str) -> Decision {
        while self.recommendations.front().is_some_and(|r| r.0 <= now - DOWN_WINDOW_SECONDS) {
            self.recommendations.pop_front();
        }
        while self.events.front().is_some_and(|e| e.0 <= now - POLICY_PERIOD_SECONDS) {
            self.events.pop_front();
        }
        // Scale-up window 0 s: only this recommendation bounds from below; the scale-down
        // window's highest recommendation bounds from above.
        let highest = self.recommendations.iter().map(|r| r.1).fold(desired, u32::max);
        let stabilised = current.max(desired).min(highest);
        self.recommendations.push_back((now, desired));

        // The policies count from the replicas at the start of their period.
        let period_start = self.events.front().map_or(current, |e| e.1);
        let to = if stabilised > current {
            let by_pods = period_start + UP_PODS;
            let by_percent = (f64::from(period_start) * (1.0 + UP_PERCENT / 100.0)).ceil() as u32;
            stabilised.min(by_pods.max(by_percent).max(current)).min(self.limits.max)
        } else if stabilised < current {
            let floor = (f64::from(period_start) * (1.0 - DOWN_PERCENT / 100.0)) as u32;
            stabilised.max(floor.min(current)).max(self.limits.min)
        } else {
            current
        };
        let to = self.limits.clamp(to);
        if to == current {
            return Decision::Hold;
        }
        self.events.push_back((now, current, to));
        let held = if to == desired { String::new() } else { format!(" (recommended {desired})") };
        Decision::Scale { to, reason: format!("HPA: {metric}: {current} -> {to} replicas{held}") }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const LIMITS: Limits = Limits { min: 1, max: 64 };

    /// The count a decision scales to, if it does.
    pub(crate) fn to(d: Decision) -> Option<u32> {
        match d {
            Decision::Scale { to, .. } => Some(to),
            Decision::Hold => None,
        }
    }

    #[test]
    fn busy_pods_grow_by_the_ratio_and_the_rate_limit() {
        let mut hpa = Hpa::new(LIMITS);
        // 100% busy against 80%: ceil(n * 1.25).
        assert_eq!(to(hpa.sync_cpu(15.0, 4, 1.0)), Some(5));
        assert_eq!(to(hpa.sync_cpu(30.0, 5, 1.0)), Some(7));
        // 10x the target at 1 pod asks for 10, but the rate limit allows max(1 + 4, 2 * 1).
        let mut hpa = Hpa::new(LIMITS);
        assert_eq!(to(hpa.sync_cpu(15.0, 1, 8.0)), Some(5));
        // At 10 pods it is the 100% policy that allows more: 20.
        let mut hpa = Hpa::new(LIMITS);
        assert_eq!(to(hpa.sync_cpu(15.0, 10, 8.0)), Some(20));
        assert_eq!(to(Hpa::new(LIMITS).sync_cpu(15.0, 60, 8.0)), Some(64), "never above max");
    }

    #[test]
    fn within_the_tolerance_nothing_changes() {
        let mut hpa = Hpa::new(LIMITS);
        // 87% / 80% = 1.09: inside the 10% tolerance; 89% / 80% = 1.11: outside.
        assert_eq!(to(hpa.sync_cpu(15.0, 10, 0.875)), None);
        assert_eq!(to(hpa.sync_cpu(30.0, 10, 0.895)), Some(12));
    }

    #[test]
    fn scaling_down_waits_for_the_highest_recommendation_of_five_minutes() {
        let mut hpa = Hpa::new(LIMITS);
        assert_eq!(to(hpa.sync_cpu(0.0, 8, 0.8)), None, "at target: recommends 8");
        // Idle pods from then on recommend 1, but 8 was recommended less than 300 s ago.
        let mut t = 15.0;
        while t < 300.0 {
            assert_eq!(to(hpa.sync_cpu(t, 8, 0.1)), None, "at {t} s");
            t += 15.0;
        }
        // The 8 leaves the window: down to 1 at once (100% per period, bounded by min).
        assert_eq!(to(hpa.sync_cpu(300.0, 8, 0.1)), Some(1));
    }

    #[test]
    fn a_scale_up_within_the_period_counts_against_the_next() {
        let mut hpa = Hpa::new(LIMITS);
        assert_eq!(to(hpa.sync_cpu(0.0, 2, 8.0)), Some(6), "2 + 4 pods");
        // 5 s later (inside the 15 s period) the period still starts at 2: no more than 6.
        assert_eq!(to(hpa.sync_cpu(5.0, 6, 8.0)), None);
        assert_eq!(to(hpa.sync_cpu(15.0, 6, 8.0)), Some(12), "a new period: 6 * 2");
    }
}
