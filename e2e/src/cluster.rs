//! Starting the cluster the suite runs on: the provider `STOKER_E2E_PROVIDER` names.

use crate::kind::KindCluster;
use crate::local::LocalControlPlane;
use crate::node::NodeCluster;
use crate::provider::{Cluster, Provider, StartError};

/// Starts the provider chosen by `STOKER_E2E_PROVIDER`.
pub async fn start_from_env() -> Result<Box<dyn Cluster>, StartError> {
    install_tls_provider();
    match Provider::from_env()? {
        Provider::Local => Ok(Box::new(LocalControlPlane::start().await?)),
        Provider::Kind => Ok(Box::new(KindCluster::start().await?)),
        Provider::Kubelet => Ok(Box::new(NodeCluster::start().await?)),
    }
}

/// Several rustls providers are compiled into the workspace (kube uses ring, object_store
/// aws-lc-rs), so rustls cannot choose one by itself: choose ring before any client exists.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
