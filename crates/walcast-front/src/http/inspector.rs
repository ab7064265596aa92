//! The inspector: a page at `/inspector` to watch a project's changes, broadcasts and
//! presence, and the pipeline's health.
//!
//! The page (HTML, JS and CSS in `inspector/`, compiled into the binary: nothing is
//! fetched from elsewhere) is a Phoenix/Supabase Realtime client of its own over the same
//! WebSocket as every app, so it sees only what the key pasted into it may see. Its health
//! panel reads `GET /inspector/api/health`, which answers any valid key of a project
//! with the processes this front hears from (see [`crate::cluster`]), scoped to what
//! that key may know: the pipelines and fronts serve every project, so their numbers
//! (changes, skips, connections, channels, every project's counts) and the pipeline's
//! last error (which may name any project's database objects) are shown to the default
//! project's `service_role` key only (the operator's; its anon key is public). Other keys
//! see whether each process is up (leader, `cdc_active`, bus and draining) and their own
//! project's counts.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use walcast_bus::beacon::{Beacon, WorkerBeacon};

use crate::auth::credentials::Credentials;
use crate::cluster::{Heard, ProcessView};
use crate::http::health::{Health, Probe};
use crate::limits::usage::{ProjectUsage, Usage};
use crate::projects::Projects;
use crate::reply::error_response;

const INDEX: &str = include_str!("../../inspector/index.html");
const SCRIPT: &str = include_str!("../../inspector/inspector.js");
const STYLE: &str = include_str!("../../inspector/inspector.css");

/// The page may run only its own script and style and talk only to this origin.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   img-src 'self' data:; connect-src 'self' ws: wss:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// What the health panel reads: the processes heard from, this front's own counts, and
/// the projects (to verify the key that asks).
pub(crate) struct Inspector {
    pub projects: Projects,
    pub heard: Arc<Heard>,
    pub probe: Arc<Probe>,
    pub usage: Arc<Usage>,
}

pub(crate) fn routes() -> Router<Arc<Inspector>> {
    Router::new()
        .route(
            "/inspector",
            get(|| asset(INDEX, "text/html; charset=utf-8")),
        )
        .route(
            "/inspector/",
            get(|| asset(INDEX, "text/html; charset=utf-8")),
        )
        .route(
            "/inspector/inspector.js",
            get(|| asset(SCRIPT, "text/javascript; charset=utf-8")),
        )
        .route(
            "/inspector/inspector.css",
            get(|| asset(STYLE, "text/css; charset=utf-8")),
        )
        .route("/inspector/api/health", get(health))
}

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

#[derive(Serialize)]
struct HealthView {
    /// The front that answered.
    front: String,
    /// The role of the key that asked.
    role: String,
    processes: Vec<ProcessView>,
    /// Per project: the key's own project, or every project for the operator.
    projects: BTreeMap<String, ProjectView>,
}

/// One project as the inspector shows it.
#[derive(Serialize, Debug, PartialEq)]
struct ProjectView {
    /// Connected users on every front (this one's count plus the others' beacons).
    users: u64,
    /// The project's connected-users limit (its own, else the default).
    max_users: u64,
    /// Every limit in force (its own, else the default).
    limits: crate::limits::usage::Quotas,
    /// This front's counters.
    here: ProjectUsage,
}

/// `GET /inspector/api/health` with a project key (see [`crate::auth::credentials`]).
async fn health(
    State(inspector): State<Arc<Inspector>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let creds = Credentials::from_request(&query, &headers);
    let verified = match inspector.projects.verify(creds.token().unwrap_or("")).await {
        Ok(v) => v,
        Err(e) => return error_response(e.http_status(), &e.to_string()),
    };
    let role = verified
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or("anon")
        .to_string();
    let mut processes = inspector.heard.lock().view(Instant::now());
    let health = inspector.probe.health();
    with_own_front(&mut processes, &health);
    let operator = verified.project == crate::DEFAULT_PROJECT && role == "service_role";
    scope(&mut processes, &verified.project, operator);
    let projects = project_views(&inspector.usage, &verified.project, operator);
    let body = HealthView {
        front: health.front_id.clone(),
        role,
        processes,
        projects,
    };
    (StatusCode::OK, Json(body)).into_response()
}

