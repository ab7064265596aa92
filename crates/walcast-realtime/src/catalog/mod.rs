//! What realtime delivery knows of the database's catalog: the realtime tables
//! (`walcast_control::tables`), column types (`walcast_pipeline::change_event::TypeCache`), the facts the authorizer reads about a table
//! and a role ([`read`], of the types in [`facts`]), and privilege and schema changes at
//! their WAL position ([`change`]).

pub mod change;
pub mod facts;
pub mod read;

use tokio_postgres::Client;
use walcast_wal2json::Lsn;

use crate::error::RealtimeError;
use walcast_control::tables::{self, TableRef};

/// The periodic re-read of the realtime tables (every `TABLE_FILTER_REFRESH_MS`), a safety net: their
/// edits normally arrive in WAL order and are applied exactly where they happened. The
/// table is read, then the WAL position; only when the source has acknowledged past
/// that position (so every edit visible in the read was decoded) does a difference mean
/// drift. Returns the tables to adopt in that case.
pub async fn tables_drift(
    client: &Client,
    decoded: &[TableRef],
    confirmed: Lsn,
) -> Result<Option<Vec<TableRef>>, RealtimeError> {
    // Tables dropped while no sql_drop trigger ran leave the realtime tables (in WAL order).
    change::prune_dropped(client).await?;
    let tables = tables::list(client, None).await?;
    let at: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let at: Lsn = at.parse().unwrap_or(Lsn(u64::MAX));
    if confirmed < at || tables.as_slice() == decoded {
        return Ok(None);
    }
    tracing::warn!("realtime tables differ from the decoded state; reloading it");
    Ok(Some(tables))
}
