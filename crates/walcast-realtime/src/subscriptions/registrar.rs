//! The worker side of the subscription registry: validates what fronts register against
//! the realtime tables and the table's columns, then adds it to the [`Matcher`].

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Mutex;
use tokio_postgres::Client;
use walcast_bus::subs::{
    BoxFuture, RegisterReply, RegisterRequest, RegisterResult, SubsHandler, SubscriptionSpec,
    SyncMessage, UnregisterRequest,
};
use walcast_core::source_scope;
use walcast_protocol::filter::CompiledFilter;
use walcast_wal2json::Lsn;

use crate::error::RealtimeError;
use crate::subscriptions::fronts::FrontsRecord;
use crate::subscriptions::matcher::{Matcher, Sub};
use crate::subscriptions::validate::{by_class, validate, ColumnCache, RowCheckCache};
use walcast_control::roles::{RolePolicy, RoleRefused};
use walcast_control::tables as realtime_tables;

#[derive(Clone)]
pub struct Registrar {
    inner: Arc<Inner>,
}

/// A registration waiting for the connection, and where its reply goes.
type Queued = (RegisterRequest, tokio::sync::oneshot::Sender<RegisterReply>);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Inner {
    matcher: Arc<Matcher>,
    queue: std::sync::Mutex<Vec<Queued>>,
    /// Sync lists arriving in parts: front → (round, ids so far).
    partial: std::sync::Mutex<HashMap<String, (u64, Vec<String>)>>,
    database_url: String,
    client: Mutex<Option<Client>>,
    fronts: Arc<FrontsRecord>,
    /// The roles a subscription's token may act as.
    roles: RolePolicy,
    /// The projects of this registrar's source (`None`: all).
    projects: Option<Arc<walcast_control::source_projects::SourceProjects>>,
}

impl Registrar {
    pub fn new(matcher: Arc<Matcher>, database_url: String, roles: RolePolicy) -> Registrar {
        Registrar {
            inner: Arc::new(Inner {
                matcher,
                queue: Default::default(),
                partial: Default::default(),
                database_url,
                client: Mutex::new(None),
                fronts: Default::default(),
                roles,
                projects: None,
            }),
        }
    }

    /// A registrar that refuses subscriptions of projects not on its source.
    pub fn for_source(
        matcher: Arc<Matcher>,
        database_url: String,
        roles: RolePolicy,
        projects: Arc<walcast_control::source_projects::SourceProjects>,
    ) -> Registrar {
        let mut r = Registrar::new(matcher, database_url, roles);
        if let Some(inner) = Arc::get_mut(&mut r.inner) {
            inner.projects = Some(projects);
        }
        r
    }

    /// Why `spec` is refused before its table is looked at: its token's role, or its
    /// project on another source.
    async fn refusal(
        &self,
        client: &Client,
        spec: &SubscriptionSpec,
        roles: &mut HashMap<String, Result<(), RoleRefused>>,
    ) -> Result<Option<String>, RealtimeError> {
        let role = self.inner.roles.check_memo(client, &spec.claims, roles);
        if let Err(refused) = role.await? {
            return Ok(Some(refused.to_string()));
        }
        if !self.on_source(&spec.project).await? {
            return Ok(Some(format!(
                "project {:?} is not on this source",
                spec.project
            )));
        }
        Ok(None)
    }

    /// Whether `project` is on this registrar's source (always, without a source).
    async fn on_source(&self, project: &str) -> Result<bool, RealtimeError> {
        let Some(p) = &self.inner.projects else {
            return Ok(true);
        };
        let on = p.schema_of(project).await?.is_some();
        if !on {
            p.foreign(project, "registration");
        }
        Ok(on)
    }

    pub fn matcher(&self) -> &Arc<Matcher> {
        &self.inner.matcher
    }

    /// The fronts recorded for the next leader (see [`crate::subscriptions::fronts`]).
    pub fn fronts(&self) -> &Arc<FrontsRecord> {
        &self.inner.fronts
    }

