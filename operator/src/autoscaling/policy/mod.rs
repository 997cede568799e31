//! The autoscaler's policies, pure: windows of client batch times in, decisions out. No clock,
//! no I/O; the driver feeds them and the scaling loop applies what they decide.
//!
//! - [`ours`]: grow geometrically while the clients wait for data, then aim at the count the
//!   measurements predict, and bisect only if the aim was off.
//! - [`cachew`]: Cachew's rule (one worker per step), the baseline we measure against.
//!
//! The other baselines of the simulated comparison (`super::sim`), none of which the operator
//! runs: [`hpa`], Kubernetes' HorizontalPodAutoscaler on CPU utilisation; [`keda`], KEDA on the
//! client's prefetch queue; [`fixed`], a hand-sized pool. HPA and KEDA read what a cluster
//! would give them (CPU utilisation, a queue gauge) instead of windows.

mod cachew;
mod fixed;
pub mod hpa;
mod keda;
mod ours;

use stoker_api::AutoscalingPolicy;
use stoker_api::window::Window;

pub use cachew::Cachew;
pub use fixed::Fixed;
pub use hpa::Hpa;
pub use keda::Keda;
pub use ours::Ours;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub min: u32,
    pub max: u32,
}

impl Limits {
    pub(crate) fn clamp(&self, n: u32) -> u32 {
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

/// Where a policy's search is, for status. When a pipeline's jobs are in different states,
/// status shows the one listed first here: the variants are ranked by how far a job is from
/// a settled worker count, so a pipeline shows the least settled of its jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PolicyState {
    Growing,
    /// Searching between a count known too small and one known enough.
    Bisecting,
    /// Measuring the current count (after start or a rescale).
    Measuring,
    Converged,
    /// No client attached: at min until they return.
    Idle,
}

impl PolicyState {
    const ALL: [PolicyState; 5] = [
        PolicyState::Growing,
        PolicyState::Bisecting,
        PolicyState::Measuring,
        PolicyState::Converged,
        PolicyState::Idle,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            PolicyState::Measuring => "Measuring",
            PolicyState::Growing => "Growing",
            PolicyState::Bisecting => "Bisecting",
            PolicyState::Converged => "Converged",
            PolicyState::Idle => "Idle",
        }
    }

    /// The state a status recorded (a new leader continues from it).
    pub fn from_name(name: &str) -> Option<PolicyState> {
        PolicyState::ALL.into_iter().find(|s| s.name() == name)
    }

    pub fn converged(&self) -> bool {
        matches!(self, PolicyState::Converged)
    }

    /// What status shows for a pipeline whose jobs are in `states`: the first in rank.
    pub fn shown(states: impl IntoIterator<Item = PolicyState>) -> Option<PolicyState> {
        states.into_iter().min()
    }
}

pub trait Policy {
    /// The next window of measurements; the decision it leads to.
    fn observe(&mut self, window: &Window) -> Decision;
    /// No client is attached any more.
    fn idle(&mut self) -> Decision;
    fn state(&self) -> PolicyState;
    /// Room appeared outside the job (another pipeline stopped, giving its workers back to
    /// the budget and the nodes): a convergence that more workers did not help may be re-tried
    /// at the next window in which the clients wait. `why` says what happened, for the reason.
    fn reconsider(&mut self, _why: &str) {}
    /// For status: when and why a convergence will be re-tried, if it will.
    fn retry_plan(&self) -> Option<String> {
        None
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipeline_shows_its_least_settled_job_and_names_round_trip() {
        use PolicyState::*;
        assert_eq!(PolicyState::shown([Converged, Bisecting, Idle]), Some(Bisecting));
        assert_eq!(PolicyState::shown([Idle, Measuring]), Some(Measuring));
        assert_eq!(PolicyState::shown([Converged, Growing]), Some(Growing));
        assert_eq!(PolicyState::shown([]), None);
        for s in PolicyState::ALL {
            assert_eq!(PolicyState::from_name(s.name()), Some(s));
        }
        assert_eq!(PolicyState::from_name("autoscaling mode Fixed"), None);
    }
}
