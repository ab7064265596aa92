//! What the authorizer reads from the catalog about a table and a role (its columns and
//! key, its RLS switch, the columns a role may `SELECT`), each read in one
//! `REPEATABLE READ` snapshot together with the catalog epoch, and the cache of those
//! facts, valid for one [`View`] only (see [`crate::catalog::change`]): with the event
//! triggers, until the next notice that can have changed them; without, for one batch;
//! and never longer than [`ROLE_CHANGES_WITHIN`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use std::sync::Arc;

use crate::catalog::change::{Notice, TableState, View};
use crate::catalog::facts::{Access, TableInfo};
use walcast_core::sql::qualified;

type TableKey = (String, String);
type RoleKey = (String, String, String);

/// The longest a fact is used, whatever the view: roles are global objects that event
/// triggers do not see (`ALTER ROLE … BYPASSRLS`, `GRANT role TO role` change what a
/// role may read without a notice), so those changes apply within this long.
pub const ROLE_CHANGES_WITHIN: Duration = Duration::from_secs(1);

/// A fact, the view it was read at and when.
type Fact<T> = (View, Instant, T);

/// Facts read at one view.
#[derive(Default)]
pub struct CatalogCache {
    view: Option<View>,
    tables: HashMap<TableKey, Fact<TableInfo>>,
    roles: HashMap<RoleKey, Fact<Option<Access>>>,
    /// Table states carried by the last notice about each table, valid at their view
    /// whatever their age: exact for the table at the position, used when the catalog
    /// has moved on since (role changes after the notice aside).
    carried: HashMap<TableKey, (View, Arc<TableState>)>,
}

/// Is a fact usable at `view`?
fn fresh<T>(fact: &Fact<T>, view: View) -> bool {
    fact.0 == view && fact.1.elapsed() < ROLE_CHANGES_WITHIN
}

impl CatalogCache {
    /// The view facts are used at (`Batch(0)` until one is set).
    pub fn view(&self) -> View {
        self.view.unwrap_or(View::Batch(0))
    }

    /// Judge the next batch at `view`: facts read at another view are no longer used.
    pub fn set_view(&mut self, view: View) {
        if self.view != Some(view) {
            self.view = Some(view);
            self.tables.retain(|_, f| fresh(f, view));
            self.roles.retain(|_, f| fresh(f, view));
            self.carried.retain(|_, (v, _)| *v == view);
        }
    }

    pub fn table(&self, schema: &str, table: &str) -> Option<TableInfo> {
        let key = (schema.to_string(), table.to_string());
        self.tables
            .get(&key)
            .filter(|f| fresh(f, self.view()))
            .map(|(_, _, info)| info.clone())
    }

    pub fn put_table(&mut self, schema: &str, table: &str, info: TableInfo) {
        let key = (schema.to_string(), table.to_string());
        self.tables.insert(key, (self.view(), Instant::now(), info));
    }

    /// `Some(None)`: known, the role may not read the table.
    pub fn access(&self, role: &str, schema: &str, table: &str) -> Option<Option<Access>> {
        let key = (role.to_string(), schema.to_string(), table.to_string());
        self.roles
            .get(&key)
            .filter(|f| fresh(f, self.view()))
            .map(|(_, _, a)| a.clone())
    }

    pub fn put_access(&mut self, role: &str, schema: &str, table: &str, access: Option<Access>) {
        let key = (role.to_string(), schema.to_string(), table.to_string());
        self.roles
            .insert(key, (self.view(), Instant::now(), access));
    }

    /// A notice moved the position from the current view to `to`: facts of the tables it
    /// may have changed are dropped; the others stay valid at `to` when the epochs follow
    /// each other (nothing else changed in between), else everything is dropped.
    pub fn on_notice(&mut self, notice: &Notice, to: View) {
        let from = self.view();
        let follows = match (from, to) {
            (View::Epoch(Some(a)), View::Epoch(Some(b))) => b == a + 1 || b == a,
            (a, b) => a == b,
        };
        if !follows || notice.tables.is_none() {
            self.tables.clear();
            self.roles.clear();
            self.carried.clear();
        } else {
            self.carried
                .retain(|(s, t), (v, _)| *v == from && !notice.touches(s, t));
            self.carried.values_mut().for_each(|(v, _)| *v = to);
            self.tables
                .retain(|(s, t), (v, _, _)| *v == from && !notice.touches(s, t));
            self.roles
                .retain(|(_, s, t), (v, _, _)| *v == from && !notice.touches(s, t));
            self.tables.values_mut().for_each(|(v, _, _)| *v = to);
            self.roles.values_mut().for_each(|(v, _, _)| *v = to);
        }
        self.view = Some(to);
        notice.states.iter().for_each(|s| self.carry(s));
    }

