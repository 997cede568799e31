//! The operator's HTTP endpoints: /healthz (the process runs), /readyz (the process is up, as
//! the leader or a standby; the body says which) and /metrics.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use kube::runtime::reflector::Store;
use stoker_api::DataPipeline;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// What this process is doing, as /readyz reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Connecting, or stopping: not Ready.
    Starting,
    /// Waiting for the lease: Ready (a healthy replica), but the dispatcher Service does not
    /// route here (it selects the leader's pod label, see `leader_pod`).
    Standby,
    /// Reconciling and serving the dispatcher.
    Leading,
}

#[derive(Clone)]
pub struct HttpState {
    pub metrics: Metrics,
    pub role: watch::Receiver<Role>,
    /// The controller's cache, once this process reconciles.
    pub pipelines: watch::Receiver<Option<Store<DataPipeline>>>,
}

pub async fn serve(addr: SocketAddr, state: HttpState, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await?;
    Ok(())
}

async fn readyz(State(state): State<HttpState>) -> (StatusCode, &'static str) {
    match *state.role.borrow() {
        Role::Leading => (StatusCode::OK, "leading"),
        Role::Standby => (StatusCode::OK, "standby"),
        Role::Starting => (StatusCode::SERVICE_UNAVAILABLE, "starting"),
    }
}

async fn metrics(State(state): State<HttpState>) -> String {
    if let Some(store) = state.pipelines.borrow().as_ref() {
        state.metrics.count_phases(store.state().iter().map(|dp| dp.as_ref()));
    }
    state.metrics.render()
}
