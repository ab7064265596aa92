//! The front's side of the subscription registry.
//!
//! Every `postgres_changes` binding of a joined channel (or SSE stream) gets a
//! subscription id `<front id>:<n>`, registered with the cdc-worker, which puts the ids a
//! change matched into the event's `subs`. This map turns those ids back into the channel
//! to deliver to and the binding id the client knows. It also drives `sync` (every
//! [`SYNC_INTERVAL`]) and answers `resync` by registering everything again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use walcast_bus::subs::{
    class_key, is_class_key, RegisterRequest, ResyncProgress, SubsClient, SubscriptionSpec,
    SyncMessage, UnregisterRequest, SYNC_INTERVAL,
};
use walcast_bus::Subscription;
use walcast_protocol::PgChangeBinding;

use crate::outbound::ChanOut;
use crate::sse::SseChannel;
use crate::state::Shared;
use crate::telemetry;

/// Where a subscription's changes go.
#[derive(Clone)]
pub(crate) enum Sink {
    Ws(Arc<ChanOut>),
    Sse(Arc<SseChannel>),
}

impl Sink {
    pub(crate) fn id(&self) -> u64 {
        match self {
            Sink::Ws(c) => c.id,
            Sink::Sse(s) => s.id,
        }
    }
}

pub(crate) struct Target {
    pub sink: Sink,
    /// The binding id the client knows (the join reply's `id`).
    pub binding: u32,
    pub spec: SubscriptionSpec,
}

/// Targets by number, and the numbers of each class (see [`class_key`]).
#[derive(Default)]
struct Map {
    targets: HashMap<u64, Target>,
    classes: HashMap<String, Vec<u64>>,
}

impl Map {
    fn insert(&mut self, n: u64, t: Target) {
        let class = class_key(&t.spec);
        if let Some(old) = self.targets.insert(n, t) {
            self.unclass(n, &class_key(&old.spec));
        }
        self.classes.entry(class).or_default().push(n);
    }

    fn remove(&mut self, n: u64) -> Option<Target> {
        let t = self.targets.remove(&n)?;
        self.unclass(n, &class_key(&t.spec));
        Some(t)
    }

    fn unclass(&mut self, n: u64, class: &str) {
        if let Some(v) = self.classes.get_mut(class) {
            v.retain(|m| *m != n);
            if v.is_empty() {
                self.classes.remove(class);
            }
        }
    }
}

pub(crate) struct Registry {
    prefix: String,
    next: AtomicU64,
    map: RwLock<Map>,
}

