//! Row-level security, checked as each subscriber.
//!
//! A subscriber receives an INSERT or UPDATE only if a `SELECT` of that row by primary
//! key, run with its JWT `role` as the Postgres role and its claims in
//! `request.jwt.claims` (both set with `set_config(…, true)` and bound parameters, in a
//! transaction that is always rolled back), returns it, *and* the row still holds the
//! change's values in that same snapshot: a change is never judged by a later version of
//! its row (a version that has since been replaced is withheld from RLS-checked
//! subscribers; the newer version is judged on its own). Checks are batched: see
//! [`crate::rls_check`]. Only columns the role may `SELECT` are sent. A DELETE goes to
//! every subscriber whose role may read the table; with RLS on, its `old_record` holds
//! only the primary key (as with Supabase). Any error in a check denies the subscribers
//! of that check only, is logged and counted.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Statement};

use crate::rls_check::{run_checks, CheckOptions, TableCheck, TableOutcome};
use crate::rls_sql::CatalogColumn;
use crate::sql::qualified;
use crate::CdcError;

/// How long table facts (RLS flag, privileges, key types) are trusted before re-reading.
const CACHE_TTL: Duration = Duration::from_secs(5);

/// What the catalog says about a streamed table.
#[derive(Clone, Debug, Default)]
pub struct TableInfo {
    /// Row-level security is enabled.
    pub rls: bool,
    /// Primary-key columns with their SQL type (`format_type`), in key order.
    pub pk: Vec<CatalogColumn>,
    /// Every column with its SQL type, in table order.
    pub columns: Vec<CatalogColumn>,
}

#[derive(Clone, Debug)]
struct TableFacts {
    info: TableInfo,
    at: Instant,
}

#[derive(Clone, Debug)]
struct RoleFacts {
    /// `None`: the role cannot read the table at all (or does not exist).
    columns: Option<HashSet<String>>,
    bypass_rls: bool,
    at: Instant,
}

/// What a role may see of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub columns: HashSet<String>,
    pub bypass_rls: bool,
}

pub struct RlsChecker {
    database_url: String,
    client: Option<Client>,
    /// Transactions known to be visible to new snapshots (the last batch's).
    visible_xids: HashSet<u32>,
    /// Connections that run checks (`client` reads the catalog).
    lanes: Vec<Lane>,
    tables: HashMap<(String, String), TableFacts>,
    roles: HashMap<(String, String, String), RoleFacts>,
}

impl RlsChecker {
    /// `parallel`: connections a large batch's checks are spread over.
    pub fn new(database_url: String, parallel: usize) -> RlsChecker {
        RlsChecker {
            database_url,
            client: None,
            visible_xids: HashSet::new(),
            lanes: (0..parallel.max(1)).map(|_| Lane::default()).collect(),
            tables: HashMap::new(),
            roles: HashMap::new(),
        }
    }

