//! Registered `postgres_changes` subscriptions, matched while decoding.
//!
//! The subscription side (register / unregister / sync from fronts) and the decode side (which
//! subscriptions does this change match?) share one index. A subscription registered at
//! WAL position P matches every change whose commit LSN is after P: since it is in the
//! index before P is read, any such transaction is decoded after it was added.
//!
//! Subscriptions are grouped in classes ([`walcast_bus::subs::ClassFields`]: same project, table, event,
//! filter, selected columns and role, named by `ClassFields::key`): a change is matched
//! once per class, whatever the number of subscribers, and each class keeps its
//! subscriptions per front (copied on write, so a match hands them out without copying
//! them). A subscription joins a class only if its fields equal the class's: one whose key
//! names a class with other fields (a collision) is refused, never merged.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use walcast_bus::subs::FRONT_EXPIRY;
use walcast_wal2json::Lsn;

pub use super::row_view::RowView;

mod class;
mod state;

pub use class::{Bucket, Class, MatchedClass, Sub};
use state::State;

/// Default of [`ClassLimits::per_project`].
pub const DEFAULT_MAX_CLASSES_PER_PROJECT: usize = 10_000;
/// Default of [`ClassLimits::per_front`].
pub const DEFAULT_MAX_CLASSES_PER_FRONT: usize = 50_000;
/// Default of [`ClassLimits::filter_bytes_per_project`]: 16 MiB of compiled patterns.
pub const DEFAULT_MAX_FILTER_BYTES_PER_PROJECT: usize = 16 << 20;
/// Default of [`ClassLimits::filter_bytes`]: 256 MiB of compiled patterns in all.
pub const DEFAULT_MAX_FILTER_BYTES: usize = 256 << 20;

/// How many classes the matcher keeps: every class costs a filter evaluation per change
/// of its tables, on the path every project shares, so one tenant (or one socket) must
/// not be able to add them without bound. A registration that would add one more is
/// refused with a readable error; joining an existing class is always possible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassLimits {
    /// Classes of one project.
    pub per_project: usize,
    /// Classes with a subscription of one front.
    pub per_front: usize,
    /// Memory of the compiled patterns of one project's classes (each pattern's automata
    /// and search cache, see `walcast_protocol::filter::Pattern::heap_bytes`).
    pub filter_bytes_per_project: usize,
    /// The same, of every project's classes together.
    pub filter_bytes: usize,
}

impl Default for ClassLimits {
    fn default() -> ClassLimits {
        ClassLimits {
            per_project: DEFAULT_MAX_CLASSES_PER_PROJECT,
            per_front: DEFAULT_MAX_CLASSES_PER_FRONT,
            filter_bytes_per_project: DEFAULT_MAX_FILTER_BYTES_PER_PROJECT,
            filter_bytes: DEFAULT_MAX_FILTER_BYTES,
        }
    }
}

/// Why a subscription whose class key names a class with other fields is refused.
pub const COLLISION: &str = "Unable to subscribe to changes: its class key names a class with \
     other parameters (refused, never merged)";

/// A refused subscription: its id and the reason sent to its client.
pub type Refusal = (String, String);

/// A sync list leaves alone subscriptions registered less than this long ago: the list
/// was taken before their registration reached us (a front sends both on one connection,
/// but takes the list earlier). A missing one that is older is gone from its front.
pub const SYNC_GRACE: Duration = walcast_bus::subs::SYNC_INTERVAL;

#[derive(Default)]
pub struct Matcher {
    state: RwLock<State>,
}

impl Matcher {
    pub fn new() -> Arc<Matcher> {
        Matcher::with_limits(ClassLimits::default())
    }

