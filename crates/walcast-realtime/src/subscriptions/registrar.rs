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
use walcast_protocol::filter::{CompiledFilter, Filter};
use walcast_wal2json::Lsn;

use crate::error::RealtimeError;
use crate::subscriptions::fronts::FrontsRecord;
use crate::subscriptions::matcher::{Matcher, Sub};
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
        // that position is decoded after the subscription was there.
        let placeholder = Lsn(u64::MAX);
        let mut refused = self.inner.matcher.insert_all(
            accepted
                .iter()
                .map(|(spec, filter)| Sub::new(spec.clone(), filter.clone(), placeholder))
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

/// Most entries a binding's `select` may have (Postgres' limit of columns per table).
pub const MAX_SELECT_COLUMNS: usize = 1600;
/// Longest `select` entry, in bytes (Postgres cuts names at 63).
pub const MAX_SELECT_NAME: usize = 63;

fn describe(spec: &SubscriptionSpec) -> String {
    format!(
        "[event: {}, schema: {}, table: {}, filters: {}]",
        spec.event,
        spec.schema,
        spec.table.as_deref().unwrap_or("*"),
        spec.filter.as_deref().unwrap_or("")
    )
}

/// (schema, table, role) → the table's columns: name, typname, readable by the role.
type ColumnCache = HashMap<(String, String, String), Vec<(String, String, bool)>>;

/// (schema, table, role) → its changes are never row-checked for that role.
type RowCheckCache = HashMap<(String, String, String), bool>;

/// Whether every change a spec matches is delivered by class (see
/// [`RegisterResult::by_class`]): one table without row-level security for the role —
/// the same rule the pipeline applies per change (`authorize`; a DELETE is judged per
/// subscriber like any other change).
async fn by_class(
    client: &Client,
    spec: &SubscriptionSpec,
    memo: &mut RowCheckCache,
) -> Result<bool, tokio_postgres::Error> {
    let Some(table) = spec.table.as_deref().filter(|_| spec.schema != "*") else {
        return Ok(false);
    };
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let key = (spec.schema.clone(), table.to_string(), role.to_string());
    if let Some(known) = memo.get(&key) {
        return Ok(*known);
    }
    let unchecked = client
        .query_opt(
            "SELECT NOT c.relrowsecurity OR coalesce(r.rolbypassrls, false)
               FROM pg_class c LEFT JOIN pg_roles r ON r.rolname = $2
              WHERE c.oid = to_regclass($1)",
            &[&walcast_core::sql::qualified(&spec.schema, table), &role],
        )
        .await?
        .is_some_and(|r| r.get::<_, bool>(0));
    memo.insert(key, unchecked);
    Ok(unchecked)
}

/// What a subscription is told when its table was dropped.
pub(crate) fn dropped_message(schema: &str, table: &str) -> String {
    format!("Table {schema}.{table} was dropped: this subscription has ended")
}

/// A subscription already in effect at its front (`from` set: registered again in the
/// background or for a new leader) whose table no longer exists was ended by a DROP: it
/// is told so, as the worker's notice of the drop would, whichever arrives first. A new
/// join of a missing table gets Supabase's generic refusal instead.
async fn dropped(
    client: &Client,
    spec: &SubscriptionSpec,
) -> Result<Option<String>, tokio_postgres::Error> {
    let (Some(_), Some(table)) = (spec.from, spec.table.as_deref()) else {
        return Ok(None);
    };
    if spec.schema == "*" {
        return Ok(None);
    }
    let name = walcast_core::sql::qualified(&spec.schema, table);
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
        .await?
        .get(0);
    Ok((!exists).then(|| dropped_message(&spec.schema, table)))
}

/// Check a spec; `Ok(Err(message))` is a refusal to send to the client.
async fn validate(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    columns: &mut ColumnCache,
) -> Result<Result<Option<CompiledFilter>, String>, tokio_postgres::Error> {
    let unable = || {
        format!(
            "Unable to subscribe to changes with given parameters. Please check Realtime is enabled for the given connect parameters: {}",
            describe(spec)
        )
    };
    if !matches!(spec.event.as_str(), "*" | "INSERT" | "UPDATE" | "DELETE") {
        return Ok(Err(unable()));
    }
    let covered = enabled.iter().any(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    if !covered {
        return Ok(Err(dropped(client, spec).await?.unwrap_or_else(unable)));
    }
    let filter = match spec
        .filter
        .as_deref()
        .map(str::trim)
        .filter(|f| !f.is_empty())
    {
        None => None,
        Some(text) => match Filter::parse(text) {
            Ok(f) => Some(f),
            Err(e) => return Ok(Err(format!("Error parsing `filter` params: {e}"))),
        },
    };
    if let Some(f) = &filter {
        if let Err(message) = check_filter(client, spec, enabled, f, columns).await? {
            return Ok(Err(message));
        }
    }
    if let Err(message) = check_select(client, spec, enabled, columns).await? {
        return Ok(Err(message));
    }
    // Its patterns compiled once, here, for every change it is evaluated on.
    match filter.map(CompiledFilter::new).transpose() {
        Ok(compiled) => Ok(Ok(compiled)),
        Err(e) => Ok(Err(format!("Error parsing `filter` params: {e}"))),
    }
}

/// A `select` of at most [`MAX_SELECT_COLUMNS`] names of at most [`MAX_SELECT_NAME`] bytes.
pub fn select_bounds(select: &[String]) -> Result<(), String> {
    if select.len() > MAX_SELECT_COLUMNS {
        return Err(format!(
            "Error parsing `select` params: {} columns (at most {MAX_SELECT_COLUMNS})",
            select.len()
        ));
    }
    match select.iter().find(|c| c.trim().len() > MAX_SELECT_NAME) {
        Some(_) => Err(format!(
            "Error parsing `select` params: a column name is longer than {MAX_SELECT_NAME} bytes"
        )),
        None => Ok(()),
    }
}

/// Every `select` name must be a column of the table (of at least one table a wildcard
/// covers), as Postgres would refuse `SELECT x FROM t`. `Ok(Err(message))`: refused.
async fn check_select(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    columns: &mut ColumnCache,
) -> Result<Result<(), String>, tokio_postgres::Error> {
    let Some(select) = spec.select.as_deref() else {
        return Ok(Ok(()));
    };
    if let Err(message) = select_bounds(select) {
        return Ok(Err(message));
    }
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let mut unknown = walcast_bus::subs::selected(spec).unwrap_or_default();
    let tables = enabled.iter().filter(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    for t in tables {
        if unknown.is_empty() {
            break;
        }
        let cols = table_columns(client, t, role, columns).await?;
        unknown.retain(|c| !cols.iter().any(|(n, _, _)| n == c));
    }
    Ok(match unknown.first() {
        Some(c) => Err(format!(
            "Error parsing `select` params: column \"{c}\" does not exist"
        )),
        None => Ok(()),
    })
}

/// A filter is evaluated on every change of the tables it covers: its columns must exist
/// there with a type it fits, and the subscriber's role must be allowed to read them (or
/// matching would reveal values the role cannot SELECT). `Ok(Err(message))`: refused.
async fn check_filter(
    client: &Client,
    spec: &SubscriptionSpec,
    enabled: &[realtime_tables::TableRef],
    f: &Filter,
    columns: &mut ColumnCache,
) -> Result<Result<(), String>, tokio_postgres::Error> {
    let role = spec
        .claims
        .get("role")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    let tables = enabled.iter().filter(|t| {
        (spec.schema == "*" || spec.schema == t.schema)
            && spec.table.as_deref().is_none_or(|name| name == t.table)
    });
    for t in tables {
        let cols = table_columns(client, t, role, columns).await?;
        for c in &f.conditions {
            if cols
                .iter()
                .any(|(n, _, readable)| *n == c.column && !readable)
            {
                return Ok(Err(format!(
                    "Error parsing `filter` params: permission denied for column {:?} of {} (role {:?} may not read it)",
                    c.column, t, role
                )));
            }
        }
        if spec.table.is_none() || spec.schema == "*" {
            // A wildcard: tables without the column simply never match.
            continue;
        }
        let lookup = |name: &str| {
            cols.iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, t, _)| t.as_str())
        };
        if let Err(e) = f.validate(lookup) {
            return Ok(Err(format!("Error parsing `filter` params: {e}")));
        }
    }
    Ok(Ok(()))
}

/// A table's columns (name, type, readable by `role`), read once per request.
async fn table_columns<'a>(
    client: &Client,
    t: &realtime_tables::TableRef,
    role: &str,
    columns: &'a mut ColumnCache,
) -> Result<&'a [(String, String, bool)], tokio_postgres::Error> {
    let key = (t.schema.clone(), t.table.clone(), role.to_string());
    if !columns.contains_key(&key) {
        let rows = client
            .query(
                "SELECT a.attname::text, t.typname::text,
                        coalesce((SELECT has_column_privilege(r.oid, a.attrelid, a.attnum, 'SELECT')
                                    FROM pg_roles r WHERE r.rolname = $3), false)
                   FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
                  WHERE a.attrelid = format('%I.%I', $1::text, $2::text)::regclass
                    AND a.attnum > 0 AND NOT a.attisdropped",
                &[&t.schema, &t.table, &role],
            )
            .await?;
        let read = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        columns.insert(key.clone(), read);
    }
    Ok(columns.get(&key).map(Vec::as_slice).unwrap_or_default())
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