/// The projects a key of `project` may see the counts of: its own; every one for the
/// operator (the default project's `service_role` key).
fn project_views(usage: &Usage, project: &str, operator: bool) -> BTreeMap<String, ProjectView> {
    let mut all = usage.snapshot();
    if !operator {
        all.retain(|p, _| p == project);
        all.entry(project.to_string()).or_default();
    }
    all.into_iter()
        .map(|(p, here)| {
            let users = here.users + usage.remote_users(&p);
            let limits = usage.quotas(&p);
            let view = ProjectView {
                users,
                max_users: limits.users,
                limits,
                here,
            };
            (p, view)
        })
        .collect()
}

/// This front as it is now (its beacon is up to a second old, or not sent yet).
fn with_own_front(processes: &mut Vec<ProcessView>, h: &Health) {
    let now = h.beacon();
    match processes
        .iter_mut()
        .find(|p| p.beacon.process == h.front_id)
    {
        Some(p) => {
            p.beacon.front = Some(now);
            p.heard_ms_ago = 0;
        }
        None => processes.push(ProcessView {
            beacon: Beacon {
                process: h.front_id.clone(),
                at_ms: 0,
                bus_connected: h.bus_connected,
                worker: None,
                front: Some(now),
                sources: Vec::new(),
            },
            heard_ms_ago: 0,
            history: Vec::new(),
        }),
    }
}

/// What a key of `project` may see of processes that serve every project (see the
/// module's doc): everything for the operator, else whether each is up.
fn scope(processes: &mut [ProcessView], project: &str, operator: bool) {
    if !operator {
        hide_errors(processes);
        hide_counts(processes, project);
    }
}

/// Deployment-wide numbers say how busy the other projects are: only up/down (and the
/// project's own users) is left.
fn hide_counts(processes: &mut [ProcessView], project: &str) {
    for p in processes {
        p.history.clear();
        for w in pipelines(&mut p.beacon) {
            w.lag_bytes = 0;
            w.changes_total = 0;
            w.skipped_changes_total = 0;
        }
        if let Some(f) = p.beacon.front.as_mut() {
            f.connections = 0;
            f.channels = 0;
            f.sse_streams = 0;
            f.subscriptions = 0;
            f.project_users.retain(|p, _| p == project);
            f.project_rates.retain(|p, _| p == project);
        }
    }
}

/// A pipeline's last error may name any project's database objects: only the default
/// project's `service_role` sees it.
fn hide_errors(processes: &mut [ProcessView]) {
    for p in processes {
        for w in pipelines(&mut p.beacon) {
            w.last_error = w
                .last_error
                .take()
                .map(|_| "(shown to the default project's service_role only)".into());
        }
    }
}

