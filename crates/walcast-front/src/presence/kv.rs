//! Presence shared by every front through a JetStream KV bucket.
//!
//! One key per tracked meta, `<project>.<pub|prv>.<topic>.<presence key>.<phx_ref>` (each
//! part escaped into a valid KV token), whose value is the meta plus the owner front id.
//! Each front re-puts its own entries every `ttl / 3` while their channel lives and deletes
//! them on untrack, leave or close. A watch on the bucket turns the other fronts' puts and
//! deletes into `presence_diff`s for local subscribers. nats-server 2.9 sends no delete
//! marker when a key expires by `max_age`, so each front also remembers when it last saw
//! each remote entry put and emits the leave itself once that is older than the TTL: the
//! presences of a front that died disappear for the others within about the TTL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{self, Operation, Store};
use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use walcast_bus::subs::BoxFuture;
use walcast_protocol::server;

mod entry_key;

use super::admit::MAX_PAYLOAD_BYTES;
use super::{PresenceDiff, PresenceMeta, PresenceStore, RemoteDiffs};
use crate::connection::TopicKey;

/// The bucket name.
pub const PRESENCE_BUCKET: &str = "walcast_presence";

/// The largest entry of the bucket: a tracked payload, topic and key (at most
/// [`super::admit::MAX_TRACKED_BYTES`], as JSON) with the rest of its meta.
const MAX_ENTRY_BYTES: i32 = (MAX_PAYLOAD_BYTES + 16 * 1024) as i32;
/// The bucket's memory, all projects together.
const MAX_BUCKET_BYTES: i64 = 256 * 1024 * 1024;

/// The bucket's `max_age` and the remote-entry expiry unless configured.
pub const DEFAULT_PRESENCE_TTL: Duration = Duration::from_secs(60);

/// The KV value of one tracked meta.
#[derive(Serialize, Deserialize)]
struct Value {
    /// Owner front id.
    front: String,
    project: String,
    private: bool,
    topic: String,
    key: String,
    meta: Box<RawValue>,
}

struct Local {
    topic: TopicKey,
    key: String,
    payload: String,
    phx_ref: String,
    meta: Box<RawValue>,
    kv_key: String,
    value: Bytes,
}

struct Remote {
    key: String,
    meta: Box<RawValue>,
    value: Bytes,
    seen: Instant,
}

#[derive(Default)]
struct State {
    /// This front's entries by owner (`<front id>:<channel id>`).
    local: HashMap<String, Local>,
    /// Other fronts' entries by topic, then KV key.
    remote: HashMap<TopicKey, HashMap<String, Remote>>,
    /// KV key → topic of `remote`.
    index: HashMap<String, TopicKey>,
}

struct Inner {
    front: String,
    ttl: Duration,
    kv: tokio::sync::OnceCell<Store>,
    state: Mutex<State>,
    /// Serialises this front's KV writes, so a refresh never re-puts a deleted entry.
    io: tokio::sync::Mutex<()>,
    prefix: String,
    next: AtomicU64,
    tx: mpsc::UnboundedSender<(TopicKey, PresenceDiff)>,
}

/// [`PresenceStore`] on the JetStream KV bucket [`PRESENCE_BUCKET`].
pub struct KvPresence {
    inner: Arc<Inner>,
    rx: Mutex<Option<RemoteDiffs>>,
}

