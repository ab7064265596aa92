//! Bounded outbound queues: one per connection, and a gate per channel.
//!
//! Every frame for a client goes through its connection's bounded queue. Producers never
//! wait: when the queue is full the connection is closed as a slow consumer (close code
//! 1013) and counted. A channel's gate holds fan-out frames while its join is in flight
//! and lets them out right after the join reply, so a change matched between the worker's
//! registration and the reply is neither lost nor delivered before the reply.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::ws::Utf8Bytes;
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{Frame, Vsn, WireMessage};

use crate::sink::{Change, Sink};
use crate::state::Shared;
use crate::telemetry;

/// Close code for a slow consumer ("try again later").
pub const CLOSE_SLOW_CONSUMER: u16 = 1013;
/// Close reason for a slow consumer.
pub const REASON_SLOW_CONSUMER: &str = "slow consumer: outbound queue full";

/// One message for the socket.
#[derive(Clone, Debug)]
pub(crate) enum Out {
    Text(Utf8Bytes),
    Binary(Bytes),
}

impl Out {
    /// Encode a server frame for a socket of version `vsn`.
    pub(crate) fn frame(f: &Frame, vsn: Vsn) -> Option<Out> {
        match f.encode_server(vsn) {
            Ok(WireMessage::Text(t)) => Some(Out::Text(t.into())),
            Ok(WireMessage::Binary(b)) => Some(Out::Binary(Bytes::from(b))),
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode server frame");
                telemetry::error("encode");
                None
            }
        }
    }
}

/// The sending side of one connection.
pub(crate) struct ConnHandle {
    pub id: u64,
    tx: mpsc::Sender<Out>,
    /// Cancelled to close the connection (reason in `close`).
    pub kill: CancellationToken,
    close: OnceLock<(u16, String)>,
}

impl ConnHandle {
    pub(crate) fn new(id: u64, capacity: usize) -> (Arc<ConnHandle>, mpsc::Receiver<Out>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let h = ConnHandle {
            id,
            tx,
            kill: CancellationToken::new(),
            close: OnceLock::new(),
        };
        (Arc::new(h), rx)
    }

    /// Queue a message; false if the connection is gone or was just closed as too slow.
    pub(crate) fn push(&self, out: Out) -> bool {
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

    pub(crate) fn close_reason(&self) -> Option<(u16, String)> {
        self.close.get().cloned()
    }
}

enum Gate {
    Pending(Vec<Out>),
    Open,
    Closed,
}

/// The outbound side of one joined channel.
pub(crate) struct ChanOut {
    pub id: u64,
    pub conn: Arc<ConnHandle>,
    pub topic: Arc<str>,
    pub vsn: Vsn,
    /// `config.broadcast.self`.
    pub broadcast_self: bool,
    /// Presence enabled (at join, or by a track).
    pub presence: AtomicBool,
    pending_cap: usize,
    gate: Mutex<Gate>,
}

impl ChanOut {
    pub(crate) fn new(
        id: u64,
        conn: Arc<ConnHandle>,
        topic: &str,
        vsn: Vsn,
        broadcast_self: bool,
        presence: bool,
        pending_cap: usize,
    ) -> ChanOut {
        ChanOut {
            id,
            conn,
            topic: Arc::from(topic),
            vsn,
            broadcast_self,
            presence: AtomicBool::new(presence),
            pending_cap,
            gate: Mutex::new(Gate::Pending(Vec::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fan-out delivery: held while the join is in flight, dropped once the channel closed.
    pub(crate) fn deliver(&self, out: Out) -> bool {
        let mut g = self.lock();
        match &mut *g {
            Gate::Open => self.conn.push(out),
            Gate::Pending(buf) => {
                if buf.len() >= self.pending_cap {
                    self.conn.slow_consumer();
                    return false;
                }
                buf.push(out);
                true
            }
            Gate::Closed => false,
        }
    }

    /// Queue `first` (join reply, system, presence_state), then everything held, and open.
    pub(crate) fn open(&self, first: Vec<Out>) {
        let mut g = self.lock();
        let held = match std::mem::replace(&mut *g, Gate::Open) {
            Gate::Pending(buf) => buf,
            Gate::Open => Vec::new(),
            Gate::Closed => {
                *g = Gate::Closed;
                return;
            }
        };
        for o in first.into_iter().chain(held) {
            if !self.conn.push(o) {
                break;
            }
        }
    }

    /// Queue `last` (leave reply, `phx_close` …) and drop every later delivery.
    pub(crate) fn close(&self, last: Vec<Out>) {
        let mut g = self.lock();
        *g = Gate::Closed;
        for o in last {
            if !self.conn.push(o) {
                break;
            }
        }
    }

    pub(crate) fn presence_enabled(&self) -> bool {
        self.presence.load(Ordering::Relaxed)
    }
}

impl Sink for ChanOut {
    fn id(&self) -> u64 {
        self.id
    }

    fn deliver(&self, change: &mut Change<'_>, ids: Vec<u32>) -> bool {
        let text = change.phoenix_frame(self.vsn, &self.topic, ids);
        ChanOut::deliver(self, Out::Text(text))
    }

    /// The channel stays open (as for a refused join) with a `system` error.
    fn end(&self, _shared: &Shared, why: &str) {
        let status = SystemStatus::Error;
        let f = server::system(None, &self.topic, "postgres_changes", status, why);
        if let Some(out) = Out::frame(&f, self.vsn) {
            ChanOut::deliver(self, out);
        }
    }
}
