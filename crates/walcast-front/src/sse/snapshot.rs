//! `?snapshot=true`: the rows the subscriber may see, then the changes, on one stream.
//!
//! The subscription is registered first; then, under the channel's lock, the stream
//! takes its live receiver and the changes its history holds; then the cdc-worker reads
//! the rows as the subscriber ([`walcast_bus::admin::AdminRequest::SnapshotRows`]) and
//! tells the snapshot and WAL position of the read (the [`Cut`]). Every change that can
//! follow is either held (history) or queued (the live receiver, bounded by
//! `OUTBOUND_QUEUE`: a reader that falls further behind while the rows are read gets
//! `event: error` as any slow reader), and each is sent only if the rows lack it
//! ([`Cut::delivers`]). No change falls between the rows and the changes, none is sent
//! twice.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::Response;
use serde_json::Value;
use tokio::sync::broadcast;
use walcast_bus::admin::{AdminError, AdminErrorKind, AdminRequest, SnapshotRows};
use walcast_core::pg_snapshot::{Cut, PgSnapshot};

use super::events::{after_cut, snapshot_start};
use super::stream::{Item, Pos, SseChannel};
use super::SseHub;
use crate::reply::error_response;
use crate::telemetry;

/// What a snapshot stream starts with: its first events (`ready`, the rows,
/// `snapshot_done`, the held changes the rows lack), its live receiver, the last
/// position sent, and the cut that filters the live changes.
pub(super) type Start = (
    VecDeque<Event>,
    broadcast::Receiver<Arc<Item>>,
    Option<Pos>,
    Cut,
);

fn refuse(outcome: &'static str, status: StatusCode, message: &str) -> Response {
    metrics::counter!(telemetry::SSE_SNAPSHOTS, "outcome" => outcome).increment(1);
    error_response(status, message)
}

fn refusal(e: &AdminError) -> Response {
    let (outcome, status) = match e.kind {
        AdminErrorKind::TooLarge => ("too_large", StatusCode::PAYLOAD_TOO_LARGE),
        AdminErrorKind::Refused => ("refused", StatusCode::FORBIDDEN),
        AdminErrorKind::UnknownTable
        | AdminErrorKind::InvalidRequest
        | AdminErrorKind::UnknownProject => ("refused", StatusCode::BAD_REQUEST),
        AdminErrorKind::Unavailable => ("unavailable", StatusCode::SERVICE_UNAVAILABLE),
        _ => ("error", StatusCode::INTERNAL_SERVER_ERROR),
    };
    refuse(outcome, status, &format!("snapshot: {}", e.message))
}

/// Start a snapshot stream on `chan` (subscribed already) for a subscriber of
/// `project` with `claims`. `Err`: the HTTP refusal (the stream never starts).
pub(super) async fn start(
    hub: &SseHub,
    chan: &SseChannel,
    name: &str,
    claims: &Value,
) -> Result<Start, Response> {
    let b = &chan.binding;
    let Some(table) = b.table.clone().filter(|t| t != "*") else {
        return Err(refuse(
            "refused",
            StatusCode::BAD_REQUEST,
            "snapshot=true needs one table (`table`)",
        ));
    };
    let project = chan.key.project.as_str();
    let (Some(admin), Some(source)) = (hub.projects.admin(), hub.projects.source_of(project))
    else {
        return Err(refuse(
            "unavailable",
            StatusCode::SERVICE_UNAVAILABLE,
            "snapshot: the cdc-worker cannot be asked",
        ));
    };
    let (mut first, rx, held) = snapshot_start(chan, name);
    let req = AdminRequest::SnapshotRows {
        project: project.to_string(),
        claims: claims.clone(),
        schema: b.schema.clone(),
        table,
        filter: b.filter.clone(),
        select: b.select.clone(),
        max_rows: hub.cfg.sse_snapshot_max_rows,
        max_bytes: hub.cfg.sse_snapshot_max_bytes,
    };
    let rows = admin
        .snapshot_rows(&source, req, hub.cfg.sse_snapshot_timeout)
        .await
        .map_err(|e| refusal(&e))?;
    let snapshot = PgSnapshot::parse(&rows.snapshot).map_err(|e| {
        refuse(
            "error",
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("snapshot: {e}"),
        )
    })?;
    let cut = Cut {
        snapshot,
        lsn: rows.lsn,
    };
    first.extend(row_events(chan, &rows));
    let (held_events, last) = after_cut(&held, &cut);
    first.extend(held_events);
    metrics::counter!(telemetry::SSE_SNAPSHOTS, "outcome" => "ok").increment(1);
    metrics::counter!(telemetry::SSE_SNAPSHOT_ROWS).increment(rows.rows.len() as u64);
    Ok((first, rx, last, cut))
}

/// `event: snapshot` per row (no `id`: see the module docs of [`super`]), then
/// `event: snapshot_done`.
fn row_events(chan: &SseChannel, rows: &SnapshotRows) -> Vec<Event> {
    let b = &chan.binding;
    let columns = serde_json::to_string(&rows.columns).unwrap_or_else(|_| "[]".into());
    let head = format!(
        "{{\"ids\":[{}],\"data\":{{\"schema\":{},\"table\":{},\"type\":\"SNAPSHOT\",\"columns\":{columns},\"record\":",
        b.id,
        Value::from(b.schema.as_str()),
        Value::from(b.table.as_deref().unwrap_or_default()),
    );
    let mut events: Vec<Event> = rows
        .rows
        .iter()
        .map(|r| {
            Event::default()
                .event("snapshot")
                .data(format!("{head}{r}}}}}"))
        })
        .collect();
    let done = format!(
        "{{\"rows\":{},\"lsn\":{}}}",
        rows.rows.len(),
        Value::from(rows.lsn.to_string())
    );
    events.push(Event::default().event("snapshot_done").data(done));
    events
}
