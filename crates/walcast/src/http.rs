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

#[derive(Clone)]
pub struct OpsState {
    pub cdc: Arc<CdcHealth>,
    pub bus: Bus,
    pub metrics: PrometheusHandle,
    pub lease_mode: &'static str,
}

#[derive(Serialize)]
struct HealthBody {
    #[serde(flatten)]
    cdc: CdcHealthReport,
    lease_mode: &'static str,
    bus: &'static str,
    bus_connected: bool,
}

async fn health(State(s): State<OpsState>) -> impl IntoResponse {
    Json(HealthBody {
        cdc: s.cdc.report(),
        lease_mode: s.lease_mode,
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
