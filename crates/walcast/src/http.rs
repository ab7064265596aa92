//! The operational HTTP surface: `/health` and `/metrics`.

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tokio::net::TcpListener;
use walcast_bus::Bus;
use walcast_cdc::{CdcHealth, CdcHealthReport};
use walcast_front::Front;

#[derive(Clone)]
pub struct OpsState {
    /// The CDC pipeline, in processes that run one.
    pub cdc: Option<Arc<CdcHealth>>,
    /// The realtime front, in processes that run one.
    pub front: Option<Front>,
    pub bus: Bus,
    pub metrics: PrometheusHandle,
    pub lease_mode: String,
}

#[derive(Serialize)]
struct HealthBody {
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    cdc: Option<CdcHealthReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    front: Option<walcast_front::Health>,
    bus: &'static str,
    bus_connected: bool,
}

async fn health(State(s): State<OpsState>) -> impl IntoResponse {
    Json(HealthBody {
        cdc: s.cdc.as_ref().map(|c| c.report()),
        lease_mode: s.cdc.as_ref().map(|_| s.lease_mode.clone()),
        front: s.front.as_ref().map(Front::health),
        bus: s.bus.kind(),
        bus_connected: s.bus.is_connected(),
    })
}

async fn metrics(State(s): State<OpsState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

pub fn ops_router(state: OpsState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serve `router` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
