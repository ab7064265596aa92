//! The operator's own routes and key: what only the platform's operator may read or do.
//!
//! The operator key (`MANAGEMENT_API_KEY`) is taken from `Authorization: Bearer` only and
//! compared in constant time (SHA-256 digests, no early exit). No project key (anon,
//! `service_role`, a user's JWT, the default project's keys) is ever accepted in its place:
//! one would let a tenant read the others' figures. It guards the management API and `GET /metrics/projects`, every project's counters on this
//! front (who the other tenants are, how busy, what they were refused).
//!
//! A key rather than a second listener on loopback: the figures are scraped by Prometheus
//! and read by operators from outside the pod, through the one port every deployment
//! already exposes to them; a loopback listener would be out of their reach, and one open
//! wider would need a credential anyway.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

use crate::reply::ApiError;
use crate::telemetry;
use crate::usage::Usage;

/// The operator key, as its digest; `None`: no key configured, so nobody is the operator.
#[derive(Clone)]
pub(crate) struct OperatorKey {
    digest: Option<[u8; 32]>,
}

impl OperatorKey {
    pub(crate) fn new(key: Option<&str>) -> OperatorKey {
        OperatorKey {
            digest: key.map(|k| Sha256::digest(k.as_bytes()).into()),
        }
    }

    /// Whether `headers` carry the operator key (`Authorization: Bearer <key>`): a
    /// project's key (a JWT) is refused with 403, anything else with 401.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(want) = self.digest.as_ref() else {
            return Err(ApiError::forbidden(
                "no operator key is configured on this front (MANAGEMENT_API_KEY)",
            ));
        };
        let Some(presented) = bearer(headers) else {
            return Err(ApiError::unauthorized(
                "the operator key is required (Authorization: Bearer <MANAGEMENT_API_KEY>)",
            ));
        };
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let diff = digest
            .iter()
            .zip(want.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if std::hint::black_box(diff) == 0 {
            return Ok(());
        }
        if crate::auth::peek_claims(presented).is_ok() {
            return Err(ApiError::forbidden(
                "a project's key or token is not the operator key",
            ));
        }
        Err(ApiError::unauthorized("wrong operator key"))
    }
}

/// The token of `Authorization: Bearer <token>`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

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
    if let Err(e) = f.key.check(&headers) {
        telemetry::error("operator_auth");
        e.log("operator", "project_metrics", None);
        return e.into_response();
    }
    let text = crate::usage::render(&f.usage.snapshot());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}
