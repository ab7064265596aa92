//! `walcast.snapshots` (`walcast-control/sql/0022_snapshots.sql`): the queue of snapshots and their
//! progress, in the source database, read and written by walcast's own role only.

use tokio_postgres::GenericClient;
use walcast_core::sql::{parse_qualified_name, qualified, NameError};
use walcast_pgtls::db_message;
use walcast_protocol::filter::{Filter, FilterError};

use super::query::{chunk_query, Column, QueryError, Shape};

/// Snapshots queued or running per database, at most (`walcast snapshot start` refuses
/// more).
pub const MAX_ACTIVE: i64 = 100;

/// The longest table name a snapshot is asked for, in bytes (two quoted identifiers of
/// Postgres' 63 bytes each, every quote doubled, fit).
pub const MAX_NAME_BYTES: usize = 300;

/// The longest filter a snapshot is asked for, in bytes.
pub const MAX_FILTER_BYTES: usize = 4_096;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("table {0} does not exist")]
    UnknownTable(String),
    #[error("table {table} has no change stream for project {project:?}: a snapshot is published on the change stream (walcast changes enable {table} --project {project})")]
    NotStreaming { table: String, project: String },
    #[error("filter: {0}")]
    Filter(#[from] FilterError),
    #[error("filter: {}", db_message(.0))]
    FilterValue(#[source] tokio_postgres::Error),
    #[error("table name: {0}")]
    Name(#[from] NameError),
    #[error("the {what} is longer than {max} bytes")]
    TooLong { what: &'static str, max: usize },
    #[error("the {0} has a control character")]
    Control(&'static str),
    #[error("table {table}: {source}")]
    Query {
        table: String,
        #[source]
        source: QueryError,
    },
    #[error("{MAX_ACTIVE} snapshots are queued or running already: wait, or cancel some")]
    QueueFull,
    #[error("a row of {table} is not a JSON object: {source}")]
    Row {
        table: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("connecting to the database: {0}")]
    Connect(String),
}

impl SnapshotError {
    /// Whether reading again cannot help (the snapshot fails): its table, filter or
    /// rows are wrong, or the chunk query fails on its data (a filter value not of its
    /// column's type: class 22) or its definition (class 42).
    pub fn is_permanent(&self) -> bool {
        match self {
            SnapshotError::Db(e) => e
                .code()
                .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("42")),
            SnapshotError::Connect(_) => false,
            _ => true,
        }
    }
}

/// A row of `walcast.snapshots` (the wire form the management API's answers carry too).
pub use walcast_bus::admin::SnapshotRecord as Snapshot;

const COLUMNS: &str = "id, project_id, schema_name, table_name, filter, state, last_key::text,
    rows_done, chunks_done, rows_estimate, error";

fn snapshot(r: &tokio_postgres::Row) -> Snapshot {
    Snapshot {
        id: r.get(0),
        project: r.get(1),
        schema: r.get(2),
        table: r.get(3),
        filter: r.get(4),
        state: r.get(5),
        last_key: r.get(6),
        rows_done: r.get(7),
        chunks_done: r.get(8),
        rows_estimate: r.get(9),
        error: r.get(10),
    }
}

/// Refuse a name or filter longer than its bound, or with a control character (NUL
/// cannot be stored; the others are no part of a real name or filter).
fn bounded(what: &'static str, text: &str, max: usize) -> Result<(), SnapshotError> {
    if text.len() > max {
        return Err(SnapshotError::TooLong { what, max });
    }
    if text.chars().any(char::is_control) {
        return Err(SnapshotError::Control(what));
    }
    Ok(())
}

/// Queue a snapshot of the table named `name` (`table` or `schema.table`, SQL quoting
/// allowed, `public` by default) for `project`: the one entry of `walcast snapshot start`
/// and the management API. Returns its id.
pub async fn start_named(
    client: &mut tokio_postgres::Client,
    project: &str,
    name: &str,
    filter: &str,
) -> Result<i64, SnapshotError> {
    bounded("table name", name, MAX_NAME_BYTES)?;
    bounded("filter", filter, MAX_FILTER_BYTES)?;
    let (schema, table) = parse_qualified_name(name)?;
    start(client, project, &schema, &table, filter).await
}

/// Queue a snapshot of `schema.table` for `project` (whose change stream must be on),
/// under `filter` (checked against the table now). Returns its id. At most
/// [`MAX_ACTIVE`] are queued or running: counted and inserted under a lock on the
/// table, so callers side by side cannot pass the bound together.
pub async fn start(
    client: &mut tokio_postgres::Client,
    project: &str,
    schema: &str,
    table: &str,
    filter: &str,
) -> Result<i64, SnapshotError> {
    let name = qualified(schema, table);
    if !streaming(&*client, project, schema, table).await? {
        return Err(SnapshotError::NotStreaming {
            table: name,
            project: project.to_string(),
        });
    }
    // The filter's values cast to their columns' types (a value that is not fails here,
    // not in the leader): its first row, read as the leader reads (see `READ_SETTINGS`)
    // in a transaction rolled back.
    let probe = client.transaction().await?;
    probe.batch_execute(READ_SETTINGS_LOCAL).await?;
    let shape = shape(&probe, schema, table).await?;
    let query =
        chunk_query(&shape, &Filter::parse(filter)?).map_err(|source| SnapshotError::Query {
            table: name,
            source,
        })?;
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&1i64];
    params.extend(
        query
            .filter_params
            .iter()
            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync)),
    );
    if let Err(e) = probe.query(query.first.as_str(), &params).await {
        return Err(match e.code().is_some_and(|c| c.code().starts_with("22")) {
            true => SnapshotError::FilterValue(e),
            false => SnapshotError::Db(e),
        });
    }
    probe.rollback().await?;
    let tx = client.transaction().await?;
    // Self-conflicting, and no conflict with the leader's row updates (ROW EXCLUSIVE): a
    // start waits only for another start.
    tx.batch_execute("LOCK TABLE walcast.snapshots IN SHARE UPDATE EXCLUSIVE MODE")
        .await?;
    let active: i64 = tx
        .query_one(
            "SELECT count(*) FROM walcast.snapshots WHERE state IN ('queued', 'running')",
            &[],
        )
        .await?
        .get(0);
    if active >= MAX_ACTIVE {
        return Err(SnapshotError::QueueFull);
    }
    let row = tx
        .query_one(
            "INSERT INTO walcast.snapshots (project_id, schema_name, table_name, filter, rows_estimate)
             SELECT $1, $2, $3, $4, greatest(coalesce((
                 SELECT c.reltuples::bigint FROM pg_class c
                  WHERE c.oid = to_regclass(format('%I.%I', $2::text, $3::text))), 0), 0)
             RETURNING id",
            &[&project, &schema, &table, &filter],
        )
        .await?;
    tx.commit().await?;
    Ok(row.get(0))
}

