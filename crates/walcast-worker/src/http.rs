//! The operational HTTP surface: `/health` (JSON), `/livez` and `/readyz` (probes) and
//! `/metrics`. A front adds its own routes, among them the operator's `/metrics/projects`
//! (per-project figures, behind the operator key: `walcast_front::Front::router`).
//!
//! The figures name projects (lagging delivery lanes, series labelled by project),
//! tables (the last skipped change) and error texts: `/metrics` and the full `/health` go
//! to the operator's keys only (`Authorization: Bearer <MANAGEMENT_API_KEY or
//! METRICS_API_KEY>`). Anyone else gets the public `/health` (up, leader, streaming, bus,
//! lag), `/livez`, and `/readyz` with a reason that names no source nor error.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use walcast_bus::Bus;
use walcast_front::operator::OperatorKey;
use walcast_front::Front;
use walcast_lease::LeaseStatus;
use walcast_pipeline::{PipelineHealth, PipelineHealthReport};

pub use crate::server::serve;

#[derive(Clone)]
pub struct OpsState {
    /// The CDC pipeline, in processes that run one.
    pub cdc: Option<Arc<PipelineHealth>>,
    /// The other sources' pipelines (README "Sources"), in processes that run the CDC.
    pub sources: Option<Arc<crate::supervisor::Sources>>,
    /// The outbox relay, where enabled.
    pub outbox: Option<Arc<walcast_outbox::OutboxHealth>>,
    /// The realtime front, in processes that run one.
    pub front: Option<Front>,
    pub bus: Bus,
    pub metrics: PrometheusHandle,
    pub lease_mode: String,
    /// The elector's view, in processes that elect a leader.
    pub lease: Option<Arc<LeaseStatus>>,
    /// Who reads the figures (`/metrics`, the full `/health`, `/readyz`'s reasons).
    pub key: OperatorKey,
}

/// What a process serves its operational routes with.
pub struct OpsHttp {
    pub listener: crate::server::Listening,
    pub metrics: PrometheusHandle,
    /// The operator's keys (`MANAGEMENT_API_KEY`, `METRICS_API_KEY`).
    pub key: OperatorKey,
}

/// The lease as this process sees it.
#[derive(Serialize)]
struct LeaseHealth {
    /// The term (fencing number) as last seen.
    lease_term: Option<u64>,
    /// Its holder as last seen.
    lease_holder: Option<String>,
    /// Leader: time left before its fence closes unless renewed. Follower: time left
    /// before the holder's lease runs out, as last read.
    lease_expires_in_ms: Option<u64>,
}

#[derive(Serialize)]
struct HealthBody {
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    cdc: Option<PipelineHealthReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    outbox: Option<walcast_outbox::OutboxHealthReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_mode: Option<String>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    lease: Option<LeaseHealth>,
    #[serde(skip_serializing_if = "Option::is_none")]
    front: Option<walcast_front::Health>,
    /// The other sources' pipelines (README "Sources"): each as the default's fields above.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sources: Vec<crate::supervisor::SourceHealth>,
    bus: &'static str,
    bus_connected: bool,
}

/// What `/health` tells anyone (a load balancer, a client): whether the process is up,
/// leads and streams, its bus, its slot's lag. No project, table, source or error text.
#[derive(Serialize)]
struct PublicHealth {
    #[serde(skip_serializing_if = "Option::is_none")]
    cdc_active: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    leader: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lag_bytes: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draining: Option<bool>,
    bus: &'static str,
    bus_connected: bool,
    /// Where the rest is.
    detail: &'static str,
}

/// Said by the public `/health`.
const MORE_DETAIL: &str =
    "the full health needs Authorization: Bearer <MANAGEMENT_API_KEY or METRICS_API_KEY>";

