//! Presence: who is tracked on which topic.
//!
//! [`PresenceStore`] is the seam for the store: [`MemoryPresence`] is per front (the
//! in-process bus, `memory`), [`KvPresence`] is shared by every front through JetStream
//! KV (`kv`). The front sends the returned diffs, and the store's
//! [`PresenceStore::remote_diffs`] (changes made by other fronts), to its own channels of
//! the topic (here). What a socket's presence events may be — their size, their rates —
//! is `admit`'s.
//!
//! The Phoenix command that tracks and untracks is `channel::track`.

pub(crate) mod admit;
pub mod kv;
mod memory;

pub use kv::{KvPresence, DEFAULT_PRESENCE_TTL, PRESENCE_BUCKET};
pub use memory::MemoryPresence;

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::value::RawValue;
use walcast_bus::subs::BoxFuture;
use walcast_protocol::{server, Vsn};

use crate::connection::{Out, TopicKey, Topics};
use crate::limits::rates::Rate;
use crate::limits::usage::Usage;

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
    (topics, usage): (Arc<Topics>, Arc<Usage>),
    mut rx: RemoteDiffs,
    cancel: tokio_util::sync::CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some((key, d)) = next else { return };
        send_diff(&topics, &usage, &key, &d);
    }
}
