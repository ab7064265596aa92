//! The change streams' settings (README "Change streams"), as the worker's options.

use std::time::Duration;

use clap::Args;
use walcast_changes::config::{self as rc, ChangeStreamConfig};
use walcast_changes::snapshot::SnapshotConfig;

/// The change streams' JetStream stream and the consumer storing changes in it.
#[derive(Args, Clone, Debug)]
pub struct ChangeStreamArgs {
    /// Store the changes of the tables enabled with `walcast changes enable` in JetStream
    /// (needs NATS with JetStream; the stream is created at the first such change).
    #[arg(long = "changes-stream-enabled", env = "CHANGES_STREAM_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub changes_enabled: bool,
    /// The JetStream stream (created, or updated to these settings, by each leader).
    #[arg(long = "changes-stream", env = "CHANGES_STREAM", default_value = rc::DEFAULT_CHANGES_STREAM)]
    pub changes_stream: String,
    /// The stream's replicas (1 for a single NATS server, 3 for a cluster).
    #[arg(long = "changes-stream-replicas", env = "CHANGES_STREAM_REPLICAS", default_value_t = rc::DEFAULT_CHANGES_REPLICAS)]
    pub changes_replicas: usize,
    /// How long the stream keeps changes, in seconds.
    #[arg(long = "changes-stream-max-age-secs", env = "CHANGES_STREAM_MAX_AGE_SECS", default_value_t = rc::DEFAULT_CHANGES_MAX_AGE_SECS)]
    pub changes_max_age_secs: u64,
    /// The most bytes the stream keeps (the oldest go first); -1: no limit.
    #[arg(long = "changes-stream-max-bytes", env = "CHANGES_STREAM_MAX_BYTES", default_value_t = rc::DEFAULT_CHANGES_MAX_BYTES, allow_negative_numbers = true)]
    pub changes_max_bytes: i64,
    /// JetStream's duplicate window, in seconds: a replay after a crash or a takeover
    /// within it is dropped by `Nats-Msg-Id`. Must exceed the worst replay.
    #[arg(long = "changes-stream-duplicate-window-secs", env = "CHANGES_STREAM_DUPLICATE_WINDOW_SECS", default_value_t = rc::DEFAULT_CHANGES_DUPLICATE_WINDOW_SECS)]
    pub changes_duplicate_window_secs: u64,
    /// How long to wait for one PubAck before resending, in milliseconds.
    #[arg(long = "changes-stream-ack-timeout-ms", env = "CHANGES_STREAM_ACK_TIMEOUT_MS", default_value_t = rc::DEFAULT_CHANGES_ACK_TIMEOUT_MS)]
    pub changes_ack_timeout_ms: u64,
    /// Changes sent and not yet acknowledged, at most.
    #[arg(long = "changes-stream-max-in-flight", env = "CHANGES_STREAM_MAX_IN_FLIGHT", default_value_t = rc::DEFAULT_CHANGES_MAX_IN_FLIGHT)]
    pub changes_max_in_flight: usize,
    /// Changes handed over and not yet acknowledged, at most: beyond, the change stream
    /// takes no more transactions until JetStream caught up (realtime carries on; the
    /// slot retains the WAL from the change stream's position).
    #[arg(long = "changes-stream-max-queued", env = "CHANGES_STREAM_MAX_QUEUED", default_value_t = rc::DEFAULT_CHANGES_MAX_QUEUED)]
    pub changes_max_queued: usize,
    /// Snapshot rows read per second, at most, per source (`walcast snapshot`); 0: no
    /// limit. Bounds the load a snapshot puts on the database next to its writers.
    #[arg(long = "snapshot-rows-per-sec", env = "SNAPSHOT_ROWS_PER_SEC", default_value_t = walcast_changes::snapshot::DEFAULT_ROWS_PER_SEC)]
    pub snapshot_rows_per_sec: u32,
    /// Rows per snapshot chunk (one short statement between two watermarks).
    #[arg(long = "snapshot-chunk-rows", env = "SNAPSHOT_CHUNK_ROWS", default_value_t = walcast_changes::snapshot::DEFAULT_CHUNK_ROWS)]
    pub snapshot_chunk_rows: u32,
}

impl ChangeStreamArgs {
    /// The consumer's settings (`None` when disabled).
    pub fn to_config(
        &self,
        database_url: &str,
        max_record_bytes: usize,
    ) -> Option<ChangeStreamConfig> {
        if !self.changes_enabled {
            return None;
        }
        let mut c = ChangeStreamConfig::new(database_url);
        c.stream = self.changes_stream.clone();
        c.replicas = self.changes_replicas.max(1);
        c.max_age = Duration::from_secs(self.changes_max_age_secs);
        c.max_bytes = self.changes_max_bytes;
        c.duplicate_window = Duration::from_secs(self.changes_duplicate_window_secs);
        c.ack_timeout = Duration::from_millis(self.changes_ack_timeout_ms.max(1));
        c.max_in_flight = self.changes_max_in_flight.max(1);
        c.max_queued = self.changes_max_queued.max(1);
        c.max_record_bytes = max_record_bytes;
        Some(c)
    }

    /// The snapshotter's settings (snapshots are published on the change stream: none
    /// when it is off).
    pub fn snapshot_config(&self, database_url: &str) -> Option<SnapshotConfig> {
        if !self.changes_enabled {
            return None;
        }
        let mut c = SnapshotConfig::new(database_url);
        c.rows_per_sec = self.snapshot_rows_per_sec;
        c.chunk_rows = self.snapshot_chunk_rows.max(1);
        Some(c)
    }

    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "enabled": self.changes_enabled,
            "stream": self.changes_stream,
            "replicas": self.changes_replicas,
            "max_age_secs": self.changes_max_age_secs,
            "max_bytes": self.changes_max_bytes,
            "duplicate_window_secs": self.changes_duplicate_window_secs,
            "ack_timeout_ms": self.changes_ack_timeout_ms,
            "max_in_flight": self.changes_max_in_flight,
            "max_queued": self.changes_max_queued,
            "snapshot_rows_per_sec": self.snapshot_rows_per_sec,
            "snapshot_chunk_rows": self.snapshot_chunk_rows,
        })
    }
}
