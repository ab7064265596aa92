//! Presence: who is tracked on which topic.
//!
//! [`PresenceStore`] is the seam for the store: [`MemoryPresence`] is per front (the
//! in-process bus), [`crate::KvPresence`] is shared by every front through JetStream KV.
//! The front sends the returned diffs, and the store's [`PresenceStore::remote_diffs`]
//! (changes made by other fronts), to its own channels of the topic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::value::RawValue;
use walcast_bus::subs::BoxFuture;
use walcast_protocol::{server, PresenceAction, Vsn};

use crate::delivery::Delivery;
use crate::outbound::Out;
use crate::rates::Rate;
use crate::topics::{TopicKey, Topics};
use crate::usage::Usage;

/// One tracked presence: `key` (the channel's presence key) and its meta
/// (the track payload plus `phx_ref`, and `phx_ref_prev` after an update).
#[derive(Clone, Debug)]
pub struct PresenceMeta {
    /// Presence key.
    pub key: String,
    /// The meta object as sent to clients.
    pub meta: Box<RawValue>,
}

/// Joins and leaves caused by one track/untrack.
#[derive(Clone, Debug, Default)]
pub struct PresenceDiff {
    /// New metas.
    pub joins: Vec<PresenceMeta>,
    /// Removed metas.
    pub leaves: Vec<PresenceMeta>,
}

/// Where presence lives. `owner` identifies one channel instance globally
/// (`<front id>:<channel id>`), so several connections with one key give several metas.
pub trait PresenceStore: Send + Sync + 'static {
    /// Track (or update) `owner`'s presence; `None` when nothing changed (same payload).
    fn track(
        &self,
        topic: TopicKey,
        owner: String,
        key: String,
        payload: Box<RawValue>,
    ) -> BoxFuture<Option<PresenceDiff>>;
    /// Stop tracking `owner`; `None` when it was not tracked.
    fn untrack(&self, topic: TopicKey, owner: String) -> BoxFuture<Option<PresenceDiff>>;
    /// Everything tracked on a topic.
    fn list(&self, topic: TopicKey) -> BoxFuture<Vec<PresenceMeta>>;
    /// Diffs caused elsewhere (other fronts), for this front's subscribers of the topic.
    /// Taken once, by the front at start; `None` for a store local to one front.
    fn remote_diffs(&self) -> Option<RemoteDiffs> {
        None
    }
}

/// Diffs made by other fronts, per topic.
pub type RemoteDiffs = tokio::sync::mpsc::UnboundedReceiver<(TopicKey, PresenceDiff)>;

struct Entry {
    owner: String,
    key: String,
    payload: String,
    phx_ref: String,
    meta: Box<RawValue>,
}

/// In-memory presence for one front.
pub struct MemoryPresence {
    topics: Mutex<HashMap<TopicKey, Vec<Entry>>>,
    prefix: String,
    next: AtomicU64,
}

impl Default for MemoryPresence {
    fn default() -> Self {
        MemoryPresence {
            topics: Mutex::new(HashMap::new()),
            prefix: format!("F{:08x}", rand::random::<u32>()),
            next: AtomicU64::new(1),
        }
    }
}

