//! The tables whose change stream is on (`walcast.change_stream_tables`, README "Change
//! streams"): enabled and disabled by walcast's own role only (`walcast changes`).

use tokio_postgres::GenericClient;
use walcast_core::sql::qualified;

use walcast_control::tables::{check_streamable, delete_row, list_rows, TableRef};
use walcast_control::RealtimeTablesError;

/// The change-stream tables' own table, always decoded by the change-stream consumer
/// (so an edit takes effect at its WAL position).
pub const STREAMS_SCHEMA: &str = "walcast";
pub const STREAMS_TABLE: &str = "change_stream_tables";

/// Stream `schema.table`'s changes to JetStream for `project` (and set `REPLICA IDENTITY
/// FULL`, so UPDATE and DELETE carry the old row). A table of another project's realtime
/// tables, or already streaming for another project, is refused. Returns whether it was
/// off before.
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
              WHERE schema_name = $1 AND table_name = $2 AND project_id <> $3
             UNION ALL
             SELECT project_id FROM walcast.change_stream_tables
              WHERE schema_name = $1 AND table_name = $2 AND project_id <> $3
             LIMIT 1",
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
    let n = client
        .execute(
            "INSERT INTO walcast.change_stream_tables (project_id, schema_name, table_name)
             VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            &[&project, &schema, &table],
        )
        .await?;
    Ok(n > 0)
}

/// Stop streaming a table. Returns whether it was on.
pub async fn disable<C: GenericClient>(
    client: &C,
    project: &str,
    schema: &str,
    table: &str,
) -> Result<bool, RealtimeTablesError> {
    let n = delete_row(
        client,
        "walcast.change_stream_tables",
        project,
        schema,
        table,
    )
    .await?;
    Ok(n > 0)
}

/// Every streaming table, optionally of one project, sorted.
pub async fn list<C: GenericClient>(
    client: &C,
    project: Option<&str>,
) -> Result<Vec<TableRef>, RealtimeTablesError> {
    list_rows(client, "walcast.change_stream_tables", project).await
}