fn public_health(s: &OpsState) -> PublicHealth {
    let cdc = s.cdc.as_ref().map(|c| c.report());
    PublicHealth {
        cdc_active: cdc.as_ref().map(|c| c.cdc_active),
        leader: cdc.as_ref().map(|c| c.leader),
        lag_bytes: cdc.as_ref().map(|c| c.lag_bytes),
        draining: s.front.as_ref().map(|f| f.health().draining),
        bus: s.bus.kind(),
        bus_connected: s.bus.is_connected(),
        detail: MORE_DETAIL,
    }
}

/// `/health`: the public body without an `Authorization` header; the full one to the
/// operator's keys; any other credential refused (401/403), never answered in part.
async fn health(State(s): State<OpsState>, headers: HeaderMap) -> Response {
    if !headers.contains_key(header::AUTHORIZATION) {
        return Json(public_health(&s)).into_response();
    }
    if let Some(refused) = s.key.refuse_figures(&headers, "health") {
        crate::telemetry::figures_refused("health");
        return refused;
    }
    Json(full_health(&s)).into_response()
}

fn full_health(s: &OpsState) -> HealthBody {
    HealthBody {
        cdc: s.cdc.as_ref().map(|c| c.report()),
        outbox: s
            .outbox
            .as_ref()
            .map(|o| o.report(walcast_outbox::time::now_ms())),
        lease_mode: s.cdc.as_ref().map(|_| s.lease_mode.clone()),
        lease: s.lease.as_ref().map(|l| {
            let r = l.report();
            LeaseHealth {
                lease_term: r.term,
                lease_holder: r.holder,
                lease_expires_in_ms: r
                    .expires_in
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            }
        }),
        front: s.front.as_ref().map(Front::health),
        sources: s.sources.as_ref().map(|s| s.health()).unwrap_or_default(),
        bus: s.bus.kind(),
        bus_connected: s.bus.is_connected(),
    }
}

/// `/livez`: the process runs and its HTTP server answers.
async fn livez() -> &'static str {
    "ok"
}

/// `/readyz`: 200 `ready`, or 503 with the reason (see [`readiness`]): its public form,
/// or its detail (error text, source) to the operator's keys.
async fn readyz(State(s): State<OpsState>, headers: HeaderMap) -> impl IntoResponse {
    let front = s.front.as_ref().map(Front::health);
    let cdc = s.cdc.as_ref().map(|c| c.report());
    let sources = s.sources.as_ref().map(|s| s.health()).unwrap_or_default();
    let ready = readiness(s.bus.is_connected(), front.as_ref(), cdc.as_ref())
        .and_then(|()| sources_ready(&sources));
    match ready {
        Ok(()) => (StatusCode::OK, "ready".to_string()),
        Err(why) if s.key.reads_figures(&headers) => (StatusCode::SERVICE_UNAVAILABLE, why.detail),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why.public.to_string()),
    }
}

/// Why a process is not ready: `public` for anyone (a probe, a load balancer), `detail`
/// (with the pipeline's error and the source's name) for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady {
    pub public: &'static str,
    pub detail: String,
}

impl NotReady {
    fn plain(reason: &'static str) -> NotReady {
        NotReady {
            public: reason,
            detail: reason.to_string(),
        }
    }
}

/// Whether a process should receive traffic (a front) or count as a healthy member of the
/// worker set (a leader that reads the slot, or a standby ready to take over): the bus is
/// connected, a front is not draining, a leader's pipeline is active. A standby is ready:
/// it cannot read the slot before it leads.
pub fn readiness(
    bus_connected: bool,
    front: Option<&walcast_front::Health>,
    cdc: Option<&PipelineHealthReport>,
) -> Result<(), NotReady> {
    if !bus_connected {
        return Err(NotReady::plain(
            "not ready: the bus (NATS) is not connected",
        ));
    }
    if front.is_some_and(|f| f.draining) {
        return Err(NotReady::plain(
            "not ready: shutting down (draining sockets)",
        ));
    }
    if let Some(c) = cdc.filter(|c| c.leader && !c.cdc_active) {
        let why = c.last_error.as_deref().unwrap_or("starting");
        return Err(NotReady {
            public: "not ready: leader, but the pipeline is not active (why: the full /health)",
            detail: format!("not ready: leader, but the pipeline is not active: {why}"),
        });
    }
    Ok(())
}

