//! Applying project changes on this front: a management notice refreshes the project
//! directory at once, and the directory's events end what may no longer stay — every
//! socket of a deleted or suspended project, the sockets with a public channel of a
//! project made private-only — each channel told first with a `system` error; and the
//! SSE streams of a deleted or suspended project (a `system` event, then the end). When a
//! project's keys change, every socket and SSE stream of it verifies its sessions' tokens
//! again and ends those no key accepts any more; after missed events, every project's do.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::broadcast::error::RecvError;
use tokio_util::sync::CancellationToken;
use walcast_protocol::server::{self, SystemStatus};

use crate::connection::{ConnHandle, Connections, Out, Topics};
use crate::projects::{ProjectEvent, Projects};
use crate::sse::SseHub;
use crate::telemetry;

/// Close code of a socket ended by a project change.
pub const CLOSE_PROJECT_CHANGED: u16 = 1000;

/// Refresh the directory on every notice of [`super::SUBJECT_PROJECTS_CHANGED`].
pub(crate) async fn notice_loop(
    projects: Projects,
    mut notices: walcast_bus::Subscription,
    cancel: CancellationToken,
) {
    while crate::cluster::listen::next_message(&mut notices, &cancel, "project notices")
        .await
        .is_some()
    {
        projects.refresh_now().await;
    }
}

/// End what the directory's events say may no longer stay, until `cancel` fires.
pub(crate) async fn events_loop(
    projects: Projects,
    (topics, connections, sse): (Arc<Topics>, Arc<Connections>, Arc<SseHub>),
    cancel: CancellationToken,
) {
    let mut events = projects.events();
    loop {
        let e = tokio::select! {
            _ = cancel.cancelled() => return,
            e = events.recv() => e,
        };
        match e {
            Ok(ProjectEvent::KeysChanged(p)) => recheck(&connections, &sse, Some(&p)),
            Ok(e) => {
                end(&topics, &connections, &e);
                if !e.public_only() {
                    let n = sse.end_project(e.project(), e.message());
                    tracing::info!(
                        project = e.project(),
                        streams = n,
                        "SSE streams ended by a project change"
                    );
                }
            }
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(
                    missed = n,
                    "project events missed: every session is checked again"
                );
                recheck(&connections, &sse, None);
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// Make the sockets and SSE streams of `project` (`None`: every project's) verify their
/// tokens again.
fn recheck(connections: &Connections, sse: &SseHub, project: Option<&str>) {
    let sockets = connections.recheck(project);
    let streams = sse.recheck(project);
    tracing::info!(
        project,
        sockets,
        streams,
        "project keys changed: sessions check their tokens again"
    );
}

/// Tell each affected channel (`system` error, `phx_close`), then close its socket —
/// and, for a deleted or suspended project, every other socket of it.
fn end(topics: &Topics, connections: &Connections, e: &ProjectEvent) {
    let mut sockets: HashMap<u64, Arc<ConnHandle>> = HashMap::new();
    for c in topics.of_project(e.project(), e.public_only()) {
        let system = server::system(None, &c.topic, "system", SystemStatus::Error, e.message());
        for f in [system, server::phx_close(None, &c.topic)] {
            if let Some(out) = Out::frame(&f, c.vsn) {
                c.conn.push(out);
            }
        }
        sockets.insert(c.conn.id, c.conn.clone());
    }
    if !e.public_only() {
        for c in connections.of_project(e.project()) {
            sockets.insert(c.id, c);
        }
    }
    let reason = e.message();
    for c in sockets.values() {
        c.close_with(CLOSE_PROJECT_CHANGED, reason);
    }
    metrics::counter!(telemetry::PROJECT_SOCKETS_ENDED).increment(sockets.len() as u64);
    tracing::info!(project = e.project(), event = ?e, sockets = sockets.len(), "sockets ended by a project change");
}
