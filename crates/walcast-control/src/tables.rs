//! The realtime tables: which tables are streamed, per project (the `walcast.realtime_tables` table).

use tokio_postgres::GenericClient;

pub use crate::error::RealtimeTablesError;

use walcast_core::sql::qualified;

/// The realtime tables' own table, always in the decoder's table filter (see the migration).
pub const TABLES_SCHEMA: &str = "walcast";
pub const TABLES_TABLE: &str = "realtime_tables";
pub use walcast_core::DEFAULT_PROJECT;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableRef {
    pub project: String,
    pub schema: String,
    pub table: String,
}

impl std::fmt::Display for TableRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", qualified(&self.schema, &self.table))
    }
}

/// What [`inspect`] found of an existing plain or partitioned table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inspected {
    pub primary_key: bool,
    pub partitioned: bool,
}

/// Does the table exist (`None` if not), does it have a primary key, is it partitioned?
pub async fn inspect<C: GenericClient>(
    client: &C,
    schema: &str,
    table: &str,
) -> Result<Option<Inspected>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
                    c.relkind = 'p'
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
            &[&schema, &table],
        )
        .await?;
    Ok(row.map(|r| Inspected {
        primary_key: r.get(0),
        partitioned: r.get(1),
    }))
}

/// Refuse a table whose changes could not be streamed: missing, partitioned, or without a
/// primary key (realtime tables and change-stream tables alike).
pub async fn check_streamable<C: GenericClient>(
    client: &C,
    schema: &str,
    table: &str,
) -> Result<(), RealtimeTablesError> {
    let name = qualified(schema, table);
    match inspect(client, schema, table).await? {
        None => Err(RealtimeTablesError::UnknownTable(name)),
        // wal2json has no publish-via-root: a partitioned table's changes would never
        // match its row, so it is refused rather than accepted and left silent.
        Some(t) if t.partitioned => Err(RealtimeTablesError::Partitioned(name)),
        Some(t) if !t.primary_key => Err(RealtimeTablesError::NoPrimaryKey(name)),
        Some(_) => Ok(()),
    }
}

/// Enable streaming of `schema.table` for `project` and set `REPLICA IDENTITY FULL` so
/// UPDATE and DELETE carry the old row. Idempotent; returns whether it was not enabled
/// before.
pub async fn enable<C: GenericClient>(
    client: &C,
    project: &str,
    schema: &str,
    table: &str,
) -> Result<bool, RealtimeTablesError> {
    let name = qualified(schema, table);
    check_streamable(client, schema, table).await?;
    let other = client
        .query_opt(
            "SELECT project_id FROM walcast.realtime_tables
              WHERE schema_name = $1 AND table_name = $2 AND project_id <> $3",
            &[&schema, &table, &project],
        )
        .await?;
    if let Some(row) = other {
        return Err(RealtimeTablesError::OtherProject {
            table: name,
            project: row.get(0),
        });
    }
    client
        .batch_execute(&format!("ALTER TABLE {name} REPLICA IDENTITY FULL"))
        .await?;
    let via = project == DEFAULT_PROJECT && publication_exists(client).await?;
    let n = client
        .execute(
            "INSERT INTO walcast.realtime_tables (project_id, schema_name, table_name, via_publication)
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[&project, &schema, &table, &via],
        )
        .await?;
    if via && !in_publication(client, schema, table).await? {
        client
            .batch_execute(&format!("ALTER PUBLICATION {PUBLICATION} ADD TABLE {name}"))
            .await?;
    }
    Ok(n > 0)
}

pub use walcast_bus::admin::{unreadable_note, API_ROLES};

