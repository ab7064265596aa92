//! Registered `postgres_changes` subscriptions, matched while decoding.
//!
//! The registry side (register / unregister / sync from fronts) and the decode side (which
//! subscriptions does this change match?) share one index. A subscription registered at
//! WAL position P matches every change whose commit LSN is after P: since it is in the
//! index before P is read, any such transaction is decoded after it was added.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use walcast_bus::subs::{SubscriptionSpec, FRONT_EXPIRY};
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
    kinds: [bool; 3],
}

impl Sub {
    pub fn new(spec: SubscriptionSpec, filter: Option<Filter>, effective_from: Lsn) -> Sub {
        let e = spec.event.to_ascii_uppercase();
        let all = e == "*";
        Sub {
            claims_json: serde_json::to_string(&spec.claims).unwrap_or_default(),
            kinds: [
                all || e == "INSERT",
                all || e == "UPDATE",
                all || e == "DELETE",
            ],
            spec,
            filter,
            effective_from,
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

/// Index key: (project, schema or "*", table or "").
type Key = (String, String, String);

#[derive(Default)]
struct State {
    by_key: HashMap<Key, Vec<Arc<Sub>>>,
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

    /// Add (or replace, by id) a subscription.
    pub fn insert(&self, sub: Sub) {
        let sub = Arc::new(sub);
        let mut st = self.write();
        st.fronts.insert(sub.spec.front.clone(), Instant::now());
        if let Some(old) = st.by_id.insert(sub.spec.id.clone(), sub.clone()) {
            remove_from_key(&mut st, &old);
        }
        st.by_key.entry(key_of(&sub.spec)).or_default().push(sub);
        metrics::gauge!("walcast_cdc_subscriptions").set(st.by_id.len() as f64);
    }

    pub fn remove(&self, ids: &[String]) {
        let mut st = self.write();
        for id in ids {
            if let Some(old) = st.by_id.remove(id) {
                remove_from_key(&mut st, &old);
            }
        }
        metrics::gauge!("walcast_cdc_subscriptions").set(st.by_id.len() as f64);
    }

    /// A front's full list: drop its subscriptions missing from it; note it is alive.
    pub fn sync(&self, front: &str, ids: &[String]) {
        let keep: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        let stale: Vec<String> = {
            let st = self.read();
            st.by_id
                .values()
                .filter(|s| s.spec.front == front && !keep.contains(s.spec.id.as_str()))
                .map(|s| s.spec.id.clone())
                .collect()
        };
        self.remove(&stale);
        self.write()
            .fronts
            .insert(front.to_string(), Instant::now());
    }

    /// Drop every subscription of fronts not heard from within `expiry`.
    pub fn expire_fronts(&self, expiry: Duration) -> usize {
        let dead: Vec<String> = {
            let st = self.read();
            st.fronts
                .iter()
                .filter(|(_, t)| t.elapsed() > expiry)
                .map(|(f, _)| f.clone())
                .collect()
        };
        if dead.is_empty() {
            return 0;
        }
        let ids: Vec<String> = {
            let st = self.read();
            st.by_id
                .values()
                .filter(|s| dead.contains(&s.spec.front))
                .map(|s| s.spec.id.clone())
                .collect()
        };
        self.remove(&ids);
        let mut st = self.write();
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

    /// Ids of the subscriptions a change matches. `row` is the new row for INSERT and
    /// UPDATE, the old row (replica identity) for DELETE. A filter that cannot be
    /// evaluated on this row denies that subscription only.
    pub fn matches(
        &self,
        project: &str,
        schema: &str,
        table: &str,
        kind: ChangeKind,
        commit_lsn: Lsn,
        row: &impl RecordView,
    ) -> Vec<Arc<Sub>> {
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
            let Some(subs) = st
                .by_key
                .get(&(p.to_string(), s.to_string(), t.to_string()))
            else {
                continue;
            };
            for sub in subs {
                if commit_lsn <= sub.effective_from || !sub.wants(kind) {
                    continue;
                }
                let pass = match &sub.filter {
                    None => true,
                    Some(f) => match f.matches(row) {
                        Ok(b) => b,
                        Err(e) => {
                            metrics::counter!("walcast_cdc_filter_errors_total").increment(1);
                            tracing::debug!(sub = %sub.spec.id, error = %e, "filter could not be evaluated; not delivered");
                            false
                        }
                    },
                };
                if pass {
                    out.push(sub.clone());
                }
            }
        }
        out
    }
}

fn remove_from_key(st: &mut State, old: &Arc<Sub>) {
    let key = key_of(&old.spec);
    if let Some(v) = st.by_key.get_mut(&key) {
        v.retain(|s| !Arc::ptr_eq(s, old));
        if v.is_empty() {
            st.by_key.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_protocol::filter::SliceRecord;

    fn ids(v: Vec<Arc<Sub>>) -> Vec<String> {
        v.iter().map(|s| s.spec.id.clone()).collect()
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
    fn sync_and_expiry_drop_subscriptions() {
        let m = Matcher::default();
        add(&m, "f:1", Some("t"), "*", None, 0);
        add(&m, "f:2", Some("t"), "*", None, 0);
        m.sync("f", &["f:2".to_string()]);
        assert_eq!(m.len(), 1);
        assert_eq!(m.expire_fronts(Duration::from_secs(60)), 0);
        assert_eq!(m.expire_fronts(Duration::ZERO), 1);
        assert!(m.is_empty());
        m.remove(&["nope".into()]);
    }
}
