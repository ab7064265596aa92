//! Registered `postgres_changes` subscriptions, matched while decoding.
//!
//! The registry side (register / unregister / sync from fronts) and the decode side (which
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
use walcast_protocol::filter::{ColumnText, Filter, RecordView};
use walcast_wal2json::{Column, Lsn};

use crate::types::TypeCache;

/// A validated subscription.
#[derive(Debug)]
pub struct Sub {
    pub spec: SubscriptionSpec,
    pub filter: Option<Filter>,
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

/// A sync list leaves alone subscriptions registered less than this long ago: the list
/// was taken before their registration reached us (a front sends both on one connection,
/// but takes the list earlier). A missing one that is older is gone from its front.
pub const SYNC_GRACE: Duration = walcast_bus::subs::SYNC_INTERVAL;

impl Sub {
    pub fn new(spec: SubscriptionSpec, filter: Option<Filter>, effective_from: Lsn) -> Sub {
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
    filter: Option<Filter>,
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
            select: f.select.as_ref().map(|c| c.iter().cloned().collect()),
            kinds: [
                all || e == "INSERT",
                all || e == "UPDATE",
                all || e == "DELETE",
            ],
        }
    }

    fn wants(&self, kind: ChangeKind) -> bool {
        match kind {
            ChangeKind::Insert => self.kinds[0],
            ChangeKind::Update => self.kinds[1],
            ChangeKind::Delete => self.kinds[2],
            ChangeKind::Truncate => false,
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
    /// each touched bucket once. Returns the ids of `new` refused because their key names
    /// a class with other fields (see [`State::collides`]); they are not added.
    fn apply(&mut self, gone: &[String], new: Vec<Sub>) -> Vec<String> {
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
            if self.collides(&sub) {
                refused.push(sub.spec.id.clone());
                continue;
            }
            self.fronts.insert(sub.spec.front.clone(), Instant::now());
            self.by_id.insert(sub.spec.id.clone(), sub.clone());
            if !self.classes.contains_key(&sub.class) {
                let entry = ClassEntry {
                    class: Arc::new(Class::of(&sub)),
                    fronts: BTreeMap::new(),
                };
                self.classes.insert(sub.class.clone(), entry);
                self.by_key
                    .entry(key_of(&sub.spec))
                    .or_default()
                    .push(sub.class.clone());
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
        refused
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
        let old = entry.fronts.remove(front).unwrap_or_default();
        let bucket: Vec<Arc<Sub>> = old
            .iter()
            .filter(|s| !gone.contains(&Arc::as_ptr(s)))
            .cloned()
            .chain(new)
            .collect();
        if !bucket.is_empty() {
            entry.fronts.insert(front.to_string(), Arc::new(bucket));
        } else if entry.fronts.is_empty() {
            // The class's last subscription went away.
            let Some(entry) = self.classes.remove(class) else {
                return;
            };
            let _ = entry;
            for keys in self.by_key.values_mut() {
                keys.retain(|k| k != class);
            }
            self.by_key.retain(|_, v| !v.is_empty());
        }
    }
}

/// A row as the filter evaluator sees it: column name, typname, Postgres text value.
pub struct RowView<'a> {
    cols: Vec<(&'a str, &'a str, Option<std::borrow::Cow<'a, str>>)>,
}

impl<'a> RowView<'a> {
    pub fn new(columns: impl Iterator<Item = &'a Column<'a>>, types: &'a TypeCache) -> RowView<'a> {
        RowView {
            cols: columns
                .map(|c| {
                    let typname = c
                        .type_oid
                        .and_then(|o| types.get(o))
                        .unwrap_or(c.type_name.as_ref());
                    (c.name.as_ref(), typname, c.text())
                })
                .collect(),
        }
    }
}

impl RecordView for RowView<'_> {
    fn column(&self, name: &str) -> Option<ColumnText<'_>> {
        self.cols
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, t, v)| ColumnText {
                typname: t,
                value: v.as_deref(),
            })
    }
}

#[derive(Default)]
pub struct Matcher {
    state: RwLock<State>,
}

impl Matcher {
    pub fn new() -> Arc<Matcher> {
        Arc::new(Matcher::default())
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

    /// Add (or replace, by id) subscriptions, as one edit. Returns the ids refused because
    /// their class key names a class with other fields (a replaced subscription of such an
    /// id is gone).
    #[must_use]
    pub fn insert_all(&self, subs: Vec<Sub>) -> Vec<String> {
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
        st.apply(&stale, Vec::new());
        st.fronts.insert(front.to_string(), Instant::now());
    }

    /// The fronts heard from (and not expired).
    pub fn fronts(&self) -> BTreeSet<String> {
        self.read().fronts.keys().cloned().collect()
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

    /// The classes a change matches, each with the fronts that have a subscription in
    /// effect at `commit_lsn`. `row` is the new row for INSERT and UPDATE, the old row
    /// (replica identity) for DELETE. A filter that cannot be evaluated on this row
    /// denies that class only. The work is per class, not per subscription.
    pub fn matches(
        &self,
        project: &str,
        schema: &str,
        table: &str,
        kind: ChangeKind,
        commit_lsn: Lsn,
        row: &impl RecordView,
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
                let class = &entry.class;
                if !class.wants(kind) || !passes(class, row) {
                    continue;
                }
                let fronts: Vec<(String, Bucket)> = entry
                    .fronts
                    .iter()
                    .filter(|(_, b)| b.iter().any(|s| commit_lsn > s.effective_from))
                    .map(|(f, b)| (f.clone(), b.clone()))
                    .collect();
                if !fronts.is_empty() {
                    out.push(MatchedClass {
                        class: class.clone(),
                        fronts,
                        at: commit_lsn,
                    });
                }
            }
        }
        out
    }
}

