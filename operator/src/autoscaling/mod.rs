//! A batch-time report becomes a scaling decision. Read in this order:
//!
//! 1. `stoker_api::window::Window`: what a client measured over one window (the dispatcher's
//!    inbox keeps them until the scaling loop takes them);
//! 2. [`run`]: the loop that takes the windows every round and applies the decisions;
//! 3. [`driver`]: one round, pure, in small steps (ingest, due, judge, wishes, grant, records);
//! 4. [`policy`]: the pure policies (ours, and Cachew's rule as the baseline);
//! 5. [`budget`]: sharing the cluster-wide worker budget by marginal gain, and [`echo`]: the
//!    echo factor of a pipeline held at a limit while its clients wait;
//! 6. [`book`]: each pipeline's record, which status and the local view show;
//! 7. [`scaler`] and its backends: [`kube`] (the workers Deployment's replicas, through the
//!    controller; [`replicas`] is the count it applies), local processes in `stoker-local`.
//!
//! [`sim`] models workers feeding a trainer, to run the policies without processes.

mod book;
pub mod budget;
mod driver;
pub mod echo;
mod kube;
pub mod policy;
pub mod replicas;
mod run;
pub mod scaler;
pub mod sim;

pub use book::{HISTORY, ScalingBook, ScalingRecord};
pub use driver::{Driver, Rescale, Scaled, combine};
pub use kube::{DeploymentScaler, after_round, in_scope};
pub use run::Loop;
pub use scaler::Scaler;

/// How often the loop looks at the windows; each pipeline is judged once per its own
/// `autoscaling.policy.windowSeconds`.
pub const ROUND: std::time::Duration = std::time::Duration::from_secs(1);
