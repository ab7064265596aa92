//! The front's side of the subscription registry: its subscriptions by number and by
//! class.
//!
//! Every `postgres_changes` binding of a joined channel (or SSE stream) gets a
//! subscription id `<front id>:<n>`, registered with the cdc-worker (by the
//! `registration` module), which names in each change's `subs` the ids or the classes
//! ([`walcast_bus::subs::class_key`]) it matched. This map turns those back into the channels to deliver to
//! and the binding ids the client knows. It also remembers which classes the worker
//! delivers by class ("ready"), so a join of one more subscription of such a class needs
//! no round trip to the worker.
//!
//! A class is its [`ClassFields`]; the key only names it. A subscription whose key names
//! a class of other fields (a collision, or a forged key) is refused, never merged: every
//! member of a class, and so everyone a change named by class reaches, has the class's
//! role, filter and columns.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use walcast_bus::source::DEFAULT_SOURCE;
use walcast_bus::subs::{is_class_key, ClassFields, SubscriptionSpec, SYNC_INTERVAL};
use walcast_core::Lsn;
use walcast_protocol::PgChangeBinding;

use crate::subscription::sink::{FastHash, SinkRef};
use crate::telemetry;

/// How long the worker's word that a class is delivered by class is trusted without
/// being heard again (every registration of the class repeats it): a table that turned
/// on row-level security since is noticed within this time.
pub(crate) const READY_TTL: Duration = SYNC_INTERVAL;

pub(crate) struct Target {
    pub sink: SinkRef,
    /// The binding id the client knows (the join reply's `id`).
    pub binding: u32,
    pub spec: SubscriptionSpec,
    /// The source its project is on: its leader is the one that delivers it.
    pub source: String,
}

/// A class the worker delivers by class key, and has registered subscriptions of.
#[derive(Clone, Copy)]
struct Ready {
    /// Where its first subscription became effective.
    from: Lsn,
    /// When the worker last said so.
    confirmed: Instant,
    /// Its subscriptions the worker has registered (while there is one, the worker
    /// names the class in every change it matches, for this front).
    registered: usize,
}

/// The members of one class.
struct Members {
    fields: ClassFields,
    ns: Vec<u64>,
}

/// Why a subscription whose class key names a class with other fields is refused.
pub(crate) const COLLISION: &str = "Unable to subscribe to changes: its class key names a \
     class with other parameters (refused, never merged)";

/// Names a class by its fields ([`ClassFields::key`]; tests force collisions).
type KeyFn = fn(&ClassFields) -> String;

/// Targets by number, the members of each class (by key), which classes are ready, and
/// how many registrations of each class are still on their way to the worker.
struct Map {
    key: KeyFn,
    /// By our own ids (never a client's), hashed fast: looked up once per delivery.
    targets: HashMap<u64, Target, FastHash>,
    classes: HashMap<String, Members>,
    ready: HashMap<String, Ready>,
    /// Subscriptions the worker has registered as delivered by class.
    registered: std::collections::HashSet<u64>,
    pending: HashMap<String, usize>,
}

/// What [`Registry::remove`] took out: ids to unregister, and their classes.
#[derive(Default)]
pub(crate) struct Removed {
    pub ids: Vec<String>,
    /// The source of each of `ids` (same order; missing ones: the default source).
    pub sources: Vec<String>,
    pub classes: Vec<String>,
    /// A registration of one of these classes is on its way to the worker: unregister
    /// only once it arrived (see `registration::Registration::unregister`).
    pub wait: bool,
}

impl Removed {
    /// The ids, grouped by their source.
    pub(crate) fn by_source(self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut sources = self.sources.into_iter();
        for id in self.ids {
            let source = sources.next().unwrap_or_else(|| DEFAULT_SOURCE.to_string());
            out.entry(source).or_default().push(id);
        }
        out
    }
}

impl Map {
    fn new(key: KeyFn) -> Map {
        Map {
            key,
            targets: HashMap::default(),
            classes: HashMap::new(),
            ready: HashMap::new(),
            registered: Default::default(),
            pending: HashMap::new(),
        }
    }

    fn class_of(&self, spec: &SubscriptionSpec) -> String {
        (self.key)(&ClassFields::of(spec))
    }

