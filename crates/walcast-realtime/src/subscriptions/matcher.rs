//! Registered `postgres_changes` subscriptions, matched while decoding.
//!
//! The subscription side (register / unregister / sync from fronts) and the decode side (which
//! subscriptions does this change match?) share one index. A subscription registered at
//! WAL position P matches every change whose commit LSN is after P: since it is in the
//! index before P is read, any such transaction is decoded after it was added.
//!
//! Subscriptions are grouped in classes ([`ClassFields`]: same project, table, event,
//! filter, selected columns and role, named by [`ClassFields::key`]): a change is matched
//! once per class, whatever the number of subscribers, and each class keeps its
//! subscriptions per front (copied on write, so a match hands them out without copying
//! them). A subscription joins a class only if its fields equal the class's: one whose key
//! names a class with other fields (a collision) is refused, never merged.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use walcast_bus::subs::{ClassFields, SubscriptionSpec, FRONT_EXPIRY};
use walcast_bus::ChangeKind;
use walcast_protocol::filter::CompiledFilter;
use walcast_wal2json::Lsn;

pub use super::row_view::RowView;

/// A validated subscription.
#[derive(Debug)]
pub struct Sub {
    pub spec: SubscriptionSpec,
    /// Its filter, patterns compiled once.
    pub filter: Option<CompiledFilter>,
    pub effective_from: Lsn,
    /// The claims as JSON text, as bound for `request.jwt.claims` (subscribers with the
    /// same text share RLS checks).
    pub claims_json: String,
    /// Its class's fields, and their key ([`ClassFields::key`]).
    pub fields: ClassFields,
    pub class: String,
    /// When the worker registered it (a sync list older than that may lack it).
    registered: Instant,
}

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

impl Sub {
    pub fn new(spec: SubscriptionSpec, filter: Option<CompiledFilter>, effective_from: Lsn) -> Sub {
        let fields = ClassFields::of(&spec);
        Sub {
            claims_json: serde_json::to_string(&spec.claims).unwrap_or_default(),
            class: fields.key(),
            fields,
            spec,
            filter,
            effective_from,
            registered: Instant::now(),
        }
    }

    pub fn role(&self) -> Option<&str> {
        self.spec.claims.get("role").and_then(|r| r.as_str())
    }
}

/// What the subscriptions of one class have in common.
#[derive(Debug)]
pub struct Class {
    pub key: String,
    /// What its subscriptions have in common (every member's fields equal these).
    pub fields: ClassFields,
    /// The JWT `role` claim (empty when there is none).
    pub role: String,
    pub(super) filter: Option<CompiledFilter>,
    /// What its filter's compiled patterns hold in memory.
    heap: usize,
    kinds: [bool; 3],
    /// The binding's `select`: only these columns (and the key) are sent.
    pub select: Option<BTreeSet<String>>,
}

impl Class {
    fn of(sub: &Sub) -> Class {
        let f = &sub.fields;
        let e = f.event.as_str();
        let all = e == "*";
        Class {
            key: sub.class.clone(),
            fields: f.clone(),
            role: f.role.clone(),
            filter: sub.filter.clone(),
            heap: sub.filter.as_ref().map_or(0, CompiledFilter::heap_bytes),
            select: f.select.as_ref().map(|c| c.iter().cloned().collect()),
            kinds: [
                all || e == "INSERT",
                all || e == "UPDATE",
                all || e == "DELETE",
            ],
        }
    }

    /// Whether its filter has patterns (`like`, `match`, …): the filters whose evaluation
    /// may cost more than a comparison.
    pub fn has_patterns(&self) -> bool {
        self.heap > 0
    }

    /// The columns its filter reads (none without a filter).
    pub fn filter_columns(&self) -> impl Iterator<Item = &str> {
        self.filter.iter().flat_map(|f| f.filter().columns())
    }

    pub(super) fn wants(&self, kind: ChangeKind) -> bool {
        match kind {
            ChangeKind::Insert => self.kinds[0],
            ChangeKind::Update => self.kinds[1],
            ChangeKind::Delete => self.kinds[2],
            // Supabase does not deliver TRUNCATE to clients (README "Change streams").
            ChangeKind::Truncate => false,
            // Snapshot rows go to the change stream only (README "Change streams").
            ChangeKind::Read => false,
        }
    }
}

/// The subscriptions of one class on one front.
pub type Bucket = Arc<Vec<Arc<Sub>>>;

/// A class a change matched, with the fronts that have a subscription effective at it.
#[derive(Debug, Clone)]
pub struct MatchedClass {
    pub class: Arc<Class>,
    pub fronts: Vec<(String, Bucket)>,
    /// The change's commit LSN.
    pub at: Lsn,
}

impl MatchedClass {
    /// The subscriptions in effect for the change.
    pub fn subs(&self) -> impl Iterator<Item = &Arc<Sub>> {
        let at = self.at;
        self.fronts
            .iter()
            .flat_map(|(_, b)| b.iter())
            .filter(move |s| at > s.effective_from)
    }
}