    /// Judge at `view`, knowing these states (carried by notices before it).
    pub fn seed(&mut self, view: View, states: &[TableState]) {
        self.set_view(view);
        states.iter().for_each(|s| self.carry(s));
    }

    /// A table's state as of the current view: its facts, and kept for when the catalog
    /// has moved on.
    fn carry(&mut self, state: &TableState) {
        self.put_table(&state.schema, &state.table, state.info());
        for role in state.roles.keys() {
            self.put_access(role, &state.schema, &state.table, state.access(role));
        }
        let key = (state.schema.clone(), state.table.clone());
        self.carried
            .insert(key, (self.view(), Arc::new(state.clone())));
    }

    /// The table's facts as the last notice about it carried them, if that notice is
    /// the position's.
    fn carried(&self, schema: &str, table: &str) -> Option<&TableState> {
        let key = (schema.to_string(), table.to_string());
        self.carried
            .get(&key)
            .filter(|(v, _)| *v == self.view())
            .map(|(_, s)| s.as_ref())
    }

    pub fn carried_table(&self, schema: &str, table: &str) -> Option<TableInfo> {
        self.carried(schema, table).map(TableState::info)
    }

    /// `Some(None)`: carried, the role may read nothing.
    pub fn carried_access(&self, role: &str, schema: &str, table: &str) -> Option<Option<Access>> {
        self.carried(schema, table).map(|s| s.access(role))
    }
}

/// Run `reads` in one `REPEATABLE READ READ ONLY` snapshot that first reads the catalog
/// epoch (when `epoch`); always ended, also on an error.
pub(crate) async fn in_snapshot<T, F>(
    client: &Client,
    epoch: bool,
    reads: F,
) -> Result<(T, Option<i64>), tokio_postgres::Error>
where
    F: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
{
    client
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await?;
    let result = async {
        let n = if epoch {
            let row = client
                .query_one("SELECT n FROM walcast.catalog_epoch", &[])
                .await?;
            Some(row.get::<_, i64>(0))
        } else {
            None
        };
        Ok::<_, tokio_postgres::Error>((reads.await?, n))
    }
    .await;
    let end = client.batch_execute("ROLLBACK").await;
    let out = result?;
    end?;
    Ok(out)
}

/// Is RLS enabled on the table, what are its key and its columns? With the epoch of the
/// snapshot they were read in (when `epoch`).
pub async fn read_table(
    client: &Client,
    schema: &str,
    table: &str,
    epoch: bool,
) -> Result<(TableInfo, Option<i64>), tokio_postgres::Error> {
    let rel = qualified(schema, table);
    let reads = async {
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
        let rows = client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod),
                        a.atttypid IN ('numeric'::regtype, 'real'::regtype, 'double precision'::regtype)
                   FROM pg_attribute a
                  WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
                  ORDER BY a.attnum",
                &[&rel],
            )
            .await?;
        let columns = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let nan_as_null: HashSet<String> = rows
            .iter()
            .filter(|r| r.get::<_, bool>(2))
            .map(|r| r.get(0))
            .collect();
        Ok(TableInfo {
            rls,
            pk,
            columns,
            nan_as_null,
        })
    };
    in_snapshot(client, epoch, reads).await
}

