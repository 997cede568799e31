//! Benchmarks of Stoker's own parts (`stoker bench`): [`dispatcher`], one dispatcher under
//! simulated members; [`policies`], the autoscaling policies compared on local processes. The
//! simulated comparison lives with its simulator in the operator.

pub mod dispatcher;
pub mod policies;
