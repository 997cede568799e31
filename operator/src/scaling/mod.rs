//! The autoscaler's shell: feeds the dispatcher's batch-time windows to the pure policies, shares
//! the cluster-wide worker budget, and hands decisions to a `Scaler`.

mod book;
mod driver;
mod kube;
mod run;

pub use book::{HISTORY, ScalingBook, ScalingRecord};
pub use driver::{Driver, Rescale, Scaled, combine};
pub use kube::{DeploymentScaler, events, in_scope};
pub use run::Loop;

/// How often the loop looks at the windows; each pipeline is judged once per its own
/// `autoscaling.policy.windowSeconds`.
pub const ROUND: std::time::Duration = std::time::Duration::from_secs(1);

/// The state of a pipeline with no job measured yet.
pub const IDLE: &str = "Idle";