    async fn client(&mut self) -> Result<&Client, CdcError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = Some(crate::connect(&self.database_url).await?);
        }
        match self.client.as_ref() {
            Some(c) => Ok(c),
            None => Err(CdcError::SlotMissing("rls connection".into())),
        }
    }

    /// Is RLS enabled on the table, what are its key and its columns?
    pub async fn table(&mut self, schema: &str, table: &str) -> Result<TableInfo, CdcError> {
        let key = (schema.to_string(), table.to_string());
        if let Some(f) = self.tables.get(&key).filter(|f| f.at.elapsed() < CACHE_TTL) {
            return Ok(f.info.clone());
        }
        let client = self.client().await?;
        let rel = qualified(schema, table);
        let rls: bool = client
            .query_opt(
                "SELECT relrowsecurity FROM pg_class WHERE oid = to_regclass($1)",
                &[&rel],
            )
            .await?
            .map(|r| r.get(0))
            .unwrap_or(true);
        let pk = client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
                   FROM pg_index i
                   JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, n) ON true
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                  WHERE i.indrelid = to_regclass($1) AND i.indisprimary
                  ORDER BY k.n",
                &[&rel],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let columns = client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
                   FROM pg_attribute a
                  WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
                  ORDER BY a.attnum",
                &[&rel],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let info = TableInfo { rls, pk, columns };
        self.tables.insert(
            key,
            TableFacts {
                info: info.clone(),
                at: Instant::now(),
            },
        );
        Ok(info)
    }

    /// The columns `role` may SELECT (None: not the table at all, or no such role).
    pub async fn access(
        &mut self,
        role: &str,
        schema: &str,
        table: &str,
    ) -> Result<Option<Access>, CdcError> {
        let key = (role.to_string(), schema.to_string(), table.to_string());
        if let Some(f) = self.roles.get(&key).filter(|f| f.at.elapsed() < CACHE_TTL) {
            return Ok(f.columns.clone().map(|columns| Access {
                columns,
                bypass_rls: f.bypass_rls,
            }));
        }
        let client = self.client().await?;
        let rel = qualified(schema, table);
        let exists = client
            .query_opt(
                "SELECT rolbypassrls FROM pg_roles WHERE rolname = $1",
                &[&role],
            )
            .await?;
        let (columns, bypass_rls) = match exists {
            None => (None, false),
            Some(r) => {
                let bypass: bool = r.get(0);
                let cols: Vec<String> = client
                    .query(
                        "SELECT a.attname::text FROM pg_attribute a
                          WHERE a.attrelid = to_regclass($2) AND a.attnum > 0 AND NOT a.attisdropped
                            AND has_column_privilege($1, a.attrelid, a.attnum, 'SELECT')",
                        &[&role, &rel],
                    )
                    .await?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                (
                    (!cols.is_empty()).then(|| cols.into_iter().collect()),
                    bypass,
                )
            }
        };
        self.roles.insert(
            key,
            RoleFacts {
                columns: columns.clone(),
                bypass_rls,
                at: Instant::now(),
            },
        );
        Ok(columns.map(|columns| Access {
            columns,
            bypass_rls,
        }))
    }

    /// Wait (bounded) until every transaction of `xids` is visible to new snapshots. The
    /// streaming source can receive a commit before the committing backend has left the
    /// process array, and a check run in that instant would not see the row yet.
    pub async fn wait_visible(&mut self, xids: &[u32]) -> Result<(), CdcError> {
        let mut pending: Vec<i64> = xids
            .iter()
            .filter(|x| !self.visible_xids.contains(x))
            .map(|x| i64::from(*x))
            .collect();
        pending.sort_unstable();
        pending.dedup();
        if pending.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let client = self.client().await?;
            // The 64-bit id: the epoch of the current snapshot's xmax, one less when the
            // 32-bit id is ahead of xmax's low half (it belongs to the previous epoch).
            let visible: bool = client
                .query_one(
                    "SELECT coalesce(bool_and(pg_visible_in_snapshot(
                         ((((pg_snapshot_xmax(s)::text::bigint >> 32)
                            - CASE WHEN x > (pg_snapshot_xmax(s)::text::bigint & 4294967295)
                                   THEN 1 ELSE 0 END) << 32) | x)::text::xid8, s)), true)
                       FROM pg_current_snapshot() s, unnest($1::bigint[]) x",
                    &[&pending],
                )
                .await?
                .get(0);
            if visible {
                self.visible_xids = xids.iter().copied().collect();
                return Ok(());
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    xids = ?pending,
                    "transactions still not visible after 2 s; checking anyway"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Run a batch of checks (see [`crate::rls_check`]): one round trip on one
    /// connection, or, for many groups, the groups dealt over the checker's connections
    /// and run side by side (each connection in its own snapshot, with its own version
    /// statement; a row counts as unchanged only if it is in every snapshot).
    pub async fn check(
        &mut self,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, CdcError> {
        let groups: usize = tables.iter().map(|t| t.groups.len()).sum();
        // Naive mode (not pipelined) stays the straightforward baseline: one connection.
        let n = if groups >= SPLIT_ABOVE_GROUPS && opts.pipelined {
            self.lanes.len().max(1)
        } else {
            1
        };
        let url = self.database_url.as_str();
        if n == 1 {
            return match self.lanes.first_mut() {
                Some(lane) => lane.check(url, tables, opts).await,
                None => Err(CdcError::SlotMissing("rls connection".into())),
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
                    compare: t.compare.clone(),
                    rows: t.rows.clone(),
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
        .collect::<Result<Vec<_>, CdcError>>()?;
        let mut merged: Vec<TableOutcome> = tables
            .iter()
            .map(|t| TableOutcome {
                current: Ok(HashSet::new()),
                groups: t.groups.iter().map(|_| Err("not checked".into())).collect(),
            })
            .collect();
        for (k, (outcome, idx)) in outcomes.into_iter().zip(index).enumerate() {
            for (ti, (o, gidx)) in outcome.into_iter().zip(idx).enumerate() {
                let Some(m) = merged.get_mut(ti) else {
                    continue;
                };
                m.current = match (
                    std::mem::replace(&mut m.current, Ok(HashSet::new())),
                    o.current,
                ) {
                    (Err(e), _) | (_, Err(e)) => Err(e),
                    (Ok(_), Ok(c)) if k == 0 => Ok(c),
                    (Ok(a), Ok(b)) => Ok(a.intersection(&b).copied().collect()),
                };
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

/// Below this many groups in a batch, one connection does it all.
const SPLIT_ABOVE_GROUPS: usize = 32;

/// One connection that runs checks, with its prepared statements.
#[derive(Default)]
struct Lane {
    client: Option<Client>,
    statements: HashMap<String, Statement>,
}

impl Lane {
    async fn check(
        &mut self,
        url: &str,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, CdcError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.statements.clear();
            self.client = Some(check_connection(url).await?);
        }
        let result = match self.client.as_ref() {
            Some(client) => {
                let fast = CheckOptions {
                    isolate: false,
                    ..opts.clone()
                };
                match run_checks(client, &mut self.statements, tables, &fast).await {
                    Ok(out) if out.iter().all(TableOutcome::all_ok) => Ok(out),
                    // Something failed and took the rest of the batch with it: again,
                    // with every statement in its own savepoint.
                    Ok(_) => {
                        let isolated = CheckOptions {
                            isolate: true,
                            ..opts.clone()
                        };
                        run_checks(client, &mut self.statements, tables, &isolated).await
                    }
                    Err(e) => Err(e),
                }
            }
            None => Err(CdcError::SlotMissing("rls connection".into())),
        };
        if result.is_err() {
            // The session may be mid-transaction: start over on a fresh one.
            self.client = None;
            self.statements.clear();
        }
        result
    }
}

/// A connection for checks. Checks for one role differ only in the claims, which
/// policies read when they run: one generic plan serves them all instead of planning
/// each group (Postgres re-plans by itself when the role changes).
async fn check_connection(url: &str) -> Result<Client, CdcError> {
    let client = crate::connect(url).await?;
    client
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await?;
    Ok(client)
}
