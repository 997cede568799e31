//! The operator's HTTP endpoints: /healthz (the process runs), /readyz (this process leads and
//! reconciles, so Services route dispatcher traffic only to the leader) and /metrics.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use kube::runtime::reflector::Store;
use stoker_api::DataPipeline;
use tokio::sync::watch;

use crate::metrics::Metrics;

#[derive(Clone)]
pub struct HttpState {
    pub metrics: Metrics,
    pub ready: watch::Receiver<bool>,
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
    if *state.ready.borrow() {
        (StatusCode::OK, "leading")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "standby: not the leader")
    }
}

async fn metrics(State(state): State<HttpState>) -> String {
    if let Some(store) = state.pipelines.borrow().as_ref() {
        state.metrics.count_phases(store.state().iter().map(|dp| dp.as_ref()));
    }
    state.metrics.render()
}