impl KvPresence {
    /// Start: open (or create) the bucket in the background, retrying while NATS is
    /// unreachable, then watch it; refresh this front's entries and expire silent remote
    /// ones until `cancel` fires. `front_id` marks this front's entries.
    pub fn start(
        client: async_nats::Client,
        front_id: &str,
        ttl: Duration,
        cancel: CancellationToken,
    ) -> KvPresence {
        let ttl = ttl.max(Duration::from_secs(1));
        let (tx, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            front: front_id.to_string(),
            ttl,
            kv: tokio::sync::OnceCell::new(),
            state: Mutex::new(State::default()),
            io: tokio::sync::Mutex::new(()),
            prefix: format!("K{:08x}", rand::random::<u32>()),
            next: AtomicU64::new(1),
            tx,
        });
        tokio::spawn(watch_loop(inner.clone(), client, cancel.clone()));
        tokio::spawn(refresh_loop(inner.clone(), cancel.clone()));
        tokio::spawn(expire_loop(inner.clone(), cancel));
        KvPresence {
            inner,
            rx: Mutex::new(Some(rx)),
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn phx_ref(&self) -> String {
        format!(
            "{}{}",
            self.prefix,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    async fn put(&self, key: &str, value: Bytes) {
        let Some(kv) = self.kv.get() else {
            return; // put by the refresh loop once the bucket is open
        };
        if let Err(e) = kv.put(key, value).await {
            tracing::warn!(error = %e, key, "presence: KV put failed (retried by the refresh)");
        }
    }

    async fn delete(&self, key: &str) {
        let Some(kv) = self.kv.get() else {
            return;
        };
        if let Err(e) = kv.delete(key).await {
            tracing::warn!(error = %e, key, "presence: KV delete failed (expires by TTL)");
        }
    }

    async fn track(
        &self,
        topic: TopicKey,
        owner: String,
        key: String,
        payload: Box<RawValue>,
    ) -> Option<PresenceDiff> {
        let _io = self.io.lock().await;
        let text = payload.get().to_string();
        let (diff, new_key, value, old_key) = {
            let mut st = self.lock();
            let mut diff = PresenceDiff::default();
            let mut prev = None;
            let mut old_key = None;
            if let Some(old) = st.local.get(&owner) {
                if old.payload == text && old.key == key && old.topic == topic {
                    return None;
                }
            }
            if let Some(old) = st.local.remove(&owner) {
                prev = Some(old.phx_ref.clone());
                old_key = Some(old.kv_key);
                diff.leaves.push(PresenceMeta {
                    key: old.key,
                    meta: old.meta,
                });
            }
            let phx_ref = self.phx_ref();
            let meta = server::presence_meta(&payload, &phx_ref, prev.as_deref());
            let kv_key = entry_key::kv_key(&topic, &key, &phx_ref);
            let value = Value {
                front: self.front.clone(),
                project: topic.project.clone(),
                private: topic.private,
                topic: topic.topic.clone(),
                key: key.clone(),
                meta: meta.clone(),
            };
            let value = Bytes::from(serde_json::to_vec(&value).unwrap_or_default());
            diff.joins.push(PresenceMeta {
                key: key.clone(),
                meta: meta.clone(),
            });
            st.local.insert(
                owner,
                Local {
                    topic,
                    key,
                    payload: text,
                    phx_ref,
                    meta,
                    kv_key: kv_key.clone(),
                    value: value.clone(),
                },
            );
            (diff, kv_key, value, old_key)
        };
        // Put the new meta before deleting the old one: other fronts never see the key gone.
        self.put(&new_key, value).await;
        if let Some(old) = old_key {
            self.delete(&old).await;
        }
        Some(diff)
    }

    async fn untrack(&self, owner: String) -> Option<PresenceDiff> {
        let _io = self.io.lock().await;
        let old = self.lock().local.remove(&owner)?;
        self.delete(&old.kv_key).await;
        Some(PresenceDiff {
            joins: Vec::new(),
            leaves: vec![PresenceMeta {
                key: old.key,
                meta: old.meta,
            }],
        })
    }

    fn list(&self, topic: &TopicKey) -> Vec<PresenceMeta> {
        let st = self.lock();
        let mut out: Vec<PresenceMeta> = st
            .local
            .values()
            .filter(|l| &l.topic == topic)
            .map(|l| PresenceMeta {
                key: l.key.clone(),
                meta: l.meta.clone(),
            })
            .collect();
        if let Some(r) = st.remote.get(topic) {
            out.extend(r.values().map(|e| PresenceMeta {
                key: e.key.clone(),
                meta: e.meta.clone(),
            }));
        }
        out
    }

    /// Apply one watched entry; the diff for local subscribers, if any.
    fn apply(&self, e: kv::Entry) -> Option<(TopicKey, PresenceDiff)> {
        match e.operation {
            Operation::Put => {
                let v: Value = match serde_json::from_slice(&e.value) {
                    Ok(v) => v,
                    Err(err) => {
                        tracing::warn!(key = %e.key, error = %err, "presence: unreadable KV entry");
                        return None;
                    }
                };
                if v.front == self.front {
                    return None;
                }
                let topic = TopicKey {
                    project: v.project,
                    private: v.private,
                    topic: v.topic,
                };
                let mut st = self.lock();
                let st = &mut *st;
                let entries = st.remote.entry(topic.clone()).or_default();
                let mut diff = PresenceDiff::default();
                if let Some(old) = entries.get_mut(&e.key) {
                    old.seen = Instant::now();
                    if old.value == e.value {
                        return None; // a refresh
                    }
                    diff.leaves.push(PresenceMeta {
                        key: old.key.clone(),
                        meta: old.meta.clone(),
                    });
                }
                diff.joins.push(PresenceMeta {
                    key: v.key.clone(),
                    meta: v.meta.clone(),
                });
                entries.insert(
                    e.key.clone(),
                    Remote {
                        key: v.key,
                        meta: v.meta,
                        value: e.value,
                        seen: Instant::now(),
                    },
                );
                st.index.insert(e.key, topic.clone());
                Some((topic, diff))
            }
            Operation::Delete | Operation::Purge => {
                let mut st = self.lock();
                let topic = st.index.remove(&e.key)?;
                let entries = st.remote.get_mut(&topic)?;
                let old = entries.remove(&e.key)?;
                if entries.is_empty() {
                    st.remote.remove(&topic);
                }
                Some((
                    topic,
                    PresenceDiff {
                        joins: Vec::new(),
                        leaves: vec![PresenceMeta {
                            key: old.key,
                            meta: old.meta,
                        }],
                    },
                ))
            }
        }
    }

    /// Forget remote entries not put for longer than the TTL; their leave diffs.
    fn expire(&self, now: Instant) -> Vec<(TopicKey, PresenceDiff)> {
        let mut st = self.lock();
        let State { remote, index, .. } = &mut *st;
        let mut out = Vec::new();
        remote.retain(|topic, entries| {
            let mut diff = PresenceDiff::default();
            entries.retain(|k, e| {
                if now.saturating_duration_since(e.seen) < self.ttl {
                    return true;
                }
                index.remove(k);
                diff.leaves.push(PresenceMeta {
                    key: e.key.clone(),
                    meta: e.meta.clone(),
                });
                false
            });
            if !diff.leaves.is_empty() {
                out.push((topic.clone(), diff));
            }
            !entries.is_empty()
        });
        out
    }
}

impl PresenceStore for KvPresence {
    fn track(
        &self,
        topic: TopicKey,
        owner: String,
        key: String,
        payload: Box<RawValue>,
    ) -> BoxFuture<Option<PresenceDiff>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.track(topic, owner, key, payload).await })
    }

