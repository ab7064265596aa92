//! The management API: projects created, read, listed, updated (name, private-only,
//! suspended, their own limits), deleted, and their secret rotated, by the platform's
//! operator.
//!
//! It is served by every front (the fronts are the HTTP side of walcast; they have no
//! database, so the cdc-worker does the work through admin requests,
//! `walcast_control::manage` — the code `walcast project …` runs too). After a change,
//! the front publishes [`SUBJECT_PROJECTS_CHANGED`]: every front refreshes its project
//! directory at once, and ends the sockets a deleted, suspended or now private-only
//! project may no longer keep (see `ending`). A project's snapshots (README "Change
//! streams") are started, listed and cancelled here too (see `snapshots`), at the leader
//! of the project's source.
//!
//! Authenticated by the operator key (`MANAGEMENT_API_KEY`, `Authorization: Bearer`),
//! compared in constant time; no project key (anon, service_role, user JWT) is ever
//! accepted. Without the key the routes are not served. A project's secret is returned
//! only by create and rotate. The routes and answers are in `docs/management-api.json`.

mod ending;
mod snapshots;
mod view;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};
use walcast_bus::admin::{
    AdminClient, AdminRequest, LimitChanges, ProjectLimits, ProjectRecord, LIMITS, MAX_LIMIT,
};
use walcast_bus::Bus;

pub(crate) use ending::{events_loop, notice_loop};
pub use view::{created_view, mint_keys, project_view, with_effective_limits, KEY_LIFETIME_SECS};
pub use walcast_bus::admin::SUBJECT_PROJECTS_CHANGED;

use crate::auth::operator::OperatorKey;
use crate::projects::Projects;
use crate::reply::ApiError;
use crate::telemetry;

/// How long a request waits for the cdc-worker.
const WORKER_TIMEOUT: Duration = Duration::from_secs(10);

/// What the management routes need.
pub(crate) struct Management {
    pub projects: Projects,
    pub bus: Bus,
    /// The operator key.
    pub key: OperatorKey,
    /// How long a rotated secret stays valid by default.
    pub rotation_window: Duration,
    /// A project's limits where it has none of its own (every field set; see
    /// [`crate::FrontConfig::project_defaults`]).
    pub defaults: ProjectLimits,
}

impl Management {
    pub(crate) fn new(
        projects: Projects,
        bus: Bus,
        key: &str,
        (window, defaults): (Duration, ProjectLimits),
    ) -> Management {
        Management {
            projects,
            bus,
            key: OperatorKey::new(Some(key)),
            rotation_window: window,
            defaults,
        }
    }

    /// A project as the API shows it: no secrets, its limits and those in force.
    fn view(&self, p: &ProjectRecord) -> Value {
        with_effective_limits(project_view(p), p, &self.defaults)
    }

    /// A created or rotated project: with its secret and keys.
    fn created(&self, p: &ProjectRecord) -> Result<Value, ApiError> {
        let v = created_view(p).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        })?;
        Ok(with_effective_limits(v, p, &self.defaults))
    }
}

/// The routes (see `docs/management-api.json`).
pub(crate) fn routes(m: Arc<Management>) -> Router {
    Router::new()
        .route(PROJECTS, post(create).get(list))
        .route(PROJECT, get(get_one).patch(update).delete(delete))
        .route(ROTATE, post(rotate))
        .route(SNAPSHOTS, post(snapshots::start).get(snapshots::list))
        .route(SNAPSHOT, get(snapshots::get_one).delete(snapshots::cancel))
        .with_state(m)
}

/// Paths of the routes (checked against the OpenAPI file by a test).
pub const PROJECTS: &str = "/management/v1/projects";
pub const PROJECT: &str = "/management/v1/projects/{id}";
pub const ROTATE: &str = "/management/v1/projects/{id}/rotate";
pub const SNAPSHOTS: &str = "/management/v1/projects/{id}/snapshots";
pub const SNAPSHOT: &str = "/management/v1/projects/{id}/snapshots/{snapshot}";

/// Every operation: its id in the OpenAPI file, and the statuses it answers with
/// (checked against the file by a test).
pub const RESPONSES: &[(&str, &[u16])] = &[
    ("create", &[201, 401, 403, 422, 500, 503]),
    ("list", &[200, 401, 403, 500, 503]),
    ("get", &[200, 400, 401, 403, 404, 500, 503]),
    ("update", &[200, 400, 401, 403, 404, 422, 500, 503]),
    ("delete", &[200, 400, 401, 403, 404, 500, 503]),
    ("rotate", &[200, 400, 401, 403, 404, 422, 500, 503]),
    (
        "snapshot_start",
        &[201, 400, 401, 403, 404, 409, 413, 422, 429, 500, 503],
    ),
    ("snapshot_list", &[200, 400, 401, 403, 404, 500, 503]),
    ("snapshot_get", &[200, 400, 401, 403, 404, 500, 503]),
    ("snapshot_cancel", &[200, 400, 401, 403, 404, 409, 500, 503]),
];

