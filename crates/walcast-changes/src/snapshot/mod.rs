//! Snapshots consistent with the change stream (`walcast snapshot`, README "Change
//! streams", docs/design-snapshots.md): a table's current rows published on its change
//! stream as `READ` events, placed in the stream so that a consumer applying by position
//! (`(commit_lsn, seq)`) has no gap and no duplicate at the seam.
//!
//! The DBLog method: the [`runner`] on the source's leader reads the table in primary-key
//! chunks ([`query`]), each in its own short statement between two signed watermarks
//! (`walcast.snapshot` logical messages, [`Watermark`]), and hands the rows in process
//! ([`board`]) to the change-stream consumer (`consumer/`), which drops, at the
//! high watermark, the rows whose key changed between the two and publishes the rest at
//! the high watermark's position. Progress and the resume point are in
//! `walcast.snapshots` ([`store`]).

pub mod board;
pub mod manage;
pub mod query;
pub mod runner;
pub mod store;

use std::time::Duration;

pub use board::Board;
pub use runner::Snapshotter;
pub use store::SnapshotError;

/// The prefix of the watermarks (signed: the driver skips and counts a forged one).
pub const PREFIX: &str = "walcast.snapshot";

/// Default of `SNAPSHOT_ROWS_PER_SEC`.
pub const DEFAULT_ROWS_PER_SEC: u32 = 1_000;
/// Default of `SNAPSHOT_CHUNK_ROWS`.
pub const DEFAULT_CHUNK_ROWS: u32 = 1_000;

/// Which watermark of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mark {
    Low,
    High,
}

/// The body of a watermark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Watermark {
    /// The snapshot's id (`walcast.snapshots`).
    pub id: i64,
    /// The chunk attempt's nonce ([`board::ChunkKey`]).
    pub chunk: u64,
    pub mark: Mark,
}

impl Watermark {
    /// Its board key.
    pub fn key(&self) -> board::ChunkKey {
        (self.id, self.chunk)
    }
}

/// The snapshotter's settings.
#[derive(Clone, Debug)]
pub struct SnapshotConfig {
    /// walcast's role on the source database (`DATABASE_URL`).
    pub database_url: String,
    /// Rows read per second, at most (0: no limit).
    pub rows_per_sec: u32,
    /// Rows per chunk.
    pub chunk_rows: u32,
    /// How long a chunk's rows may take to be stored before it is read again.
    pub ack_timeout: Duration,
    /// How often to look for a queued snapshot.
    pub poll: Duration,
    /// The projects of this source (`None`: all).
    pub projects: Option<std::sync::Arc<walcast_control::source_projects::SourceProjects>>,
}

impl SnapshotConfig {
    pub fn new(database_url: impl Into<String>) -> SnapshotConfig {
        SnapshotConfig {
            database_url: database_url.into(),
            rows_per_sec: DEFAULT_ROWS_PER_SEC,
            chunk_rows: DEFAULT_CHUNK_ROWS,
            ack_timeout: Duration::from_secs(60),
            poll: Duration::from_secs(1),
            projects: None,
        }
    }
}
