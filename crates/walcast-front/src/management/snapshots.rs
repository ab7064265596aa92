//! Snapshots of a project's tables (README "Change streams"): the management API's side
//! of `walcast snapshot start|status|cancel`. The front checks the operator key, the ids
//! and the body's shape, then asks the leader of the project's source
//! ([`walcast_bus::admin::snapshots`]), which runs the CLI's own checks (change stream on,
//! filter parsed and fitted to the columns, the queue bound) and scopes every read and
//! cancel to the project: another project's snapshot id is answered 404.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};
use walcast_bus::admin::{AdminClient, AdminRequest, SnapshotRecord, MAX_SNAPSHOT_LIST};

use super::{answer, authorize, body_object, fields, opt_str, Management, St, WORKER_TIMEOUT};
use crate::reply::ApiError;

/// The largest body of a snapshot start, in bytes (its table name and filter are bounded
/// again, more tightly, where they are used).
pub const MAX_BODY: usize = 16 * 1024;

/// How many snapshots a list shows when not told.
pub const DEFAULT_LIST: u32 = 100;

/// The fields a start accepts (checked against the OpenAPI file by a test).
pub const START_FIELDS: [&str; 2] = ["table", "where"];

/// A snapshot as the API shows it (`where`: its filter, as it was asked; no resume key).
pub fn snapshot_view(s: &SnapshotRecord) -> Value {
    json!({
        "id": s.id,
        "project": s.project,
        "schema": s.schema,
        "table": s.table,
        "where": s.filter,
        "state": s.state,
        "rows_done": s.rows_done,
        "rows_estimate": s.rows_estimate,
        "chunks_done": s.chunks_done,
        "error": s.error,
    })
}

/// A project id of a snapshot route: as [`super::check_id`], and the default project too
/// (its change streams are the single-tenant deployment's).
fn check_project(id: &str) -> Result<(), ApiError> {
    match id == crate::auth::DEFAULT_PROJECT {
        true => Ok(()),
        false => super::check_id(id),
    }
}

/// A snapshot id from the path: a positive whole number.
fn snapshot_id(text: &str) -> Result<i64, ApiError> {
    text.parse::<i64>()
        .ok()
        .filter(|n| *n > 0 && text.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_id",
                "a snapshot id is a positive whole number",
            )
        })
}

/// The source (database) of the project (its id already checked): the default one for
/// the default project, else the one the control database names (404 for an unknown
/// project).
async fn source_of(admin: &AdminClient, project: &str) -> Result<String, ApiError> {
    if project == crate::auth::DEFAULT_PROJECT {
        return Ok(walcast_bus::source::DEFAULT_SOURCE.to_string());
    }
    let req = AdminRequest::ProjectGet {
        id: project.to_string(),
    };
    Ok(admin.project(req, WORKER_TIMEOUT).await?.source)
}

fn unknown_snapshot(project: &str, id: i64) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "unknown_snapshot",
        format!("project {project:?} has no snapshot {id}"),
    )
}

/// `(table, where)` of a start's body.
fn start_body(body: &[u8]) -> Result<(String, String), ApiError> {
    if body.len() > MAX_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("the body is larger than {MAX_BODY} bytes"),
        ));
    }
    let o = body_object(body)?;
    fields(&o, &START_FIELDS)?;
    let table = opt_str(&o, "table")?.ok_or_else(|| {
        ApiError::invalid_body("\"table\" is required (`table` or `schema.table`)")
    })?;
    Ok((table, opt_str(&o, "where")?.unwrap_or_default()))
}

/// `POST /management/v1/projects/{id}/snapshots` `{"table", "where"?}`: 201 with the
/// queued snapshot.
pub(super) async fn start(
    State(m): St,
    Path(project): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_project(&project)?;
        let (table, filter) = start_body(&body)?;
        let source = source_of(&admin, &project).await?;
        let s = admin
            .snapshot_start(&source, &project, (&table, &filter), WORKER_TIMEOUT)
            .await?;
        tracing::info!(%project, id = s.id, %table, "snapshot queued through the management API");
        Ok(snapshot_view(&s))
    }
    .await;
    answer("snapshot_start", StatusCode::CREATED, r)
}