    /// Add (or replace) a target; refused, and nothing changed, when its key names a
    /// class of other fields.
    fn insert(&mut self, n: u64, t: Target) -> Result<(), &'static str> {
        let fields = ClassFields::of(&t.spec);
        let class = (self.key)(&fields);
        if self.classes.get(&class).is_some_and(|m| m.fields != fields) {
            telemetry::error("class_collision");
            tracing::error!(%class, id = %t.spec.id, "a subscription's class key names a class with other fields: refused");
            return Err(COLLISION);
        }
        if self.targets.contains_key(&n) {
            self.remove(n);
        }
        self.targets.insert(n, t);
        let members = self.classes.entry(class).or_insert_with(|| Members {
            fields,
            ns: Vec::new(),
        });
        members.ns.push(n);
        Ok(())
    }

    fn remove(&mut self, n: u64) -> Option<Target> {
        let t = self.targets.remove(&n)?;
        let class = self.class_of(&t.spec);
        if self.registered.remove(&n) {
            if let Some(r) = self.ready.get_mut(&class) {
                r.registered = r.registered.saturating_sub(1);
                if r.registered == 0 {
                    self.ready.remove(&class);
                }
            }
        }
        self.unclass(n, &class);
        Some(t)
    }

    fn unclass(&mut self, n: u64, class: &str) {
        if let Some(m) = self.classes.get_mut(class) {
            m.ns.retain(|m| *m != n);
            if m.ns.is_empty() {
                self.classes.remove(class);
                self.ready.remove(class);
            }
        }
    }
}

pub(crate) struct Registry {
    prefix: String,
    next: AtomicU64,
    map: RwLock<Map>,
    /// Per source, the newest commit position of any change delivered to this front
    /// (positions of different sources are unrelated numbers).
    seen: Mutex<HashMap<String, Lsn>>,
    /// Woken whenever a registration on its way to the worker arrived (or gave up).
    settled: tokio::sync::Notify,
}

impl Registry {
    pub(crate) fn new(front_id: &str) -> Registry {
        Registry::with_keys(front_id, |f| f.key())
    }

    /// A registry naming classes with `key` (tests force collisions with it).
    fn with_keys(front_id: &str, key: KeyFn) -> Registry {
        Registry {
            prefix: format!("{front_id}:"),
            next: AtomicU64::new(1),
            map: RwLock::new(Map::new(key)),
            seen: Mutex::new(HashMap::new()),
            settled: tokio::sync::Notify::new(),
        }
    }