/// A beacon's pipelines: the default source's and the other sources' (`sources`).
fn pipelines(b: &mut Beacon) -> impl Iterator<Item = &mut WorkerBeacon> {
    b.worker.iter_mut().chain(b.sources.iter_mut())
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_bus::beacon::{FrontBeacon, WorkerBeacon};

    fn health(front_id: &str, connections: usize) -> crate::Health {
        crate::Health {
            front_id: front_id.into(),
            connections,
            channels: 0,
            sse_streams: 0,
            subscriptions: 0,
            bus: "nats",
            bus_connected: true,
            bus_disconnected_recently: false,
            bus_last_disconnect: None,
            bus_disconnects: 0,
            draining: false,
            project_users: Default::default(),
            project_rates: Default::default(),
        }
    }

    fn heard(
        process: &str,
        worker: Option<WorkerBeacon>,
        front: Option<FrontBeacon>,
    ) -> ProcessView {
        ProcessView {
            beacon: Beacon {
                process: process.into(),
                at_ms: 1,
                bus_connected: true,
                worker,
                front,
                sources: Vec::new(),
            },
            heard_ms_ago: 900,
            history: Vec::new(),
        }
    }

    #[test]
    fn this_front_is_shown_live_heard_or_not() {
        let mut v = vec![heard("f1", None, Some(FrontBeacon::default()))];
        with_own_front(&mut v, &health("f1", 3));
        assert_eq!((v.len(), v[0].heard_ms_ago), (1, 0));
        assert_eq!(v[0].beacon.front.as_ref().map(|f| f.connections), Some(3));
        with_own_front(&mut v, &health("f2", 5));
        assert_eq!(v.len(), 2, "not heard yet: added");
        assert_eq!(v[1].beacon.front.as_ref().map(|f| f.connections), Some(5));
    }

    #[test]
    fn other_projects_see_up_or_down_only() {
        let busy = WorkerBeacon {
            leader: true,
            cdc_active: true,
            changes_total: 42,
            lag_bytes: 7,
            last_error: Some("relation \"other_tenant.secret\" does not exist".into()),
            ..Default::default()
        };
        let front = health("f1", 9).beacon();
        let fresh = || {
            vec![
                heard("w1", Some(busy.clone()), None),
                heard("f1", None, Some(front.clone())),
            ]
        };
        let mut other = fresh();
        scope(&mut other, "0b6c", false);
        let w = other[0].beacon.worker.as_ref().unwrap();
        assert!(w.leader && w.cdc_active);
        assert_eq!((w.changes_total, w.lag_bytes), (0, 0));
        assert_ne!(w.last_error.as_deref(), busy.last_error.as_deref());
        assert_eq!(other[1].beacon.front.as_ref().unwrap().connections, 0);
        // The default project's anon key is public: it sees no more than another's.
        let mut anon = fresh();
        scope(&mut anon, "default", false);
        let w = anon[0].beacon.worker.as_ref().unwrap();
        assert_eq!(w.changes_total, 0);
        assert_ne!(w.last_error.as_deref(), busy.last_error.as_deref());
        let mut operator = fresh();
        scope(&mut operator, "default", true);
        let w = operator[0].beacon.worker.as_ref().unwrap();
        assert_eq!(w.last_error.as_deref(), busy.last_error.as_deref());
        assert_eq!(operator[1].beacon.front.as_ref().unwrap().connections, 9);
    }

    #[test]
    fn the_other_sources_pipelines_are_scrubbed_alike() {
        let on_s2 = WorkerBeacon {
            source: "s2".into(),
            leader: true,
            cdc_active: true,
            changes_total: 42,
            lag_bytes: 7,
            last_error: Some("relation \"tenant.secret\" does not exist".into()),
            ..Default::default()
        };
        let mut v = vec![heard("w1", Some(WorkerBeacon::default()), None)];
        v[0].beacon.sources.push(on_s2.clone());
        scope(&mut v, "0b6c", false);
        let w = &v[0].beacon.sources[0];
        assert!(w.leader && w.cdc_active && w.source == "s2");
        assert_eq!((w.changes_total, w.lag_bytes), (0, 0));
        assert_ne!(w.last_error.as_deref(), on_s2.last_error.as_deref());
    }

    #[test]
    fn pipeline_errors_are_hidden_but_their_presence_is_not() {
        let failing = WorkerBeacon {
            last_error: Some("relation \"secret_table\" does not exist".into()),
            ..Default::default()
        };
        let mut v = vec![
            heard("w1", Some(failing), None),
            heard("w2", Some(WorkerBeacon::default()), None),
        ];
        hide_errors(&mut v);
        let errors: Vec<Option<String>> = v
            .iter()
            .map(|p| p.beacon.worker.as_ref().and_then(|w| w.last_error.clone()))
            .collect();
        assert_eq!(
            errors,
            [
                Some("(shown to the default project's service_role only)".into()),
                None
            ]
        );
    }
}