/// Every snapshot (of one project), newest first, at most `limit`.
pub async fn list<C: GenericClient>(
    client: &C,
    project: Option<&str>,
    limit: i64,
) -> Result<Vec<Snapshot>, SnapshotError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM walcast.snapshots
          WHERE $1::text IS NULL OR project_id = $1 ORDER BY id DESC LIMIT $2"
    );
    let rows = client.query(&sql, &[&project, &limit]).await?;
    Ok(rows.iter().map(snapshot).collect())
}

/// Snapshot `id` of `project` (`None`: none of this project, whether or not another
/// project has one).
pub async fn get<C: GenericClient>(
    client: &C,
    project: &str,
    id: i64,
) -> Result<Option<Snapshot>, SnapshotError> {
    let sql = format!("SELECT {COLUMNS} FROM walcast.snapshots WHERE id = $1 AND project_id = $2");
    Ok(client
        .query_opt(&sql, &[&id, &project])
        .await?
        .as_ref()
        .map(snapshot))
}

/// Cancel a queued or running snapshot of `project`; whether it was.
pub async fn cancel<C: GenericClient>(
    client: &C,
    project: &str,
    id: i64,
) -> Result<bool, SnapshotError> {
    let n = client
        .execute(
            "UPDATE walcast.snapshots SET state = 'cancelled', finished_at = now(), updated_at = now()
              WHERE id = $1 AND project_id = $2 AND state IN ('queued', 'running')",
            &[&id, &project],
        )
        .await?;
    Ok(n > 0)
}

/// The snapshot to work on: the running one (resumed), else the oldest queued, now
/// running.
pub async fn next<C: GenericClient>(client: &C) -> Result<Option<Snapshot>, SnapshotError> {
    let sql = format!(
        "UPDATE walcast.snapshots SET state = 'running', updated_at = now(),
                started_at = coalesce(started_at, now())
          WHERE id = (SELECT id FROM walcast.snapshots WHERE state IN ('queued', 'running')
                       ORDER BY state = 'running' DESC, id LIMIT 1)
          RETURNING {COLUMNS}"
    );
    Ok(client.query_opt(&sql, &[]).await?.as_ref().map(snapshot))
}

/// A chunk is stored: its last key and rows. `false`: the snapshot is no longer running
/// (cancelled).
pub async fn progress<C: GenericClient>(
    client: &C,
    id: i64,
    last_key: &str,
    rows: i64,
) -> Result<bool, SnapshotError> {
    let n = client
        .execute(
            "UPDATE walcast.snapshots SET last_key = $2::text::jsonb, rows_done = rows_done + $3,
                    chunks_done = chunks_done + 1, updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&id, &last_key, &rows],
        )
        .await?;
    Ok(n > 0)
}

