//! One window of a training client's batch times: the autoscaler's only input. The client
//! measures it, the dispatcher receives it (`ReportWindowRequest`), and the policies judge it;
//! this one type carries it from the wire to the policy.

use crate::proto;

/// What one client (or, combined, all consumers of a job) measured over one window, while
/// streaming from `workers` workers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Window {
    /// Workers that delivered batches during the window (a starting worker does not count).
    pub workers: u32,
    pub batches: u64,
    /// Median and 90th percentile of the batch times (time between consecutive `next()` calls).
    pub median_s: f64,
    pub p90_s: f64,
    /// Mean batch time: 1 / training speed, what more workers should lower.
    pub mean_s: f64,
    /// Time waiting for data divided by batch time.
    pub wait_fraction: f64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("batch times and wait fraction must be finite and non-negative")]
pub struct InvalidWindow;

impl From<&proto::ReportWindowRequest> for Window {
    fn from(r: &proto::ReportWindowRequest) -> Window {
        Window {
            workers: r.workers,
            batches: r.batches,
            median_s: r.median_seconds,
            p90_s: r.p90_seconds,
            mean_s: r.mean_seconds,
            wait_fraction: r.wait_fraction,
        }
    }
}

impl Window {
    /// Refuses a time that is negative or not a number: a policy fed NaN would compare nothing
    /// correctly from then on.
    pub fn check(&self) -> Result<(), InvalidWindow> {
        let valid = |x: f64| x.is_finite() && x >= 0.0;
        match [self.median_s, self.p90_s, self.mean_s, self.wait_fraction].into_iter().all(valid) {
            true => Ok(()),
            false => Err(InvalidWindow),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_becomes_a_window_and_a_time_that_is_not_a_number_is_refused() {
        let report = proto::ReportWindowRequest {
            batches: 10,
            median_seconds: 0.1,
            p90_seconds: 0.2,
            mean_seconds: 0.12,
            wait_fraction: 0.5,
            workers: 3,
            ..Default::default()
        };
        let w = Window::from(&report);
        assert_eq!(w.check(), Ok(()));
        assert_eq!(
            (w.workers, w.batches, w.median_s, w.p90_s, w.mean_s, w.wait_fraction),
            (3, 10, 0.1, 0.2, 0.12, 0.5)
        );
        for bad in [
            proto::ReportWindowRequest { median_seconds: f64::NAN, ..report.clone() },
            proto::ReportWindowRequest { mean_seconds: -1.0, ..report.clone() },
            proto::ReportWindowRequest { wait_fraction: f64::INFINITY, ..report.clone() },
        ] {
            assert_eq!(Window::from(&bad).check(), Err(InvalidWindow));
        }
    }
}