    /// A fresh subscription number and its id.
    pub(crate) fn alloc(&self) -> (u64, String) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        (n, format!("{}{n}", self.prefix))
    }

    /// The number of one of our own ids (`None` for other fronts' ids).
    pub(crate) fn own(&self, id: &str) -> Option<u64> {
        id.strip_prefix(&self.prefix)?.parse().ok()
    }

    /// Add a target; `Err`: refused (its class key names a class with other fields).
    pub(crate) fn insert(&self, n: u64, t: Target) -> Result<(), &'static str> {
        self.write().insert(n, t)
    }

    /// The key of a subscription's class.
    pub(crate) fn class_of(&self, spec: &SubscriptionSpec) -> String {
        self.read().class_of(spec)
    }

    /// Remove subscriptions; returns their ids and classes.
    pub(crate) fn remove(&self, ns: &[u64]) -> Removed {
        let mut g = self.write();
        let mut out = Removed::default();
        for n in ns {
            if let Some(t) = g.remove(*n) {
                out.classes.push(g.class_of(&t.spec));
                out.ids.push(t.spec.id);
                out.sources.push(t.source);
            }
        }
        out.classes.sort_unstable();
        out.classes.dedup();
        out.wait = out.classes.iter().any(|c| g.pending.contains_key(c));
        out
    }

    /// A change of `source` for this front arrived (whatever it is delivered to).
    pub(crate) fn saw(&self, source: &str, at: Lsn) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.get_mut(source) {
            Some(s) => *s = (*s).max(at),
            None => {
                seen.insert(source.to_string(), at);
            }
        }
    }

    /// The newest commit position seen of `source`.
    fn seen(&self, source: &str) -> Lsn {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(source).copied().unwrap_or(Lsn(0))
    }

    /// Join one more subscription of this class without asking the worker, if the class
    /// is ready: the worker has registered a subscription of it that it delivers by class
    /// (so it names the class in every change it matches, for this front), as it said
    /// within [`READY_TTL`]. Returns the position the new subscription is effective from:
    /// every change of its `source` committed after this call is newer than every change
    /// of that source seen so far, so
    /// it is delivered (older ones still in flight may be too). The claim counts as a
    /// registration on its way until [`Registry::end_pending`]. Only a class whose fields
    /// are the spec's is claimed (never one its key merely names). Returns the class's key
    /// too.
    pub(crate) fn claim_ready(
        &self,
        spec: &SubscriptionSpec,
        source: &str,
    ) -> Option<(Lsn, String)> {
        let seen = self.seen(source);
        let mut g = self.write();
        let fields = ClassFields::of(spec);
        let class = (g.key)(&fields);
        if g.classes.get(&class).is_none_or(|m| m.fields != fields) {
            return None;
        }
        let r = *g.ready.get(&class)?;
        if r.registered == 0 || r.confirmed.elapsed() >= READY_TTL {
            return None;
        }
        *g.pending.entry(class.clone()).or_default() += 1;
        Some((r.from.max(seen), class))
    }

    /// The worker accepted one of our subscriptions: note whether it delivers it by class
    /// (`from`: where it became effective).
    pub(crate) fn confirm(&self, id: &str, by_class: bool, from: Lsn) {
        let Some(n) = self.own(id) else {
            return;
        };
        let mut g = self.write();
        let Some(class) = g.targets.get(&n).map(|t| g.class_of(&t.spec)) else {
            return;
        };
        if !by_class {
            g.ready.remove(&class);
            g.registered.remove(&n);
            return;
        }
        let now = Instant::now();
        let fresh = g.registered.insert(n);
        let r = g.ready.entry(class).or_insert(Ready {
            from,
            confirmed: now,
            registered: 0,
        });
        r.confirmed = now;
        r.registered += usize::from(fresh);
    }

    /// … and arrived (or gave up).
    pub(crate) fn end_pending(&self, classes: &[String]) {
        let mut g = self.write();
        for c in classes {
            if let Some(n) = g.pending.get_mut(c) {
                *n -= 1;
                if *n == 0 {
                    g.pending.remove(c);
                }
            }
        }
        drop(g);
        self.settled.notify_waiters();
    }

    /// Whether a registration of one of these classes is on its way to the worker.
    pub(crate) fn any_pending(&self, classes: &[String]) -> bool {
        let g = self.read();
        classes.iter().any(|c| g.pending.contains_key(c))
    }

    /// Wait (at most `limit`) until no registration of these classes is on its way.
    pub(crate) async fn settle(&self, classes: &[String], limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let woken = self.settled.notified();
            if !self.any_pending(classes) {
                return;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return;
            }
        }
    }

    /// The target a subscription number points to, if still there.
    pub(crate) fn sink_of(&self, n: u64) -> Option<(SinkRef, SubscriptionSpec)> {
        let g = self.read();
        g.targets.get(&n).map(|t| (t.sink.clone(), t.spec.clone()))
    }

    /// Replace the claims of these subscriptions (their role, hence class, can change);
    /// returns their updated specs, and the ids of those removed instead because their new
    /// class key names a class of other fields.
    pub(crate) fn set_claims(
        &self,
        ns: &[u64],
        claims: &Value,
    ) -> (Vec<SubscriptionSpec>, Vec<String>) {
        let claims = Arc::new(claims.clone());
        let mut g = self.write();
        let (mut specs, mut refused) = (Vec::new(), Vec::new());
        for n in ns {
            let Some(mut t) = g.remove(*n) else {
                continue;
            };
            t.spec.claims = claims.clone();
            let spec = t.spec.clone();
            match g.insert(*n, t) {
                Ok(()) => specs.push(spec),
                Err(_) => refused.push(spec.id),
            }
        }
        (specs, refused)
    }

    /// Group the targets of a change's `subs` by sink: `(sink, binding ids deduplicated)`.
    /// An id is a subscription id of ours or a class key (every subscription of ours in
    /// that class that was in effect at the change: registered, and from a position
    /// before it). Targets of another project, table or event are skipped (tenant
    /// isolation does not rest on the worker alone); a class's members all have its
    /// fields (see `Map::insert`), so a class is checked once, not per member.
    pub(crate) fn groups(&self, ev: &walcast_bus::ChangeEvent) -> Vec<(SinkRef, Bindings)> {
        let (ids, at) = (&ev.subs, ev.commit_lsn);
        let g = self.read();
        let mut grouping = Grouping::default();
        for id in ids {
            if !is_class_key(id) {
                let t = self.own(id).and_then(|n| g.targets.get(&n));
                if let Some(t) = t.filter(|t| may_carry(&ClassView::of(&t.spec), ev)) {
                    grouping.add(t);
                }
                continue;
            }
            let Some(m) = g.classes.get(id) else {
                continue;
            };
            if !may_carry(&ClassView::of_fields(&m.fields), ev) {
                continue;
            }
            grouping.reserve(m.ns.len());
            let members = m.ns.iter().filter_map(|n| g.targets.get(n));
            for t in members.filter(|t| t.spec.from.is_some_and(|from| at > from)) {
                grouping.add(t);
            }
        }
        grouping.out
    }

    /// Note where these subscriptions became effective, unless they already were.
    pub(crate) fn set_from(&self, ids: &[String], at: Lsn) {
        let mut g = self.write();
        for n in ids.iter().filter_map(|id| self.own(id)) {
            if let Some(t) = g.targets.get_mut(&n) {
                t.spec.from.get_or_insert(at);
            }
        }
    }

    /// Every subscription id, by the source its project is on.
    pub(crate) fn ids_by_source(&self) -> HashMap<String, Vec<String>> {
        let mut out: HashMap<String, Vec<String>> = HashMap::new();
        for t in self.read().targets.values() {
            out.entry(t.source.clone())
                .or_default()
                .push(t.spec.id.clone());
        }
        out
    }

    /// The specs of the subscriptions of projects on `source`.
    pub(crate) fn specs_of(&self, source: &str) -> Vec<SubscriptionSpec> {
        self.read()
            .targets
            .values()
            .filter(|t| t.source == source)
            .map(|t| t.spec.clone())
            .collect()
    }

    /// The source of one of our subscriptions, if still there.
    pub(crate) fn source_of(&self, id: &str) -> Option<String> {
        let n = self.own(id)?;
        self.read().targets.get(&n).map(|t| t.source.clone())
    }

    /// Every sink with a subscription of a project on `source`, once each, with its
    /// project (a sink serves one project).
    pub(crate) fn sinks_of(&self, source: &str) -> Vec<(SinkRef, String)> {
        let g = self.read();
        let mut seen = std::collections::HashSet::new();
        g.targets
            .values()
            .filter(|t| t.source == source && seen.insert(t.sink.id()))
            .map(|t| (t.sink.clone(), t.spec.project.clone()))
            .collect()
    }

    /// The sources of the projects with a subscription here (each name copied once, not
    /// once per subscription: this runs every second over all of them).
    pub(crate) fn sources(&self) -> std::collections::BTreeSet<String> {
        let g = self.read();
        let names: std::collections::BTreeSet<&str> =
            g.targets.values().map(|t| t.source.as_str()).collect();
        names.into_iter().map(str::to_owned).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.read().targets.len()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Map> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Map> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a subscription asks for this change's table and event.
/// The binding ids of one sink a change is delivered to (nearly always one).
pub(crate) type Bindings = smallvec::SmallVec<[u32; 2]>;

/// A change's targets grouped by sink, in the order first seen.
#[derive(Default)]
struct Grouping {
    index: HashMap<u64, usize, FastHash>,
    out: Vec<(SinkRef, Bindings)>,
}

impl Grouping {
    fn reserve(&mut self, n: usize) {
        self.index.reserve(n);
        self.out.reserve(n);
    }

    fn add(&mut self, t: &Target) {
        let out = &mut self.out;
        let slot = *self.index.entry(t.sink.id()).or_insert_with(|| {
            out.push((t.sink.clone(), Bindings::new()));
            out.len() - 1
        });
        let ids = &mut out[slot].1;
        if !ids.contains(&t.binding) {
            ids.push(t.binding);
        }
    }
}

/// What decides whether a subscription (or its whole class) may receive a change.
struct ClassView<'a> {
    project: &'a str,
    schema: &'a str,
    table: Option<&'a str>,
    event: &'a str,
}

