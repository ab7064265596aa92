//! The operational HTTP surface: `/health` (JSON), `/livez` and `/readyz` (probes) and
//! `/metrics`. A front adds its own routes, among them the operator's `/metrics/projects`
//! (per-project figures, behind the operator key: `walcast_front::Front::router`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use walcast_bus::Bus;
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

async fn health(State(s): State<OpsState>) -> impl IntoResponse {
    Json(HealthBody {
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
    })
}

/// `/livez`: the process runs and its HTTP server answers.
async fn livez() -> &'static str {
    "ok"
}

/// `/readyz`: 200 `ready`, or 503 with the reason (see [`readiness`]).
async fn readyz(State(s): State<OpsState>) -> impl IntoResponse {
    let front = s.front.as_ref().map(Front::health);
    let cdc = s.cdc.as_ref().map(|c| c.report());
    let sources = s.sources.as_ref().map(|s| s.health()).unwrap_or_default();
    let ready = readiness(s.bus.is_connected(), front.as_ref(), cdc.as_ref())
        .and_then(|()| sources_ready(&sources));
    match ready {
        Ok(()) => (StatusCode::OK, "ready".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
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
) -> Result<(), String> {
    if !bus_connected {
        return Err("not ready: the bus (NATS) is not connected".into());
    }
    if front.is_some_and(|f| f.draining) {
        return Err("not ready: shutting down (draining sockets)".into());
    }
    if let Some(c) = cdc.filter(|c| c.leader && !c.cdc_active) {
        let why = c.last_error.as_deref().unwrap_or("starting");
        return Err(format!(
            "not ready: leader, but the pipeline is not active: {why}"
        ));
    }
    Ok(())
}

/// Every source this worker leads streams (a source it only stands by for is ready).
pub fn sources_ready(sources: &[crate::supervisor::SourceHealth]) -> Result<(), String> {
    for s in sources {
        if let Err(why) = readiness(true, None, Some(&s.pipeline)) {
            return Err(format!("{why} (source {})", s.name));
        }
    }
    Ok(())
}

async fn metrics(State(s): State<OpsState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::render(&s.metrics),
    )
}

pub fn ops_router(state: OpsState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
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
            .contains("NATS"));
        assert!(readiness(true, Some(&front(true)), None)
            .unwrap_err()
            .contains("draining"));
        assert_eq!(readiness(true, None, Some(&cdc(true, true))), Ok(()));
        assert!(readiness(true, None, Some(&cdc(true, false)))
            .unwrap_err()
            .contains("wal2json"));
        // A standby cannot read before it leads: it is a ready member of the set.
        assert_eq!(readiness(true, None, Some(&cdc(false, false))), Ok(()));
    }
}