fn passes(class: &Class, row: &impl RecordView) -> bool {
    match &class.filter {
        None => true,
        Some(f) => match f.matches(row) {
            Ok(b) => b,
            Err(e) => {
                metrics::counter!(crate::telemetry::FILTER_ERRORS).increment(1);
                tracing::debug!(class = %class.key, error = %e, "filter could not be evaluated; not delivered");
                false
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_protocol::filter::SliceRecord;

    fn ids(v: Vec<MatchedClass>) -> Vec<String> {
        v.iter()
            .flat_map(|m| m.subs().map(|s| s.spec.id.clone()))
            .collect()
    }

    fn spec(id: &str, table: Option<&str>, event: &str, filter: Option<&str>) -> SubscriptionSpec {
        SubscriptionSpec {
            id: id.into(),
            front: "f".into(),
            project: "default".into(),
            schema: "public".into(),
            table: table.map(String::from),
            event: event.into(),
            filter: filter.map(String::from),
            select: None,
            claims: serde_json::json!({"role": "anon"}),
            from: None,
        }
    }

    fn add(
        m: &Matcher,
        id: &str,
        table: Option<&str>,
        event: &str,
        filter: Option<&str>,
        from: u64,
    ) {
        let f = filter.map(|f| Filter::parse(f).unwrap());
        m.insert(Sub::new(spec(id, table, event, filter), f, Lsn(from)));
    }

    #[test]
    fn event_table_filter_and_position() {
        let m = Matcher::default();
        add(&m, "a", Some("t"), "*", None, 0);
        add(&m, "b", Some("t"), "INSERT", Some("id=eq.1"), 0);
        add(&m, "c", None, "delete", None, 0);
        add(&m, "d", Some("t"), "*", None, 100);
        add(&m, "e", Some("other"), "*", None, 0);
        let one = [("id", "int4", Some("1"))];
        let two = [("id", "int4", Some("2"))];
        let ins1 = ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(50),
            &SliceRecord(&one),
        ));
        assert_eq!(ins1, ["a", "b"]);
        let ins2 = ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(150),
            &SliceRecord(&two),
        ));
        assert_eq!(ins2, ["a", "d"]);
        let del = ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Delete,
            Lsn(150),
            &SliceRecord(&one),
        ));
        assert_eq!(del, ["a", "d", "c"]);
        assert!(m
            .matches(
                "p2",
                "public",
                "t",
                ChangeKind::Insert,
                Lsn(150),
                &SliceRecord(&one)
            )
            .is_empty());
    }

    #[test]
    fn a_filter_error_denies_only_that_subscription() {
        let m = Matcher::default();
        add(&m, "ok", Some("t"), "*", None, 0);
        add(&m, "bad", Some("t"), "*", Some("id=eq.1"), 0);
        let rec = [("id", "int4", Some("not a number"))];
        let got = ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(1),
            &SliceRecord(&rec),
        ));
        assert_eq!(got, ["ok"]);
    }

    #[test]
    fn a_forced_key_never_merges_classes_with_other_fields() {
        let m = Matcher::default();
        let service = SubscriptionSpec {
            claims: serde_json::json!({"role": "service_role"}),
            ..spec("svc", Some("t"), "*", None)
        };
        assert!(m.insert(Sub::new(service, None, Lsn(0))));
        // An anon subscription whose key was made to equal the service_role class's.
        let forged = |id: &str, select: Option<Vec<String>>| {
            let mut sub = Sub::new(
                SubscriptionSpec {
                    select,
                    ..spec(id, Some("t"), "*", None)
                },
                None,
                Lsn(0),
            );
            sub.class = m.read().by_id["svc"].class.clone();
            sub
        };
        assert!(!m.insert(forged("anon", None)), "another role: refused");
        let refused = m.insert_all(vec![
            forged("anon2", Some(vec!["x".into()])),
            forged("anon3", None),
        ]);
        assert_eq!(refused, ["anon2", "anon3"]);
        assert_eq!(m.len(), 1);
        let rec = [("id", "int4", Some("1"))];
        let got = ids(m.matches(
            "default",
            "public",
            "t",
            ChangeKind::Insert,
            Lsn(1),
            &SliceRecord(&rec),
        ));
        assert_eq!(got, ["svc"]);
        // The same fields do join the class.
        let twin = SubscriptionSpec {
            claims: serde_json::json!({"role": "service_role", "sub": "other"}),
            ..spec("svc2", Some("t"), "*", None)
        };
        assert!(m.insert(Sub::new(twin, None, Lsn(0))));
        assert_eq!(m.read().classes.len(), 1);
    }

    #[test]
    fn sync_and_expiry_drop_subscriptions() {
        let m = Matcher::default();
        add(&m, "f:1", Some("t"), "*", None, 0);
        add(&m, "f:2", Some("t"), "*", None, 0);
        // Registered just now: a list that lacks it may predate it.
        m.sync("f", &["f:2".to_string()], SYNC_GRACE);
        assert_eq!(m.len(), 2);
        m.sync("f", &["f:2".to_string()], Duration::ZERO);
        assert_eq!(m.len(), 1);
        assert_eq!(m.expire_fronts(Duration::from_secs(60)), 0);
        assert_eq!(m.expire_fronts(Duration::ZERO), 1);
        assert!(m.is_empty());
        m.remove(&["nope".into()]);
    }
}
