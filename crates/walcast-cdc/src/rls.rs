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
    /// Prepared statements of this session, by SQL text.
    statements: HashMap<String, Statement>,
    tables: HashMap<(String, String), TableFacts>,
    roles: HashMap<(String, String, String), RoleFacts>,
}

impl RlsChecker {
    pub fn new(database_url: String) -> RlsChecker {
        RlsChecker {
            database_url,
            client: None,
            visible_xids: HashSet::new(),
            statements: HashMap::new(),
            tables: HashMap::new(),
            roles: HashMap::new(),
        }
    }

    async fn client(&mut self) -> Result<&Client, CdcError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.statements.clear();
            let client = crate::connect(&self.database_url).await?;
            // Checks for one role differ only in the claims, which policies read when
            // they run: one generic plan serves them all instead of planning each group.
            // (Postgres re-plans by itself when the role changes.)
            client
                .batch_execute("SET plan_cache_mode = force_generic_plan")
                .await?;
            self.client = Some(client);
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

    /// Run a batch of checks in one round trip (see [`crate::rls_check`]).
    pub async fn check(
        &mut self,
        tables: &[TableCheck],
        opts: &CheckOptions,
    ) -> Result<Vec<TableOutcome>, CdcError> {
        self.client().await?;
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