/// Count, log and answer a refusal or failure.
fn respond(e: ApiError, op: &'static str) -> Response {
    let status = e.status.as_u16().to_string();
    metrics::counter!(telemetry::MANAGEMENT_REQUESTS, "op" => op, "status" => status).increment(1);
    e.log("management", op, None);
    e.into_response()
}

/// The operator key (see [`crate::auth::operator`]): a project's key (a JWT) is refused with
/// 403, anything else with 401.
fn authorize(m: &Management, headers: &HeaderMap) -> Result<AdminClient, ApiError> {
    m.key.check(headers)?;
    m.projects.admin().cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "this front has no cdc-worker to ask",
        )
    })
}

/// A project id from the path: 1 to 64 letters, digits, `-` or `_`, not `default` (the
/// default project is configured by `JWT_SECRET`, not managed).
fn check_id(id: &str) -> Result<(), ApiError> {
    let ok = (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !ok {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_id",
            "a project id is 1 to 64 letters, digits, '-' or '_'",
        ));
    }
    if id == crate::auth::DEFAULT_PROJECT {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_id",
            "the default project is configured by JWT_SECRET, not managed here",
        ));
    }
    Ok(())
}

/// A JSON object body (empty = `{}`).
fn body_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Default::default());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::invalid_body("the body must be a JSON object")),
        Err(e) => Err(ApiError::invalid_body(format!("the body is not JSON: {e}"))),
    }
}

/// An optional field of a type; any other field is refused (a typo must not be ignored).
fn fields(o: &serde_json::Map<String, Value>, allowed: &[&str]) -> Result<(), ApiError> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid_body(format!(
            "unknown field {k:?} (allowed: {})",
            allowed.join(", ")
        ))),
        None => Ok(()),
    }
}

fn opt_bool(o: &serde_json::Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid_body(format!(
            "{k:?} must be true or false"
        ))),
    }
}

/// A limit `k`: absent `None`; `null` `Some(None)` (the fronts' default); a whole number
/// from 0 to [`MAX_LIMIT`] `Some(Some(n))`. Anything else (negative, fractional, too
/// large, a string) is refused, naming `k`.
fn opt_limit(o: &serde_json::Map<String, Value>, k: &str) -> Result<Option<Option<u32>>, ApiError> {
    match o.get(k) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(None)),
        Some(v) => v
            .as_u64()
            .filter(|n| *n <= MAX_LIMIT)
            .and_then(|n| u32::try_from(n).ok())
            .map(|n| Some(Some(n)))
            .ok_or_else(|| {
                ApiError::invalid_body(format!(
                    "{k:?} must be a whole number from 0 to {MAX_LIMIT}, or null for the default"
                ))
            }),
    }
}

/// Every limit of a body ([`ProjectLimits::FIELDS`]), each as [`opt_limit`] reads it.
fn opt_limits(o: &serde_json::Map<String, Value>) -> Result<LimitChanges, ApiError> {
    let mut changes = [None; LIMITS];
    for (change, k) in changes.iter_mut().zip(ProjectLimits::FIELDS) {
        *change = opt_limit(o, k)?;
    }
    Ok(LimitChanges::from_array(changes))
}

/// The fields a create accepts (checked against the OpenAPI file by a test).
pub fn create_fields() -> Vec<&'static str> {
    let mut f = vec!["name", "private_only", "source"];
    f.extend(ProjectLimits::FIELDS);
    f
}

/// The fields an update accepts (checked against the OpenAPI file by a test).
pub fn update_fields() -> Vec<&'static str> {
    let mut f = vec!["name", "private_only", "suspended"];
    f.extend(ProjectLimits::FIELDS);
    f
}

fn opt_str(o: &serde_json::Map<String, Value>, k: &str) -> Result<Option<String>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid_body(format!("{k:?} must be a string"))),
    }
}

