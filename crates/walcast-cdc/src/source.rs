//! What both sources (SQL polling and the streaming replication protocol) share: the
//! wal2json options, the table filter, and the source kinds.

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_wal2json::Lsn;

use crate::registry::{self, TableRef, REGISTRY_SCHEMA, REGISTRY_TABLE};

/// The wal2json options every source uses (`add-tables` is appended).
pub const WAL2JSON_OPTIONS: &[(&str, &str)] = &[
    ("format-version", "2"),
    ("include-transaction", "1"),
    ("include-xids", "1"),
    ("include-timestamp", "1"),
    ("include-lsn", "1"),
    ("include-pk", "1"),
    ("include-type-oids", "1"),
    ("include-typmod", "0"),
    // Of the logical messages, only the DDL notices (see `catalog_change`).
    ("add-msg-prefixes", crate::catalog_change::NOTICE_PREFIX),
];

/// The `add-tables` value: every enabled table plus our registry (so registry edits
/// arrive in WAL order).
pub fn table_filter(tables: &[TableRef]) -> String {
    let mut names: Vec<(&str, &str)> = tables
        .iter()
        .map(|t| (t.schema.as_str(), t.table.as_str()))
        .collect();
    names.push((REGISTRY_SCHEMA, REGISTRY_TABLE));
    names.sort();
    names.dedup();
    walcast_wal2json::add_tables_option(names)
}

/// Where changes are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// `pg_logical_slot_peek_changes` + `pg_replication_slot_advance` (the reference
    /// design's SQL interface).
    Poll,
    /// `START_REPLICATION` on a replication connection: each WAL record decoded once,
    /// changes pushed as they commit.
    Stream,
}

impl std::str::FromStr for SourceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "poll" => Ok(SourceKind::Poll),
            "stream" => Ok(SourceKind::Stream),
            other => Err(format!(
                "unknown CDC source {other:?} (expected poll or stream)"
            )),
        }
    }
}

impl std::fmt::Display for SourceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SourceKind::Poll => "poll",
            SourceKind::Stream => "stream",
        })
    }
}

/// The periodic registry re-read (every `TABLE_FILTER_REFRESH_MS`), a safety net: registry
/// edits normally arrive in WAL order and are applied exactly where they happened. The
/// registry is read, then the WAL position; only when the source has acknowledged past
/// that position (so every edit visible in the read was decoded) does a difference mean
/// drift. Returns the registry to adopt in that case.
pub async fn registry_drift(
    client: &Client,
    decoded: &[TableRef],
    confirmed: Lsn,
) -> Result<Option<Vec<TableRef>>, crate::CdcError> {
    // Tables dropped while no sql_drop trigger ran leave the registry (in WAL order).
    crate::catalog_change::prune_dropped(client).await?;
    let tables = registry::list(client, None).await?;
    let at: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let at: Lsn = at.parse().unwrap_or(Lsn(u64::MAX));
    if confirmed < at || tables.as_slice() == decoded {
        return Ok(None);
    }
    tracing::warn!("realtime registry differs from the decoded state; reloading it");
    Ok(Some(tables))
}

/// A source of wal2json lines: reads the slot from its confirmed position, hands each line
/// to the [`crate::pipeline::Pipeline`] in WAL order, and acknowledges to Postgres only
/// commit positions whose changes the bus confirmed. Implemented by the poller and the
/// streamer; everything after the line (decode, route, match, publish) is shared.
#[allow(async_fn_in_trait)]
pub trait Source {
    /// Run until cancelled or a failure the caller retries.
    async fn run(self, cancel: &CancellationToken) -> Result<(), crate::CdcError>;
}
