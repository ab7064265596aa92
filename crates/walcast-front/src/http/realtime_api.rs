//! The REST API that enables realtime per table, for a project's servers:
//!
//! * `PUT /v1/db/{project}/schema/tables/{table}/realtime` with `{"enabled": true|false}`
//! * `DELETE` on the same path (= disable), `GET` on it (`{"schema","table","enabled"}`)
//! * `GET /v1/db/{project}/realtime/tables`: `[{"schema","table"}]`
//!
//! The table is always in the project's own schema (`public` for the default project,
//! `project_<hex>` for the others). The key (`apikey` header, or `Authorization: Bearer`)
//! must be a `service_role` key of that project. The front has no database: the
//! cdc-worker does the work ([`AdminClient`]); the pipeline sees the registry edit in WAL
//! order, so it takes effect without a restart.
//!
//! An enable answers `{"schema","table","enabled","changed"}`, plus `unreadable_by` (the
//! API roles that may not `SELECT` the table) and a `warning` with the `GRANT` that fixes
//! it when there are any.
//!
//! Errors are `{"error": <code>, "message": <text>}`: 401 `unauthorized` (missing, bad
//! or expired key), 403 `forbidden` (not `service_role`, or another project's key), 404
//! `unknown_project` / `unknown_table`, 422 `no_primary_key` / `partitioned_table` / `invalid_body`, 503
//! `unavailable` (no cdc-worker answered), 500 `internal`.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Value};
use walcast_bus::admin::{unreadable_note, AdminClient, AdminReply};

use crate::auth::credentials::Credentials;
use crate::auth::AuthError;
use crate::projects::Projects;
use crate::reply::ApiError;
use crate::telemetry;

/// How long a request waits for the cdc-worker.
const WORKER_TIMEOUT: Duration = Duration::from_secs(10);

/// Count, log and answer a refusal or failure.
fn respond(e: ApiError, op: &'static str, project: &str) -> Response {
    let status = e.status.as_u16().to_string();
    metrics::counter!(telemetry::API_ERRORS, "status" => status, "error" => e.error).increment(1);
    telemetry::error("admin_api");
    e.log("realtime API", op, Some(project));
    e.into_response()
}

/// Check that the request carries a `service_role` key of `project`; the client to the
/// worker.
/// The worker's admin client and the project's source (its leader answers), once the
/// key is checked.
async fn authorize(
    projects: &Projects,
    headers: &HeaderMap,
    project: &str,
) -> Result<(AdminClient, String), ApiError> {
    let creds = Credentials::from_headers(headers);
    let Some(key) = creds.key() else {
        return Err(ApiError::unauthorized(
            "an apikey header (or Authorization: Bearer) with the project's service_role key is required",
        ));
    };
    let verified = match projects.verify(key).await {
        Ok(v) => v,
        Err(AuthError::UnknownProject(r)) if r == project => {
            return Err(ApiError::unknown_project(project))
        }
        Err(AuthError::DirectoryUnavailable(m)) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                m,
            ))
        }
        Err(e @ AuthError::Suspended(_)) => return Err(ApiError::forbidden(e.to_string())),
        Err(e) => return Err(ApiError::unauthorized(e.to_string())),
    };
    if verified.project != project {
        return match projects.schema(project).await {
            Ok(_) => Err(ApiError::forbidden(format!(
                "this key belongs to project {:?}, not {project:?}",
                verified.project
            ))),
            Err(AuthError::UnknownProject(_)) => Err(ApiError::unknown_project(project)),
            Err(e) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            )),
        };
    }
    if verified.role() != Some("service_role") {
        return Err(ApiError::forbidden(format!(
            "a service_role key is required (this key's role is {})",
            verified
                .role()
                .map_or("missing".to_string(), |r| format!("{r:?}"))
        )));
    }
    let source = projects
        .source_of(project)
        .ok_or_else(|| ApiError::unknown_project(project))?;
    let admin = projects.admin().cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "this front has no cdc-worker to ask",
        )
    })?;
    Ok((admin, source))
}