/// Index key: (project, schema or "*", table or "").
type Key = (String, String, String);

struct ClassEntry {
    class: Arc<Class>,
    fronts: BTreeMap<String, Bucket>,
}

#[derive(Default)]
struct State {
    by_key: HashMap<Key, Vec<String>>,
    classes: HashMap<String, ClassEntry>,
    by_id: HashMap<String, Arc<Sub>>,
    fronts: HashMap<String, Instant>,
    limits: ClassLimits,
    /// Classes per project, and classes with a subscription of each front.
    per_project: HashMap<String, usize>,
    per_front: HashMap<String, usize>,
    /// Memory of the compiled patterns, per project and in all.
    filter_bytes: HashMap<String, usize>,
    filter_bytes_total: usize,
}

fn key_of(spec: &SubscriptionSpec) -> Key {
    (
        spec.project.clone(),
        spec.schema.clone(),
        spec.table.clone().unwrap_or_default(),
    )
}

impl State {
    /// Remove `gone` and add `new` (replacing subscriptions of the same id), rebuilding
    /// each touched bucket once. Returns those of `new` refused (see [`State::admit`]);
    /// they are not added.
    fn apply(&mut self, gone: &[String], new: Vec<Sub>) -> Vec<Refusal> {
        let mut removed: HashMap<(String, String), HashSet<*const Sub>> = HashMap::new();
        let mut added: HashMap<(String, String), Vec<Arc<Sub>>> = HashMap::new();
        let new: Vec<Arc<Sub>> = new.into_iter().map(Arc::new).collect();
        let replaced = new.iter().map(|s| &s.spec.id);
        for id in gone.iter().chain(replaced) {
            if let Some(old) = self.by_id.remove(id) {
                removed
                    .entry((old.class.clone(), old.spec.front.clone()))
                    .or_default()
                    .insert(Arc::as_ptr(&old));
            }
        }
        let mut refused = Vec::new();
        for sub in new {
            if let Err(why) = self.admit(&sub, &added) {
                refused.push((sub.spec.id.clone(), why));
                continue;
            }
            self.fronts.insert(sub.spec.front.clone(), Instant::now());
            self.by_id.insert(sub.spec.id.clone(), sub.clone());
            if !self.classes.contains_key(&sub.class) {
                let entry = ClassEntry {
                    class: Arc::new(Class::of(&sub)),
                    fronts: BTreeMap::new(),
                };
                let heap = entry.class.heap;
                *self
                    .filter_bytes
                    .entry(sub.spec.project.clone())
                    .or_default() += heap;
                self.filter_bytes_total += heap;
                self.classes.insert(sub.class.clone(), entry);
                *self
                    .per_project
                    .entry(sub.spec.project.clone())
                    .or_default() += 1;
                self.by_key
                    .entry(key_of(&sub.spec))
                    .or_default()
                    .push(sub.class.clone());
            }
            let pair = (sub.class.clone(), sub.spec.front.clone());
            let has_front = self.classes[&sub.class].fronts.contains_key(&pair.1);
            if !has_front && !added.contains_key(&pair) {
                *self.per_front.entry(pair.1.clone()).or_default() += 1;
            }
            added
                .entry((sub.class.clone(), sub.spec.front.clone()))
                .or_default()
                .push(sub);
        }
        let touched: HashSet<(String, String)> =
            removed.keys().chain(added.keys()).cloned().collect();
        for (class, front) in touched {
            let gone = removed.remove(&(class.clone(), front.clone()));
            let new = added.remove(&(class.clone(), front.clone()));
            self.rebuild(
                &class,
                &front,
                gone.unwrap_or_default(),
                new.unwrap_or_default(),
            );
        }
        metrics::gauge!(crate::telemetry::SUBSCRIPTIONS).set(self.by_id.len() as f64);
        metrics::gauge!(crate::telemetry::FILTER_BYTES).set(self.filter_bytes_total as f64);
        refused
    }