/// Every source this worker leads streams (a source it only stands by for is ready).
pub fn sources_ready(sources: &[crate::supervisor::SourceHealth]) -> Result<(), NotReady> {
    for s in sources {
        if let Err(why) = readiness(true, None, Some(&s.pipeline)) {
            return Err(NotReady {
                public:
                    "not ready: a source's pipeline is not active (which and why: the full /health)",
                detail: format!("{} (source {})", why.detail, s.name),
            });
        }
    }
    Ok(())
}

/// `/metrics`: to the operator's keys only (series are labelled by project).
async fn metrics(State(s): State<OpsState>, headers: HeaderMap) -> Response {
    if let Some(refused) = s.key.refuse_figures(&headers, "metrics") {
        crate::telemetry::figures_refused("metrics");
        return refused;
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::render(&s.metrics),
    )
        .into_response()
}

pub fn ops_router(state: OpsState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// A cdc-worker serving no front: [`ops_router`], and a JSON answer to any other route
/// (with a front, the front's answer says more).
pub fn worker_router(state: OpsState) -> Router {
    ops_router(state).fallback(|uri: axum::http::Uri| async move {
        let shown: String = uri.path().chars().take(200).collect();
        let body = serde_json::json!({
            "error": "no such route: this is a cdc-worker, which serves only its operator endpoints; clients connect to a front (ws-front, or walcast serve)",
            "path": shown,
            "routes": ["GET /health", "GET /livez", "GET /readyz", "GET /metrics"],
        });
        (StatusCode::NOT_FOUND, axum::Json(body))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn front(draining: bool) -> walcast_front::Health {
        walcast_front::Health {
            front_id: "f".into(),
            connections: 0,
            channels: 0,
            sse_streams: 0,
            subscriptions: 0,
            bus: "nats",
            bus_connected: true,
            bus_disconnected_recently: false,
            bus_last_disconnect: None,
            bus_disconnects: 0,
            draining,
            project_users: Default::default(),
            project_rates: Default::default(),
        }
    }

    fn cdc(leader: bool, active: bool) -> PipelineHealthReport {
        let h = walcast_pipeline::PipelineHealth::new("walcast");
        let mut r = h.report();
        r.leader = leader;
        r.cdc_active = active;
        r.last_error = (!active).then(|| "wal2json is not installed".into());
        r
    }

    #[test]
    fn ready_only_when_connected_not_draining_and_a_leader_reads() {
        assert_eq!(readiness(true, Some(&front(false)), None), Ok(()));
        assert!(readiness(false, Some(&front(false)), None)
            .unwrap_err()
            .public
            .contains("NATS"));
        assert!(readiness(true, Some(&front(true)), None)
            .unwrap_err()
            .public
            .contains("draining"));
        assert_eq!(readiness(true, None, Some(&cdc(true, true))), Ok(()));
        let why = readiness(true, None, Some(&cdc(true, false))).unwrap_err();
        assert!(why.detail.contains("wal2json"), "{why:?}");
        // The error text is the operator's: the public reason names none.
        assert!(!why.public.contains("wal2json"), "{why:?}");
        // A standby cannot read before it leads: it is a ready member of the set.
        assert_eq!(readiness(true, None, Some(&cdc(false, false))), Ok(()));
    }

    #[test]
    fn a_sources_name_and_error_are_the_operators() {
        let sources = [crate::supervisor::SourceHealth {
            name: "acme-payroll".into(),
            pipeline: cdc(true, false),
            lease_holder: None,
            lease_term: None,
        }];
        let why = sources_ready(&sources).unwrap_err();
        assert!(
            why.detail.contains("acme-payroll") && why.detail.contains("wal2json"),
            "{why:?}"
        );
        assert!(
            !why.public.contains("acme-payroll") && !why.public.contains("wal2json"),
            "{why:?}"
        );
    }
}
