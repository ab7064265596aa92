//! What a pipeline is configured with, each default defined once here (the binaries'
//! options use these constants).

use std::time::Duration;

use crate::source::{ReadConfig, SourceKind};

/// The logical replication slot's default name.
pub const DEFAULT_SLOT_NAME: &str = "walcast_cdc_slot";
/// Stream source: how often progress is acknowledged.
pub const DEFAULT_ACK_INTERVAL: Duration = Duration::from_millis(100);
/// Poll source: rows per peek to start with.
pub const DEFAULT_POLL_BATCH: usize = 1000;
/// Poll source: the adaptive peek size's bound.
pub const DEFAULT_POLL_MAX_BATCH: usize = 100_000;
/// Poll source: the wait after an empty peek.
pub const DEFAULT_POLL_IDLE: Duration = Duration::from_millis(100);
/// How often consumers re-check their state (the realtime registry, the outboxes).
pub const DEFAULT_FILTER_REFRESH: Duration = Duration::from_millis(3000);
/// The heartbeat's interval: off (see [`crate::heartbeat`]).
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::ZERO;

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// For the signing key of `walcast.*` messages, and for the consumers' own
    /// connections: `DATABASE_URL`.
    pub database_url: String,
    /// For the slot (preflight, slot management, polling or streaming): a role with
    /// `REPLICATION`; `POSTGRES_REPLICATION_URL`, else `DATABASE_URL`.
    pub replication_url: String,
    /// Which source reads the slot: SQL polling or the streaming protocol.
    pub source: SourceKind,
    /// How either source reads it (slot, batch sizes, idle wait, re-check interval).
    pub read: ReadConfig,
    /// Stream mode: how often progress is acknowledged.
    pub ack_interval: Duration,
    pub allow_unbounded_wal: bool,
    /// The leader writes a heartbeat (a logical message) on the source database this
    /// often, so the slot has a commit of its own to acknowledge (zero: off; see
    /// [`crate::heartbeat`]).
    pub heartbeat: Duration,
    /// This instance's id, sent as `Walcast-Origin`.
    pub origin: String,
    /// The name of the source (database) this pipeline reads, sent as `Walcast-Source`
    /// (see [`walcast_bus::source`]).
    pub source_name: String,
    /// We were elected: a session still reading the slot belongs to a worker that lost
    /// its leadership (typically one that was killed while Postgres still runs its last
    /// query), so terminate it instead of waiting for it.
    pub take_over_slot: bool,
}

impl PipelineConfig {
    /// The defaults, reading the slot [`DEFAULT_SLOT_NAME`] of `database_url` by
    /// streaming.
    pub fn new(database_url: &str) -> PipelineConfig {
        PipelineConfig {
            database_url: database_url.to_string(),
            replication_url: database_url.to_string(),
            source: SourceKind::Stream,
            read: ReadConfig {
                slot: DEFAULT_SLOT_NAME.to_string(),
                min_batch: DEFAULT_POLL_BATCH,
                max_batch: DEFAULT_POLL_MAX_BATCH,
                idle: DEFAULT_POLL_IDLE,
                filter_refresh: DEFAULT_FILTER_REFRESH,
            },
            ack_interval: DEFAULT_ACK_INTERVAL,
            allow_unbounded_wal: false,
            heartbeat: DEFAULT_HEARTBEAT_INTERVAL,
            origin: "walcast".to_string(),
            source_name: walcast_bus::source::DEFAULT_SOURCE.to_string(),
            take_over_slot: false,
        }
    }

    /// For tests against the test kit's throwaway Postgres: slot `slot`, the given
    /// source, short waits.
    pub fn for_test(database_url: &str, slot: &str, source: SourceKind) -> PipelineConfig {
        let mut cfg = PipelineConfig::new(database_url);
        cfg.source = source;
        cfg.read.slot = slot.to_string();
        cfg.read.idle = Duration::from_millis(20);
        cfg.origin = format!("test-{slot}");
        cfg
    }
}