    /// Whether `sub` may be added (`added`: the (class, front) pairs this edit adds so
    /// far): its key must not name a class of other fields, and a new class must fit the
    /// [`ClassLimits`] of its project and front.
    fn admit(
        &self,
        sub: &Sub,
        added: &HashMap<(String, String), Vec<Arc<Sub>>>,
    ) -> Result<(), String> {
        if self.collides(sub) {
            return Err(COLLISION.to_string());
        }
        let (project, front) = (&sub.spec.project, &sub.spec.front);
        let entry = self.classes.get(&sub.class);
        let count = |m: &HashMap<String, usize>, k: &str| m.get(k).copied().unwrap_or(0);
        let full = |limit: &'static str, max: usize, what: String| {
            metrics::counter!(crate::telemetry::CLASSES_REFUSED, "limit" => limit).increment(1);
            tracing::warn!(id = %sub.spec.id, limit, max, "subscription refused: too many classes");
            Err(format!(
                "Unable to subscribe to changes: {what} has {max} distinct subscriptions \
                 (classes: table, event, filter, columns and role) already, the most allowed"
            ))
        };
        if entry.is_none() && count(&self.per_project, project) >= self.limits.per_project {
            return full(
                "project",
                self.limits.per_project,
                format!("project {project:?}"),
            );
        }
        if entry.is_none() {
            self.admit_filter(sub)?;
        }
        let pair = (sub.class.clone(), front.clone());
        let new_for_front =
            entry.is_none_or(|e| !e.fronts.contains_key(front)) && !added.contains_key(&pair);
        if new_for_front && count(&self.per_front, front) >= self.limits.per_front {
            return full("front", self.limits.per_front, "this front".to_string());
        }
        Ok(())
    }

    /// Whether the compiled patterns of `sub`'s filter (a new class's) fit what its project
    /// and the worker may hold: every change of its table runs them, on the project's lane.
    fn admit_filter(&self, sub: &Sub) -> Result<(), String> {
        let heap = sub.filter.as_ref().map_or(0, CompiledFilter::heap_bytes);
        if heap == 0 {
            return Ok(());
        }
        let project = &sub.spec.project;
        let used = self.filter_bytes.get(project).copied().unwrap_or(0);
        let (limit, max, what) = if used + heap > self.limits.filter_bytes_per_project {
            (
                "filter_bytes_project",
                self.limits.filter_bytes_per_project,
                format!("project {project:?}"),
            )
        } else if self.filter_bytes_total + heap > self.limits.filter_bytes {
            (
                "filter_bytes",
                self.limits.filter_bytes,
                "this worker".to_string(),
            )
        } else {
            return Ok(());
        };
        metrics::counter!(crate::telemetry::CLASSES_REFUSED, "limit" => limit).increment(1);
        tracing::warn!(id = %sub.spec.id, limit, max, heap, "subscription refused: its filter's patterns do not fit");
        Err(format!(
            "Unable to subscribe to changes: the patterns of {what}'s filters would hold more than {} KiB (this filter's: {} KiB); use fewer or simpler like/match patterns",
            max / 1024,
            heap.div_ceil(1024)
        ))
    }

    /// Whether `sub`'s key names a class whose fields are not `sub`'s (a collision, or a
    /// forged key): such a subscription must never be merged into it, or it would get
    /// what that class's role, filter and columns allow. Counted and logged.
    fn collides(&self, sub: &Sub) -> bool {
        let Some(entry) = self.classes.get(&sub.class) else {
            return false;
        };
        if entry.class.fields == sub.fields {
            return false;
        }
        metrics::counter!(crate::telemetry::CLASS_COLLISIONS).increment(1);
        tracing::error!(
            class = %sub.class,
            id = %sub.spec.id,
            "a subscription's class key names a class with other fields: refused"
        );
        true
    }

    fn rebuild(&mut self, class: &str, front: &str, gone: HashSet<*const Sub>, new: Vec<Arc<Sub>>) {
        let Some(entry) = self.classes.get_mut(class) else {
            return;
        };
        let had = entry.fronts.remove(front);
        let old = had.clone().unwrap_or_default();
        let bucket: Vec<Arc<Sub>> = old
            .iter()
            .filter(|s| !gone.contains(&Arc::as_ptr(s)))
            .cloned()
            .chain(new)
            .collect();
        if !bucket.is_empty() {
            entry.fronts.insert(front.to_string(), Arc::new(bucket));
            return;
        }
        if had.is_some() {
            decrement(&mut self.per_front, front);
        }
        if entry.fronts.is_empty() {
            // The class's last subscription went away.
            let Some(entry) = self.classes.remove(class) else {
                return;
            };
            decrement(&mut self.per_project, &entry.class.fields.project);
            let heap = entry.class.heap;
            if let Some(n) = self.filter_bytes.get_mut(&entry.class.fields.project) {
                *n = n.saturating_sub(heap);
                if *n == 0 {
                    self.filter_bytes.remove(&entry.class.fields.project);
                }
            }
            self.filter_bytes_total = self.filter_bytes_total.saturating_sub(heap);
            for keys in self.by_key.values_mut() {
                keys.retain(|k| k != class);
            }
            self.by_key.retain(|_, v| !v.is_empty());
        }
    }
}

fn decrement(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(key);
        }
    }
}

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

    /// Every class with a filter.
    pub fn filtered_classes(&self) -> Vec<Arc<Class>> {
        let st = self.read();
        st.classes
            .values()
            .filter(|e| e.class.filter.is_some())
            .map(|e| e.class.clone())
            .collect()
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
    /// `crate::subscriptions::narrow`), so that no project's filters hold the decoding of
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
#[path = "matcher_tests.rs"]
mod tests;