    fn untrack(&self, _topic: TopicKey, owner: String) -> BoxFuture<Option<PresenceDiff>> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.untrack(owner).await })
    }

    fn list(&self, topic: TopicKey) -> BoxFuture<Vec<PresenceMeta>> {
        let r = self.inner.list(&topic);
        Box::pin(std::future::ready(r))
    }

    fn remote_diffs(&self) -> Option<RemoteDiffs> {
        self.rx.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

async fn open(client: &async_nats::Client, ttl: Duration) -> Result<Store, String> {
    let js = async_nats::jetstream::new(client.clone());
    if let Ok(s) = js.get_key_value(PRESENCE_BUCKET).await {
        return Ok(s);
    }
    // The stream a KV bucket is, created directly: `create_key_value` first queries the
    // account info, which async-nats 0.51 cannot parse from nats-server 2.9.
    let cfg = async_nats::jetstream::stream::Config {
        name: format!("KV_{PRESENCE_BUCKET}"),
        description: Some("walcast presence".to_string()),
        subjects: vec![format!("$KV.{PRESENCE_BUCKET}.>")],
        max_messages_per_subject: 1,
        max_age: ttl,
        storage: async_nats::jetstream::stream::StorageType::Memory,
        allow_rollup: true,
        deny_delete: true,
        deny_purge: false,
        allow_direct: true,
        num_replicas: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        // Bounded: one entry is a presence payload (at most 8 KiB) with its topic and key;
        // a full bucket refuses new entries (those presences stay on their own front,
        // logged) rather than growing without end.
        max_message_size: MAX_ENTRY_BYTES,
        max_bytes: MAX_BUCKET_BYTES,
        ..Default::default()
    };
    // Another front may create it meanwhile: either way, open it by name.
    let created = js.create_stream(cfg).await.err();
    js.get_key_value(PRESENCE_BUCKET)
        .await
        .map_err(|e| match created {
            Some(c) => format!("{c}; {e}"),
            None => e.to_string(),
        })
}

/// Waits between attempts to open the bucket: 200 ms, doubling up to 5 s.
const OPEN_BACKOFF: walcast_core::Backoff = walcast_core::Backoff {
    base: Duration::from_millis(200),
    cap: Duration::from_secs(5),
};

async fn watch_loop(inner: Arc<Inner>, client: async_nats::Client, cancel: CancellationToken) {
    let mut failures = 0;
    let store = loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = open(&client, inner.ttl) => match r {
                Ok(s) => break s,
                Err(e) => tracing::warn!(error = %e, "presence: cannot open the KV bucket; retrying"),
            },
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(OPEN_BACKOFF.delay(failures)) => {}
        }
        failures += 1;
    };
    let store = inner.kv.get_or_init(|| async { store }).await.clone();
    tracing::info!(bucket = PRESENCE_BUCKET, "presence: KV bucket open");
    // Put what was tracked before the bucket was open.
    refresh(&inner).await;
    loop {
        let mut watch = tokio::select! {
            _ = cancel.cancelled() => return,
            w = store.watch_with_history(">") => match w {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "presence: cannot watch the KV bucket; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            },
        };
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return,
                n = watch.next() => n,
            };
            match next {
                Some(Ok(e)) => {
                    if let Some(d) = inner.apply(e) {
                        let _ = inner.tx.send(d);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "presence: KV watch error; re-watching");
                    break;
                }
                None => {
                    tracing::warn!("presence: KV watch ended; re-watching");
                    break;
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Re-put every local entry still tracked.
async fn refresh(inner: &Inner) {
    let owners: Vec<String> = inner.lock().local.keys().cloned().collect();
    for owner in owners {
        let _io = inner.io.lock().await;
        let Some((key, value)) = inner
            .lock()
            .local
            .get(&owner)
            .map(|l| (l.kv_key.clone(), l.value.clone()))
        else {
            continue;
        };
        inner.put(&key, value).await;
    }
}

async fn refresh_loop(inner: Arc<Inner>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(inner.ttl / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => refresh(&inner).await,
        }
    }
}

async fn expire_loop(inner: Arc<Inner>, cancel: CancellationToken) {
    let every = (inner.ttl / 8).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {
                for d in inner.expire(Instant::now()) {
                    let _ = inner.tx.send(d);
                }
            }
        }
    }
}
