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
//!
//! Over NATS the rows come in parts ([`walcast_bus::admin::parts`]), all of them within
//! `SSE_SNAPSHOT_TIMEOUT_MS`, each checked (its request's nonce, its sequence number, the
//! totals and digest at the end) and counted against the front's budget of held rows
//! ([`SnapshotBudget`]) before it is kept: a snapshot is complete or refused before its
//! stream starts, never cut short. The rows stay counted until the stream has sent them
//! ([`Unsent`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::Response;
use serde_json::Value;
use tokio::sync::{broadcast, OwnedSemaphorePermit, Semaphore};
use walcast_bus::admin::{AdminError, AdminErrorKind, AdminRequest, SnapshotRows};
use walcast_core::pg_snapshot::{Cut, PgSnapshot};

use super::stream::{Item, Pos, SseChannel};
use super::SseHub;
use crate::config::{FrontConfig, SSE_SNAPSHOTS_HELD, SSE_SNAPSHOT_ROW_OVERHEAD};
use crate::reply::error_response;
use crate::telemetry;

/// What a snapshot stream starts with: its first event (`ready`), the rows and what
/// follows them ([`Unsent`]), its live receiver, the last position sent, and the cut that
/// filters the live changes.
pub(super) type Start = (
    VecDeque<Event>,
    Unsent,
    broadcast::Receiver<Arc<Item>>,
    Option<Pos>,
    Cut,
);

/// The front's budget of snapshot rows held (received, not yet sent): room for
/// [`SSE_SNAPSHOTS_HELD`] snapshots of the largest size, each row counted with its bytes
/// and [`SSE_SNAPSHOT_ROW_OVERHEAD`].
pub(crate) struct SnapshotBudget(Arc<Semaphore>);

impl SnapshotBudget {
    pub(crate) fn new(cfg: &FrontConfig) -> SnapshotBudget {
        let one = cfg.sse_snapshot_max_bytes as usize
            + cfg.sse_snapshot_max_rows as usize * SSE_SNAPSHOT_ROW_OVERHEAD;
        let all = one
            .saturating_mul(SSE_SNAPSHOTS_HELD)
            .min(Semaphore::MAX_PERMITS);
        SnapshotBudget(Arc::new(Semaphore::new(all)))
    }

    /// Count `rows` rows of `bytes` bytes into `held`; refused (`QueueFull`) when the
    /// budget has no room for them.
    fn admit(
        &self,
        held: &Mutex<Option<OwnedSemaphorePermit>>,
        rows: usize,
        bytes: usize,
    ) -> Result<(), AdminError> {
        let cost = bytes.saturating_add(rows.saturating_mul(SSE_SNAPSHOT_ROW_OVERHEAD));
        let permit = u32::try_from(cost)
            .ok()
            .and_then(|n| self.0.clone().try_acquire_many_owned(n).ok())
            .ok_or_else(|| {
                AdminError::new(
                    AdminErrorKind::QueueFull,
                    "this front holds as many snapshot rows as it may; try again later",
                )
            })?;
        let mut g = held.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(p) => p.merge(permit),
            None => *g = Some(permit),
        }
        Ok(())
    }
}

/// A snapshot stream's rows not yet sent, then `snapshot_done` and the held changes the
/// rows lack; its rows' share of the [`SnapshotBudget`], given back once all are sent.
pub(crate) struct Unsent {
    /// Each row event's data up to its record.
    head: String,
    rows: std::vec::IntoIter<String>,
    after: VecDeque<Event>,
    _budget: Option<OwnedSemaphorePermit>,
}

impl Unsent {
    /// The next event, or `None` once everything was sent.
    pub(super) fn next_event(&mut self) -> Option<Event> {
        match self.rows.next() {
            Some(r) => Some(
                Event::default()
                    .event("snapshot")
                    .data(format!("{}{r}}}}}", self.head)),
            ),
            None => self.after.pop_front(),
        }
    }
}

/// A snapshot stream's start: `ready`, the live receiver, and every change the history
/// holds (taken together under the channel's lock); the rows are read after this, and
/// these changes are then kept or dropped by the read's cut ([`after_cut`]).
fn snapshot_start(
    chan: &SseChannel,
    name: &str,
) -> (
    VecDeque<Event>,
    broadcast::Receiver<Arc<Item>>,
    Vec<Arc<Item>>,
) {
    let first = VecDeque::from([chan.ready_event(name)]);
    let g = chan.lock();
    let rx = chan.live.subscribe();
    let held = g.ring.iter().cloned().collect();
    (first, rx, held)
}

