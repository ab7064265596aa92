//! The front's open connections: the WebSocket connections' handles (to close them when
//! draining), the counts of connections, channels and SSE streams, the
//! `max_connections` slots they share, and whether the front is draining.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::queue::{ConnHandle, CLOSE_GOING_AWAY};
use crate::telemetry;

/// Open WebSocket connections by id, each with its project.
type OpenConns = HashMap<u64, (Arc<ConnHandle>, Arc<str>)>;

pub(crate) struct Connections {
    /// WebSocket connections and SSE streams this front accepts at once.
    max: usize,
    connections: AtomicUsize,
    channels: AtomicUsize,
    sse_streams: AtomicUsize,
    /// Shutting down: new sockets and streams are refused, open ones are being closed.
    draining: AtomicBool,
    /// Open WebSocket connections and their projects, to close them one by one when
    /// draining, or a project's when it is deleted or suspended.
    conns: Mutex<OpenConns>,
    next_id: AtomicU64,
}

/// The counts `/health` reports.
pub(crate) struct Counts {
    pub connections: usize,
    pub channels: usize,
    pub sse_streams: usize,
}

impl Connections {
    /// `max`: WebSocket connections and SSE streams together (`max_connections`).
    pub(crate) fn new(max: usize) -> Connections {
        Connections {
            max,
            connections: AtomicUsize::new(0),
            channels: AtomicUsize::new(0),
            sse_streams: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            conns: Mutex::default(),
            next_id: AtomicU64::new(1),
        }
    }

    /// A front-unique id for a connection, a channel or an SSE stream.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn counts(&self) -> Counts {
        Counts {
            connections: self.connections.load(Ordering::Relaxed),
            channels: self.channels.load(Ordering::Relaxed),
            sse_streams: self.sse_streams.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, OpenConns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A WebSocket connection of `project` opened (drain closes it) …
    pub(crate) fn opened(&self, handle: &Arc<ConnHandle>, project: &str) {
        self.conns()
            .insert(handle.id, (handle.clone(), Arc::from(project)));
    }

    /// Make each open WebSocket connection of `project` (`None`: of every project)
    /// verify its channels' tokens again; how many were told.
    pub(crate) fn recheck(&self, project: Option<&str>) -> usize {
        let conns = self.conns();
        let of = conns
            .values()
            .filter(|(_, p)| project.is_none_or(|want| &**p == want));
        of.map(|(c, _)| c.recheck.notify_one()).count()
    }

    /// The open WebSocket connections of a project.
    pub(crate) fn of_project(&self, project: &str) -> Vec<Arc<ConnHandle>> {
        self.conns()
            .values()
            .filter(|(_, p)| &**p == project)
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// … and closed.
    pub(crate) fn closed(&self, handle: &ConnHandle) {
        self.conns().remove(&handle.id);
    }

    /// A channel was joined …
    pub(crate) fn channel_joined(&self) {
        self.channels.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!(telemetry::CHANNELS).increment(1.0);
    }

    /// … and closed.
    pub(crate) fn channel_closed(&self) {
        self.channels.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(telemetry::CHANNELS).decrement(1.0);
    }

    /// Refuse new sockets and streams, then close the open sockets one by one (1001,
    /// "server draining"), spread evenly over the first four fifths of `window`. Returns
    /// when the last is closed.
    pub(crate) async fn drain(&self, window: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        let conns: Vec<Arc<ConnHandle>> = self.conns().values().map(|(c, _)| c.clone()).collect();
        tracing::info!(
            connections = conns.len(),
            window_secs = window.as_secs_f64(),
            "draining: closing sockets over the window"
        );
        let spread = window.mul_f64(0.8);
        let start = tokio::time::Instant::now();
        let n = conns.len().max(1) as f64;
        for (i, c) in conns.iter().enumerate() {
            tokio::time::sleep_until(start + spread.mul_f64(i as f64 / n)).await;
            c.close_with(CLOSE_GOING_AWAY, "server draining");
        }
    }
}

/// One of the `max_connections` slots, released on drop.
pub(crate) struct ConnSlot {
    owner: Arc<Connections>,
}

impl ConnSlot {
    pub(crate) fn acquire(owner: &Arc<Connections>) -> Option<ConnSlot> {
        let prev = owner.connections.fetch_add(1, Ordering::AcqRel);
        if prev + owner.sse_streams.load(Ordering::Acquire) >= owner.max {
            owner.connections.fetch_sub(1, Ordering::AcqRel);
            telemetry::limit("connections");
            return None;
        }
        metrics::gauge!(telemetry::CONNECTIONS).increment(1.0);
        Some(ConnSlot {
            owner: owner.clone(),
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.owner.connections.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(telemetry::CONNECTIONS).decrement(1.0);
    }
}

/// One of the `max_connections` slots taken by an SSE stream (counted in `sse_streams`),
/// released on drop. Taken before the stream subscribes, so requests in flight count too.
pub(crate) struct SseSlot {
    owner: Arc<Connections>,
}

impl SseSlot {
    pub(crate) fn acquire(owner: &Arc<Connections>) -> Option<SseSlot> {
        let prev = owner.sse_streams.fetch_add(1, Ordering::AcqRel);
        if prev + owner.connections.load(Ordering::Acquire) >= owner.max {
            owner.sse_streams.fetch_sub(1, Ordering::AcqRel);
            telemetry::limit("connections");
            return None;
        }
        metrics::gauge!(telemetry::SSE_STREAMS).increment(1.0);
        Some(SseSlot {
            owner: owner.clone(),
        })
    }
}

impl Drop for SseSlot {
    fn drop(&mut self) {
        self.owner.sse_streams.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(telemetry::SSE_STREAMS).decrement(1.0);
    }
}
