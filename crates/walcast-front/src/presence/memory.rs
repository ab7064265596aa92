//! Presence kept in this front's memory ([`MemoryPresence`]): what one front alone needs
//! (the in-process bus); presence shared by several fronts is `super::kv`'s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::value::RawValue;
use walcast_bus::subs::BoxFuture;
use walcast_protocol::server;

use super::{PresenceDiff, PresenceMeta, PresenceStore};
use crate::connection::TopicKey;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presence::presence_map;

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