    /// Registrations arriving while one is being handled wait for the connection and are
    /// then handled together (one catalog read per table and role, one WAL position for
    /// all): a burst of joins costs a few round trips, not two per join.
    async fn register_all(&self, req: RegisterRequest) -> RegisterReply {
        let (tx, rx) = tokio::sync::oneshot::channel();
        lock(&self.inner.queue).push((req, tx));
        let mut client = self.inner.client.lock().await;
        let batch = std::mem::take(&mut *lock(&self.inner.queue));
        if !batch.is_empty() {
            self.register_batch(&mut client, batch).await;
        }
        drop(client);
        rx.await.unwrap_or_default()
    }

    async fn register_batch(&self, client: &mut Option<Client>, batch: Vec<Queued>) {
        let sizes: Vec<usize> = batch.iter().map(|(r, _)| r.subs.len()).collect();
        let (reqs, replies): (Vec<RegisterRequest>, Vec<_>) = batch.into_iter().unzip();
        let all = RegisterRequest {
            subs: reqs.into_iter().flat_map(|r| r.subs).collect(),
        };
        metrics::histogram!(crate::telemetry::REGISTRATION_BATCH).record(all.subs.len() as f64);
        let reply = match self.try_register_all(client, &all).await {
            Ok(reply) => reply,
            Err(e) => {
                // The connection is suspect: reconnect next time.
                *client = None;
                tracing::error!(error = %e, "subscription registration failed");
                RegisterReply {
                    results: all
                        .subs
                        .iter()
                        .map(|s| RegisterResult {
                            id: s.id.clone(),
                            ok: false,
                            error: Some(format!(
                                "Unable to subscribe to changes: database error: {e}"
                            )),
                            by_class: false,
                        })
                        .collect(),
                    effective_from: None,
                }
            }
        };
        let mut results = reply.results.into_iter();
        for (n, tx) in sizes.into_iter().zip(replies) {
            let _ = tx.send(RegisterReply {
                results: results.by_ref().take(n).collect(),
                effective_from: reply.effective_from,
            });
        }
    }

    async fn try_register_all(
        &self,
        guard: &mut Option<Client>,
        req: &RegisterRequest,
    ) -> Result<RegisterReply, RealtimeError> {
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(walcast_pgtls::connect(&self.inner.database_url).await?);
        }
        let Some(client) = guard.as_ref() else {
            return Ok(RegisterReply::default());
        };
        let mut enabled: HashMap<String, Vec<realtime_tables::TableRef>> = HashMap::new();
        // A join's bindings mostly share table and role: read their columns once.
        let mut columns: ColumnCache = HashMap::new();
        let mut unchecked: RowCheckCache = HashMap::new();
        let mut roles: HashMap<String, Result<(), RoleRefused>> = HashMap::new();
        let mut results = Vec::with_capacity(req.subs.len());
        let mut accepted = Vec::new();
        for spec in &req.subs {
            if let Some(why) = self.refusal(client, spec, &mut roles).await? {
                results.push(RegisterResult {
                    id: spec.id.clone(),
                    ok: false,
                    error: Some(format!("Unable to subscribe to changes: {why}")),
                    by_class: false,
                });
                continue;
            }
            if !enabled.contains_key(&spec.project) {
                let tables = realtime_tables::list(client, Some(&spec.project)).await?;
                enabled.insert(spec.project.clone(), tables);
            }
            let tables = enabled
                .get(&spec.project)
                .map(Vec::as_slice)
                .unwrap_or_default();
            match validate(client, spec, tables, &mut columns).await? {
                Ok(filter) => {
                    accepted.push((spec.clone(), filter));
                    results.push(RegisterResult {
                        id: spec.id.clone(),
                        ok: true,
                        error: None,
                        by_class: by_class(client, spec, &mut unchecked).await?,
                    });
                }
                Err(message) => results.push(RegisterResult {
                    id: spec.id.clone(),
                    ok: false,
                    error: Some(message),
                    by_class: false,
                }),
            }
        }
        let (at, refused) = self.place(client, accepted).await?;
        let refused: HashMap<String, String> = refused.into_iter().collect();
        for r in &mut results {
            if let Some(why) = refused.get(&r.id) {
                r.ok = false;
                r.by_class = false;
                r.error = Some(why.clone());
            }
        }
        Ok(RegisterReply {
            results,
            effective_from: Some(at),
        })
    }

    /// Put accepted subscriptions into the matcher; returns the position they are
    /// effective from, and those the matcher refused (see [`Matcher::insert_all`]).
    async fn place(
        &self,
        client: &Client,
        accepted: Vec<(SubscriptionSpec, Option<CompiledFilter>)>,
    ) -> Result<(Lsn, Vec<crate::subscriptions::matcher::Refusal>), RealtimeError> {
        // A new front is recorded before its registration is answered, so a leader that
        // takes over after the answer waits for it.
        let fronts = accepted.iter().map(|(s, _)| s.front.as_str());
        if let Err(e) = self.inner.fronts.record(client, fronts).await {
            tracing::warn!(error = %e, "cannot record a new front (a takeover may not wait for it)");
        }
        // Into the index first, then read the position: any transaction committing after
        // that position is decoded after the subscription was there. A new subscription
        // matches nothing until then; one registered before (a resync, a token refresh)
        // replaces itself at once at the position it already had, so the changes decoded
        // while its registration waits for the position still reach it.
        let placeholder = Lsn(u64::MAX);
        let mut refused = self.inner.matcher.insert_all(
            accepted
                .iter()
                .map(|(spec, filter)| {
                    let from = spec.from.unwrap_or(placeholder);
                    Sub::new(spec.clone(), filter.clone(), from)
                })
                .collect(),
        );
        let accepted: Vec<_> = accepted
            .into_iter()
            .filter(|(spec, _)| !refused.iter().any(|(id, _)| *id == spec.id))
            .collect();
        let count = accepted.len();
        let at: String = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0);
        let at: Lsn = at.parse().unwrap_or_default();
        // Registered before (a resync, a token refresh): keep its position, so a replayed
        // backlog is matched as it was the first time.
        refused.extend(
            self.inner.matcher.insert_all(
                accepted
                    .into_iter()
                    .map(|(spec, filter)| {
                        let from = spec.from.map_or(at, |f| f.min(at));
                        Sub::new(spec, filter, from)
                    })
                    .collect(),
            ),
        );
        metrics::counter!(crate::telemetry::SUBSCRIPTIONS_REGISTERED).increment(count as u64);
        Ok((at, refused))
    }
}