/// `GET /management/v1/projects/{id}/snapshots[?limit=n]`: newest first (at most
/// [`DEFAULT_LIST`] unless told, up to [`MAX_SNAPSHOT_LIST`]).
pub(super) async fn list(
    State(m): St,
    Path(project): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let admin = authorize(&m, &headers)?;
        check_project(&project)?;
        let limit = match query.get("limit") {
            None => DEFAULT_LIST,
            Some(l) => l
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=MAX_SNAPSHOT_LIST).contains(n))
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_limit",
                        format!("limit is a whole number from 1 to {MAX_SNAPSHOT_LIST}"),
                    )
                })?,
        };
        let source = source_of(&admin, &project).await?;
        let all = admin
            .snapshot_list(&source, &project, limit, WORKER_TIMEOUT)
            .await?;
        Ok(Value::Array(all.iter().map(snapshot_view).collect()))
    }
    .await;
    answer("snapshot_list", StatusCode::OK, r)
}

/// Snapshot `id` (the path's text) of `project`, cancelled first with `cancel`: the
/// snapshot and whether this cancelled it; 404 when the project has no such snapshot.
async fn one(
    m: &Management,
    headers: &HeaderMap,
    (project, id): (&str, &str),
    cancel: bool,
) -> Result<(SnapshotRecord, bool), ApiError> {
    let admin = authorize(m, headers)?;
    check_project(project)?;
    let id = snapshot_id(id)?;
    let source = source_of(&admin, project).await?;
    let (s, cancelled) = admin
        .snapshot_get(&source, project, (id, cancel), WORKER_TIMEOUT)
        .await?;
    let s = s.ok_or_else(|| unknown_snapshot(project, id))?;
    Ok((s, cancelled))
}

/// `GET /management/v1/projects/{id}/snapshots/{snapshot}`.
pub(super) async fn get_one(
    State(m): St,
    Path((project, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let r = one(&m, &headers, (&project, &id), false).await;
    answer(
        "snapshot_get",
        StatusCode::OK,
        r.map(|(s, _)| snapshot_view(&s)),
    )
}

/// `DELETE /management/v1/projects/{id}/snapshots/{snapshot}`: cancel a queued or
/// running snapshot (what was published stays published); 409 when it is over.
pub(super) async fn cancel(
    State(m): St,
    Path((project, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let r = match one(&m, &headers, (&project, &id), true).await {
        Ok((s, true)) => {
            tracing::info!(%project, id = s.id, "snapshot cancelled through the management API");
            Ok(snapshot_view(&s))
        }
        Ok((s, false)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "snapshot_over",
            format!(
                "snapshot {} is {}: only a queued or running snapshot can be cancelled",
                s.id, s.state
            ),
        )),
        Err(e) => Err(e),
    };
    answer("snapshot_cancel", StatusCode::OK, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_bodies_are_checked_before_anything_is_asked() {
        assert_eq!(snapshot_id("12").unwrap(), 12);
        for bad in [
            "0",
            "-1",
            "+1",
            "1 ",
            "1e3",
            "x",
            "",
            "99999999999999999999",
        ] {
            assert!(snapshot_id(bad).is_err(), "{bad:?}");
        }
        assert!(check_project("default").is_ok());
        assert!(check_project("a;b").is_err());
        let (t, w) = start_body(br#"{"table": "public.items", "where": "id=eq.1"}"#).unwrap();
        assert_eq!((t.as_str(), w.as_str()), ("public.items", "id=eq.1"));
        assert_eq!(start_body(br#"{"table": "t"}"#).unwrap().1, "");
        for bad in [
            &br#"{}"#[..],
            br#"{"table": 1}"#,
            br#"{"table": "t", "filter": "id=eq.1"}"#,
            br#"{"table": "t", "where": ["x"]}"#,
            br#"[]"#,
        ] {
            let e = start_body(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad:?}");
        }
        let big = format!(r#"{{"table": "{}"}}"#, "t".repeat(MAX_BODY));
        assert_eq!(
            start_body(big.as_bytes()).unwrap_err().status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
    }
}