/// The columns `role` may SELECT (`None`: not the table at all, or no such role), with
/// the epoch of the snapshot they were read in (when `epoch`).
pub async fn read_access(
    client: &Client,
    role: &str,
    schema: &str,
    table: &str,
    epoch: bool,
) -> Result<(Option<Access>, Option<i64>), tokio_postgres::Error> {
    let rel = qualified(schema, table);
    let reads = async {
        let Some(r) = client
            .query_opt(
                "SELECT rolbypassrls FROM pg_roles WHERE rolname = $1",
                &[&role],
            )
            .await?
        else {
            return Ok(None);
        };
        let bypass_rls: bool = r.get(0);
        let columns: HashSet<String> = client
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
        Ok((!columns.is_empty()).then_some(Access {
            columns,
            bypass_rls,
        }))
    };
    in_snapshot(client, epoch, reads).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::change::NoticeTable;

    fn info(rls: bool) -> TableInfo {
        TableInfo {
            rls,
            ..TableInfo::default()
        }
    }

    fn notice(epoch: i64, tables: Option<&[&str]>) -> Notice {
        Notice {
            epoch: Some(epoch),
            tag: "ALTER TABLE".into(),
            states: Vec::new(),
            tables: tables.map(|ts| {
                ts.iter()
                    .map(|t| NoticeTable {
                        schema: "public".into(),
                        table: t.to_string(),
                        dropped: false,
                    })
                    .collect()
            }),
        }
    }

    fn cache_at(epoch: i64) -> CatalogCache {
        let mut c = CatalogCache::default();
        c.set_view(View::Epoch(Some(epoch)));
        c.put_table("public", "a", info(true));
        c.put_table("public", "b", info(false));
        c.put_access("anon", "public", "a", None);
        c.put_access("anon", "public", "b", None);
        c
    }

    #[test]
    fn a_notice_drops_what_it_names_and_keeps_the_rest() {
        let mut c = cache_at(4);
        c.on_notice(&notice(5, Some(&["a"])), View::Epoch(Some(5)));
        assert!(
            c.table("public", "a").is_none(),
            "the altered table is read again"
        );
        assert!(c.access("anon", "public", "a").is_none());
        assert_eq!(c.table("public", "b").map(|i| i.rls), Some(false));
        assert_eq!(c.access("anon", "public", "b"), Some(None));
    }

    #[test]
    fn a_notice_about_any_table_or_a_gap_drops_everything() {
        let mut c = cache_at(4);
        c.on_notice(&notice(5, None), View::Epoch(Some(5)));
        assert!(c.table("public", "b").is_none(), "GRANT names no table");

        let mut c = cache_at(4);
        // Epoch 5 was never decoded (e.g. a restart in between): nothing is trusted.
        c.on_notice(&notice(6, Some(&["a"])), View::Epoch(Some(6)));
        assert!(c.table("public", "b").is_none());
    }

    fn state(table: &str, anon_columns: &[&str]) -> TableState {
        let mut roles = HashMap::new();
        roles.insert(
            "anon".to_string(),
            crate::catalog::change::RoleState {
                bypass: false,
                columns: anon_columns.iter().map(|c| c.to_string()).collect(),
            },
        );
        TableState {
            schema: "public".into(),
            table: table.into(),
            rls: false,
            pk: vec![("id".into(), "bigint".into())],
            columns: vec![("id".into(), "bigint".into(), false)],
            roles,
        }
    }

    #[test]
    fn a_notice_carries_the_state_at_its_position() {
        let mut c = cache_at(4);
        let mut n = notice(5, None);
        n.states = vec![state("a", &["id", "k"])];
        c.on_notice(&n, View::Epoch(Some(5)));
        // Known without a read, and kept for when the catalog has moved on.
        let anon = c.access("anon", "public", "a").flatten().unwrap();
        assert_eq!(anon.columns.len(), 2);
        assert_eq!(c.access("authenticated", "public", "a"), None, "not cached");
        assert_eq!(
            c.carried_access("authenticated", "public", "a"),
            Some(None),
            "not listed: reads nothing"
        );
        assert!(c.carried_table("public", "a").is_some());
        assert!(
            c.table("public", "b").is_none(),
            "GRANT: every other table read again"
        );
        assert!(c.carried_table("public", "b").is_none());

        // The next notice about the table replaces it; one about another keeps it.
        c.on_notice(&notice(6, Some(&["b"])), View::Epoch(Some(6)));
        assert!(c.carried_table("public", "a").is_some());
        c.on_notice(&notice(7, Some(&["a"])), View::Epoch(Some(7)));
        assert!(c.carried_table("public", "a").is_none());
    }

    #[test]
    fn without_triggers_facts_last_one_batch() {
        let mut c = CatalogCache::default();
        c.set_view(View::Batch(1));
        c.put_table("public", "a", info(true));
        assert!(c.table("public", "a").is_some());
        c.set_view(View::Batch(2));
        assert!(c.table("public", "a").is_none());
    }
}