impl<'a> ClassView<'a> {
    fn of(spec: &'a SubscriptionSpec) -> Self {
        let table = spec.table.as_deref();
        ClassView::new(&spec.project, &spec.schema, table, &spec.event)
    }

    fn of_fields(f: &'a ClassFields) -> Self {
        ClassView::new(&f.project, &f.schema, f.table.as_deref(), &f.event)
    }

    fn new(project: &'a str, schema: &'a str, table: Option<&'a str>, event: &'a str) -> Self {
        ClassView {
            project,
            schema,
            table,
            event,
        }
    }
}

/// Whether `c` may receive `ev`: its project, and a table and event it covers; else
/// counted (only a worker's bug, a forged or a colliding class key could name it).
fn may_carry(c: &ClassView<'_>, ev: &walcast_bus::ChangeEvent) -> bool {
    if c.project != ev.project {
        telemetry::error("cross_project_event");
        return false;
    }
    let covers = (c.schema == "*" || c.schema == ev.schema)
        && c.table.is_none_or(|t| t == ev.table)
        && (c.event == "*" || c.event.eq_ignore_ascii_case(ev.kind.as_str()));
    if !covers {
        telemetry::error("class_mismatch");
    }
    covers
}

/// The spec registered for one binding.
pub(crate) fn spec_for(
    id: String,
    front: &str,
    project: &str,
    b: &PgChangeBinding,
    claims: &Arc<Value>,
) -> SubscriptionSpec {
    SubscriptionSpec {
        id,
        front: front.to_string(),
        project: project.to_string(),
        schema: b.schema.clone(),
        table: b.table.clone(),
        event: b.event.to_ascii_uppercase(),
        filter: b.filter.clone().filter(|f| !f.trim().is_empty()),
        select: b.select.clone(),
        claims: claims.clone(),
        from: None,
    }
}

#[cfg(test)]
mod tests;
