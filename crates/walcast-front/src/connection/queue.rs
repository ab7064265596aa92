//! A connection's bounded queue ([`ConnHandle`]): every frame for its client goes through
//! it to the socket's writer, and so does the way the connection ends.
//!
//! Producers never wait: when the queue is full the connection is closed as a slow
//! consumer (close code 1013) and counted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::mpsc;
use walcast_protocol::{Frame, Vsn};

use super::socket::{Ending, Kill, Link, Out};
use crate::limits::usage::ProjectCounts;
use crate::telemetry;

/// Close code: server going away (shutdown).
pub const CLOSE_GOING_AWAY: u16 = 1001;
/// Close code: a frame over `max_frame_bytes`.
pub const CLOSE_TOO_BIG: u16 = 1009;
/// Close code for a slow consumer ("try again later").
pub const CLOSE_SLOW_CONSUMER: u16 = 1013;
/// Close reason for a slow consumer.
pub const REASON_SLOW_CONSUMER: &str = "slow consumer: outbound queue full";

/// The sending side of one connection.
pub(crate) struct ConnHandle {
    pub id: u64,
    tx: mpsc::Sender<Out>,
    /// Set to close the connection (reason in `close`).
    pub kill: Kill,
    close: OnceLock<(u16, String)>,
    /// Its project's counters, once it counts as a connected user (its first join).
    usage: OnceLock<Arc<ProjectCounts>>,
    /// The client sent a Close frame (answered by the socket, not by us).
    peer_closed: AtomicBool,
    /// Set when its project's keys changed: its read loop verifies each channel's token
    /// again (a permit is kept if the loop is busy meanwhile).
    pub recheck: tokio::sync::Notify,
}

impl ConnHandle {
    pub(crate) fn new(id: u64, capacity: usize) -> (Arc<ConnHandle>, mpsc::Receiver<Out>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let h = ConnHandle {
            id,
            tx,
            kill: Kill::default(),
            close: OnceLock::new(),
            usage: OnceLock::new(),
            peer_closed: AtomicBool::new(false),
            recheck: tokio::sync::Notify::new(),
        };
        (Arc::new(h), rx)
    }

    /// Queue a message; false if the connection is gone or was just closed as too slow.
    pub(crate) fn push(&self, out: Out) -> bool {
        if let Some(c) = self.usage.get() {
            c.messages_out.fetch_add(1, Ordering::Relaxed);
            c.bytes_out.fetch_add(out.len() as u64, Ordering::Relaxed);
        }
        self.push_reply(out)
    }

    /// Queue a protocol reply (a Pong, the answer to a Close), not counted as a message.
    fn push_reply(&self, out: Out) -> bool {
        match self.tx.try_send(out) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.slow_consumer();
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Encode and queue a control frame.
    pub(crate) fn push_frame(&self, f: &Frame, vsn: Vsn) -> bool {
        match Out::frame(f, vsn) {
            Some(o) => self.push(o),
            None => false,
        }
    }

    /// Count what goes through it for its project from now on.
    pub(crate) fn count_for(&self, counts: Arc<ProjectCounts>) {
        let _ = self.usage.set(counts);
    }

    /// Its project's counters, once it counts as a connected user.
    pub(crate) fn usage(&self) -> Option<&Arc<ProjectCounts>> {
        self.usage.get()
    }

    pub(crate) fn slow_consumer(&self) {
        if self
            .close
            .set((CLOSE_SLOW_CONSUMER, REASON_SLOW_CONSUMER.to_string()))
            .is_ok()
        {
            metrics::counter!(telemetry::SLOW_CONSUMERS).increment(1);
            tracing::info!(conn = self.id, "closing slow consumer");
        }
        self.kill.cancel();
    }

    /// Close the connection with this code and reason (the first reason set wins).
    pub(crate) fn close_with(&self, code: u16, reason: &str) {
        let _ = self.close.set((code, reason.to_string()));
        self.kill.cancel();
    }

    /// The client sent a Close frame: the connection ends, answered with the client's code.
    pub(crate) fn peer_closed(&self) {
        self.peer_closed.store(true, Ordering::Relaxed);
        self.kill.cancel();
    }

    pub(crate) fn is_peer_closed(&self) -> bool {
        self.peer_closed.load(Ordering::Relaxed)
    }

    pub(crate) fn close_reason(&self) -> Option<(u16, String)> {
        self.close.get().cloned()
    }
}

impl Link for ConnHandle {
    fn reply(&self, out: Out) -> bool {
        self.push_reply(out)
    }

    fn killed(&self) -> &Kill {
        &self.kill
    }

    fn ending(&self) -> Ending {
        if self.is_peer_closed() {
            return Ending::Answered;
        }
        let (code, reason) = self.close_reason().unwrap_or((1000, String::new()));
        Ending::Close {
            flush: code != CLOSE_SLOW_CONSUMER,
            code,
            reason,
        }
    }
}
