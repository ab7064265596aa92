//! A joined channel's gate into its connection's queue ([`ChanOut`]).
//!
//! A channel's gate holds fan-out frames while its join is in flight and lets them out
//! right after the join reply, so a change matched between the worker's registration and
//! the reply is neither lost nor delivered before the reply.
//!
//! A join with broadcast replay reads the stored messages after its channel was added to
//! the topic, so a message can reach it twice: replayed, and live (held at the gate, or
//! still on its way from the cdc-worker). The gate remembers the replayed ids (at most
//! the replay limit) and drops the live copies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use walcast_protocol::Vsn;

use super::queue::ConnHandle;
use super::socket::Out;
use crate::telemetry;

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

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::connection::queue::CLOSE_SLOW_CONSUMER;

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
