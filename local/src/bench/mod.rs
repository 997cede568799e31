//! Benchmarks of Stoker's own parts (`stoker bench`); the autoscaler's lives with its
//! simulator in the operator.

pub mod dispatcher;