    /// A matcher keeping at most these many classes.
    pub fn with_limits(limits: ClassLimits) -> Arc<Matcher> {
        let m = Matcher::default();
        m.write().limits = limits;
        Arc::new(m)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Add (or replace, by id) a subscription; `false` if refused (see
    /// [`Matcher::insert_all`]).
    pub fn insert(&self, sub: Sub) -> bool {
        self.insert_all(vec![sub]).is_empty()
    }

    /// Add (or replace, by id) subscriptions, as one edit. Returns those refused, with the
    /// reason for their client: their class key names a class with other fields, or their
    /// class would be one too many ([`ClassLimits`]). A replaced subscription of a refused
    /// id is gone.
    #[must_use]
    pub fn insert_all(&self, subs: Vec<Sub>) -> Vec<Refusal> {
        self.write().apply(&[], subs)
    }

    pub fn remove(&self, ids: &[String]) {
        self.write().apply(ids, Vec::new());
    }

    /// Remove every subscription to exactly this table (not wildcards), whatever its
    /// project (a table streams for one project only); returns their (front, id).
    pub fn take_table(&self, schema: &str, table: &str) -> Vec<(String, String)> {
        let mut st = self.write();
        let gone: Vec<(String, String)> = st
            .by_id
            .values()
            .filter(|s| s.spec.schema == schema && s.spec.table.as_deref() == Some(table))
            .map(|s| (s.spec.front.clone(), s.spec.id.clone()))
            .collect();
        let ids: Vec<String> = gone.iter().map(|(_, id)| id.clone()).collect();
        st.apply(&ids, Vec::new());
        gone
    }

    /// A front's full list: drop its subscriptions missing from it (unless registered
    /// within `grace`, i.e. after the list may have been taken); note it is alive.
    pub fn sync(&self, front: &str, ids: &[String], grace: Duration) {
        let keep: HashSet<&str> = ids.iter().map(String::as_str).collect();
        let mut st = self.write();
        let stale: Vec<String> = st
            .by_id
            .values()
            .filter(|s| s.spec.front == front && !keep.contains(s.spec.id.as_str()))
            .filter(|s| s.registered.elapsed() >= grace)
            .map(|s| s.spec.id.clone())
            .collect();
        if !stale.is_empty() {
            // Normally the leftovers of unregistrations that were lost; named here because
            // a front that still had one would no longer get its changes.
            tracing::info!(
                front,
                dropped = stale.len(),
                "a front's sync list dropped subscriptions it no longer lists"
            );
        }
        st.apply(&stale, Vec::new());
        st.fronts.insert(front.to_string(), Instant::now());
    }

    /// Every class.
    pub fn classes(&self) -> Vec<Arc<Class>> {
        let st = self.read();
        st.classes.values().map(|e| e.class.clone()).collect()
    }

    /// The subscription ids of a class, per front.
    pub fn class_subs(&self, key: &str) -> Vec<(String, Vec<String>)> {
        let st = self.read();
        let Some(entry) = st.classes.get(key) else {
            return Vec::new();
        };
        entry
            .fronts
            .iter()
            .map(|(front, b)| (front.clone(), b.iter().map(|s| s.spec.id.clone()).collect()))
            .collect()
    }

    /// The fronts heard from (and not expired).
    pub fn fronts(&self) -> BTreeSet<String> {
        self.read().fronts.keys().cloned().collect()
    }

    /// The fronts that have subscriptions (the leader's heartbeats go to these).
    pub fn subscribed_fronts(&self) -> Vec<String> {
        self.read().per_front.keys().cloned().collect()
    }

    /// Note that a front is alive (it sent part of a sync).
    pub fn touch(&self, front: &str) {
        self.write()
            .fronts
            .insert(front.to_string(), Instant::now());
    }

    /// Drop every subscription of fronts not heard from within `expiry`.
    pub fn expire_fronts(&self, expiry: Duration) -> usize {
        let mut st = self.write();
        let dead: Vec<String> = st
            .fronts
            .iter()
            .filter(|(_, t)| t.elapsed() > expiry)
            .map(|(f, _)| f.clone())
            .collect();
        if dead.is_empty() {
            return 0;
        }
        let ids: Vec<String> = st
            .by_id
            .values()
            .filter(|s| dead.contains(&s.spec.front))
            .map(|s| s.spec.id.clone())
            .collect();
        st.apply(&ids, Vec::new());
        for f in &dead {
            st.fronts.remove(f);
        }
        tracing::warn!(fronts = ?dead, subscriptions = ids.len(), "dropped subscriptions of fronts not heard from");
        ids.len()
    }

    pub fn expire_dead_fronts(&self) -> usize {
        self.expire_fronts(FRONT_EXPIRY)
    }

    pub fn len(&self) -> usize {
        self.read().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The classes of a change's table (its project's, for that table or its schema or
    /// every table), each with the fronts that have a subscription in effect at
    /// `commit_lsn`: what the change may match. Taken under the lock, which is held for
    /// nothing more (a clone of a few shared pointers per class): the filters are
    /// evaluated afterwards, on the project's delivery lane (see
    /// `subscriptions/narrow.rs`), so that no project's filters hold the decoding of
    /// the others' changes or any registration.
    pub fn candidates(
        &self,
        project: &str,
        schema: &str,
        table: &str,
        commit_lsn: Lsn,
    ) -> Vec<MatchedClass> {
        let st = self.read();
        if st.by_id.is_empty() {
            return Vec::new();
        }
        let keys = [
            (project, schema, table),
            (project, schema, ""),
            (project, "*", table),
            (project, "*", ""),
        ];
        let mut out = Vec::new();
        for (p, s, t) in keys {
            let Some(classes) = st
                .by_key
                .get(&(p.to_string(), s.to_string(), t.to_string()))
            else {
                continue;
            };
            for entry in classes.iter().filter_map(|k| st.classes.get(k)) {
                let fronts: Vec<(String, Bucket)> = entry
                    .fronts
                    .iter()
                    .filter(|(_, b)| b.iter().any(|s| commit_lsn > s.effective_from))
                    .map(|(f, b)| (f.clone(), b.clone()))
                    .collect();
                if !fronts.is_empty() {
                    out.push(MatchedClass {
                        class: entry.class.clone(),
                        fronts,
                        at: commit_lsn,
                    });
                }
            }
        }
        out
    }

    /// Memory of the compiled patterns of `project`'s classes, and of every project's.
    pub fn filter_bytes(&self, project: &str) -> (usize, usize) {
        let st = self.read();
        let own = st.filter_bytes.get(project).copied().unwrap_or(0);
        (own, st.filter_bytes_total)
    }
}

#[cfg(test)]
mod tests;