/// `{"enabled": true|false}`.
fn parse_enabled(body: &[u8]) -> Result<bool, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_body(format!("the body is not JSON: {e}")))?;
    v.get("enabled").and_then(Value::as_bool).ok_or_else(|| {
        ApiError::invalid_body(r#"the body must be {"enabled": true} or {"enabled": false}"#)
    })
}

async fn set(
    projects: &Projects,
    headers: &HeaderMap,
    project: &str,
    table: &str,
    enabled: Result<bool, ApiError>,
) -> Result<Value, ApiError> {
    let (admin, source) = authorize(projects, headers, project).await?;
    let enabled = enabled?;
    match admin
        .set_realtime(&source, project, table, enabled, WORKER_TIMEOUT)
        .await?
    {
        AdminReply::Realtime {
            schema,
            table,
            enabled,
            changed,
            unreadable_by,
        } => {
            tracing::info!(project, %schema, %table, enabled, changed, "realtime set through the REST API");
            let mut reply =
                json!({"schema": schema, "table": table, "enabled": enabled, "changed": changed});
            if let Some(note) = unreadable_note(&schema, &table, &unreadable_by) {
                reply["unreadable_by"] = json!(unreadable_by);
                reply["warning"] = json!(note);
            }
            Ok(reply)
        }
        other => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("unexpected reply {other:?}"),
        )),
    }
}

fn reply(op: &'static str, project: &str, r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => respond(e, op, project),
    }
}

/// `PUT /v1/db/{project}/schema/tables/{table}/realtime`.
pub(crate) async fn put(
    State(projects): State<Projects>,
    Path((project, table)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = set(&projects, &headers, &project, &table, parse_enabled(&body)).await;
    reply("put", &project, r)
}

/// `DELETE /v1/db/{project}/schema/tables/{table}/realtime`.
pub(crate) async fn delete(
    State(projects): State<Projects>,
    Path((project, table)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let r = set(&projects, &headers, &project, &table, Ok(false)).await;
    reply("delete", &project, r)
}

/// `GET /v1/db/{project}/schema/tables/{table}/realtime`.
pub(crate) async fn get_one(
    State(projects): State<Projects>,
    Path((project, table)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (admin, source) = authorize(&projects, &headers, &project).await?;
        let schema = projects
            .schema(&project)
            .await
            .map_err(|_| ApiError::unknown_project(&project))?;
        let tables = admin.list_tables(&source, &project, WORKER_TIMEOUT).await?;
        let enabled = tables
            .iter()
            .any(|t| t.schema == schema && t.table == table);
        Ok(json!({"schema": schema, "table": table, "enabled": enabled}))
    }
    .await;
    reply("get", &project, r)
}

/// `GET /v1/db/{project}/realtime/tables`.
pub(crate) async fn list(
    State(projects): State<Projects>,
    Path(project): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (admin, source) = authorize(&projects, &headers, &project).await?;
        let tables = admin.list_tables(&source, &project, WORKER_TIMEOUT).await?;
        serde_json::to_value(tables).map_err(|e| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        })
    }
    .await;
    reply("list", &project, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies() {
        assert_eq!(parse_enabled(br#"{"enabled": true}"#).ok(), Some(true));
        assert_eq!(
            parse_enabled(br#"{"enabled": false, "x": 1}"#).ok(),
            Some(false)
        );
        for bad in [
            &b"not json"[..],
            br#"{"enabled": "true"}"#,
            br#"{"enabled": 1}"#,
            br#"{}"#,
            br#"[true]"#,
            b"",
        ] {
            let e = parse_enabled(bad).err().map(|e| (e.status, e.error));
            assert_eq!(
                e,
                Some((StatusCode::UNPROCESSABLE_ENTITY, "invalid_body")),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
