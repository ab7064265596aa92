//! What both sources (SQL polling and the streaming replication protocol) share: the
//! wal2json options, the table filter, the source kinds, and the [`Source`] trait through
//! which the driver reads them.

use std::time::Duration;

use bytes::Bytes;
use walcast_wal2json::{add_tables_and_schemas, Lsn};

pub mod poll;
pub mod stream;

pub use poll::Poller;
pub use stream::{StreamConfig, Streamer};

/// How a source reads the slot (both sources: the stream source uses the slot and the
/// filter refresh; the batch sizes and idle wait are the polling source's).
#[derive(Clone, Debug)]
pub struct ReadConfig {
    pub slot: String,
    pub min_batch: usize,
    pub max_batch: usize,
    pub idle: Duration,
    pub filter_refresh: Duration,
}

/// The wal2json options every source uses (the [`Filter`]'s are appended).
pub const WAL2JSON_OPTIONS: &[(&str, &str)] = &[
    ("format-version", "2"),
    ("include-transaction", "1"),
    ("include-xids", "1"),
    ("include-timestamp", "1"),
    ("include-lsn", "1"),
    ("include-pk", "1"),
    ("include-type-oids", "1"),
    ("include-typmod", "0"),
];

/// The `add-msg-prefixes` value when no consumer wants logical messages (an empty value
/// would let every message through).
const NO_MESSAGES: &str = "walcast.none";

/// What the sources decode: the union of the consumers' tables and whole schemas
/// (`add-tables`) and of their logical-message prefixes (`add-msg-prefixes`). `Display` is the tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    pub tables: String,
    pub messages: String,
}

impl Filter {
    /// The filter of these tables, whole schemas and message prefixes (each sorted,
    /// duplicates once).
    pub fn new(
        mut tables: Vec<(String, String)>,
        mut schemas: Vec<String>,
        mut prefixes: Vec<String>,
    ) -> Filter {
        tables.sort();
        tables.dedup();
        schemas.sort();
        schemas.dedup();
        prefixes.sort();
        prefixes.dedup();
        let messages = match prefixes.is_empty() {
            true => NO_MESSAGES.to_string(),
            false => prefixes.join(","),
        };
        let tables = tables.iter().map(|(s, t)| (s.as_str(), t.as_str()));
        Filter {
            tables: add_tables_and_schemas(tables, schemas.iter().map(String::as_str)),
            messages,
        }
    }

    /// Every wal2json option, this filter's included.
    pub fn options(&self) -> Vec<(&str, &str)> {
        let mut options = WAL2JSON_OPTIONS.to_vec();
        options.push(("add-tables", &self.tables));
        options.push(("add-msg-prefixes", &self.messages));
        options
    }
}

impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.tables)
    }
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

/// What a source yields to the driver.
#[derive(Debug)]
pub enum Input {
    /// One wal2json line, in WAL order.
    Line(Bytes),
    /// Everything before this position was yielded: between transactions it may be
    /// acknowledged (the slot moves through WAL of tables nobody decodes).
    CaughtUp(Lsn),
    /// A point to acknowledge what was handled and do the periodic work (fence, slot
    /// statistics, health, the registry re-check). `busy`: lines were read since the last
    /// one (statistics are refreshed at once); `reply`: the server expects a status even if
    /// nothing advanced.
    Checkpoint { busy: bool, reply: bool },
}

/// Where wal2json lines come from. A source only reads and acknowledges; the control logic
/// (framing, timers, health, fence checks, "every consumer's barrier, then acknowledge")
/// is the driver's.
#[allow(async_fn_in_trait)]
pub trait Source {
    /// Whether consumers' held work is flushed whenever [`Source::next`] waits (streaming:
    /// yes; polling: no, a peek's rows are batched up to the limit and flushed at its end).
    const FLUSH_WHILE_WAITING: bool;

    /// Read after the acknowledged position `from`, decoding only what `filter` names.
    /// Called again, after [`Source::stop`], when the filter changes.
    async fn start(&mut self, from: Lsn, filter: &Filter) -> Result<(), crate::PipelineError>;

    /// The next input. Cancel-safe: the driver drops it to flush or when cancelled.
    async fn next(&mut self) -> Result<Input, crate::PipelineError>;

    /// Tell the server that everything up to `upto` was handled (every consumer's barrier
    /// passed, the fence checked); returns the position it confirmed.
    async fn ack(&mut self, upto: Lsn) -> Result<Lsn, crate::PipelineError>;

    /// Stop reading (before a restart with a new filter, or at the end).
    async fn stop(&mut self);
}
