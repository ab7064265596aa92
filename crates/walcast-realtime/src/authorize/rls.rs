//! Row-level security, checked as each subscriber.
//!
//! A subscriber receives an INSERT or UPDATE only if the table's policies for `SELECT`
//! let its role see *that version* of the row: the policies that apply to the role
//! ([`RlsChecker::role_facts`], read afresh for every batch, combined as Postgres does in
//! [`crate::authorize::policy`]) are evaluated on the version's own values, run with its JWT
//! `role` as the Postgres role and its claims in `request.jwt.claims` (both set with
//! `set_config(…, true)` and bound parameters, in a transaction that is always rolled
//! back). A version lacking a value its policies read is judged by its row instead (see
//! [`crate::authorize::check`]). Checks are batched. Only columns the role may `SELECT` are
//! sent. A DELETE is judged the same way on the row it deleted (its replica identity),
//! and an UPDATE's old row decides whether its `old_record` is sent (beyond Supabase,
//! which sends every DELETE's key to every subscriber). Any error in a check denies the
//! subscribers of that check only, is logged and counted.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Statement};

use crate::authorize::check::{CheckOptions, TableCheck, TableOutcome};
use crate::authorize::policy::{ColumnFact, PolicyFact, RoleTableFacts};
use crate::authorize::visibility;
use crate::catalog::change::{freshness, Freshness, Notice, TableState, View};
pub use crate::catalog::facts::{Access, TableInfo};
use crate::catalog::read::{self, CatalogCache};
use crate::error::RealtimeError;
use crate::telemetry;
use walcast_core::sql::qualified;

mod connections;

use connections::{Lane, Urls};

/// How long a read may wait for a statement already decoded to become visible.
const VISIBLE_WAIT: Duration = Duration::from_secs(2);

pub struct RlsChecker {
    /// walcast's own login: the catalog, and the current-row comparisons.
    database_url: String,
    /// The check login ([`walcast_control::check_login`]): every statement run as a subscriber.
    check_url: String,
    client: Option<Client>,
    /// Transactions known to be visible to new snapshots (the last batch's).
    visible_xids: HashSet<u32>,
    /// Transactions decoded (whatever tables they wrote) since the last wait: the next
    /// check waits until they are all visible (see [`RlsChecker::wait_visible`]).
    decoded: Vec<u32>,
    /// Connections that run checks (`client` reads the catalog).
    lanes: Vec<Lane>,
    /// Table and privilege facts, valid at one view of the catalog.
    cache: CatalogCache,
    /// Prepared statements of `client`.
    catalog_statements: HashMap<&'static str, Statement>,
}

/// Per (table, role): RLS enabled, forced, the role bypasses it (superuser or
/// `BYPASSRLS`), the role has the owner's privileges (as Postgres's `check_enable_rls`).
/// `$1`: qualified table names, `$2`: role names, pairwise.
const ROLE_FACTS_SQL: &str = "
SELECT q.n, c.relrowsecurity, c.relforcerowsecurity, r.rolsuper OR r.rolbypassrls,
       pg_has_role(r.oid, c.relowner, 'USAGE')
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS q(rel, role, n)
  JOIN pg_class c ON c.oid = to_regclass(q.rel)
  JOIN pg_roles r ON r.rolname = q.role";

/// Per (table, role): the policies for SELECT or ALL whose roles include PUBLIC (0) or a
/// role whose privileges the role has (as Postgres's `check_role_for_policy`), by name,
/// with their `USING` expression and the columns they read (`pg_depend`: every column
/// their expressions name, whole-row references aside).
const POLICIES_SQL: &str = "
SELECT q.n, p.polname::text, p.polpermissive, pg_get_expr(p.polqual, p.polrelid),
       coalesce(d.names, '{}'), coalesce(d.types, '{}'), coalesce(d.nan, '{}')
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS q(rel, role, n)
  JOIN pg_roles r ON r.rolname = q.role
  JOIN pg_policy p ON p.polrelid = to_regclass(q.rel)
  LEFT JOIN LATERAL (
       SELECT array_agg(a.attname::text ORDER BY a.attnum) AS names,
              array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum) AS types,
              array_agg(a.atttypid IN ('numeric'::regtype, 'real'::regtype,
                                       'double precision'::regtype) ORDER BY a.attnum) AS nan
         FROM pg_depend dep
         JOIN pg_attribute a ON a.attrelid = dep.refobjid AND a.attnum = dep.refobjsubid
        WHERE dep.classid = 'pg_policy'::regclass AND dep.objid = p.oid
          AND dep.refclassid = 'pg_class'::regclass AND dep.refobjid = p.polrelid
          AND dep.refobjsubid > 0 AND NOT a.attisdropped) d ON true
 WHERE p.polcmd IN ('r', '*')
   AND EXISTS (SELECT FROM unnest(p.polroles) AS pr(oid)
                WHERE CASE WHEN pr.oid = 0 THEN true
                           ELSE pg_has_role(r.oid, pr.oid, 'USAGE') END)
 ORDER BY q.n, p.polname";