/// Which of `roles` (those that exist) may not `SELECT` `schema.table`: their subscribers
/// would receive nothing from it.
pub async fn unreadable_by<C: GenericClient>(
    client: &C,
    schema: &str,
    table: &str,
    roles: &[&str],
) -> Result<Vec<String>, tokio_postgres::Error> {
    let roles: Vec<String> = roles.iter().map(|r| r.to_string()).collect();
    let rows = client
        .query(
            "SELECT r.rolname::text FROM pg_roles r, pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = $2 AND r.rolname = ANY($3)
                AND NOT has_table_privilege(r.oid, c.oid, 'SELECT')
              ORDER BY array_position($3, r.rolname::text)",
            &[&schema, &table, &roles],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The publication Supabase apps enable realtime with; for the default project its
/// membership and walcast's realtime tables agree (see `sql/0010_supabase_realtime_publication.sql`).
pub const PUBLICATION: &str = "supabase_realtime";

async fn publication_exists<C: GenericClient>(client: &C) -> Result<bool, RealtimeTablesError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&PUBLICATION],
        )
        .await?;
    Ok(row.get(0))
}

async fn in_publication<C: GenericClient>(
    client: &C,
    schema: &str,
    table: &str,
) -> Result<bool, RealtimeTablesError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                             WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
            &[&PUBLICATION, &schema, &table],
        )
        .await?;
    Ok(row.get(0))
}

/// Stop streaming a table. Returns whether it was enabled.
pub async fn disable<C: GenericClient>(
    client: &C,
    project: &str,
    schema: &str,
    table: &str,
) -> Result<bool, RealtimeTablesError> {
    let n = delete_row(client, "walcast.realtime_tables", project, schema, table).await?;
    if project == DEFAULT_PROJECT && in_publication(client, schema, table).await? {
        let name = qualified(schema, table);
        client
            .batch_execute(&format!(
                "ALTER PUBLICATION {PUBLICATION} DROP TABLE {name}"
            ))
            .await?;
    }
    Ok(n > 0)
}

/// Every enabled table, optionally of one project, sorted.
pub async fn list<C: GenericClient>(
    client: &C,
    project: Option<&str>,
) -> Result<Vec<TableRef>, RealtimeTablesError> {
    list_rows(client, "walcast.realtime_tables", project).await
}

/// Deletes a table's row from one of walcast's per-table catalogs (`catalog`: a constant
/// of ours, never input). Returns how many rows went.
pub async fn delete_row<C: GenericClient>(
    client: &C,
    catalog: &'static str,
    project: &str,
    schema: &str,
    table: &str,
) -> Result<u64, RealtimeTablesError> {
    let sql = format!(
        "DELETE FROM {catalog} WHERE project_id = $1 AND schema_name = $2 AND table_name = $3"
    );
    Ok(client.execute(&sql, &[&project, &schema, &table]).await?)
}

/// The rows of one of walcast's per-table catalogs (`catalog`: a constant of ours),
/// optionally of one project, sorted.
pub async fn list_rows<C: GenericClient>(
    client: &C,
    catalog: &'static str,
    project: Option<&str>,
) -> Result<Vec<TableRef>, RealtimeTablesError> {
    let sql = format!(
        "SELECT project_id, schema_name, table_name FROM {catalog}
          WHERE $1::text IS NULL OR project_id = $1 ORDER BY 1, 2, 3"
    );
    let rows = client.query(&sql, &[&project]).await?;
    Ok(rows
        .iter()
        .map(|r| TableRef {
            project: r.get(0),
            schema: r.get(1),
            table: r.get(2),
        })
        .collect())
}

/// A realtime-tables row (`project_id`, `schema_name`, `table_name`) from decoded columns.
pub fn tables_row(cols: &[walcast_wal2json::Column<'_>]) -> Option<TableRef> {
    let get = |name: &str| {
        cols.iter()
            .find(|c| c.name == name)
            .and_then(|c| c.text())
            .map(|t| t.into_owned())
    };
    Some(TableRef {
        project: get("project_id")?,
        schema: get("schema_name")?,
        table: get("table_name")?,
    })
}

/// The `add-tables` value for the realtime tables alone: every enabled table plus the
/// realtime tables' own table (so their edits arrive in WAL order).
pub fn table_filter(tables: &[TableRef]) -> String {
    let mut names: Vec<(&str, &str)> = tables
        .iter()
        .map(|t| (t.schema.as_str(), t.table.as_str()))
        .collect();
    names.push((TABLES_SCHEMA, TABLES_TABLE));
    names.sort();
    names.dedup();
    walcast_wal2json::add_tables_option(names)
}