/// A running snapshot ends (`done` or `failed`).
pub async fn finish<C: GenericClient>(
    client: &C,
    id: i64,
    state: &str,
    error: Option<&str>,
) -> Result<(), SnapshotError> {
    client
        .execute(
            "UPDATE walcast.snapshots SET state = $2, error = $3, finished_at = now(), updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&id, &state, &error],
        )
        .await?;
    Ok(())
}

/// Whether `schema.table` still streams for `project`.
pub async fn streaming<C: GenericClient>(
    client: &C,
    project: &str,
    schema: &str,
    table: &str,
) -> Result<bool, SnapshotError> {
    let row = client
        .query_opt(
            "SELECT 1 FROM walcast.change_stream_tables
              WHERE project_id = $1 AND schema_name = $2 AND table_name = $3",
            &[&project, &schema, &table],
        )
        .await?;
    Ok(row.is_some())
}

/// How a session of walcast's own login reads a tenant's table: with row security off (a
/// policy that would apply is an error, never run as walcast) and an empty `search_path`
/// (no operator or function of the tenant's found by name). The chunk queries
/// ([`super::query`]) cast to no type of the tenant's.
pub const READ_SETTINGS: &str = "SET search_path = ''; SET row_security = off";
const READ_SETTINGS_LOCAL: &str = "SET LOCAL search_path = ''; SET LOCAL row_security = off";

/// The table's columns and primary key, from the catalog, each with what may be done
/// with its values on walcast's own login (see [`super::query`]): its type looked through
/// domains is Postgres's own (`plain`), and the type a bound value may be cast to: that
/// base type, or an enum (or an array of one), whose input is Postgres's own too.
const SHAPE_SQL: &str = "
WITH RECURSIVE c AS (
    SELECT a.attnum, a.attname, a.atttypid, a.atttypmod
      FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = pg_catalog.to_regclass(pg_catalog.format('%I.%I', $1::text, $2::text))
       AND a.attnum > 0 AND NOT a.attisdropped
), base(attnum, ty, typmod, depth) AS (
    SELECT c.attnum, c.atttypid, c.atttypmod, 0 FROM c
    UNION ALL
    SELECT b.attnum, y.typbasetype, y.typtypmod, b.depth + 1
      FROM base b JOIN pg_catalog.pg_type y ON y.oid = b.ty
     WHERE y.typtype = 'd'
), deepest AS (
    SELECT DISTINCT ON (attnum) attnum, ty, typmod FROM base ORDER BY attnum, depth DESC
)
SELECT c.attname::text, t.typname::text, pg_catalog.format_type(c.atttypid, c.atttypmod),
       coalesce((SELECT k.n FROM pg_catalog.unnest(i.indkey::int2[]) WITH ORDINALITY k(att, n)
                  WHERE k.att = c.attnum), 0)::int4,
       b.typnamespace = 'pg_catalog'::regnamespace,
       CASE WHEN b.typnamespace = 'pg_catalog'::regnamespace OR b.typtype = 'e'
                 OR (b.typcategory = 'A' AND e.typtype = 'e')
            THEN pg_catalog.format_type(d.ty, d.typmod) END
  FROM c
  JOIN pg_catalog.pg_type t ON t.oid = c.atttypid
  JOIN deepest d ON d.attnum = c.attnum
  JOIN pg_catalog.pg_type b ON b.oid = d.ty
  LEFT JOIN pg_catalog.pg_type e ON e.oid = b.typelem
  LEFT JOIN pg_catalog.pg_index i
         ON i.indrelid = pg_catalog.to_regclass(pg_catalog.format('%I.%I', $1::text, $2::text))
        AND i.indisprimary
 ORDER BY c.attnum";

/// The table's columns and primary key, from the catalog.
pub async fn shape<C: GenericClient>(
    client: &C,
    schema: &str,
    table: &str,
) -> Result<Shape, SnapshotError> {
    let rows = client.query(SHAPE_SQL, &[&schema, &table]).await?;
    if rows.is_empty() {
        return Err(SnapshotError::UnknownTable(qualified(schema, table)));
    }
    let mut pk: Vec<(i32, String)> = Vec::new();
    let mut columns = Vec::new();
    for r in &rows {
        let name: String = r.get(0);
        let position: i32 = r.get(3);
        if position > 0 {
            pk.push((position, name.clone()));
        }
        columns.push(Column {
            name,
            typname: r.get(1),
            sql_type: r.get(2),
            plain: r.get(4),
            cast_type: r.get(5),
        });
    }
    pk.sort();
    Ok(Shape {
        schema: schema.to_string(),
        table: table.to_string(),
        columns,
        pk: pk.into_iter().map(|(_, n)| n).collect(),
    })
}