/// `$1 < epoch <= $2` all logged and none touching a table of `$3`/`$4` (schema, table
/// pairs) or every table (see `walcast-control/sql/0015_catalog_log.sql`).
const UNTOUCHED_SQL: &str = "
SELECT count(*) = $2::int8 - $1::int8
   AND NOT coalesce(bool_or(l.tables IS NULL OR EXISTS (
        SELECT FROM jsonb_array_elements(l.tables) t
          JOIN unnest($3::text[], $4::text[]) AS q(s, n)
            ON t->>'schema' = q.s AND t->>'table' = q.n)), false)
  FROM walcast.catalog_log l
 WHERE l.epoch > $1::int8 AND l.epoch <= $2::int8";

impl RlsChecker {
    /// `parallel`: connections a large batch's checks are spread over. Checks run on
    /// `check_url`'s login, the catalog is read on `database_url`'s.
    pub fn new(database_url: String, check_url: String, parallel: usize) -> RlsChecker {
        RlsChecker {
            database_url,
            check_url,
            client: None,
            visible_xids: HashSet::new(),
            decoded: Vec::new(),
            lanes: (0..parallel.max(1)).map(|_| Lane::default()).collect(),
            cache: CatalogCache::default(),
            catalog_statements: HashMap::new(),
        }
    }

