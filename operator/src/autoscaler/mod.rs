//! The autoscaler's policies, pure: windows of client batch times in, decisions out. No clock,
//! no I/O; the scaling loop (`crate::scaling`) feeds them and applies what they decide.
//!
//! - [`ours`]: grow geometrically while the clients wait for data, then aim at the count the
//!   measurements predict, and bisect only if the aim was off.
//! - [`cachew`]: Cachew's rule (one worker per step), the baseline we measure against.
//! - [`budget`]: sharing a cluster-wide worker budget by marginal gain.
//! - [`sim`]: a trainer-and-workers model to run policies against.

pub mod budget;
mod cachew;
mod ours;
pub mod sim;

use stoker_api::AutoscalingPolicy;

pub use cachew::Cachew;
pub use ours::Ours;

/// What the clients of one (pipeline, job) measured over one window, at `workers` workers.
#[derive(Clone, Debug, PartialEq)]
pub struct Window {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub min: u32,
    pub max: u32,
}

impl Limits {
    fn clamp(&self, n: u32) -> u32 {
        n.clamp(self.min.max(1), self.max.max(self.min.max(1)))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Hold,
    /// Run `to` workers; `reason` is for people (Events, status history).
    Scale {
        to: u32,
        reason: String,
    },
}

/// Where a policy's search is, for status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyState {
    /// Measuring the current count (after start or a rescale).
    Measuring,
    Growing,
    /// Searching between a count known too small and one known enough.
    Bisecting {
        low: u32,
        high: u32,
    },
    Converged,
    /// No client attached: at min until they return.
    Idle,
}

impl PolicyState {
    pub fn name(&self) -> &'static str {
        match self {
            PolicyState::Measuring => "Measuring",
            PolicyState::Growing => "Growing",
            PolicyState::Bisecting { .. } => "Bisecting",
            PolicyState::Converged => "Converged",
            PolicyState::Idle => "Idle",
        }
    }

    pub fn converged(&self) -> bool {
        matches!(self, PolicyState::Converged)
    }
}

pub trait Policy {
    /// The next window of measurements; the decision it leads to.
    fn observe(&mut self, window: &Window) -> Decision;
    /// No client is attached any more.
    fn idle(&mut self) -> Decision;
    fn state(&self) -> PolicyState;
}

/// Our policy for a job whose pipeline runs `start` workers now.
pub fn ours(limits: Limits, policy: &AutoscalingPolicy, start: u32) -> Box<dyn Policy + Send> {
    Box::new(Ours::new(limits, policy, start))
}

/// Cachew's rule, for comparison.
pub fn cachew(limits: Limits, policy: &AutoscalingPolicy, start: u32) -> Box<dyn Policy + Send> {
    Box::new(Cachew::new(limits, policy, start))
}

fn ms(seconds: f64) -> String {
    format!("{:.1} ms", seconds * 1e3)
}