impl MemoryPresence {
    fn phx_ref(&self) -> String {
        format!(
            "{}{}",
            self.prefix,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TopicKey, Vec<Entry>>> {
        self.topics.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn track_now(
        &self,
        topic: TopicKey,
        owner: String,
        key: String,
        payload: Box<RawValue>,
    ) -> Option<PresenceDiff> {
        let mut g = self.lock();
        let entries = g.entry(topic).or_default();
        let text = payload.get().to_string();
        let mut diff = PresenceDiff::default();
        let mut prev = None;
        if let Some(pos) = entries.iter().position(|e| e.owner == owner) {
            if entries[pos].payload == text && entries[pos].key == key {
                return None;
            }
            let old = entries.remove(pos);
            prev = Some(old.phx_ref.clone());
            diff.leaves.push(PresenceMeta {
                key: old.key,
                meta: old.meta,
            });
        }
        let phx_ref = self.phx_ref();
        let meta = server::presence_meta(&payload, &phx_ref, prev.as_deref());
        diff.joins.push(PresenceMeta {
            key: key.clone(),
            meta: meta.clone(),
        });
        entries.push(Entry {
            owner,
            key,
            payload: text,
            phx_ref,
            meta,
        });
        Some(diff)
    }

    fn untrack_now(&self, topic: TopicKey, owner: String) -> Option<PresenceDiff> {
        let mut g = self.lock();
        let entries = g.get_mut(&topic)?;
        let pos = entries.iter().position(|e| e.owner == owner)?;
        let old = entries.remove(pos);
        if entries.is_empty() {
            g.remove(&topic);
        }
        Some(PresenceDiff {
            joins: Vec::new(),
            leaves: vec![PresenceMeta {
                key: old.key,
                meta: old.meta,
            }],
        })
    }
}

impl PresenceStore for MemoryPresence {
    fn track(
        &self,
        topic: TopicKey,
        owner: String,
        key: String,
        payload: Box<RawValue>,
    ) -> BoxFuture<Option<PresenceDiff>> {
        let r = self.track_now(topic, owner, key, payload);
        Box::pin(std::future::ready(r))
    }

    fn untrack(&self, topic: TopicKey, owner: String) -> BoxFuture<Option<PresenceDiff>> {
        let r = self.untrack_now(topic, owner);
        Box::pin(std::future::ready(r))
    }

    fn list(&self, topic: TopicKey) -> BoxFuture<Vec<PresenceMeta>> {
        let g = self.lock();
        let r = g
            .get(&topic)
            .map(|v| {
                v.iter()
                    .map(|e| PresenceMeta {
                        key: e.key.clone(),
                        meta: e.meta.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Box::pin(std::future::ready(r))
    }
}

/// Presence events (track, untrack) a socket may send per second, after a burst of
/// [`EVENTS_BURST`]: each one is a KV write shared by every front.
pub(crate) const EVENTS_PER_SECOND: u32 = 10;
pub(crate) const EVENTS_BURST: u32 = 20;
/// The largest presence payload (its JSON), stored per presence in the KV bucket and sent
/// to every member of the topic in each `presence_state` (a project's smaller
/// `max_payload_size_in_kb` holds too).
pub(crate) const MAX_PAYLOAD_BYTES: usize = 8 * 1024;
/// The largest tracked entry: its payload, topic and presence key, as JSON text (a KV
/// entry of the presence bucket holds the three, and the bucket's entries are bounded).
pub(crate) const MAX_TRACKED_BYTES: usize = MAX_PAYLOAD_BYTES + 12 * 1024;

/// The length of `s` as a JSON string (quotes and escapes included), without writing it.
pub(crate) fn json_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// Why a presence event is refused; each shuts the channel (a `system` error with
/// Supabase's text, then `phx_close`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PresenceRefused {
    /// The track payload is over [`MAX_PAYLOAD_BYTES`] or the project's payload limit,
    /// or with its topic and presence key over [`MAX_TRACKED_BYTES`].
    TooLarge,
    /// The socket is over its presence events/s.
    ClientRate,
    /// The project is over its presence events/s across the fronts.
    ProjectRate,
    /// The project is over its messages/s or bytes/s.
    Messages,
}

impl PresenceRefused {
    /// Supabase's `system` message text.
    pub(crate) fn message(self) -> &'static str {
        match self {
            PresenceRefused::TooLarge => "Track message size exceeded",
            PresenceRefused::ClientRate => "Client presence rate limit exceeded",
            PresenceRefused::ProjectRate => "Too many presence messages per second",
            PresenceRefused::Messages => crate::usage::TOO_MANY_MESSAGES,
        }
    }
}

/// May this presence event of a socket of `project` go ahead? The payload's size (and
/// with the channel's `(topic, presence key)`, the entry's), the socket's rate, the
/// project's presence rate, its messages and bytes rates. Refusals are counted and
/// logged.
pub(crate) fn admit(
    usage: &crate::usage::Usage,
    (project, entry): (&str, (&str, &str)),
    events: &mut crate::limits::TokenBucket,
    action: &PresenceAction,
) -> Result<(), PresenceRefused> {
    let size = match action {
        PresenceAction::Track { payload } => payload.get().len(),
        PresenceAction::Untrack => 0,
    };
    if size > MAX_PAYLOAD_BYTES {
        let detail = format!("presence payload of {size} bytes, max {MAX_PAYLOAD_BYTES}");
        usage.refuse(project, "presence_payload", "PayloadSizeExceeded", &detail);
        return Err(PresenceRefused::TooLarge);
    }
    let tracked = size + json_len(entry.0) + json_len(entry.1);
    if size > 0 && tracked > MAX_TRACKED_BYTES {
        let detail = format!(
            "presence entry (payload, topic and key) of {tracked} bytes, max {MAX_TRACKED_BYTES}"
        );
        usage.refuse(project, "presence_payload", "PayloadSizeExceeded", &detail);
        return Err(PresenceRefused::TooLarge);
    }
    if usage.check_payload(project, size).is_err() {
        return Err(PresenceRefused::TooLarge);
    }
    if !events.take() {
        let detail = "a socket's presence events per second";
        usage.refuse(
            project,
            "presence_events",
            "ClientPresenceRateLimitReached",
            detail,
        );
        return Err(PresenceRefused::ClientRate);
    }
    if let Err(over) = usage.take(project, &[(crate::rates::Rate::Presence, 1)]) {
        let detail = format!("{} per second, limit {}", over.seen, over.limit);
        usage.refuse(
            project,
            "project_presence",
            "PresenceRateLimitReached",
            &detail,
        );
        return Err(PresenceRefused::ProjectRate);
    }
    usage
        .take_messages(project, 1, size as u64)
        .map_err(|_| PresenceRefused::Messages)
}

/// `{key:{metas:[…]}}` of a list of metas, grouped by key in first-seen order (linear in
/// the number of metas: a topic's state may hold thousands).
pub(crate) fn presence_map(metas: &[PresenceMeta]) -> String {
    let mut keys: Vec<(&str, Vec<&RawValue>)> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for m in metas {
        match index.get(m.key.as_str()) {
            Some(&i) => keys[i].1.push(&m.meta),
            None => {
                index.insert(&m.key, keys.len());
                keys.push((&m.key, vec![&m.meta]));
            }
        }
    }
    server::presence_map(keys)
}

/// Send a diff to this front's channels of the topic that have presence enabled (counted
/// among its project's messages sent).
pub(crate) fn send_diff(topics: &Topics, usage: &Usage, key: &TopicKey, d: &PresenceDiff) {
    let frame = server::presence_diff(
        &key.topic,
        &presence_map(&d.joins),
        &presence_map(&d.leaves),
    );
    let mut v1: Option<Option<Out>> = None;
    let mut v2: Option<Option<Out>> = None;
    let (mut sent, mut bytes) = (0u64, 0u64);
    for m in topics.members(key) {
        if !m.presence_enabled() {
            continue;
        }
        let slot = match m.vsn {
            Vsn::V1 => &mut v1,
            Vsn::V2 => &mut v2,
        };
        if let Some(o) = slot.get_or_insert_with(|| Out::frame(&frame, m.vsn)) {
            sent += 1;
            bytes += o.len() as u64;
            m.deliver(o.clone());
        }
    }
    if sent > 0 {
        usage.count(&key.project, &[(Rate::Events, sent), (Rate::Bytes, bytes)]);
    }
}

/// Send other fronts' diffs to this front's subscribers until `cancel` fires.
pub(crate) async fn remote_loop(
    (delivery, usage): (std::sync::Arc<Delivery>, std::sync::Arc<Usage>),
    mut rx: RemoteDiffs,
    cancel: tokio_util::sync::CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some((key, d)) = next else { return };
        send_diff(&delivery.topics, &usage, &key, &d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_len_is_the_length_serde_writes() {
        for s in [
            "",
            "plain",
            "é🙂",
            "\"\\/",
            "\u{0}\u{1}\u{1f}\u{7f}",
            "\t\r\n\u{8}\u{c}",
        ] {
            assert_eq!(
                json_len(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
    }

    fn key() -> TopicKey {
        TopicKey {
            project: "p".into(),
            private: false,
            topic: "realtime:r".into(),
        }
    }

    fn rv(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.into()).unwrap()
    }

    #[test]
    fn track_update_untrack() {
        let p = MemoryPresence::default();
        let d = p
            .track_now(key(), "o1".into(), "ann".into(), rv(r#"{"a":1}"#))
            .unwrap();
        assert_eq!(d.joins.len(), 1);
        assert!(d.leaves.is_empty());
        assert!(p
            .track_now(key(), "o1".into(), "ann".into(), rv(r#"{"a":1}"#))
            .is_none());
        let d = p
            .track_now(key(), "o1".into(), "ann".into(), rv(r#"{"a":2}"#))
            .unwrap();
        assert_eq!(d.leaves.len(), 1);
        assert!(d.joins[0].meta.get().contains("phx_ref_prev"));
        p.track_now(key(), "o2".into(), "ann".into(), rv("{}"));
        let state = presence_map(
            &p.lock()[&key()]
                .iter()
                .map(|e| PresenceMeta {
                    key: e.key.clone(),
                    meta: e.meta.clone(),
                })
                .collect::<Vec<_>>(),
        );
        let v: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(v["ann"]["metas"].as_array().unwrap().len(), 2);
        assert!(p.untrack_now(key(), "o1".into()).is_some());
        assert!(p.untrack_now(key(), "o1".into()).is_none());
    }
}
