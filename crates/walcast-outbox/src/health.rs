//! The relay's part of `/health`.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

/// Shared between the relay and the health endpoint.
#[derive(Debug, Default)]
pub struct OutboxHealth {
    published: AtomicU64,
    quarantined: AtomicU64,
    quarantine_size: AtomicI64,
    /// Milliseconds since the epoch of the oldest unacknowledged event's commit (0: none).
    oldest_pending_ms: AtomicI64,
    queued_events: AtomicU64,
    queued_bytes: AtomicU64,
    last_error: Mutex<Option<String>>,
}

/// The JSON of `/health`'s `outbox`.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct OutboxHealthReport {
    pub published_total: u64,
    pub quarantined_total: u64,
    /// Rows in the quarantine table when last read (-1: not read yet).
    pub quarantine_size: i64,
    /// Age of the oldest event not yet acknowledged by JetStream (0: none waits).
    pub oldest_unpublished_ms: i64,
    /// Events handed to the relay and not yet acknowledged (sent or queued).
    pub queued_events: u64,
    pub queued_bytes: u64,
    pub last_error: Option<String>,
}

impl OutboxHealth {
    pub fn new() -> OutboxHealth {
        let h = OutboxHealth::default();
        h.quarantine_size.store(-1, Ordering::Relaxed);
        h
    }

    pub(crate) fn published(&self, n: u64) {
        self.published.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn quarantined(&self) {
        self.quarantined.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_quarantine_size(&self, n: i64) {
        self.quarantine_size.store(n, Ordering::Relaxed);
    }

    pub(crate) fn set_oldest_pending(&self, commit_ms: Option<i64>) {
        self.oldest_pending_ms
            .store(commit_ms.unwrap_or(0), Ordering::Relaxed);
    }

    pub(crate) fn set_queued(&self, events: u64, bytes: u64) {
        self.queued_events.store(events, Ordering::Relaxed);
        self.queued_bytes.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn set_error(&self, e: Option<String>) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = e;
    }

    pub fn report(&self, now_ms: i64) -> OutboxHealthReport {
        let oldest = self.oldest_pending_ms.load(Ordering::Relaxed);
        OutboxHealthReport {
            published_total: self.published.load(Ordering::Relaxed),
            quarantined_total: self.quarantined.load(Ordering::Relaxed),
            quarantine_size: self.quarantine_size.load(Ordering::Relaxed),
            oldest_unpublished_ms: if oldest == 0 {
                0
            } else {
                (now_ms - oldest).max(0)
            },
            queued_events: self.queued_events.load(Ordering::Relaxed),
            queued_bytes: self.queued_bytes.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}