/// The changes of `held` a reader of rows read at `cut` lacks, as events, and the
/// position of the last one.
fn after_cut(held: &[Arc<Item>], cut: &Cut) -> (Vec<Event>, Option<Pos>) {
    let mut last = None;
    let mut events = Vec::new();
    for item in held {
        if cut.delivers(item.pos.0, item.xid) {
            events.push(item.event());
            last = Some(item.pos);
        } else {
            metrics::counter!(telemetry::SSE_SNAPSHOT_SKIPPED).increment(1);
        }
    }
    (events, last)
}

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
        AdminErrorKind::QueueFull => ("busy", StatusCode::SERVICE_UNAVAILABLE),
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
    let (first, rx, held_changes) = snapshot_start(chan, name);
    let req = AdminRequest::SnapshotRows {
        project: project.to_string(),
        claims: claims.clone(),
        schema: b.schema.clone(),
        table,
        filter: b.filter.clone(),
        select: b.select.clone(),
        max_rows: hub.cfg.sse_snapshot_max_rows,
        max_bytes: hub.cfg.sse_snapshot_max_bytes,
        nonce: None,
    };
    let held = Mutex::new(None);
    let mut admit = |n: usize, bytes: usize| hub.snapshot_budget.admit(&held, n, bytes);
    let rows = admin
        .snapshot_rows(&source, req, hub.cfg.sse_snapshot_timeout, &mut admit)
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
    metrics::counter!(telemetry::SSE_SNAPSHOTS, "outcome" => "ok").increment(1);
    metrics::counter!(telemetry::SSE_SNAPSHOT_ROWS).increment(rows.rows.len() as u64);
    let (held_events, last) = after_cut(&held_changes, &cut);
    let mut unsent = unsent(chan, rows);
    unsent.after.extend(held_events);
    unsent._budget = held.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok((first, unsent, rx, last, cut))
}

/// `event: snapshot` per row (no `id`: see the module docs of [`super`]), then
/// `event: snapshot_done`.
fn unsent(chan: &SseChannel, rows: SnapshotRows) -> Unsent {
    let b = &chan.binding;
    let columns = serde_json::to_string(&rows.columns).unwrap_or_else(|_| "[]".into());
    let head = format!(
        "{{\"ids\":[{}],\"data\":{{\"schema\":{},\"table\":{},\"type\":\"SNAPSHOT\",\"columns\":{columns},\"record\":",
        b.id,
        Value::from(b.schema.as_str()),
        Value::from(b.table.as_deref().unwrap_or_default()),
    );
    let done = format!(
        "{{\"rows\":{},\"lsn\":{}}}",
        rows.rows.len(),
        Value::from(rows.lsn.to_string())
    );
    Unsent {
        head,
        rows: rows.rows.into_iter(),
        after: VecDeque::from([Event::default().event("snapshot_done").data(done)]),
        _budget: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_holds_four_largest_snapshots_and_is_given_back() {
        let cfg = FrontConfig {
            sse_snapshot_max_rows: 10,
            sse_snapshot_max_bytes: 1000,
            ..FrontConfig::default()
        };
        let budget = SnapshotBudget::new(&cfg);
        let largest = |held: &Mutex<Option<OwnedSemaphorePermit>>| {
            // In two parts, as over NATS.
            budget.admit(held, 5, 500)?;
            budget.admit(held, 5, 500)
        };
        let held: Vec<Mutex<Option<OwnedSemaphorePermit>>> =
            (0..SSE_SNAPSHOTS_HELD).map(|_| Mutex::new(None)).collect();
        for h in &held {
            largest(h).expect("room for four");
        }
        let fifth = Mutex::new(None);
        let e = budget.admit(&fifth, 1, 1).unwrap_err();
        assert_eq!(e.kind, AdminErrorKind::QueueFull);
        // One stream sent its rows: room again.
        drop(held.into_iter().next());
        largest(&fifth).expect("room once one was sent");
    }
}
