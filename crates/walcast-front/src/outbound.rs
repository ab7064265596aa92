//! Bounded outbound queues: one per connection, and a gate per channel.
//!
//! Every frame for a client goes through its connection's bounded queue. Producers never
//! wait: when the queue is full the connection is closed as a slow consumer (close code
//! 1013) and counted. A channel's gate holds fan-out frames while its join is in flight
//! and lets them out right after the join reply, so a change matched between the worker's
//! registration and the reply is neither lost nor delivered before the reply.
//!
//! A join with broadcast replay reads the stored messages after its channel was added to
//! the topic, so a message can reach it twice: replayed, and live (held at the gate, or
//! still on its way from the cdc-worker). The gate remembers the replayed ids (at most
//! the replay limit) and drops the live copies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::mpsc;
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{Frame, Vsn};

use crate::sink::{Change, Sink};
pub(crate) use crate::socket::Out;
use crate::socket::{Ending, Kill, Link};
use crate::telemetry;
use crate::usage::ProjectCounts;

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

enum Gate {
    /// Held while the join is in flight, each with its broadcast id (`meta.id`) if any.
    Pending(Vec<(Out, Option<Arc<str>>)>),
    /// The ids the join replayed: their live copies are dropped.
    Open(HashSet<String>),
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
        self.deliver_broadcast(out, None)
    }

    /// [`ChanOut::deliver`] for a broadcast with id `id` (its `meta.id`): dropped if the
    /// join replayed it.
    pub(crate) fn deliver_broadcast(&self, out: Out, id: Option<&Arc<str>>) -> bool {
        let mut g = self.lock();
        match &mut *g {
            Gate::Open(replayed) => {
                if id.is_some_and(|id| replayed.contains(&**id)) {
                    telemetry::replayed_live_dropped();
                    return true;
                }
                self.conn.push(out)
            }
            Gate::Pending(buf) => {
                if buf.len() >= self.pending_cap {
                    self.conn.slow_consumer();
                    return false;
                }
                buf.push((out, id.cloned()));
                true
            }
            Gate::Closed => false,
        }
    }

    /// Queue `first` (join reply, system, presence_state, replayed broadcasts), then
    /// everything held but the live copies of the `replayed` ids, and open.
    pub(crate) fn open(&self, first: Vec<Out>, replayed: HashSet<String>) {
        let mut g = self.lock();
        let held = match &mut *g {
            Gate::Pending(buf) => std::mem::take(buf),
            Gate::Open(_) | Gate::Closed => return,
        };
        let held = held.into_iter().filter_map(|(o, id)| match id {
            Some(id) if replayed.contains(&*id) => {
                telemetry::replayed_live_dropped();
                None
            }
            _ => Some(o),
        });
        for o in first.into_iter().chain(held) {
            if !self.conn.push(o) {
                break;
            }
        }
        *g = Gate::Open(replayed);
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

    fn deliver(&self, change: &mut Change<'_>, ids: &[u32]) -> bool {
        let text = change.phoenix_frame(self.vsn, &self.topic, ids);
        ChanOut::deliver(self, text)
    }

    /// A `system` error; the channel goes on.
    fn missed(&self, why: &str) {
        self.end(why);
    }

    /// The channel stays open (as for a refused join) with a `system` error.
    fn end(&self, why: &str) {
        let status = SystemStatus::Error;
        let f = server::system(None, &self.topic, "postgres_changes", status, why);
        if let Some(out) = Out::frame(&f, self.vsn) {
            ChanOut::deliver(self, out);
        }
    }

    /// The same `system` error; the channel stays subscribed.
    fn warn(&self, why: &str) {
        Sink::end(self, why)
    }

    fn resumed(&self, why: &str) {
        let f = server::system(None, &self.topic, "postgres_changes", SystemStatus::Ok, why);
        if let Some(out) = Out::frame(&f, self.vsn) {
            ChanOut::deliver(self, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &'static str) -> Out {
        Out::text(s)
    }

    fn drain(rx: &mut mpsc::Receiver<Out>) -> Vec<String> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|o| String::from_utf8_lossy(o.payload()).into_owned())
            .collect()
    }

    #[test]
    fn live_copies_of_replayed_broadcasts_are_dropped_held_or_not() {
        let (conn, mut rx) = ConnHandle::new(1, 16);
        let chan = ChanOut::new(7, conn, "realtime:room", Vsn::V1, false, false, 8);
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a".into(), "b".into(), "c".into());
        assert!(chan.deliver_broadcast(text("live a"), Some(&a)));
        assert!(chan.deliver(text("change")));
        assert!(chan.deliver_broadcast(text("live c"), Some(&c)));
        assert!(drain(&mut rx).is_empty(), "held until the join is answered");

        let replayed = ["a", "b"].map(String::from).into();
        chan.open(
            vec![text("reply"), text("replayed a"), text("replayed b")],
            replayed,
        );
        assert!(chan.deliver_broadcast(text("live b"), Some(&b)));
        assert!(chan.deliver_broadcast(text("live c again"), Some(&c)));
        assert!(chan.deliver(text("later")));
        assert_eq!(
            drain(&mut rx),
            [
                "reply",
                "replayed a",
                "replayed b",
                "change",
                "live c",
                "live c again",
                "later"
            ]
        );
    }

    #[test]
    fn a_full_gate_closes_the_connection_as_slow() {
        let (conn, _rx) = ConnHandle::new(1, 16);
        let chan = ChanOut::new(7, conn.clone(), "realtime:room", Vsn::V1, false, false, 2);
        assert!(chan.deliver(text("1")) && chan.deliver(text("2")));
        assert!(!chan.deliver(text("3")));
        assert_eq!(conn.close_reason().map(|r| r.0), Some(CLOSE_SLOW_CONSUMER));
    }
}
