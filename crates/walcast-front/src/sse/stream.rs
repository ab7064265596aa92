//! One shared SSE subscription ([`SseChannel`]): its history ring, its live readers, and
//! the map of every stream of the front by key ([`Streams`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};

use axum::http::StatusCode;
use axum::response::sse::Event;
use serde_json::Value;
use tokio::sync::{broadcast, OnceCell};
use tokio::time::Instant;
use walcast_bus::ChangeEvent;
use walcast_core::Lsn;
use walcast_protocol::{EncodedChange, PgChangeBinding};

use crate::subscription::sink::{Change, Sink};

pub(super) type Pos = (Lsn, u32);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct SseKey {
    pub project: String,
    pub channel: String,
    pub binding: String,
    pub identity: String,
}

pub(crate) struct Item {
    pub pos: Pos,
    pub id: String,
    pub data: String,
    /// The change's transaction (`ChangeEvent::xid`), for a snapshot's cut.
    pub xid: Option<u32>,
    /// The last item: the subscription ended (`data` is the `system` event's).
    pub end: bool,
}

pub(super) struct Inner {
    pub ring: VecDeque<Arc<Item>>,
    /// Position of the newest entry evicted from the ring.
    pub evicted: Option<Pos>,
    pub readers: usize,
    pub idle_since: Option<Instant>,
}

/// One shared SSE subscription with its history.
pub(crate) struct SseChannel {
    pub id: u64,
    pub key: SseKey,
    pub binding: PgChangeBinding,
    cap: usize,
    /// Its subscription's number, once its first reader subscribed (the others wait for
    /// the same answer).
    pub sub: OnceCell<Result<u64, (StatusCode, String)>>,
    inner: Mutex<Inner>,
    pub live: broadcast::Sender<Arc<Item>>,
    /// Bumped when its project's keys change: each reader verifies its own token again
    /// (readers of one stream share claims, not tokens).
    pub recheck: tokio::sync::watch::Sender<u64>,
    /// The map it is in (it leaves it when the worker ends its subscription).
    streams: Weak<Streams>,
}

impl Item {
    /// Its `postgres_changes` event (with its position as the `id`).
    pub(super) fn event(&self) -> Event {
        Event::default()
            .id(&self.id)
            .event("postgres_changes")
            .data(&self.data)
    }
}

impl SseChannel {
    /// `event: ready`: the channel's name and its binding with its `id`.
    pub(super) fn ready_event(&self, name: &str) -> Event {
        let ready_data = format!(
            "{{\"channel\":{},\"postgres_changes\":[{}]}}",
            Value::from(name),
            self.binding.reply_entry()
        );
        Event::default().event("ready").data(ready_data)
    }

    /// A new stream for `key` in `streams`, keeping `cap` changes of history and
    /// `live_cap` for live readers not yet caught up.
    pub(super) fn new(
        id: u64,
        key: SseKey,
        binding: &PgChangeBinding,
        (cap, live_cap): (usize, usize),
        streams: &Arc<Streams>,
    ) -> SseChannel {
        SseChannel {
            id,
            key,
            binding: binding.clone(),
            cap,
            sub: OnceCell::new(),
            inner: Mutex::new(Inner {
                ring: VecDeque::new(),
                evicted: None,
                readers: 0,
                idle_since: Some(Instant::now()),
            }),
            live: broadcast::channel(live_cap).0,
            recheck: tokio::sync::watch::channel(0).0,
            streams: Arc::downgrade(streams),
        }
    }

    /// Its subscription's number, if it has one.
    pub(super) fn sub(&self) -> Option<u64> {
        self.sub.get().and_then(|r| r.as_ref().ok()).copied()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a change and hand it to live readers.
    pub(crate) fn push(&self, ev: &ChangeEvent, enc: &EncodedChange, ids: &[u32]) {
        let pos = ev.position();
        let mut g = self.lock();
        if g.ring.back().is_some_and(|last| last.pos >= pos) {
            return; // a replay of something already recorded
        }
        let item = Arc::new(Item {
            pos,
            id: format!("{}:{}", pos.0, pos.1),
            data: enc.payload_json(ids),
            xid: ev.xid,
            end: false,
        });
        g.ring.push_back(item.clone());
        while g.ring.len() > self.cap {
            if let Some(old) = g.ring.pop_front() {
                g.evicted = Some(old.pos);
            }
        }
        let _ = self.live.send(item);
    }

    /// The worker ended the subscription (its table was dropped): live readers get a
    /// `system` error event, then their stream ends.
    pub(crate) fn end(&self, message: &str) {
        self.system(message, true)
    }

    /// A `system` error event for live readers; `end`: then their stream ends.
    fn system(&self, message: &str, end: bool) {
        self.system_with("error", message, end)
    }

    /// A `system` event of `status` (`error` or `ok`); `end`: the stream ends after it.
    fn system_with(&self, status: &str, message: &str, end: bool) {
        let data = serde_json::json!({
            "extension": "postgres_changes",
            "status": status,
            "message": message,
        });
        let item = Arc::new(Item {
            pos: (Lsn(u64::MAX), u32::MAX),
            id: String::new(),
            data: data.to_string(),
            xid: None,
            end,
        });
        let _ = self.live.send(item);
    }
}

impl Sink for SseChannel {
    fn id(&self) -> u64 {
        self.id
    }

    fn deliver(&self, change: &mut Change<'_>, ids: &[u32]) -> bool {
        self.push(change.event, change.encoded, ids);
        true
    }

    /// Live readers get the reason and their streams end; a reader coming back
    /// subscribes anew (and is refused with the reason).
    /// Its readers get a `system` error and their streams end (a reader that comes back
    /// resumes from the history, which lacks what was lost).
    fn missed(&self, why: &str) {
        SseChannel::end(self, why);
    }

    fn end(&self, why: &str) {
        if let Some(streams) = self.streams.upgrade() {
            streams.remove_if(self);
        }
        SseChannel::end(self, why);
    }

    fn warn(&self, why: &str) {
        self.system(why, false)
    }

    fn resumed(&self, why: &str) {
        self.system_with("ok", why, false)
    }
}

/// Every SSE stream of the front, by key.
#[derive(Default)]
pub(super) struct Streams {
    map: Mutex<HashMap<SseKey, Arc<SseChannel>>>,
}

impl Streams {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SseKey, Arc<SseChannel>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remove `chan` if it is still the stream of its key.
    pub(super) fn remove_if(&self, chan: &SseChannel) -> bool {
        let mut g = self.lock();
        if g.get(&chan.key)
            .is_some_and(|c| std::ptr::eq(Arc::as_ptr(c), chan))
        {
            g.remove(&chan.key);
            true
        } else {
            false
        }
    }
}

/// Counts a reader of a channel while the response lives.
pub(super) struct Reader {
    chan: Arc<SseChannel>,
}

impl Reader {
    pub(super) fn new(chan: Arc<SseChannel>) -> Reader {
        {
            let mut g = chan.lock();
            g.readers += 1;
            g.idle_since = None;
        }
        Reader { chan }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut g = self.chan.lock();
        g.readers = g.readers.saturating_sub(1);
        if g.readers == 0 {
            g.idle_since = Some(Instant::now());
        }
    }
}
