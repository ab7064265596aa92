//! Row-level security, checked as each subscriber.
//!
//! A subscriber receives an INSERT or UPDATE only if a `SELECT` of that row by primary
//! key, run with its JWT `role` as the Postgres role and its claims in
//! `request.jwt.claims` (both set with `set_config(…, true)` and bound parameters, in a
//! transaction that is always rolled back), returns it. Subscribers with the same role and
//! claims share one check. Only columns the role may `SELECT` are sent. A DELETE goes to
//! every subscriber whose role may read the table; with RLS on, its `old_record` holds
//! only the primary key (as with Supabase). Any error in a check denies that subscriber
//! only, is logged and counted.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::sql::qualified;
use crate::CdcError;

/// How long table facts (RLS flag, privileges, key types) are trusted before re-reading.
const CACHE_TTL: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
struct TableFacts {
    rls: bool,
    /// Primary-key columns with their SQL type (`format_type`), in key order.
    pk: Vec<(String, String)>,
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
    /// The last transaction known to be visible to new snapshots.
    visible_xid: Option<u32>,
    tables: HashMap<(String, String), TableFacts>,
    roles: HashMap<(String, String, String), RoleFacts>,
}

impl RlsChecker {
    pub fn new(database_url: String) -> RlsChecker {
        RlsChecker {
            database_url,
            client: None,
            visible_xid: None,
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

    /// Is RLS enabled on the table, and what is its primary key?
    pub async fn table(
        &mut self,
        schema: &str,
        table: &str,
    ) -> Result<(bool, Vec<(String, String)>), CdcError> {
        let key = (schema.to_string(), table.to_string());
        if let Some(f) = self.tables.get(&key).filter(|f| f.at.elapsed() < CACHE_TTL) {
            return Ok((f.rls, f.pk.clone()));
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
            .collect::<Vec<(String, String)>>();
        self.tables.insert(
            key,
            TableFacts {
                rls,
                pk: pk.clone(),
                at: Instant::now(),
            },
        );
        Ok((rls, pk))
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

    /// Wait (bounded) until transaction `xid` is visible to new snapshots. The streaming
    /// source can receive a commit before the committing backend has left the process
    /// array, and a check run in that instant would not see the row yet.
    pub async fn wait_visible(&mut self, xid: u32) -> Result<(), CdcError> {
        if self.visible_xid == Some(xid) {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let client = self.client().await?;
            // The 64-bit id: the epoch of the current snapshot's xmax, one less when the
            // 32-bit id is ahead of xmax's low half (it belongs to the previous epoch).
            let visible: bool = client
                .query_one(
                    "SELECT pg_visible_in_snapshot(
                         ((((pg_snapshot_xmax(s)::text::bigint >> 32)
                            - CASE WHEN $1::bigint > (pg_snapshot_xmax(s)::text::bigint & 4294967295)
                                   THEN 1 ELSE 0 END) << 32) | $1::bigint)::text::xid8, s)
                       FROM pg_current_snapshot() s",
                    &[&i64::from(xid)],
                )
                .await?
                .get(0);
            if visible {
                self.visible_xid = Some(xid);
                return Ok(());
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    xid,
                    "transaction still not visible after 2 s; checking anyway"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Does `SELECT … WHERE pk = values` as `role` with `claims` return the row? Errors
    /// (an unknown role, a policy that raises …) are returned, for the caller to deny.
    pub async fn visible(
        &mut self,
        schema: &str,
        table: &str,
        pk: &[(String, String)],
        values: &[Option<String>],
        role: &str,
        claims: &str,
    ) -> Result<bool, CdcError> {
        let mut sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE ",
            qualified(schema, table)
        );
        for (i, (name, ty)) in pk.iter().enumerate() {
            if i > 0 {
                sql.push_str(" AND ");
            }
            // `ty` is format_type() output from the catalog: valid SQL, not user input.
            sql.push_str(&format!(
                "{} = ${}::text::{}",
                crate::sql::quote_ident(name),
                i + 1,
                ty
            ));
        }
        sql.push(')');
        let client = self.client().await?;
        client.batch_execute("BEGIN").await?;
        let result = async {
            client
                .query_one(
                    "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)",
                    &[&role, &claims],
                )
                .await?;
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = values
                .iter()
                .map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            let row = client.query_one(sql.as_str(), &params).await?;
            Ok::<bool, tokio_postgres::Error>(row.get(0))
        }
        .await;
        // Always rolled back: nothing a check does survives it.
        client.batch_execute("ROLLBACK").await?;
        Ok(result?)
    }
}
