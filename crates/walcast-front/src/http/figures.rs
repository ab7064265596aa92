//! The operator's figures: `GET /metrics/projects`, every project's counters on this
//! front, guarded by the operator's keys ([`OperatorKey`]: the operator key or the
//! figures key).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::auth::operator::OperatorKey;
use crate::limits::usage::Usage;
use crate::telemetry;

/// What the operator's figures need.
pub(crate) struct Figures {
    pub key: OperatorKey,
    pub usage: Arc<Usage>,
}

/// `GET /metrics/projects`: every project's counters on this front, in Prometheus' text
/// format, to the operator only.
pub(crate) fn routes(figures: Arc<Figures>) -> Router {
    Router::new()
        .route("/metrics/projects", get(project_metrics))
        .with_state(figures)
}

async fn project_metrics(State(f): State<Arc<Figures>>, headers: HeaderMap) -> Response {
    if let Err(e) = f.key.check_figures(&headers) {
        telemetry::error("operator_auth");
        e.log("operator", "project_metrics", None);
        return e.into_response();
    }
    let text = crate::limits::usage::render(&f.usage.snapshot());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}
