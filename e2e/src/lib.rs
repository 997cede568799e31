//! The Stoker end-to-end harness: one scenario suite, three cluster providers.
//!
//! - [`local::LocalControlPlane`] (the default, on every CI run): etcd, kube-apiserver and
//!   kube-controller-manager as child processes on free loopback ports, with a generated admin
//!   kubeconfig. There is no kubelet: pods are created and stay Pending, and the operator runs
//!   as a local process that the harness starts, stops and restarts.
//! - [`node::NodeCluster`] (`kubelet`, on every CI run): the same control plane plus a real node
//!   (kubelet, kube-scheduler and kube-proxy on Debian's dockerd, a Service DNS); the images are
//!   built here and the operator runs in-cluster from the Helm chart.
//! - [`kind::KindCluster`]: a kind cluster with locally built images and the Helm chart
//!   installed; the operator runs in-cluster. Skipped, with the reason, where Docker or kind is
//!   missing.
//!
//! Scenarios are written against the [`Cluster`] trait and run on either.

pub mod cluster;
pub(crate) mod control_plane;
pub mod dashboard;
pub mod http;
pub mod in_cluster;
pub mod k8s;
pub mod kind;
pub mod kubelet;
pub mod leader_proxy;
pub mod local;
pub mod node;
pub mod ports;
pub mod process;
pub mod prometheus;
pub mod provider;
pub mod tenants;
pub mod tools;
pub mod wait;

pub use provider::{Cluster, OperatorInstance, OperatorOptions, Provider, StartError, WorkerData};
pub use wait::{Check, wait_for};

/// Namespace of the operator (the chart's release namespace and the Lease's namespace).
pub const OPERATOR_NAMESPACE: &str = "stoker-system";
/// Name of the Helm release.
pub const RELEASE: &str = "stoker";
/// Name of the operator's Lease.
pub const LEASE_NAME: &str = "stoker-operator";
/// Name of the DataPipeline CRD.
pub const CRD_NAME: &str = "datapipelines.stoker.dev";