    /// The catalog connection. Its `search_path` is empty, so that type names and policy
    /// expressions read through it name every schema: they mean the same in the checks,
    /// whatever role (and so `$user` schema) those run as.
    async fn client(&mut self) -> Result<&Client, RealtimeError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let client = walcast_pgtls::connect(&self.database_url).await?;
            client.batch_execute("SET search_path = ''").await?;
            self.client = Some(client);
            self.catalog_statements.clear();
        }
        match self.client.as_ref() {
            Some(c) => Ok(c),
            None => Err(RealtimeError::RlsUnavailable(
                "the checker's connection was not kept",
            )),
        }
    }

    /// Judge the next batch at `view` (see [`crate::catalog::change`]).
    pub fn set_view(&mut self, view: View) {
        self.cache.set_view(view);
    }

    /// At start: judge at `view`, knowing the table states carried before it.
    pub fn seed(&mut self, view: View, states: &[TableState]) {
        self.cache.seed(view, states);
    }

    /// A notice was decoded: the position moves to `to`.
    pub fn on_notice(&mut self, notice: &Notice, to: View) {
        self.cache.on_notice(notice, to);
    }

    /// Keep a read made in a snapshot with this epoch? `Ok(false)`: read again (a
    /// statement already decoded is not visible yet); an error when the snapshot shows
    /// a later statement than the position, or still an earlier one after a while.
    fn settle(&self, epoch: Option<i64>, since: Instant) -> Result<bool, RealtimeError> {
        let view = self.cache.view();
        match freshness(view, epoch) {
            Freshness::Exact => Ok(true),
            Freshness::Behind if since.elapsed() < VISIBLE_WAIT => Ok(false),
            f => {
                // Counted where it is given up on (a carried state may stand in).
                Err(RealtimeError::CatalogMoved {
                    view: format!("{view:?}"),
                    snapshot: epoch,
                    ahead: f == Freshness::Ahead,
                })
            }
        }
    }

    /// [`RlsChecker::settle`], and a snapshot ahead of the position is kept when no
    /// epoch in between touched `tables` (DDL on other tables, say a burst of enables,
    /// keeps the catalog ahead of the stream without changing these facts).
    async fn accept(
        &mut self,
        epoch: Option<i64>,
        since: Instant,
        tables: &[(&str, &str)],
    ) -> Result<bool, RealtimeError> {
        let moved = match self.settle(epoch, since) {
            Err(e @ RealtimeError::CatalogMoved { ahead: true, .. }) => e,
            other => return other,
        };
        let (View::Epoch(Some(from)), Some(to)) = (self.cache.view(), epoch) else {
            return Err(moved);
        };
        match self.untouched(from, to, tables).await {
            Ok(true) => {
                metrics::counter!(telemetry::CATALOG_AHEAD_KEPT).increment(1);
                Ok(true)
            }
            Ok(false) => Err(moved),
            Err(e) => {
                // Not knowing is as not kept: what depends on it is withheld.
                tracing::warn!(error = %e, "cannot read walcast.catalog_log");
                Err(moved)
            }
        }
    }

    /// Every epoch in `(from, to]` is logged (`walcast.catalog_log`) and none touched
    /// these tables (nor every table).
    async fn untouched(
        &mut self,
        from: i64,
        to: i64,
        tables: &[(&str, &str)],
    ) -> Result<bool, RealtimeError> {
        let schemas: Vec<&str> = tables.iter().map(|(s, _)| *s).collect();
        let names: Vec<&str> = tables.iter().map(|(_, t)| *t).collect();
        let stmt = self.catalog_statement(UNTOUCHED_SQL).await?;
        let client = self.client().await?;
        let row = client
            .query_one(&stmt, &[&from, &to, &schemas, &names])
            .await
            .inspect_err(|_| self.client = None)?;
        Ok(row.try_get(0)?)
    }

    fn tracks_epoch(&self) -> bool {
        matches!(self.cache.view(), View::Epoch(Some(_)))
    }

    /// Is RLS enabled on the table, what are its key and its columns, at the view?
    pub async fn table(&mut self, schema: &str, table: &str) -> Result<TableInfo, RealtimeError> {
        if let Some(info) = self.cache.table(schema, table) {
            return Ok(info);
        }
        let since = Instant::now();
        let epoch = self.tracks_epoch();
        loop {
            let client = self.client().await?;
            let read = read::read_table(client, schema, table, epoch).await;
            let (info, n) = read.inspect_err(|_| self.client = None)?;
            match self.accept(n, since, &[(schema, table)]).await {
                Ok(true) => {
                    self.cache.put_table(schema, table, info.clone());
                    return Ok(info);
                }
                Ok(false) => {}
                Err(e) => return carried_or(self.cache.carried_table(schema, table), e),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The columns `role` may SELECT at the view (None: not the table at all, or no
    /// such role).
    pub async fn access(
        &mut self,
        role: &str,
        schema: &str,
        table: &str,
    ) -> Result<Option<Access>, RealtimeError> {
        if let Some(access) = self.cache.access(role, schema, table) {
            return Ok(access);
        }
        let since = Instant::now();
        let epoch = self.tracks_epoch();
        loop {
            let client = self.client().await?;
            let read = read::read_access(client, role, schema, table, epoch).await;
            let (access, n) = read.inspect_err(|_| self.client = None)?;
            match self.accept(n, since, &[(schema, table)]).await {
                Ok(true) => {
                    self.cache.put_access(role, schema, table, access.clone());
                    return Ok(access);
                }
                Ok(false) => {}
                Err(e) => {
                    return carried_or(self.cache.carried_access(role, schema, table), e);
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// What each (schema, table, role) is subject to for `SELECT`, read now: never cached,
    /// so a policy, an owner, a membership or the RLS switches changed by DDL apply from
    /// the next batch on. `None`: no such table or role. Two statements, one round trip.
    pub async fn role_facts(
        &mut self,
        pairs: &[(String, String, String)],
    ) -> Result<Vec<Option<RoleTableFacts>>, RealtimeError> {
        let rels: Vec<String> = pairs.iter().map(|(s, t, _)| qualified(s, t)).collect();
        let roles: Vec<&str> = pairs.iter().map(|(_, _, r)| r.as_str()).collect();
        let facts_stmt = self.catalog_statement(ROLE_FACTS_SQL).await?;
        let policies_stmt = self.catalog_statement(POLICIES_SQL).await?;
        let since = Instant::now();
        let epoch = self.tracks_epoch();
        // In one snapshot with the epoch: policies, owners and switches as of the batch.
        let (facts, policies) = loop {
            let client = self.client().await?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&rels, &roles];
            let reads = futures_util::future::try_join(
                client.query(&facts_stmt, &params),
                client.query(&policies_stmt, &params),
            );
            let read = read::in_snapshot(client, epoch, reads).await;
            let (rows, n) = read.inspect_err(|_| self.client = None)?;
            let tables: Vec<(&str, &str)> = pairs
                .iter()
                .map(|(s, t, _)| (s.as_str(), t.as_str()))
                .collect();
            match self.accept(n, since, &tables).await {
                Ok(true) => break rows,
                Ok(false) => {}
                Err(e) => return carried_or(None, e),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let mut out: Vec<Option<RoleTableFacts>> = vec![None; pairs.len()];
        for r in &facts {
            let n: i64 = r.try_get(0)?;
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| out.get_mut(i)) {
                *slot = Some(RoleTableFacts {
                    enabled: r.try_get(1)?,
                    forced: r.try_get(2)?,
                    bypass: r.try_get(3)?,
                    owner: r.try_get(4)?,
                    policies: Vec::new(),
                });
            }
        }
        for r in &policies {
            let n: i64 = r.try_get(0)?;
            let names: Vec<String> = r.try_get(4)?;
            let types: Vec<String> = r.try_get(5)?;
            let nan: Vec<bool> = r.try_get(6)?;
            let policy = PolicyFact {
                name: r.try_get(1)?,
                permissive: r.try_get(2)?,
                using: r.try_get(3)?,
                columns: names
                    .into_iter()
                    .zip(types)
                    .zip(nan)
                    .map(|((name, ty), nan_as_null)| ColumnFact {
                        name,
                        ty,
                        nan_as_null,
                    })
                    .collect(),
            };
            let slot = usize::try_from(n - 1).ok().and_then(|i| out.get_mut(i));
            if let Some(Some(facts)) = slot {
                facts.policies.push(policy);
            }
        }
        Ok(out)
    }

    /// A statement of the catalog connection, prepared once per connection.
    async fn catalog_statement(&mut self, sql: &'static str) -> Result<Statement, RealtimeError> {
        if let Some(s) = self
            .catalog_statements
            .get(sql)
            .filter(|_| self.client.as_ref().is_some_and(|c| !c.is_closed()))
        {
            return Ok(s.clone());
        }
        let stmt = self.client().await?.prepare(sql).await?;
        self.catalog_statements.insert(sql, stmt.clone());
        Ok(stmt)
    }

    /// A transaction was decoded: its commit is in the WAL, before the changes of every
    /// later batch. Checks from now on wait until it is visible (see
    /// [`RlsChecker::wait_visible`]).
    pub fn decoded(&mut self, xid: u32) {
        if !self.visible_xids.contains(&xid) {
            self.decoded.push(xid);
        }
    }

    /// Transactions decoded and not yet known to be visible.
    pub fn unconfirmed(&self) -> usize {
        self.decoded.len()
    }

    /// Wait (bounded) until every transaction of `xids` (the batch's) and every one
    /// decoded before them ([`RlsChecker::decoded`]) is visible to new snapshots.
    /// Postgres writes a commit to the WAL (where the slot decodes it) before the
    /// committing backend leaves the process array (where snapshots see it), and
    /// backends leave it in any order: without this, a check could read a state older
    /// than the version it judges, e.g. a membership removed just before (in WAL order)
    /// an item was added to that group, and show the item to the removed user. After 2 s
    /// (a commit held by a synchronous standby that does not answer) it checks anyway,
    /// with what snapshots see, and logs it.
    pub async fn wait_visible(&mut self, xids: &[u32]) -> Result<(), RealtimeError> {
        let mut pending: Vec<u32> = xids
            .iter()
            .chain(&self.decoded)
            .filter(|x| !self.visible_xids.contains(x))
            .copied()
            .collect();
        pending.sort_unstable();
        pending.dedup();
        if pending.is_empty() {
            self.decoded.clear();
            return Ok(());
        }
        let deadline = Instant::now() + VISIBLE_WAIT;
        loop {
            let client = self.client().await?;
            let text: String = client
                .query_one("SELECT pg_current_snapshot()::text", &[])
                .await?
                .try_get(0)?;
            let snapshot = visibility::parse_snapshot(&text).ok_or(
                RealtimeError::RlsUnavailable("unreadable pg_current_snapshot()"),
            )?;
            let visible = pending.iter().all(|x| visibility::visible(&snapshot, *x));
            if visible || Instant::now() > deadline {
                if !visible {
                    metrics::counter!(telemetry::RLS_INVISIBLE).increment(1);
                    tracing::warn!(
                        xids = ?pending,
                        "transactions decoded before a check still not visible after 2 s; checking anyway"
                    );
                }
                self.visible_xids = xids.iter().copied().collect();
                self.decoded.clear();
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Run a batch of checks (see [`crate::authorize::check`]) by `opts.deadline`: past
    /// it, the statements running are cancelled on the server, their connections
    /// dropped (each may be mid-transaction) and [`RealtimeError::CheckDeadline`] returned.
    pub async fn check(
        &mut self,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, RealtimeError> {
        let Some(deadline) = opts.deadline else {
            return self.check_now(tables, opts).await;
        };
        let run = self.check_now(tables, opts);
        match tokio::time::timeout_at(deadline.into(), run).await {
            Ok(outcome) => outcome,
            Err(_) => {
                self.abandon_checks();
                Err(RealtimeError::CheckDeadline)
            }
        }
    }

    /// Drop every check connection, cancelling what it runs (in the background).
    fn abandon_checks(&mut self) {
        for lane in &mut self.lanes {
            lane.statements.clear();
            lane.own_statements.clear();
            let check = lane.client.take().map(|c| (&self.check_url, c));
            let own = lane.own.take().map(|c| (&self.database_url, c));
            for (url, client) in check.into_iter().chain(own) {
                let (url, token) = (url.clone(), client.cancel_token());
                tokio::spawn(async move {
                    if let Err(e) = walcast_pgtls::cancel(&url, &token).await {
                        tracing::warn!(error = %e, "cancelling an overdue RLS check failed");
                    }
                });
            }
        }
    }

    /// [`RlsChecker::check`] without a deadline: one round trip on one connection, or,
    /// for many groups, the groups dealt over the checker's connections and run side by
    /// side (each connection in its own snapshot, each group judged entirely on one).
    async fn check_now(
        &mut self,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, RealtimeError> {
        let groups: usize = tables.iter().map(|t| t.groups.len()).sum();
        // Naive mode (not pipelined) stays the straightforward baseline: one connection.
        let n = if groups >= SPLIT_ABOVE_GROUPS && opts.pipelined {
            self.lanes.len().max(1)
        } else {
            1
        };
        let url = Urls {
            check: &self.check_url,
            own: &self.database_url,
        };
        if n == 1 {
            return match self.lanes.first_mut() {
                Some(lane) => lane.check(url, tables, opts).await,
                None => Err(RealtimeError::RlsUnavailable("no lane to check on")),
            };
        }
        // chunk → table → original group indices
        let mut chunks: Vec<Vec<TableCheck>> = (0..n).map(|_| Vec::new()).collect();
        let mut index: Vec<Vec<Vec<usize>>> = (0..n).map(|_| Vec::new()).collect();
        for t in tables {
            for (chunk, idx) in chunks.iter_mut().zip(index.iter_mut()) {
                chunk.push(TableCheck {
                    schema: t.schema.clone(),
                    table: t.table.clone(),
                    pk: t.pk.clone(),
                    columns: t.columns.clone(),
                    versions: Arc::clone(&t.versions),
                    groups: Vec::new(),
                });
                idx.push(Vec::new());
            }
            for (gi, g) in t.groups.iter().enumerate() {
                let k = gi % n;
                if let (Some(c), Some(i)) = (
                    chunks.get_mut(k).and_then(|c| c.last_mut()),
                    index.get_mut(k).and_then(|i| i.last_mut()),
                ) {
                    c.groups.push(g.clone());
                    i.push(gi);
                }
            }
        }
        let outcomes = futures_util::future::join_all(
            self.lanes
                .iter_mut()
                .zip(&chunks)
                .map(|(lane, chunk)| lane.check(url, chunk, opts)),
        )
        .await
        .into_iter()
        .collect::<Result<Vec<_>, RealtimeError>>()?;
        let mut merged: Vec<TableOutcome> = tables
            .iter()
            .map(|t| TableOutcome {
                current_error: None,
                groups: t.groups.iter().map(|_| Err("not checked".into())).collect(),
            })
            .collect();
        for (outcome, idx) in outcomes.into_iter().zip(index) {
            for (m, (o, gidx)) in merged.iter_mut().zip(outcome.into_iter().zip(idx)) {
                if m.current_error.is_none() {
                    m.current_error = o.current_error;
                }
                for (gi, g) in gidx.into_iter().zip(o.groups) {
                    if let Some(slot) = m.groups.get_mut(gi) {
                        *slot = g;
                    }
                }
            }
        }
        Ok(merged)
    }
}

/// The catalog moved past the position: the state the last notice carried for it, if
/// any, else the error (counted: what depends on it is withheld).
fn carried_or<T>(carried: Option<T>, moved: RealtimeError) -> Result<T, RealtimeError> {
    match carried {
        Some(state) => {
            metrics::counter!(telemetry::CATALOG_CARRIED).increment(1);
            Ok(state)
        }
        None => {
            metrics::counter!(telemetry::CATALOG_AHEAD).increment(1);
            Err(moved)
        }
    }
}

/// Below this many groups in a batch, one connection does it all.
const SPLIT_ABOVE_GROUPS: usize = 32;
