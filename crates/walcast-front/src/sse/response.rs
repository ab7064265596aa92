//! What an SSE response sends: the first events of a reader (`ready`, a `gap`, the
//! history it missed), then live changes until the token expires or no key accepts it any
//! more (its project's keys changed), the subscription ends or the reader falls behind.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event;
use serde_json::Value;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use walcast_core::pg_snapshot::Cut;

use super::snapshot::Unsent;
use super::stream::{Item, Pos, Reader, SseChannel};
use crate::auth::now_secs;
use crate::connection::open::SseSlot;
use crate::limits::usage::UserSlot;
use crate::projects::Projects;
use crate::telemetry;

/// The stream's first events (`ready`, a `gap` if the history no longer reaches back to
/// `resume`, then what it holds after `resume`), the live receiver and the last position
/// sent, taken together under the channel's lock so nothing falls between them.
pub(super) fn first_events(
    chan: &SseChannel,
    name: &str,
    resume: Option<Pos>,
) -> (VecDeque<Event>, broadcast::Receiver<Arc<Item>>, Option<Pos>) {
    let mut first = VecDeque::from([chan.ready_event(name)]);
    let g = chan.lock();
    let rx = chan.live.subscribe();
    let mut last = resume;
    if let Some(from) = resume {
        if g.evicted.is_some_and(|ev| ev > from) {
            let oldest = g.ring.front().map_or(String::new(), |i| i.id.clone());
            first.push_back(Event::default().event("gap").data(format!(
                "{{\"reason\":\"history exhausted\",\"oldest\":{}}}",
                Value::from(oldest)
            )));
        }
        for item in g.ring.iter().filter(|i| i.pos > from) {
            first.push_back(item.event());
            last = Some(item.pos);
        }
    }
    (first, rx, last)
}

pub(super) struct StreamState {
    pub first: VecDeque<Event>,
    /// A snapshot's rows and what follows them, sent after `first`.
    pub rows: Option<Unsent>,
    pub rx: broadcast::Receiver<Arc<Item>>,
    pub last: Option<Pos>,
    pub expires: Instant,
    pub exp: i64,
    /// Its project and acting token, verified again on each change of `recheck`.
    pub session: (Projects, String, String),
    pub recheck: tokio::sync::watch::Receiver<u64>,
    pub cancel: CancellationToken,
    pub done: bool,
    /// A snapshot stream: changes its rows already hold are dropped (see
    /// [`walcast_core::pg_snapshot::Cut`]), until the first change after the cut.
    pub cut: Option<Cut>,
    pub _guard: Reader,
    /// Its `max_connections` slot and its place among its project's connected users
    /// (whose counters count what it sends).
    pub slot: (SseSlot, UserSlot),
}

/// A `system` error event (the stream ends after it).
fn system_error(message: &str) -> Event {
    let data = format!(
        "{{\"extension\":\"system\",\"status\":\"error\",\"message\":{}}}",
        Value::from(message)
    );
    Event::default().event("system").data(data)
}

pub(super) async fn next_event(
    mut st: StreamState,
) -> Option<(Result<Event, Infallible>, StreamState)> {
    if let Some(ev) = st.first.pop_front() {
        return Some((Ok(ev), st));
    }
    if let Some(ev) = st.rows.as_mut().and_then(|r| r.next_event()) {
        return Some((Ok(ev), st));
    }
    st.rows = None; // all sent: their budget is given back
    if st.done {
        return None;
    }
    loop {
        tokio::select! {
            _ = st.cancel.cancelled() => return None,
            _ = tokio::time::sleep_until(st.expires) => {
                st.done = true;
                let msg = format!("Token has expired {} seconds ago", (now_secs() - st.exp).max(0));
                return Some((Ok(system_error(&msg)), st));
            }
            r = st.recheck.changed() => {
                let (projects, project, token) = &st.session;
                let checked = r.map_err(|_| None).and_then(|()| {
                    projects.check_session(project, token).map_err(Some)
                });
                match checked {
                    Ok(()) => continue,
                    Err(None) => return None,
                    Err(Some(e)) => {
                        telemetry::error("token_revoked");
                        st.done = true;
                        return Some((Ok(system_error(&e.to_string())), st));
                    }
                }
            }
            r = st.rx.recv() => match r {
                Ok(item) if item.end => {
                    st.done = true;
                    return Some((Ok(Event::default().event("system").data(&item.data)), st));
                }
                // A warning (`SseChannel::warn`, no position): the stream goes on.
                Ok(item) if item.id.is_empty() => {
                    return Some((Ok(Event::default().event("system").data(&item.data)), st));
                }
                Ok(item) => {
                    if st.last.is_some_and(|l| item.pos <= l) {
                        continue;
                    }
                    if let Some(cut) = &st.cut {
                        if !cut.delivers(item.pos.0, item.xid) {
                            metrics::counter!(telemetry::SSE_SNAPSHOT_SKIPPED).increment(1);
                            continue;
                        }
                        if item.pos.0 > cut.lsn {
                            st.cut = None;
                        }
                    }
                    st.last = Some(item.pos);
                    let counts = st.slot.1.counts();
                    counts.messages_out.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    counts.bytes_out.fetch_add(item.data.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    return Some((Ok(item.event()), st));
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    st.done = true;
                    metrics::counter!(telemetry::SLOW_CONSUMERS).increment(1);
                    let data = format!("{{\"message\":\"slow consumer: {n} events dropped\"}}");
                    return Some((Ok(Event::default().event("error").data(data)), st));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}