/// Tell every front a project changed (they refresh their directory at once), and
/// refresh this one's before answering (its next request sees the change).
async fn announce(m: &Management, id: &str) {
    let r = m
        .bus
        .publish(
            SUBJECT_PROJECTS_CHANGED.to_string(),
            &[],
            Bytes::from(id.to_string()),
        )
        .await;
    if let Err(e) = r {
        tracing::warn!(error = %e, project = id, "cannot announce the project change: fronts see it at their next refresh");
    }
    m.projects.refresh_now().await;
}

fn answer(op: &'static str, status: StatusCode, r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => {
            metrics::counter!(telemetry::MANAGEMENT_REQUESTS, "op" => op, "status" => status.as_u16().to_string())
                .increment(1);
            (status, Json(v)).into_response()
        }
        Err(e) => respond(e, op),
    }
}

type St = State<Arc<Management>>;

/// `POST /management/v1/projects` `{"name", "private_only"?, "source"?,
/// "max_concurrent_users"?, … the other limits?}`: 201, with its secret and keys (a limit `null`: the default).
async fn create(State(m): St, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        let o = body_object(&body)?;
        fields(&o, &create_fields())?;
        let name =
            opt_str(&o, "name")?.ok_or_else(|| ApiError::invalid_body("\"name\" is required"))?;
        let private_only = opt_bool(&o, "private_only")?.unwrap_or(false);
        let source = opt_str(&o, "source")?;
        let limits = ProjectLimits::from_array(opt_limits(&o)?.to_array().map(Option::flatten));
        let req = AdminRequest::ProjectCreate {
            name,
            private_only,
            source,
            limits,
        };
        let p = admin.project(req, WORKER_TIMEOUT).await?;
        announce(&m, &p.id).await;
        tracing::info!(project = %p.id, "project created through the management API");
        m.created(&p)
    }
    .await;
    answer("create", StatusCode::CREATED, r)
}

/// `GET /management/v1/projects`: every stored project, no secrets.
async fn list(State(m): St, headers: HeaderMap) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        let list = admin.projects(WORKER_TIMEOUT).await?;
        Ok(Value::Array(list.iter().map(|p| m.view(p)).collect()))
    }
    .await;
    answer("list", StatusCode::OK, r)
}

/// `GET /management/v1/projects/{id}`.
async fn get_one(State(m): St, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_id(&id)?;
        let p = admin
            .project(AdminRequest::ProjectGet { id }, WORKER_TIMEOUT)
            .await?;
        Ok(m.view(&p))
    }
    .await;
    answer("get", StatusCode::OK, r)
}

/// `PATCH /management/v1/projects/{id}` `{"name"?, "private_only"?, "suspended"?,
/// "max_concurrent_users"?, … the other limits?}` (a limit `null`: back to the default).
async fn update(State(m): St, Path(id): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_id(&id)?;
        let o = body_object(&body)?;
        fields(&o, &update_fields())?;
        let req = AdminRequest::ProjectUpdate {
            id: id.clone(),
            name: opt_str(&o, "name")?,
            private_only: opt_bool(&o, "private_only")?,
            suspended: opt_bool(&o, "suspended")?,
            limits: opt_limits(&o)?,
        };
        let p = admin.project(req, WORKER_TIMEOUT).await?;
        announce(&m, &id).await;
        Ok(m.view(&p))
    }
    .await;
    answer("update", StatusCode::OK, r)
}

/// `DELETE /management/v1/projects/{id}`.
async fn delete(State(m): St, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_id(&id)?;
        let tables = admin.delete_project(&id, WORKER_TIMEOUT).await?;
        announce(&m, &id).await;
        Ok(json!({"id": id, "deleted": true, "tables": tables}))
    }
    .await;
    answer("delete", StatusCode::OK, r)
}

/// `POST /management/v1/projects/{id}/rotate` `{"previous_valid_secs"?}`.
async fn rotate(State(m): St, Path(id): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_id(&id)?;
        let o = body_object(&body)?;
        fields(&o, &["previous_valid_secs"])?;
        let window_secs = match o.get("previous_valid_secs") {
            None | Some(Value::Null) => m.rotation_window.as_secs(),
            Some(v) => v.as_u64().ok_or_else(|| {
                ApiError::invalid_body("\"previous_valid_secs\" must be a whole number of seconds")
            })?,
        };
        let req = AdminRequest::ProjectRotate {
            id: id.clone(),
            window_secs,
        };
        let p = admin.project(req, WORKER_TIMEOUT).await?;
        announce(&m, &id).await;
        m.created(&p)
    }
    .await;
    answer("rotate", StatusCode::OK, r)
}

#[cfg(test)]
mod tests;