// Each call is work for the registrar's source (its metrics carry `source`), also when a
// front in the same process calls it directly.
impl SubsHandler for Registrar {
    fn register(&self, req: RegisterRequest) -> BoxFuture<RegisterReply> {
        let this = self.clone();
        let source = self.source().to_string();
        Box::pin(source_scope::within(&source, async move {
            this.register_all(req).await
        }))
    }

    fn unregister(&self, req: UnregisterRequest) {
        source_scope::within_sync(self.source(), || self.inner.matcher.remove(&req.ids));
    }

    fn sync(&self, msg: SyncMessage) {
        source_scope::within_sync(self.source(), || self.sync_now(msg));
    }
}

impl Registrar {
    /// The source whose subscriptions it answers for.
    fn source(&self) -> &str {
        self.inner
            .projects
            .as_ref()
            .map_or(walcast_bus::source::DEFAULT_SOURCE, |p| p.source())
    }

    fn sync_now(&self, msg: SyncMessage) {
        let matcher = &self.inner.matcher;
        if msg.last && msg.round == 0 {
            matcher.sync(
                &msg.front,
                &msg.ids,
                crate::subscriptions::matcher::SYNC_GRACE,
            );
            return;
        }
        // A list in parts: gather a round, apply it when its last part came (a round cut
        // short by a lost part is replaced by the next one, dropping nothing meanwhile).
        matcher.touch(&msg.front);
        let mut partial = self.inner.partial.lock().unwrap_or_else(|p| p.into_inner());
        let entry = partial
            .entry(msg.front.clone())
            .or_insert_with(|| (msg.round, Vec::new()));
        if entry.0 != msg.round {
            *entry = (msg.round, Vec::new());
        }
        entry.1.extend(msg.ids);
        if msg.last {
            if let Some((_, ids)) = partial.remove(&msg.front) {
                drop(partial);
                matcher.sync(&msg.front, &ids, crate::subscriptions::matcher::SYNC_GRACE);
            }
        }
    }
}