impl Registry {
    pub(crate) fn new(front_id: &str) -> Registry {
        Registry {
            prefix: format!("{front_id}:"),
            next: AtomicU64::new(1),
            map: RwLock::new(Map::default()),
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

    pub(crate) fn insert(&self, n: u64, t: Target) {
        self.write().insert(n, t);
    }

    /// Remove subscriptions; returns their ids.
    pub(crate) fn remove(&self, ns: &[u64]) -> Vec<String> {
        let mut g = self.write();
        ns.iter()
            .filter_map(|n| g.remove(*n).map(|t| t.spec.id))
            .collect()
    }

    /// Replace the claims of these subscriptions (their role, hence class, can change);
    /// returns their updated specs.
    pub(crate) fn set_claims(&self, ns: &[u64], claims: &Value) -> Vec<SubscriptionSpec> {
        let mut g = self.write();
        ns.iter()
            .filter_map(|n| {
                let mut t = g.remove(*n)?;
                t.spec.claims = claims.clone();
                let spec = t.spec.clone();
                g.insert(*n, t);
                Some(spec)
            })
            .collect()
    }

    /// Group the targets of a change's `subs` by sink: `(sink, binding ids deduplicated)`.
    /// An id is a subscription id of ours or a class key (every subscription of ours in
    /// that class that was in effect at the change: registered, and from a position
    /// before it). Targets of another project, table or event are skipped (tenant
    /// isolation does not rest on the worker alone).
    pub(crate) fn groups(&self, ev: &walcast_bus::ChangeEvent) -> Vec<(Sink, Vec<u32>)> {
        let (project, ids, at) = (ev.project.as_str(), &ev.subs, ev.commit_lsn);
        let g = self.read();
        let mut index: HashMap<u64, usize> = HashMap::new();
        let mut out: Vec<(Sink, Vec<u32>)> = Vec::new();
        let targets = ids
            .iter()
            .flat_map(|id| -> Box<dyn Iterator<Item = &Target>> {
                if is_class_key(id) {
                    let members = g.classes.get(id).map(Vec::as_slice).unwrap_or_default();
                    Box::new(
                        members
                            .iter()
                            .filter_map(|n| g.targets.get(n))
                            .filter(move |t| t.spec.from.is_some_and(|from| at > from)),
                    )
                } else {
                    Box::new(self.own(id).and_then(|n| g.targets.get(&n)).into_iter())
                }
            });
        for t in targets {
            if t.spec.project != project {
                telemetry::error("cross_project_event");
                continue;
            }
            if !covers(&t.spec, ev) {
                // Only a class key collision (64-bit hash) could name it: never deliver a
                // change of another table or event.
                telemetry::error("class_mismatch");
                continue;
            }
            let slot = *index.entry(t.sink.id()).or_insert_with(|| {
                out.push((t.sink.clone(), Vec::new()));
                out.len() - 1
            });
            let ids = &mut out[slot].1;
            if !ids.contains(&t.binding) {
                ids.push(t.binding);
            }
        }
        out
    }

    /// Note where these subscriptions became effective, unless they already were.
    pub(crate) fn set_from(&self, ids: &[String], at: walcast_wal2json::Lsn) {
        let mut g = self.write();
        for n in ids.iter().filter_map(|id| self.own(id)) {
            if let Some(t) = g.targets.get_mut(&n) {
                t.spec.from.get_or_insert(at);
            }
        }
    }

    pub(crate) fn specs_of(&self, ns: &[u64]) -> Vec<SubscriptionSpec> {
        let g = self.read();
        ns.iter()
            .filter_map(|n| g.targets.get(n).map(|t| t.spec.clone()))
            .collect()
    }

    pub(crate) fn all_ids(&self) -> Vec<String> {
        self.read()
            .targets
            .values()
            .map(|t| t.spec.id.clone())
            .collect()
    }

    pub(crate) fn all_specs(&self) -> Vec<SubscriptionSpec> {
        self.read()
            .targets
            .values()
            .map(|t| t.spec.clone())
            .collect()
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
fn covers(spec: &SubscriptionSpec, ev: &walcast_bus::ChangeEvent) -> bool {
    (spec.schema == "*" || spec.schema == ev.schema)
        && spec.table.as_deref().is_none_or(|t| t == ev.table)
        && (spec.event == "*" || spec.event.eq_ignore_ascii_case(ev.kind.as_str()))
}

/// The spec registered for one binding.
pub(crate) fn spec_for(
    id: String,
    front: &str,
    project: &str,
    b: &PgChangeBinding,
    claims: &Value,
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

/// Register specs with the worker. `Ok` maps each refused id to the worker's reason;
/// `Err` is a readable reason the whole request failed (no answer in time …). An
/// accepted subscription keeps the position it first became effective from.
pub(crate) async fn register(
    shared: &Shared,
    specs: Vec<SubscriptionSpec>,
) -> Result<HashMap<String, String>, String> {
    if specs.is_empty() {
        return Ok(HashMap::new());
    }
    let ids: Vec<String> = specs.iter().map(|s| s.id.clone()).collect();
    let reply = shared
        .subs
        .register(RegisterRequest { subs: specs }, shared.cfg.register_timeout)
        .await
        .map_err(|e| {
            telemetry::error("register");
            e.to_string()
        })?;
    let mut refused = HashMap::new();
    let mut accepted = Vec::with_capacity(ids.len());
    for id in ids {
        match reply.results.iter().find(|r| r.id == id) {
            Some(r) if r.ok => accepted.push(id),
            Some(r) => {
                let why = r
                    .error
                    .clone()
                    .unwrap_or_else(|| "subscription refused by the cdc-worker".into());
                refused.insert(id, why);
            }
            None => {
                refused.insert(
                    id,
                    "the cdc-worker did not answer for this subscription".into(),
                );
            }
        }
    }
    if let Some(at) = reply.effective_from {
        shared.registry.set_from(&accepted, at);
    }
    Ok(refused)
}

/// Tell the worker these subscriptions are gone (errors are logged: `sync` repairs them).
pub(crate) async fn unregister(subs: &SubsClient, ids: Vec<String>) {
    if ids.is_empty() {
        return;
    }
    if let Err(e) = subs.unregister(UnregisterRequest { ids }).await {
        telemetry::error("unregister");
        tracing::warn!(error = %e, "unregister failed (the next sync repairs it)");
    }
}

/// Every [`SYNC_INTERVAL`]: send the full list of this front's subscription ids.
pub(crate) async fn sync_loop(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let msg = SyncMessage::whole(shared.front_id.clone(), shared.registry.all_ids());
        if let Err(e) = shared.subs.sync(msg).await {
            telemetry::error("sync");
            tracing::warn!(error = %e, "subscription sync failed");
        }
    }
}

/// On every resync request (a new worker leader), register everything again.
pub(crate) async fn resync_loop(
    shared: Arc<Shared>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    while let Some(request) = crate::next_message(&mut sub, &cancel, "resync").await {
        // The request's payload is where the new leader waits for our progress.
        let reply_to = std::str::from_utf8(&request.payload)
            .ok()
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        let progress = |done: bool| ResyncProgress {
            front: shared.front_id.clone(),
            done,
        };
        if let Some(to) = &reply_to {
            if let Err(e) = shared.subs.resync_progress(to, &progress(false)).await {
                tracing::warn!(error = %e, "cannot answer a resync request");
            }
        }
        let specs = shared.registry.all_specs();
        tracing::info!(
            count = specs.len(),
            "resync requested: registering all subscriptions again"
        );
        // In batches, so joins are not held behind one huge registration.
        for chunk in specs.chunks(shared.cfg.resync_batch.max(1)) {
            match register(&shared, chunk.to_vec()).await {
                Ok(refused) => {
                    for (id, why) in refused {
                        tracing::warn!(%id, reason = %why, "subscription refused on resync");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "resync registration failed"),
            }
        }
        if let Some(to) = &reply_to {
            if let Err(e) = shared.subs.resync_progress(to, &progress(true)).await {
                tracing::warn!(error = %e, "cannot report a finished resync");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subscription_covers_only_its_table_and_event() {
        let spec = SubscriptionSpec {
            id: "f:1".into(),
            front: "f".into(),
            project: "default".into(),
            schema: "public".into(),
            table: Some("todos".into()),
            event: "INSERT".into(),
            filter: None,
            select: None,
            claims: serde_json::json!({"role": "anon"}),
            from: None,
        };
        let ev = |table: &str, kind: &str| -> walcast_bus::ChangeEvent {
            serde_json::from_value(serde_json::json!({
                "project": "default", "schema": "public", "table": table, "type": kind,
                "commit_timestamp": "x", "commit_lsn": "0/1", "seq": 0, "columns": []
            }))
            .unwrap()
        };
        assert!(covers(&spec, &ev("todos", "INSERT")));
        assert!(!covers(&spec, &ev("todos", "DELETE")));
        assert!(!covers(&spec, &ev("secrets", "INSERT")));
        let all = SubscriptionSpec {
            schema: "*".into(),
            table: None,
            event: "*".into(),
            ..spec
        };
        assert!(covers(&all, &ev("secrets", "DELETE")));
    }
}
